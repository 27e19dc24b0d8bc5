#include "bounded_teardown.h"

#include <thread>

namespace dearcomm {

const char* to_string(Teardown outcome) {
  switch (outcome) {
    case Teardown::kDestroyed: return "destroyed";
    case Teardown::kAbortedAfterGrace: return "aborted after grace";
    case Teardown::kAlreadyAborted: return "already aborted";
  }
  return "?";
}

Teardown bounded_teardown(Watchdog& watchdog, const TeardownSteps& steps, std::chrono::milliseconds grace,
                          std::chrono::milliseconds poll_interval) {
  watchdog.stop();  // after this, failed() is final and no abort runs concurrently
  if (watchdog.failed()) {
    return Teardown::kAlreadyAborted;
  }
  const auto deadline = std::chrono::steady_clock::now() + grace;
  for (Idle idle = steps.idle(); idle != Idle::kYes; idle = steps.idle()) {
    if (idle == Idle::kFailed || std::chrono::steady_clock::now() >= deadline) {
      steps.abort();
      return Teardown::kAbortedAfterGrace;
    }
    std::this_thread::sleep_for(poll_interval);
  }
  steps.destroy();
  return Teardown::kDestroyed;
}

}  // namespace dearcomm
