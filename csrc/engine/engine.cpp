#include "engine.h"

#include "common/error_text.h"
#include "update/update.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <algorithm>

namespace dearcomm {

// A profiler range named like "dearcomm::reduce_scatter[bucket 3]"; the name is
// only built while a profiler listens.
#define DEARCOMM_RANGE(phase, bucket)                                        \
  at::RecordFunction dearcomm_range_(at::RecordScope::USER_SCOPE);          \
  if (dearcomm_range_.isActive()) {                                          \
    dearcomm_range_.before(                                                  \
        std::string("dearcomm::") + (phase) + "[bucket " + std::to_string(bucket) + "]"); \
  }

// A collective on one of a bucket's buffer slots.
struct InFlight {
  std::unique_ptr<PendingCollective> pending;
  int64_t launched_ns = -1;  // timeline: when `pending` was launched
  std::shared_ptr<const Stamp> launch_stamp;  // link meter: the same, on the backend's clock
};

// A bucket's buffers (engine/buffers.h) and its collectives in flight.
struct Engine::Bucket : BucketBuffers {
  // Per buffer slot, the gradients: [0] is `grads`; a bucket the policy
  // delays has one more per iteration of delay (core/executor.h).
  std::vector<at::Tensor> slot_grads;
  std::vector<InFlight> in_flight;  // per slot
};

struct Engine::Flat : FlatBuffers {
  std::vector<at::Tensor> slot_grads;  // [0] is `grads`; more as its most delayed bucket needs
};

namespace {
// A tensor over `view`'s memory that is not an autograd view of it: it keeps
// the storage alive, but its version counter is its own.
at::Tensor alias_with_own_version(const at::Tensor& view) {
  return at::empty({0}, view.options()).set_(view.storage(), view.storage_offset(), view.sizes(), view.strides());
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

Engine::Engine(BucketLayout layout,
               std::vector<at::Tensor> params,
               std::vector<std::string> names,
               std::shared_ptr<CommBackend> backend,
               std::unique_ptr<SchedulePolicy> policy,
               EngineOptions options)
    : layout_(std::move(layout)),
      params_(std::move(params)),
      names_(std::move(names)),
      backend_(std::move(backend)),
      options_(options),
      arrived_(params_.size()),
      packed_(params_.size(), false),
      grad_views_(params_.size()) {
  TORCH_CHECK_VALUE(backend_, "dearcomm: no communication backend");
  TORCH_CHECK_VALUE(policy, "dearcomm: no schedule policy");
  reduction_ = policy->reduction();
  update_ = make_update(policy->update_strategy(), reduction_);  // raises if the reduction cannot feed it
  TORCH_CHECK_VALUE(params_.size() == layout_.params.size() && names_.size() == params_.size(),
      "dearcomm: the layout has ", layout_.params.size(), " parameters but the engine got ",
      params_.size(), " parameters and ", names_.size(), " names");
  TORCH_CHECK_VALUE(layout_.world_size == backend_->world_size(),
      "dearcomm: the layout was planned for world size ", layout_.world_size,
      " but the process group has ", backend_->world_size(), " ranks");

  for (size_t p = 0; p < params_.size(); ++p) {
    const ParamSlot& slot = layout_.params[p];
    const c10::ScalarType dtype = layout_.buckets.at(slot.bucket).dtype;
    TORCH_CHECK_VALUE(params_[p].numel() == slot.numel && params_[p].scalar_type() == dtype,
        "dearcomm: parameter '", names_[p], "' (", params_[p].numel(), " elements of ",
        params_[p].scalar_type(), ") does not match its slot in bucket ", slot.bucket, " (",
        slot.numel, " elements of ", dtype, ")");
  }
  const bool uses_link_model = policy->uses_link_model();
  if (policy->needs_issue_order()) {
    backend_->keep_issue_order();
  }
  // Before the buffers: they follow the executor's buffer slots. It calls no
  // device method until an event arrives.
  core::Device& device = *this;  // a private base: converted here, where it is accessible
  core_ = std::make_unique<core::Executor>(core_layout(layout_, options_.comm_dtype), names_, std::move(policy),
                                           device, backend_->rank());
  allocate_flat_buffers();
  const int64_t rank = backend_->rank();
  buckets_.resize(layout_.buckets.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const BucketSpec& spec = layout_.buckets[b];
    const Flat& flat = flats_[spec.buffer];
    Bucket& bucket = buckets_[b];
    auto range = [&](const at::Tensor& t) { return t.defined() ? t.narrow(0, spec.buffer_offset, spec.padded_numel) : t; };
    bucket.grads = range(flat.grads);
    bucket.gathered_comm = range(flat.gathered_comm);
    bucket.gathered = range(flat.gathered);
    bucket.params = range(flat.params);
    const int64_t slots = core_->num_slots(static_cast<int64_t>(b));
    for (int64_t s = 0; s < slots; ++s) {
      bucket.slot_grads.push_back(range(flat.slot_grads.at(s)));
    }
    bucket.in_flight.resize(slots);
    if (reduction_ == Collective::kReduceScatter) {
      bucket.grad_shard = at::zeros({spec.shard_numel}, bucket.grads.options());
    }
    update_->allocate(bucket, spec, rank);
  }
  if (uses_link_model) {
    link_meter_ = std::make_unique<LinkMeter>(static_cast<int64_t>(buckets_.size()));
    backend_->time_collectives();
  }
}

void Engine::allocate_flat_buffers() {
  flats_.resize(layout_.buffer_numels.size());
  std::vector<bool> done(flats_.size(), false);
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    const BucketSpec& spec = layout_.buckets[b];
    if (done[spec.buffer]) {
      continue;
    }
    done[spec.buffer] = true;
    Flat& flat = flats_[spec.buffer];
    const int64_t numel = layout_.buffer_numels[spec.buffer];
    const at::TensorOptions opts = params_[spec.first_param].options().dtype(spec.dtype);
    const at::TensorOptions comm = opts.dtype(comm_dtype(static_cast<int64_t>(b)));
    // Zeroed once: pads and gaps are never written, so they stay zero through every collective.
    flat.grads = at::zeros({numel}, comm);
    // .grad can live in the buffer only where the buffer holds it as it is.
    flat.grad_views = options_.grad_views && comm_dtype(static_cast<int64_t>(b)) == spec.dtype &&
                      pre_divide(static_cast<int64_t>(b)) == 1.0 && update_->grads_may_alias_buffer();
    update_->allocate(flat, numel, opts, comm);
    flat.slot_grads.push_back(flat.grads);
  }
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    Flat& flat = flats_[layout_.buckets[b].buffer];
    while (static_cast<int64_t>(flat.slot_grads.size()) < core_->num_slots(static_cast<int64_t>(b))) {
      flat.slot_grads.push_back(at::zeros_like(flat.grads));
    }
  }
  for (size_t p = 0; p < params_.size(); ++p) {
    const Flat& flat = flat_of(static_cast<int64_t>(p));
    // Not in a delayed bucket: the next backward would accumulate into the
    // slot its reduction still reads.
    if (flat.grad_views && core_->num_slots(layout_.params[p].bucket) == 1) {
      grad_views_[p] = alias_with_own_version(param_view(flat.grads, static_cast<int64_t>(p)));
    }
    if (flat.params.defined()) {
      param_view(flat.params, static_cast<int64_t>(p)).copy_(params_[p].detach());
    }
  }
}

const Engine::Flat& Engine::flat_of(int64_t param) const {
  return flats_[layout_.buckets[layout_.params[param].bucket].buffer];
}

Engine::~Engine() = default;

void Engine::trace_wait(int64_t bucket, const char* kind, int64_t launched_ns, const PendingCollective& pending,
                        int64_t wait_begin_ns) {
  if (tracing_ && launched_ns >= 0) {
    trace_.push_back(TraceEvent{kind, bucket, launched_ns, pending.completed_ns(), wait_begin_ns, now_ns()});
  }
}

std::vector<TraceEvent> Engine::take_trace() {
  std::vector<TraceEvent> out;
  out.swap(trace_);
  return out;
}

c10::ScalarType Engine::comm_dtype(int64_t b) const {
  return options_.comm_dtype == c10::ScalarType::Undefined ? layout_.buckets[b].dtype : options_.comm_dtype;
}

double Engine::pre_divide(int64_t b) const {
  // fp16 overflows at 65504: summing p gradients could pass it, so divide by p
  // first. bf16 and fp32 have fp32's range: divide once, after the sum.
  return comm_dtype(b) == at::kHalf ? 1.0 / backend_->world_size() : 1.0;
}

at::Tensor Engine::param_view(const at::Tensor& flat, int64_t param) const {
  return flat.narrow(0, layout_.buffer_offset(param), layout_.params[param].numel).view(params_[param].sizes());
}

bool Engine::is_grad_view(int64_t param, const at::Tensor& grad) const {
  // By address, not identity: any tensor over exactly this slot is in place.
  const at::Tensor& view = grad_views_[param];
  return view.defined() && grad.defined() && grad.device() == view.device() && grad.data_ptr() == view.data_ptr() &&
         grad.sizes() == view.sizes() && grad.strides() == view.strides();
}

at::Tensor Engine::grad_view(int64_t param) const {
  TORCH_CHECK_INDEX(param >= 0 && param < static_cast<int64_t>(params_.size()),
      "dearcomm: parameter index ", param, " out of range");
  return grad_views_[param];
}

bool Engine::uses_grad_views() const {
  return std::any_of(flats_.begin(), flats_.end(), [](const Flat& f) { return f.grad_views; });
}

void Engine::check_bucket_index(int64_t bucket) const {
  TORCH_CHECK_INDEX(bucket >= 0 && bucket < static_cast<int64_t>(buckets_.size()),
      "dearcomm: bucket ", bucket, " out of range [0, ", buckets_.size(), ")");
}

// What a failed or timed-out collective most often means, which the
// transport's own text (a closed connection, a receive timeout) does not say.
constexpr const char* kPeerMissing =
    " (the ranks' collectives did not pair up: a peer failed, exited or stalled, or ran out of batches before "
    "this rank did; every rank must take the same number of optimizer steps)";

void Engine::fail_collective(const char* what, int64_t bucket, const std::exception& e) const {
  TORCH_CHECK(false, "dearcomm: [rank ", backend_->rank(), "] ", what, " of bucket ", bucket, " (",
      layout_.buckets[bucket].numel, " elements, backend ", backend_->name(), ") failed: ", error_text(e),
      kPeerMissing);
}

// ---- backward ------------------------------------------------------------

void Engine::mark_grad_ready(int64_t param, const at::Tensor& grad) {
  incoming_ = grad;  // accept_grad takes it, once the executor has checked the event
  struct Drop {
    at::Tensor& t;
    ~Drop() { t = at::Tensor(); }
  } drop{incoming_};
  core_->grad_ready(param);
}

std::vector<int64_t> Engine::begin_backward() {
  if (link_meter_) {
    adopt_link_agreements(kLinkAgreementLag - 1);  // first: if it fails, no backward has begun
    link_meter_->begin_backward();
  }
  std::fill(packed_.begin(), packed_.end(), false);
  packed_params_ = 0;
  return link_model_;
}

void Engine::accept_grad(int64_t param) {
  const at::Tensor& grad = incoming_;
  TORCH_CHECK_VALUE(grad.layout() == at::kStrided,
      "dearcomm: parameter '", names_[param], "' got a sparse gradient; sparse gradients are not supported "
      "(use nn.Embedding(sparse=False))");
  TORCH_CHECK_VALUE(params_[param].scalar_type() == layout_.buckets[layout_.params[param].bucket].dtype,
      "dearcomm: parameter '", names_[param], "' is ", params_[param].scalar_type(), " but was ",
      layout_.buckets[layout_.params[param].bucket].dtype, " when the buckets were planned; convert the model "
      "(model.to(dtype), .half(), .double()) before wrap(), not after");
  TORCH_CHECK_VALUE(grad.scalar_type() == params_[param].scalar_type() && grad.device() == params_[param].device(),
      "dearcomm: the gradient of '", names_[param], "' is ", grad.scalar_type(), " on ", grad.device(),
      " but the parameter is ", params_[param].scalar_type(), " on ", params_[param].device());
  TORCH_CHECK_VALUE(params_[param].numel() == layout_.params[param].numel,
      "dearcomm: parameter '", names_[param], "' has ", params_[param].numel(), " elements but had ",
      layout_.params[param].numel, " when the buckets were planned; parameters must not change shape after wrap()");
  TORCH_CHECK_VALUE(grad.sizes() == params_[param].sizes(),
      "dearcomm: the gradient of '", names_[param], "' has shape ", grad.sizes(),
      " but the parameter has shape ", params_[param].sizes());
  arrived_[param] = grad;
}

void Engine::eligible(int64_t /*bucket*/) {
  if (link_meter_) {
    link_meter_->tick(backend_->stamp());
  }
}

void Engine::issue(const Op& op) {
  if (op.kind == Collective::kAllGather) {
    start_gather(op.bucket);
  } else {
    start_reduction(op.bucket, op.slot);
  }
}

void Engine::wait(const Op& op) {
  if (op.kind == Collective::kAllGather) {
    finish_gather(op.bucket);
  } else {
    finish_reduction(op.bucket, op.slot);
  }
}

void Engine::end_backward() {
  core_->end_backward();
}

void Engine::reductions_issued() {
  if (link_meter_) {
    start_link_agreement();
  }
}

// After every reduction of this backward, in the same place on every rank.
void Engine::start_link_agreement() {
  link_agreements_.push_back({backend_->sum_host(link_meter_->figures()), {}});
}

void Engine::pin_link_model(std::vector<int64_t> drained) {
  TORCH_CHECK_VALUE(core_->policy().uses_link_model(), "dearcomm: this schedule has no credit and no link model");
  TORCH_CHECK_VALUE(drained.size() == buckets_.size(), "dearcomm: a link model has one entry per bucket (",
      buckets_.size(), "), got ", drained.size());
  TORCH_CHECK(state() != IterationState::kBackward, "dearcomm: the link model cannot change during a backward");
  for (int64_t bytes : drained) {
    TORCH_CHECK_VALUE(bytes >= 0, "dearcomm: a link model drains >= 0 bytes per tick, got ", bytes);
  }
  if (link_meter_) {
    adopt_link_agreements(0);  // issued by every rank: wait for them before dropping the meter
    link_meter_.reset();
  }
  link_model_ = std::move(drained);
}

// Oldest first, until `keep` are left: the same ones on every rank, at the
// same call, whatever their sums' progress.
void Engine::adopt_link_agreements(size_t keep) {
  while (link_agreements_.size() > keep) {
    settle(link_agreements_.front());
    const std::vector<int64_t> summed = std::move(link_agreements_.front().summed);
    link_agreements_.pop_front();
    link_model_ = link_meter_->model(summed, backend_->world_size());
  }
}

// Waits for the sum; adopting it is left to adopt_link_agreements.
void Engine::settle(LinkAgreement& agreement) {
  if (!agreement.pending) {
    return;
  }
  const std::unique_ptr<PendingSum> sum = std::move(agreement.pending);  // waited for once, either way
  try {
    agreement.summed = sum->result(options_.timeout);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "dearcomm: [rank ", backend_->rank(), "] the sum of the link figures (",
        link_meter_->num_figures(), " int64, backend ", backend_->name(), ") failed: ", error_text(e));
  }
}

