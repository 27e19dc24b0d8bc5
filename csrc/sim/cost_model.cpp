#include "sim/cost_model.h"

#include "core/check.h"

#include <cmath>
#include <map>
#include <mutex>
#include <stdexcept>

namespace dearcomm::sim {
namespace {
void check(const char* kind, const AlphaBeta& ab) {
  DEARCOMM_CORE_CHECK(std::isfinite(ab.alpha_s) && ab.alpha_s >= 0 && std::isfinite(ab.seconds_per_byte) &&
                          ab.seconds_per_byte >= 0,
                      std::invalid_argument, "dearcomm: the cost of ", kind, " needs a finite alpha >= 0 and beta >= 0,"
                      " got alpha ", ab.alpha_s, " s and beta ", ab.seconds_per_byte, " s/byte");
  DEARCOMM_CORE_CHECK(std::isfinite(ab.host_s) && ab.host_s >= 0, std::invalid_argument, "dearcomm: the host cost of ",
                      kind, " must be finite and >= 0, got ", ab.host_s, " s per collective");
  DEARCOMM_CORE_CHECK(std::isfinite(ab.host_s_per_byte) && ab.host_s_per_byte >= 0, std::invalid_argument,
                      "dearcomm: the host cost per byte of ", kind, " must be finite and >= 0, got ",
                      ab.host_s_per_byte, " s per byte");
}
}  // namespace

CostModel::CostModel(int64_t world_size, AlphaBeta reduce_scatter, AlphaBeta all_gather, AlphaBeta all_reduce,
                     AlphaBeta ordered_all_reduce, double compute_slowdown, double comm_slowdown,
                     int64_t all_reduce_lanes, double comm_cpu_slowdown, double compute_cpu_slowdown,
                     double iteration_cv, double cores_share)
    : world_size_(world_size),
      reduce_scatter_(reduce_scatter),
      all_gather_(all_gather),
      all_reduce_(all_reduce),
      ordered_all_reduce_(ordered_all_reduce),
      compute_slowdown_(compute_slowdown),
      comm_slowdown_(comm_slowdown),
      all_reduce_lanes_(all_reduce_lanes),
      comm_cpu_slowdown_(comm_cpu_slowdown),
      compute_cpu_slowdown_(compute_cpu_slowdown),
      slowest_rank_factor_(1.0) {
  DEARCOMM_CORE_CHECK(world_size >= 2, std::invalid_argument, "dearcomm: a world size >= 2 is needed, got ",
                      world_size);
  check("reduce_scatter", reduce_scatter_);
  check("all_gather", all_gather_);
  check("all_reduce", all_reduce_);
  check("ordered_all_reduce", ordered_all_reduce_);
  DEARCOMM_CORE_CHECK(std::isfinite(compute_slowdown_) && compute_slowdown_ >= 1.0, std::invalid_argument,
                      "dearcomm: compute_slowdown must be a finite factor >= 1, got ", compute_slowdown_);
  DEARCOMM_CORE_CHECK(std::isfinite(comm_slowdown_) && comm_slowdown_ >= 1.0, std::invalid_argument,
                      "dearcomm: comm_slowdown must be a finite factor >= 1, got ", comm_slowdown_);
  DEARCOMM_CORE_CHECK(std::isfinite(comm_cpu_slowdown_) && comm_cpu_slowdown_ >= 1.0, std::invalid_argument,
                      "dearcomm: comm_cpu_slowdown must be a finite factor >= 1, got ", comm_cpu_slowdown_);
  DEARCOMM_CORE_CHECK(std::isfinite(compute_cpu_slowdown_) && compute_cpu_slowdown_ >= 1.0, std::invalid_argument,
                      "dearcomm: compute_cpu_slowdown must be a finite factor >= 1, got ", compute_cpu_slowdown_);
  DEARCOMM_CORE_CHECK(std::isfinite(iteration_cv) && iteration_cv >= 0.0, std::invalid_argument,
                      "dearcomm: iteration_cv must be a finite number >= 0, got ", iteration_cv);
  DEARCOMM_CORE_CHECK(std::isfinite(cores_share) && cores_share >= 0.0, std::invalid_argument,
                      "dearcomm: cores_share must be a finite number >= 0, got ", cores_share);
  if (iteration_cv > 0.0 && cores_share <= 1.0) {
    slowest_rank_factor_ = 1.0 + iteration_cv * expected_slowest_of(world_size_);
  }
  DEARCOMM_CORE_CHECK(all_reduce_lanes_ >= 1, std::invalid_argument,
                      "dearcomm: all_reduce_lanes must be >= 1, got ", all_reduce_lanes_);
}

const AlphaBeta& CostModel::of(Collective kind, bool in_issue_order) const {
  switch (kind) {
    case Collective::kReduceScatter: return reduce_scatter_;
    case Collective::kAllGather: return all_gather_;
    case Collective::kAllReduce: return in_issue_order ? ordered_all_reduce_ : all_reduce_;
  }
  return all_reduce_;
}

double CostModel::seconds(Collective kind, int64_t bytes, bool in_issue_order) const {
  const double p = static_cast<double>(world_size_);
  const double passes = kind == Collective::kAllReduce ? 2.0 : 1.0;  // an all-reduce is RS + AG
  const AlphaBeta& ab = of(kind, in_issue_order);
  return passes * ((p - 1) * ab.alpha_s + (p - 1) / p * static_cast<double>(bytes) * ab.seconds_per_byte);
}

int64_t CostModel::all_reduce_bytes_in(double seconds, bool in_issue_order) const {
  const double per_byte = 2.0 * (world_size_ - 1) / static_cast<double>(world_size_) *
                          of(Collective::kAllReduce, in_issue_order).seconds_per_byte;
  if (per_byte <= 0) {
    return INT64_MAX;
  }
  const double bytes = seconds / per_byte;
  return bytes >= 9.0e18 ? INT64_MAX : static_cast<int64_t>(bytes);
}

double expected_slowest_of(int64_t n) {
  DEARCOMM_CORE_CHECK(n >= 1, std::invalid_argument, "dearcomm: expected_slowest_of needs a count >= 1, got ", n);
  if (n == 1) {
    return 0.0;  // one draw's expectation
  }
  // Every simulation with a spread asks (auto simulates dozens of candidates
  // for one world size): integrate once per n.
  static std::mutex mutex;
  static std::map<int64_t, double> known;
  std::lock_guard<std::mutex> lock(mutex);
  const auto it = known.find(n);
  if (it != known.end()) {
    return it->second;
  }
  // E[max] = integral of x n phi(x) Phi(x)^(n-1) dx; beyond |x| = 12 nothing is left to four digits.
  constexpr double kStep = 1e-3;
  const double inv_sqrt_2pi = 1.0 / std::sqrt(2.0 * std::acos(-1.0));
  double total = 0.0;
  for (int i = -12000; i <= 12000; ++i) {
    const double x = i * kStep;
    const double cdf = 0.5 * std::erfc(-x / std::sqrt(2.0));
    const double density = std::exp(-0.5 * x * x) * inv_sqrt_2pi;
    total += x * static_cast<double>(n) * density * std::pow(cdf, static_cast<double>(n - 1));
  }
  return known[n] = total * kStep;
}

}  // namespace dearcomm::sim
