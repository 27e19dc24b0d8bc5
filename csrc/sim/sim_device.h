// The simulated device: the executor's actions on a virtual clock. One
// compute stream (forward, backward and optimizer time from a Profile) and
// one communication channel that runs collectives in issue order, one at a
// time (one NCCL stream; the CPU backend's exchanges and ordered
// all-reduces), except that up to `all_reduce_lanes` consecutive all-reduces
// run at once, sharing the link equally (gloo's worker threads), each taking
// what the CostModel says alone (in issue order: its ordered all-reduce's
// cost, where the schedule asks the backend for that order). A wait moves the compute
// stream to the collective's end. Where compute and a collective run at
// once, compute progresses CostModel::compute_slowdown() times slower and the
// collective comm_slowdown() times slower (cores shared with the transport):
// both are advanced together, piecewise, as work left at a rate. A
// reduction's pack (at its issue) and average (after its wait) run on the
// compute stream at the Profile's cost per byte. Each collective's host cost
// (CostModel::host_seconds) is owed to the compute stream from its issue: the
// next compute pays it first, unless the stream idles in a wait long enough
// to absorb it (the cores are free then). It records
// what the real device traces
// (launch, completion, wait), so a prediction draws like a measurement.
// Standard C++ only.
#pragma once

#include "core/device.h"
#include "core/layout.h"
#include "sim/cost_model.h"
#include "sim/profile.h"

#include <deque>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace dearcomm::sim {

struct SimOp {
  Collective kind = Collective::kAllReduce;
  int64_t bucket = -1;
  int64_t slot = 0;
  int64_t iteration = -1;
  double issued_s = -1.0;  // the host issued it (the compute stream's time)
  double start_s = -1.0;   // the channel began it
  double end_s = -1.0;     // ... and finished it
  double wait_begin_s = -1.0;
  double wait_end_s = -1.0;
};

struct Span {
  std::string name;
  int64_t iteration;
  double start_s;
  double end_s;
};

class SimDevice final : public core::Device {
 public:
  // `link_model`: give the policy the link model (bytes an all-reduce drains
  // between eligibility events, from the previous backward's spacing).
  // `all_reduces_in_issue_order`: the schedule asked the backend for issue
  // order, so all-reduces run one at a time whatever the CostModel's lanes.
  SimDevice(const core::Layout& layout, const Profile& profile, const CostModel& cost, bool link_model,
            bool all_reduces_in_issue_order);

  // `seconds` of work on an idle machine: longer where a collective runs beside it.
  void compute(const std::string& name, double seconds);
  double now() const { return now_; }
  void set_iteration(int64_t iteration) { iteration_ = iteration; }
  const std::vector<SimOp>& ops() const { return ops_; }
  const std::vector<Span>& spans() const { return spans_; }
  // The host CPU `iteration` took: its compute work (as on an idle machine,
  // compute_cpu_slowdown() times that where a collective ran beside it) and
  // its collectives' CPU (CostModel::host_cpu_seconds, counted at issue).
  double cpu_seconds(int64_t iteration) const;

  std::vector<int64_t> begin_backward() override;
  void accept_grad(int64_t /*param*/) override {}
  void eligible(int64_t bucket) override;
  void issue(const Op& op) override;
  void wait(const Op& op) override;
  void averages_to_grad(int64_t /*bucket*/, int64_t /*slot*/, const std::vector<int64_t>& /*params*/) override {}
  void averages_in(int64_t /*bucket*/) override {}
  void update(int64_t bucket, const std::vector<int64_t>& params) override;

 private:
  const core::Layout& layout_;
  const Profile& profile_;
  const CostModel& cost_;
  const bool link_model_;
  const bool in_issue_order_;       // the schedule asked the backend for issue order (its all-reduces' cost)
  const int64_t all_reduce_lanes_;  // all-reduces run at once (the CostModel's, or 1)
  int64_t total_numel_ = 0;
  // The channel's collectives not finished at now_, in issue order: the
  // first `running()` run, each with `left` seconds of work as it would take alone.
  struct Queued {
    std::pair<int64_t, int64_t> key;  // (bucket, slot) in in_flight_
    Collective kind;
    double left;
  };
  // How many of the channel's first collectives run now: the first, and the
  // all-reduces right behind an all-reduce, up to all_reduce_lanes_.
  size_t running() const;
  // Advances the clock by `dt` at the given collective rate (work per
  // second: 1 alone, 1/comm_slowdown beside compute), shared equally by the
  // running collectives: their work goes down, those that finish record their
  // end, and those that start running record their start.
  void advance(double dt, double comm_rate);
  // Wall time until the first running collective finishes, at `comm_rate`.
  double time_to_finish(double comm_rate) const;

  // `seconds` of compute work on the stream, as compute() describes it;
  // returns how much of that work ran beside a collective.
  double run(const std::string& name, double seconds);

  std::map<int64_t, double> cpu_s_;  // per iteration, what cpu_seconds() gives
  double host_owed_s_ = 0.0;  // host cost of collectives issued, not yet paid by compute or idle time
  double now_ = 0.0;  // the compute stream, and the channel's time: both advance together
  std::deque<Queued> channel_;
  int64_t iteration_ = 0;
  std::map<std::pair<int64_t, int64_t>, SimOp> in_flight_;  // per (bucket, slot): its latest collective
  std::vector<SimOp> ops_;        // waited for, in wait order
  std::vector<Span> spans_;
  double backward_begin_ = 0.0;
  std::vector<double> ticks_;     // this backward's eligibility times
  std::vector<int64_t> drained_;  // the model from the previous backward
};

}  // namespace dearcomm::sim