std::vector<int64_t> Engine::missing_grads() const {
  return core_->missing_grads();
}

void Engine::check_backward_complete() const {
  core_->check_backward_complete();
}

void Engine::start_reduction(int64_t b, int64_t slot) {
  Bucket& bucket = buckets_[b];
  InFlight& flight = bucket.in_flight.at(slot);
  const BucketSpec& spec = layout_.buckets[b];
  // A parameter is packed whole by the first of its buckets to go out (its
  // gradient is complete by then); a gradient that autograd accumulated into
  // its bucket view is in place already.
  std::vector<at::Tensor> sources;
  std::vector<int64_t> offsets, packed;
  for (int64_t p = spec.first_param; p < spec.first_param + spec.num_params; ++p) {
    if (packed_[p]) {
      continue;
    }
    packed_[p] = true;
    if (!is_grad_view(p, arrived_[p])) {
      sources.push_back(arrived_[p]);
      offsets.push_back(layout_.buffer_offset(p));
      packed.push_back(p);
    }
    arrived_[p] = at::Tensor();  // the user owns .grad again
  }
  if (!sources.empty()) {
    DEARCOMM_RANGE("pack", b);
    backend_->pack(sources, offsets, flats_[spec.buffer].slot_grads[slot], pre_divide(b));
  }
  packed_params_ += static_cast<int64_t>(packed.size());
  // As DDP's reducer does: a .grad that was None or replaced becomes the view
  // (same values), so the next backward accumulates in place. A .grad that is
  // part of a graph (backward(create_graph=True)) is left alone.
  for (int64_t p : packed) {
    at::Tensor& grad = params_[p].mutable_grad();
    if (grad_views_[p].defined() && (!grad.defined() || !grad.requires_grad())) {
      grad = grad_views_[p];
    }
  }
  // Stamped before the launch: a small collective may complete before it returns.
  flight.launched_ns = tracing_ ? now_ns() : -1;
  flight.launch_stamp = link_meter_ ? backend_->stamp() : nullptr;
  if (reduction_ == Collective::kReduceScatter) {
    TORCH_CHECK(slot == 0, "dearcomm: internal error: a reduce-scatter into buffer slot ", slot);  // one shard
    DEARCOMM_RANGE("reduce_scatter", b);
    flight.pending = backend_->reduce_scatter(bucket.grads, bucket.grad_shard);
  } else {
    DEARCOMM_RANGE("all_reduce", b);
    flight.pending = backend_->all_reduce(bucket.slot_grads[slot]);
  }
}

