#include "schedule/policy.h"

namespace dearcomm {

const char* to_string(Collective kind) {
  switch (kind) {
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kAllGather: return "all_gather";
    case Collective::kAllReduce: return "all_reduce";
  }
  return "?";
}

const char* to_string(UpdateStrategy strategy) {
  switch (strategy) {
    case UpdateStrategy::kShardedAtStep: return "sharded_at_step";
    case UpdateStrategy::kReplicatedBeforeUse: return "replicated_before_use";
    case UpdateStrategy::kFullAfterReduction: return "full_after_reduction";
  }
  return "?";
}

const char* to_string(ReductionsWaited where) {
  switch (where) {
    case ReductionsWaited::kWhenBackwardReturns: return "when_backward_returns";
    case ReductionsWaited::kInStep: return "in_step";
    case ReductionsWaited::kInNextForward: return "in_next_forward";
  }
  return "?";
}

}  // namespace dearcomm
