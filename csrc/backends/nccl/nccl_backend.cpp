#include "nccl_backend.h"

#include "../../common/bounded_teardown.h"
#include "../../common/gil_release.h"
#include "../../kernels/spin.h"
#include "comm_stream_pool.h"
#include "cuda_completion.h"
#include "fused_copy.h"
#include "nccl_check.h"

#include <ATen/ATen.h>
// Its alignas(hardware_destructive_interference_size) warns under GCC (an ABI
// note about torch's own layout, fixed when torch was built).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winterference-size"
#include <ATen/core/CachingHostAllocator.h>
#pragma GCC diagnostic pop
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace dearcomm {
namespace {

using namespace std::chrono_literals;

// The watchdog's poll period: it only has to notice timeouts and errors (no
// result waits for it), so a coarse period costs nothing.
constexpr auto kWatchdogPoll = 20ms;
// How long the watchdog waits for the training thread to leave an NCCL call
// before it gives up on an orderly abort (Note [Failure]).
constexpr auto kAbortLockWait = 10s;

ncclDataType_t nccl_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return ncclFloat32;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kDouble: return ncclFloat64;
    default: TORCH_CHECK_TYPE(false, "dearcomm: NCCL backend does not communicate ", t.scalar_type());
  }
}

ncclComm_t create_comm(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key, int rank, int world_size) {
  ncclUniqueId id;
  if (rank == 0) {
    DEARCOMM_NCCL_CHECK(ncclGetUniqueId(&id));
    const auto* bytes = reinterpret_cast<const uint8_t*>(&id);
    store->set(key, std::vector<uint8_t>(bytes, bytes + sizeof(id)));
  } else {
    const std::vector<uint8_t> bytes = store->get(key);  // waits for rank 0, up to the store's timeout
    TORCH_CHECK(bytes.size() == sizeof(id), "dearcomm: NCCL unique id under '", key, "' has ", bytes.size(),
                " bytes, expected ", sizeof(id));
    std::memcpy(&id, bytes.data(), sizeof(id));
  }
  ncclComm_t comm = nullptr;
  DEARCOMM_NCCL_CHECK(ncclCommInitRank(&comm, world_size, id, rank));
  return comm;
}

int64_t env_int(const char* name) {
  const char* value = std::getenv(name);
  return value ? std::atoll(value) : 0;
}

OnFailure on_failure_from_environment() {
  const char* value = std::getenv("DEARCOMM_NCCL_FAILURE");
  const std::string mode = value ? value : "terminate";
  TORCH_CHECK_VALUE(mode == "terminate" || mode == "raise",
      "dearcomm: DEARCOMM_NCCL_FAILURE must be 'terminate' (default: end the process when a collective fails or "
      "times out) or 'raise' (abort the communicator and raise at the next call), got '", mode, "'");
  return mode == "raise" ? OnFailure::kRaise : OnFailure::kTerminate;
}

// A collective in flight: wait() orders the compute stream after it.
class NcclPending final : public PendingCollective {
 public:
  NcclPending(std::shared_ptr<void> done, std::shared_ptr<Watchdog> watchdog, c10::DeviceIndex device,
              bool drop_edge, std::shared_ptr<const Stamp> finished)
      : done_(std::move(done)), watchdog_(std::move(watchdog)), device_(device), drop_edge_(drop_edge),
        finished_(std::move(finished)) {}

  std::shared_ptr<const Stamp> finished() const override { return finished_; }

  void wait(std::chrono::milliseconds /*timeout: enforced by the Watchdog*/) override {
    watchdog_->check();
    if (drop_edge_) {
      return;  // DEARCOMM_DEBUG_DROP_EDGE=done: a negative control for the tests
    }
    // E2 of Note [Stream order]: device-side wait, the host goes on. The
    // parameters' device's stream, whatever device is current here.
    const c10::cuda::CUDAGuard guard(device_);
    DEARCOMM_CUDA_CHECK(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(device_).stream(), as_event(done_), 0));
  }

 private:
  std::shared_ptr<void> done_;
  std::shared_ptr<Watchdog> watchdog_;
  c10::DeviceIndex device_;
  bool drop_edge_;
  std::shared_ptr<const Stamp> finished_;
};

