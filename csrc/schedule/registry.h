// The one list of schedules: names, their update strategies and factories.
// Python's option validation (dearcomm/_options.py, through _C.schedules())
// and the engine's construction both read it, so adding a schedule is its own
// file plus one entry in registry.cpp.
#pragma once

#include "schedule/policy.h"

#include <functional>
#include <string>
#include <vector>

namespace dearcomm {

struct UpdateOption {
  std::string name;  // the user's wrap(update=...)
  UpdateStrategy strategy;
};

struct ScheduleInfo {
  std::string name;     // the user's wrap(schedule=...)
  std::string summary;  // one line, for docs and error messages
  std::vector<UpdateOption> updates;
  std::string default_update;  // one of `updates`
  std::function<std::unique_ptr<SchedulePolicy>(UpdateStrategy)> make;
};

const std::vector<ScheduleInfo>& schedule_registry();

// The policy for wrap(schedule=, update=). Raises ValueError for an unknown
// name, NotImplementedError (naming the valid combinations) for an update the
// schedule does not support.
std::unique_ptr<SchedulePolicy> make_policy(const std::string& schedule, const std::string& update);

}  // namespace dearcomm
