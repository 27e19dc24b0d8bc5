// Ops waiting to be issued, most urgent first, released under a credit.
//
// ByteScheduler issues a ready partition when the bytes in flight allow and
// returns the credit when a partition completes: the backlog then waits in its
// queue, where a more urgent partition can still overtake it, instead of in
// the communication library's FIFO. Completion times differ between ranks,
// and every rank must issue the same collectives in the same order (gloo and
// NCCL pair them by order), so here the credit is returned by *ticks*, events
// every rank sees in the same order (a bucket became eligible): each tick
// returns `credit` bytes, as if the network had sent that much since the last
// one; an op leaves when the credit covers it, most urgent first, and nothing
// overtakes a more urgent op that is still waiting. Credit unused while the
// queue is empty is lost (an idle network sends nothing later). Pure: no
// tensors, no clock, the same answer on every rank.
#pragma once

#include "schedule/policy.h"

#include <cstdint>
#include <vector>

namespace dearcomm {

class OpQueue {
 public:
  // Queues `op`; lower `priority` goes first, ties in the order queued.
  void push(const Op& op, int64_t priority, int64_t bytes);
  // One tick: `credit` more bytes may go; returns the ops that now go.
  std::vector<Op> tick(int64_t credit);
  // Everything queued, most urgent first (backward ended: nothing is left to
  // overtake it).
  std::vector<Op> release_all();
  bool empty() const { return queued_.empty(); }
  void clear();

 private:
  struct Entry {
    Op op;
    int64_t priority;
    int64_t bytes;
    int64_t sequence;
  };
  std::vector<Entry> queued_;  // kept sorted by (priority, sequence)
  int64_t next_sequence_ = 0;
  int64_t available_ = 0;      // credit returned and not yet spent
};

}  // namespace dearcomm
