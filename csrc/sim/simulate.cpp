#include "sim/simulate.h"

#include "core/check.h"
#include "core/executor.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>
#include <stdexcept>

namespace dearcomm::sim {

void Profile::check(int64_t num_params) const {
  DEARCOMM_CORE_CHECK(static_cast<int64_t>(param_numels.size()) == num_params, std::invalid_argument,
                      "dearcomm: the profile sizes ", param_numels.size(), " parameters, the layout has ",
                      num_params);
  DEARCOMM_CORE_CHECK(std::isfinite(step_s) && step_s >= 0, std::invalid_argument,
                      "dearcomm: step time must be finite and >= 0, got ", step_s, " s");
  DEARCOMM_CORE_CHECK(std::isfinite(pack_s_per_byte) && pack_s_per_byte >= 0 && std::isfinite(average_s_per_byte) &&
                          average_s_per_byte >= 0,
                      std::invalid_argument, "dearcomm: pack and average costs must be finite and >= 0, got ",
                      pack_s_per_byte, " and ", average_s_per_byte, " s per byte");
  std::vector<int64_t> readers(num_params, 0);
  for (const ModuleCost& m : modules) {
    DEARCOMM_CORE_CHECK(std::isfinite(m.forward_s) && m.forward_s >= 0 && std::isfinite(m.backward_s) &&
                            m.backward_s >= 0,
                        std::invalid_argument, "dearcomm: module '", m.name,
                        "' needs finite forward and backward times >= 0, got ", m.forward_s, " s and ",
                        m.backward_s, " s");
    for (int64_t p : m.params) {
      DEARCOMM_CORE_CHECK(p >= 0 && p < num_params, std::invalid_argument, "dearcomm: module '", m.name,
                          "' reads parameter ", p, " of ", num_params);
      readers[p] += 1;
    }
    DEARCOMM_CORE_CHECK(m.grad_ready_s.empty() || m.grad_ready_s.size() == m.params.size(), std::invalid_argument,
                        "dearcomm: module '", m.name, "' gives ", m.grad_ready_s.size(), " gradient-ready times for ",
                        m.params.size(), " parameters");
    for (double at : m.grad_ready_s) {
      DEARCOMM_CORE_CHECK(std::isfinite(at) && at >= 0 && at <= m.backward_s, std::invalid_argument,
                          "dearcomm: module '", m.name, "' has a gradient ready ", at,
                          " s into its backward; expected 0 to its backward time, ", m.backward_s, " s");
    }
  }
  for (int64_t p = 0; p < num_params; ++p) {
    DEARCOMM_CORE_CHECK(readers[p] == 1, std::invalid_argument, "dearcomm: parameter ", p, " is read by ",
                        readers[p], " modules of the profile; each parameter belongs to exactly one");
  }
}


Result simulate(const core::Layout& layout, const Profile& profile, std::unique_ptr<SchedulePolicy> policy,
                const CostModel& cost, int64_t iterations) {
  layout.check();
  profile.check(layout.num_params());
  DEARCOMM_CORE_CHECK(policy, std::invalid_argument, "dearcomm: no schedule policy");
  DEARCOMM_CORE_CHECK(iterations >= 1, std::invalid_argument, "dearcomm: iterations must be >= 1, got ",
                      iterations);
  std::vector<std::vector<int64_t>> module_buckets;
  for (const ModuleCost& m : profile.modules) {
    std::set<int64_t> buckets;
    for (int64_t p : m.params) {
      for (int64_t b = layout.params[p].first_bucket; b <= layout.params[p].last_bucket; ++b) {
        buckets.insert(b);
      }
    }
    module_buckets.emplace_back(buckets.begin(), buckets.end());
  }
  SimDevice device(layout, profile, cost, policy->uses_link_model(), policy->needs_issue_order());
  std::vector<std::string> names;
  for (int64_t p = 0; p < layout.num_params(); ++p) {
    names.push_back(core::concat("param ", p));
  }
  core::Executor executor(layout, std::move(names), std::move(policy), device, 0);
  const double step_s = profile.step_s * executor.timing().share_at_step(cost.world_size());
  executor.set_recording(true);

  Result result;
  // A module's backward: its gradients ready as the profile spaces them
  // (stable: the profile's order among those ready at once).
  auto backward = [&](const ModuleCost& module) {
    const std::string name = "backward " + module.name;
    if (module.grad_ready_s.empty()) {
      device.compute(name, module.backward_s);
      for (int64_t p : module.params) {
        executor.grad_ready(p);
      }
      return;
    }
    std::vector<size_t> order(module.params.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return module.grad_ready_s[a] < module.grad_ready_s[b]; });
    double done = 0.0;
    for (size_t k : order) {
      if (module.grad_ready_s[k] > done) {
        device.compute(name, module.grad_ready_s[k] - done);
        done = module.grad_ready_s[k];
      }
      executor.grad_ready(module.params[k]);
    }
    if (module.backward_s > done || module.params.empty()) {
      device.compute(name, module.backward_s - done);
    }
  };
  auto forward = [&] {
    result.iteration_starts_s.push_back(device.now());
    for (size_t m = 0; m < profile.modules.size(); ++m) {
      for (int64_t b : module_buckets[m]) {
        executor.require_bucket(b);
      }
      device.compute("fwd " + profile.modules[m].name, profile.modules[m].forward_s);
    }
  };
  for (int64_t it = 0; it < iterations; ++it) {
    device.set_iteration(it);
    forward();
    for (size_t m = profile.modules.size(); m-- > 0;) {
      backward(profile.modules[m]);
    }
    executor.end_backward();
    executor.begin_step(/*averages_needed=*/false);
    device.compute("step", step_s);
    executor.end_step();
  }
  device.set_iteration(iterations);
  forward();
  executor.flush();  // a module-less bucket (none in a checked profile) would stay pending otherwise
  const auto& starts = result.iteration_starts_s;
  result.timeline_s = starts[starts.size() - 1] - starts[starts.size() - 2];
  result.cpu_s = device.cpu_seconds(iterations - 1);
  result.iteration_s = std::max(result.timeline_s, result.cpu_s * cost.slowest_rank_factor());
  result.ops = device.ops();
  result.spans = device.spans();
  result.records = executor.take_records();
  return result;
}

}  // namespace dearcomm::sim
