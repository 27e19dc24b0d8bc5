// The seam between *what* a schedule communicates and *how* it is done.
//
// A SchedulePolicy turns the events of one iteration into collectives; the
// executor (core/executor.h) keeps ready counts and states and has a device
// issue exactly the ops a policy returns, in the order returned.
//
// A policy holds no tensors, calls no backend and decides only from inputs
// that are the same on every rank (bucket indices and the event order the
// executor derives from them), so every rank issues the same collectives in
// the same order — and the simulated device (sim/) runs the very same policy
// on a virtual clock.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace dearcomm {

enum class Collective { kReduceScatter, kAllGather, kAllReduce };
const char* to_string(Collective kind);  // "reduce_scatter", "all_gather", "all_reduce"

struct Op {
  Collective kind;
  int64_t bucket;
  int64_t slot = 0;  // the bucket's buffer slot; the executor sets it (see SchedulePolicy::delay)
  bool operator==(const Op& other) const {
    return kind == other.kind && bucket == other.bucket && slot == other.slot;
  }
};

// When the optimizer runs, and so which buffers the executor keeps and what an
// all-gather carries.
enum class UpdateStrategy {
  kShardedAtStep,        // step() updates this rank's fp32 master shard; all-gathers carry parameters
  kReplicatedBeforeUse,  // all-gathers carry averaged gradients; a bucket is updated when the forward needs it
  kFullAfterReduction,   // the reduction leaves full averaged gradients in .grad; the user's optimizer runs in step()
};
const char* to_string(UpdateStrategy strategy);  // "sharded_at_step", ...

// Where the executor waits for a backward's reductions, and so what the next
// forward waits for.
enum class ReductionsWaited {
  kWhenBackwardReturns,  // .grad holds averages when backward returns, as with DDP
  kInStep,               // optimizer.step() waits for them (.grad keeps this rank's gradient)
  kInNextForward,        // step() leaves them running; the next forward waits for each bucket's
                         // reduction (and updates its parameters) right before the module that
                         // needs it, so they overlap the next forward too (ByteScheduler)
};
const char* to_string(ReductionsWaited where);  // "when_backward_returns", ...

class SchedulePolicy {
 public:
  virtual ~SchedulePolicy() = default;

  virtual UpdateStrategy update_strategy() const = 0;
  // The collective that reduces a bucket's gradients (its buffers are
  // allocated for it): kReduceScatter leaves a shard, kAllReduce the full average.
  virtual Collective reduction() const = 0;

  // A backward begins: reset per-iteration state (queues). `bucket_bytes`:
  // each bucket's size in its communication dtype. `drained[k]`: the bytes
  // the link is taken to send between the (k-1)-th and the k-th eligibility
  // event of this backward (the link model, engine/link_meter.h); empty
  // where there is none yet. Both are the same on every rank.
  virtual void begin_iteration(const std::vector<int64_t>& bucket_bytes, const std::vector<int64_t>& drained) {
    (void)bucket_bytes;
    (void)drained;
  }
  // How many iterations late bucket `bucket`'s averages are applied. 0: in
  // the step() of the backward that produced them. d > 0: the bucket has d + 1
  // buffer slots, iteration i's gradients fill slot i mod (d + 1), their
  // reduction stays in flight across step() and later backwards, and step()
  // of iteration i applies iteration i - d's averages (none while i < d). The
  // same for every call and on every rank; a parameter's buckets share it.
  virtual int64_t delay(int64_t bucket) const {
    (void)bucket;
    return 0;
  }
  // Whether begin_iteration reads `drained`: the executor measures the link
  // and agrees on the model with the other ranks only for such a policy.
  virtual bool uses_link_model() const { return false; }
  // Whether the link must serve collectives one at a time in issue order
  // (one NCCL stream does; gloo runs two all-reduces at once): a delayed
  // reduction in flight across the next backward must not share the link
  // with that backward's own, which the backward waits for.
  virtual bool needs_issue_order() const { return false; }
  // Backward: bucket `bucket` is *eligible*, i.e. it and every bucket after it
  // (canonical backward order: descending index) are complete on this rank.
  // The executor derives eligibility, so every rank sees the same sequence of
  // events, B-1, B-2, ..., 0, whatever order its gradients arrive in.
  virtual std::vector<Op> on_eligible(int64_t bucket) = 0;
  // Every bucket was eligible: ops the policy still holds back. After them,
  // every bucket's reduction must have been issued.
  virtual std::vector<Op> at_end_of_backward() { return {}; }
  virtual ReductionsWaited reductions_waited() const = 0;
  // optimizer.step(), after the reductions finished (and, sharded, the shard
  // update): ops whose results the next forward consumes. None: every
  // parameter is current once step() returns.
  virtual std::vector<Op> at_step(int64_t num_buckets) = 0;
};

}  // namespace dearcomm
