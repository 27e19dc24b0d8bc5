"""Buffers (BatchNorm's running statistics) under gradient accumulation, as
under torch DDP: every forward after a synchronising training forward starts
from rank 0's buffers (DDP broadcasts before it, dearcomm right after the
training forward), so with no_sync() the first micro-batch of each step
starts from rank 0's statistics and the others from their own, and an eval
forward on every rank after training (a distributed eval) sees rank 0's."""
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import dearcomm
from tests.multiprocess import run_workers

MICRO, STEPS = 2, 3


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _train(rank, model, optimizer, no_sync):
    g = torch.Generator().manual_seed(10 + rank)  # every rank its own data: the statistics differ
    for _ in range(STEPS):
        for micro in range(MICRO):
            x = torch.randn(4, 6, generator=g) * (1 + rank)
            if micro < MICRO - 1:
                with no_sync():
                    model(x).square().mean().backward()
            else:
                model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _evaluated(model, rank):
    """What a distributed eval sees: the eval outputs on this rank's own
    batch, and the state they were computed from."""
    model.eval()
    with torch.no_grad():
        out = model(torch.randn(4, 6, generator=torch.Generator().manual_seed(99 + rank)))
    plain = model.module if isinstance(model, DistributedDataParallel) else model
    return out, {k: v.clone() for k, v in plain.state_dict().items()}


def _worker(rank, world_size):
    ddp_model = _model()
    ddp = DistributedDataParallel(ddp_model)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    _train(rank, ddp, ddp_opt, ddp.no_sync)
    results = {"ddp": _evaluated(ddp, rank)}
    for schedule in ("dear", "wfbp"):
        model = _model()
        model, optimizer = dearcomm.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), schedule=schedule)
        _train(rank, model, optimizer, model.no_sync)
        results[schedule] = _evaluated(model, rank)
    return results


def test_buffers_under_accumulation_and_eval_match_ddp():
    for rank, r in enumerate(run_workers(_worker, 2, deadline=120)):
        for schedule in ("dear", "wfbp"):
            torch.testing.assert_close(r[schedule][0], r["ddp"][0], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {schedule} eval outputs: {m}")
            for name, value in r["ddp"][1].items():
                torch.testing.assert_close(r[schedule][1][name], value, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"rank {rank} {schedule} {name}: {m}")


def _two_forwards_worker(rank, world_size):
    """Two training forwards before one backward (two views of a batch, a
    discriminator on real and fake ones) through BatchNorm: both forwards
    saved the running statistics for backward, which the broadcast between
    them must leave usable, as DDP does."""
    results = {}
    for name in ("ddp", "dear", "wfbp"):
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        if name == "ddp":
            model = DistributedDataParallel(model)
        else:
            model, optimizer = dearcomm.wrap(model, optimizer, schedule=name)
        g = torch.Generator().manual_seed(rank)
        for _ in range(STEPS):
            x1, x2 = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
            (model(x1).square().mean() + model(x2).square().mean()).backward()
            optimizer.step()
            optimizer.zero_grad()
        results[name] = _evaluated(model, rank)[0]
    return results


def test_two_forwards_before_backward_train_as_with_ddp():
    for rank, r in enumerate(run_workers(_two_forwards_worker, 2, deadline=120)):
        for schedule in ("dear", "wfbp"):
            torch.testing.assert_close(r[schedule], r["ddp"], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {schedule}: {m}")