// ---- step ----------------------------------------------------------------

void Engine::finish_reduction(int64_t b, int64_t slot) {
  Bucket& bucket = buckets_[b];
  InFlight& flight = bucket.in_flight.at(slot);
  const bool scattered = reduction_ == Collective::kReduceScatter;
  {
    DEARCOMM_RANGE(scattered ? "wait_reduce_scatter" : "wait_all_reduce", b);
    const int64_t wait_begin = tracing_ ? now_ns() : -1;
    try {
      flight.pending->wait(options_.timeout);
    } catch (const std::exception& e) {
      fail_collective(scattered ? "reduce-scatter" : "all-reduce", b, e);
    }
    trace_wait(b, to_string(reduction_), flight.launched_ns, *flight.pending, wait_begin);
    if (link_meter_) {
      link_meter_->reduction(std::move(flight.launch_stamp), flight.pending->finished(), bucket.grads.nbytes());
    }
  }
  flight.pending.reset();
  // Average: what pack did not divide already (fp16 divides before the sum).
  const double post_divide = backend_->world_size() * pre_divide(b);
  if (scattered) {
    if (post_divide != 1.0) {
      bucket.grad_shard.div_(post_divide);
    }
    if (bucket.master_grad.defined() && !bucket.master_grad.is_same(bucket.grad_shard)) {
      bucket.master_grad.copy_(bucket.grad_shard);
    }
  } else {
    if (post_divide != 1.0) {
      bucket.slot_grads[slot].div_(post_divide);
    }
  }
}

