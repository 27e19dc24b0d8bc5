#include "process_group_backend.h"

#include "python_tls.h"

#include "../../common/error_text.h"
#include "../../common/host_stamp.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace dearcomm {

// The c10d Works of one collective, once posted (at once, or by the poster
// thread), or why posting failed; and when the last Work completed.
class Posting {
 public:
  explicit Posting(bool whole = false) : whole_(whole) {}
  // Takes the Works and stamps the completion time as the last one ends (gloo's
  // threads run the callbacks; send/recv Works have no future: then it stays unknown).
  void complete(std::vector<c10::intrusive_ptr<c10d::Work>> works) {
    auto progress = progress_;
    progress->remaining.store(static_cast<int64_t>(works.size()));
    for (const auto& work : works) {
      c10::intrusive_ptr<c10::ivalue::Future> future;
      try {
        future = work->getFuture();
      } catch (const std::exception&) {
        break;
      }
      future->addCallback([progress](c10::ivalue::Future&) {
        if (progress->remaining.fetch_sub(1) == 1) {
          progress->completed.store(steady_now_ns());
        }
      });
    }
    settle(std::move(works), nullptr);
  }
  void fail(std::exception_ptr error) { settle({}, std::move(error)); }
  // The poster ran the whole collective, waiting for its Works itself (no
  // other thread may wait for a gloo send or receive: its completion is
  // consumed by the first waiter); it completed at `completed_ns`.
  void ran(int64_t completed_ns) {
    progress_->completed.store(completed_ns);
    settle({}, nullptr);
  }

  // The Works, once posted, handed over to the caller (once; later calls get
  // none): a poster job may hold the Posting last, and must not be left the
  // Works, whose memory is freed on the waiting thread (WorkHandle::wait).
  // Throws what posting threw, or if it took longer than `timeout`.
  std::vector<c10::intrusive_ptr<c10d::Work>> take_works(std::chrono::milliseconds timeout, const char* what) {
    std::unique_lock<std::mutex> lock(mutex_);
    TORCH_CHECK(posted_.wait_for(lock, timeout, [this] { return done_; }),
        what, whole_ ? " did not finish within " : " was not even posted within ", timeout.count(), " ms");
    if (error_) {
      try {
        std::rethrow_exception(error_);
      } catch (const std::exception& e) {
        TORCH_CHECK(false, what, whole_ ? " failed: " : " could not be posted: ", error_text(e));
      } catch (...) {
        TORCH_CHECK(false, what, whole_ ? " failed" : " could not be posted");
      }
    }
    return std::move(works_);
  }
  int64_t completed_ns() const { return progress_->completed.load(); }
  // The completion time as a stamp: it has a time once complete() stamped it.
  std::shared_ptr<const Stamp> finished() const {
    return std::make_shared<HostStamp>(std::shared_ptr<const std::atomic<int64_t>>(progress_, &progress_->completed));
  }

 private:
  void settle(std::vector<c10::intrusive_ptr<c10d::Work>> works, std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      TORCH_INTERNAL_ASSERT(!done_, "dearcomm: a collective was posted twice");
      works_ = std::move(works);
      error_ = std::move(error);
      done_ = true;
    }
    posted_.notify_all();
  }

  struct Progress {
    std::atomic<int64_t> remaining{0};
    std::atomic<int64_t> completed{-1};
  };
  std::shared_ptr<Progress> progress_ = std::make_shared<Progress>();
  const bool whole_;  // the poster runs the whole collective (ran() or fail())
  std::mutex mutex_;
  std::condition_variable posted_;
  bool done_ = false;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::exception_ptr error_;
};

namespace {

// One collective plus the local step that completes it (e.g. the sum after
// the exchange of reduce_scatter).
class WorkHandle final : public PendingCollective {
 public:
  WorkHandle(std::shared_ptr<Posting> posting, const char* what, std::function<void()> finish = {})
      : posting_(std::move(posting)), what_(what), finish_(std::move(finish)) {}

