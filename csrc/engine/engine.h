// The executor: fused buckets of gradients and the collectives a schedule
// policy (schedule/policy.h) asks for, issued in the order it asks.
//
// Device-agnostic: all communication goes through a CommBackend, all data
// movement through ATen ops, so the CPU (gloo) and NCCL paths share this file.
//
// One iteration, schedule "dear" (buckets are numbered in forward order):
//
//   backward   grads ready, last layers first -> RS(bucket B-1) ... RS(bucket 0)
//   step()     wait every RS, average; sharded: optimizer on the 1/p shard;
//              then AG(0), AG(1), ..., AG(B-1) issued, running in that order
//   forward    module of bucket b starts -> wait AG(b) [replicated: update b]
//
// Schedule "wfbp" (DDP/Horovod): AR(bucket) during backward, wait all when
// backward returns, the user's optimizer updates full parameters in step(),
// nothing in forward.
//
// Schedule "bytescheduler": AR(bucket) as a priority queue under a credit on
// bytes in flight releases them during backward (the rest when it ends, input
// side first; in flight per the link model every rank agrees on, link_meter.h);
// step() waits for nothing; forward: module of bucket b -> wait AR(b), update
// the parameters all of whose buckets are reduced. (schedule/*.cpp say what
// each schedule decides.)
//
// The policy decides which collective runs on which bucket, and when; the
// engine owns the buffers, ready counts, backend calls, waits and tracing. It
// feeds the policy rank-independent events only (a bucket becomes eligible
// once it and every later bucket are complete), so every rank launches the
// same collectives in the same order; every pending all-gather is issued and
// finished before the next backward's first reduction.
// Single-threaded by contract: hooks and step() run on the training thread.
#pragma once

#include "bucket_layout.h"
#include "buffers.h"
#include "comm_backend.h"
#include "link_meter.h"
#include "schedule/policy.h"

#include <ATen/core/Tensor.h>

#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace dearcomm {

class Update;

// Where the iteration stands. Changed only by the transition methods below.
enum class IterationState {
  kIdle,       // parameters current, nothing in flight; next: backward
  kBackward,   // gradients arriving, reductions launched in bucket order
  kReduced,    // every reduction finished and averaged; the optimizer may run
  kGathering,  // all-gathers (bytescheduler: reductions) pending, consumed by the next forward's hooks
};

// One collective on the timeline (steady_clock ns; -1 where unknown).
struct TraceEvent {
  std::string kind;  // "reduce_scatter", "all_gather", "all_reduce"
  int64_t bucket;
  int64_t launched_ns;
  int64_t completed_ns;   // from the backend, if it reports it
  int64_t wait_begin_ns;  // the engine started waiting for it
  int64_t wait_end_ns;    // ... and was done (results usable)
};

enum class BucketState {
  kFilling,    // waiting for gradients of its parameters
  kReducing,   // reduce-scatter / all-reduce in flight
  kReduced,    // averaged gradient (shard) ready
  kGathering,  // all-gather in flight
  kCurrent,    // parameters up to date
};

const char* to_string(IterationState state);
const char* to_string(BucketState state);

struct EngineOptions {
  // Gradients travel in this dtype (e.g. bf16); Undefined: the parameters'.
  // Master shards and the optimizer stay fp32 either way.
  c10::ScalarType comm_dtype = c10::ScalarType::Undefined;
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  // Make .grad a view into its bucket wherever the bucket holds gradients as
  // they are (see Engine::grad_view); off only for A/B measurements and debugging.
  bool grad_views = true;
};

class Engine {
 public:
  // `params` and `names` are in forward order, as given to plan_buckets.
  Engine(BucketLayout layout,
         std::vector<at::Tensor> params,
         std::vector<std::string> names,
         std::shared_ptr<CommBackend> backend,
         std::unique_ptr<SchedulePolicy> policy,
         EngineOptions options);
  ~Engine();

  // ---- backward --------------------------------------------------------
  // Notes `grad` of parameter `param` for its bucket; tells the policy about
  // every bucket that became eligible and issues what it returns.
  void mark_grad_ready(int64_t param, const at::Tensor& grad);
  // Parameters without a gradient so far in this backward.
  std::vector<int64_t> missing_grads() const;
  // Raises, naming them, if some parameters got no gradient in this backward.
  void check_backward_complete() const;
  // Backward is over: checks it is complete and issues the ops the policy
  // held back until then. Idempotent; finish_reductions() calls it too.
  void end_backward();
  // The policy's answer. kWhenBackwardReturns: the runtime waits for them
  // then (it also does so where .grad views are what they read);
  // kInNextForward: step() leaves them running and the next forward waits for
  // them bucket by bucket (require_bucket).
  ReductionsWaited reductions_waited() const { return policy_->reductions_waited(); }
  UpdateStrategy update_strategy() const;
  // Parameters whose gradient the last backward copied into its bucket: those
  // whose .grad was not (yet) their bucket view. 0 in steady state with views.
  int64_t packed_params() const { return packed_params_; }

