// The real device: fused buckets of gradients in flat buffers, moved by a
// CommBackend (gloo through c10d on the CPU, NCCL on GPUs), driven by the
// executor (core/executor.h), which makes every decision of an iteration.
//
// The executor says which collective runs on which bucket and when, what is
// waited for and when a parameter is updated; this file owns the buffers
// (flat per dtype, .grad views, master shards: update/update.h says which
// exist), packs, launches, waits, averages and unpacks, and traces. The CPU
// and NCCL paths share it: they differ only behind CommBackend.
//
// Single-threaded by contract: hooks and step() run on the training thread.
#pragma once

#include "bucket_layout.h"
#include "buffers.h"
#include "comm_backend.h"
#include "core/device.h"
#include "core/executor.h"
#include "core/states.h"
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

// One collective on the timeline (steady_clock ns; -1 where unknown).
struct TraceEvent {
  std::string kind;  // "reduce_scatter", "all_gather", "all_reduce"
  int64_t bucket;
  int64_t launched_ns;
  int64_t completed_ns;   // from the backend, if it reports it
  int64_t wait_begin_ns;  // the engine started waiting for it
  int64_t wait_end_ns;    // ... and was done (results usable)
};

struct EngineOptions {
  // Gradients travel in this dtype (e.g. bf16); Undefined: the parameters'.
  // Master shards and the optimizer stay fp32 either way.
  c10::ScalarType comm_dtype = c10::ScalarType::Undefined;
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  // Make .grad a view into its bucket wherever the bucket holds gradients as
  // they are (see Engine::grad_view); off only for A/B measurements and debugging.
  bool grad_views = true;
};

class Engine final : private core::Device {
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
  // Backward is over: checks it is complete, issues the ops the policy held
  // back, and waits for the reductions where the policy says so (wfbp: .grad
  // holds averages when backward returns) or where they read .grad's memory,
  // which the user's code may write next. Idempotent.
  void end_backward();
  // The policy's answer (kInNextForward: step() leaves them running and the
  // next forward waits for them bucket by bucket).
  ReductionsWaited reductions_waited() const { return core_->policy().reductions_waited(); }
  UpdateStrategy update_strategy() const { return core_->policy().update_strategy(); }
  // Parameters whose gradient the last backward copied into its bucket: those
  // whose .grad was not (yet) their bucket view. 0 in steady state with views.
  int64_t packed_params() const { return packed_params_; }
  // Whether the backend serves this engine's all-reduces in issue order (on
  // CPU: where the schedule asked, needs_issue_order()).
  bool all_reduces_in_issue_order() const { return backend_->all_reduces_in_issue_order(); }

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
  // zero_grad() for `params`' bucket views. set_to_none: .grad becomes None
  // (the bucket is not touched; the next backward packs each new gradient into
  // its slot and points .grad at the view again). Otherwise a .grad that is its
  // bucket view is zero-filled in place and kept (one fill per bucket when all
  // of its parameters are selected), so the next backward accumulates into it;
  // between a backward and the end of its reductions (a backward that raised)
  // the buckets are left alone and the views replaced by zeros. Returns the
  // selected parameters whose .grad is defined and no view, for the caller to
  // give torch's zero_grad.
  std::vector<int64_t> zero_grads(const std::vector<int64_t>& params, bool set_to_none);

  // ---- step ------------------------------------------------------------
  // Waits for every reduction and averages (clipping and GradScaler need
  // them). All-reduced buckets with full_after_reduction: the averaged
  // gradients are copied into each parameter's .grad for the user's optimizer.
  // Idempotent within a step.
  void finish_reductions() { core_->finish_reductions(); }
  // optimizer.step() begins: waits for the reductions unless the schedule
  // leaves them to the next forward and nothing else needs the averages.
  void begin_step(bool averages_needed) { core_->begin_step(averages_needed); }
  // optimizer.step() ends, after the update: issues the policy's step ops
  // (dear: every all-gather, in bucket order), which the next forward's hooks
  // wait for bucket by bucket; none (wfbp): back to kIdle. The first one with
  // sharded_at_step makes parameters views into the gathered buffers.
  void end_step() { core_->end_step(); }
  // Ends a step whose update is skipped (a GradScaler found inf/NaN on every
  // rank): nothing to gather, back to kIdle with the parameters unchanged.
  void skip_step() { core_->skip_step(); }

  // ---- forward ---------------------------------------------------------
  // Makes bucket `bucket` current: waits for its all-gather and applies its
  // update (replicated). Other buckets keep gathering meanwhile.
  void require_bucket(int64_t bucket) { core_->require_bucket(bucket); }
  // Completes every pending all-gather and update (eval, state_dict, sync()).
  void flush() { core_->flush(); }

