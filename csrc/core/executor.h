// The executor: every decision of an iteration, in standard C++ only (no
// tensors, no clock, no backend). Events come in (a gradient arrived, backward
// ended, step(), a forward needs bucket b, sync()); the schedule policy
// (schedule/policy.h) turns them into collectives, the update strategy's
// timing (core/update_timing.h) into updates, and the executor validates each
// against the state table (core/states.h) and has a Device carry it out.
// The real device (engine/engine.h) and the simulated one (sim/) run the same
// executor, so a prediction runs the very code that trains.
//
// One iteration, schedule "dear" (buckets numbered in forward order):
//   backward  gradients arrive, last layers first; bucket b is *eligible* once
//             it and every later bucket are complete -> RS(B-1) ... RS(0)
//   step()    wait every RS (averages); the optimizer updates the shards;
//             then AG(0), AG(1), ..., AG(B-1) issued, running in that order
//   forward   module of bucket b starts -> wait AG(b) [replicated: update b]
// Every pending gather is finished before the next backward's first reduction.
//
// A policy may delay a bucket (SchedulePolicy::delay): its reduction then
// stays in flight across step() in its own buffer slot, and a later step()
// applies it; the bucket's slots take turns, one per iteration.
//
// Single-threaded by contract: hooks and step() run on the training thread.
#pragma once

#include "core/device.h"
#include "core/layout.h"
#include "core/states.h"
#include "core/update_timing.h"
#include "schedule/policy.h"

#include <memory>
#include <string>
#include <vector>

namespace dearcomm::core {

class Executor {
 public:
  // `names`: one per parameter, for errors; `rank`: for errors too.
  Executor(Layout layout, std::vector<std::string> names, std::unique_ptr<SchedulePolicy> policy, Device& device,
           int rank);
  Executor(const Executor&) = delete;  // its Completions point into layout_
  Executor& operator=(const Executor&) = delete;

  // ---- backward --------------------------------------------------------
  // A gradient arrived (the first of a backward begins it; one in kGathering
  // first makes every bucket current; one after a complete backward, before
  // step(), begins another whose reductions add to the first's, as with DDP).
  // Issues what the policy returns for every bucket that became eligible.
  void grad_ready(int64_t param);
  // Parameters without a gradient so far in this backward.
  std::vector<int64_t> missing_grads() const;
  // Raises std::invalid_argument, naming them, if some got no gradient.
  void check_backward_complete() const;
  // Backward is over: checks it is complete, issues what the policy held
  // back, and waits for the reductions where the policy says so, or where
  // they read memory the user may write next. Idempotent.
  void end_backward();

  // ---- step ------------------------------------------------------------
  // The averages are needed now (clipping, GradScaler): waits for every
  // reduction. Idempotent within a step.
  void finish_reductions();
  // optimizer.step() begins: waits for the reductions unless the policy
  // leaves them to the next forward and nothing else needs them.
  void begin_step(bool averages_needed);
  // optimizer.step() ends (after the update): issues what the next forward
  // consumes, or, with nothing left pending, ends the iteration.
  void end_step();
  // A step whose update is skipped (GradScaler found inf/NaN on some rank,
  // or zero_grad() between backward and step()): its gathers still go out and
  // are waited for; the iteration ends with the parameters current.
  void skip_step();

  // ---- forward ---------------------------------------------------------
  // Makes bucket `bucket` current (waits for it, applies its update).
  void require_bucket(int64_t bucket);
  // Makes every bucket current (eval, state_dict, sync()) and leaves no
  // reduction in flight: a delayed one's averages stay in its slot until the
  // step that applies them.
  void flush();

  // Between steps (state kIdle), after a flush: the slots of bucket
  // `bucket` whose averages later steps apply, oldest first (a delayed
  // bucket's last `delay` backwards; none in the first ones, or undelayed).
  // A checkpoint saves them. Raises std::logic_error mid-iteration or while
  // one is still being reduced.
  std::vector<int64_t> pending_slots(int64_t bucket) const;

  IterationState state() const { return machine_.iteration(); }
  // Of the bucket's slot in this iteration.
  BucketState bucket_state(int64_t bucket) const;
  // The buffer slot of bucket `bucket`'s gradients in backward `iteration`.
  int64_t slot(int64_t bucket, int64_t iteration) const;
  int64_t num_slots(int64_t bucket) const { return delay_.at(bucket) + 1; }
  const SchedulePolicy& policy() const { return *policy_; }
  const UpdateTiming& timing() const { return timing_; }
  const Layout& layout() const { return layout_; }
  // Buckets a forward needed before their gather was issued (stays 0).
  int64_t prefetch_misses() const { return prefetch_misses_; }
  // The state changes (core/states.h), recorded while on; off by default.
  void set_recording(bool on) { machine_.set_recording(on); }
  std::vector<Transition> take_records() { return machine_.take_records(); }

 private:
  void begin_backward(bool again);
  void backward_again(int64_t param);
  void issue(const std::vector<Op>& ops);
  void wait_reduction(int64_t bucket, int64_t slot);
  void use_averages(int64_t bucket);
  void step_done(int64_t bucket);
  void leave_pending(const std::vector<Op>& gathers);
  void make_current(int64_t bucket);
  void apply(int64_t bucket);
  bool all_current() const;
  int64_t this_slot(int64_t bucket) const { return slot(bucket, iteration_); }
  // Whether the policy's reductions have finished by `moment` (the wait table, core/states.cpp).
  bool finished_by(Moment moment) const { return reductions_finished_by(waited_, moment); }
  // The iteration whose averages this step applies to bucket `bucket` (< 0: none yet).
  int64_t due_iteration(int64_t bucket) const { return iteration_ - delay_[bucket]; }
  void check_bucket_index(int64_t bucket) const;
  void check_delays() const;

  Layout layout_;
  std::vector<std::string> names_;
  std::unique_ptr<SchedulePolicy> policy_;
  Device& device_;
  const int rank_;
  const Collective reduction_;
  const ReductionsWaited waited_;
  const UpdateTiming timing_;
  const std::vector<int64_t> delay_;   // per bucket, the policy's
  StateMachine machine_;
  std::vector<int64_t> bucket_bytes_;  // what the policy weighs
  int64_t iteration_ = -1;             // the latest backward's number

  // This backward:
  std::vector<bool> grad_ready_;  // per parameter
  std::vector<int64_t> ready_;    // per bucket: parameters overlapping it whose gradient arrived
  int64_t next_eligible_ = 0;     // eligibility order is B-1, ..., 0: counts eligible buckets
  bool backward_ended_ = false;
  Completion reduced_;            // averages_to_grad: parameters all of whose buckets are reduced
  // This step's gathers:
  int64_t next_gather_ = 0;       // issue order is 0, 1, ..., B-1
  Completion current_;            // update_when_current: parameters all of whose buckets are current
  bool update_skipped_ = false;   // within skip_step(): its gathers make buckets current without an update
  int64_t prefetch_misses_ = 0;
};

}  // namespace dearcomm::core
