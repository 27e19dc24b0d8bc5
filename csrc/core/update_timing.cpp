#include "core/update_timing.h"

namespace dearcomm::core {

UpdateTiming update_timing(UpdateStrategy strategy) {
  UpdateTiming timing;
  timing.averages_to_grad = strategy == UpdateStrategy::kFullAfterReduction;
  timing.update_when_current = strategy == UpdateStrategy::kReplicatedBeforeUse;
  timing.at_step = strategy == UpdateStrategy::kShardedAtStep         ? UpdateTiming::AtStep::kShard
                   : strategy == UpdateStrategy::kReplicatedBeforeUse ? UpdateTiming::AtStep::kNothing
                                                                      : UpdateTiming::AtStep::kEverything;
  return timing;
}

double UpdateTiming::share_at_step(int64_t world_size) const {
  switch (at_step) {
    case AtStep::kNothing: return 0.0;
    case AtStep::kShard: return 1.0 / static_cast<double>(world_size);
    case AtStep::kEverything: return 1.0;
  }
  return 1.0;
}

}  // namespace dearcomm::core
