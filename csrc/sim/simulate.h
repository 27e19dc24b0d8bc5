// A schedule run on the simulated device: the executor and the policy that
// train (core/executor.h, schedule/), driven as dearcomm's hooks drive them,
// on a virtual clock. Standard C++ only.
//
// Each iteration: the forward runs the modules in order, each first making
// its buckets current (require_bucket); the backward runs them in reverse,
// each module's parameters becoming ready where the profile places them in
// its backward (all at its end where it does not); then
// end_backward, step() (the update at step: the shard, or the whole model,
// or nothing for an update before use) and end_step. One more forward after
// the last iteration consumes what its step left pending.
#pragma once

#include "core/layout.h"
#include "core/states.h"
#include "schedule/policy.h"
#include "sim/cost_model.h"
#include "sim/profile.h"
#include "sim/sim_device.h"

#include <memory>
#include <vector>

namespace dearcomm::sim {

struct Result {
  // Steady state: from the start of the last iteration's forward to the start
  // of the forward after it (timeline_s), or the host CPU that iteration
  // needs (cpu_s) where that is longer: where the ranks fill the cores, the
  // iteration cannot take less time than its compute work and its
  // collectives' CPU together (0 per byte where collectives run elsewhere),
  // for the slowest rank of the iteration (CostModel::slowest_rank_factor).
  double iteration_s = 0.0;
  double timeline_s = 0.0;
  double cpu_s = 0.0;
  std::vector<double> iteration_starts_s;  // one per iteration, and one for the final forward
  std::vector<SimOp> ops;                  // every collective, in the order waited for
  std::vector<Span> spans;                 // compute, in order
  std::vector<Transition> records;         // the executor's state changes, whole run
};

Result simulate(const core::Layout& layout, const Profile& profile, std::unique_ptr<SchedulePolicy> policy,
                const CostModel& cost, int64_t iterations);

}  // namespace dearcomm::sim
