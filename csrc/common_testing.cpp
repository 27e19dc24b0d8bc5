// dearcomm._C._testing: the device-free pieces of the NCCL backend's
// bookkeeping (watchdog loop, teardown order, handle pool), driven on CPU by
// fake completions so their logic is tested without a GPU; and the CPU
// backend's poster thread on its own.
#include "backends/cpu/poster.h"
#include "common/bounded_teardown.h"
#include "common/handle_pool.h"
#include "common/watchdog.h"

#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace dearcomm {
namespace {

// A completion the test steers: running until set done or failed; with
// `block` set, poll() blocks until cleared (a slow event query).
class FakeCompletion final : public Completion {
 public:
  Status poll(std::string* error) override {
    std::unique_lock<std::mutex> lock(mutex_);
    polls_ += 1;
    changed_.notify_all();
    changed_.wait(lock, [this] { return !block_; });
    if (status_ == Status::kFailed) {
      *error = error_;
    }
    return status_;
  }
  void set(const std::string& state, const std::string& error) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK_VALUE(state == "running" || state == "done" || state == "failed", "unknown state ", state);
    status_ = state == "done" ? Status::kDone : state == "failed" ? Status::kFailed : Status::kRunning;
    error_ = error;
  }
  void set_blocking(bool block) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      block_ = block;
    }
    changed_.notify_all();
  }
  // Waits (GIL released by the binding) until poll() has run `n` times.
  bool wait_polls(int64_t n, double seconds) {
    std::unique_lock<std::mutex> lock(mutex_);
    return changed_.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return polls_ >= n; });
  }
  int64_t polls() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return polls_;
  }

 private:
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  Status status_ = Status::kRunning;
  std::string error_;
  bool block_ = false;
  int64_t polls_ = 0;
};

// A watchdog whose hooks only count, and report an async error on demand.
struct TestWatchdog {
  std::shared_ptr<std::string> async_error = std::make_shared<std::string>();
  std::shared_ptr<std::mutex> async_mutex = std::make_shared<std::mutex>();
  std::shared_ptr<std::atomic<int64_t>> failures = std::make_shared<std::atomic<int64_t>>(0);
  std::shared_ptr<std::atomic<int64_t>> thread_starts = std::make_shared<std::atomic<int64_t>>(0);
  // Whether check() already raised while on_failure ran (it must not: in
  // terminate mode the training thread could catch it and train on).
  std::shared_ptr<std::atomic<bool>> published_before_handled = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<std::weak_ptr<Watchdog>> self = std::make_shared<std::weak_ptr<Watchdog>>();
  std::shared_ptr<Watchdog> watchdog;

  std::shared_ptr<std::atomic<int64_t>> failures_started = std::make_shared<std::atomic<int64_t>>(0);

  // on_failure_ms: how long the failure hook takes (an abort in progress).
  TestWatchdog(double timeout_ms, double poll_ms, double on_failure_ms) {
    WatchdogHooks hooks;
    hooks.on_thread_start = [starts = thread_starts] { starts->fetch_add(1); };
    hooks.async_error = [error = async_error, mutex = async_mutex] {
      std::lock_guard<std::mutex> lock(*mutex);
      return *error;
    };
    hooks.on_failure = [count = failures, started = failures_started, early = published_before_handled,
                        self = self, on_failure_ms](const std::string&) {
      started->fetch_add(1);
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(on_failure_ms));
      if (auto w = self->lock()) {
        early->store(w->failed());
      }
      count->fetch_add(1);
    };
    hooks.consequence = "; (test) nothing aborted";
    watchdog = std::make_shared<Watchdog>(std::chrono::milliseconds(static_cast<int64_t>(timeout_ms)),
                                          std::chrono::milliseconds(static_cast<int64_t>(poll_ms)), 0,
                                          std::move(hooks));
    *self = watchdog;
  }
};

struct DestroyCount {
  std::atomic<int64_t> value{0};
};

struct PooledHandle {
  std::shared_ptr<void> handle;  // back to its pool when the Python object goes
};

// Posts `jobs` jobs to a Poster and destroys it at once (the first job
// sleeps, so the others are still queued then): the jobs that ran, in the
// order they ran, and whether each ran on the posting thread.
std::pair<std::vector<int64_t>, std::vector<bool>> run_poster(int64_t jobs, bool inline_jobs) {
  std::mutex mutex;
  std::vector<int64_t> order;
  std::vector<bool> on_caller;
  const std::thread::id caller = std::this_thread::get_id();
  {
    Poster poster(inline_jobs);
    for (int64_t i = 0; i < jobs; ++i) {
      poster.post([&, i] {
        if (i == 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        std::lock_guard<std::mutex> lock(mutex);
        order.push_back(i);
        on_caller.push_back(std::this_thread::get_id() == caller);
      });
    }
  }
  return {order, on_caller};
}

}  // namespace

// Stands in for a c10d worker thread that is the last owner of a Work
// launched during backward (dearcomm/_exit.py): a thread that destroys a
// Python object in a noexcept destructor, which takes the GIL. Returns once
// the thread is about to take it; the caller keeps the GIL meanwhile.
struct PythonObjectOwner {
  explicit PythonObjectOwner(const py::object& held) : object(held.inc_ref().ptr()) {}
  PythonObjectOwner(const PythonObjectOwner&) = delete;
  PythonObjectOwner& operator=(const PythonObjectOwner&) = delete;
  PyObject* object;
  ~PythonObjectOwner() noexcept {
    py::gil_scoped_acquire gil;  // during finalization: pthread_exit unwinds through here
    Py_DECREF(object);
  }
};