void Engine::step_left_pending() {
  if (update_->binds_parameters() && !params_bound_) {
    bind_params_to_gather_buffers();
  }
}

void Engine::bind_params_to_gather_buffers() {
  // Done at the first step, never inside a backward, so no saved tensor of
  // autograd sees a parameter change its storage.
  for (size_t p = 0; p < params_.size(); ++p) {
    params_[p].set_data(param_view(flat_of(static_cast<int64_t>(p)).params, static_cast<int64_t>(p)));
  }
  params_bound_ = true;
}

void Engine::averages_to_grad(int64_t b, int64_t slot, const std::vector<int64_t>& params) {
  // A parameter is unpacked whole, once the last of its buckets is averaged.
  std::vector<at::Tensor> grads;
  std::vector<int64_t> offsets;
  for (int64_t p : params) {
    at::Tensor& grad = params_[p].mutable_grad();
    if (is_grad_view(p, grad)) {
      continue;  // averaged in place
    }
    if (!grad.defined()) {
      grad = at::empty_like(params_[p]);
    }
    grads.push_back(grad);
    offsets.push_back(layout_.buffer_offset(p));
  }
  if (!grads.empty()) {
    DEARCOMM_RANGE("unpack", b);
    backend_->unpack(flats_[layout_.buckets[b].buffer].slot_grads.at(slot), offsets, grads);
  }
}

