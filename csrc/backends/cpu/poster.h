// A thread that posts gloo's point-to-point sends and receives for the
// training thread.
//
// gloo's Pair::send/recv take the pair's mutex, which gloo's TCP loop thread
// holds while it reads, and Pair::send writes the whole payload itself when
// the peer's receive is already posted. Posted from the training thread,
// each message could block compute on that mutex, and gloo's loop, which only
// try_locks it, busy-polls epoll meanwhile and preempts the blocked thread on
// shared cores (docs/benchmarks.md, "Findings: ResNet at 2 ranks": ~12 ms per iteration in
// Pair::send/recv with 60 messages). Here the training thread only enqueues;
// jobs run in order, so exchanges keep their issue order.
//
// A job must drop its tensors before it tells the waiter (the Works it hands
// over keep the memory alive): where Python owns that memory, the last
// reference's drop takes the GIL, which the training thread may hold while it
// posts, and which ends this thread (and the process) once the interpreter is
// finalizing.
#pragma once

#include <chrono>
#include <functional>
#include <memory>

namespace dearcomm {

class Poster {
 public:
  // inline_jobs: run each job at once on the posting thread (the A/B switch
  // DEARCOMM_CPU_POSTER=0; see process_group_backend.cpp).
  explicit Poster(bool inline_jobs = false);
  // Runs every job still queued, then joins the thread; if the queue has not
  // drained within `kDrainLimit` (gloo stuck), warns and leaves the thread
  // behind rather than hang the caller.
  ~Poster();
  Poster(const Poster&) = delete;
  Poster& operator=(const Poster&) = delete;

  // Runs `job` on the poster thread, after every job posted before it. A job
  // must not throw: it reports its errors itself (one that throws is dropped).
  void post(std::function<void()> job);

  static constexpr std::chrono::seconds kDrainLimit{60};

 private:
  struct State;  // shared with the thread, which may outlive the Poster (see ~Poster)
  const bool inline_;
  std::shared_ptr<State> state_;
};

}  // namespace dearcomm