  // ---- gradients as bucket views (as DDP's gradient_as_bucket_view) -------
  // Where a bucket communicates gradients in the parameters' dtype without
  // pre-division, each parameter's .grad is made a tensor that aliases its slot
  // of the bucket: autograd's AccumulateGrad then adds straight into the bucket
  // and backward packs nothing. The alias shares the bucket's memory but has its
  // own version counter (it is not an autograd view), so step()'s check that
  // .grad was not changed after backward stays per parameter and the engine's
  // own writes to the bucket never count as the user's.
  // Undefined where the bucket cannot hold .grad as it is.
  at::Tensor grad_view(int64_t param) const;
  bool uses_grad_views() const;
  // zero_grad() for `params`' bucket views: a .grad that is its bucket view is
  // zero-filled in place and kept (one fill per bucket when all of its
  // parameters are selected), whatever `set_to_none` says. Between a backward
  // and the end of its reductions (a backward that raised) the buckets are
  // left alone: views are dropped. Returns the selected parameters whose .grad
  // is defined and no view, for the caller to give torch's zero_grad.
  std::vector<int64_t> zero_grads(const std::vector<int64_t>& params, bool set_to_none);

  // ---- step ------------------------------------------------------------
  // Waits for every reduction and averages. All-reduced buckets: the averaged
  // gradients are copied into each parameter's .grad for the user's optimizer.
  // Idempotent within a step (gradient clipping finishes the reductions early).
  void finish_reductions();
  // Issues the policy's step ops (dear: every all-gather, in bucket order); the
  // next forward's hooks wait for them bucket by bucket. The first call in
  // sharded mode makes parameters views into the gathered buffers. No ops
  // (wfbp): nothing to gather, back to kIdle. With reductions waited
  // kInNextForward (bytescheduler) it may come before finish_reductions(): the reductions are
  // then what the next forward waits for.
  void start_gathers();
  // Ends a step whose update is skipped (a GradScaler found inf/NaN on every
  // rank): nothing to gather, back to kIdle with the parameters unchanged.
  void skip_step();

  // ---- forward ---------------------------------------------------------
  // Makes bucket `bucket` current: waits for its all-gather and applies its
  // update (replicated). Other buckets keep gathering meanwhile.
  void require_bucket(int64_t bucket);
  // Completes every pending all-gather and update (eval, state_dict, sync()).
  void flush();

  // ---- sharded update --------------------------------------------------
  // This rank's part of the bucket's averaged gradient, as the update reads
  // it: its shard after a reduce-scatter (fp32 if sharded), the whole bucket
  // after an all-reduce (reduction() tells which). Not for .grad updates.
  at::Tensor grad_shard(int64_t bucket) const;
  Collective reduction() const { return reduction_; }
  at::Tensor master_shard(int64_t bucket) const;  // fp32 master parameters, this rank's shard
  // Re-reads master shards from the parameters (after a load_state_dict).
  void reload_master_shards();

  // Replicated update: parameter `param`'s averaged gradient (its shape and
  // dtype), valid from its all-gather until the next backward.
  at::Tensor averaged_grad(int64_t param) const;
  // Replicated update: called with the parameters whose every bucket has just
  // been gathered (each once per step); runs the optimizer on them, reading
  // averaged_grad.
  using UpdateFn = std::function<void(const std::vector<int64_t>&)>;
  void set_update_fn(UpdateFn fn) { update_fn_ = std::move(fn); }

  // Buckets a forward needed before their all-gather was issued (stays 0:
  // start_gathers() issues them all; tests check it).
  int64_t prefetch_misses() const { return prefetch_misses_; }

  // Timeline: off by default; when on, every collective leaves a TraceEvent.
  void set_tracing(bool on) { tracing_ = on; }
  std::vector<TraceEvent> take_trace();

