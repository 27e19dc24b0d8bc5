#include "spin.h"

namespace dearcomm {
namespace kernels {
namespace {

__global__ void spin_kernel(int64_t cycles, const volatile int* abort) {
  const long long start = clock64();
  while (clock64() - start < cycles && *abort == 0) {
  }
}

}  // namespace

cudaError_t spin(int64_t cycles, const volatile int* abort, cudaStream_t stream) {
  spin_kernel<<<1, 1, 0, stream>>>(cycles, abort);
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace dearcomm
