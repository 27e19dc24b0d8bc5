#include "poster.h"

#include "../../common/gil_release.h"

#include <c10/util/Logging.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

namespace dearcomm {

struct Poster::State {
  std::mutex mutex;
  std::condition_variable ready;    // a job was queued, or stopping
  std::condition_variable drained;  // the thread has run its last job and ends
  std::deque<std::function<void()>> jobs;
  bool stopping = false;
  bool finished = false;
  std::thread thread;

  void run() {
    std::unique_lock<std::mutex> lock(mutex);
    while (true) {
      ready.wait(lock, [this] { return stopping || !jobs.empty(); });
      if (jobs.empty()) {
        break;  // stopping, nothing left
      }
      std::function<void()> job = std::move(jobs.front());
      jobs.pop_front();
      lock.unlock();
      try {
        job();
      } catch (...) {  // jobs report their own errors; never let one end the process
      }
      job = nullptr;  // its Works and views go before the lock is taken again
      lock.lock();
    }
    finished = true;
    drained.notify_all();
  }
};

Poster::Poster(bool inline_jobs) : inline_(inline_jobs), state_(std::make_shared<State>()) {}

Poster::~Poster() {
  const GilRelease no_gil;  // the drain may take up to kDrainLimit (a stuck exchange)
  std::unique_lock<std::mutex> lock(state_->mutex);
  if (!state_->thread.joinable()) {
    return;  // never started (inline, or nothing posted)
  }
  state_->stopping = true;
  state_->ready.notify_one();
  if (state_->drained.wait_for(lock, kDrainLimit, [this] { return state_->finished; })) {
    lock.unlock();
    state_->thread.join();
    return;
  }
  LOG(WARNING) << "dearcomm: the CPU backend's poster thread did not post its last " << state_->jobs.size()
               << " exchange(s) within " << kDrainLimit.count() << " s (gloo stuck?); leaving it behind";
  state_->thread.detach();  // it keeps `state` alive through its own reference
}

void Poster::post(std::function<void()> job) {
  if (inline_) {
    job();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (!state_->thread.joinable()) {  // started before the job is queued: if this throws, nothing is left queued
      state_->thread = std::thread([state = state_] { state->run(); });
    }
    state_->jobs.push_back(std::move(job));
  }
  state_->ready.notify_one();
}

}  // namespace dearcomm
