#include "schedule/op_queue.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace dearcomm {

OpQueue::OpQueue(int64_t credit_bytes) : credit_(credit_bytes) {
  TORCH_CHECK_VALUE(credit_bytes > 0, "dearcomm: the credit must be > 0 bytes, got ", credit_bytes);
}

void OpQueue::push(const Op& op, int64_t priority, int64_t bytes) {
  const Entry entry{op, priority, bytes, next_sequence_++};
  auto later = std::upper_bound(queued_.begin(), queued_.end(), entry, [](const Entry& a, const Entry& b) {
    return a.priority != b.priority ? a.priority < b.priority : a.sequence < b.sequence;
  });
  queued_.insert(later, entry);
}

template <typename Goes>
std::vector<Op> OpQueue::release(int64_t drained, Goes goes) {
  TORCH_CHECK(drained >= 0, "dearcomm: a tick drained ", drained, " bytes");
  in_flight_ = drained >= in_flight_ ? 0 : in_flight_ - drained;
  std::vector<Op> out;
  size_t taken = 0;
  while (taken < queued_.size() && (in_flight_ == 0 || goes(in_flight_, queued_[taken].bytes))) {
    in_flight_ += queued_[taken].bytes;
    out.push_back(queued_[taken].op);
    ++taken;
  }
  queued_.erase(queued_.begin(), queued_.begin() + static_cast<std::ptrdiff_t>(taken));
  return out;
}

std::vector<Op> OpQueue::tick(int64_t drained) {
  return release(drained, [this](int64_t in_flight, int64_t bytes) { return bytes <= credit_ - in_flight; });
}

std::vector<Op> OpQueue::tick_within(int64_t drained, int64_t window) {
  return release(drained, [window](int64_t in_flight, int64_t) { return in_flight < window; });
}

std::vector<Op> OpQueue::release_all() {
  std::vector<Op> out;
  for (const Entry& entry : queued_) {
    in_flight_ += entry.bytes;
    out.push_back(entry.op);
  }
  queued_.clear();
  return out;
}

void OpQueue::clear() {
  queued_.clear();
  in_flight_ = 0;
}

}  // namespace dearcomm