void Engine::no_averages(int64_t /*bucket*/, const std::vector<int64_t>& params) {
  for (int64_t p : params) {
    params_[p].mutable_grad() = at::Tensor();  // torch's optimizers skip a parameter without .grad
  }
}

std::vector<int64_t> Engine::zero_grads(const std::vector<int64_t>& params, bool set_to_none) {
  std::vector<bool> selected(params_.size(), false);
  for (int64_t p : params) {
    TORCH_CHECK_INDEX(p >= 0 && p < static_cast<int64_t>(params_.size()), "dearcomm: parameter index ", p,
                      " out of range");
    selected[p] = true;
  }
  // In kBackward the reductions launched so far may still read the buckets
  // (complete backwards finish them at their end, so this is one that raised).
  const bool buckets_in_use = state() == IterationState::kBackward;
  std::vector<int64_t> not_views;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const BucketSpec& spec = layout_.buckets[b];
    std::vector<int64_t> views;      // selected parameters whose .grad is their view
    bool others_keep_views = false;  // a parameter not selected (another optimizer's) has its view
    for (int64_t p = spec.first_param; p < spec.first_param + spec.num_params; ++p) {
      at::Tensor& grad = params_[p].mutable_grad();
      const bool view = is_grad_view(p, grad);
      if (!selected[p]) {
        others_keep_views = others_keep_views || view;
      } else if (view && (set_to_none || params_[p].sizes() != grad.sizes())) {
        // set_to_none, as DDP with gradient_as_bucket_view: the next
        // backward's fresh gradient is copied into the slot (one read, one
        // write), where a kept view costs a fill and autograd's add (two
        // reads, two writes). A parameter that changed shape after wrap():
        // without .grad, the next backward reaches the engine's check (a clear
        // error) instead of failing inside autograd's accumulation into the
        // old shape.
        grad.reset();
      } else if (view && !buckets_in_use) {
        views.push_back(p);
      } else if (view) {  // the reductions may still read the bucket: not in place
        grad = at::zeros_like(grad);
      } else if (grad.defined() && layout_.params[p].bucket == static_cast<int64_t>(b)) {
        not_views.push_back(p);  // once, from its first bucket
      }
    }
    if (views.empty()) {
      continue;
    }
    if (others_keep_views) {
      for (int64_t p : views) {
        params_[p].mutable_grad().zero_();
      }
      continue;
    }
    buckets_[b].grads.zero_();  // one fill; the other slots are overwritten by their pack anyway
    for (int64_t p : views) {
      // The fill went through the bucket: count it as a write to each .grad, as
      // torch's zero_() would (a zero_grad() between backward and step() must
      // make step() raise, as without views).
      params_[p].grad().unsafeGetTensorImpl()->bump_version();
    }
  }
  return not_views;
}