  int64_t completed_ns() const override { return posting_->completed_ns(); }
  std::shared_ptr<const Stamp> finished() const override { return posting_->finished(); }

  // One deadline for posting and every Work: `timeout` bounds the whole wait.
  void wait(std::chrono::milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    if (!taken_) {
      works_ = posting_->take_works(timeout, what_);
      taken_ = true;
    }
    for (const auto& work : works_) {
      // At least 1 ms: c10d reads a zero timeout as "no timeout".
      const auto left = std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now()));
      bool completed = false;
      try {
        completed = work->wait(left);
      } catch (const std::exception& e) {
        TORCH_CHECK(false, what_, " failed: ", error_text(e));
      }
      TORCH_CHECK(completed, what_, " did not finish within ", timeout.count(), " ms");
    }
    // gloo's worker drops its references to a Work just after completing it:
    // wait for that, so that the last reference, and the memory the Work
    // holds, goes on this thread. Where Python owns that memory (a storage
    // Python has seen: torch.save, from_numpy), the thread that frees it takes
    // the GIL, which on gloo's thread aborts the process at exit (python_tls.h).
    for (const auto& work : works_) {
      while (work.use_count() > 1 && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::yield();
      }
    }
    if (finish_) {
      finish_();
    }
  }

 private:
  std::shared_ptr<Posting> posting_;
  const char* what_;
  std::function<void()> finish_;
  bool taken_ = false;                                // the Works were taken from the posting
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;  // released with this handle, on the waiting thread
};

// A sum of host integers: gloo sums them in a tensor of their own.
class HostSum final : public PendingSum {
 public:
  HostSum(at::Tensor values, c10::intrusive_ptr<c10d::Work> work) : values_(std::move(values)), work_(std::move(work)) {}
  std::vector<int64_t> result(std::chrono::milliseconds timeout) override {
    bool completed = false;
    try {
      completed = work_->wait(timeout);
    } catch (const std::exception& e) {  // gloo throws on a timeout too
      TORCH_CHECK(false, "the sum of ", values_.numel(), " int64 over the ranks failed or did not finish within ",
                  timeout.count(), " ms: ", error_text(e));
    }
    TORCH_CHECK(completed, "the sum of ", values_.numel(), " int64 over the ranks did not finish within ",
                timeout.count(), " ms");
    const int64_t* summed = values_.data_ptr<int64_t>();
    return std::vector<int64_t>(summed, summed + values_.numel());
  }

 private:
  at::Tensor values_;
  c10::intrusive_ptr<c10d::Work> work_;
};

// DEARCOMM_CPU_POSTER=0 posts on the training thread, as before the poster
// existed: a switch for A/B measurements and debugging, not a tuning knob.
bool post_inline() {
  const char* value = std::getenv("DEARCOMM_CPU_POSTER");
  return value != nullptr && std::string(value) == "0";
}

// DEARCOMM_CPU_ORDERED=1 orders every all-reduce, =0 none (gloo's allreduce,
// which runs two at once); unset, those of a schedule that asks
// (keep_issue_order). A switch for A/B measurements, not a tuning knob.
int ordered_override() {
  const char* value = std::getenv("DEARCOMM_CPU_ORDERED");
  return value == nullptr ? -1 : std::string(value) == "0" ? 0 : 1;
}

// A tensor over `t`'s memory that refers to no other tensor: a view would
// keep `t` itself alive, and with it the Python object of a tensor made in
// Python (the benchmarks' _C.all_reduce), in the Works and jobs of the
// collective. Freeing that object takes the GIL, which a gloo worker or the
// poster must never need (python_tls.h); the memory itself is released on the
// waiting thread (WorkHandle::wait, exchange()).
at::Tensor same_memory(const at::Tensor& t) {
  return at::empty({0}, t.options()).set_(t.storage(), t.storage_offset(), t.sizes(), t.strides());
}

