// A kernel that only waits: tests delay a stream with it to expose a missing
// cross-stream wait (the result must not change, only the time).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dearcomm {
namespace kernels {

cudaError_t spin(int64_t cycles, cudaStream_t stream);

}  // namespace kernels
}  // namespace dearcomm
