#include "sim/sim_device.h"

#include "core/check.h"

#include <algorithm>
#include <stdexcept>

namespace dearcomm::sim {

SimDevice::SimDevice(const core::Layout& layout, const Profile& profile, const CostModel& cost, bool link_model,
                     bool all_reduces_in_issue_order)
    : layout_(layout),
      profile_(profile),
      cost_(cost),
      link_model_(link_model),
      in_issue_order_(all_reduces_in_issue_order),
      all_reduce_lanes_(all_reduces_in_issue_order ? 1 : cost.all_reduce_lanes()) {
  for (int64_t numel : profile_.param_numels) {
    total_numel_ += numel;
  }
}

size_t SimDevice::running() const {
  if (channel_.empty()) {
    return 0;
  }
  size_t n = 1;
  if (channel_.front().kind == Collective::kAllReduce) {
    while (n < channel_.size() && n < static_cast<size_t>(all_reduce_lanes_) &&
           channel_[n].kind == Collective::kAllReduce) {
      ++n;
    }
  }
  return n;
}

double SimDevice::time_to_finish(double comm_rate) const {
  const size_t n = running();
  double least = channel_.front().left;
  for (size_t i = 1; i < n; ++i) {
    least = std::min(least, channel_[i].left);
  }
  return least * static_cast<double>(n) / comm_rate;
}

void SimDevice::advance(double dt, double comm_rate) {
  const size_t n = running();
  if (n > 0) {
    const double share = dt * comm_rate / static_cast<double>(n);
    for (size_t i = 0; i < n; ++i) {
      channel_[i].left -= share;
    }
    // Finished (float residue of the division above), wherever they run.
    for (size_t i = n; i-- > 0;) {
      if (channel_[i].left <= 1e-15) {
        in_flight_.at(channel_[i].key).end_s = now_ + dt;
        channel_.erase(channel_.begin() + static_cast<std::ptrdiff_t>(i));
      }
    }
    for (size_t i = 0, now_running = running(); i < now_running; ++i) {
      double& start = in_flight_.at(channel_[i].key).start_s;
      if (start < 0) {
        start = now_ + dt;
      }
    }
  }
  now_ += dt;
}

double SimDevice::cpu_seconds(int64_t iteration) const {
  const auto it = cpu_s_.find(iteration);
  return it == cpu_s_.end() ? 0.0 : it->second;
}

void SimDevice::compute(const std::string& name, double seconds) {
  if (host_owed_s_ > 0) {
    const double owed = host_owed_s_;
    host_owed_s_ = 0.0;
    run("host", owed);
  }
  const double beside = run(name, seconds);
  cpu_s_[iteration_] += seconds + (cost_.compute_cpu_slowdown() - 1.0) * beside;
}

double SimDevice::run(const std::string& name, double seconds) {
  const double compute_slowdown = cost_.compute_slowdown();
  const double comm_rate = 1.0 / cost_.comm_slowdown();
  const double begin = now_;
  double work = seconds;  // left, in idle-machine seconds
  double beside = 0.0;    // done while a collective ran
  while (work > 0) {
    if (channel_.empty()) {
      now_ += work;
      break;
    }
    // Both run: until the first of the two finishes.
    const double compute_left = work * compute_slowdown;
    const double comm_left = time_to_finish(comm_rate);
    const double dt = std::min(compute_left, comm_left);
    const double done = compute_left <= comm_left ? work : dt / compute_slowdown;
    beside += done;
    work -= done;
    advance(dt, comm_rate);
  }
  spans_.push_back({name, iteration_, begin, now_});
  return beside;
}

std::vector<int64_t> SimDevice::begin_backward() {
  // The link model of the backward before (the real device agrees on one
  // measured a few backwards before; in a steady state they are the same).
  if (link_model_ && !ticks_.empty()) {
    drained_.clear();
    double before = backward_begin_;
    for (double tick : ticks_) {
      drained_.push_back(cost_.all_reduce_bytes_in(tick - before, in_issue_order_));
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
  if (op.kind != Collective::kAllGather && profile_.pack_s_per_byte > 0) {
    compute("pack", profile_.pack_s_per_byte * static_cast<double>(layout_.buckets.at(op.bucket).bytes));
  }
  const std::pair<int64_t, int64_t> key{op.bucket, op.slot};
  // start and end are set when the channel reaches and finishes it (advance).
  in_flight_[key] = SimOp{op.kind, op.bucket, op.slot, iteration_, now_, -1.0, -1.0};
  channel_.push_back({key, op.kind, cost_.seconds(op.kind, layout_.buckets.at(op.bucket).bytes, in_issue_order_)});
  host_owed_s_ += cost_.host_seconds(op.kind, in_issue_order_);
  cpu_s_[iteration_] += cost_.host_cpu_seconds(op.kind, layout_.buckets.at(op.bucket).bytes, in_issue_order_);
  if (channel_.size() <= running()) {  // runs at once
    in_flight_[key].start_s = now_;
    if (channel_.size() == 1 && channel_.back().left <= 0) {  // costs nothing (α = β = 0) on an idle channel
      in_flight_[key].end_s = now_;
      channel_.pop_back();
    }
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
  host_owed_s_ = std::max(0.0, host_owed_s_ - (now_ - wait_begin));  // the idle cores did it
  ops_.push_back(done);
  if (op.kind != Collective::kAllGather && profile_.average_s_per_byte > 0) {  // this rank's reduced bytes
    const double bytes = static_cast<double>(layout_.buckets.at(op.bucket).bytes) /
                         (op.kind == Collective::kReduceScatter ? static_cast<double>(cost_.world_size()) : 1.0);
    compute("average", profile_.average_s_per_byte * bytes);
  }
}

void SimDevice::update(int64_t /*bucket*/, const std::vector<int64_t>& params) {
  int64_t numel = 0;
  for (int64_t p : params) {
    numel += profile_.param_numels.at(p);
  }
  compute("update", total_numel_ > 0 ? profile_.step_s * static_cast<double>(numel) / total_numel_ : 0.0);
}

}  // namespace dearcomm::sim
