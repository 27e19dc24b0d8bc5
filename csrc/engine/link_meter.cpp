#include "link_meter.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>

namespace dearcomm {

void LinkMeter::begin_backward() {
  ticks_.clear();
  measure_rate();
}

void LinkMeter::measure_rate() {
  ++batch_;
  // Times from the first launch that has one (they are close together).
  const Stamp* origin = nullptr;
  for (const Reduction& r : reductions_) {
    if (r.launched->since(*r.launched)) {
      origin = r.launched.get();
      break;
    }
  }
  struct Interval {
    int64_t begin_ns, end_ns, bytes;
  };
  // A batch (the reductions recorded between two backwards) is measured as a
  // whole or not at all: a launch stamp counts the time a reduction queued
  // behind the others (one NCCL stream), so part of a batch would count some
  // of that time twice. Oldest first; one without all of its times waits,
  // and the later ones with it, up to kKeepBackwards backwards, after which
  // its untimed reductions are given up.
  std::vector<Interval> timed;
  size_t measured = 0;
  while (measured < reductions_.size()) {
    const int64_t batch = reductions_[measured].batch;
    size_t end_of_batch = measured;
    bool all_timed = true;
    std::vector<Interval> batch_timed;
    for (; end_of_batch < reductions_.size() && reductions_[end_of_batch].batch == batch; ++end_of_batch) {
      const Reduction& r = reductions_[end_of_batch];
      const std::optional<int64_t> begin = origin ? r.launched->since(*origin) : std::nullopt;
      const std::optional<int64_t> end = origin && r.finished ? r.finished->since(*origin) : std::nullopt;
      if (begin && end) {
        if (*end >= *begin) {
          batch_timed.push_back({*begin, *end, r.bytes});
        }
      } else {
        all_timed = false;
      }
    }
    if (!all_timed && batch_ - batch < kKeepBackwards) {
      break;
    }
    timed.insert(timed.end(), batch_timed.begin(), batch_timed.end());
    measured = end_of_batch;
  }
  reductions_.erase(reductions_.begin(), reductions_.begin() + static_cast<std::ptrdiff_t>(measured));
  std::sort(timed.begin(), timed.end(), [](const Interval& a, const Interval& b) { return a.begin_ns < b.begin_ns; });
  // The union of the in-flight intervals: the time the link was busy.
  int64_t busy_ns = 0, bytes = 0, covered_to = INT64_MIN;
  for (const Interval& r : timed) {
    const int64_t from = std::max(r.begin_ns, covered_to);
    busy_ns += std::max<int64_t>(0, r.end_ns - from);
    covered_to = std::max(covered_to, r.end_ns);
    bytes += r.bytes;
  }
  if (busy_ns > 0) {
    rate_bytes_per_ms_ = std::max<int64_t>(1, static_cast<int64_t>(
        static_cast<__int128>(bytes) * 1000000 / busy_ns));
  }
}

void LinkMeter::tick(std::shared_ptr<const Stamp> at) {
  ticks_.push_back(std::move(at));
}

void LinkMeter::reduction(std::shared_ptr<const Stamp> launched, std::shared_ptr<const Stamp> finished,
                          int64_t bytes) {
  if (launched) {
    reductions_.push_back({std::move(launched), std::move(finished), bytes, batch_});
  }
}

bool LinkMeter::measure_spacing(const std::vector<std::shared_ptr<const Stamp>>& ticks) {
  std::vector<int64_t> gaps(num_ticks_, 0);
  for (int64_t k = 1; k < num_ticks_; ++k) {
    const std::optional<int64_t> gap = ticks[k]->since(*ticks[k - 1]);
    if (!gap) {
      return false;
    }
    gaps[k] = std::max<int64_t>(0, *gap) / 1000;
  }
  gaps_us_ = std::move(gaps);
  return true;
}

std::vector<int64_t> LinkMeter::figures() {
  TORCH_CHECK(static_cast<int64_t>(ticks_.size()) == num_ticks_,
      "dearcomm: the link meter saw ", ticks_.size(), " of ", num_ticks_, " ticks in this backward");
  untimed_.push_back(std::move(ticks_));
  ticks_.clear();
  // The newest backward whose ticks all have a time; it and older ones are done with.
  for (size_t i = untimed_.size(); i-- > 0;) {
    if (measure_spacing(untimed_[i])) {
      untimed_.erase(untimed_.begin(), untimed_.begin() + static_cast<std::ptrdiff_t>(i) + 1);
      break;
    }
  }
  while (untimed_.size() > static_cast<size_t>(kKeepBackwards)) {
    untimed_.pop_front();
  }
  std::vector<int64_t> out(num_figures(), 0);
  const bool known = rate_bytes_per_ms_ > 0 && !gaps_us_.empty();
  out[0] = known ? 1 : 0;
  if (known) {
    out[1] = rate_bytes_per_ms_;
    std::copy(gaps_us_.begin(), gaps_us_.end(), out.begin() + 2);
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
