// One macro each for CUDA and NCCL calls: the failing call, file:line, and the
// library's own error string (plus NCCL's last error message, which names the cause).
#pragma once

#include <c10/util/Exception.h>
#include <cuda_runtime.h>
#include <nccl.h>

#define DEARCOMM_CUDA_CHECK(expr)                                                        \
  do {                                                                                   \
    const cudaError_t dearcomm_err_ = (expr);                                            \
    TORCH_CHECK(dearcomm_err_ == cudaSuccess, "dearcomm: CUDA error at ", __FILE__, ":", \
                __LINE__, " in ", #expr, ": ", cudaGetErrorString(dearcomm_err_));       \
  } while (0)

#define DEARCOMM_NCCL_CHECK(expr)                                                           \
  do {                                                                                      \
    const ncclResult_t dearcomm_res_ = (expr);                                              \
    TORCH_CHECK(dearcomm_res_ == ncclSuccess, "dearcomm: NCCL error at ", __FILE__, ":",    \
                __LINE__, " in ", #expr, ": ", ncclGetErrorString(dearcomm_res_), " (",     \
                ncclGetLastError(nullptr), ")");                                            \
  } while (0)
