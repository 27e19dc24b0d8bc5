#include "comm_stream_pool.h"

#include "nccl_check.h"

#include <c10/cuda/CUDAGuard.h>

#include <map>
#include <mutex>
#include <vector>

namespace dearcomm {
namespace {

struct Pool {
  std::mutex mutex;
  std::map<c10::DeviceIndex, std::vector<cudaStream_t>> idle;
};

Pool& pool() {
  static auto* p = new Pool();  // never destroyed: streams outlive static destructors too
  return *p;
}

}  // namespace

c10::cuda::CUDAStream acquire_comm_stream(c10::DeviceIndex device) {
  {
    Pool& p = pool();
    const std::lock_guard<std::mutex> lock(p.mutex);
    auto& idle = p.idle[device];
    if (!idle.empty()) {
      const cudaStream_t stream = idle.back();
      idle.pop_back();
      return c10::cuda::getStreamFromExternal(stream, device);
    }
  }
  const c10::cuda::CUDAGuard guard(device);
  int least = 0, greatest = 0;
  DEARCOMM_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t stream = nullptr;
  DEARCOMM_CUDA_CHECK(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest));
  return c10::cuda::getStreamFromExternal(stream, device);
}

void release_comm_stream(const c10::cuda::CUDAStream& stream) {
  Pool& p = pool();
  const std::lock_guard<std::mutex> lock(p.mutex);
  p.idle[stream.device_index()].push_back(stream.stream());
}

}  // namespace dearcomm
