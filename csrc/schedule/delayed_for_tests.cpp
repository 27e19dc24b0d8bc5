// WFBP with chosen buckets applied `delay` iterations late: the executor's
// buffer slots and reductions in flight across step(), driven by the simplest
// policy that needs them, so the core's part of a delayed schedule (DeFT) is
// tested on its own. Not in the registry: tests reach it through
// _C._testing.delayed_schedule.
#include "schedule/policy.h"
#include "schedule/registry.h"

#include <deque>
#include <set>
#include <string>
#include <vector>

namespace dearcomm {
namespace {

class DelayedForTests final : public SchedulePolicy {
 public:
  DelayedForTests(std::set<int64_t> delayed, int64_t delay) : delayed_(std::move(delayed)), delay_(delay) {}

  UpdateStrategy update_strategy() const override { return UpdateStrategy::kFullAfterReduction; }
  Collective reduction() const override { return Collective::kAllReduce; }
  int64_t delay(int64_t bucket) const override { return delayed_.count(bucket) ? delay_ : 0; }
  std::vector<Op> on_eligible(int64_t bucket) override { return {{Collective::kAllReduce, bucket}}; }
  ReductionsWaited reductions_waited() const override { return ReductionsWaited::kInStep; }
  std::vector<Op> at_step(int64_t) override { return {}; }

 private:
  const std::set<int64_t> delayed_;
  const int64_t delay_;
};

}  // namespace

ScheduleChoice delayed_schedule_for_tests(const std::vector<int64_t>& delayed, int64_t delay) {
  static std::deque<ScheduleInfo> infos;  // a choice points into its info: kept for the process
  const std::set<int64_t> buckets(delayed.begin(), delayed.end());
  ScheduleInfo& info = infos.emplace_back();
  info.name = "delayed_for_tests";
  info.summary = "wfbp with chosen buckets applied late (tests of the executor only)";
  info.updates = {{"replicated", UpdateStrategy::kFullAfterReduction}};
  info.default_update = "replicated";
  info.make = [buckets, delay](UpdateStrategy, const PolicyConfig&) {
    return std::unique_ptr<SchedulePolicy>(std::make_unique<DelayedForTests>(buckets, delay));
  };
  ScheduleChoice choice;
  choice.schedule = &info;
  choice.update = &info.updates.front();
  return choice;
}

}  // namespace dearcomm
