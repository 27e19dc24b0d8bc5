// When an update strategy acts, in the executor's events. What buffers it
// needs and where averages land is its device-side half (update/update.h).
//
//   sharded_at_step        step() updates this rank's master shard (the
//                          optimizer, between the reductions and the
//                          gathers); nothing per bucket.
//   replicated_before_use  a parameter is updated once its last bucket is
//                          current (gathered, or all-reduced), before the
//                          forward reads it.
//   full_after_reduction   a parameter's average goes to .grad once its last
//                          bucket is reduced; the user's optimizer runs in
//                          step(); nothing may be gathered.
#pragma once

#include "schedule/policy.h"

#include <cstdint>

namespace dearcomm::core {

struct UpdateTiming {
  bool averages_to_grad = false;     // at each reduction's wait
  bool update_when_current = false;  // at each bucket's arrival in the forward
  // What step() itself updates: nothing (each parameter is updated before
  // use), this rank's shard, or every parameter.
  enum class AtStep { kNothing, kShard, kEverything };
  AtStep at_step = AtStep::kEverything;
  // That share of the model's parameters, at `world_size` ranks.
  double share_at_step(int64_t world_size) const;
};

UpdateTiming update_timing(UpdateStrategy strategy);

}  // namespace dearcomm::core
