"""torch.distributed's one-tensor collectives under the names of the torch in use.

torch 2.14 calls them all_gather_single / reduce_scatter_single and deprecates
the older all_gather_into_tensor / reduce_scatter_tensor; earlier releases
(2.11 on common GPU images) have only the older names. Same arguments:
(output, input, ..., group=...). And dearcomm's own collectives on the
training group, waited for within wrap()'s timeout (else the group's)."""
import datetime
import pickle
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def within(timeout: datetime.timedelta, what: str, collective, tensor: torch.Tensor, *args, **kwargs) -> None:
    """Runs a torch collective of dearcomm's on the training group (on
    ``tensor``) and waits for it at most ``timeout`` (wrap()'s), as the engine
    waits for its own: a peer that stalled, died or never calls it makes
    every waiting rank raise, naming ``what``, instead of waiting for the
    group's own timeout (30 minutes on gloo). On CUDA tensors the call is
    NCCL's as usual: a bounded wait there blocks the CPU until the GPU is
    done, and NCCL's watchdog bounds it."""
    if tensor.is_cuda:
        collective(tensor, *args, **kwargs)
        return
    work = collective(tensor, *args, async_op=True, **kwargs)
    try:
        work.wait(timeout)
    except RuntimeError as e:
        raise RuntimeError(f"dearcomm: {what} failed or did not complete within {timeout.total_seconds():g} s "
                           f"(wrap(timeout=), else the group's): a peer stalled, died or did not call it: {e}") from e


def peer_missing(what: str, error: Exception) -> RuntimeError:
    """The error where one of dearcomm's collectives that wait for the
    group's timeout failed (``what``: which, and how): gloo's text alone
    ("Timed out waiting 1800000ms for recv") names nothing."""
    return RuntimeError(f"dearcomm: {what} (the group's timeout): a peer stalled, died or is elsewhere: {error}")


def group_timeout(group) -> datetime.timedelta:
    """The timeout the group was created with. An NCCL group has no CPU
    backend and a gloo group no CUDA one: ask each device type's backend."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return dist.distributed_c10d._get_default_timeout(dist.get_backend(group))


def broadcast_within(tensors: List[torch.Tensor], src: int, group, timeout: datetime.timedelta, what: str) -> None:
    """Broadcasts ``tensors`` in place from global rank ``src``, one flat
    buffer per dtype and device, each wait within ``timeout`` (see within)."""
    by_kind: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    sending = dist.get_rank() == src
    for same in by_kind.values():
        flat = torch._utils._flatten_dense_tensors(same)
        within(timeout, what, dist.broadcast, flat, src, group=group)
        if not sending:  # the source's own values are already in place
            for tensor, value in zip(same, torch._utils._unflatten_dense_tensors(flat, same)):
                tensor.copy_(value)


def all_gather_object_within(obj: Any, group, timeout: datetime.timedelta, what: str,
                             device: Optional[torch.device] = None) -> List[Any]:
    """torch's all_gather_object with each wait within ``timeout`` (see
    within; on NCCL the watchdog's): the pickled objects' sizes gathered,
    then their bytes, padded to the largest. On an NCCL group through
    ``device`` (the rank's GPU: a script may not have made it current),
    else the CPU."""
    if dist.get_backend(group) != "nccl":
        device = torch.device("cpu")
    elif device is None or device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    n = dist.get_world_size(group)
    sizes = torch.empty(n, dtype=torch.int64, device=device)
    within(timeout, what, all_gather_single, sizes, torch.tensor([data.numel()], device=device), group=group)
    sizes = sizes.tolist()
    largest = max(sizes)
    padded = torch.zeros(largest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data.to(device)
    gathered = torch.empty(n * largest, dtype=torch.uint8, device=device)
    within(timeout, what, all_gather_single, gathered, padded, group=group)
    gathered = gathered.cpu()
    return [pickle.loads(gathered[r * largest:r * largest + size].numpy().tobytes()) for r, size in enumerate(sizes)]
