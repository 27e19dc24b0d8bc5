#include "poster.h"

#include <utility>

namespace dearcomm {

Poster::~Poster() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  ready_.notify_one();
  if (thread_.joinable()) {
    thread_.join();
  }
}

void Poster::post(std::function<void()> job) {
  if (inline_) {
    job();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back(std::move(job));
    if (!thread_.joinable()) {
      thread_ = std::thread([this] { run(); });
    }
  }
  ready_.notify_one();
}

void Poster::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    ready_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
    if (jobs_.empty()) {
      return;  // stopping, nothing left
    }
    std::function<void()> job = std::move(jobs_.front());
    jobs_.pop_front();
    lock.unlock();
    job();
    lock.lock();
  }
}

}  // namespace dearcomm
