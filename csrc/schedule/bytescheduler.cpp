// ByteScheduler (Peng et al., SOSP 2019), all-reduce flavour: each partition
// (bucket) is all-reduced under a priority queue, input side first (bucket
// index = forward position), with a credit returned per tick (each time a
// bucket becomes eligible; schedule/op_queue.h says why); step() does not wait: the next
// forward waits, module by module, for its own parameters' all-reduces and
// updates a parameter once all of its partitions are reduced.
#include "schedule/op_queue.h"
#include "schedule/policy.h"

#include <c10/util/Exception.h>

namespace dearcomm {
namespace {

class ByteSchedulerPolicy final : public SchedulePolicy {
 public:
  explicit ByteSchedulerPolicy(int64_t credit_bytes) : credit_bytes_(credit_bytes) {
    TORCH_CHECK_VALUE(credit_bytes > 0, "dearcomm: the credit must be > 0 bytes, got ", credit_bytes);
  }
  UpdateStrategy update_strategy() const override { return UpdateStrategy::kReplicatedBeforeUse; }
  Collective reduction() const override { return Collective::kAllReduce; }
  void begin_iteration(const std::vector<int64_t>& bucket_bytes) override {
    bucket_bytes_ = bucket_bytes;
    queue_.clear();
  }
  std::vector<Op> on_eligible(int64_t bucket) override {
    queue_.push({Collective::kAllReduce, bucket}, /*priority=*/bucket, bucket_bytes_.at(bucket));
    return queue_.tick(credit_bytes_);
  }
  std::vector<Op> at_end_of_backward() override { return queue_.release_all(); }
  bool finish_reductions_at_end_of_backward() const override { return false; }
  bool finish_reductions_in_forward() const override { return true; }
  std::vector<Op> at_step(int64_t) override { return {}; }  // all-reduced: nothing to gather

 private:
  const int64_t credit_bytes_;
  std::vector<int64_t> bucket_bytes_;
  OpQueue queue_;
};

}  // namespace

std::unique_ptr<SchedulePolicy> make_bytescheduler_policy(int64_t credit_bytes) {
  return std::make_unique<ByteSchedulerPolicy>(credit_bytes);
}

}  // namespace dearcomm
