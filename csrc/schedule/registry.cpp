#include "schedule/registry.h"

#include <c10/util/Exception.h>

#include <sstream>

namespace dearcomm {

// Defined in each schedule's own file.
std::unique_ptr<SchedulePolicy> make_wfbp_policy();
std::unique_ptr<SchedulePolicy> make_dear_policy(UpdateStrategy update);

const std::vector<ScheduleInfo>& schedule_registry() {
  static const std::vector<ScheduleInfo> registry = {
      {"dear", "reduce-scatter during backward, all-gather during the next forward",
       {{"sharded", UpdateStrategy::kShardedAtStep}, {"replicated", UpdateStrategy::kReplicatedBeforeUse}},
       "sharded", [](UpdateStrategy update) { return make_dear_policy(update); }},
      {"wfbp", "bucketed all-reduce during backward, finished when backward returns (DDP's schedule)",
       {{"replicated", UpdateStrategy::kFullAfterReduction}},
       "replicated", [](UpdateStrategy) { return make_wfbp_policy(); }},
  };
  return registry;
}

namespace {

std::string valid_combinations() {
  std::ostringstream out;
  for (const ScheduleInfo& info : schedule_registry()) {
    for (const UpdateOption& update : info.updates) {
      out << (out.tellp() > 0 ? ", " : "") << "schedule='" << info.name << "' with update='" << update.name << "'";
    }
  }
  return out.str();
}

}  // namespace

std::unique_ptr<SchedulePolicy> make_policy(const std::string& schedule, const std::string& update) {
  const ScheduleInfo* info = nullptr;
  bool known_update = false;
  for (const ScheduleInfo& candidate : schedule_registry()) {
    info = candidate.name == schedule ? &candidate : info;
    for (const UpdateOption& option : candidate.updates) {
      known_update = known_update || option.name == update;
    }
  }
  TORCH_CHECK_VALUE(info, "dearcomm: unknown schedule '", schedule, "'; valid: ", valid_combinations());
  TORCH_CHECK_VALUE(known_update, "dearcomm: unknown update '", update, "'; valid: ", valid_combinations());
  for (const UpdateOption& option : info->updates) {
    if (option.name == update) {
      return info->make(option.strategy);
    }
  }
  TORCH_CHECK_NOT_IMPLEMENTED(false, "dearcomm: schedule='", schedule, "' with update='", update,
      "' is not supported; valid: ", valid_combinations());
  return nullptr;  // not reached
}

}  // namespace dearcomm
