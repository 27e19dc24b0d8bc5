// DeAR (decoupled all-reduce): the all-reduce is split in two. Each bucket is
// reduce-scattered as soon as it is eligible; step() waits for them (the
// averaged shard is what the optimizer reads) and issues every all-gather in
// forward order, which the next forward consumes bucket by bucket.
//
// Every all-gather is issued in step(), not one by one from the forward's
// hooks: then every rank issues them at the same point of the program whatever
// runs between step() and the next training forward (a rank-0-only
// state_dict() or eval, a barrier). The backends run them in issue order, so
// bucket 0 lands first and the forward overlaps the rest.
#include "schedule/policy.h"

#include <c10/util/Exception.h>

namespace dearcomm {
namespace {

class DearPolicy final : public SchedulePolicy {
 public:
  explicit DearPolicy(UpdateStrategy update) : update_(update) {
    TORCH_CHECK(update == UpdateStrategy::kShardedAtStep || update == UpdateStrategy::kReplicatedBeforeUse,
        "dearcomm: schedule 'dear' has no update strategy ", to_string(update));
  }
  UpdateStrategy update_strategy() const override { return update_; }
  Collective reduction() const override { return Collective::kReduceScatter; }
  std::vector<Op> on_eligible(int64_t bucket) override { return {{Collective::kReduceScatter, bucket}}; }
  // The shard update reads the averaged shard; .grad keeps this rank's local gradient.
  ReductionsWaited reductions_waited() const override { return ReductionsWaited::kInStep; }
  std::vector<Op> at_step(int64_t num_buckets) override {
    std::vector<Op> gathers;
    for (int64_t b = 0; b < num_buckets; ++b) {
      gathers.push_back({Collective::kAllGather, b});
    }
    return gathers;
  }

 private:
  UpdateStrategy update_;
};

}  // namespace

std::unique_ptr<SchedulePolicy> make_dear_policy(UpdateStrategy update) {
  return std::make_unique<DearPolicy>(update);
}

}  // namespace dearcomm
