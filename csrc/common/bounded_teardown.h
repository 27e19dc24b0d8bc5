// How a backend with its own communicators ends, in bounded time.
//
// Order matters (c10d's ProcessGroupNCCL learned it): stop the watchdog
// first, so no abort can start while the communicators are being freed; then,
// if the watchdog already aborted them, free nothing more; else give enqueued
// collectives up to `grace` to finish (they need every peer) and destroy the
// communicators in order, or abort them if a peer never came (or at once if
// the stream failed). Never an
// unbounded stream synchronize: a dead peer would hang it forever.
#pragma once

#include "watchdog.h"

#include <chrono>
#include <functional>

namespace dearcomm {

enum class Teardown { kDestroyed, kAbortedAfterGrace, kAlreadyAborted };

const char* to_string(Teardown outcome);

enum class Idle { kYes, kNo, kFailed };  // kFailed: the stream hit an error; nothing will drain

struct TeardownSteps {
  std::function<Idle()> idle;      // have all enqueued collectives finished? never blocks
  std::function<void()> destroy;   // orderly free
  std::function<void()> abort;     // forced free; unblocks stuck kernels
};

Teardown bounded_teardown(Watchdog& watchdog, const TeardownSteps& steps, std::chrono::milliseconds grace,
                          std::chrono::milliseconds poll_interval);

}  // namespace dearcomm