void drop_on_another_thread(const py::object& object) {
  auto taking = std::make_shared<std::atomic<bool>>(false);
  std::thread([owner = std::make_shared<PythonObjectOwner>(object), taking]() mutable {
    taking->store(true);
    owner.reset();
  }).detach();
  while (!taking->load()) {
    std::this_thread::yield();
  }
}

void register_testing(py::module& parent) {
  py::module m = parent.def_submodule("_testing", "device-free pieces of the backends, for tests");
  m.def("drop_on_another_thread", &drop_on_another_thread, py::arg("object"));
  m.def("run_poster", &run_poster, py::arg("jobs"), py::arg("inline_jobs"),
        py::call_guard<py::gil_scoped_release>());
  py::class_<FakeCompletion, std::shared_ptr<FakeCompletion>>(m, "FakeCompletion")
      .def(py::init<>())
      .def("set", &FakeCompletion::set, py::arg("state"), py::arg("error") = "")
      .def("set_blocking", &FakeCompletion::set_blocking)
      .def("wait_polls", &FakeCompletion::wait_polls, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("polls", &FakeCompletion::polls);

  py::class_<TestWatchdog>(m, "Watchdog")
      .def(py::init<double, double, double>(), py::arg("timeout_ms"), py::arg("poll_ms"),
           py::arg("on_failure_ms") = 0.0)
      .def("watch", [](TestWatchdog& w, std::shared_ptr<FakeCompletion> c, std::string what) {
        w.watchdog->watch(std::move(c), std::move(what));
      }, py::call_guard<py::gil_scoped_release>())
      .def("check", [](TestWatchdog& w) { w.watchdog->check(); })
      .def("stop", [](TestWatchdog& w) { w.watchdog->stop(); }, py::call_guard<py::gil_scoped_release>())
      .def("set_async_error", [](TestWatchdog& w, const std::string& error) {
        std::lock_guard<std::mutex> lock(*w.async_mutex);
        *w.async_error = error;
      })
      .def_property_readonly("failed", [](const TestWatchdog& w) { return w.watchdog->failed(); })
      .def_property_readonly("in_flight", [](const TestWatchdog& w) { return w.watchdog->in_flight(); })
      .def_property_readonly("rounds", [](const TestWatchdog& w) { return w.watchdog->rounds(); })
      .def_property_readonly("failures_handled", [](const TestWatchdog& w) { return w.failures->load(); })
      .def_property_readonly("failures_started", [](const TestWatchdog& w) { return w.failures_started->load(); })
      .def_property_readonly("thread_starts", [](const TestWatchdog& w) { return w.thread_starts->load(); })
      .def_property_readonly("published_before_handled",
                             [](const TestWatchdog& w) { return w.published_before_handled->load(); });

  // Runs bounded_teardown with fake steps: idle after `idle_after_polls`
  // queries (-1: never), or a failed stream at once (`stream_failed`).
  // Returns (outcome, destroy calls, abort calls, idle queries).
  m.def("teardown", [](TestWatchdog& w, int64_t idle_after_polls, double grace_ms, bool stream_failed) {
    int64_t queries = 0, destroyed = 0, aborted = 0;
    TeardownSteps steps;
    steps.idle = [&] {
      if (stream_failed) {
        ++queries;
        return Idle::kFailed;
      }
      return idle_after_polls >= 0 && ++queries > idle_after_polls ? Idle::kYes : Idle::kNo;
    };
    steps.destroy = [&] { ++destroyed; };
    steps.abort = [&] { ++aborted; };
    Teardown outcome;
    {
      py::gil_scoped_release no_gil;
      outcome = bounded_teardown(*w.watchdog, steps, std::chrono::milliseconds(static_cast<int64_t>(grace_ms)),
                                 std::chrono::milliseconds(1));
    }
    return py::make_tuple(to_string(outcome), destroyed, aborted, queries);
  }, py::arg("watchdog"), py::arg("idle_after_polls"), py::arg("grace_ms"), py::arg("stream_failed") = false);

  // A handle pool over fake handles (counted integers); `destroyed` counts
  // the handles it gave back, which outlives the pool.
  py::class_<HandlePool, std::shared_ptr<HandlePool>>(m, "HandlePool")
      .def_property_readonly("created", &HandlePool::created)
      .def_property_readonly("available", &HandlePool::available);
  py::class_<DestroyCount, std::shared_ptr<DestroyCount>>(m, "DestroyCount")
      .def_property_readonly("value", [](const DestroyCount& c) { return c.value.load(); });
  m.def("fake_handle_pool", [] {
    auto next = std::make_shared<std::atomic<intptr_t>>(1);
    auto destroyed = std::make_shared<DestroyCount>();
    auto pool = HandlePool::create([next] { return reinterpret_cast<HandlePool::Handle>(next->fetch_add(1)); },
                                   [destroyed](HandlePool::Handle) { destroyed->value.fetch_add(1); });
    return py::make_tuple(pool, destroyed);
  });
  py::class_<PooledHandle>(m, "PooledHandle");
  m.def("acquire", [](const std::shared_ptr<HandlePool>& pool) { return PooledHandle{pool->acquire()}; });
}

}  // namespace dearcomm