// ---- forward -------------------------------------------------------------

void Engine::start_gather(int64_t b) {
  Bucket& bucket = buckets_[b];
  DEARCOMM_RANGE("all_gather", b);
  InFlight& flight = bucket.in_flight[0];
  const auto [input, output] = update_->gather(bucket);
  flight.launched_ns = tracing_ ? now_ns() : -1;  // before the launch, as start_reduction's
  flight.pending = backend_->all_gather(input, output);
}

void Engine::finish_gather(int64_t b) {
  InFlight& flight = buckets_[b].in_flight[0];
  {
    DEARCOMM_RANGE("wait_all_gather", b);
    const int64_t wait_begin = tracing_ ? now_ns() : -1;
    try {
      flight.pending->wait(options_.timeout);
    } catch (const std::exception& e) {
      fail_collective("all-gather", b, e);
    }
    trace_wait(b, "all_gather", flight.launched_ns, *flight.pending, wait_begin);
  }
  flight.pending.reset();
}

void Engine::averages_in(int64_t b) {
  update_->averages_in(buckets_[b]);
}

void Engine::update(int64_t b, const std::vector<int64_t>& params) {
  if (update_fn_) {
    DEARCOMM_RANGE("update", b);
    update_fn_(params);  // reads the averaged gradients from averaged_grad(p)
  }
}

