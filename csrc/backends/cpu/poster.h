// A thread that posts gloo's point-to-point sends and receives for the
// training thread.
//
// gloo's Pair::send/recv take the pair's mutex, which gloo's TCP loop thread
// holds while it reads, and Pair::send writes the whole payload itself when
// the peer's receive is already posted. Posted from the training thread,
// each message could block compute on that mutex, and gloo's loop, which only
// try_locks it, busy-polls epoll meanwhile and preempts the blocked thread on
// shared cores (docs/benchmarks.md, issue 12 §7: ~12 ms per iteration in
// Pair::send/recv with 60 messages). Here the training thread only enqueues;
// jobs run in order, so collectives keep their issue order.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace dearcomm {

class Poster {
 public:
  // inline_jobs: run each job at once on the posting thread (the A/B switch
  // DEARCOMM_CPU_POSTER=0; see process_group_backend.cpp).
  explicit Poster(bool inline_jobs = false) : inline_(inline_jobs) {}
  // Runs every job still queued, then joins the thread.
  ~Poster();
  Poster(const Poster&) = delete;
  Poster& operator=(const Poster&) = delete;

  // Runs `job` on the poster thread (started on first use), after every job
  // posted before it. A job must not throw: it reports its errors itself.
  void post(std::function<void()> job);

 private:
  void run();

  const bool inline_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace dearcomm
