// What the core knows of the bucket layout: which parameters each bucket
// overlaps and which buckets each parameter spans, and each bucket's size in
// bytes as communicated. No dtypes, offsets or tensors (those are the
// device's, engine/bucket_layout.h).
#pragma once

#include <cstdint>
#include <vector>

namespace dearcomm::core {

struct Layout {
  struct Bucket {
    int64_t first_param;
    int64_t num_params;
    int64_t bytes;  // in its communication dtype: what a policy weighs
  };
  struct Param {
    int64_t first_bucket;
    int64_t last_bucket;  // > first_bucket where a partition boundary splits it
  };
  std::vector<Bucket> buckets;
  std::vector<Param> params;

  int64_t num_buckets() const { return static_cast<int64_t>(buckets.size()); }
  int64_t num_params() const { return static_cast<int64_t>(params.size()); }
  // Raises std::invalid_argument unless buckets and spans agree.
  void check() const;
};

// "A parameter is complete when the last of its buckets is": the one place
// that says it. Each round (a backward's reductions, a step's gathers), every
// bucket is reported done once; each parameter is returned once, by the
// report of the last of its buckets, whatever order they come in.
class Completion {
 public:
  explicit Completion(const Layout& layout) : layout_(&layout) { reset(); }
  void reset();
  std::vector<int64_t> done(int64_t bucket);

 private:
  const Layout* layout_;
  std::vector<int64_t> remaining_;  // per parameter: its buckets not reported this round
};

}  // namespace dearcomm::core
