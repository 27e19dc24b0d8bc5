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
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dearcomm {

// A point on a backend's clock, in the order of the work before it: a
// steady_clock reading on the CPU; on a GPU an event on a stream, which gets
// its time only once the device reaches it (the host runs ahead). What is
// measured from stamps is read late, when the stamps have a time.
class Stamp {
 public:
  virtual ~Stamp() = default;
  // Nanoseconds from `origin` (a stamp of the same backend) to this one,
  // negative if this one came first; nullopt while either has no time yet.
  virtual std::optional<int64_t> since(const Stamp& origin) const = 0;
};

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
  // Where the collective completes, on the backend's clock (link_meter.h);
  // null unless the backend was asked to time_collectives().
  virtual std::shared_ptr<const Stamp> finished() const { return nullptr; }
};

// A sum of a few host integers over the ranks (sum_host), in flight.
class PendingSum {
 public:
  virtual ~PendingSum() = default;
  // Blocks (the GIL released by the caller) until the sum is on the host;
  // throws, naming it, if it failed or took longer than `timeout`.
  virtual std::vector<int64_t> result(std::chrono::milliseconds timeout) = 0;
};

class CommBackend {
 public:
  virtual ~CommBackend() = default;

  virtual std::string name() const = 0;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Now, on this backend's clock, in the order of the caller's work (on a
  // GPU: of the current stream).
  virtual std::shared_ptr<const Stamp> stamp() = 0;
  // From now on every collective's finished() gives a stamp (a GPU records a
  // timing event after each one; the CPU has them anyway).
  virtual void time_collectives() {}
  // From now on all-reduces hold the link one at a time in issue order (a
  // GPU's one communication stream does so anyway).
  virtual void keep_issue_order() {}
  virtual bool all_reduces_in_issue_order() const { return true; }
  // Sums `values` over all ranks without blocking the caller; every rank
  // calls it at the same point, as for any collective. For agreements on a
  // few figures (the link model), wherever the buffers live.
  virtual std::unique_ptr<PendingSum> sum_host(const std::vector<int64_t>& values) = 0;

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
