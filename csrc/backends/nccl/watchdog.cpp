#include "watchdog.h"

#include "nccl_check.h"

namespace dearcomm {

CompletionEvent::CompletionEvent() {
  DEARCOMM_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
}

CompletionEvent::~CompletionEvent() {
  if (event_ != nullptr) {
    cudaEventDestroy(event_);  // no throwing from a destructor; a failure here is harmless
  }
}

Watchdog::Watchdog(std::vector<ncclComm_t> comms, std::chrono::milliseconds timeout, int rank)
    : comms_(std::move(comms)), timeout_(timeout), rank_(rank), thread_([this] { run(); }) {}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void Watchdog::watch(std::shared_ptr<CompletionEvent> event, std::string what) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    in_flight_.push_back({std::move(event), std::move(what), std::chrono::steady_clock::now()});
  }
  wake_.notify_all();
}

void Watchdog::check() const {
  if (failed_.load()) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(false, failure_);
  }
}

void Watchdog::fail(const std::string& reason) {
  // Abort unblocks every kernel of these communicators; they are unusable after.
  for (ncclComm_t comm : comms_) {
    ncclCommAbort(comm);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  failure_ = "dearcomm: [rank " + std::to_string(rank_) + "] " + reason +
             "; the NCCL communicators were aborted";
  failed_.store(true);
  in_flight_.clear();
}

void Watchdog::run() {
  using namespace std::chrono_literals;
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_ && !failed_.load()) {
    wake_.wait_for(lock, 50ms, [this] { return stop_ || !in_flight_.empty(); });
    // Collectives complete in the order they were enqueued on each stream;
    // finished ones are dropped, the oldest unfinished one is timed.
    std::string reason;
    for (auto it = in_flight_.begin(); it != in_flight_.end();) {
      const cudaError_t state = cudaEventQuery(it->event->get());
      if (state == cudaSuccess) {
        it = in_flight_.erase(it);
      } else if (state != cudaErrorNotReady) {
        reason = it->what + " failed: " + cudaGetErrorString(state);
        break;
      } else if (std::chrono::steady_clock::now() - it->start > timeout_) {
        reason = it->what + " did not finish within " + std::to_string(timeout_.count()) + " ms";
        break;
      } else {
        ++it;
      }
    }
    for (ncclComm_t comm : comms_) {
      ncclResult_t async = ncclSuccess;
      if (reason.empty() && ncclCommGetAsyncError(comm, &async) == ncclSuccess && async != ncclSuccess) {
        reason = std::string("NCCL reported an asynchronous error: ") + ncclGetErrorString(async);
      }
    }
    if (!reason.empty()) {
      lock.unlock();
      fail(reason);
      return;
    }
  }
}

}  // namespace dearcomm
