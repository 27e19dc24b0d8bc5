// Ops waiting to be issued, most urgent first, released under a credit on the
// bytes in flight.
//
// ByteScheduler issues a ready partition while the bytes in flight stay
// within the credit and returns credit as partitions complete: the backlog
// waits in this queue, where a more urgent partition can still overtake it,
// instead of in the communication library's FIFO. Completion times differ
// between ranks, and every rank must issue the same collectives in the same
// order (gloo and NCCL pair them by order), so the bytes in flight are not
// observed but *modelled*: at each tick (a bucket became eligible, an event
// every rank sees in the same order) the link is taken to have sent
// `drained` bytes since the previous tick, a figure all ranks agree on
// (engine/link_meter.h measures it). An op leaves when it fits under the
// credit, or when nothing is in flight (an op bigger than the credit goes
// alone); nothing overtakes a more urgent op that is still waiting. Pure: no
// tensors, no clock, the same answer on every rank.
#pragma once

#include "schedule/policy.h"

#include <cstdint>
#include <vector>

namespace dearcomm {

class OpQueue {
 public:
  explicit OpQueue(int64_t credit_bytes);

  // Queues `op`; lower `priority` goes first, ties in the order queued.
  void push(const Op& op, int64_t priority, int64_t bytes);
  // One tick: the link sent `drained` bytes since the last one (kDrainedAll:
  // unknown, taken as everything); returns the ops that now go.
  std::vector<Op> tick(int64_t drained);
  // A tick for a schedule that fills the link's gaps (US-Byte): ops go, most
  // urgent first, while the link would start them within `window` bytes from
  // now (so the last may run past the gap), and at least one if it is idle.
  std::vector<Op> tick_within(int64_t drained, int64_t window);
  // Everything queued, most urgent first (backward ended: nothing is left to
  // overtake it).
  std::vector<Op> release_all();
  bool empty() const { return queued_.empty(); }
  // A new iteration: nothing queued, nothing in flight.
  void clear();

  static constexpr int64_t kDrainedAll = INT64_MAX;

 private:
  // Drains, then releases the queue's head while `goes(in_flight, bytes)`.
  template <typename Goes>
  std::vector<Op> release(int64_t drained, Goes goes);

  struct Entry {
    Op op;
    int64_t priority;
    int64_t bytes;
    int64_t sequence;
  };
  const int64_t credit_;
  std::vector<Entry> queued_;  // kept sorted by (priority, sequence)
  int64_t next_sequence_ = 0;
  int64_t in_flight_ = 0;      // modelled: issued and not yet drained
};

}  // namespace dearcomm
