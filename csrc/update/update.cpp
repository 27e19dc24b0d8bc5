#include "update.h"

#include <c10/util/Exception.h>

namespace dearcomm {

std::unique_ptr<Update> make_update(UpdateStrategy strategy, Collective reduction) {
  TORCH_CHECK(reduction == Collective::kReduceScatter || reduction == Collective::kAllReduce,
      "dearcomm: a schedule policy reduces with ", to_string(reduction));
  const bool scattered = reduction == Collective::kReduceScatter;
  switch (strategy) {
    case UpdateStrategy::kShardedAtStep:
      if (scattered) {
        return make_sharded_update();
      }
      break;
    case UpdateStrategy::kReplicatedBeforeUse:
      return make_replicated_update(reduction);
    case UpdateStrategy::kFullAfterReduction:
      if (!scattered) {
        return make_full_update();
      }
      break;
  }
  TORCH_CHECK(false, "dearcomm: a schedule policy reduces with ", to_string(reduction), " but updates ",
              to_string(strategy));
}

}  // namespace dearcomm
