// What a collective costs on the simulated device: the α–β model of a ring,
// per collective kind (each kind may have its own α and β: NCCL and gloo
// reach different bandwidths for them). For n bytes over p ranks:
//   reduce-scatter, all-gather   (p-1)·α + (p-1)/p · n · β
//   all-reduce                 2·(p-1)·α + 2·(p-1)/p · n · β
// and what a collective in flight costs the compute beside it: where the
// transport and the summing run on the cores that compute (gloo on a CPU),
// compute runs `compute_slowdown` times longer while the channel is busy, and
// a collective `comm_slowdown` times longer while compute runs beside it
// (measured factors >= 1: benchmarks/contention.py; 1 where they do not share).
// `host_s` of a kind: compute-stream seconds each collective of it costs the
// host, where its CPU work (gloo's threads, the engine's bookkeeping) takes
// the cores the compute runs on: a fixed cost per collective that the
// bandwidth terms and compute_slowdown (measured on large collectives) leave
// out, and which many small collectives add up (0 on a GPU).
// `host_s_per_byte` of a kind: the host CPU each byte of its buffer takes
// (gloo's summing and copies), in the same compute-stream seconds. It does
// not stretch the timeline (compute_slowdown carries that beside the
// collectives); it bounds it: an iteration takes at least its compute work
// plus its collectives' CPU, `comm_cpu_slowdown` times what they take alone
// (Python passes comm_slowdown unless told otherwise), where the ranks fill
// the cores (Result::cpu_s); compute beside a collective counts
// `compute_cpu_slowdown` times its work (1 unless told otherwise).
// `iteration_cv`: how much one rank's compute iteration varies (its spread
// over its median). The ranks meet every iteration, so where the cores bound
// it an iteration takes the slowest rank's: the bound times
// slowest_rank_factor(), 1 + cv times the expected largest of world_size
// standard normal draws (0 by default: every rank alike).
// `cores_share`: the ranks on a host over its cores, where their compute
// fills every core (0 where it does not, or on a GPU). Above 1 the ranks take
// turns on the cores: a rank that reaches the meeting first hands its core to
// a slower one, so the spread costs the iteration nothing and the factor is 1
// (4 ranks on 2 cores on loopback: docs/benchmarks.md).
// `all_reduce_lanes`: how many all-reduces the backend runs at once, sharing
// the link (gloo: its two worker threads take posted all-reduces in turn; 1
// where collectives run one at a time, as on one NCCL stream).
// `ordered_all_reduce`: the cost of an all-reduce the backend keeps in issue
// order, where that is another implementation (the CPU backend's: its own
// reduce-scatter and all-gather exchanges, pipelined, in place of gloo's
// allreduce: 6-23% slower than gloo's at 4 ranks on the emulated 1 Gbit/s
// link, within 4% at 2); the same as `all_reduce` where it is one (NCCL).
// Standard C++ only.
#pragma once

#include "schedule/policy.h"

#include <cstdint>

namespace dearcomm::sim {

struct AlphaBeta {
  double alpha_s = 0.0;           // per step of the ring
  double seconds_per_byte = 0.0;  // β: 1 / bandwidth
  double host_s = 0.0;            // the host's per-collective cost, taken from compute
  double host_s_per_byte = 0.0;   // the host's CPU per byte of the buffer (bounds the iteration)
};

class CostModel {
 public:
  CostModel(int64_t world_size, AlphaBeta reduce_scatter, AlphaBeta all_gather, AlphaBeta all_reduce,
            AlphaBeta ordered_all_reduce, double compute_slowdown = 1.0, double comm_slowdown = 1.0,
            int64_t all_reduce_lanes = 1, double comm_cpu_slowdown = 1.0, double compute_cpu_slowdown = 1.0,
            double iteration_cv = 0.0, double cores_share = 0.0);
  // `in_issue_order`: the backend keeps this collective in issue order (the schedule asked).
  double seconds(Collective kind, int64_t bytes, bool in_issue_order = false) const;
  double host_seconds(Collective kind, bool in_issue_order = false) const {
    return of(kind, in_issue_order).host_s;
  }
  // The host CPU a collective of `bytes` takes beside compute: its fixed
  // and per-byte cost, comm_cpu_slowdown() times what it takes alone.
  double host_cpu_seconds(Collective kind, int64_t bytes, bool in_issue_order = false) const {
    const AlphaBeta& ab = of(kind, in_issue_order);
    return comm_cpu_slowdown_ * (ab.host_s + ab.host_s_per_byte * static_cast<double>(bytes));
  }
  double compute_slowdown() const { return compute_slowdown_; }
  double comm_slowdown() const { return comm_slowdown_; }
  double comm_cpu_slowdown() const { return comm_cpu_slowdown_; }
  double compute_cpu_slowdown() const { return compute_cpu_slowdown_; }
  // What the CPU bound of one rank is multiplied by for the slowest of them.
  double slowest_rank_factor() const { return slowest_rank_factor_; }
  int64_t all_reduce_lanes() const { return all_reduce_lanes_; }
  // Bytes an all-reduce moves through the link in `seconds` once started
  // (the link model a queueing policy gets).
  int64_t all_reduce_bytes_in(double seconds, bool in_issue_order = false) const;
  int64_t world_size() const { return world_size_; }

 private:
  const AlphaBeta& of(Collective kind, bool in_issue_order) const;
  int64_t world_size_;
  AlphaBeta reduce_scatter_, all_gather_, all_reduce_, ordered_all_reduce_;
  double compute_slowdown_;
  double comm_slowdown_;
  int64_t all_reduce_lanes_;
  double comm_cpu_slowdown_;
  double compute_cpu_slowdown_;
  double slowest_rank_factor_;  // from iteration_cv, world_size and cores_share
};

// The expected largest of `n` independent standard normal draws (0 for one,
// 1/sqrt(pi) for two), integrated numerically to four digits.
double expected_slowest_of(int64_t n);

}  // namespace dearcomm::sim
