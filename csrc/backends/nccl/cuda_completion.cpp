#include "cuda_completion.h"

#include "nccl_check.h"

#include <c10/cuda/CUDAGuard.h>

namespace dearcomm {

std::shared_ptr<HandlePool> make_cuda_event_pool(c10::DeviceIndex device, bool timing) {
  // Guarded: the last owner of an event may be any thread (the watchdog's),
  // whose current device must not get a context of its own.
  return HandlePool::create(
      [device, timing] {
        const c10::cuda::CUDAGuard guard(device);
        cudaEvent_t event = nullptr;
        DEARCOMM_CUDA_CHECK(cudaEventCreateWithFlags(&event, timing ? cudaEventDefault : cudaEventDisableTiming));
        return static_cast<HandlePool::Handle>(event);
      },
      [device](HandlePool::Handle event) {
        const c10::cuda::CUDAGuard guard(device);
        cudaEventDestroy(static_cast<cudaEvent_t>(event));  // from a destructor: nothing to do on failure
      });
}

namespace {

// As ProcessGroupNCCL's watchdog queries: in thread-local capture mode, so a
// query from this thread cannot invalidate a CUDA-graph capture on another.
cudaError_t query_event(cudaEvent_t event) {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeThreadLocal;
  cudaThreadExchangeStreamCaptureMode(&mode);
  const cudaError_t state = cudaEventQuery(event);
  cudaThreadExchangeStreamCaptureMode(&mode);
  if (state == cudaErrorNotReady) {
    cudaGetLastError();  // as c10's event query: "not ready" is no error to leave behind for torch
  }
  return state;
}

}  // namespace

std::optional<int64_t> CudaStamp::since(const Stamp& origin) const {
  const auto* cuda = dynamic_cast<const CudaStamp*>(&origin);
  if (cuda == nullptr) {
    return std::nullopt;  // another backend's clock: no common time
  }
  const cudaEvent_t from = as_event(cuda->event_), to = as_event(event_);
  const c10::cuda::CUDAGuard guard(device_);  // the caller's current device may be another one
  // Not reached yet, or failed (the watchdog reports failures): no time.
  if (query_event(from) != cudaSuccess || query_event(to) != cudaSuccess) {
    return std::nullopt;
  }
  float ms = 0.0f;
  DEARCOMM_CUDA_CHECK(cudaEventElapsedTime(&ms, from, to));
  return static_cast<int64_t>(static_cast<double>(ms) * 1e6);
}

Completion::Status CudaCompletion::poll(std::string* error) {
  const cudaError_t state = query_event(event());
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
