#include "bucket_layout.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

namespace dearcomm {
namespace {

int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

int64_t shard_align_elements(c10::ScalarType dtype) {
  return std::max<int64_t>(1, kShardAlignBytes / static_cast<int64_t>(c10::elementSize(dtype)));
}

// Builds the layout bucket by bucket; see plan_buckets for the rules.
class Planner {
 public:
  Planner(int64_t cap_bytes, int64_t partition_bytes, int64_t world_size)
      : cap_bytes_(cap_bytes), partition_bytes_(partition_bytes) {
    layout_.world_size = world_size;
  }

  void add(int64_t numel, c10::ScalarType dtype) {
    const int64_t param = static_cast<int64_t>(layout_.params.size());
    if (open_ && dtype != open_spec_.dtype) {
      close();
    }
    if (!open_) {
      open(param, dtype);
    }
    int64_t offset = round_up(open_spec_.numel, kParamAlignElements);
    if (offset > 0 && offset + numel > partition_numel_) {
      // It does not fit in what is left: it starts the next bucket, so a
      // partition boundary never cuts a parameter that fits in one, and a
      // larger one's parts are its own. Else the module before it would wait
      // for the head of this one (e.g. the first layer's bias sharing a bucket
      // with most of the second layer's weight), and this one for the tail of
      // the bucket before.
      close();
      open(param, dtype);
      offset = 0;
    }
    ParamSlot slot{current(), offset, numel, current()};
    open_spec_.num_params += 1;
    int64_t end = offset + numel;  // in the open bucket's coordinates
    while (end > partition_numel_) {
      // Split at the partition boundary: the bucket is full, without padding,
      // and the parameter continues at the start of the next one.
      open_spec_.numel = partition_numel_;
      close();
      open(param, dtype);
      open_spec_.num_params = 1;
      end -= partition_numel_;
    }
    open_spec_.numel = end;
    slot.last_bucket = current();
    layout_.params.push_back(slot);
    const int64_t bytes = open_spec_.numel * static_cast<int64_t>(c10::elementSize(dtype));
    const int64_t cap = layout_.buckets.empty() ? std::min(cap_bytes_, kFirstBucketCapBytes) : cap_bytes_;
    if (bytes >= cap) {
      close();
    }
  }

  // A parameter in the given pieces, one bucket each (see plan_buckets).
  void add_blocks(int64_t numel, c10::ScalarType dtype, const std::vector<int64_t>& pieces) {
    const int64_t param = static_cast<int64_t>(layout_.params.size());
    if (open_) {
      close();
    }
    ParamSlot slot{current(), 0, numel, current()};
    for (const int64_t piece : pieces) {
      open(param, dtype);
      open_spec_.num_params = 1;
      open_spec_.numel = piece;
      slot.last_bucket = current();
      close();
    }
    layout_.params.push_back(slot);
  }

  BucketLayout finish() {
    if (open_) {
      close();
    }
    return std::move(layout_);
  }

 private:
  int64_t current() const { return static_cast<int64_t>(layout_.buckets.size()); }

  void open(int64_t first_param, c10::ScalarType dtype) {
    auto found = std::find(buffer_dtypes_.begin(), buffer_dtypes_.end(), dtype);
    const int64_t buffer = found - buffer_dtypes_.begin();
    if (found == buffer_dtypes_.end()) {
      buffer_dtypes_.push_back(dtype);
      layout_.buffer_numels.push_back(0);
    }
    const int64_t unit = partition_unit(layout_.world_size, dtype);
    const int64_t partition_elements = partition_bytes_ / static_cast<int64_t>(c10::elementSize(dtype));
    partition_numel_ = partition_bytes_ == kNoPartition ? kNoPartition
                                                        : std::max(unit, partition_elements / unit * unit);
    open_spec_ = BucketSpec{first_param, 0, 0, 0, 0, dtype, buffer, layout_.buffer_numels[buffer]};
    open_ = true;
  }

  void close() {
    BucketSpec& spec = open_spec_;
    // An equal 1/world_size share per rank, rounded up to kShardAlignBytes
    // (see its comment for why).
    spec.shard_numel = round_up((spec.numel + layout_.world_size - 1) / layout_.world_size,
                                shard_align_elements(spec.dtype));
    spec.padded_numel = spec.shard_numel * layout_.world_size;
    layout_.buffer_numels[spec.buffer] += spec.padded_numel;
    layout_.buckets.push_back(spec);
    open_ = false;
  }

