// Releases the GIL for the scope where this thread holds it (and Python is
// running): a destructor that may wait on collectives for seconds must not
// block a Python thread that the wait itself may need.
#pragma once

#include <Python.h>

namespace dearcomm {

class GilRelease {
 public:
  GilRelease() : state_(Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~GilRelease() {
    if (state_ != nullptr) {
      PyEval_RestoreThread(state_);
    }
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_;
};

}  // namespace dearcomm
