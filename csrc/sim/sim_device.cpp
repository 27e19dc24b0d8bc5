#include "sim/sim_device.h"

#include "core/check.h"

#include <algorithm>
#include <stdexcept>

namespace dearcomm::sim {

SimDevice::SimDevice(const core::Layout& layout, const Profile& profile, const CostModel& cost, bool link_model)
    : layout_(layout), profile_(profile), cost_(cost), link_model_(link_model) {
  for (int64_t numel : profile_.param_numels) {
    total_numel_ += numel;
  }
}

void SimDevice::compute(const std::string& name, double seconds) {
  const double slowdown = cost_.compute_slowdown();
  double t = now_;
  double work = seconds;  // left, in idle-machine seconds
  while (!busy_.empty() && busy_.front().second <= t) {
    busy_.pop_front();  // ended before this span
  }
  for (const auto& [start, end] : busy_) {
    if (work <= 0) {
      break;
    }
    if (t < start) {  // the channel is idle until `start`
      const double idle = std::min(work, start - t);
      t += idle;
      work -= idle;
      if (work <= 0) {
        break;
      }
    }
    const double shared = std::min(work * slowdown, end - t);  // wall time beside the collective
    t += shared;
    work -= shared / slowdown;
  }
  t += std::max(0.0, work);
  spans_.push_back({name, iteration_, now_, t});
  now_ = t;
}

std::vector<int64_t> SimDevice::begin_backward() {
  // The link model of the backward before (the real device agrees on one
  // measured a few backwards before; in a steady state they are the same).
  if (link_model_ && !ticks_.empty()) {
    drained_.clear();
    double before = backward_begin_;
    for (double tick : ticks_) {
      drained_.push_back(cost_.all_reduce_bytes_in(tick - before));
      before = tick;
    }
  }
  backward_begin_ = now_;
  ticks_.clear();
  return drained_;
}

void SimDevice::eligible(int64_t /*bucket*/) {
  ticks_.push_back(now_);
}

void SimDevice::issue(const Op& op) {
  const double start = std::max(now_, channel_free_);
  const double end = start + cost_.seconds(op.kind, layout_.buckets.at(op.bucket).bytes);
  channel_free_ = end;
  busy_.emplace_back(start, end);
  in_flight_[{op.bucket, op.slot}] = SimOp{op.kind, op.bucket, op.slot, iteration_, now_, start, end};
}

void SimDevice::wait(const Op& op) {
  const auto it = in_flight_.find({op.bucket, op.slot});
  DEARCOMM_CORE_CHECK(it != in_flight_.end() && it->second.kind == op.kind, std::logic_error,
                      "dearcomm: internal error: the simulated device waits for ", to_string(op.kind), " of bucket ",
                      op.bucket, " (slot ", op.slot, "), which is not in flight");
  SimOp done = it->second;
  in_flight_.erase(it);
  done.wait_begin_s = now_;
  now_ = std::max(now_, done.end_s);
  done.wait_end_s = now_;
  ops_.push_back(done);
}

void SimDevice::update(int64_t /*bucket*/, const std::vector<int64_t>& params) {
  int64_t numel = 0;
  for (int64_t p : params) {
    numel += profile_.param_numels.at(p);
  }
  compute("update", total_numel_ > 0 ? profile_.step_s * static_cast<double>(numel) / total_numel_ : 0.0);
}

}  // namespace dearcomm::sim
