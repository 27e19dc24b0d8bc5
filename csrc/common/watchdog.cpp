#include "watchdog.h"

#include <c10/util/Exception.h>

namespace dearcomm {

Watchdog::Watchdog(std::chrono::milliseconds timeout, std::chrono::milliseconds poll_interval, int rank,
                   WatchdogHooks hooks)
    : timeout_(timeout), poll_interval_(poll_interval), rank_(rank), hooks_(std::move(hooks)),
      thread_([this] { run(); }) {}

Watchdog::~Watchdog() {
  stop();
}

void Watchdog::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) {
    thread_.join();
  }
}

void Watchdog::watch(std::shared_ptr<Completion> completion, std::string what) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (failed_.load() || stop_) {
    return;  // nobody polls any more; check() reports the failure
  }
  incoming_.push_back({std::move(completion), std::move(what), std::chrono::steady_clock::now()});
  watched_count_.fetch_add(1);
}

void Watchdog::check() const {
  if (failed_.load()) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(false, failure_);
  }
}

int64_t Watchdog::in_flight() const {
  return watched_count_.load();
}

std::string Watchdog::poll_round(std::deque<Entry>& watched) {
  // Entries are checked oldest first; finished ones are dropped wherever they
  // are (collectives of one stream finish in order, but nothing relies on it).
  const auto now = std::chrono::steady_clock::now();
  for (auto it = watched.begin(); it != watched.end();) {
    std::string error;
    const Completion::Status status = it->completion->poll(&error);
    if (status == Completion::Status::kDone) {
      it = watched.erase(it);
      watched_count_.fetch_sub(1);
    } else if (status == Completion::Status::kFailed) {
      return it->what + " failed: " + error;
    } else if (now - it->start > timeout_) {
      return it->what + " did not finish within " + std::to_string(timeout_.count()) + " ms";
    } else {
      ++it;
    }
  }
  if (hooks_.async_error) {
    const std::string async = hooks_.async_error();
    if (!async.empty()) {
      return "the communicator reported an asynchronous error: " + async;
    }
  }
  return "";
}

void Watchdog::run() {
  if (hooks_.on_thread_start) {
    hooks_.on_thread_start();
  }
  std::deque<Entry> watched;  // this thread's own: polled with no lock held
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    // Sleep a round unless told to stop; new entries wait for the next round.
    wake_.wait_for(lock, poll_interval_, [this] { return stop_; });
    if (stop_) {
      return;
    }
    for (Entry& entry : incoming_) {
      watched.push_back(std::move(entry));
    }
    incoming_.clear();
    lock.unlock();
    const std::string reason = poll_round(watched);
    rounds_.fetch_add(1);
    if (!reason.empty()) {
      // The backend acts first (it may end the process): an error raised on
      // the training thread before that could be caught and trained past.
      if (hooks_.on_failure) {
        hooks_.on_failure(reason);
      }
      watched_count_.fetch_sub(static_cast<int64_t>(watched.size()));
      watched.clear();
      lock.lock();
      watched_count_.fetch_sub(static_cast<int64_t>(incoming_.size()));
      incoming_.clear();
      failure_ = "dearcomm: [rank " + std::to_string(rank_) + "] " + reason + hooks_.consequence;
      failed_.store(true);  // from here on check() raises on the training thread
      return;
    }
    lock.lock();
  }
}

}  // namespace dearcomm
