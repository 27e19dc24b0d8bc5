#include "cuda_completion.h"

#include "nccl_check.h"

namespace dearcomm {

std::shared_ptr<HandlePool> make_cuda_event_pool() {
  return HandlePool::create(
      [] {
        cudaEvent_t event = nullptr;
        DEARCOMM_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
        return static_cast<HandlePool::Handle>(event);
      },
      [](HandlePool::Handle event) {
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
