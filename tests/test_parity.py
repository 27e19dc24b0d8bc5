"""Parity: every schedule, update and bucket size trains exactly like one
process on the global batch (fp32, rtol 1e-5), checked after every step.

Each world size runs all configurations in one set of processes (spawning is
the slow part); each configuration is then reported as its own test.
"""
import copy
import itertools
import traceback

import pytest
import torch
import torch.nn.functional as F

import dearcomm
from tests.models import MixedNet, batches, global_batch, local_slice, step_on_global_batch, step_on_slice
from tests.multiprocess import run_workers

STEPS = 7
SMALL_BUCKET_MB = 2048 / 2**20  # 2 KiB: a few parameters per bucket

SCHEDULES = [("dear", "sharded"), ("dear", "replicated"), ("wfbp", "replicated"), ("bytescheduler", "replicated"),
             ("usbyte", "replicated")]
# (bucket_mb, partition_mb): one bucket per tensor, a few tensors per bucket,
# the default; partitions smaller than the largest tensors (400 bytes, fused up
# to that), and the smallest partition (1 byte: one partition unit, world_size
# x 16 floats), which splits every tensor larger than that into many buckets
# whose last part has an odd size.
BUCKETINGS = [(0.0, None), (SMALL_BUCKET_MB, None), (25.0, None), (25.0, 400 / 2**20), (0.0, 1 / 2**20)]
CONFIGS = [
    dict(optim=optim, schedule=schedule, update=update, bucket_mb=bucket_mb, partition_mb=partition_mb)
    for optim, (schedule, update), (bucket_mb, partition_mb) in itertools.product(
        ["sgd", "adamw"], SCHEDULES, BUCKETINGS)
    if not (schedule == "usbyte" and partition_mb)  # usbyte splits by its planner's blocks only
] + [
    # A credit of one byte on a link pinned to drain nothing during backward
    # (from step 1): one all-reduce goes, the rest queue until backward ends
    # and then go input side first.
    dict(optim=optim, schedule="bytescheduler", update="replicated", bucket_mb=0.0, partition_mb=partition_mb,
         credit_mb=1 / 2**20, stalled_link=True)
    for optim, partition_mb in itertools.product(["sgd", "adamw"], [None, 1 / 2**20])
] + [
    # A planner's explicit pieces (US-Byte's unequal blocks): see uneven_blocks.
    dict(optim=optim, schedule=schedule, update=update, bucket_mb=SMALL_BUCKET_MB, partition_mb=None, blocks="uneven")
    for optim, (schedule, update) in itertools.product(["sgd", "adamw"], SCHEDULES)
] + [
    # US-Byte with a planner's order that is not the input-first one (output
    # side first), on a link pinned to drain nothing: blocks queue until
    # backward ends and then go in that order.
    dict(optim=optim, schedule="usbyte", update="replicated", bucket_mb=0.0, partition_mb=None, blocks="uneven",
         priorities="reversed", stalled_link=True)
    for optim in ["sgd", "adamw"]
]


def uneven_blocks(model, world_size):
    """Every parameter of more than three partition units in pieces of 1, 2 and
    the rest of the units, as a planner with unequal block sizes would."""
    blocks = {}
    for name, p in model.named_parameters():
        unit = dearcomm._C.partition_unit(world_size, p.dtype)
        if p.numel() > 3 * unit:
            blocks[name] = [unit, 2 * unit, p.numel() - 3 * unit]
    assert blocks, "no parameter is large enough to split"
    return blocks


def config_id(cfg):
    partition = f"-partition{cfg['partition_mb'] * 2**20:g}B" if cfg.get("partition_mb") else ""
    credit = f"-credit{cfg['credit_mb'] * 2**20:g}B" if cfg.get("credit_mb") else ""
    credit += "-stalled-link" if cfg.get("stalled_link") else ""
    blocks = f"-{cfg['blocks']}-blocks" if cfg.get("blocks") else ""
    blocks += f"-{cfg['priorities']}-priorities" if cfg.get("priorities") else ""
    return f"{cfg['optim']}-{cfg['schedule']}-{cfg['update']}-bucket{cfg['bucket_mb']:g}MB{partition}{credit}{blocks}"


def make_optimizer(kind, model):
    # Two groups with different learning rates; the scheduler scales both.
    first = list(model.embed.parameters()) + list(model.conv.parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    groups = [{"params": first}, {"params": rest, "lr": 0.05 if kind == "sgd" else 5e-3}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2)
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=1e-2)


def compare(what, actual, expected, failures, step, tolerance):
    try:
        torch.testing.assert_close(actual, expected, **tolerance)
    except AssertionError as e:
        failures.append(f"step {step}, {what}: {e}")


