// The one list of schedules: names, their update strategies, options and
// factories. The user's names are resolved here once (resolve_schedule) into
// a ScheduleChoice that Python keeps (WrapOptions.choice) and hands back to
// build an engine or a simulation, so no name is parsed twice. Adding a
// schedule is its own file plus one entry in registry.cpp.
#pragma once

#include "schedule/policy.h"

#include <cstdint>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace dearcomm {

struct UpdateOption {
  std::string name;  // the user's wrap(update=...)
  UpdateStrategy strategy;
};

// A schedule's tunables (wrap(credit_mb=...)); 0 where the schedule has none.
struct PolicyConfig {
  int64_t credit_bytes = 0;
  // Per bucket, lower goes first (a planner's order, from wrap(priorities=)
  // through the layout); empty: bucket order, input side first.
  std::vector<int64_t> bucket_priorities;
  // Per bucket, how many iterations late its averages are applied (a
  // planner's choice, from wrap(delays=) through the layout; see
  // SchedulePolicy::delay); empty: none delayed.
  std::vector<int64_t> bucket_delays;
};

struct ScheduleInfo {
  std::string name;     // the user's wrap(schedule=...)
  std::string summary;  // one line, for docs and error messages
  std::vector<UpdateOption> updates;
  std::string default_update;  // one of `updates`
  std::function<std::unique_ptr<SchedulePolicy>(UpdateStrategy, const PolicyConfig&)> make;
  // wrap(partition_mb=None) means this; INT64_MAX: never split (the planner's kNoPartition)
  int64_t default_partition_bytes = INT64_MAX;
  int64_t default_credit_bytes = 0;                // 0: the schedule has no credit
  bool takes_priorities = false;                   // it queues buckets by PolicyConfig::bucket_priorities
  bool takes_delays = false;                       // it applies buckets late by PolicyConfig::bucket_delays
};

const std::vector<ScheduleInfo>& schedule_registry();

// wrap(schedule=, update=, credit_mb=), resolved: entries of the registry and
// the options with the schedule's defaults filled in.
struct ScheduleChoice {
  const ScheduleInfo* schedule = nullptr;
  const UpdateOption* update = nullptr;
  PolicyConfig config;

  std::unique_ptr<SchedulePolicy> make_policy() const { return schedule->make(update->strategy, config); }
  // This choice with a planner's per-bucket priorities (lower goes first);
  // ValueError for a schedule that does not queue by priority.
  ScheduleChoice with_bucket_priorities(std::vector<int64_t> priorities) const;
  // This choice with a planner's per-bucket delays (>= 0); ValueError for a
  // schedule that applies every bucket on time.
  ScheduleChoice with_bucket_delays(std::vector<int64_t> delays) const;
};

// Raises ValueError for an unknown name or a credit the schedule has no use
// for, NotImplementedError (naming the valid combinations) for an update the
// schedule does not support. No update: the schedule's default; no credit:
// the schedule's default (if it has one).
ScheduleChoice resolve_schedule(const std::string& schedule, const std::optional<std::string>& update,
                                std::optional<int64_t> credit_bytes = std::nullopt);

}  // namespace dearcomm
