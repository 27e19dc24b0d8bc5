// Pack and unpack for CUDA tensors: every contiguous (source, destination)
// pair in one fused launch of kernels::copy_segments on the current stream,
// casting between fp32/fp16/bf16 and scaling; other pairs (strided, or other
// dtypes) fall back to ATen copies on the same stream.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace dearcomm {

void fused_copy(const std::vector<at::Tensor>& sources, const std::vector<at::Tensor>& destinations,
                double scale = 1.0);

// A bucket's pack (tensor i -> flat[offsets[i]:], scaled) and unpack (the
// reverse), addressing the slots directly instead of through one view each.
void pack_into(const std::vector<at::Tensor>& sources, const std::vector<int64_t>& offsets, const at::Tensor& flat,
               double scale = 1.0);
void unpack_from(const at::Tensor& flat, const std::vector<int64_t>& offsets,
                 const std::vector<at::Tensor>& destinations);

}  // namespace dearcomm