void Engine::settle() {
  // sync() and eval leave nothing in flight, but adopt nothing: they may run
  // on one rank only (a rank-0 checkpoint), and the model a backward gets
  // must depend on the backward's number alone.
  for (LinkAgreement& agreement : link_agreements_) {
    settle(agreement);
  }
}

// ---- sharded update ------------------------------------------------------

at::Tensor Engine::grad_shard(int64_t b) const {
  check_bucket_index(b);
  return update_->shard_for_optimizer(buckets_[b]);
}

at::Tensor Engine::own_part(int64_t b) const {
  check_bucket_index(b);
  return update_->own_part(buckets_[b], layout_.buckets[b], backend_->rank());
}

at::Tensor Engine::averaged_grad(int64_t param) const {
  TORCH_CHECK_INDEX(param >= 0 && param < static_cast<int64_t>(params_.size()),
      "dearcomm: parameter index ", param, " out of range");
  TORCH_CHECK(core_->timing().update_when_current,
      "dearcomm: averaged gradients outside .grad exist only with update='replicated' of schedule='dear'");
  return param_view(flat_of(param).gathered, param);
}

std::vector<at::Tensor> Engine::pending_averages(int64_t param) const {
  TORCH_CHECK_INDEX(param >= 0 && param < static_cast<int64_t>(params_.size()),
      "dearcomm: parameter index ", param, " out of range");
  std::vector<at::Tensor> out;
  for (int64_t slot : core_->pending_slots(layout_.params[param].bucket)) {
    out.push_back(param_view(flat_of(param).slot_grads.at(slot), param).to(params_[param].scalar_type(),
                                                                          /*non_blocking=*/false, /*copy=*/true));
  }
  return out;
}

at::Tensor Engine::master_shard(int64_t b) const {
  check_bucket_index(b);
  TORCH_CHECK(update_->binds_parameters(), "dearcomm: master shards exist only with update='sharded'");
  return buckets_[b].master;
}

void Engine::reload_master_shards(const std::vector<int64_t>& params) {
  TORCH_CHECK(update_->binds_parameters(), "dearcomm: master shards exist only with update='sharded'");
  // Not while step()'s all-gathers write the parameters; a backward made them
  // current when it began (its first gradient), so from then to step() is fine.
  TORCH_CHECK(state() != IterationState::kGathering,
      "dearcomm: parameters can be reloaded only once they are current (after sync() or a training forward's "
      "waits), state is ", to_string(state()));
  const int64_t rank = backend_->rank();
  std::vector<bool> touched(buckets_.size(), false);
  for (int64_t p : params) {
    TORCH_CHECK_INDEX(p >= 0 && p < static_cast<int64_t>(params_.size()), "dearcomm: parameter index ", p,
                      " out of range");
    if (!params_bound_) {  // the parameters still own their memory: the flat copy is refreshed from them
      param_view(flat_of(p).params, p).copy_(params_[p].detach());
    }
    for (int64_t b = layout_.params[p].bucket; b <= layout_.params[p].last_bucket; ++b) {
      touched[b] = true;
    }
  }
  // Only the buckets written: a reload rounds the fp32 master to the parameters' dtype.
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (touched[b]) {
      const BucketSpec& spec = layout_.buckets[b];
      buckets_[b].master.copy_(buckets_[b].params.narrow(0, spec.shard_begin(rank), spec.shard_numel));
    }
  }
}

}  // namespace dearcomm
