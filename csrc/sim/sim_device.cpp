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

double SimDevice::time_to_finish(double comm_rate) const {
  return channel_.front().left / comm_rate;
}

void SimDevice::advance(double dt, double comm_rate) {
  if (!channel_.empty()) {
    Queued& running = channel_.front();
    running.left -= dt * comm_rate;
    if (running.left <= 1e-15) {  // finished (float residue of the division above)
      in_flight_.at(running.key).end_s = now_ + dt;
      channel_.pop_front();
      if (!channel_.empty()) {
        in_flight_.at(channel_.front().key).start_s = now_ + dt;
      }
    }
  }
  now_ += dt;
}

void SimDevice::compute(const std::string& name, double seconds) {
  const double compute_slowdown = cost_.compute_slowdown();
  const double comm_rate = 1.0 / cost_.comm_slowdown();
  const double begin = now_;
  double work = seconds;  // left, in idle-machine seconds
  while (work > 0) {
    if (channel_.empty()) {
      now_ += work;
      break;
    }
    // Both run: until the first of the two finishes.
    const double compute_left = work * compute_slowdown;
    const double comm_left = time_to_finish(comm_rate);
    const double dt = std::min(compute_left, comm_left);
    work = compute_left <= comm_left ? 0.0 : work - dt / compute_slowdown;
    advance(dt, comm_rate);
  }
  spans_.push_back({name, iteration_, begin, now_});
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
  const std::pair<int64_t, int64_t> key{op.bucket, op.slot};
  // start and end are set when the channel reaches and finishes it (advance).
  in_flight_[key] = SimOp{op.kind, op.bucket, op.slot, iteration_, now_, channel_.empty() ? now_ : -1.0, -1.0};
  channel_.push_back({key, cost_.seconds(op.kind, layout_.buckets.at(op.bucket).bytes)});
  if (channel_.size() == 1 && channel_.back().left <= 0) {  // costs nothing (α = β = 0) on an idle channel
    in_flight_[key].end_s = now_;
    channel_.pop_back();
  }
}

void SimDevice::wait(const Op& op) {
  const auto it = in_flight_.find({op.bucket, op.slot});
  DEARCOMM_CORE_CHECK(it != in_flight_.end() && it->second.kind == op.kind, std::logic_error,
                      "dearcomm: internal error: the simulated device waits for ", to_string(op.kind), " of bucket ",
                      op.bucket, " (slot ", op.slot, "), which is not in flight");
  const double wait_begin = now_;
  while (it->second.end_s < 0) {  // compute idles: the channel runs alone until this one is done
    advance(time_to_finish(1.0), 1.0);
  }
  SimOp done = it->second;
  in_flight_.erase(it);
  done.wait_begin_s = wait_begin;
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
