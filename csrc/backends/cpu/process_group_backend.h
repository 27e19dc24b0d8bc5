// CPU backend: the collectives of a c10d ProcessGroup (gloo), called from C++.
// c10d Work objects stand in for the events of the NCCL backend.
#pragma once

#include "../../engine/comm_backend.h"
#include "poster.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>
#include <unordered_map>

namespace dearcomm {

class Posting;  // the Works of one collective, once posted (exchanges: by the poster thread)

class ProcessGroupBackend final : public CommBackend {
 public:
  explicit ProcessGroupBackend(c10::intrusive_ptr<c10d::ProcessGroup> group);

  std::string name() const override;
  int rank() const override { return group_->getRank(); }
  int world_size() const override { return group_->getSize(); }
  std::shared_ptr<const Stamp> stamp() override;
  std::unique_ptr<PendingSum> sum_host(const std::vector<int64_t>& values) override;

  // gloo has no true reduce-scatter: c10d's gloo reduce_scatter all-reduces the
  // whole buffer, twice DeAR's traffic. This one sends each rank its chunk
  // ((p-1)/p of the bucket out and in, as a ring RS) into a scratch buffer kept
  // per input buffer, then sums the p chunks locally in wait().
  // Reduce-scatter and all-gather move their data with exchange(): see there.
  std::unique_ptr<PendingCollective> reduce_scatter(const at::Tensor& input, const at::Tensor& output) override;
  std::unique_ptr<PendingCollective> all_gather(const at::Tensor& input, const at::Tensor& output) override;
  std::unique_ptr<PendingCollective> all_reduce(const at::Tensor& buffer) override;
  void keep_issue_order() override;
  bool all_reduces_in_issue_order() const override { return ordered_all_reduce_; }
  void pack(const std::vector<at::Tensor>& sources, const std::vector<int64_t>& offsets,
            const at::Tensor& flat, double scale) override;
  void unpack(const at::Tensor& flat, const std::vector<int64_t>& offsets,
              const std::vector<at::Tensor>& destinations) override;

 private:
  // Point-to-point: outgoing[j] to rank j, incoming[j] from rank j, all posted
  // at once, by poster_ (off the training thread: poster.h), in pieces of
  // ~kPieceBytes. gloo serialises one large send against one large receive on
  // a pair (measured at 1 Gbit/s: 8 MiB each way took 137 ms as one message,
  // 76 ms as 8 pieces, 53 ms one way), so pieces are what makes the exchange
  // full-duplex. gloo's all_to_all_single and all_gather reached half the line
  // rate for the same reason.
  std::shared_ptr<Posting> exchange(const std::vector<at::Tensor>& outgoing,
                                    const std::vector<at::Tensor>& incoming);
  // The first tag of the next exchange's pieces: tags are (exchange number,
  // piece), the same on every rank because every rank calls in the same order.
  int64_t next_tags();
  // How many pieces of ~kPieceBytes a message of `bytes` goes in.
  static int64_t piece_count(int64_t bytes);
  // all_reduce once keep_issue_order() was called: the reduce-scatter
  // exchange, a local sum and the all-gather exchange, piece by piece, run
  // whole by the poster thread, so all-reduces hold the link one at a time in
  // issue order (gloo's own allreduce runs two at once on its two worker
  // threads, sharing the link: the one issued first finishes later).
  std::unique_ptr<PendingCollective> ordered_all_reduce(const at::Tensor& tensor);
  const int ordered_override_;  // DEARCOMM_CPU_ORDERED: 1 every all-reduce, 0 none, -1 where asked
  bool ordered_all_reduce_;
  static constexpr int64_t kPieceBytes = 1 << 20;
  static constexpr int64_t kMaxPieces = 64;
  static constexpr int64_t kTagCycles = int64_t{1} << 24;  // tags stay below 2^30
  int64_t next_exchange_ = 0;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  // Receive buffers of reduce_scatter, one per input buffer (buckets are
  // persistent, so this allocates once per bucket: fresh large allocations
  // cost ~10x a copy on these machines).
  std::unordered_map<const void*, at::Tensor> scatter_scratch_;
  // That scratch for `buffer` (made or remade to its size and dtype).
  at::Tensor scratch_for(const at::Tensor& buffer);
  Poster poster_;  // last: destroyed first, posting what is still queued
};

}  // namespace dearcomm
