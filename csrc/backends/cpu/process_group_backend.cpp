#include "process_group_backend.h"

#include "python_tls.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <functional>

namespace dearcomm {
namespace {

// The c10d Works of one collective plus the local step that completes it
// (e.g. the sum after the exchange of reduce_scatter).
class WorkHandle final : public PendingCollective {
 public:
  WorkHandle(std::vector<c10::intrusive_ptr<c10d::Work>> works, const char* what, std::function<void()> finish = {})
      : works_(std::move(works)), what_(what), finish_(std::move(finish)) {
    // The completion time, stamped by gloo's threads as the last Work ends (for
    // the timeline). gloo's send/recv Works have no future: then it stays unknown.
    auto state = progress_;
    state->remaining.store(static_cast<int64_t>(works_.size()));
    for (const auto& work : works_) {
      c10::intrusive_ptr<c10::ivalue::Future> future;
      try {
        future = work->getFuture();
      } catch (const std::exception&) {
        return;
      }
      future->addCallback([state](c10::ivalue::Future&) {
        if (state->remaining.fetch_sub(1) == 1) {
          state->completed.store(std::chrono::duration_cast<std::chrono::nanoseconds>(
              std::chrono::steady_clock::now().time_since_epoch()).count());
        }
      });
    }
  }

  int64_t completed_ns() const override { return progress_->completed.load(); }

  void wait(std::chrono::milliseconds timeout) override {
    for (const auto& work : works_) {
      bool completed = false;
      try {
        completed = work->wait(timeout);
      } catch (const std::exception& e) {
        TORCH_CHECK(false, what_, " failed: ", e.what());
      }
      TORCH_CHECK(completed, what_, " did not finish within ", timeout.count(), " ms");
    }
    if (finish_) {
      finish_();
    }
  }

 private:
  struct Progress {
    std::atomic<int64_t> remaining{0};
    std::atomic<int64_t> completed{-1};
  };
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::shared_ptr<Progress> progress_ = std::make_shared<Progress>();
  const char* what_;
  std::function<void()> finish_;
};

}  // namespace

ProcessGroupBackend::ProcessGroupBackend(c10::intrusive_ptr<c10d::ProcessGroup> group)
    : group_(std::move(group)) {
  TORCH_CHECK_VALUE(group_, "dearcomm: the process group is None");
}

std::string ProcessGroupBackend::name() const {
  return "c10d:" + group_->getBackendName();
}

std::vector<c10::intrusive_ptr<c10d::Work>> ProcessGroupBackend::exchange(
    const std::vector<at::Tensor>& outgoing, const std::vector<at::Tensor>& incoming) {
  // Every message of one exchange has the same size, so both ends cut it into
  // the same pieces; tags are (exchange number, piece), the same on every rank
  // because every rank calls exchange() in the same order.
  const int64_t call = next_exchange_++ % kTagCycles;
  const int rank = this->rank();
  NoProfilerRecordInWorks no_records;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (int peer = 0; peer < world_size(); ++peer) {
    if (peer == rank) {
      continue;
    }
    const int64_t bytes = incoming[peer].numel() * static_cast<int64_t>(incoming[peer].element_size());
    const int64_t pieces = std::clamp<int64_t>((bytes + kPieceBytes - 1) / kPieceBytes, 1, kMaxPieces);
    auto in = incoming[peer].chunk(pieces);
    auto out = outgoing[peer].chunk(pieces);
    for (size_t k = 0; k < in.size(); ++k) {
      const int tag = static_cast<int>(call * kMaxPieces + static_cast<int64_t>(k));
      std::vector<at::Tensor> recv_buffer{in[k]};
      std::vector<at::Tensor> send_buffer{out[k]};
      works.push_back(group_->recv(recv_buffer, peer, tag));
      works.push_back(group_->send(send_buffer, peer, tag));
    }
  }
  return works;
}

std::unique_ptr<PendingCollective> ProcessGroupBackend::reduce_scatter(const at::Tensor& input, const at::Tensor& output) {
  WithoutPythonTLS no_python_objects;  // in the Works and their futures' callbacks: see python_tls.h
  const int64_t p = world_size();
  const int64_t shard = output.numel();
  TORCH_CHECK(input.numel() == shard * p,
      "dearcomm: reduce_scatter input has ", input.numel(), " elements, expected ", shard * p);
  at::Tensor& scratch = scatter_scratch_[input.data_ptr()];
  if (!scratch.defined() || scratch.numel() != input.numel() || scratch.dtype() != input.dtype()) {
    scratch = at::empty_like(input);
  }
  // Rank j's chunk of `input` goes to rank j; chunk j of scratch receives rank j's.
  std::vector<at::Tensor> outgoing, incoming;
  for (int64_t j = 0; j < p; ++j) {
    outgoing.push_back(input.narrow(0, j * shard, shard));
    incoming.push_back(scratch.narrow(0, j * shard, shard));
  }
  auto works = exchange(outgoing, incoming);
  const int64_t r = rank();
  at::Tensor own = outgoing[r], own_slot = incoming[r], received = scratch.view({p, shard}), out = output;
  return std::make_unique<WorkHandle>(std::move(works), "reduce-scatter", [own, own_slot, received, out]() mutable {
    own_slot.copy_(own);
    at::sum_out(out, received, /*dim=*/{0});
  });
}

std::unique_ptr<PendingCollective> ProcessGroupBackend::all_gather(const at::Tensor& input, const at::Tensor& output) {
  WithoutPythonTLS no_python_objects;  // in the Works and their futures' callbacks: see python_tls.h
  const int64_t p = world_size();
  const int64_t shard = input.numel();
  TORCH_CHECK(output.numel() == shard * p,
      "dearcomm: all_gather output has ", output.numel(), " elements, expected ", shard * p);
  std::vector<at::Tensor> outgoing(p, input), incoming;
  for (int64_t j = 0; j < p; ++j) {
    incoming.push_back(output.narrow(0, j * shard, shard));
  }
  incoming[rank()].copy_(input);
  return std::make_unique<WorkHandle>(exchange(outgoing, incoming), "all-gather");
}

std::unique_ptr<PendingCollective> ProcessGroupBackend::all_reduce(const at::Tensor& buffer) {
  WithoutPythonTLS no_python_objects;  // in the Work and its future's callbacks: see python_tls.h
  NoProfilerRecordInWorks no_records;
  std::vector<at::Tensor> tensors{buffer};
  return std::make_unique<WorkHandle>(std::vector<c10::intrusive_ptr<c10d::Work>>{group_->allreduce(tensors)},
                                      "all-reduce");
}

void ProcessGroupBackend::pack(const std::vector<at::Tensor>& sources, const std::vector<int64_t>& offsets,
                               const at::Tensor& flat, double scale) {
  for (size_t i = 0; i < sources.size(); ++i) {
    at::Tensor slot = flat.narrow(0, offsets[i], sources[i].numel()).view(sources[i].sizes());
    if (scale == 1.0) {
      slot.copy_(sources[i]);
    } else {
      at::mul_out(slot, sources[i], at::scalar_tensor(scale, sources[i].options()));
    }
  }
}

void ProcessGroupBackend::unpack(const at::Tensor& flat, const std::vector<int64_t>& offsets,
                                 const std::vector<at::Tensor>& destinations) {
  for (size_t i = 0; i < destinations.size(); ++i) {
    at::Tensor destination = destinations[i];
    destination.copy_(flat.narrow(0, offsets[i], destination.numel()).view(destination.sizes()));
  }
}

}  // namespace dearcomm
