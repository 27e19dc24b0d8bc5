// DeFT (delayed updates, ICDE 2025): WFBP's bucketed all-reduce in bucket
// order, with the buckets a planner chose (dearcomm/deft.py) applied one or
// more iterations late. A delayed bucket's reduction is issued when it is
// eligible, as any other, but stays in flight in its own buffer slot across
// step() and the next forward, and the backward that ends `delay` iterations
// later waits for it: its communication leaves the tail of this backward for
// the compute windows that follow, and the link keeps the order it was issued
// in (the journal version does not reorder). When backward returns, .grad
// holds what step() applies, as with DDP: this backward's averages for the
// undelayed buckets, those of `delay` backwards ago for the delayed ones
// (nothing yet in the first `delay` steps).
#include "schedule/policy.h"

#include <c10/util/Exception.h>

namespace dearcomm {
namespace {

class DeftPolicy final : public SchedulePolicy {
 public:
  explicit DeftPolicy(std::vector<int64_t> delays) : delays_(std::move(delays)) {}

  UpdateStrategy update_strategy() const override { return UpdateStrategy::kFullAfterReduction; }
  Collective reduction() const override { return Collective::kAllReduce; }
  int64_t delay(int64_t bucket) const override {
    TORCH_CHECK_VALUE(delays_.empty() || bucket < static_cast<int64_t>(delays_.size()), "dearcomm: deft got delays "
                      "for ", delays_.size(), " buckets, but the layout has bucket ", bucket);
    return delays_.empty() ? 0 : delays_[bucket];
  }
  void begin_iteration(const std::vector<int64_t>& bucket_bytes, const std::vector<int64_t>&) override {
    TORCH_CHECK_VALUE(delays_.empty() || delays_.size() == bucket_bytes.size(), "dearcomm: deft got delays for ",
                      delays_.size(), " buckets, but the layout has ", bucket_bytes.size());
  }
  std::vector<Op> on_eligible(int64_t bucket) override { return {{Collective::kAllReduce, bucket}}; }
  ReductionsWaited reductions_waited() const override { return ReductionsWaited::kWhenBackwardReturns; }
  bool needs_issue_order() const override { return true; }
  std::vector<Op> at_step(int64_t) override { return {}; }  // nothing to gather: parameters are current

 private:
  const std::vector<int64_t> delays_;  // per bucket; empty: none delayed
};

}  // namespace

std::unique_ptr<SchedulePolicy> make_deft_policy(std::vector<int64_t> delays) {
  return std::make_unique<DeftPolicy>(std::move(delays));
}

}  // namespace dearcomm
