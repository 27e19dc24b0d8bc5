"""Buffers (BatchNorm's running statistics) under gradient accumulation end
as under torch DDP: both broadcast rank 0's buffers at the first training
forward after a synchronising one, so with no_sync() the first micro-batch of
each step starts from rank 0's statistics and the others keep their own."""
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


def _worker(rank, world_size):
    ddp_model = _model()
    ddp = DistributedDataParallel(ddp_model)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    _train(rank, ddp, ddp_opt, ddp.no_sync)
    results = {"ddp": {k: v.clone() for k, v in ddp_model.state_dict().items()}}
    for schedule in ("dear", "wfbp"):
        model = _model()
        model, optimizer = dearcomm.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), schedule=schedule)
        _train(rank, model, optimizer, model.no_sync)
        results[schedule] = {k: v.clone() for k, v in model.state_dict().items()}
    return results


def test_buffers_under_accumulation_match_ddp():
    for rank, r in enumerate(run_workers(_worker, 2, deadline=120)):
        for schedule in ("dear", "wfbp"):
            for name, value in r["ddp"].items():
                torch.testing.assert_close(r[schedule][name], value, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"rank {rank} {schedule} {name}: {m}")
