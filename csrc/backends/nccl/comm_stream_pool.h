// Note [Stream lifetime] - dearcomm's communication streams are never
// destroyed. The caching allocator records an event on every stream a block
// was recorded on (Note [Buffer lifetime]) when that block is freed, which can
// be long after its backend is gone: a bucket the user still holds, tensors
// freed at interpreter exit. An event recorded on a destroyed stream crashes
// the process (seen on an H100: SIGSEGV in cudaEventRecord under
// DeviceCachingAllocator::insert_events at Py_FinalizeEx). So a dropped
// backend hands its idle stream back here and the next backend on that device
// reuses it; a stream with work stuck on it is never handed out again. (A
// freed buffer's event may then land behind the next backend's work on the
// reused stream: its memory is reused a little later, nothing worse.)
//
// Own streams rather than c10's pooled ones: those wrap around after 32 per
// device, and then teardown's idle check would wait for another user's work.
#pragma once

#include <c10/cuda/CUDAStream.h>

namespace dearcomm {

// A high-priority stream on one device, taken from the pool (or created) and
// handed back when this object goes, if it is idle then; one with work still
// on it (stuck, or aborted) is kept out of use for good. Also on a backend
// whose constructor throws after taking it.
class PooledStream {
 public:
  explicit PooledStream(c10::DeviceIndex device);
  ~PooledStream();
  PooledStream(const PooledStream&) = delete;
  PooledStream& operator=(const PooledStream&) = delete;

  const c10::cuda::CUDAStream& get() const { return stream_; }
  cudaStream_t stream() const { return stream_.stream(); }

 private:
  c10::cuda::CUDAStream stream_;
};

// Streams this process created so far (tests: dropped backends' are reused).
int64_t comm_streams_created();

}  // namespace dearcomm
