// WFBP (wait-free backpropagation; DDP's and Horovod's schedule): each bucket
// is all-reduced as soon as it is eligible, backward returns with averaged
// gradients in .grad, and the user's optimizer updates full parameters in step().
#include "schedule/policy.h"

namespace dearcomm {
namespace {

class WfbpPolicy final : public SchedulePolicy {
 public:
  UpdateStrategy update_strategy() const override { return UpdateStrategy::kFullAfterReduction; }
  Collective reduction() const override { return Collective::kAllReduce; }
  std::vector<Op> on_eligible(int64_t bucket) override { return {{Collective::kAllReduce, bucket}}; }
  ReductionsWaited reductions_waited() const override { return ReductionsWaited::kWhenBackwardReturns; }
  std::vector<Op> at_step(int64_t) override { return {}; }  // nothing to gather: parameters are current
};

}  // namespace

std::unique_ptr<SchedulePolicy> make_wfbp_policy() { return std::make_unique<WfbpPolicy>(); }

}  // namespace dearcomm
