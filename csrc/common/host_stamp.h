// Stamps on the host's steady_clock (comm_backend.h): the CPU backend's
// clock, where the time is known at once, or once a collective completes.
#pragma once

#include "../engine/comm_backend.h"

#include <atomic>
#include <chrono>
#include <memory>

namespace dearcomm {

inline int64_t steady_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now().time_since_epoch()).count();
}

class HostStamp final : public Stamp {
 public:
  // A time already known.
  explicit HostStamp(int64_t ns) : ns_(std::make_shared<std::atomic<int64_t>>(ns)) {}
  // A time another thread stores into `ns` later (-1 until then).
  explicit HostStamp(std::shared_ptr<const std::atomic<int64_t>> ns) : ns_(std::move(ns)) {}

  std::optional<int64_t> since(const Stamp& origin) const override {
    const auto* host = dynamic_cast<const HostStamp*>(&origin);
    if (host == nullptr) {
      return std::nullopt;  // another backend's clock: no common time
    }
    const int64_t from = host->ns(), to = ns();
    if (from < 0 || to < 0) {
      return std::nullopt;
    }
    return to - from;
  }
  int64_t ns() const { return ns_->load(); }

 private:
  std::shared_ptr<const std::atomic<int64_t>> ns_;
};

}  // namespace dearcomm
