// Python bindings of dearcomm._C. Every call that may issue or wait on a
// collective releases the GIL: gloo's workers may need it to free a finished
// Work while this thread waits, and holding it then deadlocks.
#include "backend_capsule.h"
#include "backends/cpu/process_group_backend.h"
#include "backends/cpu/python_tls.h"
#include "common/host_stamp.h"
#include "engine/bucket_layout.h"
#include "engine/engine.h"
#include "schedule/registry.h"

#include <torch/csrc/Dtype.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include <optional>

namespace py = pybind11;
using namespace dearcomm;

namespace dearcomm {
void register_testing(py::module& parent);  // common_testing.cpp
ScheduleChoice delayed_schedule_for_tests(const std::vector<int64_t>& delayed, int64_t delay);  // schedule/
void register_simulate(py::module& m, c10::ScalarType (*to_scalar_type)(const py::handle&));  // sim_bindings.cpp
py::list transitions_to_list(const std::vector<Transition>& records);
}

namespace {

c10::ScalarType to_scalar_type(const py::handle& dtype) {
  TORCH_CHECK_TYPE(THPDtype_Check(dtype.ptr()), "dearcomm: expected a torch.dtype, got ",
      py::str(py::type::of(dtype)).cast<std::string>());
  return reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
}

py::object to_dtype(c10::ScalarType type) {
  return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(type)));
}

BucketLayout plan(const std::vector<int64_t>& numels, const py::list& dtypes, int64_t bucket_cap_bytes, int64_t world_size,
                  int64_t partition_bytes, const std::vector<std::vector<int64_t>>& blocks) {
  std::vector<c10::ScalarType> types;
  for (const auto& d : dtypes) {
    types.push_back(to_scalar_type(d));
  }
  return plan_buckets(numels, types, bucket_cap_bytes, world_size, partition_bytes, blocks);
}

// A collective started from Python (benchmarks, tests); wait() releases the GIL.
struct PyPending {
  std::unique_ptr<PendingCollective> pending;
  int64_t completed_ns = -1;  // kept when the collective is released
  void wait(double timeout_seconds) {
    TORCH_CHECK(pending, "dearcomm: this collective was already waited for");
    pending->wait(std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000)));
    completed_ns = pending->completed_ns();
    pending.reset();  // here, without the GIL: its Works die off Python's thread state
  }
};

}  // namespace

py::list dearcomm::transitions_to_list(const std::vector<Transition>& records) {
  py::list out;
  for (const Transition& t : records) {
    py::dict d;
    d["sequence"] = t.sequence;
    d["state"] = to_string(t.iteration);
    d["bucket"] = t.bucket;
    d["slot"] = t.slot;
    d["event"] = t.bucket < 0 ? to_string(static_cast<IterationEvent>(t.event))
                              : to_string(static_cast<BucketAction>(t.event));
    d["bucket_state"] = t.bucket < 0 ? py::none() : py::cast(std::string(to_string(t.bucket_state)));
    out.append(d);
  }
  return out;
}

namespace {

std::shared_ptr<Engine> make_engine(
    BucketLayout layout,
    std::vector<at::Tensor> params,
    std::vector<std::string> names,
    c10::intrusive_ptr<c10d::ProcessGroup> group,
    const ScheduleChoice& schedule,
    double timeout_seconds,
    const py::object& backend_capsule,
    const py::object& comm_dtype,
    bool grad_views) {
  std::unique_ptr<SchedulePolicy> policy = schedule.make_policy();
  EngineOptions options;
  options.grad_views = grad_views;
  options.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000.0));
  if (!comm_dtype.is_none()) {
    options.comm_dtype = to_scalar_type(comm_dtype);
    TORCH_CHECK_VALUE(options.comm_dtype == at::kFloat || options.comm_dtype == at::kBFloat16 ||
                      options.comm_dtype == at::kHalf,
        "dearcomm: comm_dtype must be torch.float32, torch.bfloat16 or torch.float16, got ", options.comm_dtype);
  }
  TORCH_CHECK_VALUE(!params.empty(), "dearcomm: no parameters to communicate");
  std::shared_ptr<CommBackend> backend;
  if (backend_capsule.is_none()) {
    TORCH_CHECK_VALUE(params.front().device().is_cpu(),
        "dearcomm: parameters on ", params.front().device(), " need a backend from dearcomm._C_cuda");
    backend = std::make_shared<ProcessGroupBackend>(std::move(group));
  } else {
    backend = backend_from_capsule(backend_capsule.cast<py::capsule>());  // e.g. from dearcomm._C_cuda.nccl_backend
  }
  return std::make_shared<Engine>(std::move(layout), std::move(params), std::move(names), std::move(backend),
                                  std::move(policy), options);
}

