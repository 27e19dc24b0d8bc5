// What the simulated device computes with: per module (forward order) its
// forward and backward time, the parameters it reads and when in its backward
// each gradient is ready; the optimizer's time over the whole model; what a
// pass over gradient memory costs.
// Standard C++ only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dearcomm::sim {

struct ModuleCost {
  std::string name;
  double forward_s = 0.0;
  double backward_s = 0.0;
  std::vector<int64_t> params;  // engine-order indices of the parameters its forward reads
  // Per parameter, how far into backward_s its gradient is ready (gradients
  // of one module arrive spread out: a schedule that sizes its sends to the
  // gaps between them sees those gaps); empty: all at the end.
  std::vector<double> grad_ready_s;
};

struct Profile {
  std::vector<ModuleCost> modules;   // forward order
  double step_s = 0.0;               // the optimizer over every parameter, on one rank
  // Host-side passes over a reduction's bucket, on the compute stream: the
  // pack at its issue (gradients copied in; none where .grad is the bucket
  // view) and the average at its wait (the reduced bytes divided in place).
  double pack_s_per_byte = 0.0;
  double average_s_per_byte = 0.0;
  std::vector<int64_t> param_numels; // engine order: what share of step_s an update of some parameters takes

  // Raises std::invalid_argument naming the module or parameter: times and
  // costs must be finite and >= 0, every parameter read by exactly one module.
  void check(int64_t num_params) const;
};

}  // namespace dearcomm::sim
