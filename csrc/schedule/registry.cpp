#include "schedule/registry.h"

#include <c10/util/Exception.h>

#include <sstream>

namespace dearcomm {

// Defined in each schedule's own file.
std::unique_ptr<SchedulePolicy> make_wfbp_policy();
std::unique_ptr<SchedulePolicy> make_dear_policy(UpdateStrategy update);
std::unique_ptr<SchedulePolicy> make_bytescheduler_policy(int64_t credit_bytes);

// The ByteScheduler paper's recommendation for all-reduce: partitions of 8 M
// and a credit of 16 M parameters (fp32 here).
constexpr int64_t kByteSchedulerPartitionBytes = 8 * (int64_t{1} << 20) * 4;
constexpr int64_t kByteSchedulerCreditBytes = 16 * (int64_t{1} << 20) * 4;

const std::vector<ScheduleInfo>& schedule_registry() {
  static const std::vector<ScheduleInfo> registry = {
      {"dear", "reduce-scatter during backward, all-gather during the next forward",
       {{"sharded", UpdateStrategy::kShardedAtStep}, {"replicated", UpdateStrategy::kReplicatedBeforeUse}},
       "sharded", [](UpdateStrategy update, const PolicyConfig&) { return make_dear_policy(update); }},
      {"wfbp", "bucketed all-reduce during backward, finished when backward returns (DDP's schedule)",
       {{"replicated", UpdateStrategy::kFullAfterReduction}},
       "replicated", [](UpdateStrategy, const PolicyConfig&) { return make_wfbp_policy(); }},
      {"bytescheduler",
       "partitioned all-reduce under a priority queue (input side first) and a credit; each parameter is "
       "updated in the next forward, once its partitions are reduced",
       {{"replicated", UpdateStrategy::kReplicatedBeforeUse}},
       "replicated",
       [](UpdateStrategy, const PolicyConfig& config) { return make_bytescheduler_policy(config.credit_bytes); },
       kByteSchedulerPartitionBytes, kByteSchedulerCreditBytes},
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

std::unique_ptr<SchedulePolicy> make_policy(const std::string& schedule, const std::string& update,
                                            int64_t credit_bytes) {
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
  TORCH_CHECK_VALUE(credit_bytes >= 0, "dearcomm: the credit must be > 0 bytes, got ", credit_bytes);
  TORCH_CHECK_VALUE(credit_bytes == 0 || info->default_credit_bytes > 0,
      "dearcomm: schedule='", schedule, "' has no credit; credit_mb applies to schedules that queue their "
      "collectives (schedule='bytescheduler')");
  PolicyConfig config;
  config.credit_bytes = credit_bytes > 0 ? credit_bytes : info->default_credit_bytes;
  for (const UpdateOption& option : info->updates) {
    if (option.name == update) {
      return info->make(option.strategy, config);
    }
  }
  TORCH_CHECK_NOT_IMPLEMENTED(false, "dearcomm: schedule='", schedule, "' with update='", update,
      "' is not supported; valid: ", valid_combinations());
  return nullptr;  // not reached
}

}  // namespace dearcomm
