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
  int64_t created = 0;
};

Pool& pool() {
  static auto* p = new Pool();  // never destroyed: streams outlive static destructors too
  return *p;
}

c10::cuda::CUDAStream take(c10::DeviceIndex device) {
  {
    Pool& p = pool();
    const std::lock_guard<std::mutex> lock(p.mutex);
    auto& idle = p.idle[device];
    if (!idle.empty()) {
      const cudaStream_t stream = idle.back();
      idle.pop_back();
      return c10::cuda::getStreamFromExternal(stream, device);
    }
    p.created += 1;
  }
  const c10::cuda::CUDAGuard guard(device);
  int least = 0, greatest = 0;
  DEARCOMM_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t stream = nullptr;
  DEARCOMM_CUDA_CHECK(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest));
  return c10::cuda::getStreamFromExternal(stream, device);
}

}  // namespace

PooledStream::PooledStream(c10::DeviceIndex device) : stream_(take(device)) {}

PooledStream::~PooledStream() {
  const c10::cuda::CUDAGuard guard(stream_.device_index());
  if (cudaStreamQuery(stream_.stream()) != cudaSuccess) {
    return;  // work still on it (or the device failed): never handed out again
  }
  Pool& p = pool();
  const std::lock_guard<std::mutex> lock(p.mutex);
  p.idle[stream_.device_index()].push_back(stream_.stream());
}

int64_t comm_streams_created() {
  Pool& p = pool();
  const std::lock_guard<std::mutex> lock(p.mutex);
  return p.created;
}

}  // namespace dearcomm
