#include "core/executor.h"

#include "core/check.h"

#include <algorithm>
#include <stdexcept>

namespace dearcomm::core {
namespace {

// What each of the two checks that meet these mistakes says.
constexpr const char* kSecondGradient =
    "' got a second gradient before its backward ended: a parameter used both inside and outside a reentrant "
    "activation checkpoint (use_reentrant=False avoids it), or a backward that raised midway, then another (the "
    "ranks' collectives may no longer pair up: resume from a checkpoint in a new process)";
constexpr const char* kDelayedBackwardAgain =
    "' got a second gradient before optimizer.step(), which a schedule that delays buckets (deft) does not take: "
    "call optimizer.step() after every backward, sum the losses into one backward, or run the backwards that "
    "accumulate under model.no_sync() (Lightning's manual optimization: self.trainer.strategy.block_backward_sync())";
constexpr const char* kStepWithoutBackward =
    "dearcomm: optimizer.step() called without a backward since the last step (a backward inside model.no_sync() "
    "does not count: run the last micro-batch's backward outside it; zero_grad() between a backward and step() "
    "skips that step, so call it before backward or after step())";

std::vector<int64_t> delays_of(const SchedulePolicy* policy, int64_t num_buckets) {
  std::vector<int64_t> delays(num_buckets, 0);
  for (int64_t b = 0; policy && b < num_buckets; ++b) {
    delays[b] = policy->delay(b);
    DEARCOMM_CORE_CHECK(delays[b] >= 0, std::invalid_argument, "dearcomm: the schedule policy delays bucket ", b,
                        " by ", delays[b], " iterations");
  }
  return delays;
}

std::vector<int64_t> plus_one(std::vector<int64_t> delays) {
  for (int64_t& d : delays) {
    d += 1;
  }
  return delays;
}

}  // namespace

Executor::Executor(Layout layout, std::vector<std::string> names, std::unique_ptr<SchedulePolicy> policy,
                   Device& device, int rank)
    : layout_((layout.check(), std::move(layout))),
      names_(std::move(names)),
      policy_(std::move(policy)),
      device_(device),
      rank_(rank),
      reduction_(policy_ ? policy_->reduction() : Collective::kAllReduce),
      waited_(policy_ ? policy_->reductions_waited() : ReductionsWaited::kInStep),
      timing_(policy_ ? update_timing(policy_->update_strategy()) : UpdateTiming{}),
      delay_(delays_of(policy_.get(), layout_.num_buckets())),
      machine_(plus_one(delay_)),
      grad_ready_(layout_.params.size(), false),
      ready_(layout_.buckets.size(), 0),
      reduced_(layout_),
      current_(layout_) {
  DEARCOMM_CORE_CHECK(policy_, std::invalid_argument, "dearcomm: no schedule policy");
  DEARCOMM_CORE_CHECK(names_.size() == layout_.params.size(), std::invalid_argument, "dearcomm: ", names_.size(),
                      " names for ", layout_.params.size(), " parameters");
  DEARCOMM_CORE_CHECK(reduction_ == Collective::kReduceScatter || reduction_ == Collective::kAllReduce,
                      std::invalid_argument, "dearcomm: a schedule policy reduces with ", to_string(reduction_));
  for (const Layout::Bucket& bucket : layout_.buckets) {
    bucket_bytes_.push_back(bucket.bytes);
  }
  check_delays();
}

// What delays are supported today: averages to .grad, where a late average
// replaces what step() applies; parameters whose buckets share the delay.
void Executor::check_delays() const {
  bool any = false;
  for (int64_t p = 0; p < layout_.num_params(); ++p) {
    const Layout::Param& span = layout_.params[p];
    for (int64_t b = span.first_bucket; b <= span.last_bucket; ++b) {
      any = any || delay_[b] > 0;
      DEARCOMM_CORE_CHECK(delay_[b] == delay_[span.first_bucket], std::invalid_argument, "dearcomm: parameter '",
                          names_[p], "' spans buckets ", span.first_bucket, " to ", span.last_bucket,
                          ", which the schedule policy delays differently");
    }
  }
  DEARCOMM_CORE_CHECK(!any || (timing_.averages_to_grad && finished_by(Moment::kStepBegins)),
                      std::invalid_argument, "dearcomm: a schedule policy delays buckets with update strategy ",
                      to_string(policy_->update_strategy()), " and reductions waited ",
                      to_string(policy_->reductions_waited()), "; delays need full_after_reduction, waited by step()");
}

int64_t Executor::slot(int64_t bucket, int64_t iteration) const {
  return iteration < 0 ? 0 : iteration % num_slots(bucket);
}

std::vector<int64_t> Executor::pending_slots(int64_t bucket) const {
  check_bucket_index(bucket);
  DEARCOMM_CORE_CHECK(state() == IterationState::kIdle, std::logic_error, "dearcomm: delayed gradients are read "
                      "(optimizer.state_dict()) between steps, after optimizer.step(); the iteration is in state ",
                      to_string(state()));
  std::vector<int64_t> slots;
  for (int64_t i = std::max<int64_t>(0, iteration_ - delay_[bucket] + 1); i <= iteration_; ++i) {
    const int64_t s = slot(bucket, i);
    DEARCOMM_CORE_CHECK(machine_.bucket(bucket, s) == BucketState::kReduced, std::logic_error, "dearcomm: bucket ",
                        bucket, "'s averages of iteration ", i, " are ", to_string(machine_.bucket(bucket, s)),
                        "; flush() first");
    slots.push_back(s);
  }
  return slots;
}

BucketState Executor::bucket_state(int64_t bucket) const {
  check_bucket_index(bucket);
  return machine_.bucket(bucket, this_slot(bucket));
}

void Executor::check_bucket_index(int64_t bucket) const {
  DEARCOMM_CORE_CHECK(bucket >= 0 && bucket < layout_.num_buckets(), std::out_of_range, "dearcomm: bucket ", bucket,
                      " out of range [0, ", layout_.num_buckets(), ")");
}

// ---- backward ------------------------------------------------------------

void Executor::grad_ready(int64_t param) {
  DEARCOMM_CORE_CHECK(param >= 0 && param < layout_.num_params(), std::out_of_range, "dearcomm: parameter index ",
                      param, " out of range");
  if (state() == IterationState::kGathering) {
    flush();  // every pending gather goes out before this backward's first reduction
  }
  DEARCOMM_CORE_CHECK(state() != IterationState::kReduced || backward_ended_, std::logic_error,
                      "dearcomm: internal error: reductions finished before the end of their backward");
  if (backward_ended_ && (state() == IterationState::kBackward || state() == IterationState::kReduced)) {
    backward_again(param);  // another backward before step(), as DDP takes it
  } else if (state() == IterationState::kIdle) {
    begin_backward(false);
  }
  DEARCOMM_CORE_CHECK(state() == IterationState::kBackward, std::runtime_error, "dearcomm: the gradient of '",
                      names_[param], "' arrived in state ", to_string(state()),
                      "; backward must not run inside optimizer.step()");
  DEARCOMM_CORE_CHECK(!grad_ready_[param], std::runtime_error, "dearcomm: parameter '", names_[param],
                      kSecondGradient);
  device_.accept_grad(param);
  grad_ready_[param] = true;
  const Layout::Param& span = layout_.params[param];
  for (int64_t b = span.first_bucket; b <= span.last_bucket; ++b) {
    ready_[b] += 1;
  }
  // Buckets become eligible in descending order on every rank, whatever order
  // the gradients arrive in: the policy sees the same events everywhere.
  const int64_t num_buckets = layout_.num_buckets();
  while (next_eligible_ < num_buckets) {
    const int64_t b = num_buckets - 1 - next_eligible_;
    if (ready_[b] < layout_.buckets[b].num_params) {
      break;
    }
    next_eligible_ += 1;
    device_.eligible(b);
    issue(policy_->on_eligible(b));
  }
}

void Executor::begin_backward(bool again) {
  std::vector<int64_t> link_model = device_.begin_backward();  // first: if it raises, no backward has begun
  iteration_ += 1;
  grad_ready_.assign(grad_ready_.size(), false);
  ready_.assign(ready_.size(), 0);
  for (int64_t b = 0; b < layout_.num_buckets(); ++b) {
    machine_.on(b, this_slot(b), again ? BucketAction::kBackwardAgain : BucketAction::kBackwardBegins);
  }
  reduced_.reset();
  next_eligible_ = 0;
  backward_ended_ = false;
  machine_.on(again ? IterationEvent::kBackwardAgain : IterationEvent::kBackwardBegins);
  policy_->begin_iteration(bucket_bytes_, link_model);
}

// A backward after a complete one, before step() (a GAN's discriminator:
// real, then fake samples). As with DDP, .grad accumulates and step()
// applies the sum of the backwards' averages: each backward reduces what
// .grad holds when its gradients arrive. Where the first one's averages went
// to .grad (all-reduce, waited) that is avg(g1) + g2 on this rank, which
// averages to avg(g1) + avg(g2); where they did not (a reduce-scatter's
// shard, or reductions still in flight, which read a packed copy), .grad
// holds g1 + g2, which averages to the same. Those still in flight are
// waited for and their averages left unused.
void Executor::backward_again(int64_t param) {
  const bool delayed = std::any_of(delay_.begin(), delay_.end(), [](int64_t d) { return d > 0; });
  DEARCOMM_CORE_CHECK(!delayed, std::runtime_error, "dearcomm: parameter '", names_[param], kDelayedBackwardAgain);
  if (state() == IterationState::kBackward) {
    for (int64_t b = 0; b < layout_.num_buckets(); ++b) {
      if (machine_.bucket(b, this_slot(b)) == BucketState::kReducing) {
        wait_reduction(b, this_slot(b));
      }
    }
    machine_.on(IterationEvent::kReductionsWaited);
  }
  begin_backward(true);
}

void Executor::issue(const std::vector<Op>& ops) {
  for (Op op : ops) {
    check_bucket_index(op.bucket);
    op.slot = this_slot(op.bucket);
    const BucketState state = machine_.bucket(op.bucket, op.slot);
    if (op.kind == Collective::kAllGather) {
      DEARCOMM_CORE_CHECK(!timing_.averages_to_grad && state == BucketState::kReduced, std::runtime_error,
                          "dearcomm: the schedule policy all-gathers bucket ", op.bucket, " in bucket state ",
                          to_string(state));
      device_.issue(op);
      machine_.on(op.bucket, op.slot, BucketAction::kIssueGather);
      next_gather_ = op.bucket + 1;
    } else {
      DEARCOMM_CORE_CHECK(op.kind == reduction_ && state == BucketState::kFilling &&
                              ready_[op.bucket] == layout_.buckets[op.bucket].num_params,
                          std::runtime_error, "dearcomm: the schedule policy issues ", to_string(op.kind),
                          " of bucket ", op.bucket, " in bucket state ", to_string(state), " (its reduction is ",
                          to_string(reduction_), " once every gradient of the bucket arrived)");
      device_.issue(op);
      machine_.on(op.bucket, op.slot, BucketAction::kIssueReduction);
    }
  }
}

std::vector<int64_t> Executor::missing_grads() const {
  std::vector<int64_t> missing;
  if (state() == IterationState::kBackward) {
    for (int64_t p = 0; p < layout_.num_params(); ++p) {
      if (!grad_ready_[p]) {
        missing.push_back(p);
      }
    }
  }
  return missing;
}

void Executor::check_backward_complete() const {
  const std::vector<int64_t> missing = missing_grads();
  if (missing.empty()) {
    return;
  }
  std::string names;
  for (size_t i = 0; i < missing.size() && i < 8; ++i) {
    names += concat(i ? ", " : "", "'", names_[missing[i]], "'");
  }
  throw std::invalid_argument(concat(
      "dearcomm: [rank ", rank_, "] ", missing.size(), " parameter(s) got no gradient in this backward: ", names,
      (missing.size() > 8 ? ", ..." : ""),
      ". Every parameter that requires grad must take part in the loss (freeze unused ones with "
      "requires_grad_(False) before wrap), or pass find_unused_parameters=True (to wrap(), Lightning's "
      "DearStrategy() or Accelerate's prepare()) where some backwards leave parameters out"));
}

void Executor::end_backward() {
  if (state() != IterationState::kBackward || backward_ended_) {
    return;
  }
  check_backward_complete();
  backward_ended_ = true;
  issue(policy_->at_end_of_backward());
  for (int64_t b = 0; b < layout_.num_buckets(); ++b) {
    DEARCOMM_CORE_CHECK(machine_.bucket(b, this_slot(b)) != BucketState::kFilling, std::runtime_error,
                        "dearcomm: the schedule policy never issued the reduction of bucket ", b);
  }
  device_.reductions_issued();
  if (finished_by(Moment::kBackwardEnds) || device_.reductions_read_user_memory()) {
    finish_reductions();
  }
}

// ---- step ----------------------------------------------------------------

void Executor::finish_reductions() {
  if (state() == IterationState::kReduced) {
    return;  // already finished, e.g. by gradient clipping before step()
  }
  DEARCOMM_CORE_CHECK(state() != IterationState::kIdle && state() != IterationState::kGathering, std::runtime_error,
                      kStepWithoutBackward);
  end_backward();
  if (state() == IterationState::kReduced) {
    return;  // end_backward waited for them
  }
  for (int64_t b = layout_.num_buckets() - 1; b >= 0; --b) {
    use_averages(b);
  }
  machine_.on(IterationEvent::kReductionsWaited);
}

void Executor::wait_reduction(int64_t b, int64_t slot) {
  device_.wait({reduction_, b, slot});
  machine_.on(b, slot, BucketAction::kWaitReduction);
}

// The averages this step applies of bucket `b`: those of the iteration its
// delay points to (none yet in the first `delay` iterations). A flush may
// have waited for them already.
void Executor::use_averages(int64_t b) {
  const int64_t due = due_iteration(b);
  const int64_t due_slot = slot(b, due);
  if (due >= 0 && machine_.bucket(b, due_slot) == BucketState::kReducing) {
    wait_reduction(b, due_slot);
  }
  if (!timing_.averages_to_grad) {
    return;
  }
  const std::vector<int64_t> params = reduced_.done(b);
  if (due >= 0) {
    device_.averages_to_grad(b, due_slot, params);
  } else {
    device_.no_averages(b, params);
  }
}

// step() is over without gathers: the slot whose averages it applied (or
// skipped) is free again.
void Executor::step_done(int64_t b) {
  const int64_t due = due_iteration(b);
  if (due >= 0) {
    machine_.on(b, slot(b, due), BucketAction::kStepDone);
  }
}

void Executor::begin_step(bool averages_needed) {
  DEARCOMM_CORE_CHECK(state() != IterationState::kIdle && state() != IterationState::kGathering, std::runtime_error,
                      kStepWithoutBackward);
  if (averages_needed || finished_by(Moment::kStepBegins)) {
    finish_reductions();
  }
}

void Executor::end_step() {
  const bool in_forward = !finished_by(Moment::kStepBegins);  // the next forward waits for them
  const bool reductions_pending = in_forward && state() == IterationState::kBackward;
  DEARCOMM_CORE_CHECK(state() == IterationState::kReduced || reductions_pending, std::runtime_error,
                      "dearcomm: the step's gathers need finished reductions, state is ", to_string(state()));
  if (reductions_pending) {
    end_backward();  // every reduction issued; the forward waits for them bucket by bucket
  }
  const std::vector<Op> ops = policy_->at_step(layout_.num_buckets());
  if (ops.empty() && !in_forward) {
    for (int64_t b = 0; b < layout_.num_buckets(); ++b) {
      step_done(b);  // the user's optimizer updated full parameters in step()
    }
    machine_.on(IterationEvent::kStepDone);
    return;
  }
  leave_pending(ops);
}

// The step's gathers (or, with none, the reductions) are left to the next forward.
void Executor::leave_pending(const std::vector<Op>& gathers) {
  device_.step_left_pending();
  machine_.on(IterationEvent::kStepLeftPending);
  // Nothing to gather (the reductions are what the forward waits for): no gather is missing.
  next_gather_ = gathers.empty() ? layout_.num_buckets() : 0;
  current_.reset();
  // Issued here, at the same point of the program on every rank; a hook only
  // waits (see schedule/dear.cpp). The devices run them in issue order.
  issue(gathers);
}

void Executor::skip_step() {
  DEARCOMM_CORE_CHECK(state() == IterationState::kReduced, std::runtime_error,
                      "dearcomm: a step can be skipped only after the reductions finished, state is ",
                      to_string(state()));
  const std::vector<Op> gathers = policy_->at_step(layout_.num_buckets());
  if (gathers.empty()) {
    for (int64_t b = 0; b < layout_.num_buckets(); ++b) {
      step_done(b);  // nothing was updated: the parameters are still current
    }
    machine_.on(IterationEvent::kStepDone);
    return;
  }
  // The gathers a step issues, issued anyway: they carry the shards as they
  // are (sharded) or averages that are not applied (replicated). A rank that
  // skips alone, while the others step, then still pairs every collective
  // with theirs: no size mismatch, no reduce-scatter read as an all-gather.
  // Waited for here, so the parameters are current when the skip returns
  // (a write into them right after, such as a rollback, is kept).
  update_skipped_ = true;
  struct Reset {
    bool& flag;
    ~Reset() { flag = false; }
  } reset{update_skipped_};
  leave_pending(gathers);
  flush();
}

// ---- forward -------------------------------------------------------------

void Executor::require_bucket(int64_t b) {
  if (state() != IterationState::kGathering) {
    return;
  }
  check_bucket_index(b);
  if (next_gather_ <= b) {
    prefetch_misses_ += 1;  // not issued yet: end_step() issues every bucket, so this is a bug
  }
  while (next_gather_ <= b) {
    issue({{Collective::kAllGather, next_gather_}});
  }
  make_current(b);
  if (all_current()) {
    machine_.on(IterationEvent::kAllCurrent);
  }
}

bool Executor::all_current() const {
  for (int64_t b = 0; b < layout_.num_buckets(); ++b) {
    if (machine_.bucket(b, this_slot(b)) != BucketState::kCurrent) {
      return false;
    }
  }
  return true;
}

void Executor::flush() {
  device_.settle();
  for (int64_t b = 0; b < layout_.num_buckets(); ++b) {
    if (delay_[b] == 0) {
      continue;  // an undelayed reduction in flight is this backward's, waited as usual
    }
    for (int64_t s = 0; s < num_slots(b); ++s) {
      if (machine_.bucket(b, s) == BucketState::kReducing) {
        wait_reduction(b, s);  // its averages wait in the slot for their step
      }
    }
  }
  if (state() != IterationState::kGathering) {
    return;
  }
  while (next_gather_ < layout_.num_buckets()) {
    issue({{Collective::kAllGather, next_gather_}});
  }
  for (int64_t b = 0; b < layout_.num_buckets(); ++b) {
    make_current(b);
  }
  machine_.on(IterationEvent::kAllCurrent);
}

void Executor::make_current(int64_t b) {
  const int64_t s = this_slot(b);
  if (machine_.bucket(b, s) == BucketState::kReducing) {  // a reduction left running by step() (kInNextForward)
    use_averages(b);
  }
  if (machine_.bucket(b, s) == BucketState::kGathering) {
    device_.wait({Collective::kAllGather, b, s});
    machine_.on(b, s, BucketAction::kWaitGather);
    apply(b);
  } else if (machine_.bucket(b, s) == BucketState::kReduced) {
    machine_.on(b, s, BucketAction::kApply);
    apply(b);
  }
}

void Executor::apply(int64_t b) {
  device_.averages_in(b);
  if (timing_.update_when_current) {
    const std::vector<int64_t> params = current_.done(b);
    if (!params.empty() && !update_skipped_) {
      device_.update(b, params);
    }
  }
}

}  // namespace dearcomm::core
