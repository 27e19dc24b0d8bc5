#include "copy_segments.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace dearcomm {
namespace kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxVector = 8;                                   // elements per vector access, at most
constexpr int64_t kChunk = int64_t{kThreads} * kMaxVector * 2;  // elements per block: a multiple of every vector

struct Launch {
  Segment segments[kMaxSegmentsPerLaunch];
  int64_t first_chunk[kMaxSegmentsPerLaunch + 1];  // prefix sums: block b works on the segment s with
  int32_t count;                                   // first_chunk[s] <= b < first_chunk[s + 1]
  float scale;
};

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float(float v) { return v; }
template <> __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float(float v) { return v; }
template <> __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Elements per vector access: 16 bytes on the wider side (fp32: 4, fp16/bf16:
// 8), so the wider side moves 16 bytes per access, the narrower 8 or 16.
template <typename Src, typename Dst>
constexpr int vector_width() {
  return 16 / (sizeof(Src) > sizeof(Dst) ? sizeof(Src) : sizeof(Dst));
}

template <typename Src, typename Dst>
__global__ void __launch_bounds__(kThreads) copy_segments_kernel(const __grid_constant__ Launch launch) {
  constexpr int kVector = vector_width<Src, Dst>();
  static_assert(kChunk % kVector == 0 && kVector <= kMaxVector, "a chunk must hold whole vectors");
  // Find this block's segment: a binary search over the prefix sums.
  const int64_t block = blockIdx.x;
  int lo = 0, hi = launch.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (launch.first_chunk[mid] <= block) lo = mid; else hi = mid - 1;
  }
  const Segment seg = launch.segments[lo];
  const Src* src = static_cast<const Src*>(seg.src);
  Dst* dst = static_cast<Dst*>(seg.dst);
  const int64_t begin = (block - launch.first_chunk[lo]) * kChunk;
  const int64_t end = begin + kChunk < seg.numel ? begin + kChunk : seg.numel;
  const float scale = launch.scale;

  // Vector path when both sides of the whole segment are vector-aligned (then
  // every chunk is too: kChunk is a multiple of kVector); scalar tail.
  const bool aligned = reinterpret_cast<uintptr_t>(src) % sizeof(Vec<Src, kVector>) == 0 &&
                       reinterpret_cast<uintptr_t>(dst) % sizeof(Vec<Dst, kVector>) == 0;
  int64_t i = begin;
  if (aligned) {
    const int64_t vector_end = begin + (end - begin) / kVector * kVector;
    for (int64_t j = begin + int64_t{threadIdx.x} * kVector; j < vector_end; j += int64_t{kThreads} * kVector) {
      const Vec<Src, kVector> in = *reinterpret_cast<const Vec<Src, kVector>*>(src + j);
      Vec<Dst, kVector> out;
#pragma unroll
      for (int k = 0; k < kVector; ++k) out.v[k] = from_float<Dst>(scale * to_float(in.v[k]));
      *reinterpret_cast<Vec<Dst, kVector>*>(dst + j) = out;
    }
    i = vector_end;
  }
  for (int64_t j = i + threadIdx.x; j < end; j += kThreads) {
    dst[j] = from_float<Dst>(scale * to_float(src[j]));
  }
}

template <typename Src, typename Dst>
cudaError_t launch_all(const Segment* segments, int64_t count, float scale, cudaStream_t stream) {
  Launch launch;
  for (int64_t start = 0; start < count; start += kMaxSegmentsPerLaunch) {
    const int n = static_cast<int>(count - start < kMaxSegmentsPerLaunch ? count - start : kMaxSegmentsPerLaunch);
    launch.count = 0;
    launch.scale = scale;
    int64_t chunks = 0;
    for (int s = 0; s < n; ++s) {
      const Segment& seg = segments[start + s];
      if (seg.numel <= 0) continue;
      launch.segments[launch.count] = seg;
      launch.first_chunk[launch.count] = chunks;
      chunks += (seg.numel + kChunk - 1) / kChunk;
      launch.count += 1;
    }
    launch.first_chunk[launch.count] = chunks;
    if (chunks == 0) continue;
    if (chunks > 0x7fffffff) return cudaErrorInvalidConfiguration;
    copy_segments_kernel<Src, Dst><<<static_cast<unsigned>(chunks), kThreads, 0, stream>>>(launch);
    const cudaError_t error = cudaGetLastError();
    if (error != cudaSuccess) return error;
  }
  return cudaSuccess;
}

template <typename Src>
cudaError_t dispatch_dst(const Segment* segments, int64_t count, DType dst_type, float scale, cudaStream_t stream) {
  switch (dst_type) {
    case DType::kFloat32: return launch_all<Src, float>(segments, count, scale, stream);
    case DType::kFloat16: return launch_all<Src, __half>(segments, count, scale, stream);
    case DType::kBFloat16: return launch_all<Src, __nv_bfloat16>(segments, count, scale, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t copy_segments(const Segment* segments, int64_t count, DType src_type, DType dst_type,
                          float scale, cudaStream_t stream) {
  switch (src_type) {
    case DType::kFloat32: return dispatch_dst<float>(segments, count, dst_type, scale, stream);
    case DType::kFloat16: return dispatch_dst<__half>(segments, count, dst_type, scale, stream);
    case DType::kBFloat16: return dispatch_dst<__nv_bfloat16>(segments, count, dst_type, scale, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kernels
}  // namespace dearcomm
