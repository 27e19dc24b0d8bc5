// replicated_before_use: every rank receives the whole averaged gradient (an
// all-gather of the shards, or an all-reduce) and updates each parameter once
// all its buckets are in, before its module's forward.
#include "update.h"

#include <ATen/ATen.h>

namespace dearcomm {
namespace {

class ReplicatedUpdate final : public Update {
 public:
  explicit ReplicatedUpdate(Collective reduction) : all_reduced_(reduction == Collective::kAllReduce) {}

  UpdateStrategy kind() const override { return UpdateStrategy::kReplicatedBeforeUse; }

  // An all-reduce averages in place for the next forward to read, after
  // zero_grad() and the user's code have written .grad.
  bool grads_may_alias_buffer() const override { return !all_reduced_; }

  void allocate(FlatBuffers& flat, int64_t numel, const at::TensorOptions& params,
                const at::TensorOptions& comm) const override {
    // Averaged gradients must not land in .grad's views: zero_grad() and the
    // next backward write those while the all-gathers are still in flight.
    flat.gathered_comm = flat.grad_views ? at::zeros({numel}, comm) : flat.grads;
    flat.gathered = comm.dtype() == params.dtype() ? flat.gathered_comm : at::zeros({numel}, params);
  }

  std::pair<at::Tensor, at::Tensor> gather(BucketBuffers& bucket) const override {
    return {bucket.grad_shard, bucket.gathered_comm};
  }

  void averages_in(BucketBuffers& bucket) const override {
    if (!bucket.gathered.is_same(bucket.gathered_comm)) {
      bucket.gathered.copy_(bucket.gathered_comm);  // to the parameters' dtype
    }
  }

  // All-reduced: the whole bucket, the same on every rank.
  at::Tensor shard_for_optimizer(const BucketBuffers& bucket) const override {
    return all_reduced_ ? bucket.grads : bucket.grad_shard;
  }

  // All-reduced: every rank holds the whole bucket; its shard's range is its own.
  at::Tensor own_part(const BucketBuffers& bucket, const BucketSpec& spec, int64_t rank) const override {
    return all_reduced_ ? bucket.grads.narrow(0, spec.shard_begin(rank), spec.shard_numel) : bucket.grad_shard;
  }

 private:
  const bool all_reduced_;
};

}  // namespace

std::unique_ptr<Update> make_replicated_update(Collective reduction) {
  return std::make_unique<ReplicatedUpdate>(reduction);
}

}  // namespace dearcomm
