// ByteScheduler (Peng et al., SOSP 2019), all-reduce flavour: each partition
// (bucket) is all-reduced under a priority queue, input side first (bucket
// index = forward position), while the bytes in flight stay within the
// credit (schedule/op_queue.h: in flight as the ranks' agreed link model
// says); step() does not wait: the next forward waits, module by module, for
// its own parameters' all-reduces and updates a parameter once all of its
// partitions are reduced.
#include "schedule/op_queue.h"
#include "schedule/policy.h"

namespace dearcomm {
namespace {

class ByteSchedulerPolicy final : public SchedulePolicy {
 public:
  explicit ByteSchedulerPolicy(int64_t credit_bytes) : queue_(credit_bytes) {}
  UpdateStrategy update_strategy() const override { return UpdateStrategy::kReplicatedBeforeUse; }
  Collective reduction() const override { return Collective::kAllReduce; }
  bool uses_link_model() const override { return true; }
  void begin_iteration(const std::vector<int64_t>& bucket_bytes, const std::vector<int64_t>& drained) override {
    bucket_bytes_ = bucket_bytes;
    drained_ = drained;
    ticks_ = 0;
    queue_.clear();  // the executor starts a backward with nothing in flight
  }
  std::vector<Op> on_eligible(int64_t bucket) override {
    queue_.push({Collective::kAllReduce, bucket}, /*priority=*/bucket, bucket_bytes_.at(bucket));
    const size_t tick = ticks_++;
    return queue_.tick(tick < drained_.size() ? drained_[tick] : OpQueue::kDrainedAll);
  }
  std::vector<Op> at_end_of_backward() override { return queue_.release_all(); }
  ReductionsWaited reductions_waited() const override { return ReductionsWaited::kInNextForward; }
  std::vector<Op> at_step(int64_t) override { return {}; }  // all-reduced: nothing to gather

 private:
  std::vector<int64_t> bucket_bytes_;
  std::vector<int64_t> drained_;
  size_t ticks_ = 0;
  OpQueue queue_;
};

}  // namespace

std::unique_ptr<SchedulePolicy> make_bytescheduler_policy(int64_t credit_bytes) {
  return std::make_unique<ByteSchedulerPolicy>(credit_bytes);
}

}  // namespace dearcomm
