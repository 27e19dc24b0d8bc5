// NCCL backend: the engine's primitives on GPUs, with dearcomm's own
// communicator and stream, ordered by CUDA events; the host never waits.
//
// One iteration, two lanes (schedule "dear", buckets 0..2 in forward order):
//
//   compute | F0 F1 F2 | B2 pack2 B1 pack1 B0 pack0 | wait RS, /p, opt(shard) | F0 F1 F2 ...
//   comm    |          |      [RS2]      [RS1]    [RS0]  (E1)[AG0] [AG1] [AG2]
//                                                             ^E2 F0 waits ^E2 F1 waits
//
// Note [Stream order] - every cross-stream edge is one CUDA event:
//   E1 compute -> comm stream ("ready"): recorded on the compute stream when a
//      collective is enqueued (after the pack kernel, or after the optimizer
//      wrote the shard), waited by the comm stream before NCCL reads.
//   E2 comm stream -> compute ("done"): recorded after the collective; wait()
//      makes the compute stream wait on it (finish_reductions in step(), a
//      module's forward pre-hook for all-gathers). Never a host synchronize.
// "Compute stream" is the current stream of the backend's device, whatever
// device is current on the calling thread.
// Note [Buffer lifetime] - tensors a collective touches are recorded on its
// stream (recordStream), so the caching allocator never hands their memory out
// while the collective may still read or write it; the stream itself is never
// destroyed (Note [Stream lifetime] in comm_stream_pool.h).
// Note [One communicator] - reduce-scatters and all-gathers never overlap each
// other: step() waits for every reduce-scatter before the first all-gather,
// and the next backward's first reduction waits for every all-gather. So one
// communicator on one (high-priority) stream serves both: a second would only
// add memory, start-up time and the risk of cross-communicator deadlock.
// Note [Failure] - a Watchdog polls each collective's "done" event. On a
// timeout, a CUDA error or an NCCL asynchronous error it ends the process by
// default, as ProcessGroupNCCL does (queued kernels may read garbage, and
// ncclCommAbort can itself block behind the stuck work, so it is skipped).
// DEARCOMM_NCCL_FAILURE=raise keeps the process: the watchdog marks the
// communicator aborted under the lock every NCCL call takes (NCCL forbids
// concurrent calls on one communicator), aborts it on a thread of its own,
// and every later call of the backend raises the failure.
#pragma once

#include "../../common/handle_pool.h"
#include "../../common/watchdog.h"
#include "../../engine/comm_backend.h"
#include "comm_stream_pool.h"

#include <c10/cuda/CUDAStream.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <functional>
#include <mutex>

namespace dearcomm {

std::string nccl_version_string();

// Test switches, read from the environment once per backend. Each must change
// no result while every edge of Note [Stream order] is in place.
struct NcclDebugOptions {
  int64_t stream_delay_cycles = 0;   // DEARCOMM_DEBUG_STREAM_DELAY_CYCLES: spin on the comm stream before each collective
  int64_t compute_delay_cycles = 0;  // DEARCOMM_DEBUG_COMPUTE_DELAY_CYCLES: spin on the compute stream before E1
  std::string drop_edge;             // DEARCOMM_DEBUG_DROP_EDGE=ready|done: a negative control, breaks results
  static NcclDebugOptions from_environment();
};

enum class OnFailure { kTerminate, kRaise };

class NcclBackend final : public CommBackend {
 public:
  // Creates the communicator: rank 0 publishes an NCCL unique id under
  // `key_prefix` in `store`; every rank of the group joins.
  NcclBackend(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key_prefix, int rank,
              int world_size, c10::DeviceIndex device, std::chrono::milliseconds timeout);
  ~NcclBackend() override;  // bounded: see bounded_teardown.h

  std::string name() const override;
  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }

  std::unique_ptr<PendingCollective> reduce_scatter(const at::Tensor& input, const at::Tensor& output) override;
  std::unique_ptr<PendingCollective> all_gather(const at::Tensor& input, const at::Tensor& output) override;
  std::unique_ptr<PendingCollective> all_reduce(const at::Tensor& buffer) override;
  std::shared_ptr<const Stamp> stamp() override;
  void time_collectives() override { timing_ = true; }
  // H2D on the compute stream, all-reduce and D2H into pinned memory on the
  // communicator's stream; the result polls the last event.
  std::unique_ptr<PendingSum> sum_host(const std::vector<int64_t>& values) override;
  void pack(const std::vector<at::Tensor>& sources, const std::vector<int64_t>& offsets,
            const at::Tensor& flat, double scale) override;
  void unpack(const at::Tensor& flat, const std::vector<int64_t>& offsets,
              const std::vector<at::Tensor>& destinations) override;

  // For tests: CUDA events created so far (pooled: bounded by collectives in flight).
  int64_t events_created() const { return events_->created(); }

 private:
  // The launch of every collective, with the edges of Note [Stream order];
  // `done` (null: one from the pool) is recorded after it.
  std::unique_ptr<PendingCollective> enqueue(const char* what, const std::vector<at::Tensor>& touched,
                                             const std::function<ncclResult_t(ncclComm_t, cudaStream_t)>& op,
                                             std::shared_ptr<void>* done_out = nullptr);
  void check_tensor(const at::Tensor& t, const char* what, const char* role) const;
  const std::shared_ptr<HandlePool>& timing_events();
  void on_failure(const std::string& reason);
  void end_debug_spins();  // before every ncclCommAbort: see spin_abort_

  const int rank_;
  const int world_size_;
  const c10::DeviceIndex device_;
  const std::chrono::milliseconds timeout_;
  const NcclDebugOptions debug_;
  const OnFailure on_failure_;
  PooledStream stream_;  // declared before comm_: goes back to the pool after it is destroyed
  ncclComm_t comm_ = nullptr;
  std::timed_mutex nccl_mutex_;  // held by every NCCL call on comm_ (Note [Failure])
  bool aborted_ = false;         // guarded by nccl_mutex_; once set, no NCCL call starts
  // Set before every ncclCommAbort (on_failure(), and the teardown's abort):
  // ends the debug delays' spins as the abort ends a stuck NCCL kernel
  // (kernels/spin.h). Host-mapped, and only where a delay is set; never freed,
  // since a spin may outlive the backend (on an aborted stream, or on the
  // compute stream under a dropped edge).
  volatile int* spin_abort_ = nullptr;
  std::shared_ptr<HandlePool> events_;
  std::shared_ptr<HandlePool> timing_events_;  // stamps: created on first use
  bool timing_ = false;  // time_collectives(): each collective's finished() is a stamp
  std::shared_ptr<Watchdog> watchdog_;  // shared with pending handles, which may outlive the backend
};

}  // namespace dearcomm
