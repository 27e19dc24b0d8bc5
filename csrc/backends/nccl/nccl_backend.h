// NCCL backend: the engine's primitives on GPUs, with dearcomm's own
// communicators and streams, ordered by CUDA events; the host never waits.
//
// One iteration, three lanes (schedule "dear", buckets 0..2 in forward order):
//
//   compute | F0 F1 F2 | B2 pack2 B1 pack1 B0 pack0 | wait RS, /p, opt(shard) | F0 F1 F2 ...
//   RS      |          |      [RS2]      [RS1]    [RS0]                       |
//   AG      |          |                               (E3)[AG0]   [AG1]  [AG2]
//                                                            ^E4 F0 waits  ^E4 F1 waits
//
// Note [Stream order] - every cross-stream edge is one CUDA event:
//   E1 compute -> RS/AG stream: recorded on the current stream when a
//      collective is enqueued (after the pack kernel, or after the optimizer
//      wrote the shard), waited by the collective's stream before NCCL reads.
//   E2 collective stream -> compute: recorded after the collective; wait()
//      makes the current stream wait on it (finish_reductions in step(), a
//      module's forward pre-hook for all-gathers). Never a host synchronize.
// Note [Buffer lifetime] - tensors a collective touches are recorded on its
// stream (recordStream), so the caching allocator never hands their memory out
// while the collective may still read or write it.
//
// RS and AG have a communicator and a high-priority stream each, so the last
// reduce-scatters and the first all-gathers can be in flight together.
// Every rank enqueues on each communicator in the same order (the engine's
// launch order). A Watchdog turns a stuck or failed collective into an error.
#pragma once

#include "../../engine/comm_backend.h"
#include "watchdog.h"

#include <c10/cuda/CUDAStream.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <functional>

namespace dearcomm {

std::string nccl_version_string();

class NcclBackend final : public CommBackend {
 public:
  // Creates the communicators: rank 0 publishes NCCL unique ids under
  // `key_prefix` in `store`; every rank of the group joins.
  NcclBackend(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key_prefix, int rank,
              int world_size, c10::DeviceIndex device, std::chrono::milliseconds timeout);
  ~NcclBackend() override;

  std::string name() const override;
  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }

  std::unique_ptr<PendingCollective> reduce_scatter(const at::Tensor& input, const at::Tensor& output) override;
  std::unique_ptr<PendingCollective> all_gather(const at::Tensor& input, const at::Tensor& output) override;
  std::unique_ptr<PendingCollective> all_reduce(const at::Tensor& buffer) override;
  void pack(const std::vector<at::Tensor>& sources, const std::vector<int64_t>& offsets,
            const at::Tensor& flat, double scale) override;
  void unpack(const at::Tensor& flat, const std::vector<int64_t>& offsets,
              const std::vector<at::Tensor>& destinations) override;

 private:
  // A communicator and the stream it is used from.
  struct Channel {
    ncclComm_t comm = nullptr;
    c10::cuda::CUDAStream stream;
  };

  std::unique_ptr<PendingCollective> enqueue(Channel& channel, const char* what,
                                             const std::vector<at::Tensor>& touched,
                                             const std::function<ncclResult_t(ncclComm_t, cudaStream_t)>& op);

  int rank_;
  int world_size_;
  c10::DeviceIndex device_;
  Channel rs_;  // reduce-scatter and all-reduce: fed by backward, drained by step()
  Channel ag_;  // all-gather: fed by step(), drained by the next forward
  std::unique_ptr<Watchdog> watchdog_;
  // Tests only (DEARCOMM_DEBUG_STREAM_DELAY_CYCLES): delays every collective on
  // its side stream, which must change no result if every wait is in place.
  int64_t debug_delay_cycles_ = 0;
};

}  // namespace dearcomm
