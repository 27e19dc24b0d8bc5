// A kernel that only waits: tests delay a stream with it to expose a missing
// cross-stream wait (the result must not change, only the time), or stand in
// for a stuck collective. Like an NCCL kernel it polls an abort flag in
// host-mapped memory, so aborting the communicator ends the stall, as it ends
// a stuck NCCL kernel; a kernel nothing could end would hold ncclCommAbort,
// which waits for the device, and emulate a hang NCCL never has.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dearcomm {
namespace kernels {

// Spins for `cycles` GPU clock cycles, or until *abort is non-zero; abort must
// be non-null and device-visible (host-mapped memory, cudaHostAllocMapped).
cudaError_t spin(int64_t cycles, const volatile int* abort, cudaStream_t stream);

}  // namespace kernels
}  // namespace dearcomm