// A sum of host integers: the result lands in pinned memory when `done_`
// does. The host polls, as the Watchdog does, and never holds the GIL meanwhile.
class NcclSum final : public PendingSum {
 public:
  NcclSum(at::Tensor host, std::shared_ptr<void> done, std::shared_ptr<Watchdog> watchdog, c10::DeviceIndex device)
      : host_(std::move(host)), done_(std::move(done)), watchdog_(std::move(watchdog)), device_(device) {}

  std::vector<int64_t> result(std::chrono::milliseconds timeout) override {
    const GilRelease no_gil;
    const c10::cuda::CUDAGuard guard(device_);  // no context on the caller's current device
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    CudaCompletion completion(done_);
    std::string error;
    for (;;) {
      watchdog_->check();  // raises a failure the watchdog saw (raise mode)
      const Completion::Status status = completion.poll(&error);
      TORCH_CHECK(status != Completion::Status::kFailed, "the sum of ", host_.numel(),
                  " int64 over the ranks failed: ", error);
      if (status == Completion::Status::kDone) {
        break;
      }
      TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "the sum of ", host_.numel(),
                  " int64 over the ranks did not finish within ", timeout.count(), " ms");
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    const int64_t* summed = host_.data_ptr<int64_t>();
    return std::vector<int64_t>(summed, summed + host_.numel());
  }

 private:
  at::Tensor host_;
  std::shared_ptr<void> done_;
  std::shared_ptr<Watchdog> watchdog_;
  c10::DeviceIndex device_;
};

}  // namespace

NcclDebugOptions NcclDebugOptions::from_environment() {
  NcclDebugOptions options;
  options.stream_delay_cycles = env_int("DEARCOMM_DEBUG_STREAM_DELAY_CYCLES");
  options.compute_delay_cycles = env_int("DEARCOMM_DEBUG_COMPUTE_DELAY_CYCLES");
  if (const char* edge = std::getenv("DEARCOMM_DEBUG_DROP_EDGE")) {
    options.drop_edge = edge;
  }
  TORCH_CHECK_VALUE(options.drop_edge.empty() || options.drop_edge == "ready" || options.drop_edge == "done",
      "dearcomm: DEARCOMM_DEBUG_DROP_EDGE must be 'ready' or 'done', got '", options.drop_edge, "'");
  return options;
}

std::string nccl_version_string() {
  int version = 0;
  DEARCOMM_NCCL_CHECK(ncclGetVersion(&version));
  // NCCL >= 2.9 encodes major*10000 + minor*100 + patch.
  return std::to_string(version / 10000) + "." + std::to_string(version % 10000 / 100) + "." +
         std::to_string(version % 100);
}

NcclBackend::NcclBackend(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key_prefix, int rank,
                         int world_size, c10::DeviceIndex device, std::chrono::milliseconds timeout)
    : rank_(rank),
      world_size_(world_size),
      device_(device),
      timeout_(timeout),
      debug_(NcclDebugOptions::from_environment()),
      on_failure_(on_failure_from_environment()),
      stream_(device),
      events_(make_cuda_event_pool(device)) {
  TORCH_CHECK_VALUE(store, "dearcomm: the NCCL backend needs the process group's store");
  const c10::cuda::CUDAGuard guard(device_);
  if (debug_.stream_delay_cycles > 0 || debug_.compute_delay_cycles > 0) {  // before the communicator: a throw leaks nothing
    void* flag = nullptr;
    DEARCOMM_CUDA_CHECK(cudaHostAlloc(&flag, sizeof(int), cudaHostAllocMapped));
    spin_abort_ = static_cast<volatile int*>(flag);
    *spin_abort_ = 0;
  }
  comm_ = create_comm(store, key_prefix + "/comm", rank, world_size);
  WatchdogHooks hooks;
  // A thread starts on device 0: querying events there would create a
  // context on GPU 0 for every rank (~0.5 GiB each).
  hooks.on_thread_start = [device] { cudaSetDevice(device); };
  hooks.async_error = [comm = comm_]() -> std::string {
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(comm, &async) == ncclSuccess && async != ncclSuccess) {
      return ncclGetErrorString(async);
    }
    return "";
  };
  hooks.on_failure = [this](const std::string& reason) { on_failure(reason); };
  hooks.consequence = "; the NCCL communicator was aborted";  // raise mode; terminate mode never gets to raise
  watchdog_ = std::make_shared<Watchdog>(timeout, kWatchdogPoll, rank, std::move(hooks));
}

