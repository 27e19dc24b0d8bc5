// Keeps Python objects (and profiler records) out of the c10d Works launched in its scope.
//
// Why (SIGABRT, "terminate called without an active
// exception", at interpreter exit after all work had finished): gloo's
// AsyncWork (all_reduce, all_gather_object, ...) copies the launching thread's
// at::ThreadLocalState, and during backward that state holds a Python object:
// autograd stashes a contextvars.Context there for the whole of run_backward
// (torch/autograd/graph.py, key "context"), and the engine launches its
// reductions from gradient hooks. A gloo worker thread releases its reference
// to a Work only after completing the Work's future, so it can be the Work's
// last owner: the training thread's wait() returns, the engine drops its
// handle, the script ends. Destroying the Work on the worker then decrefs the
// Python object, which takes the GIL; once the interpreter is finalizing,
// taking the GIL ends the thread with pthread_exit, whose forced unwind meets
// a noexcept frame, and std::terminate aborts the process (core dump:
// ProcessGroupGloo::runLoop -> ~AsyncAllreduceWork -> ~ThreadLocalState ->
// SafePyObject -> gil_scoped_acquire -> PyThread_exit_thread -> terminate).
//
// Launching with those objects set aside (and restored at once) leaves the
// Works nothing that needs the GIL to be destroyed, on any thread, at any time.
#pragma once

#include <ATen/ThreadLocalPythonObjects.h>
#include <ATen/record_function.h>

namespace dearcomm {

class WithoutPythonTLS {
 public:
  WithoutPythonTLS() : saved_(at::impl::ThreadLocalPythonObjects::get_state()) {
    at::impl::ThreadLocalPythonObjects::set_state({});
  }
  // Restores the same shared pointers: no Python object is freed, no GIL needed.
  ~WithoutPythonTLS() { at::impl::ThreadLocalPythonObjects::set_state(std::move(saved_)); }
  WithoutPythonTLS(const WithoutPythonTLS&) = delete;
  WithoutPythonTLS& operator=(const WithoutPythonTLS&) = delete;

 private:
  at::impl::ThreadLocalPythonObjects saved_;
};

// Keeps torch.profiler's records out of the c10d Works launched in its scope.
//
// A Work launched while a profiler records opens a RecordFunction that its
// completion ends, on a gloo thread, whenever that is. dear's all-gathers are
// launched in step() and finished by the next forward: a profiler session
// that ends between the two (a `with torch.profiler.profile():` around some
// iterations) had its state freed before those records ended, and the
// process crashed at the next garbage collection or at exit (glibc "free():
// invalid size"). The engine's own ranges ("dearcomm::all_gather[bucket 3]",
// the waits) still show every collective in the profile.
class NoProfilerRecordInWorks {
 public:
  NoProfilerRecordInWorks() = default;
  NoProfilerRecordInWorks(const NoProfilerRecordInWorks&) = delete;
  NoProfilerRecordInWorks& operator=(const NoProfilerRecordInWorks&) = delete;

 private:
  at::DisableRecordFunctionGuard guard_;
};

}  // namespace dearcomm
