// What the executor (core/executor.h) asks of a device: the real one moves
// tensors over a CommBackend (engine/engine.h); the simulated one advances a
// virtual clock (sim/sim_device.h). The executor decides *what* happens and
// *when*; a device only does it, and never calls back into the executor.
#pragma once

#include "schedule/policy.h"

#include <cstdint>
#include <vector>

namespace dearcomm::core {

class Device {
 public:
  virtual ~Device() = default;

  // A backward begins (its first gradient): reset per-backward state. Returns
  // the link model the policy gets (bytes drained before each eligibility
  // event; empty: none). May raise; the backward has not begun then.
  virtual std::vector<int64_t> begin_backward() = 0;
  // Parameter `param`'s gradient arrived: check it and keep it until its
  // bucket's reduction is issued.
  virtual void accept_grad(int64_t param) = 0;
  // Bucket `bucket` became eligible (every rank sees the same sequence).
  virtual void eligible(int64_t /*bucket*/) {}
  // Every reduction of this backward was issued.
  virtual void reductions_issued() {}
  // Whether the reductions read memory the user may write once backward
  // returns (.grad aliases the bucket): then they are waited for at its end.
  virtual bool reductions_read_user_memory() const { return false; }

  // Issue the collective on the op's buffer slot (a reduction packs the
  // bucket's gradients into it first).
  virtual void issue(const Op& op) = 0;
  // Wait for it; a reduction also averages.
  virtual void wait(const Op& op) = 0;
  // full_after_reduction: `params`, whose last bucket is `bucket`, have their
  // averages in `slot`; they go to .grad.
  virtual void averages_to_grad(int64_t bucket, int64_t slot, const std::vector<int64_t>& params) = 0;
  // full_after_reduction, a delayed bucket before its first averages: step()
  // applies nothing to `params` (their .grad is dropped).
  virtual void no_averages(int64_t /*bucket*/, const std::vector<int64_t>& /*params*/) {}
  // The bucket's averages are in use (gathered, or all-reduced): to the
  // parameters' dtype where the update reads them.
  virtual void averages_in(int64_t bucket) = 0;
  // replicated_before_use: update `params`, whose last bucket is `bucket`.
  virtual void update(int64_t bucket, const std::vector<int64_t>& params) = 0;
  // step() leaves work for the next forward (the first time: parameters
  // become views into the gathered buffers where the strategy gathers them).
  virtual void step_left_pending() {}
  // sync()/eval: nothing may stay in flight (link agreements).
  virtual void settle() {}
};

}  // namespace dearcomm::core