void NcclBackend::on_failure(const std::string& reason) {
  if (on_failure_ == OnFailure::kTerminate) {
    // As ProcessGroupNCCL's default (TORCH_NCCL_ASYNC_ERROR_HANDLING=3): end
    // the process without ncclCommAbort, which can itself block behind the
    // stuck work; the driver frees everything with the process.
    std::fprintf(stderr, "dearcomm: [rank %d] %s. Ending the process (DEARCOMM_NCCL_FAILURE=raise raises "
                 "instead).\n", rank_, reason.c_str());
    std::fflush(stderr);
    std::abort();
  }
  {
    // From here on no NCCL call starts on comm_ (enqueue checks aborted_
    // under the same lock), so the abort needs no lock while it runs.
    std::unique_lock<std::timed_mutex> lock(nccl_mutex_, std::defer_lock);
    if (!lock.try_lock_for(kAbortLockWait)) {
      std::fprintf(stderr, "dearcomm: [rank %d] %s; the training thread did not leave an NCCL call within %lld s, "
                   "so the communicator cannot be aborted safely. Ending the process.\n", rank_, reason.c_str(),
                   static_cast<long long>(std::chrono::duration_cast<std::chrono::seconds>(kAbortLockWait).count()));
      std::fflush(stderr);
      std::abort();
    }
    aborted_ = true;
  }
  end_debug_spins();
  // ncclCommAbort waits for work queued before the stuck kernel (it
  // synchronises NCCL's internal stream): on its own thread, so neither the
  // watchdog's stop() nor the backend's teardown waits for it.
  std::thread([comm = comm_] { ncclCommAbort(comm); }).detach();
}

void NcclBackend::end_debug_spins() {
  if (spin_abort_ != nullptr) {
    *spin_abort_ = 1;
  }
}

NcclBackend::~NcclBackend() {
  const GilRelease no_gil;  // teardown may poll for up to the timeout
  const c10::cuda::CUDAGuard guard(device_);
  TeardownSteps steps;
  steps.idle = [this] {
    const cudaError_t state = cudaStreamQuery(stream_.stream());
    return state == cudaSuccess ? Idle::kYes : state == cudaErrorNotReady ? Idle::kNo : Idle::kFailed;
  };
  steps.destroy = [this] { ncclCommDestroy(comm_); };
  steps.abort = [this] {
    end_debug_spins();
    ncclCommAbort(comm_);
  };
  const Teardown outcome = bounded_teardown(*watchdog_, steps, timeout_, kWatchdogPoll);
  if (outcome == Teardown::kAbortedAfterGrace) {
    std::fprintf(stderr, "dearcomm: [rank %d] collectives still in flight %lld ms after the backend was dropped "
                 "(or its stream failed); the NCCL communicator was aborted\n", rank_,
                 static_cast<long long>(timeout_.count()));
  }
  // stream_ goes back to the pool with this object, if idle (Note [Stream lifetime]).
}

std::string NcclBackend::name() const {
  return "nccl " + nccl_version_string();
}