// out = the sum of the ranks' copies of one chunk: `own`, this rank's, and
// row j of `rows`, rank j's (row `rank` is free for `own`). With two ranks one
// add, own + other: the same sum in either rank's order (float addition
// commutes), without first copying `own` into its row. `out` may be `own`.
void sum_with_own(at::Tensor out, const at::Tensor& own, const at::Tensor& rows, int64_t rank) {
  if (rows.size(0) == 2) {
    at::add_out(out, own, rows[1 - rank]);
    return;
  }
  rows[rank].copy_(own);
  at::sum_out(out, rows, /*dim=*/{0});
}

}  // namespace

ProcessGroupBackend::ProcessGroupBackend(c10::intrusive_ptr<c10d::ProcessGroup> group)
    : ordered_override_(post_inline() ? 0 : ordered_override()),  // inline, the poster would block the caller
      ordered_all_reduce_(ordered_override_ == 1),
      group_(std::move(group)),
      poster_(post_inline()) {
  TORCH_CHECK_VALUE(group_, "dearcomm: the process group is None");
}

std::string ProcessGroupBackend::name() const {
  return "c10d:" + group_->getBackendName();
}

int64_t ProcessGroupBackend::next_tags() {
  return next_exchange_++ % kTagCycles * kMaxPieces;
}

int64_t ProcessGroupBackend::piece_count(int64_t bytes) {
  return std::clamp<int64_t>((bytes + kPieceBytes - 1) / kPieceBytes, 1, kMaxPieces);
}

std::shared_ptr<Posting> ProcessGroupBackend::exchange(const std::vector<at::Tensor>& outgoing,
                                                        const std::vector<at::Tensor>& incoming) {
  // Every message of one exchange has the same size, so both ends cut it into
  // the same pieces; tags are (exchange number, piece), the same on every rank
  // because every rank calls exchange() in the same order. The job drops its
  // pieces before it settles the posting: the Works, which the waiter holds,
  // are then the last to hold the memory (poster.h).
  struct Piece {
    int peer;
    int tag;
    at::Tensor in, out;
  };
  const int64_t tags = next_tags();
  std::vector<Piece> pieces;
  for (int peer = 0; peer < world_size(); ++peer) {
    if (peer == rank()) {
      continue;
    }
    const int64_t count = piece_count(incoming[peer].nbytes());
    auto in = incoming[peer].chunk(count);
    auto out = outgoing[peer].chunk(count);
    for (size_t k = 0; k < in.size(); ++k) {
      pieces.push_back({peer, static_cast<int>(tags + static_cast<int64_t>(k)), in[k], out[k]});
    }
  }
  auto posting = std::make_shared<Posting>();
  poster_.post([group = group_, pieces = std::move(pieces), posting]() mutable {
    // Both guards matter where this runs on the training thread (DEARCOMM_CPU_POSTER=0); see python_tls.h.
    WithoutPythonTLS no_python_objects;
    NoProfilerRecordInWorks no_records;
    try {
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      for (const Piece& piece : pieces) {
        std::vector<at::Tensor> recv_buffer{piece.in};
        std::vector<at::Tensor> send_buffer{piece.out};
        works.push_back(group->recv(recv_buffer, piece.peer, piece.tag));
        works.push_back(group->send(send_buffer, piece.peer, piece.tag));
      }
      pieces.clear();
      posting->complete(std::move(works));
    } catch (...) {  // a job must not throw (poster.h): the waiter raises it
      pieces.clear();
      posting->fail(std::current_exception());
    }
  });
  return posting;
}

at::Tensor ProcessGroupBackend::scratch_for(const at::Tensor& buffer) {
  at::Tensor& scratch = scatter_scratch_[buffer.data_ptr()];
  if (!scratch.defined() || scratch.numel() != buffer.numel() || scratch.dtype() != buffer.dtype()) {
    scratch = at::empty_like(buffer);
  }
  return scratch;
}

