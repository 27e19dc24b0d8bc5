// The link model a queueing schedule's credit runs on (schedule/op_queue.h):
// how many bytes the link sends between two eligibility events ("ticks") of a
// backward.
//
// Each rank measures the link's rate (the bytes its reductions carried over
// the time at least one of them was in flight, launch to completion) and the
// spacing of its ticks; one all-reduce of a few int64 per iteration sums the
// ranks' figures, and their means are the model every rank uses. Integer
// arithmetic on the summed figures makes the model bit-identical everywhere,
// so every rank's queue still issues the same collectives in the same order.
//
// The lag: iteration i's reductions complete in the next forward, so the rate
// they give is sent at the end of backward i+1 together with that backward's
// tick spacing, and used from backward i+2 on. Before that, and where the
// backend reports no completion times, there is no model.
#pragma once

#include <cstdint>
#include <vector>

namespace dearcomm {

class LinkMeter {
 public:
  explicit LinkMeter(int64_t num_ticks) : num_ticks_(num_ticks) {}

  // A backward begins: the reductions recorded since the last one give the rate.
  void begin_backward();
  void tick(int64_t now_ns);
  // A reduction of `bytes` was launched and completed at these steady_clock
  // times (ns); ignored where the completion time is unknown (< 0).
  void reduction_done(int64_t launched_ns, int64_t completed_ns, int64_t bytes);

  // This rank's figures, to be summed over the ranks: [1 if it has a rate,
  // rate in bytes per ms, then the gap before each tick in µs].
  std::vector<int64_t> figures() const;
  int64_t num_figures() const { return 2 + num_ticks_; }
  // From the figures summed over `world_size` ranks: the bytes drained before
  // each tick. Empty where some rank had no rate yet.
  std::vector<int64_t> model(const std::vector<int64_t>& summed, int64_t world_size) const;

 private:
  struct Interval {
    int64_t begin_ns, end_ns, bytes;
  };
  const int64_t num_ticks_;
  std::vector<Interval> reductions_;  // since the last begin_backward
  int64_t rate_bytes_per_ms_ = -1;    // -1: none measured
  std::vector<int64_t> tick_ns_;      // this backward's ticks
};

}  // namespace dearcomm