  const BucketLayout& layout() const { return layout_; }
  IterationState state() const { return state_; }
  BucketState bucket_state(int64_t bucket) const;
  const CommBackend& backend() const { return *backend_; }
  // The link model this backward's policy got (bytes drained before each
  // tick, engine/link_meter.h); empty where there is none.
  const std::vector<int64_t>& link_model() const { return link_model_; }
  // Tests: every later backward runs on `drained` (one entry per bucket)
  // instead of a measured model; no more measuring or agreeing. Call it on
  // every rank, with the same figures, outside a backward.
  void pin_link_model(std::vector<int64_t> drained);

 private:
  struct Bucket;
  struct Flat;

  void issue(const std::vector<Op>& ops);
  void start_reduction(int64_t bucket);
  void finish_reduction(int64_t bucket);
  void start_gather(int64_t bucket);
  void finish_gather(int64_t bucket);
  // The bucket's averages are here (gathered, or all-reduced): to the
  // parameters' dtype, and the replicated update of every parameter whose
  // buckets are all current.
  void apply_averages(int64_t bucket);
  // Whatever the bucket still waits for (reduction, gather), then apply_averages.
  void make_current(int64_t bucket);
  void bind_params_to_gather_buffers();
  void mark_all_current();
  void copy_grads_to_params(int64_t bucket);
  void allocate_flat_buffers();
  const Flat& flat_of(int64_t param) const;
  at::Tensor param_view(const at::Tensor& flat, int64_t param) const;
  bool is_grad_view(int64_t param, const at::Tensor& grad) const;
  c10::ScalarType comm_dtype(int64_t bucket) const;
  double pre_divide(int64_t bucket) const;  // scale applied while packing
  [[noreturn]] void fail_collective(const char* what, int64_t bucket, const std::exception& e) const;
  void check_bucket_index(int64_t bucket) const;

  BucketLayout layout_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::shared_ptr<CommBackend> backend_;
  EngineOptions options_;
  std::unique_ptr<SchedulePolicy> policy_;
  Collective reduction_;            // the policy's, fixed: buffers are allocated for it
  std::unique_ptr<Update> update_;  // the policy's update strategy (update/update.h); likewise
  UpdateFn update_fn_;
  std::vector<bool> updated_;  // replicated: per parameter, this step's update ran

  std::vector<Flat> flats_;      // per flat buffer (one per dtype)
  std::vector<Bucket> buckets_;
  // Per parameter, this backward:
  std::vector<bool> grad_ready_;             // its gradient arrived
  std::vector<at::Tensor> arrived_;          // that gradient, until packed
  std::vector<bool> packed_;                 // in its bucket (packed, or accumulated there)
  std::vector<int64_t> unreduced_buckets_;   // its buckets whose reduction did not finish yet
  std::vector<at::Tensor> grad_views_;       // per parameter; undefined where impossible
  IterationState state_ = IterationState::kIdle;
  int64_t next_eligible_ = 0;     // eligibility order is B-1, B-2, ..., 0: counts eligible buckets
  bool backward_ended_ = false;   // end_backward() ran in this backward
  int64_t next_gather_ = 0;       // launch order is 0, 1, ..., B-1
  bool params_bound_ = false;
  int64_t prefetch_misses_ = 0;
  int64_t packed_params_ = 0;            // this backward, see packed_params()
  std::vector<int64_t> bucket_bytes_;  // per bucket, in its communication dtype: what the policy weighs
  // Policies that queue under a credit (uses_link_model): the meter, the sums
  // of its figures (one started at the end of each backward) and the agreed
  // model. The sum started at the end of backward i is adopted when backward
  // i + kLinkAgreementLag begins, and only then (sync() waits for the sums but
  // adopts none: it may run on one rank only), so every rank's backward n
  // runs on the same model. By then the device has normally finished the sum
  // even where it queued behind backward i's reductions (one NCCL stream), so
  // adopting it seldom makes the host wait for the device.
  static constexpr size_t kLinkAgreementLag = 2;
  struct LinkAgreement {
    std::unique_ptr<PendingSum> pending;  // null once waited for
    std::vector<int64_t> summed;
  };
  std::unique_ptr<LinkMeter> link_meter_;
  std::deque<LinkAgreement> link_agreements_;
  std::vector<int64_t> link_model_;
  void start_link_agreement();
  void adopt_link_agreements(size_t keep);
  void settle(LinkAgreement& agreement);
  bool tracing_ = false;
  std::vector<TraceEvent> trace_;
  void trace_wait(int64_t bucket, const char* kind, int64_t launched_ns, const PendingCollective& pending,
                  int64_t wait_begin_ns);
};

}  // namespace dearcomm
