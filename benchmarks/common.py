"""Shared harness of the benchmarks: process group from torchrun, timing that
syncs the right device, nccl-tests-style tables, and --json output."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable, Dict, List, Sequence

import torch
import torch.distributed as dist


def init(backend: str) -> torch.device:
    """Joins torchrun's group; returns the device this rank works on."""
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        return torch.device("cuda", local)
    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // dist.get_world_size()))
    return torch.device("cpu")


def model_rounds_parser(doc: str, models: Sequence[str], model: str, batch: int, rounds: int,
                        iters: int) -> argparse.ArgumentParser:
    """--model, --batch (per rank), --rounds, --iters (per round, of each
    variant) and --json: the options of a benchmark that alternates variants
    of one model's training in rounds."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(models), default=model)
    parser.add_argument("--batch", type=int, default=batch, help="per rank")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--iters", type=int, default=iters, help="per round, of each")
    parser.add_argument("--json", default="")
    return parser


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], None], device: torch.device, warmup: int, iters: int) -> float:
    """Median wall time of fn() over iters calls, each ended by a device sync,
    as the slowest rank saw it (max over ranks of each rank's median)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def slowest(seconds: float) -> float:
    """The largest of the ranks' values (every rank calls it): a synchronous
    iteration is as slow as its slowest rank."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def all_ranks(values: list) -> list:
    """Every rank's list, by rank (every rank calls it)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(values))
    return gathered


def iterations_for(nbytes: int, budget_bytes: float = 4e8, lo: int = 3, hi: int = 30) -> int:
    return int(max(lo, min(hi, budget_bytes // max(nbytes, 1))))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class Table:
    """Prints rows as they come (rank 0 only) and keeps them for --json."""

    def __init__(self, columns: Sequence[tuple], title: str = "") -> None:
        self.columns = columns  # (key, header, width, format)
        self.rows: List[Dict] = []
        self.rank0 = dist.get_rank() == 0
        if self.rank0:
            if title:
                print(title)
            print("".join(f"{h:>{w}}" for _, h, w, _ in columns), flush=True)

    def add(self, **row) -> None:
        self.rows.append(row)
        if self.rank0:
            print("".join(f"{format(row[k], f):>{w}}" for k, _, w, f in self.columns), flush=True)


def write_json(path: str, payload: Dict) -> None:
    if path and dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
