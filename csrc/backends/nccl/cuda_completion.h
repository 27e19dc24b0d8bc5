// CUDA events as the watchdog's completions and as stamps on the GPU's clock,
// from pools (two per collective would otherwise be created and destroyed at
// every launch).
#pragma once

#include "../../common/handle_pool.h"
#include "../../common/watchdog.h"
#include "../../engine/comm_backend.h"

#include <c10/core/Device.h>
#include <cuda_runtime.h>

#include <memory>

namespace dearcomm {

// A pool of events on `device`: cudaEventDisableTiming ones unless `timing`.
std::shared_ptr<HandlePool> make_cuda_event_pool(c10::DeviceIndex device, bool timing = false);

inline cudaEvent_t as_event(const std::shared_ptr<void>& handle) {
  return static_cast<cudaEvent_t>(handle.get());
}

// Done once the event's recorded work is. Queried in thread-local capture
// mode, as ProcessGroupNCCL's watchdog does: a query from this thread must
// not invalidate a CUDA-graph capture running on another.
class CudaCompletion final : public Completion {
 public:
  explicit CudaCompletion(std::shared_ptr<void> event) : event_(std::move(event)) {}
  Status poll(std::string* error) override;
  cudaEvent_t event() const { return as_event(event_); }

 private:
  std::shared_ptr<void> event_;
};

// A stamp (comm_backend.h): a timing event recorded on a stream. It has a
// time once the device passed it; times are cudaEventElapsedTime's (µs
// resolution), between stamps of one device.
class CudaStamp final : public Stamp {
 public:
  CudaStamp(std::shared_ptr<void> event, c10::DeviceIndex device) : event_(std::move(event)), device_(device) {}
  std::optional<int64_t> since(const Stamp& origin) const override;

 private:
  std::shared_ptr<void> event_;
  c10::DeviceIndex device_;
};

}  // namespace dearcomm
