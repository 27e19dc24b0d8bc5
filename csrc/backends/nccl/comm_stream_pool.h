// Note [Stream lifetime] - dearcomm's communication streams are never
// destroyed. The caching allocator records an event on every stream a block
// was recorded on (Note [Buffer lifetime]) when that block is freed, which can
// be long after its backend is gone: a bucket the user still holds, tensors
// freed at interpreter exit. An event recorded on a destroyed stream crashes
// the process (seen on an H100: SIGSEGV in cudaEventRecord under
// DeviceCachingAllocator::insert_events at Py_FinalizeEx). So a dropped
// backend hands its idle stream back here and the next backend on that device
// reuses it; a stream with work stuck on it is never handed out again.
//
// Own streams rather than c10's pooled ones: those wrap around after 32 per
// device, and then teardown's idle check would wait for another user's work.
#pragma once

#include <c10/cuda/CUDAStream.h>

namespace dearcomm {

// An idle high-priority stream on `device`, reused or created.
c10::cuda::CUDAStream acquire_comm_stream(c10::DeviceIndex device);

// Makes `stream` available to the next backend; only once it is idle.
void release_comm_stream(const c10::cuda::CUDAStream& stream);

}  // namespace dearcomm
