#include "core/update_timing.h"

namespace dearcomm::core {

UpdateTiming update_timing(UpdateStrategy strategy) {
  UpdateTiming timing;
  timing.averages_to_grad = strategy == UpdateStrategy::kFullAfterReduction;
  timing.update_when_current = strategy == UpdateStrategy::kReplicatedBeforeUse;
  return timing;
}

}  // namespace dearcomm::core
