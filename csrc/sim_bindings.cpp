// dearcomm._C.simulate: a schedule on the simulated device (sim/), for
// dearcomm.simulate (dearcomm/simulate.py), which validates and plans first.
#include "engine/bucket_layout.h"
#include "schedule/registry.h"
#include "sim/simulate.h"

#include <torch/csrc/utils/pybind.h>

#include <map>
#include <string>
#include <tuple>
#include <vector>

namespace py = pybind11;

namespace dearcomm {

py::list transitions_to_list(const std::vector<Transition>& records);  // bindings.cpp

namespace {

using PerKind = std::map<std::string, double>;

double of_kind(const PerKind& by_kind, const std::string& kind) {
  const auto it = by_kind.find(kind);
  return it == by_kind.end() ? 0.0 : it->second;
}

sim::AlphaBeta cost_of(const std::map<std::string, std::pair<double, double>>& costs, const PerKind& host_s,
                       const PerKind& host_s_per_byte, const std::string& kind) {
  const auto it = costs.find(kind);
  TORCH_CHECK_VALUE(it != costs.end(), "dearcomm: no cost given for ", kind);
  return {it->second.first, it->second.second, of_kind(host_s, kind), of_kind(host_s_per_byte, kind)};
}

py::dict simulate(const BucketLayout& layout, c10::ScalarType comm_dtype,
                  const std::vector<std::tuple<std::string, double, double, std::vector<int64_t>>>& modules,
                  double step_s, const std::vector<int64_t>& param_numels, const ScheduleChoice& schedule,
                  const std::map<std::string, std::pair<double, double>>& costs, int64_t iterations,
                  double compute_slowdown, double comm_slowdown, int64_t all_reduce_lanes,
                  const std::vector<std::vector<double>>& grad_ready_s, double pack_s_per_byte,
                  double average_s_per_byte, const PerKind& host_s, const PerKind& host_s_per_byte,
                  double comm_cpu_slowdown, double compute_cpu_slowdown, double iteration_cv,
                  double cores_share) {
  for (const auto& [field, by_kind] : {std::pair{"host_s", &host_s}, std::pair{"host_s_per_byte", &host_s_per_byte}}) {
    for (const auto& entry : *by_kind) {
      TORCH_CHECK_VALUE(costs.count(entry.first), "dearcomm: ", field, " names unknown collective '", entry.first,
                        "'");
    }
  }
  TORCH_CHECK_VALUE(grad_ready_s.empty() || grad_ready_s.size() == modules.size(), "dearcomm: grad_ready_s has ",
                    grad_ready_s.size(), " entries for ", modules.size(), " modules");
  sim::Profile profile;
  for (const auto& [name, forward_s, backward_s, params] : modules) {
    const size_t m = profile.modules.size();
    profile.modules.push_back({name, forward_s, backward_s, params, grad_ready_s.empty() ? std::vector<double>{}
                                                                                         : grad_ready_s[m]});
  }
  profile.step_s = step_s;
  profile.pack_s_per_byte = pack_s_per_byte;
  profile.average_s_per_byte = average_s_per_byte;
  profile.param_numels = param_numels;
  // Without "ordered_all_reduce" (NCCL, or callers that give three kinds) it costs an all-reduce's.
  auto kind_cost = [&](const std::string& kind) { return cost_of(costs, host_s, host_s_per_byte, kind); };
  const sim::AlphaBeta all_reduce = kind_cost("all_reduce");
  const sim::AlphaBeta ordered = costs.count("ordered_all_reduce") ? kind_cost("ordered_all_reduce") : all_reduce;
  const sim::CostModel cost(layout.world_size, kind_cost("reduce_scatter"), kind_cost("all_gather"), all_reduce,
                            ordered, compute_slowdown, comm_slowdown, all_reduce_lanes, comm_cpu_slowdown,
                            compute_cpu_slowdown, iteration_cv, cores_share);
  sim::Result result;
  {
    py::gil_scoped_release no_gil;  // pure C++ from here
    result = sim::simulate(core_layout(layout, comm_dtype), profile, schedule.make_policy(), cost,
                           iterations);
  }
  py::list ops;
  for (const sim::SimOp& op : result.ops) {
    py::dict d;
    d["kind"] = to_string(op.kind);
    d["bucket"] = op.bucket;
    d["slot"] = op.slot;
    d["iteration"] = op.iteration;
    d["issued_s"] = op.issued_s;
    d["start_s"] = op.start_s;
    d["end_s"] = op.end_s;
    d["wait_begin_s"] = op.wait_begin_s;
    d["wait_end_s"] = op.wait_end_s;
    ops.append(d);
  }
  py::list spans;
  for (const sim::Span& span : result.spans) {
    py::dict d;
    d["name"] = span.name;
    d["iteration"] = span.iteration;
    d["start_s"] = span.start_s;
    d["end_s"] = span.end_s;
    spans.append(d);
  }
  py::dict out;
  out["iteration_s"] = result.iteration_s;
  out["timeline_s"] = result.timeline_s;
  out["cpu_s"] = result.cpu_s;
  out["iteration_starts_s"] = result.iteration_starts_s;
  out["ops"] = ops;
  out["spans"] = spans;
  out["records"] = transitions_to_list(result.records);
  return out;
}

}  // namespace

// core::Completion over a layout it owns, for Python's update hooks.
struct PyCompletion {
  core::Layout layout;
  core::Completion completion{layout};
  PyCompletion(const std::vector<std::pair<int64_t, int64_t>>& buckets,
               const std::vector<std::pair<int64_t, int64_t>>& params) {
    for (const auto& [first_param, num_params] : buckets) {
      layout.buckets.push_back({first_param, num_params, 0});
    }
    for (const auto& [first_bucket, last_bucket] : params) {
      layout.params.push_back({first_bucket, last_bucket});
    }
    layout.check();
    completion.reset();
  }
};

void register_simulate(py::module& m, c10::ScalarType (*to_scalar_type)(const py::handle&)) {
  py::class_<PyCompletion>(m, "Completion",
      "A parameter is complete when the last of its buckets is (csrc/core/layout.h): report each bucket once "
      "per round with done(b); each parameter comes back once, with the last of its buckets.")
      .def(py::init<const std::vector<std::pair<int64_t, int64_t>>&, const std::vector<std::pair<int64_t, int64_t>>&>(),
           py::arg("buckets"), py::arg("params"),
           "buckets: (first_param, num_params) each; params: (first_bucket, last_bucket) each")
      .def("reset", [](PyCompletion& c) { c.completion.reset(); })
      .def("done", [](PyCompletion& c, int64_t bucket) {
        TORCH_CHECK_INDEX(bucket >= 0 && bucket < c.layout.num_buckets(), "dearcomm: bucket ", bucket, " out of range");
        return c.completion.done(bucket);
      }, py::arg("bucket"));

  m.def("simulate",
        [to_scalar_type](const BucketLayout& layout, const py::object& comm_dtype,
                         const std::vector<std::tuple<std::string, double, double, std::vector<int64_t>>>& modules,
                         double step_s, const std::vector<int64_t>& param_numels, const ScheduleChoice& schedule,
                         const std::map<std::string, std::pair<double, double>>& costs, int64_t iterations,
                         double compute_slowdown, double comm_slowdown, int64_t all_reduce_lanes,
                         const std::vector<std::vector<double>>& grad_ready_s, double pack_s_per_byte,
                         double average_s_per_byte, const PerKind& host_s, const PerKind& host_s_per_byte,
                         double comm_cpu_slowdown, double compute_cpu_slowdown, double iteration_cv,
                         double cores_share) {
          const c10::ScalarType dtype =
              comm_dtype.is_none() ? c10::ScalarType::Undefined : to_scalar_type(comm_dtype);
          return simulate(layout, dtype, modules, step_s, param_numels, schedule, costs, iterations,
                          compute_slowdown, comm_slowdown, all_reduce_lanes, grad_ready_s, pack_s_per_byte,
                          average_s_per_byte, host_s, host_s_per_byte, comm_cpu_slowdown,
                          compute_cpu_slowdown, iteration_cv, cores_share);
        },
        py::arg("layout"), py::arg("comm_dtype"), py::arg("modules"), py::arg("step_s"), py::arg("param_numels"),
        py::arg("schedule"), py::arg("costs"), py::arg("iterations"), py::arg("compute_slowdown") = 1.0,
        py::arg("comm_slowdown") = 1.0, py::arg("all_reduce_lanes") = 1,
        py::arg("grad_ready_s") = std::vector<std::vector<double>>{}, py::arg("pack_s_per_byte") = 0.0,
        py::arg("average_s_per_byte") = 0.0, py::arg("host_s") = PerKind{}, py::arg("host_s_per_byte") = PerKind{},
        py::arg("comm_cpu_slowdown") = 1.0, py::arg("compute_cpu_slowdown") = 1.0, py::arg("iteration_cv") = 0.0,
        py::arg("cores_share") = 0.0,
        "Runs a schedule on the simulated device; dearcomm.simulate() is the documented entry point.");
  m.def("expected_slowest_of", &sim::expected_slowest_of, py::arg("n"),
        "The expected largest of n independent standard normal draws; dearcomm.prediction.expected_slowest_of.");
}

}  // namespace dearcomm