py::list schedules() {
  py::list out;
  for (const ScheduleInfo& info : schedule_registry()) {
    py::dict strategies;
    for (const UpdateOption& update : info.updates) {
      strategies[py::str(update.name)] = to_string(update.strategy);
    }
    py::dict entry;
    entry["name"] = info.name;
    entry["summary"] = info.summary;
    entry["updates"] = strategies;  // update name -> its strategy, e.g. "sharded" -> "sharded_at_step"
    entry["default_update"] = info.default_update;
    entry["default_partition_bytes"] = info.default_partition_bytes;  // kNoPartition (INT64_MAX): never split
    entry["default_credit_bytes"] = info.default_credit_bytes;        // 0: no credit
    entry["takes_priorities"] = info.takes_priorities;                // wrap(priorities=) applies
    entry["takes_delays"] = info.takes_delays;                        // wrap(delays=) applies
    out.append(entry);
  }
  return out;
}

py::list as_python(const std::vector<Op>& ops) {
  py::list out;
  for (const Op& op : ops) {
    out.append(py::make_tuple(to_string(op.kind), op.bucket));
  }
  return out;
}

// One iteration of a policy without processes or tensors: the ops it returns
// at each event, as [(event, [(collective, bucket), ...]), ...].
py::dict policy_ops(const std::string& schedule, const std::string& update,
                    const std::vector<int64_t>& bucket_bytes, const std::vector<int64_t>& eligible_order,
                    int64_t credit_bytes, const std::vector<int64_t>& drained,
                    const std::vector<int64_t>& priorities, const std::vector<int64_t>& delays) {
  std::unique_ptr<SchedulePolicy> policy =
      resolve_schedule(schedule, update, credit_bytes ? std::optional<int64_t>(credit_bytes) : std::nullopt)
          .with_bucket_priorities(priorities)
          .with_bucket_delays(delays)
          .make_policy();
  py::list events;
  policy->begin_iteration(bucket_bytes, drained);
  for (int64_t bucket : eligible_order) {
    events.append(py::make_tuple("eligible " + std::to_string(bucket), as_python(policy->on_eligible(bucket))));
  }
  events.append(py::make_tuple("end_of_backward", as_python(policy->at_end_of_backward())));
  events.append(py::make_tuple("step", as_python(policy->at_step(static_cast<int64_t>(bucket_bytes.size())))));
  py::dict out;
  out["events"] = events;
  out["update_strategy"] = to_string(policy->update_strategy());
  out["reduction"] = to_string(policy->reduction());
  out["reductions_waited"] = to_string(policy->reductions_waited());
  out["uses_link_model"] = policy->uses_link_model();
  py::list bucket_delays;
  for (size_t b = 0; b < bucket_bytes.size(); ++b) {
    bucket_delays.append(policy->delay(static_cast<int64_t>(b)));
  }
  out["delays"] = bucket_delays;
  return out;
}

// A host stamp whose time a test gives it later (-1: none yet), as a GPU's
// stamps get theirs once the device passed them.
struct LateStamp {
  std::shared_ptr<std::atomic<int64_t>> ns = std::make_shared<std::atomic<int64_t>>(-1);
  std::shared_ptr<const Stamp> stamp() const { return std::make_shared<HostStamp>(ns); }
};