std::unique_ptr<PendingCollective> ProcessGroupBackend::reduce_scatter(const at::Tensor& input_tensor,
                                                                      const at::Tensor& output_tensor) {
  const at::Tensor input = same_memory(input_tensor), output = same_memory(output_tensor);
  const int64_t p = world_size();
  const int64_t shard = output.numel();
  TORCH_CHECK(input.numel() == shard * p,
      "dearcomm: reduce_scatter input has ", input.numel(), " elements, expected ", shard * p);
  at::Tensor scratch = scratch_for(input);
  // Rank j's chunk of `input` goes to rank j; chunk j of scratch receives rank j's.
  std::vector<at::Tensor> outgoing, incoming;
  for (int64_t j = 0; j < p; ++j) {
    outgoing.push_back(input.narrow(0, j * shard, shard));
    incoming.push_back(scratch.narrow(0, j * shard, shard));
  }
  auto posting = exchange(outgoing, incoming);
  const int64_t r = rank();
  at::Tensor own = outgoing[r], received = scratch.view({p, shard}), out = output;
  return std::make_unique<WorkHandle>(std::move(posting), "reduce-scatter", [own, received, out, r]() mutable {
    sum_with_own(out, own, received, r);
  });
}

std::unique_ptr<PendingCollective> ProcessGroupBackend::all_gather(const at::Tensor& input_tensor,
                                                                  const at::Tensor& output_tensor) {
  const at::Tensor input = same_memory(input_tensor), output = same_memory(output_tensor);
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

std::unique_ptr<PendingCollective> ProcessGroupBackend::ordered_all_reduce(const at::Tensor& tensor) {
  const at::Tensor buffer = same_memory(tensor).view({-1});  // contiguous (all_reduce checked): chunks along its elements
  const int p = world_size();
  const int r = rank();
  const int64_t shard = buffer.numel() / p;
  at::Tensor scratch = scratch_for(buffer);
  // Chunk j is rank j's; the reduce-scatter sends chunk j to rank j and
  // receives rank j's copy of chunk r into received[j]; the all-gather sends
  // the summed chunk r to every rank and receives rank j's into chunk j. Each
  // chunk goes in pieces of ~kPieceBytes, piece k of every chunk at the same
  // offset, so piece k can be summed and sent on while later pieces arrive.
  std::vector<at::Tensor> chunks, received;
  for (int j = 0; j < p; ++j) {
    chunks.push_back(buffer.narrow(0, j * shard, shard));
    received.push_back(scratch.narrow(0, j * shard, shard));
  }
  const int64_t count = piece_count(shard * static_cast<int64_t>(buffer.element_size()));
  const int64_t piece = (shard + count - 1) / count;  // as Tensor::chunk(count) cuts
  const int64_t scatter_tag = next_tags();
  const int64_t gather_tag = next_tags();
  auto posting = std::make_shared<Posting>(/*whole=*/true);
  poster_.post([group = group_, p, r, shard, piece, scatter_tag, gather_tag, chunks = std::move(chunks),
                received = std::move(received), summands = scratch.view({p, shard}), posting]() mutable {
    WithoutPythonTLS no_python_objects;
    NoProfilerRecordInWorks no_records;
    // Everything that holds the caller's memory goes before the caller is
    // told: a finished collective keeps none of it.
    auto release = [&] {
      chunks.clear();
      received.clear();
      summands = at::Tensor();
    };
    try {
      using Works = std::vector<c10::intrusive_ptr<c10d::Work>>;
      auto send = [&](const at::Tensor& t, int peer, int64_t tag) {
        std::vector<at::Tensor> buffers{t};
        return group->send(buffers, peer, static_cast<int>(tag));
      };
      auto recv = [&](const at::Tensor& t, int peer, int64_t tag) {
        std::vector<at::Tensor> buffers{t};
        return group->recv(buffers, peer, static_cast<int>(tag));
      };
      std::vector<Works> arriving;  // per piece: the reduce-scatter's receives
      Works rest;                   // sends and the all-gather's receives, waited at the end
      for (int64_t k = 0, offset = 0; offset < shard; ++k, offset += piece) {
        const int64_t length = std::min(piece, shard - offset);
        arriving.emplace_back();
        for (int j = 0; j < p; ++j) {
          if (j == r) {
            continue;
          }
          arriving.back().push_back(recv(received[j].narrow(0, offset, length), j, scatter_tag + k));
          rest.push_back(send(chunks[j].narrow(0, offset, length), j, scatter_tag + k));
          // Safe before our send of this piece is done: rank j sends it only
          // after summing, so after it received ours.
          rest.push_back(recv(chunks[j].narrow(0, offset, length), j, gather_tag + k));
        }
      }
      for (int64_t k = 0, offset = 0; offset < shard; ++k, offset += piece) {
        const int64_t length = std::min(piece, shard - offset);
        for (const auto& work : arriving[k]) {
          work->wait();  // the group's timeout; the training thread's wait has its own
        }
        at::Tensor own = chunks[r].narrow(0, offset, length);
        sum_with_own(own, own, summands.narrow(1, offset, length), r);
        for (int j = 0; j < p; ++j) {
          if (j != r) {
            rest.push_back(send(own, j, gather_tag + k));
          }
        }
      }
      for (const auto& work : rest) {
        work->wait();
      }
      const int64_t completed = steady_now_ns();
      arriving.clear();
      rest.clear();
      release();
      posting->ran(completed);
    } catch (...) {  // a job must not throw (poster.h): the waiter raises it
      release();
      posting->fail(std::current_exception());
    }
  });
  // The handle keeps the memory too, so that its last reference goes on the
  // waiting thread even where the caller dropped its tensor before waiting.
  return std::make_unique<WorkHandle>(std::move(posting), "all-reduce", [buffer] {});
}

void ProcessGroupBackend::keep_issue_order() {
  ordered_all_reduce_ = ordered_override_ != 0;
  if (!ordered_all_reduce_ && post_inline()) {
    TORCH_WARN_ONCE("dearcomm: DEARCOMM_CPU_POSTER=0 posts on the training thread, so the schedule's all-reduces "
                    "cannot be kept in issue order; gloo's allreduce runs two at once");
  }
}

std::unique_ptr<PendingCollective> ProcessGroupBackend::all_reduce(const at::Tensor& buffer) {
  if (ordered_all_reduce_ && world_size() > 1 && buffer.numel() % world_size() == 0 && buffer.is_contiguous()) {
    return ordered_all_reduce(buffer);
  }
  WithoutPythonTLS no_python_objects;  // in the Work and its future's callbacks: see python_tls.h
  NoProfilerRecordInWorks no_records;
  std::vector<at::Tensor> tensors{same_memory(buffer)};  // gloo's thread may drop the Work last
  auto posting = std::make_shared<Posting>();  // gloo's own threads run it: posted at once
  posting->complete({group_->allreduce(tensors)});
  return std::make_unique<WorkHandle>(std::move(posting), "all-reduce");
}

std::shared_ptr<const Stamp> ProcessGroupBackend::stamp() {
  return std::make_shared<HostStamp>(steady_now_ns());
}

std::unique_ptr<PendingSum> ProcessGroupBackend::sum_host(const std::vector<int64_t>& values) {
  WithoutPythonTLS no_python_objects;
  NoProfilerRecordInWorks no_records;
  at::Tensor tensor = at::empty({static_cast<int64_t>(values.size())}, at::TensorOptions().dtype(at::kLong));
  std::copy(values.begin(), values.end(), tensor.data_ptr<int64_t>());
  std::vector<at::Tensor> tensors{tensor};
  auto work = group_->allreduce(tensors);
  return std::make_unique<HostSum>(std::move(tensor), std::move(work));
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