void NcclBackend::check_tensor(const at::Tensor& t, const char* what, const char* role) const {
  TORCH_CHECK_VALUE(t.is_cuda() && t.device().index() == device_, "dearcomm: ", what, " ", role, " is on ",
                    t.device(), ", but this NCCL backend runs on cuda:", static_cast<int>(device_));
  TORCH_CHECK_VALUE(t.is_contiguous(), "dearcomm: ", what, " ", role, " must be contiguous");
  nccl_dtype(t);  // raises for a dtype NCCL does not carry
}

std::unique_ptr<PendingCollective> NcclBackend::enqueue(
    const char* what, const std::vector<at::Tensor>& touched,
    const std::function<ncclResult_t(ncclComm_t, cudaStream_t)>& op, std::shared_ptr<void>* done_out) {
  const c10::cuda::CUDAGuard guard(device_);
  const cudaStream_t compute = c10::cuda::getCurrentCUDAStream(device_).stream();
  watchdog_->check();
  std::lock_guard<std::timed_mutex> lock(nccl_mutex_);  // Note [Failure]: no abort between check and call
  TORCH_CHECK(!aborted_, "dearcomm: [rank ", rank_, "] the NCCL communicator was aborted after a failed or "
              "timed-out collective");
  // E1 of Note [Stream order]: the collective starts after everything the
  // compute stream has enqueued so far (the pack, the optimizer).
  if (debug_.compute_delay_cycles > 0) {
    DEARCOMM_CUDA_CHECK(kernels::spin(debug_.compute_delay_cycles, spin_abort_, compute));
  }
  const std::shared_ptr<void> ready = events_->acquire();
  DEARCOMM_CUDA_CHECK(cudaEventRecord(as_event(ready), compute));
  if (debug_.drop_edge != "ready") {
    DEARCOMM_CUDA_CHECK(cudaStreamWaitEvent(stream_.stream(), as_event(ready), 0));
  }
  for (const at::Tensor& t : touched) {
    // Note [Buffer lifetime]
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream_.get());
  }
  if (debug_.stream_delay_cycles > 0) {
    DEARCOMM_CUDA_CHECK(kernels::spin(debug_.stream_delay_cycles, spin_abort_, stream_.stream()));
  }
  DEARCOMM_NCCL_CHECK(op(comm_, stream_.stream()));
  std::shared_ptr<void> done = events_->acquire();
  DEARCOMM_CUDA_CHECK(cudaEventRecord(as_event(done), stream_.stream()));
  std::shared_ptr<const Stamp> finished;
  if (timing_) {
    std::shared_ptr<void> timed = timing_events()->acquire();
    DEARCOMM_CUDA_CHECK(cudaEventRecord(as_event(timed), stream_.stream()));
    finished = std::make_shared<CudaStamp>(std::move(timed), device_);
  }
  watchdog_->watch(std::make_shared<CudaCompletion>(done), what);
  if (done_out != nullptr) {
    *done_out = done;
  }
  return std::make_unique<NcclPending>(std::move(done), watchdog_, device_, debug_.drop_edge == "done",
                                       std::move(finished));
}

const std::shared_ptr<HandlePool>& NcclBackend::timing_events() {
  if (!timing_events_) {
    timing_events_ = make_cuda_event_pool(device_, /*timing=*/true);
  }
  return timing_events_;
}

std::shared_ptr<const Stamp> NcclBackend::stamp() {
  const c10::cuda::CUDAGuard guard(device_);
  std::shared_ptr<void> event = timing_events()->acquire();
  DEARCOMM_CUDA_CHECK(cudaEventRecord(as_event(event), c10::cuda::getCurrentCUDAStream(device_).stream()));
  return std::make_shared<CudaStamp>(std::move(event), device_);
}