  const int64_t cap_bytes_;
  const int64_t partition_bytes_;
  BucketLayout layout_;
  std::vector<c10::ScalarType> buffer_dtypes_;  // flat buffer index -> its dtype
  bool open_ = false;
  BucketSpec open_spec_{};
  int64_t partition_numel_ = kNoPartition;  // of the open bucket's dtype
};

void check_blocks(size_t param, int64_t numel, int64_t unit, const std::vector<int64_t>& pieces) {
  int64_t sum = 0;
  for (size_t k = 0; k < pieces.size(); ++k) {
    TORCH_CHECK_VALUE(pieces[k] > 0, "dearcomm: block ", k, " of parameter ", param, " has ", pieces[k],
                      " elements; blocks must not be empty");
    TORCH_CHECK_VALUE(k + 1 == pieces.size() || pieces[k] % unit == 0,
        "dearcomm: block ", k, " of parameter ", param, " has ", pieces[k], " elements; every block but the last "
        "must be a multiple of partition_unit = ", unit, " elements (world_size x 64 bytes)");
    sum += pieces[k];
  }
  TORCH_CHECK_VALUE(sum == numel, "dearcomm: the blocks of parameter ", param, " add up to ", sum,
                    " elements, but it has ", numel);
}

}  // namespace

int64_t partition_unit(int64_t world_size, c10::ScalarType dtype) {
  return world_size * shard_align_elements(dtype);
}

BucketLayout plan_buckets(
    const std::vector<int64_t>& numels,
    const std::vector<c10::ScalarType>& dtypes,
    int64_t bucket_cap_bytes,
    int64_t world_size,
    int64_t partition_bytes,
    const std::vector<std::vector<int64_t>>& blocks) {
  TORCH_CHECK_VALUE(numels.size() == dtypes.size(),
      "dearcomm: plan_buckets got ", numels.size(), " sizes but ", dtypes.size(), " dtypes");
  TORCH_CHECK_VALUE(world_size >= 1, "dearcomm: world_size must be >= 1, got ", world_size);
  TORCH_CHECK_VALUE(bucket_cap_bytes >= 0, "dearcomm: bucket cap must be >= 0 bytes, got ", bucket_cap_bytes);
  TORCH_CHECK_VALUE(partition_bytes > 0, "dearcomm: partition size must be > 0 bytes, got ", partition_bytes);
  TORCH_CHECK_VALUE(blocks.empty() || blocks.size() == numels.size(),
      "dearcomm: plan_buckets got blocks for ", blocks.size(), " parameters, expected none or ", numels.size());
  Planner planner(bucket_cap_bytes, partition_bytes, world_size);
  for (size_t i = 0; i < numels.size(); ++i) {
    TORCH_CHECK_VALUE(numels[i] > 0, "dearcomm: parameter ", i, " has no elements");
    if (blocks.empty() || blocks[i].empty()) {
      planner.add(numels[i], dtypes[i]);
      continue;
    }
    check_blocks(i, numels[i], partition_unit(world_size, dtypes[i]), blocks[i]);
    planner.add_blocks(numels[i], dtypes[i], blocks[i]);
  }
  return planner.finish();
}

core::Layout core_layout(const BucketLayout& layout, c10::ScalarType comm_dtype) {
  core::Layout core;
  for (const BucketSpec& spec : layout.buckets) {
    const c10::ScalarType dtype = comm_dtype == c10::ScalarType::Undefined ? spec.dtype : comm_dtype;
    core.buckets.push_back({spec.first_param, spec.num_params,
                            spec.padded_numel * static_cast<int64_t>(c10::elementSize(dtype))});
  }
  for (const ParamSlot& slot : layout.params) {
    core.params.push_back({slot.bucket, slot.last_bucket});
  }
  return core;
}

int64_t BucketLayout::buffer_offset(int64_t param) const {
  const ParamSlot& slot = params.at(param);
  return buckets[slot.bucket].buffer_offset + slot.offset;
}

std::vector<BucketLayout::Piece> BucketLayout::pieces(int64_t bucket, int64_t begin, int64_t end) const {
  TORCH_CHECK_INDEX(bucket >= 0 && bucket < static_cast<int64_t>(buckets.size()),
      "dearcomm: bucket ", bucket, " out of range [0, ", buckets.size(), ")");
  const BucketSpec& spec = buckets[bucket];
  std::vector<Piece> result;
  for (int64_t p = spec.first_param; p < spec.first_param + spec.num_params; ++p) {
    // The parameter's range in this bucket's coordinates (it may start in an earlier bucket).
    const int64_t start = buffer_offset(p) - spec.buffer_offset;
    const int64_t lo = std::max({begin, start, int64_t{0}});
    const int64_t hi = std::min({end, start + params[p].numel, spec.padded_numel});
    if (lo < hi) {
      result.push_back(Piece{p, lo - start, hi - lo, lo});
    }
  }
  return result;
}

std::string BucketLayout::describe() const {
  std::ostringstream out;
  for (size_t b = 0; b < buckets.size(); ++b) {
    const BucketSpec& s = buckets[b];
    const bool continues = params[s.first_param].bucket < static_cast<int64_t>(b);
    const int64_t last = s.first_param + s.num_params - 1;
    const bool split = params[last].last_bucket > static_cast<int64_t>(b);
    out << "bucket " << b << ": params [" << s.first_param << (continues ? " (cont.)" : "") << ", " << last
        << (split ? " (split)" : "") << "], " << s.numel << " elements of " << c10::toString(s.dtype) << ", padded to "
        << s.padded_numel << " (" << world_size << " shards of " << s.shard_numel << ")\n";
  }
  return out.str();
}

}  // namespace dearcomm