std::shared_ptr<const Stamp> host_stamp(int64_t ns) {
  return std::make_shared<HostStamp>(ns);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  register_testing(m);
  register_simulate(m, &to_scalar_type);
  m.attr("_testing").cast<py::module>().def("policy_ops", &policy_ops, py::arg("schedule"), py::arg("update"),
      py::arg("bucket_bytes"), py::arg("eligible_order"), py::arg("credit_bytes") = 0,
      py::arg("drained") = std::vector<int64_t>{}, py::arg("priorities") = std::vector<int64_t>{},
      py::arg("delays") = std::vector<int64_t>{},
      "The ops a schedule policy returns at each event of one iteration (no processes, no tensors); "
      "`drained`: the link model, bytes the link sends before each eligibility event (empty: none); "
      "`priorities`, `delays`: per bucket, for a schedule that takes them.");
  py::class_<LinkMeter>(m.attr("_testing").cast<py::module>(), "LinkMeter",
      "engine/link_meter.h on its own: one rank's measurements and the model from summed figures.")
      .def(py::init<int64_t>(), py::arg("num_ticks"))
      .def("begin_backward", &LinkMeter::begin_backward)
      .def("tick", [](LinkMeter& meter, int64_t ns) { meter.tick(host_stamp(ns)); }, py::arg("now_ns"))
      .def("tick", [](LinkMeter& meter, const LateStamp& at) { meter.tick(at.stamp()); }, py::arg("at"))
      .def("reduction_done", [](LinkMeter& meter, int64_t launched_ns, int64_t completed_ns, int64_t bytes) {
            meter.reduction(host_stamp(launched_ns), host_stamp(completed_ns), bytes);  // -1: never timed
          }, py::arg("launched_ns"), py::arg("completed_ns"), py::arg("bytes"))
      .def("reduction_done", [](LinkMeter& meter, const LateStamp& launched, const LateStamp& completed,
                                int64_t bytes) { meter.reduction(launched.stamp(), completed.stamp(), bytes); },
           py::arg("launched"), py::arg("completed"), py::arg("bytes"))
      .def("figures", &LinkMeter::figures)
      .def("model", &LinkMeter::model, py::arg("summed"), py::arg("world_size"));
  m.attr("_testing").cast<py::module>().def("delayed_schedule", &delayed_schedule_for_tests,
      py::arg("delayed_buckets"), py::arg("delay") = 1,
      "wfbp with `delayed_buckets` applied `delay` iterations late (schedule/delayed_for_tests.cpp): a "
      "ScheduleChoice for _C.Engine and _C.simulate.");
  py::class_<LateStamp>(m.attr("_testing").cast<py::module>(), "LateStamp",
      "A stamp without a time until set(ns): a GPU's stamp before the device passed it.")
      .def(py::init<>())
      .def("set", [](LateStamp& s, int64_t ns) { s.ns->store(ns); }, py::arg("ns"));
  m.def("schedules", &schedules,
        "The schedule registry, the one list of schedule names: [{name, summary, updates: {update: strategy}, "
        "default_update}, ...].");
  py::class_<ScheduleChoice>(m, "ScheduleChoice",
      "wrap(schedule=, update=, credit_mb=) resolved against the registry (resolve_schedule): what an Engine "
      "or a simulation is built from.")
      .def_property_readonly("schedule", [](const ScheduleChoice& c) { return c.schedule->name; })
      .def_property_readonly("summary", [](const ScheduleChoice& c) { return c.schedule->summary; })
      .def_property_readonly("update", [](const ScheduleChoice& c) { return c.update->name; })
      .def_property_readonly("update_strategy", [](const ScheduleChoice& c) { return to_string(c.update->strategy); },
                             "The update strategy's name, e.g. 'sharded_at_step' (dearcomm._update has its class).")
      .def_property_readonly("default_partition_bytes",
                             [](const ScheduleChoice& c) { return c.schedule->default_partition_bytes; },
                             "partition_mb=None means this; INT64_MAX: never split.")
      .def_property_readonly("credit_bytes", [](const ScheduleChoice& c) { return c.config.credit_bytes; },
                             "The policy's credit, the schedule's default filled in (0: the schedule has none).")
      .def_property_readonly("bucket_priorities", [](const ScheduleChoice& c) { return c.config.bucket_priorities; },
                             "Per bucket, lower goes first; [] where the schedule's own order applies.")
      .def("with_bucket_priorities", &ScheduleChoice::with_bucket_priorities, py::arg("priorities"),
           "This choice with per-bucket priorities (a planner's order); ValueError for a schedule without them.")
      .def_property_readonly("takes_delays", [](const ScheduleChoice& c) { return c.schedule->takes_delays; },
                             "Whether the schedule applies buckets late by per-bucket delays (wrap(delays=)).")
      .def_property_readonly("bucket_delays", [](const ScheduleChoice& c) { return c.config.bucket_delays; },
                             "Per bucket, how many iterations late it is applied; [] where none is delayed.")
      .def("with_bucket_delays", &ScheduleChoice::with_bucket_delays, py::arg("delays"),
           "This choice with per-bucket delays (a planner's); ValueError for a schedule that applies on time.")
      .def("__repr__", [](const ScheduleChoice& c) {
        return "ScheduleChoice(schedule='" + c.schedule->name + "', update='" + c.update->name +
            "', credit_bytes=" + std::to_string(c.config.credit_bytes) + ")";
      })
      // A value that points into the registry: copies share it; a pickle holds the names and resolves them again.
      .def("__copy__", [](const ScheduleChoice& c) { return c; })
      .def("__deepcopy__", [](const ScheduleChoice& c, const py::dict&) { return c; }, py::arg("memo"))
      .def(py::pickle(
          [](const ScheduleChoice& c) {
            return py::make_tuple(c.schedule->name, c.update->name, c.config.credit_bytes, c.config.bucket_priorities,
                                  c.config.bucket_delays);
          },
          [](const py::tuple& state) {
            const int64_t credit = state[2].cast<int64_t>();
            return resolve_schedule(state[0].cast<std::string>(), state[1].cast<std::string>(),
                                    credit > 0 ? std::optional<int64_t>(credit) : std::nullopt)
                .with_bucket_priorities(state[3].cast<std::vector<int64_t>>())
                .with_bucket_delays(state[4].cast<std::vector<int64_t>>());
          }));
  m.def("resolve_schedule", &resolve_schedule, py::arg("schedule"), py::arg("update") = py::none(),
        py::arg("credit_bytes") = py::none(),
        "The registry's entry for wrap(schedule=, update=, credit_mb=); raises ValueError (unknown name, a credit "
        "the schedule has no use for) or NotImplementedError (an update the schedule lacks).");
  m.doc() = "dearcomm engine: fused buckets, decoupled reduce-scatter / all-gather schedules";

  py::class_<ParamSlot>(m, "ParamSlot")
      .def_readonly("bucket", &ParamSlot::bucket)
      .def_readonly("offset", &ParamSlot::offset)
      .def_readonly("numel", &ParamSlot::numel)
      .def_readonly("last_bucket", &ParamSlot::last_bucket)
      .def("__repr__", [](const ParamSlot& s) {
        return "ParamSlot(bucket=" + std::to_string(s.bucket) + ", offset=" + std::to_string(s.offset) +
            ", numel=" + std::to_string(s.numel) + ", last_bucket=" + std::to_string(s.last_bucket) + ")";
      });

  py::class_<BucketSpec>(m, "BucketSpec")
      .def_readonly("first_param", &BucketSpec::first_param)
      .def_readonly("num_params", &BucketSpec::num_params)
      .def_readonly("numel", &BucketSpec::numel)
      .def_readonly("padded_numel", &BucketSpec::padded_numel)
      .def_readonly("shard_numel", &BucketSpec::shard_numel)
      .def("shard_begin", &BucketSpec::shard_begin, py::arg("rank"),
           "Where rank `rank`'s shard starts in the bucket, in elements.")
      .def_readonly("buffer", &BucketSpec::buffer)
      .def_readonly("buffer_offset", &BucketSpec::buffer_offset)
      .def_property_readonly("dtype", [](const BucketSpec& s) { return to_dtype(s.dtype); });

  py::class_<BucketLayout::Piece>(m, "Piece")
      .def_readonly("param", &BucketLayout::Piece::param)
      .def_readonly("param_offset", &BucketLayout::Piece::param_offset)
      .def_readonly("numel", &BucketLayout::Piece::numel)
      .def_readonly("bucket_offset", &BucketLayout::Piece::bucket_offset);

  py::class_<BucketLayout>(m, "BucketLayout")
      .def_readonly("params", &BucketLayout::params)
      .def_readonly("buckets", &BucketLayout::buckets)
      .def_readonly("world_size", &BucketLayout::world_size)
      .def_readonly("buffer_numels", &BucketLayout::buffer_numels)
      .def("buffer_offset", &BucketLayout::buffer_offset, py::arg("param"),
           "Where the parameter starts in its flat buffer (one per dtype).")
      .def("pieces", &BucketLayout::pieces, py::arg("bucket"), py::arg("begin"), py::arg("end"),
           "Parameters of `bucket` overlapping its element range [begin, end).")
      .def("describe", &BucketLayout::describe);

  m.def("plan_buckets", &plan, py::arg("numels"), py::arg("dtypes"), py::arg("bucket_cap_bytes"),
        py::arg("world_size"), py::arg("partition_bytes") = kNoPartition,
        py::arg("blocks") = std::vector<std::vector<int64_t>>{},
        "Plans fused buckets over parameters given in forward order (pure; no process group). With "
        "partition_bytes, no bucket is larger: a parameter that does not fit in what is left starts the next "
        "bucket, and one larger than a partition is split into partition-sized parts (multiples of "
        "partition_unit()). "
        "blocks (none, or a list per parameter, empty for most): a parameter's explicit pieces in elements, "
        "one bucket each (a planner's sizes).");
  m.def("partition_unit", [](int64_t world_size, const py::handle& dtype) {
    return partition_unit(world_size, to_scalar_type(dtype));
  }, py::arg("world_size"), py::arg("dtype"),
        "Partition boundaries fall on multiples of this many elements.");
  m.attr("SHARD_ALIGN_BYTES") = kShardAlignBytes;
  m.attr("FIRST_BUCKET_CAP_BYTES") = kFirstBucketCapBytes;

  py::enum_<IterationState>(m, "IterationState")
      .value("IDLE", IterationState::kIdle)
      .value("BACKWARD", IterationState::kBackward)
      .value("REDUCED", IterationState::kReduced)
      .value("GATHERING", IterationState::kGathering);
  py::enum_<BucketState>(m, "BucketState")
      .value("FILLING", BucketState::kFilling)
      .value("REDUCING", BucketState::kReducing)
      .value("REDUCED", BucketState::kReduced)
      .value("GATHERING", BucketState::kGathering)
      .value("CURRENT", BucketState::kCurrent);

  using release = py::call_guard<py::gil_scoped_release>;

  // The backends' primitives, one call each, for benchmarks and tests. Every
  // rank must call them in the same order, as with torch.distributed.
  m.def("process_group_backend", [](c10::intrusive_ptr<c10d::ProcessGroup> group) {
    return backend_to_capsule(std::make_shared<ProcessGroupBackend>(std::move(group)));
  }, py::arg("process_group"), "The c10d backend over a process group, as a capsule.");
  // `with _C.no_python_tls():` around Python-level collectives issued during
  // backward (the runtime's first-backward set-up): see python_tls.h.
  struct NoPythonTLS {
    std::optional<WithoutPythonTLS> guard;
  };
  py::class_<NoPythonTLS>(m, "no_python_tls")
      .def(py::init<>())
      .def("__enter__", [](NoPythonTLS& self) { self.guard.emplace(); })
      .def("__exit__", [](NoPythonTLS& self, const py::args&) { self.guard.reset(); });
  py::class_<PyPending>(m, "PendingCollective")
      .def("wait", &PyPending::wait, py::arg("timeout_seconds") = 1800.0, release(),
           "CPU: blocks until done. NCCL: orders the current stream after the collective.")
      .def_property_readonly("completed_ns", [](const PyPending& p) { return p.pending ? p.pending->completed_ns() : p.completed_ns; },
                             "When it completed (steady clock, ns) where the backend knows without waiting; else -1.");
  m.def("reduce_scatter", [](const py::capsule& b, const at::Tensor& input, const at::Tensor& output) {
    auto backend = backend_from_capsule(b);
    py::gil_scoped_release no_gil;
    return PyPending{backend->reduce_scatter(input, output)};
  }, py::arg("backend"), py::arg("input"), py::arg("output"));
  m.def("all_gather", [](const py::capsule& b, const at::Tensor& input, const at::Tensor& output) {
    auto backend = backend_from_capsule(b);
    py::gil_scoped_release no_gil;
    return PyPending{backend->all_gather(input, output)};
  }, py::arg("backend"), py::arg("input"), py::arg("output"));
  m.def("all_reduce", [](const py::capsule& b, const at::Tensor& buffer) {
    auto backend = backend_from_capsule(b);
    py::gil_scoped_release no_gil;
    return PyPending{backend->all_reduce(buffer)};
  }, py::arg("backend"), py::arg("buffer"));
  m.def("keep_issue_order", [](const py::capsule& b) { backend_from_capsule(b)->keep_issue_order(); },
        py::arg("backend"), "From now on the backend's all-reduces hold the link one at a time in issue order.");
  m.def("pack", [](const py::capsule& b, const std::vector<at::Tensor>& sources, const std::vector<int64_t>& offsets,
                   const at::Tensor& flat, double scale) { backend_from_capsule(b)->pack(sources, offsets, flat, scale); },
        py::arg("backend"), py::arg("sources"), py::arg("offsets"), py::arg("flat"), py::arg("scale") = 1.0, release());
  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine")
      .def(py::init(&make_engine), py::arg("layout"), py::arg("params"), py::arg("names"),
           py::arg("process_group"), py::arg("schedule"), py::arg("timeout_seconds"),
           py::arg("backend") = py::none(), py::arg("comm_dtype") = py::none(), py::arg("grad_views") = true)
      .def("mark_grad_ready", &Engine::mark_grad_ready, release())
      .def("missing_grads", &Engine::missing_grads)
      .def("check_backward_complete", &Engine::check_backward_complete)
      .def("end_backward", &Engine::end_backward, release())
      .def_property_readonly("reductions_waited",
                             [](const Engine& e) { return std::string(to_string(e.reductions_waited())); },
                             "Where the reductions are waited for: 'when_backward_returns', 'in_step' or "
                             "'in_next_forward' (schedule/policy.h)")
      .def_property_readonly("update_strategy", [](const Engine& e) { return to_string(e.update_strategy()); })
      .def_property_readonly("reduction", [](const Engine& e) { return to_string(e.reduction()); })
      .def_property_readonly("packed_params", &Engine::packed_params)
      .def("grad_view", [](const Engine& engine, int64_t param) -> py::object {
        at::Tensor view = engine.grad_view(param);
        return view.defined() ? py::cast(view) : py::none();
      }, py::arg("param"))
      .def_property_readonly("uses_grad_views", &Engine::uses_grad_views)
      .def("zero_grads", &Engine::zero_grads, py::arg("params"), py::arg("set_to_none"),
           "Zero-fills bucket views; returns the parameters whose .grad is no view (torch's zero_grad is theirs).")
      .def("finish_reductions", &Engine::finish_reductions, release())
      .def("begin_step", &Engine::begin_step, py::arg("averages_needed"), release(),
           "optimizer.step() begins: waits for the reductions unless the schedule leaves them to the next forward "
           "and nothing else needs the averages")
      .def("end_step", &Engine::end_step, release(),
           "optimizer.step() ends: issues what the next forward consumes, or ends the iteration")
      .def("skip_step", &Engine::skip_step, release())
      .def("require_bucket", &Engine::require_bucket, release())
      .def("flush", &Engine::flush, release())
      .def("grad_shard", &Engine::grad_shard)
      .def("own_part", &Engine::own_part, py::arg("bucket"))
      .def("master_shard", &Engine::master_shard)
      .def("averaged_grad", &Engine::averaged_grad, py::arg("param"),
           "Replicated update: the parameter's averaged gradient, valid from its all-gather to the next backward.")
      .def("pending_averages", &Engine::pending_averages, py::arg("param"),
           "Between steps, after flush(): the parameter's averaged gradients later steps apply (a delayed "
           "bucket's), oldest first, as copies.")
      .def("reload_master_shards", &Engine::reload_master_shards, py::arg("params"))
      .def("bucket_state", &Engine::bucket_state)
      .def_property_readonly("state", &Engine::state)
      .def_property_readonly("prefetch_misses", &Engine::prefetch_misses)
      .def_property_readonly("link_model", &Engine::link_model,
          "Bytes the link is taken to send before each eligibility event of the current backward, as every "
          "rank agreed (a queueing schedule's credit runs on it); [] where there is none yet.")
      .def("pin_link_model", &Engine::pin_link_model, py::arg("drained"), release(),
          "Tests: run every later backward on this link model (bytes drained before each eligibility event), "
          "measuring nothing; on every rank, outside a backward.")
      .def("set_tracing", &Engine::set_tracing, py::arg("on"))
      .def_property_readonly("tracing", &Engine::tracing, "Whether collectives are being recorded for take_trace().")
      .def("take_trace", [](Engine& engine) {
        py::list out;
        for (const TraceEvent& e : engine.take_trace()) {
          py::dict d;
          d["kind"] = e.kind;
          d["bucket"] = e.bucket;
          d["launched_ns"] = e.launched_ns;
          d["completed_ns"] = e.completed_ns;
          d["wait_begin_ns"] = e.wait_begin_ns;
          d["wait_end_ns"] = e.wait_end_ns;
          out.append(d);
        }
        return out;
      }, "The collectives recorded since the last call, as dicts of steady-clock ns.")
      .def("set_recording", &Engine::set_recording, py::arg("on"))
      .def("take_records", [](Engine& engine) { return transitions_to_list(engine.take_records()); },
           "The executor's state changes since the last call: dicts of sequence, state (the iteration's, after), "
           "bucket (-1: an iteration event), event, bucket_state (after).")
      .def_property_readonly("layout", &Engine::layout, py::return_value_policy::reference_internal)
      .def_property_readonly("backend", [](const Engine& e) { return e.backend().name(); })
      .def_property_readonly("all_reduces_in_issue_order", &Engine::all_reduces_in_issue_order)
      .def("set_update_fn", [](Engine& engine, py::function fn) {
        // Called from GIL-free engine code: take the GIL to call, and to drop, the function.
        auto holder = std::shared_ptr<py::function>(new py::function(std::move(fn)), [](py::function* f) {
          py::gil_scoped_acquire gil;
          delete f;
        });
        engine.set_update_fn([holder](const std::vector<int64_t>& params) {
          py::gil_scoped_acquire gil;
          (*holder)(params);
        });
      });
}
