// The link model a queueing schedule's credit runs on (schedule/op_queue.h):
// how many bytes the link sends between two eligibility events ("ticks") of a
// backward.
//
// Each rank measures the link's rate (the bytes its reductions carried over
// the time at least one of them was in flight, launch to completion) and the
// spacing of its ticks; one sum of a few int64 over the ranks per iteration
// gives their means, the model every rank uses. Integer arithmetic on the
// summed figures makes the model bit-identical everywhere, so every rank's
// queue still issues the same collectives in the same order.
//
// Times are stamps on the backend's clock (comm_backend.h), read once they
// have a time: at once on the CPU; on a GPU when the device got there, which
// may be an iteration or two after the host. So each figure is the latest one
// known: the reductions recorded so far give the rate at the first backward
// that begins once all of their stamps have a time, and the latest backward
// whose ticks all have a time gives the spacing. Which iteration that was may differ between ranks; the sum every
// rank adopts, and when (engine.h: kLinkAgreementLag), does not.
#pragma once

#include "comm_backend.h"

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

namespace dearcomm {

class LinkMeter {
 public:
  explicit LinkMeter(int64_t num_ticks) : num_ticks_(num_ticks) {}

  // A backward begins: the reductions recorded so far give the rate, once
  // all of their stamps have a time.
  void begin_backward();
  void tick(std::shared_ptr<const Stamp> at);
  // A reduction of `bytes` was launched and completes at these stamps.
  void reduction(std::shared_ptr<const Stamp> launched, std::shared_ptr<const Stamp> finished, int64_t bytes);

  // The backward ended: this rank's figures, to be summed over the ranks:
  // [1 if it has a rate and a tick spacing, rate in bytes per ms, then the gap
  // before each tick in µs].
  std::vector<int64_t> figures();
  int64_t num_figures() const { return 2 + num_ticks_; }
  // From the figures summed over `world_size` ranks: the bytes drained before
  // each tick. Empty where some rank had no figures yet.
  std::vector<int64_t> model(const std::vector<int64_t>& summed, int64_t world_size) const;

  // Stamps that never get a time (a backend that cannot tell) are dropped
  // after this many backwards, so nothing grows without bound.
  static constexpr int kKeepBackwards = 4;

 private:
  struct Reduction {
    std::shared_ptr<const Stamp> launched, finished;
    int64_t bytes;
    int64_t batch;  // begin_backward() calls before it was recorded
  };
  void measure_rate();
  bool measure_spacing(const std::vector<std::shared_ptr<const Stamp>>& ticks);

  const int64_t num_ticks_;
  std::vector<Reduction> reductions_;                               // recorded, not yet measured, oldest first
  int64_t batch_ = 0;                                               // begin_backward() calls so far
  std::vector<std::shared_ptr<const Stamp>> ticks_;                 // this backward's
  std::deque<std::vector<std::shared_ptr<const Stamp>>> untimed_;   // earlier backwards' ticks, oldest first
  int64_t rate_bytes_per_ms_ = -1;  // -1: none measured
  std::vector<int64_t> gaps_us_;    // the latest timed backward's; empty: none
};

}  // namespace dearcomm
