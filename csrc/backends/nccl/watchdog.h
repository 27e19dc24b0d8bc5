// Turns a stuck or failed NCCL collective into an error instead of a hang.
//
// The host never blocks on collectives (it only orders streams), so a dead peer
// would otherwise hang the GPU queue forever. A thread polls every collective
// in flight: past its timeout, or when a communicator reports an asynchronous
// error, it aborts the communicators (which unblocks the kernels) and records
// the reason; the next call of the backend on the training thread raises it.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace dearcomm {

// A CUDA event recorded after a collective, shared by its handle and the watchdog.
class CompletionEvent {
 public:
  CompletionEvent();
  ~CompletionEvent();
  CompletionEvent(const CompletionEvent&) = delete;
  CompletionEvent& operator=(const CompletionEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

class Watchdog {
 public:
  Watchdog(std::vector<ncclComm_t> comms, std::chrono::milliseconds timeout, int rank);
  ~Watchdog();  // stops the thread; does not abort

  void watch(std::shared_ptr<CompletionEvent> event, std::string what);
  // Raises the recorded failure, if any ("dearcomm: [rank r] <what> ...").
  void check() const;
  bool failed() const { return failed_.load(); }

 private:
  struct Entry {
    std::shared_ptr<CompletionEvent> event;
    std::string what;
    std::chrono::steady_clock::time_point start;
  };
  void run();
  void fail(const std::string& reason);

  std::vector<ncclComm_t> comms_;
  std::chrono::milliseconds timeout_;
  int rank_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Entry> in_flight_;
  std::string failure_;
  std::atomic<bool> failed_{false};
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace dearcomm
