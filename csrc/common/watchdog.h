// Turns a stuck or failed collective into an error instead of a hang.
//
// The NCCL backend never blocks the host on a collective (it only orders
// streams), so a dead peer would otherwise hang the GPU queue forever. A
// thread polls every collective in flight; past its timeout, when one reports
// an error, or when the communicator reports an asynchronous error, it records
// the reason (check() raises it on the training thread from then on) and
// calls the backend's on_failure (abort the communicators, end the process).
//
// Device-free on purpose: what a "collective in flight" is comes in through
// Completion, so the loop is tested on CPU with fake completions.
//
// Note [Watchdog locking] - producers (watch(), on the training thread, at
// every enqueue) and the polling thread share one short critical section:
// handing new entries over. Polling (cudaEventQuery, NCCL's async-error query)
// happens with no lock held, and the thread sleeps `poll_interval` between
// rounds, so watch() never waits for a collective and the thread does not
// spin a core.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace dearcomm {

// Something in flight the watchdog can ask about without blocking.
class Completion {
 public:
  enum class Status { kRunning, kDone, kFailed };
  virtual ~Completion() = default;
  // Never blocks. kFailed sets `error`.
  virtual Status poll(std::string* error) = 0;
};

struct WatchdogHooks {
  std::function<void()> on_thread_start;           // e.g. bind the thread to the backend's device
  std::function<std::string()> async_error;        // "" while the communicator is healthy
  // Runs once, on the watchdog thread, before check() starts raising.
  std::function<void(const std::string&)> on_failure;
  std::string consequence;  // what on_failure does, appended to the error check() raises
};

class Watchdog {
 public:
  Watchdog(std::chrono::milliseconds timeout, std::chrono::milliseconds poll_interval, int rank,
           WatchdogHooks hooks);
  ~Watchdog();  // stop()
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Starts timing `completion` (named `what` in errors). Takes the short lock only.
  void watch(std::shared_ptr<Completion> completion, std::string what);
  // Raises the recorded failure, if any ("dearcomm: [rank r] <what> ...").
  void check() const;
  bool failed() const { return failed_.load(); }
  // Ends the thread (waits for a failure being handled to finish); idempotent.
  // No hook runs after it returns.
  void stop();

  // For tests: entries not yet seen complete, and poll rounds so far.
  int64_t in_flight() const;
  int64_t rounds() const { return rounds_.load(); }

 private:
  struct Entry {
    std::shared_ptr<Completion> completion;
    std::string what;
    std::chrono::steady_clock::time_point start;
  };
  void run();
  std::string poll_round(std::deque<Entry>& watched);  // the failure reason, or ""

  const std::chrono::milliseconds timeout_;
  const std::chrono::milliseconds poll_interval_;
  const int rank_;
  const WatchdogHooks hooks_;

  mutable std::mutex mutex_;  // guards incoming_, failure_, stop_ (Note [Watchdog locking])
  std::condition_variable wake_;
  std::deque<Entry> incoming_;
  std::string failure_;
  bool stop_ = false;
  std::atomic<bool> failed_{false};
  std::atomic<int64_t> watched_count_{0};  // entries handed over and not yet done
  std::atomic<int64_t> rounds_{0};
  std::thread thread_;  // last: started once everything above exists
};

}  // namespace dearcomm
