#include "nccl_backend.h"

#include "../../kernels/spin.h"
#include "fused_copy.h"
#include "nccl_check.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdlib>
#include <cstring>

namespace dearcomm {
namespace {

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

// A collective in flight: wait() orders the caller's current stream after it.
class NcclPending final : public PendingCollective {
 public:
  NcclPending(std::shared_ptr<CompletionEvent> done, const Watchdog* watchdog)
      : done_(std::move(done)), watchdog_(watchdog) {}

  void wait(std::chrono::milliseconds /*timeout: enforced by the Watchdog*/) override {
    watchdog_->check();
    // E2 of Note [Stream order]: device-side wait, the host goes on.
    DEARCOMM_CUDA_CHECK(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream().stream(), done_->get(), 0));
  }

 private:
  std::shared_ptr<CompletionEvent> done_;
  const Watchdog* watchdog_;
};

}  // namespace

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
      rs_{nullptr, c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device)},
      ag_{nullptr, c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device)} {
  TORCH_CHECK_VALUE(store, "dearcomm: the NCCL backend needs the process group's store");
  if (const char* delay = std::getenv("DEARCOMM_DEBUG_STREAM_DELAY_CYCLES")) {
    debug_delay_cycles_ = std::atoll(delay);
  }
  const c10::cuda::CUDAGuard guard(device_);
  rs_.comm = create_comm(store, key_prefix + "/reduce_scatter", rank, world_size);
  ag_.comm = create_comm(store, key_prefix + "/all_gather", rank, world_size);
  watchdog_ = std::make_unique<Watchdog>(std::vector<ncclComm_t>{rs_.comm, ag_.comm}, timeout, rank);
}

NcclBackend::~NcclBackend() {
  const bool aborted = watchdog_ && watchdog_->failed();
  watchdog_.reset();
  if (!aborted) {
    // Orderly: let enqueued collectives finish on every rank, then free.
    for (Channel* channel : {&rs_, &ag_}) {
      cudaStreamSynchronize(channel->stream.stream());
      ncclCommDestroy(channel->comm);
    }
  }
}

std::string NcclBackend::name() const {
  return "nccl " + nccl_version_string();
}

std::unique_ptr<PendingCollective> NcclBackend::enqueue(
    Channel& channel, const char* what, const std::vector<at::Tensor>& touched,
    const std::function<ncclResult_t(ncclComm_t, cudaStream_t)>& op) {
  watchdog_->check();
  const c10::cuda::CUDAGuard guard(device_);
  // E1 of Note [Stream order]: the collective starts after everything the
  // caller's stream has enqueued so far (the pack, the optimizer).
  CompletionEvent ready;
  DEARCOMM_CUDA_CHECK(cudaEventRecord(ready.get(), c10::cuda::getCurrentCUDAStream(device_).stream()));
  DEARCOMM_CUDA_CHECK(cudaStreamWaitEvent(channel.stream.stream(), ready.get(), 0));
  for (const at::Tensor& t : touched) {
    // Note [Buffer lifetime]
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), channel.stream);
  }
  if (debug_delay_cycles_ > 0) {
    DEARCOMM_CUDA_CHECK(kernels::spin(debug_delay_cycles_, channel.stream.stream()));
  }
  DEARCOMM_NCCL_CHECK(op(channel.comm, channel.stream.stream()));
  auto done = std::make_shared<CompletionEvent>();
  DEARCOMM_CUDA_CHECK(cudaEventRecord(done->get(), channel.stream.stream()));
  watchdog_->watch(done, what);
  return std::make_unique<NcclPending>(std::move(done), watchdog_.get());
}

std::unique_ptr<PendingCollective> NcclBackend::reduce_scatter(const at::Tensor& input, const at::Tensor& output) {
  TORCH_CHECK(input.numel() == output.numel() * world_size_,
      "dearcomm: reduce_scatter input has ", input.numel(), " elements, expected ", output.numel() * world_size_);
  return enqueue(rs_, "reduce-scatter", {input, output}, [&](ncclComm_t comm, cudaStream_t stream) {
    return ncclReduceScatter(input.data_ptr(), output.data_ptr(), output.numel(), nccl_dtype(input), ncclSum, comm,
                             stream);
  });
}

std::unique_ptr<PendingCollective> NcclBackend::all_gather(const at::Tensor& input, const at::Tensor& output) {
  TORCH_CHECK(output.numel() == input.numel() * world_size_,
      "dearcomm: all_gather output has ", output.numel(), " elements, expected ", input.numel() * world_size_);
  return enqueue(ag_, "all-gather", {input, output}, [&](ncclComm_t comm, cudaStream_t stream) {
    return ncclAllGather(input.data_ptr(), output.data_ptr(), input.numel(), nccl_dtype(input), comm, stream);
  });
}

std::unique_ptr<PendingCollective> NcclBackend::all_reduce(const at::Tensor& buffer) {
  return enqueue(rs_, "all-reduce", {buffer}, [&](ncclComm_t comm, cudaStream_t stream) {
    return ncclAllReduce(buffer.data_ptr(), buffer.data_ptr(), buffer.numel(), nccl_dtype(buffer), ncclSum, comm,
                         stream);
  });
}

void NcclBackend::pack(const std::vector<at::Tensor>& sources, const std::vector<int64_t>& offsets,
                       const at::Tensor& flat, double scale) {
  std::vector<at::Tensor> slots;
  slots.reserve(sources.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    slots.push_back(flat.narrow(0, offsets[i], sources[i].numel()));
  }
  std::vector<at::Tensor> flat_sources;
  flat_sources.reserve(sources.size());
  for (const at::Tensor& s : sources) {
    flat_sources.push_back(s.is_contiguous() ? s.view(-1) : s.contiguous().view(-1));
  }
  fused_copy(flat_sources, slots, scale);
}

void NcclBackend::unpack(const at::Tensor& flat, const std::vector<int64_t>& offsets,
                         const std::vector<at::Tensor>& destinations) {
  std::vector<at::Tensor> slots;
  slots.reserve(destinations.size());
  for (size_t i = 0; i < destinations.size(); ++i) {
    slots.push_back(flat.narrow(0, offsets[i], destinations[i].numel()).view(destinations[i].sizes()));
  }
  fused_copy(slots, destinations);
}

}  // namespace dearcomm
