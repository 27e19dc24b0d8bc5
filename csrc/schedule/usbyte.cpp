// US-Byte (Gao et al., TPDS 2024): each tensor is all-reduced in blocks of
// unequal sizes that a planner chose (dearcomm/usbyte.py; the layout's
// explicit blocks). When a gradient becomes ready, the most urgent ready
// blocks (the planner's priorities; input side first where none are given)
// go while the link, as the ranks' agreed model says (schedule/op_queue.h),
// would start them before the next gradient is ready, and at least one if it
// is idle: the planner sized the blocks to fill exactly those gaps, and a
// block held back can still be overtaken by a more urgent one. The rest go when
// backward ends, most urgent first. As in ByteScheduler, step() does not
// wait: the next forward waits, module by module, for its own parameters'
// blocks and updates a parameter once all of them are reduced.
#include "schedule/op_queue.h"
#include "schedule/policy.h"

#include <c10/util/Exception.h>

namespace dearcomm {
namespace {

class USBytePolicy final : public SchedulePolicy {
 public:
  explicit USBytePolicy(std::vector<int64_t> priorities)
      : priorities_(std::move(priorities)), queue_(/*credit_bytes=*/1) {}  // unused: tick_within
  UpdateStrategy update_strategy() const override { return UpdateStrategy::kReplicatedBeforeUse; }
  Collective reduction() const override { return Collective::kAllReduce; }
  bool uses_link_model() const override { return true; }
  void begin_iteration(const std::vector<int64_t>& bucket_bytes, const std::vector<int64_t>& drained) override {
    TORCH_CHECK_VALUE(priorities_.empty() || priorities_.size() == bucket_bytes.size(),
                      "dearcomm: usbyte got priorities for ", priorities_.size(), " buckets, but the layout has ",
                      bucket_bytes.size());
    bucket_bytes_ = bucket_bytes;
    drained_ = drained;
    ticks_ = 0;
    queue_.clear();
  }
  std::vector<Op> on_eligible(int64_t bucket) override {
    const int64_t priority = priorities_.empty() ? bucket : priorities_.at(bucket);
    queue_.push({Collective::kAllReduce, bucket}, priority, bucket_bytes_.at(bucket));
    const size_t tick = ticks_++;
    // The gap until the next gradient: what the link sends before the next tick.
    const int64_t gap = tick + 1 < drained_.size() ? drained_[tick + 1] : drained_.empty() ? OpQueue::kDrainedAll : 0;
    return queue_.tick_within(tick < drained_.size() ? drained_[tick] : OpQueue::kDrainedAll, gap);
  }
  // Phase 2 of the plan: what is left goes after backward, most urgent first.
  std::vector<Op> at_end_of_backward() override { return queue_.release_all(); }
  ReductionsWaited reductions_waited() const override { return ReductionsWaited::kInNextForward; }
  std::vector<Op> at_step(int64_t) override { return {}; }

 private:
  const std::vector<int64_t> priorities_;  // per bucket, lower goes first; empty: bucket order
  std::vector<int64_t> bucket_bytes_;
  std::vector<int64_t> drained_;
  size_t ticks_ = 0;
  OpQueue queue_;
};

}  // namespace

std::unique_ptr<SchedulePolicy> make_usbyte_policy(std::vector<int64_t> priorities) {
  return std::make_unique<USBytePolicy>(std::move(priorities));
}

}  // namespace dearcomm
