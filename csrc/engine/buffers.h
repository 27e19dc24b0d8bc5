// The tensors the engine keeps per flat buffer and per bucket. Which of them
// exist beside the gradients is up to the update strategy (update/update.h).
#pragma once

#include <ATen/core/Tensor.h>

namespace dearcomm {

// One flat buffer per dtype (Megatron-LM's grad buffer): the buckets' tensors
// of the same name are consecutive ranges of these.
struct FlatBuffers {
  at::Tensor grads;
  at::Tensor gathered_comm;
  at::Tensor gathered;
  at::Tensor params;
  bool grad_views = false;  // each parameter's .grad aliases its slot of `grads`
};

// A bucket's tensors are views into the flat buffers of its dtype, so a
// parameter that spans buckets has one contiguous .grad, master and parameter.
struct BucketBuffers {
  // Local gradients (padded): packed, or accumulated in place by autograd where
  // .grad is a view into it (its flat buffer's grad_views).
  at::Tensor grads;
  at::Tensor grad_shard;    // reduce-scatter: this rank's averaged gradient shard (communication dtype)
  at::Tensor master_grad;   // sharded: grad_shard in fp32 for the optimizer (aliases it if fp32)
  at::Tensor gathered_comm; // replicated: the all-gather's output, in the communication dtype;
                            // `grads` (its data is consumed by then) unless .grad views live there
  at::Tensor gathered;      // replicated: all-gathered averaged gradients in the parameters'
                            // dtype (aliases `gathered_comm` when the dtypes agree)
  at::Tensor master;        // sharded: fp32 master parameters, this rank's shard
  at::Tensor gather_input;  // sharded: `master` in the parameters' dtype (aliases it for fp32)
  at::Tensor params;        // sharded: gathered parameters; the parameters are views of it
};

}  // namespace dearcomm
