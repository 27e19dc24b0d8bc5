// The one list of schedules: names, their update strategies and factories.
// Python's option validation (dearcomm/_options.py, through _C.schedules())
// and the engine's construction both read it, so adding a schedule is its own
// file plus one entry in registry.cpp.
#pragma once

#include "schedule/policy.h"

#include <cstdint>

#include <functional>
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
};

const std::vector<ScheduleInfo>& schedule_registry();

// The policy for wrap(schedule=, update=, credit_mb=). Raises ValueError for
// an unknown name or a credit the schedule has no use for,
// NotImplementedError (naming the valid combinations) for an update the
// schedule does not support. credit_bytes 0: the schedule's default.
std::unique_ptr<SchedulePolicy> make_policy(const std::string& schedule, const std::string& update,
                                            int64_t credit_bytes = 0);

}  // namespace dearcomm
