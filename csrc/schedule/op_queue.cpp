#include "schedule/op_queue.h"

#include <algorithm>

namespace dearcomm {

void OpQueue::push(const Op& op, int64_t priority, int64_t bytes) {
  const Entry entry{op, priority, bytes, next_sequence_++};
  auto later = std::upper_bound(queued_.begin(), queued_.end(), entry, [](const Entry& a, const Entry& b) {
    return a.priority != b.priority ? a.priority < b.priority : a.sequence < b.sequence;
  });
  queued_.insert(later, entry);
}

std::vector<Op> OpQueue::tick(int64_t credit) {
  available_ = credit > INT64_MAX - available_ ? INT64_MAX : available_ + credit;
  std::vector<Op> out;
  size_t taken = 0;
  while (taken < queued_.size() && queued_[taken].bytes <= available_) {
    available_ -= queued_[taken].bytes;
    out.push_back(queued_[taken].op);
    ++taken;
  }
  queued_.erase(queued_.begin(), queued_.begin() + static_cast<std::ptrdiff_t>(taken));
  if (queued_.empty()) {
    available_ = 0;
  }
  return out;
}

std::vector<Op> OpQueue::release_all() {
  std::vector<Op> out;
  for (const Entry& entry : queued_) {
    out.push_back(entry.op);
  }
  clear();
  return out;
}

void OpQueue::clear() {
  queued_.clear();
  available_ = 0;
}

}  // namespace dearcomm
