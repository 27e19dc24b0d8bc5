// full_after_reduction (wfbp, as DDP): the averages are copied to .grad and
// the user's optimizer updates full parameters in step(); nothing is gathered.
#include "update.h"

#include <c10/util/Exception.h>

namespace dearcomm {
namespace {

class FullUpdate final : public Update {
 public:
  UpdateStrategy kind() const override { return UpdateStrategy::kFullAfterReduction; }


  std::pair<at::Tensor, at::Tensor> gather(BucketBuffers& /*bucket*/) const override {
    TORCH_CHECK(false, "dearcomm: nothing is all-gathered with update strategy ", to_string(kind()));
  }

  at::Tensor shard_for_optimizer(const BucketBuffers& /*bucket*/) const override {
    TORCH_CHECK(false, "dearcomm: the averaged gradients are in .grad with update strategy ", to_string(kind()));
  }
  at::Tensor own_part(const BucketBuffers& /*bucket*/, const BucketSpec& /*spec*/, int64_t /*rank*/) const override {
    TORCH_CHECK(false, "dearcomm: the averaged gradients are in .grad with update strategy ", to_string(kind()));
  }
};

}  // namespace

std::unique_ptr<Update> make_full_update() {
  return std::make_unique<FullUpdate>();
}

}  // namespace dearcomm
