#include "bucket_layout.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

namespace dearcomm {
namespace {

int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// Shard size of a bucket of `numel` elements: an equal 1/world_size share,
// rounded up to kShardAlignBytes (see its comment for why).
int64_t padded_shard_numel(int64_t numel, int64_t world_size, c10::ScalarType dtype) {
  const int64_t align = std::max<int64_t>(1, kShardAlignBytes / static_cast<int64_t>(c10::elementSize(dtype)));
  return round_up((numel + world_size - 1) / world_size, align);
}

}  // namespace

BucketLayout plan_buckets(
    const std::vector<int64_t>& numels,
    const std::vector<c10::ScalarType>& dtypes,
    int64_t bucket_cap_bytes,
    int64_t world_size) {
  TORCH_CHECK_VALUE(numels.size() == dtypes.size(),
      "dearcomm: plan_buckets got ", numels.size(), " sizes but ", dtypes.size(), " dtypes");
  TORCH_CHECK_VALUE(world_size >= 1, "dearcomm: world_size must be >= 1, got ", world_size);
  TORCH_CHECK_VALUE(bucket_cap_bytes >= 0, "dearcomm: bucket cap must be >= 0 bytes, got ", bucket_cap_bytes);

  BucketLayout layout;
  layout.world_size = world_size;
  layout.params.reserve(numels.size());

  auto close_bucket = [&](BucketSpec& bucket) {
    bucket.shard_numel = padded_shard_numel(bucket.numel, world_size, bucket.dtype);
    bucket.padded_numel = bucket.shard_numel * world_size;
    layout.buckets.push_back(bucket);
  };

  BucketSpec open{0, 0, 0, 0, 0, c10::ScalarType::Undefined};
  for (size_t i = 0; i < numels.size(); ++i) {
    TORCH_CHECK_VALUE(numels[i] > 0, "dearcomm: parameter ", i, " has no elements");
    const bool dtype_changes = open.num_params > 0 && dtypes[i] != open.dtype;
    if (dtype_changes) {
      close_bucket(open);
      open = BucketSpec{static_cast<int64_t>(i), 0, 0, 0, 0, dtypes[i]};
    }
    if (open.num_params == 0) {
      open.first_param = static_cast<int64_t>(i);
      open.dtype = dtypes[i];
    }
    const int64_t offset = round_up(open.numel, kParamAlignElements);
    const int64_t bucket = static_cast<int64_t>(layout.buckets.size());
    layout.params.push_back(ParamSlot{bucket, offset, numels[i], bucket});
    open.numel = offset + numels[i];
    open.num_params += 1;
    const int64_t bytes = open.numel * static_cast<int64_t>(c10::elementSize(open.dtype));
    const int64_t cap = layout.buckets.empty() ? std::min(bucket_cap_bytes, kFirstBucketCapBytes) : bucket_cap_bytes;
    if (bytes >= cap) {
      close_bucket(open);
      open = BucketSpec{static_cast<int64_t>(i + 1), 0, 0, 0, 0, c10::ScalarType::Undefined};
    }
  }
  if (open.num_params > 0) {
    close_bucket(open);
  }
  return layout;
}

std::vector<BucketLayout::Piece> BucketLayout::pieces(int64_t bucket, int64_t begin, int64_t end) const {
  TORCH_CHECK_INDEX(bucket >= 0 && bucket < static_cast<int64_t>(buckets.size()),
      "dearcomm: bucket ", bucket, " out of range [0, ", buckets.size(), ")");
  const BucketSpec& spec = buckets[bucket];
  std::vector<Piece> result;
  for (int64_t p = spec.first_param; p < spec.first_param + spec.num_params; ++p) {
    const ParamSlot& slot = params[p];
    const int64_t lo = std::max(begin, slot.offset);
    const int64_t hi = std::min(end, slot.offset + slot.numel);
    if (lo < hi) {
      result.push_back(Piece{p, lo - slot.offset, hi - lo, lo});
    }
  }
  return result;
}

std::string BucketLayout::describe() const {
  std::ostringstream out;
  for (size_t b = 0; b < buckets.size(); ++b) {
    const BucketSpec& s = buckets[b];
    out << "bucket " << b << ": params [" << s.first_param << ", " << s.first_param + s.num_params
        << "), " << s.numel << " elements of " << c10::toString(s.dtype) << ", padded to "
        << s.padded_numel << " (" << world_size << " shards of " << s.shard_numel << ")\n";
  }
  return out.str();
}

}  // namespace dearcomm
