#include "core/layout.h"

#include "core/check.h"

#include <stdexcept>

namespace dearcomm::core {

void Layout::check() const {
  for (int64_t b = 0; b < num_buckets(); ++b) {
    const Bucket& bucket = buckets[b];
    DEARCOMM_CORE_CHECK(bucket.num_params > 0 && bucket.first_param >= 0 &&
                            bucket.first_param + bucket.num_params <= num_params() && bucket.bytes >= 0,
                        std::invalid_argument, "dearcomm: bucket ", b, " overlaps parameters [", bucket.first_param,
                        ", ", bucket.first_param + bucket.num_params, ") of ", num_params(), " with ", bucket.bytes,
                        " bytes");
    for (int64_t p = bucket.first_param; p < bucket.first_param + bucket.num_params; ++p) {
      DEARCOMM_CORE_CHECK(params[p].first_bucket <= b && b <= params[p].last_bucket, std::invalid_argument,
                          "dearcomm: bucket ", b, " overlaps parameter ", p, ", which spans buckets ",
                          params[p].first_bucket, " to ", params[p].last_bucket);
    }
  }
  for (int64_t p = 0; p < num_params(); ++p) {
    DEARCOMM_CORE_CHECK(0 <= params[p].first_bucket && params[p].first_bucket <= params[p].last_bucket &&
                            params[p].last_bucket < num_buckets(),
                        std::invalid_argument, "dearcomm: parameter ", p, " spans buckets ", params[p].first_bucket,
                        " to ", params[p].last_bucket, " of ", num_buckets());
  }
}

void Completion::reset() {
  remaining_.resize(layout_->params.size());
  for (size_t p = 0; p < remaining_.size(); ++p) {
    remaining_[p] = layout_->params[p].last_bucket - layout_->params[p].first_bucket + 1;
  }
}

std::vector<int64_t> Completion::done(int64_t bucket) {
  const Layout::Bucket& spec = layout_->buckets.at(bucket);
  std::vector<int64_t> completed;
  for (int64_t p = spec.first_param; p < spec.first_param + spec.num_params; ++p) {
    if (--remaining_[p] == 0) {
      completed.push_back(p);
    }
  }
  return completed;
}

}  // namespace dearcomm::core
