// A free list of opaque handles (CUDA events) that are costly to create and
// destroy at every collective. acquire() hands out a shared handle that goes
// back to the pool when its last owner (the pending collective, the watchdog)
// lets go; the pool itself lives until the last handle is back.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace dearcomm {

class HandlePool : public std::enable_shared_from_this<HandlePool> {
 public:
  using Handle = void*;

  static std::shared_ptr<HandlePool> create(std::function<Handle()> make, std::function<void(Handle)> destroy) {
    return std::shared_ptr<HandlePool>(new HandlePool(std::move(make), std::move(destroy)));
  }
  ~HandlePool() {
    for (Handle h : free_) {
      destroy_(h);
    }
  }
  HandlePool(const HandlePool&) = delete;
  HandlePool& operator=(const HandlePool&) = delete;

  // A handle from the free list, or a new one. The shared_ptr's pointee is the handle.
  std::shared_ptr<void> acquire() {
    Handle handle = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_.empty()) {
        handle = free_.back();
        free_.pop_back();
      }
    }
    if (handle == nullptr) {
      handle = make_();
      std::lock_guard<std::mutex> lock(mutex_);
      ++created_;
    }
    // The deleter keeps the pool alive until the handle is back.
    return std::shared_ptr<void>(handle, [pool = shared_from_this()](Handle h) { pool->release(h); });
  }

  int64_t created() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return created_;
  }
  int64_t available() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<int64_t>(free_.size());
  }

 private:
  HandlePool(std::function<Handle()> make, std::function<void(Handle)> destroy)
      : make_(std::move(make)), destroy_(std::move(destroy)) {}
  void release(Handle handle) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(handle);
  }

  const std::function<Handle()> make_;
  const std::function<void(Handle)> destroy_;
  mutable std::mutex mutex_;
  std::vector<Handle> free_;
  int64_t created_ = 0;
};

}  // namespace dearcomm
