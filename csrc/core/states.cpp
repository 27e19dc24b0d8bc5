#include "core/states.h"

#include "core/check.h"

#include <stdexcept>

namespace dearcomm {
namespace {

using I = IterationState;
using B = BucketState;

struct IterationRow {
  I from;
  IterationEvent event;
  I to;
};

// Every change of an iteration's state. A backward begins from kIdle (the
// executor first makes everything current, a flush, when one begins in
// kGathering), or again from kReduced before step().
constexpr IterationRow kIterationTable[] = {
    {I::kIdle, IterationEvent::kBackwardBegins, I::kBackward},
    {I::kReduced, IterationEvent::kBackwardAgain, I::kBackward},
    {I::kBackward, IterationEvent::kReductionsWaited, I::kReduced},
    {I::kReduced, IterationEvent::kStepDone, I::kIdle},
    {I::kReduced, IterationEvent::kStepLeftPending, I::kGathering},
    {I::kBackward, IterationEvent::kStepLeftPending, I::kGathering},  // reductions waited in the next forward
    {I::kGathering, IterationEvent::kAllCurrent, I::kIdle},
};

struct BucketRow {
  B from;
  BucketAction action;
  B to;
};

constexpr BucketRow kBucketTable[] = {
    {B::kCurrent, BucketAction::kBackwardBegins, B::kFilling},
    {B::kReduced, BucketAction::kBackwardAgain, B::kFilling},
    {B::kFilling, BucketAction::kIssueReduction, B::kReducing},
    {B::kReducing, BucketAction::kWaitReduction, B::kReduced},
    {B::kReduced, BucketAction::kIssueGather, B::kGathering},
    {B::kGathering, BucketAction::kWaitGather, B::kCurrent},
    {B::kReduced, BucketAction::kApply, B::kCurrent},
    {B::kReduced, BucketAction::kStepDone, B::kCurrent},
};

struct WaitRow {
  ReductionsWaited where;
  Moment moment;
  bool finished;
};

// By when a policy's reductions have finished (a clipping, a GradScaler or a
// flush may finish them sooner: the executor's finish_reductions).
constexpr WaitRow kWaitTable[] = {
    {ReductionsWaited::kWhenBackwardReturns, Moment::kBackwardEnds, true},
    {ReductionsWaited::kWhenBackwardReturns, Moment::kStepBegins, true},
    {ReductionsWaited::kInStep, Moment::kBackwardEnds, false},
    {ReductionsWaited::kInStep, Moment::kStepBegins, true},
    {ReductionsWaited::kInNextForward, Moment::kBackwardEnds, false},
    {ReductionsWaited::kInNextForward, Moment::kStepBegins, false},
};

}  // namespace

bool reductions_finished_by(ReductionsWaited where, Moment moment) {
  for (const WaitRow& row : kWaitTable) {
    if (row.where == where && row.moment == moment) {
      return row.finished;
    }
  }
  throw std::logic_error(core::concat("dearcomm: internal error: no wait rule for ", to_string(where), " at ",
                                      to_string(moment)));
}

const char* to_string(Moment moment) {
  switch (moment) {
    case Moment::kBackwardEnds: return "backward_ends";
    case Moment::kStepBegins: return "step_begins";
  }
  return "?";
}

const char* to_string(IterationState state) {
  switch (state) {
    case I::kIdle: return "IDLE";
    case I::kBackward: return "BACKWARD";
    case I::kReduced: return "REDUCED";
    case I::kGathering: return "GATHERING";
  }
  return "?";
}

const char* to_string(BucketState state) {
  switch (state) {
    case B::kFilling: return "FILLING";
    case B::kReducing: return "REDUCING";
    case B::kReduced: return "REDUCED";
    case B::kGathering: return "GATHERING";
    case B::kCurrent: return "CURRENT";
  }
  return "?";
}

const char* to_string(IterationEvent event) {
  switch (event) {
    case IterationEvent::kBackwardBegins: return "backward_begins";
    case IterationEvent::kBackwardAgain: return "backward_again";
    case IterationEvent::kReductionsWaited: return "reductions_waited";
    case IterationEvent::kStepDone: return "step_done";
    case IterationEvent::kStepLeftPending: return "step_left_pending";
    case IterationEvent::kAllCurrent: return "all_current";
  }
  return "?";
}

const char* to_string(BucketAction action) {
  switch (action) {
    case BucketAction::kBackwardBegins: return "backward_begins";
    case BucketAction::kBackwardAgain: return "backward_again";
    case BucketAction::kIssueReduction: return "issue_reduction";
    case BucketAction::kWaitReduction: return "wait_reduction";
    case BucketAction::kIssueGather: return "issue_gather";
    case BucketAction::kWaitGather: return "wait_gather";
    case BucketAction::kApply: return "apply";
    case BucketAction::kStepDone: return "step_done";
  }
  return "?";
}

StateMachine::StateMachine(const std::vector<int64_t>& slots) {
  for (int64_t n : slots) {
    DEARCOMM_CORE_CHECK(n >= 1, std::invalid_argument, "dearcomm: a bucket has >= 1 buffer slots, got ", n);
    buckets_.emplace_back(n, BucketState::kCurrent);
  }
}

bool StateMachine::allowed(BucketState from, BucketAction action) {
  for (const BucketRow& row : kBucketTable) {
    if (row.from == from && row.action == action) {
      return true;
    }
  }
  return false;
}

void StateMachine::on(IterationEvent event) {
  for (const IterationRow& row : kIterationTable) {
    if (row.from == iteration_ && row.event == event) {
      iteration_ = row.to;
      record(-1, 0, static_cast<int>(event), B::kCurrent);
      return;
    }
  }
  throw std::logic_error(core::concat("dearcomm: internal error: iteration event ", to_string(event),
                                      " in state ", to_string(iteration_)));
}

void StateMachine::on(int64_t bucket, int64_t slot, BucketAction action) {
  BucketState& state = buckets_.at(bucket).at(slot);
  for (const BucketRow& row : kBucketTable) {
    if (row.from == state && row.action == action) {
      state = row.to;
      record(bucket, slot, static_cast<int>(action), state);
      return;
    }
  }
  throw std::logic_error(core::concat("dearcomm: internal error: ", to_string(action), " of bucket ", bucket,
                                      " (slot ", slot, ") in bucket state ", to_string(state)));
}

void StateMachine::record(int64_t bucket, int64_t slot, int event, BucketState state) {
  if (recording_) {
    records_.push_back({sequence_, iteration_, bucket, slot, event, state});
  }
  sequence_ += 1;
}

std::vector<Transition> StateMachine::take_records() {
  std::vector<Transition> out;
  out.swap(records_);
  return out;
}

}  // namespace dearcomm
