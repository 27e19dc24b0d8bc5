// sharded_at_step: the optimizer updates this rank's fp32 master shard in
// step(); the all-gather carries the updated parameters.
#include "update.h"

#include <ATen/ATen.h>

namespace dearcomm {
namespace {

class ShardedUpdate final : public Update {
 public:
  UpdateStrategy kind() const override { return UpdateStrategy::kShardedAtStep; }

  void allocate(FlatBuffers& flat, int64_t numel, const at::TensorOptions& params,
                const at::TensorOptions& /*comm*/) const override {
    flat.params = at::zeros({numel}, params);  // the parameters become views into it (binds_parameters)
  }

  void allocate(BucketBuffers& bucket, const BucketSpec& spec, int64_t rank) const override {
    const int64_t n = spec.shard_numel;
    bucket.master_grad = bucket.grad_shard.scalar_type() == at::kFloat
                             ? bucket.grad_shard
                             : at::zeros({n}, bucket.grad_shard.options().dtype(at::kFloat));
    bucket.master = bucket.params.narrow(0, spec.shard_begin(rank), n).to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    bucket.gather_input = spec.dtype == at::kFloat ? bucket.master : at::empty({n}, bucket.params.options());
  }

  bool binds_parameters() const override { return true; }

  std::pair<at::Tensor, at::Tensor> gather(BucketBuffers& bucket) const override {
    if (!bucket.gather_input.is_same(bucket.master)) {
      bucket.gather_input.copy_(bucket.master);  // to the parameters' dtype
    }
    return {bucket.gather_input, bucket.params};
  }

  at::Tensor shard_for_optimizer(const BucketBuffers& bucket) const override { return bucket.master_grad; }
  at::Tensor own_part(const BucketBuffers& bucket, const BucketSpec& /*spec*/, int64_t /*rank*/) const override {
    return bucket.master_grad;
  }
};

}  // namespace

std::unique_ptr<Update> make_sharded_update() {
  return std::make_unique<ShardedUpdate>();
}

}  // namespace dearcomm