std::unique_ptr<PendingSum> NcclBackend::sum_host(const std::vector<int64_t>& values) {
  const c10::cuda::CUDAGuard guard(device_);
  const int64_t n = static_cast<int64_t>(values.size());
  const auto pinned = at::TensorOptions().dtype(at::kLong).pinned_memory(true);
  at::Tensor staged = at::empty({n}, pinned);
  std::copy(values.begin(), values.end(), staged.data_ptr<int64_t>());
  at::Tensor device = at::empty({n}, at::TensorOptions().dtype(at::kLong).device(at::kCUDA, device_));
  device.copy_(staged, /*non_blocking=*/true);  // on the compute stream, before enqueue's "ready" edge
  at::Tensor result = at::empty({n}, pinned);
  // The pinned result is not handed out again before the copy into it ran,
  // even if this sum is dropped unread.
  at::getHostAllocator(at::kCUDA)->record_event(result.data_ptr(), result.storage().data_ptr().get_context(),
                                                stream_.get().unwrap());
  std::shared_ptr<void> done;
  enqueue("sum of the link figures", {device}, [&](ncclComm_t comm, cudaStream_t stream) {
    const ncclResult_t sum = ncclAllReduce(device.data_ptr(), device.data_ptr(), n, ncclInt64, ncclSum, comm, stream);
    if (sum == ncclSuccess) {
      DEARCOMM_CUDA_CHECK(cudaMemcpyAsync(result.data_ptr(), device.data_ptr(), n * sizeof(int64_t),
                                          cudaMemcpyDeviceToHost, stream));
    }
    return sum;
  }, &done);
  return std::make_unique<NcclSum>(std::move(result), std::move(done), watchdog_, device_);
}

std::unique_ptr<PendingCollective> NcclBackend::reduce_scatter(const at::Tensor& input, const at::Tensor& output) {
  check_tensor(input, "reduce_scatter", "input");
  check_tensor(output, "reduce_scatter", "output");
  TORCH_CHECK_TYPE(input.scalar_type() == output.scalar_type(), "dearcomm: reduce_scatter input is ",
                   input.scalar_type(), " but output is ", output.scalar_type());
  TORCH_CHECK_VALUE(input.numel() == output.numel() * world_size_,
      "dearcomm: reduce_scatter input has ", input.numel(), " elements, expected ", output.numel() * world_size_);
  return enqueue("reduce-scatter", {input, output}, [&](ncclComm_t comm, cudaStream_t stream) {
    return ncclReduceScatter(input.data_ptr(), output.data_ptr(), output.numel(), nccl_dtype(input), ncclSum, comm,
                             stream);
  });
}

std::unique_ptr<PendingCollective> NcclBackend::all_gather(const at::Tensor& input, const at::Tensor& output) {
  check_tensor(input, "all_gather", "input");
  check_tensor(output, "all_gather", "output");
  TORCH_CHECK_TYPE(input.scalar_type() == output.scalar_type(), "dearcomm: all_gather input is ",
                   input.scalar_type(), " but output is ", output.scalar_type());
  TORCH_CHECK_VALUE(output.numel() == input.numel() * world_size_,
      "dearcomm: all_gather output has ", output.numel(), " elements, expected ", input.numel() * world_size_);
  return enqueue("all-gather", {input, output}, [&](ncclComm_t comm, cudaStream_t stream) {
    return ncclAllGather(input.data_ptr(), output.data_ptr(), input.numel(), nccl_dtype(input), comm, stream);
  });
}

std::unique_ptr<PendingCollective> NcclBackend::all_reduce(const at::Tensor& buffer) {
  check_tensor(buffer, "all_reduce", "buffer");
  return enqueue("all-reduce", {buffer}, [&](ncclComm_t comm, cudaStream_t stream) {
    return ncclAllReduce(buffer.data_ptr(), buffer.data_ptr(), buffer.numel(), nccl_dtype(buffer), ncclSum, comm,
                         stream);
  });
}

void NcclBackend::pack(const std::vector<at::Tensor>& sources, const std::vector<int64_t>& offsets,
                       const at::Tensor& flat, double scale) {
  pack_into(sources, offsets, flat, scale);
}

void NcclBackend::unpack(const at::Tensor& flat, const std::vector<int64_t>& offsets,
                         const std::vector<at::Tensor>& destinations) {
  unpack_from(flat, offsets, destinations);
}

}  // namespace dearcomm
