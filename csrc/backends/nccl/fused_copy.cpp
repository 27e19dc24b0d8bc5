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

// The segments of one fused launch: contiguous pairs of the first (source,
// destination) dtype pair seen; the caller copies any other pair with ATen.
class Launch {
 public:
  explicit Launch(size_t capacity) { segments_.reserve(capacity); }

  bool add(const at::Tensor& src, const void* src_ptr, const at::Tensor& dst, void* dst_ptr, int64_t numel) {
    const auto s = kernel_dtype(src.scalar_type());
    const auto d = kernel_dtype(dst.scalar_type());
    if (!s || !d || !src.is_contiguous() || !dst.is_contiguous() || (src_type_ && (*src_type_ != *s || *dst_type_ != *d))) {
      return false;
    }
    src_type_ = s;
    dst_type_ = d;
    segments_.push_back({src_ptr, dst_ptr, numel});
    return true;
  }

  void run(double scale) const {
    if (segments_.empty()) {
      return;
    }
    DEARCOMM_CUDA_CHECK(kernels::copy_segments(segments_.data(), static_cast<int64_t>(segments_.size()), *src_type_,
                                               *dst_type_, static_cast<float>(scale),
                                               c10::cuda::getCurrentCUDAStream().stream()));
  }

 private:
  std::vector<kernels::Segment> segments_;
  std::optional<kernels::DType> src_type_, dst_type_;
};

void copy_scaled(at::Tensor dst, const at::Tensor& src, double scale) {
  dst.copy_(scale == 1.0 ? src : src * scale);
}

// Where tensor i lives in `flat`: checked here, since no narrow() view is made
// per tensor (ATen's view ops cost microseconds each on the host, which for a
// bucket of hundreds of tensors was most of a pack's time).
char* slot_of(const at::Tensor& flat, const std::vector<int64_t>& offsets, size_t i, const at::Tensor& t,
              const char* what) {
  TORCH_CHECK_VALUE(t.is_cuda() && t.device() == flat.device(), "dearcomm: ", what, " tensor ", i, " is on ",
                    t.device(), " but the bucket is on ", flat.device());
  TORCH_CHECK_VALUE(offsets[i] >= 0 && offsets[i] + t.numel() <= flat.numel(), "dearcomm: ", what, " tensor ", i,
                    " (", t.numel(), " elements at offset ", offsets[i], ") does not fit the bucket of ", flat.numel(),
                    " elements");
  return static_cast<char*>(flat.data_ptr()) + offsets[i] * flat.element_size();
}

void check_flat(const at::Tensor& flat, size_t tensors, size_t offsets, const char* what) {
  TORCH_CHECK_VALUE(tensors == offsets, "dearcomm: ", what, " got ", tensors, " tensors and ", offsets, " offsets");
  TORCH_CHECK_VALUE(flat.is_cuda() && flat.is_contiguous() && flat.dim() == 1,
                    "dearcomm: ", what, " needs a contiguous 1-D CUDA bucket");
}

}  // namespace

void fused_copy(const std::vector<at::Tensor>& sources, const std::vector<at::Tensor>& destinations, double scale) {
  TORCH_CHECK_VALUE(sources.size() == destinations.size(),
      "dearcomm: fused_copy got ", sources.size(), " sources and ", destinations.size(), " destinations");
  if (sources.empty()) {
    return;
  }
  const c10::cuda::CUDAGuard guard(destinations.front().device());
  Launch launch(sources.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    const at::Tensor& src = sources[i];
    const at::Tensor& dst = destinations[i];
    TORCH_CHECK_VALUE(src.numel() == dst.numel(), "dearcomm: fused_copy pair ", i, " has ", src.numel(),
                      " and ", dst.numel(), " elements");
    TORCH_CHECK_VALUE(src.is_cuda() && dst.device() == src.device(),
                      "dearcomm: fused_copy pair ", i, " is on ", src.device(), " and ", dst.device());
    if (!launch.add(src, src.data_ptr(), dst, dst.data_ptr(), src.numel())) {
      copy_scaled(dst, src, scale);
    }
  }
  launch.run(scale);
}

void pack_into(const std::vector<at::Tensor>& sources, const std::vector<int64_t>& offsets, const at::Tensor& flat,
               double scale) {
  check_flat(flat, sources.size(), offsets.size(), "pack");
  const c10::cuda::CUDAGuard guard(flat.device());
  Launch launch(sources.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    const at::Tensor& src = sources[i];
    char* slot = slot_of(flat, offsets, i, src, "pack");
    if (!launch.add(src, src.data_ptr(), flat, slot, src.numel())) {
      copy_scaled(flat.narrow(0, offsets[i], src.numel()), src.reshape(-1), scale);
    }
  }
  launch.run(scale);
}

void unpack_from(const at::Tensor& flat, const std::vector<int64_t>& offsets,
                 const std::vector<at::Tensor>& destinations) {
  check_flat(flat, destinations.size(), offsets.size(), "unpack");
  const c10::cuda::CUDAGuard guard(flat.device());
  Launch launch(destinations.size());
  for (size_t i = 0; i < destinations.size(); ++i) {
    const at::Tensor& dst = destinations[i];
    const char* slot = slot_of(flat, offsets, i, dst, "unpack");
    if (!launch.add(flat, slot, dst, dst.data_ptr(), dst.numel())) {
      at::Tensor(dst).copy_(flat.narrow(0, offsets[i], dst.numel()).view(dst.sizes()));
    }
  }
  launch.run(1.0);
}

}  // namespace dearcomm
