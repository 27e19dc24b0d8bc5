#include "fused_copy.h"

#include "../../kernels/copy_segments.h"
#include "nccl_check.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <optional>

namespace dearcomm {
namespace {

std::optional<kernels::DType> kernel_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return kernels::DType::kFloat32;
    case at::kHalf: return kernels::DType::kFloat16;
    case at::kBFloat16: return kernels::DType::kBFloat16;
    default: return std::nullopt;
  }
}

}  // namespace

void fused_copy(const std::vector<at::Tensor>& sources, const std::vector<at::Tensor>& destinations, double scale) {
  TORCH_CHECK_VALUE(sources.size() == destinations.size(),
      "dearcomm: fused_copy got ", sources.size(), " sources and ", destinations.size(), " destinations");
  if (sources.empty()) {
    return;
  }
  const c10::cuda::CUDAGuard guard(destinations.front().device());
  // One launch per (source dtype, destination dtype) pair present; in practice one.
  std::vector<kernels::Segment> segments;
  std::optional<kernels::DType> src_type, dst_type;
  for (size_t i = 0; i < sources.size(); ++i) {
    const at::Tensor& src = sources[i];
    const at::Tensor& dst = destinations[i];
    TORCH_CHECK_VALUE(src.numel() == dst.numel(), "dearcomm: fused_copy pair ", i, " has ", src.numel(),
                      " and ", dst.numel(), " elements");
    TORCH_CHECK_VALUE(src.is_cuda() && dst.device() == src.device(),
                      "dearcomm: fused_copy pair ", i, " is on ", src.device(), " and ", dst.device());
    const auto s = kernel_dtype(src.scalar_type());
    const auto d = kernel_dtype(dst.scalar_type());
    const bool fusable = s && d && src.is_contiguous() && dst.is_contiguous() &&
                         (!src_type || (*src_type == *s && *dst_type == *d));
    if (!fusable) {
      at::Tensor out = dst;
      out.copy_(scale == 1.0 ? src : src * scale);
      continue;
    }
    src_type = s;
    dst_type = d;
    segments.push_back({src.data_ptr(), dst.data_ptr(), src.numel()});
  }
  if (!segments.empty()) {
    DEARCOMM_CUDA_CHECK(kernels::copy_segments(segments.data(), static_cast<int64_t>(segments.size()), *src_type,
                                               *dst_type, static_cast<float>(scale),
                                               c10::cuda::getCurrentCUDAStream().stream()));
  }
}

}  // namespace dearcomm
