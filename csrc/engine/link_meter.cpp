#include "link_meter.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace dearcomm {

void LinkMeter::begin_backward() {
  tick_ns_.clear();
  if (reductions_.empty()) {
    return;  // keep the last rate: an iteration without measured reductions says nothing new
  }
  std::sort(reductions_.begin(), reductions_.end(),
            [](const Interval& a, const Interval& b) { return a.begin_ns < b.begin_ns; });
  // The union of the in-flight intervals: the time the link was busy.
  int64_t busy_ns = 0, bytes = 0, covered_to = INT64_MIN;
  for (const Interval& r : reductions_) {
    const int64_t from = std::max(r.begin_ns, covered_to);
    busy_ns += std::max<int64_t>(0, r.end_ns - from);
    covered_to = std::max(covered_to, r.end_ns);
    bytes += r.bytes;
  }
  reductions_.clear();
  if (busy_ns > 0) {
    rate_bytes_per_ms_ = std::max<int64_t>(1, static_cast<int64_t>(
        static_cast<__int128>(bytes) * 1000000 / busy_ns));
  }
}

void LinkMeter::tick(int64_t now_ns) {
  tick_ns_.push_back(now_ns);
}

void LinkMeter::reduction_done(int64_t launched_ns, int64_t completed_ns, int64_t bytes) {
  if (launched_ns >= 0 && completed_ns >= launched_ns) {
    reductions_.push_back({launched_ns, completed_ns, bytes});
  }
}

std::vector<int64_t> LinkMeter::figures() const {
  TORCH_CHECK(static_cast<int64_t>(tick_ns_.size()) == num_ticks_,
      "dearcomm: the link meter saw ", tick_ns_.size(), " of ", num_ticks_, " ticks in this backward");
  std::vector<int64_t> out(num_figures(), 0);
  out[0] = rate_bytes_per_ms_ > 0 ? 1 : 0;
  out[1] = std::max<int64_t>(0, rate_bytes_per_ms_);
  for (int64_t k = 1; k < num_ticks_; ++k) {
    out[2 + k] = (tick_ns_[k] - tick_ns_[k - 1]) / 1000;
  }
  return out;
}

std::vector<int64_t> LinkMeter::model(const std::vector<int64_t>& summed, int64_t world_size) const {
  TORCH_CHECK(static_cast<int64_t>(summed.size()) == num_figures() && world_size > 0,
      "dearcomm: the link figures have ", summed.size(), " entries, expected ", num_figures());
  if (summed[0] != world_size) {
    return {};
  }
  const __int128 rate = summed[1] / world_size;  // bytes per ms
  std::vector<int64_t> drained(num_ticks_, 0);
  for (int64_t k = 1; k < num_ticks_; ++k) {
    const __int128 bytes = rate * (summed[2 + k] / world_size) / 1000;  // µs -> ms
    drained[k] = bytes > INT64_MAX ? INT64_MAX : static_cast<int64_t>(bytes);
  }
  return drained;
}

}  // namespace dearcomm
