// Bucket layout: where every gradient lives inside the fused communication
// buckets. Planned once, from the parameters in forward order, by a pure
// function; the engine allocates buffers afterwards and checks them against it.
#pragma once

#include "core/layout.h"

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dearcomm {

// One parameter's place: `numel` elements from `offset` inside bucket
// `bucket`, running on through the next buckets up to `last_bucket` where a
// partition boundary splits it (last_bucket == bucket otherwise). Buckets of
// one dtype are consecutive ranges of one flat buffer, so a split parameter
// still occupies one contiguous range of that buffer.
struct ParamSlot {
  int64_t bucket;
  int64_t offset;
  int64_t numel;
  int64_t last_bucket;
};

// One bucket, the unit of communication: elements [buffer_offset,
// buffer_offset + padded_numel) of flat buffer `buffer` (one per dtype, in
// order of first use). It overlaps parameters [first_param, first_param +
// num_params) of the forward order; the first and the last may continue in
// the neighbouring buckets. `numel` elements from its start hold data (and
// the alignment gaps between parameters); the rest is padding so that it
// splits into world_size equal shards of `shard_numel` elements.
struct BucketSpec {
  int64_t first_param;
  int64_t num_params;
  int64_t numel;
  int64_t padded_numel;
  int64_t shard_numel;
  c10::ScalarType dtype;
  int64_t buffer;
  int64_t buffer_offset;

  // Where rank `rank`'s shard starts in the bucket: the one place that says it.
  int64_t shard_begin(int64_t rank) const { return rank * shard_numel; }
};

struct BucketLayout {
  std::vector<ParamSlot> params;
  std::vector<BucketSpec> buckets;
  std::vector<int64_t> buffer_numels;  // per flat buffer: its elements (the sum of its buckets' padded_numel)
  int64_t world_size = 1;

  // Where parameter `param` starts in its flat buffer.
  int64_t buffer_offset(int64_t param) const;

  // Parameters of bucket b overlapping the element range [begin, end) of the
  // bucket, as {param index, first element inside the param, element count,
  // where that element sits in the bucket}.
  struct Piece {
    int64_t param;
    int64_t param_offset;
    int64_t numel;
    int64_t bucket_offset;
  };
  std::vector<Piece> pieces(int64_t bucket, int64_t begin, int64_t end) const;

  std::string describe() const;  // one line per bucket, for logs
};

// Each shard is padded to this many bytes, so every shard (and so every
// rank's slice of a collective) starts 64-byte aligned: vectorised kernels and
// NCCL's fast paths need aligned chunks. The pad is never read as data.
constexpr int64_t kShardAlignBytes = 64;

// Every parameter starts at a multiple of this many elements inside its
// bucket: 16 bytes in a 2-byte comm dtype (bf16/fp16), more in wider ones. The
// fused copy kernel then moves every parameter with 16-byte vector accesses;
// one odd-sized parameter would otherwise leave every later one scalar.
// (Megatron-LM pads parameter starts in its buffers the same way.) The gaps
// are zeros that are never written, so norms and updates ignore them.
constexpr int64_t kParamAlignElements = 8;

// Bucket 0 (the first layers) closes at min(cap, this). Its all-gather is the
// one the next forward cannot hide (it starts after step() and the first module
// needs it at once), and its reduce-scatter the one backward cannot hide (its
// gradients arrive last): both ends of the overlap want it small. DDP keeps its
// first bucket small (1 MiB) for the same reason at its one end.
constexpr int64_t kFirstBucketCapBytes = 1 << 20;

// No partitioning: a bucket boundary never splits a parameter.
constexpr int64_t kNoPartition = INT64_MAX;

// Plans buckets over parameters given in forward order. A bucket is closed at
// the end of a parameter once it holds at least `bucket_cap_bytes` (0: one
// bucket per parameter; bucket 0: see kFirstBucketCapBytes), or when the next
// parameter has another dtype (a bucket is one flat tensor). With
// `partition_bytes`, no bucket holds more: a parameter that does not fit in
// what is left of the open bucket starts the next one, and one larger than a
// partition is split into partition-sized parts from there, the rest
// continuing in the bucket after (ByteScheduler's tensor partitioning; small
// parameters still fuse). So a bucket never mixes part of a large parameter
// with the parameters before it. Split points are multiples of world_size shard
// alignments (partition_unit), so the split bucket needs no padding and its
// neighbour continues the parameter contiguously; partition_bytes is rounded
// down to that unit (at least one unit).
//
// `blocks` (empty, or one entry per parameter): where blocks[p] is not empty,
// it gives the element counts of parameter p's consecutive pieces, as a
// planner chose them (US-Byte's unequal blocks): p starts a bucket, each piece
// is a bucket of its own, and the next parameter starts another. The counts
// sum to p's size, and all but the last are multiples of partition_unit.
BucketLayout plan_buckets(
    const std::vector<int64_t>& numels,
    const std::vector<c10::ScalarType>& dtypes,
    int64_t bucket_cap_bytes,
    int64_t world_size,
    int64_t partition_bytes = kNoPartition,
    const std::vector<std::vector<int64_t>>& blocks = {});

// What the executor knows of `layout` (core/layout.h): spans, and each
// bucket's bytes as communicated in `comm_dtype` (Undefined: its own dtype).
core::Layout core_layout(const BucketLayout& layout, c10::ScalarType comm_dtype);

// The granularity of partition boundaries, in elements of `dtype`.
int64_t partition_unit(int64_t world_size, c10::ScalarType dtype);

}  // namespace dearcomm
