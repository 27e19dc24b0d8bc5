#include "cuda_completion.h"

#include "nccl_check.h"

#include <c10/cuda/CUDAGuard.h>

namespace dearcomm {

std::shared_ptr<HandlePool> make_cuda_event_pool(c10::DeviceIndex device) {
  // Guarded: the last owner of an event may be any thread (the watchdog's),
  // whose current device must not get a context of its own.
  return HandlePool::create(
      [device] {
        const c10::cuda::CUDAGuard guard(device);
        cudaEvent_t event = nullptr;
        DEARCOMM_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
        return static_cast<HandlePool::Handle>(event);
      },
      [device](HandlePool::Handle event) {
        const c10::cuda::CUDAGuard guard(device);
        cudaEventDestroy(static_cast<cudaEvent_t>(event));  // from a destructor: nothing to do on failure
      });
}

Completion::Status CudaCompletion::poll(std::string* error) {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeThreadLocal;
  cudaThreadExchangeStreamCaptureMode(&mode);
  const cudaError_t state = cudaEventQuery(event());
  cudaThreadExchangeStreamCaptureMode(&mode);
  if (state == cudaSuccess) {
    return Status::kDone;
  }
  if (state == cudaErrorNotReady) {
    return Status::kRunning;
  }
  *error = cudaGetErrorString(state);
  return Status::kFailed;
}

}  // namespace dearcomm
