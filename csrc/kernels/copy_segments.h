// Fused multi-tensor copy with cast and scale: the pack (tensors -> bucket)
// and unpack (bucket -> tensors) kernels of the NCCL backend. One launch
// copies up to kMaxSegmentsPerLaunch tensors. No torch headers: this builds
// with nvcc alone, fast, and is usable outside torch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dearcomm {
namespace kernels {

enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// `numel` elements from `src` to `dst`; either may have any alignment.
struct Segment {
  const void* src;
  void* dst;
  int64_t numel;
};

// The segment table travels as a kernel argument (no host-to-device copy):
// CUDA 12.1+ allows 32 KiB of arguments on sm_70 and newer; 768 segments take ~25 KiB.
constexpr int kMaxSegmentsPerLaunch = 768;

// dst[i] = convert<dst_type>(scale * src[i]) for every element of every
// segment, on `stream`, in ceil(count / kMaxSegmentsPerLaunch) launches.
// Returns the launch error, if any (kernels run asynchronously).
cudaError_t copy_segments(const Segment* segments, int64_t count, DType src_type, DType dst_type,
                          float scale, cudaStream_t stream);

}  // namespace kernels
}  // namespace dearcomm
