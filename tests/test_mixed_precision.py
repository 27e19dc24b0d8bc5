"""Low precision: bf16/fp16 gradients on the wire, and bf16 parameters with
fp32 master shards, each within an error bound of fp32 training on one process
(and measurably not fp32, so the low precision really is used)."""
import copy
import traceback

import pytest
import torch
import torch.nn.functional as F

import dearcomm
from tests.models import MixedNet, batches, step_on_global_batch, step_on_slice
from tests.multiprocess import run_workers
from tests.test_parity import SCHEDULES, make_optimizer

# AdamW moves a parameter by up to lr = 1e-2 a step (5 steps here);
# low-precision noise can flip small updates. bf16 parameters also compute
# forward and backward in bf16, so they are further checked against the same
# training on one process (below).
BOUNDS = {torch.float32: dict(rtol=2e-2, atol=2e-3), torch.bfloat16: dict(rtol=2e-2, atol=5e-2)}


def single_process_bf16_distance():
    """How far one process training bf16 parameters with an fp32 master copy
    (what update='sharded' does) ends from fp32 training."""
    torch.manual_seed(0)
    reference = MixedNet()
    master = copy.deepcopy(reference)
    low = copy.deepcopy(reference).to(torch.bfloat16)
    ref_opt, master_opt = make_optimizer("adamw", reference), make_optimizer("adamw", master)
    for x, y in batches(5, 12):
        step_on_global_batch(reference, ref_opt, x, y)
        F.cross_entropy(low(x).float(), y).backward()
        for p, m in zip(low.parameters(), master.parameters()):
            m.grad, p.grad = p.grad.float(), None
        master_opt.step()
        master_opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(low.parameters(), master.parameters()):
                p.copy_(m)
    return max_difference(low, reference)


def max_difference(model, reference):
    return max((p.float() - q.float()).abs().max().item()
               for p, q in zip(model.parameters(), reference.parameters()))


def precision_worker(rank, world_size, comm_dtype, param_dtype):
    results = {}
    for schedule, update in SCHEDULES:
        name = f"{schedule}-{update}"
        try:
            torch.manual_seed(0)
            reference = MixedNet()
            model = copy.deepcopy(reference).to(param_dtype)
            optimizer, ref_opt = make_optimizer("adamw", model), make_optimizer("adamw", reference)
            model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=0.001, schedule=schedule, update=update,
                                             comm_dtype=comm_dtype)
            for x, y in batches(5, 12):
                step_on_slice(model, optimizer, x, y, rank, world_size, float_loss=True)
                step_on_global_batch(reference, ref_opt, x, y)
            model.sync()
            engine = model._dear.engine
            masters = [engine.master_shard(b).dtype for b in range(len(engine.layout.buckets))] \
                if update == "sharded" else []
            torch.testing.assert_close({k: v.float() for k, v in model.state_dict().items()},
                                       reference.state_dict(), **BOUNDS[param_dtype])
            results[name] = (max_difference(model, reference), masters)
        except Exception:
            results[name] = traceback.format_exc()
    return results


@pytest.mark.parametrize("comm_dtype, param_dtype", [
    (torch.bfloat16, torch.float32), (torch.float16, torch.float32), (None, torch.bfloat16)],
    ids=["bf16-gradients", "fp16-gradients", "bf16-parameters"])
def test_low_precision_stays_within_bound_of_fp32(comm_dtype, param_dtype):
    for rank, results in enumerate(run_workers(precision_worker, 3, comm_dtype, param_dtype)):
        for name, result in results.items():
            assert not isinstance(result, str), f"rank {rank}, {name}:\n{result}"
            difference, masters = result
            assert difference > 1e-6, f"{name}: identical to fp32 training; was low precision used at all?"
            assert all(d == torch.float32 for d in masters), f"{name}: master shards are {masters}"
            if param_dtype == torch.bfloat16:
                baseline = single_process_bf16_distance()
                assert difference <= 2 * baseline, \
                    f"{name}: {difference:.3g} from fp32, one process in bf16 is {baseline:.3g} from it"


def fp16_range_worker(rank, world_size):
    """Guards the fp16 pre-divide: every rank's gradient is 30000, so the sum
    of three (90000) overflows fp16 (max 65504) while their mean does not; the
    update must be the mean's, with no inf or NaN anywhere."""
    results = {}
    for schedule, update in SCHEDULES:
        weight = torch.nn.Parameter(torch.zeros(16))
        model = torch.nn.Module()
        model.weight = weight
        model.forward = lambda: (weight * 30000.0).sum()  # d/dweight = 30000 on every rank
        optimizer = torch.optim.SGD([weight], lr=1e-4)
        model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=0, schedule=schedule, update=update,
                                         comm_dtype=torch.float16)
        model().backward()
        optimizer.step()
        model.sync()
        results[f"{schedule}-{update}"] = weight.detach().clone()
    return results


def test_fp16_gradients_are_averaged_without_overflow():
    for rank, results in enumerate(run_workers(fp16_range_worker, 3)):
        for name, weight in results.items():
            torch.testing.assert_close(weight, torch.full((16,), -3.0), rtol=1e-3, atol=0,
                                       msg=lambda m: f"rank {rank}, {name}: {m}")
