// The buffers of an update strategy: one class per UpdateStrategy, so the
// device never branches on the strategy. Each says which buffers it needs
// beside the gradients, what the all-gather carries, and where a bucket's
// averages go. *When* it acts is the executor's (core/update_timing.h);
// dearcomm/_update/ runs the optimizer.
//
//   sharded_at_step         (dear, update="sharded"): the optimizer updates
//       this rank's fp32 master shard in step(); the all-gather carries
//       parameters, which are views into the gathered buffer.
//   replicated_before_use   (dear, update="replicated"; bytescheduler): the
//       all-gather (or all-reduce) carries averaged gradients; a parameter is
//       updated once all its buckets are in, before its module's forward.
//   full_after_reduction    (wfbp): averages are copied to .grad and the
//       user's optimizer updates full parameters in step().
#pragma once

#include "engine/bucket_layout.h"
#include "engine/buffers.h"
#include "schedule/policy.h"

#include <memory>
#include <utility>

namespace dearcomm {

class Update {
 public:
  virtual ~Update() = default;
  virtual UpdateStrategy kind() const = 0;

  // ---- buffers (engine construction) -------------------------------------
  // Whether .grad may alias the gradient buffer (where its dtype and scaling
  // allow it at all).
  virtual bool grads_may_alias_buffer() const { return true; }
  // Buffers beside `flat.grads` (allocated, its grad_views decided) of `numel`
  // elements; `params`/`comm`: the parameters' and the communication dtype.
  virtual void allocate(FlatBuffers& /*flat*/, int64_t /*numel*/, const at::TensorOptions& /*params*/,
                        const at::TensorOptions& /*comm*/) const {}
  // A bucket's own tensors, once its views into the flat buffers are set.
  virtual void allocate(BucketBuffers& /*bucket*/, const BucketSpec& /*spec*/, int64_t /*rank*/) const {}

  // ---- an iteration -------------------------------------------------------
  // The first step() that leaves gathers pending makes the parameters views
  // into the gathered buffers.
  virtual bool binds_parameters() const { return false; }
  // The all-gather's (input, output); refreshes the input first if needed.
  virtual std::pair<at::Tensor, at::Tensor> gather(BucketBuffers& bucket) const = 0;
  // The bucket's averages are in (gathered, or all-reduced): to the
  // parameters' dtype where they are read from.
  virtual void averages_in(BucketBuffers& /*bucket*/) const {}
  // What the optimizer reads for this bucket: see Engine::grad_shard.
  virtual at::Tensor shard_for_optimizer(const BucketBuffers& bucket) const = 0;
  // This rank's part of the bucket's averages, disjoint from every other
  // rank's (a global norm sums them over the ranks): see Engine::own_part.
  virtual at::Tensor own_part(const BucketBuffers& bucket, const BucketSpec& spec, int64_t rank) const = 0;
};

// The strategy's object; raises if `reduction` cannot feed it (only a
// reduce-scatter leaves the shard a sharded update needs; .grad needs a
// full all-reduced average).
std::unique_ptr<Update> make_update(UpdateStrategy strategy, Collective reduction);

// One file each (update/<name>.cpp).
std::unique_ptr<Update> make_sharded_update();
std::unique_ptr<Update> make_replicated_update(Collective reduction);
std::unique_ptr<Update> make_full_update();

}  // namespace dearcomm
