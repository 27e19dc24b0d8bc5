// Where an iteration and each bucket stand, and the one table of transitions
// between them. The executor changes states only through StateMachine, which
// looks every change up in the tables of states.cpp (a change the table lacks
// is a bug of the executor or of a policy, and raises) and records it, with a
// sequence number, for tests and traces.
#pragma once

#include "schedule/policy.h"

#include <cstdint>
#include <vector>

namespace dearcomm {

enum class IterationState {
  kIdle,       // parameters current, nothing in flight; next: backward
  kBackward,   // gradients arriving, reductions issued as the policy asks
  kReduced,    // every reduction finished and averaged; the optimizer may run
  kGathering,  // step() is over; what the next forward consumes is in flight
               // (all-gathers; bytescheduler: its reductions)
};

// Of a bucket's buffer slot (one per bucket unless its policy delays it,
// SchedulePolicy::delay): its states are those of the gradients it holds.
enum class BucketState {
  kFilling,    // waiting for gradients of its parameters
  kReducing,   // reduce-scatter / all-reduce in flight
  kReduced,    // averaged gradient (shard) ready
  kGathering,  // all-gather in flight
  kCurrent,    // parameters up to date (a slot: free, its averages applied)
};

const char* to_string(IterationState state);
const char* to_string(BucketState state);

// What moves an iteration on.
enum class IterationEvent {
  kBackwardBegins,     // the first gradient of a backward
  kBackwardAgain,      // the first gradient of another backward before step()
  kReductionsWaited,   // every reduction finished and averaged
  kStepDone,           // step() left nothing for the next forward (wfbp, skipped step)
  kStepLeftPending,    // step() left gathers (or reductions) for the next forward
  kAllCurrent,         // the forward or a flush made every bucket current
};

// What happens to a bucket.
enum class BucketAction {
  kBackwardBegins,  // -> filling
  kBackwardAgain,   // reduced -> filling: another backward before step() reduces .grad again
  kIssueReduction,
  kWaitReduction,   // also averages
  kIssueGather,
  kWaitGather,
  kApply,           // averages in use without a gather (all-reduced, in the next forward)
  kStepDone,        // step() used the averages (wfbp) or skipped them: nothing to gather
};

const char* to_string(IterationEvent event);
const char* to_string(BucketAction action);

// Where a policy's reductions are waited (SchedulePolicy::reductions_waited)
// as the moments of an iteration by which all of them must have finished; the
// wait table in states.cpp is the one place that says what each wait point
// means. What is not finished by step() is waited by the next forward, bucket
// by bucket.
enum class Moment {
  kBackwardEnds,  // backward returns
  kStepBegins,    // optimizer.step() begins
};
const char* to_string(Moment moment);
bool reductions_finished_by(ReductionsWaited where, Moment moment);

// One change, as recorded: `bucket` is -1 for an iteration event.
struct Transition {
  int64_t sequence;
  IterationState iteration;  // the iteration's state after the change
  int64_t bucket;
  int64_t slot;              // the bucket's buffer slot (0 for an iteration event)
  int event;                 // IterationEvent or BucketAction, by `bucket`
  BucketState bucket_state;  // the slot's state after the change (unused for iteration events)
};

class StateMachine {
 public:
  // `slots`: per bucket, how many buffer slots it has (>= 1).
  explicit StateMachine(const std::vector<int64_t>& slots);

  IterationState iteration() const { return iteration_; }
  BucketState bucket(int64_t b, int64_t slot) const { return buckets_.at(b).at(slot); }
  int64_t num_buckets() const { return static_cast<int64_t>(buckets_.size()); }

  // Raise std::logic_error if the table has no such change.
  void on(IterationEvent event);
  void on(int64_t bucket, int64_t slot, BucketAction action);
  // Whether the table allows it (to give a clearer error first).
  static bool allowed(BucketState from, BucketAction action);

  // Off by default: a record per change costs an allocation now and then.
  void set_recording(bool on) { recording_ = on; }
  std::vector<Transition> take_records();

 private:
  void record(int64_t bucket, int64_t slot, int event, BucketState state);

  IterationState iteration_ = IterationState::kIdle;
  std::vector<std::vector<BucketState>> buckets_;  // per bucket, per slot
  int64_t sequence_ = 0;
  bool recording_ = false;
  std::vector<Transition> records_;
};

}  // namespace dearcomm
