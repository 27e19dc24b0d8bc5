#include "schedule/registry.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

namespace dearcomm {

// Defined in each schedule's own file.
std::unique_ptr<SchedulePolicy> make_wfbp_policy();
std::unique_ptr<SchedulePolicy> make_dear_policy(UpdateStrategy update);
std::unique_ptr<SchedulePolicy> make_bytescheduler_policy(int64_t credit_bytes);
std::unique_ptr<SchedulePolicy> make_usbyte_policy(std::vector<int64_t> priorities);
std::unique_ptr<SchedulePolicy> make_deft_policy(std::vector<int64_t> delays);

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
      {"usbyte",
       "all-reduce of each tensor in unequal blocks a planner sized to fill the link's idle gaps (wrap(blocks=), "
       "dearcomm.usbyte), one block at a time, most urgent first (wrap(priorities=)); each parameter is updated "
       "in the next forward, once its blocks are reduced",
       {{"replicated", UpdateStrategy::kReplicatedBeforeUse}},
       "replicated",
       [](UpdateStrategy, const PolicyConfig& config) { return make_usbyte_policy(config.bucket_priorities); },
       /*default_partition_bytes=*/INT64_MAX, /*default_credit_bytes=*/0, /*takes_priorities=*/true},  // blocks: the planner's
      {"deft",
       "bucketed all-reduce during backward in bucket order, as wfbp, with the buckets a planner chose "
       "(wrap(delays=), dearcomm.deft) applied up to max_delay iterations late, so their communication overlaps "
       "the next iteration's compute",
       {{"replicated", UpdateStrategy::kFullAfterReduction}},
       "replicated",
       [](UpdateStrategy, const PolicyConfig& config) { return make_deft_policy(config.bucket_delays); },
       /*default_partition_bytes=*/INT64_MAX, /*default_credit_bytes=*/0, /*takes_priorities=*/false,
       /*takes_delays=*/true},
  };
  return registry;
}

namespace {

std::string quoted(const std::string& name) {
  return "'" + name + "'";
}

std::string joined(const std::vector<std::string>& items, const std::string& separator) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    out += (i ? separator : "") + items[i];
  }
  return out;
}

// "schedule='dear' with update='sharded' (default) or 'replicated'; ..."
std::string valid_combinations() {
  std::vector<std::string> combinations;
  for (const ScheduleInfo& info : schedule_registry()) {
    std::vector<std::string> updates;
    for (const UpdateOption& option : info.updates) {
      updates.push_back(quoted(option.name) + (option.name == info.default_update ? " (default)" : ""));
    }
    combinations.push_back("schedule=" + quoted(info.name) + " with update=" + joined(updates, " or "));
  }
  return joined(combinations, "; ");
}

}  // namespace

ScheduleChoice resolve_schedule(const std::string& schedule, const std::optional<std::string>& update,
                                std::optional<int64_t> credit_bytes) {
  std::vector<std::string> schedules;  // quoted, in registry order
  std::vector<std::string> updates;    // every update name, quoted, in registry order
  std::vector<std::string> with_credit;
  ScheduleChoice choice;
  for (const ScheduleInfo& info : schedule_registry()) {
    schedules.push_back(quoted(info.name));
    choice.schedule = info.name == schedule ? &info : choice.schedule;
    for (const UpdateOption& option : info.updates) {
      if (std::find(updates.begin(), updates.end(), quoted(option.name)) == updates.end()) {
        updates.push_back(quoted(option.name));
      }
    }
    if (info.default_credit_bytes > 0) {
      with_credit.push_back("schedule=" + quoted(info.name));
    }
  }
  TORCH_CHECK_VALUE(choice.schedule, "dearcomm: unknown schedule ", quoted(schedule), "; expected one of (",
                    joined(schedules, ", "), ")");
  const ScheduleInfo& info = *choice.schedule;
  const std::string name = update.value_or(info.default_update);
  TORCH_CHECK_VALUE(std::find(updates.begin(), updates.end(), quoted(name)) != updates.end(),
                    "dearcomm: unknown update ", quoted(name), "; expected one of (", joined(updates, ", "), ")");
  std::vector<std::string> own;
  for (const UpdateOption& option : info.updates) {
    choice.update = option.name == name ? &option : choice.update;
    own.push_back(quoted(option.name));
  }
  TORCH_CHECK_NOT_IMPLEMENTED(choice.update, "dearcomm: schedule=", quoted(schedule), " with update=", quoted(name),
                              " is not supported: ", schedule, " (", info.summary, ") has update=",
                              joined(own, " or "), ". Valid combinations: ", valid_combinations(), ".");
  if (credit_bytes.has_value()) {
    TORCH_CHECK_VALUE(info.default_credit_bytes > 0, "dearcomm: schedule=", quoted(schedule),
                      " has no credit; credit_mb applies to ", joined(with_credit, " or "));
    TORCH_CHECK_VALUE(*credit_bytes > 0, "dearcomm: the credit must be > 0 bytes, got ", *credit_bytes);
  }
  choice.config.credit_bytes = credit_bytes.value_or(info.default_credit_bytes);
  return choice;
}

ScheduleChoice ScheduleChoice::with_bucket_priorities(std::vector<int64_t> priorities) const {
  std::vector<std::string> takers;
  for (const ScheduleInfo& info : schedule_registry()) {
    if (info.takes_priorities) {
      takers.push_back("schedule=" + quoted(info.name));
    }
  }
  TORCH_CHECK_VALUE(priorities.empty() || schedule->takes_priorities, "dearcomm: schedule=", quoted(schedule->name),
                    " issues in its own order; priorities apply to ", joined(takers, " or "));
  ScheduleChoice out = *this;
  out.config.bucket_priorities = std::move(priorities);
  return out;
}

ScheduleChoice ScheduleChoice::with_bucket_delays(std::vector<int64_t> delays) const {
  std::vector<std::string> takers;
  for (const ScheduleInfo& info : schedule_registry()) {
    if (info.takes_delays) {
      takers.push_back("schedule=" + quoted(info.name));
    }
  }
  const bool any = std::any_of(delays.begin(), delays.end(), [](int64_t d) { return d != 0; });
  TORCH_CHECK_VALUE(!any || schedule->takes_delays, "dearcomm: schedule=", quoted(schedule->name),
                    " applies every bucket in the step of its backward; delays apply to ", joined(takers, " or "));
  for (size_t b = 0; b < delays.size(); ++b) {
    TORCH_CHECK_VALUE(delays[b] >= 0, "dearcomm: bucket ", b, " has delay ", delays[b], "; delays are >= 0");
  }
  ScheduleChoice out = *this;
  out.config.bucket_delays = std::move(delays);
  return out;
}

}  // namespace dearcomm
