"""The Python snippets of the README and docs/, run as a user would paste them.

Every ```python block in those files carries, on the line before its fence,
a marker that names what the snippet expects to exist already:

    <!-- doc-test: wrapped -->

(the names are FIXTURES' keys), or says why it is not run here:

    <!-- doc-test: skip: examples/lightning_train.py trains with it (test_integrations_parity.py) -->

A file's snippets run in order on every rank of one gloo job, each in a
fresh namespace built by its fixture, in a working directory the ranks
share (a snippet that saves on rank 0 and loads on every rank does so as
written). Where no GPU is present, "cuda" in a snippet reads "cpu": the
guide's recipes are written for GPUs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import textwrap
import traceback
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.launch import ROOT
from tests.models import MixedNet, batches
from tests.multiprocess import free_port

DOCS = ("README.md", "docs/guide.md", "docs/pipeline.md")
MARKER = re.compile(r"^\s*<!-- doc-test: (?P<what>[a-z-]+)(?:: (?P<why>.+?))? -->\s*$")
FENCE = re.compile(r"^\s*```python\s*$")


class Snippet(NamedTuple):
    path: str
    line: int  # of the fence, 1-based
    fixture: str  # a FIXTURES key, or "skip"
    why: str
    code: str


def snippets(path: str) -> List[Snippet]:
    """Every ```python block of `path` with its marker (fixture "" where it
    has none)."""
    lines = (ROOT / path).read_text().splitlines()
    found = []
    for i, line in enumerate(lines):
        if not FENCE.match(line):
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        marker = MARKER.match(lines[i - 1]) if i > 0 else None
        found.append(Snippet(path, i + 1, marker["what"] if marker else "", (marker["why"] or "") if marker else "",
                             textwrap.dedent("\n".join(lines[i + 1:end]))))
    return found


Net = MixedNet  # what the snippets call Net: embedding, conv, layernorm and linear layers


def _batch():
    rank = dist.get_rank() if dist.is_initialized() else 0
    return next(batches(1, 16, seed=rank + 1))


def _base() -> dict:
    import dearcomm

    x, y = _batch()
    return dict(torch=torch, dist=dist, nn=nn, F=F, contextlib=contextlib, dataclasses=dataclasses,
                dearcomm=dearcomm, Net=Net, loss_fn=F.cross_entropy, x=x, y=y, loader=[(x, y)] * 3)


def _plain() -> dict:
    ns = _base()
    torch.manual_seed(0)
    ns["model"] = Net()
    ns["optimizer"] = torch.optim.AdamW(ns["model"].parameters(), lr=1e-3)
    return ns


def _wrapped() -> dict:
    ns = _plain()
    ns["model"], ns["optimizer"] = ns["dearcomm"].wrap(ns["model"], ns["optimizer"], bucket_mb=0.001)
    return ns


def _backward() -> dict:
    """Wrapped, with a forward done: `loss` waits for its backward."""
    ns = _wrapped()
    ns["loss"] = F.cross_entropy(ns["model"](ns["x"]), ns["y"])
    return ns


def _micro() -> dict:
    ns = _wrapped()
    ns["micro_batches"] = [(ns["x"][:8], ns["y"][:8]), (ns["x"][8:], ns["y"][8:])]
    return ns


def _trained() -> dict:
    """Wrapped and trained 13 steps (overlap_report has its iterations)."""
    ns = _wrapped()
    model, optimizer = ns["model"], ns["optimizer"]
    for _ in range(13):
        optimizer.zero_grad()
        F.cross_entropy(model(ns["x"]), ns["y"]).backward()
        optimizer.step()
    model.sync()
    return ns


def _profiled() -> dict:
    """Unwrapped, with its profile (`prof`, `profile`, and profile.json) and a
    `network`."""
    ns = _plain()
    dearcomm = ns["dearcomm"]
    prof = dearcomm.profile(ns["model"], (ns["x"], ns["y"]), ns["optimizer"],
                            loss_fn=lambda out, batch: F.cross_entropy(out, batch[1]), iterations=3)
    if dist.get_rank() == 0:
        prof.save("profile.json")
    dist.barrier()
    ns.update(prof=prof, profile=prof, network=dearcomm.network_preset("10gbe"))
    return ns


def _collectives() -> dict:
    """results/collectives.json, as benchmarks/collectives.py --json writes it
    (the test runs it first), and a profile."""
    assert Path("results/collectives.json").is_file(), "the test writes results/collectives.json first"
    return _profiled()


def _contention() -> dict:
    """results/contention.json: measure_contention's timings of a forward and
    backward, on every rank."""
    import json

    from dearcomm.contention import measure_contention

    ns = _plain()
    measured = measure_contention(_forward_backward(ns), nbytes=1 << 20, iters=3)
    if dist.get_rank() == 0:
        Path("results").mkdir(exist_ok=True)
        Path("results/contention.json").write_text(json.dumps(measured))
    dist.barrier()
    return ns


def _forward_backward(ns: dict) -> Callable[[], None]:
    def one_forward_backward():
        F.cross_entropy(ns["model"](ns["x"]), ns["y"]).backward()
    return one_forward_backward


def _pipeline_topology() -> dict:
    from dearcomm.pipeline import preset

    ns = _plain()
    ns.update(topology=preset("nvlink-pairs", 4), one_forward_backward=_forward_backward(ns))
    return ns


FIXTURES: Dict[str, Callable[[], dict]] = {
    "script": _base,  # a whole script: it starts the process group itself
    "none": _base,
    "plain": _plain,
    "wrapped": _wrapped,
    "backward": _backward,
    "micro": _micro,
    "trained": _trained,
    "profiled": _profiled,
    "collectives": _collectives,
    "contention": _contention,
    "pipeline-topology": _pipeline_topology,
}


def _code(snippet: Snippet) -> str:
    return snippet.code if torch.cuda.is_available() else snippet.code.replace('"cuda"', '"cpu"')


def run_file(rank: int, world_size: int, path: str, workdir: str) -> List[str]:
    """Runs `path`'s snippets on this rank (a run_workers function); returns
    a message per snippet that raised."""
    os.chdir(workdir)
    failures = []
    todo = [s for s in snippets(path) if s.fixture != "skip"]
    if any(s.fixture == "script" for s in todo):
        # A whole script starts the group itself, as under torchrun: the
        # harness's group goes, the environment torchrun would set stays.
        port = [free_port()] if rank == 0 else [None]
        dist.broadcast_object_list(port)
        dist.destroy_process_group()
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_PORT=str(port[0]))
    for snippet in todo:
        where = f"{snippet.path}:{snippet.line} ({snippet.fixture})"
        try:
            namespace = FIXTURES[snippet.fixture]()
            with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
                exec(compile(_code(snippet), where, "exec"), namespace)
        except Exception:  # noqa: BLE001 - every snippet's error is reported, then the next runs
            failures.append(f"{where}:\n{traceback.format_exc()}")
        if dist.is_initialized():
            dist.barrier()  # no rank starts the next snippet's collectives while another is in this one's
    return failures
