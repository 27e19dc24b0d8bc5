#include "process_group_backend.h"

#include <ATen/ATen.h>

#include <atomic>
#include <functional>

namespace dearcomm {
namespace {

// A c10d Work plus the local step that completes it (e.g. the sum after the
// all-to-all of reduce_scatter).
class WorkHandle final : public PendingCollective {
 public:
  WorkHandle(c10::intrusive_ptr<c10d::Work> work, const char* what, std::function<void()> finish = {})
      : work_(std::move(work)), what_(what), finish_(std::move(finish)) {
    // The completion time, stamped by gloo's worker thread (for the timeline).
    auto stamp = completed_;
    work_->getFuture()->addCallback([stamp](c10::ivalue::Future&) {
      stamp->store(std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::chrono::steady_clock::now().time_since_epoch()).count());
    });
  }

  int64_t completed_ns() const override { return completed_->load(); }

  void wait(std::chrono::milliseconds timeout) override {
    bool completed = false;
    try {
      completed = work_->wait(timeout);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, what_, " failed: ", e.what());
    }
    TORCH_CHECK(completed, what_, " did not finish within ", timeout.count(), " ms");
    if (finish_) {
      finish_();
    }
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::shared_ptr<std::atomic<int64_t>> completed_ = std::make_shared<std::atomic<int64_t>>(-1);
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

std::unique_ptr<PendingCollective> ProcessGroupBackend::reduce_scatter(const at::Tensor& input, const at::Tensor& output) {
  const int64_t p = world_size();
  TORCH_CHECK(input.numel() == output.numel() * p,
      "dearcomm: reduce_scatter input has ", input.numel(), " elements, expected ", output.numel() * p);
  at::Tensor& scratch = scatter_scratch_[input.data_ptr()];
  if (!scratch.defined() || scratch.numel() != input.numel() || scratch.dtype() != input.dtype()) {
    scratch = at::empty_like(input);
  }
  at::Tensor in = input;
  std::vector<int64_t> equal_splits;  // empty: p equal chunks
  auto work = group_->all_to_all_single(scratch, in, equal_splits, equal_splits);
  at::Tensor received = scratch.view({p, output.numel()});
  at::Tensor out = output;
  return std::make_unique<WorkHandle>(std::move(work), "reduce-scatter (all_to_all_single)",
      [received, out]() mutable { at::sum_out(out, received, /*dim=*/{0}); });
}

std::unique_ptr<PendingCollective> ProcessGroupBackend::all_gather(const at::Tensor& input, const at::Tensor& output) {
  TORCH_CHECK(output.numel() == input.numel() * world_size(),
      "dearcomm: all_gather output has ", output.numel(), " elements, expected ", input.numel() * world_size());
  at::Tensor in = input;
  at::Tensor out = output;
  return std::make_unique<WorkHandle>(group_->all_gather_single(out, in), "all-gather");
}

std::unique_ptr<PendingCollective> ProcessGroupBackend::all_reduce(const at::Tensor& buffer) {
  std::vector<at::Tensor> tensors{buffer};
  return std::make_unique<WorkHandle>(group_->allreduce(tensors), "all-reduce");
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