def train_and_compare(rank, world_size, cfg, device="cpu", tolerance=dict(rtol=1e-5, atol=1e-6)):
    """Trains a wrapped model on this rank's slice and a reference on the whole
    batch; returns the mismatches found after every step (empty: parity)."""
    torch.manual_seed(0)
    model = MixedNet().to(device)
    reference = copy.deepcopy(model)
    optimizer, ref_optimizer = make_optimizer(cfg["optim"], model), make_optimizer(cfg["optim"], reference)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.8 ** s)
    ref_scheduler = torch.optim.lr_scheduler.LambdaLR(ref_optimizer, lambda s: 0.8 ** s)
    blocks = uneven_blocks(model, world_size) if cfg.get("blocks") else None
    names = [name for name, _ in model.named_parameters()]
    priorities = {name: -i for i, name in enumerate(names)} if cfg.get("priorities") == "reversed" else None
    model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=cfg["bucket_mb"],
                                     partition_mb=cfg.get("partition_mb"), blocks=blocks, priorities=priorities,
                                     credit_mb=cfg.get("credit_mb"),
                                     schedule=cfg["schedule"], update=cfg["update"],
                                     comm_dtype=cfg.get("comm_dtype"))
    failures = []
    for step, (tokens, labels) in enumerate(batches(STEPS, global_batch(world_size))):
        tokens, labels = tokens.to(device), labels.to(device)
        optimizer.zero_grad(set_to_none=step % 2 == 0)
        F.cross_entropy(model(local_slice(tokens, rank, world_size)), local_slice(labels, rank, world_size)).backward()
        optimizer.step()
        scheduler.step()
        if step == 0 and cfg.get("stalled_link"):
            engine = model._dear.engine
            engine.pin_link_model([0] * len(engine.layout.buckets))
        if step == 0 and cfg.get("partition_mb"):
            slots = model._dear.engine.layout.params
            assert any(s.last_bucket > s.bucket for s in slots), "partitioning split no parameter"
        if step == 0 and blocks:
            layout, index = model._dear.engine.layout, model._dear.index
            for name, p in model.named_parameters():
                slot = layout.params[index[p]]
                pieces = [layout.buckets[b].numel for b in range(slot.bucket, slot.last_bucket + 1)]
                assert pieces == blocks.get(name, pieces), f"{name}: buckets of {pieces}, blocks {blocks[name]}"

        ref_optimizer.zero_grad()
        F.cross_entropy(reference(tokens), labels).backward()
        ref_optimizer.step()
        ref_scheduler.step()

        # Each way of reading parameters after step() must see the update; on
        # "next forward" steps only the next training forward consumes the
        # all-gathers (after zero_grad), as in a plain training loop.
        way = step % 5
        if way == 4:
            continue
        if way == 0:
            compare("state_dict()", model.state_dict(), reference.state_dict(), failures, step, tolerance)
        elif way == 1:
            with torch.no_grad():
                compare("no_grad forward", model(tokens), reference(tokens), failures, step, tolerance)
        elif way == 2:
            model.eval()
            compare("eval forward", model(tokens), reference(tokens), failures, step, tolerance)
            model.train()
        else:
            model.sync()
        compare("parameters", dict(model.named_parameters()), dict(reference.named_parameters()), failures, step,
                tolerance)
    return failures


def parity_worker(rank, world_size, configs):
    results = {}
    for cfg in configs:
        try:
            results[config_id(cfg)] = train_and_compare(rank, world_size, cfg)
        except Exception:  # reported per configuration
            results[config_id(cfg)] = [traceback.format_exc()]
    return results


_results = {}


def results_for(world_size):
    if world_size not in _results:
        _results[world_size] = run_workers(parity_worker, world_size, CONFIGS, deadline=300)
    return _results[world_size]


@pytest.mark.parametrize("cfg", CONFIGS, ids=config_id)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_parity_with_single_process(world_size, cfg):
    for rank, results in enumerate(results_for(world_size)):
        failures = results[config_id(cfg)]
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def large_bucket_worker(rank, world_size):
    """Guards the CPU exchange's piece loop: a 1000x700 weight in one 25 MiB
    bucket sends each peer ~1.3 MiB (world size 2) or ~0.9 MiB (3), cut into
    1 MiB pieces and a tail that is not a multiple of them. No other parity
    test has a bucket above a few KiB."""
    failures = {}
    # Also with the 2.7 MiB weight split into 1 MiB partitions.
    for (schedule, update), partition_mb in itertools.product(SCHEDULES, [None, 1.0]):
        if schedule == "usbyte" and partition_mb:
            continue  # usbyte splits by its planner's blocks only
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1000, 700), torch.nn.Tanh(), torch.nn.Linear(700, 3))
        reference = copy.deepcopy(model)
        optimizer, ref_optimizer = (torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (model, reference))
        model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=25.0, partition_mb=partition_mb,
                                         schedule=schedule, update=update)
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            n = global_batch(world_size)
            x, y = torch.randn(n, 1000, generator=g), torch.randint(0, 3, (n,), generator=g)
            step_on_slice(model, optimizer, x, y, rank, world_size)
            step_on_global_batch(reference, ref_optimizer, x, y)
        model.sync()
        errors = []
        compare("parameters", dict(model.named_parameters()), dict(reference.named_parameters()), errors, 3,
                dict(rtol=1e-5, atol=1e-6))
        if errors:
            failures[f"{schedule}-{update}-partition{partition_mb}"] = errors
    return failures


@pytest.mark.parametrize("world_size", [2, 3])
def test_parity_with_buckets_of_several_pieces(world_size):
    for rank, failures in enumerate(run_workers(large_bucket_worker, world_size)):
        assert not failures, f"rank {rank}: {failures}"
