"""torch.distributed's one-tensor collectives under the names of the torch in use.

torch 2.14 calls them all_gather_single / reduce_scatter_single and deprecates
the older all_gather_into_tensor / reduce_scatter_tensor; earlier releases
(2.11 on common GPU images) have only the older names. Same arguments:
(output, input, ..., group=...)."""
import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
