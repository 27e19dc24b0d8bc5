// The primitives a backend gives the engine. The engine core never branches on
// the backend: the c10d/gloo backend (CPU) and the NCCL backend (GPU) differ
// only behind this interface.
//
// Contract (as for c10d's ProcessGroup): every rank issues the same calls in
// the same order; a call returns once the collective is enqueued; the result
// may be read only after wait() on the returned handle.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace dearcomm {

// One collective in flight. wait() blocks the host (CPU backend) or orders the
// caller's stream after the collective (NCCL backend); it throws, naming the
// collective, if the collective failed or did not finish within `timeout`.
class PendingCollective {
 public:
  virtual ~PendingCollective() = default;
  virtual void wait(std::chrono::milliseconds timeout) = 0;
  // When the collective completed (steady_clock, ns), if the backend knows
  // without waiting; -1 otherwise. Used by the timeline.
  virtual int64_t completed_ns() const { return -1; }
};

class CommBackend {
 public:
  virtual ~CommBackend() = default;

  virtual std::string name() const = 0;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Whether its collectives report completed_ns() (the link model needs it),
  // and its buffers can be read on the host right after wait().
  virtual bool reports_completion_times() const { return false; }

  // Sums `input` (world_size equal chunks) over all ranks and leaves chunk
  // `rank` of the sum in `output`. `input` must not change until wait().
  virtual std::unique_ptr<PendingCollective> reduce_scatter(const at::Tensor& input, const at::Tensor& output) = 0;

  // Concatenates every rank's `input` into `output`, in rank order.
  virtual std::unique_ptr<PendingCollective> all_gather(const at::Tensor& input, const at::Tensor& output) = 0;

  // Sums `buffer` over all ranks, in place.
  virtual std::unique_ptr<PendingCollective> all_reduce(const at::Tensor& buffer) = 0;

  // Copies `scale` times every tensor of `sources` into `flat` at element
  // `offsets[i]`, casting to the flat buffer's dtype (one fused launch on GPU).
  virtual void pack(const std::vector<at::Tensor>& sources, const std::vector<int64_t>& offsets,
                    const at::Tensor& flat, double scale) = 0;
  // The reverse: element `offsets[i]` of `flat` onwards into `destinations[i]`,
  // casting to their dtype.
  virtual void unpack(const at::Tensor& flat, const std::vector<int64_t>& offsets,
                      const std::vector<at::Tensor>& destinations) = 0;
};

}  // namespace dearcomm