  // ---- sharded update --------------------------------------------------
  // This rank's part of the bucket's averaged gradient, as the update reads
  // it: its shard after a reduce-scatter (fp32 if sharded), the whole bucket
  // after an all-reduce (reduction() tells which). Not for .grad updates.
  at::Tensor grad_shard(int64_t bucket) const;
  // This rank's part of the bucket's averages, disjoint from the other
  // ranks' parts: a norm over them, summed over the ranks, is the global
  // norm (the shard of a reduce-scatter; of an all-reduce, its shard's range).
  at::Tensor own_part(int64_t bucket) const;
  Collective reduction() const { return reduction_; }
  at::Tensor master_shard(int64_t bucket) const;  // fp32 master parameters, this rank's shard
  // Re-reads the master shards of the buckets holding parameters `params`
  // from them (after a load_state_dict, or a write into them since the last
  // step); not while all-gathers are in flight.
  void reload_master_shards(const std::vector<int64_t>& params);

  // Replicated update: parameter `param`'s averaged gradient (its shape and
  // dtype), valid from its all-gather until the next backward.
  at::Tensor averaged_grad(int64_t param) const;
  // Between steps, after flush(): parameter `param`'s averaged gradients
  // that later steps apply (a delayed bucket's), oldest first, as copies in
  // its shape and dtype; what a checkpoint saves (core/executor.h).
  std::vector<at::Tensor> pending_averages(int64_t param) const;
  // Replicated update: called with the parameters whose every bucket has just
  // been gathered (each once per step); runs the optimizer on them, reading
  // averaged_grad.
  using UpdateFn = std::function<void(const std::vector<int64_t>&)>;
  void set_update_fn(UpdateFn fn) { update_fn_ = std::move(fn); }

  // Buckets a forward needed before their all-gather was issued (stays 0:
  // end_step() issues them all; tests check it).
  int64_t prefetch_misses() const { return core_->prefetch_misses(); }

  // Timeline: off by default; when on, every collective leaves a TraceEvent.
  void set_tracing(bool on) { tracing_ = on; }
  bool tracing() const { return tracing_; }
  std::vector<TraceEvent> take_trace();

  const BucketLayout& layout() const { return layout_; }
  IterationState state() const { return core_->state(); }
  BucketState bucket_state(int64_t bucket) const { return core_->bucket_state(bucket); }
  // The executor's state changes, in order (core/states.h); off by default.
  void set_recording(bool on) { core_->set_recording(on); }
  std::vector<Transition> take_records() { return core_->take_records(); }
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

  // ---- core::Device: what the executor has this device do ----------------
  std::vector<int64_t> begin_backward() override;
  void accept_grad(int64_t param) override;
  void eligible(int64_t bucket) override;
  void reductions_issued() override;
  bool reductions_read_user_memory() const override { return uses_grad_views(); }
  void issue(const Op& op) override;
  void wait(const Op& op) override;
  void averages_to_grad(int64_t bucket, int64_t slot, const std::vector<int64_t>& params) override;
  void no_averages(int64_t bucket, const std::vector<int64_t>& params) override;
  void averages_in(int64_t bucket) override;
  void update(int64_t bucket, const std::vector<int64_t>& params) override;
  void step_left_pending() override;
  void settle() override;

  void start_reduction(int64_t bucket, int64_t slot);
  void finish_reduction(int64_t bucket, int64_t slot);
  void start_gather(int64_t bucket);
  void finish_gather(int64_t bucket);
  void bind_params_to_gather_buffers();
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
  Collective reduction_;            // the policy's, fixed: buffers are allocated for it
  std::unique_ptr<Update> update_;  // the policy's update strategy's buffers (update/update.h); likewise
  UpdateFn update_fn_;

  std::vector<Flat> flats_;      // per flat buffer (one per dtype)
  std::vector<Bucket> buckets_;
  // Per parameter, this backward:
  at::Tensor incoming_;                      // the gradient mark_grad_ready is handing over
  std::vector<at::Tensor> arrived_;          // a gradient that arrived, until packed
  std::vector<bool> packed_;                 // in its bucket (packed, or accumulated there)
  std::vector<at::Tensor> grad_views_;       // per parameter; undefined where impossible
  bool params_bound_ = false;
  int64_t packed_params_ = 0;            // this backward, see packed_params()
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
  std::unique_ptr<core::Executor> core_;  // last: destroyed first, it refers to this device
  bool tracing_ = false;
  std::vector<TraceEvent> trace_;
  void trace_wait(int64_t bucket, const char* kind, int64_t launched_ns, const PendingCollective& pending,
                  int64_t wait_begin_ns);
};

}  // namespace dearcomm
