"""dearcomm runs on torch releases that name the one-tensor collectives
differently (2.14: all_gather_single; 2.11, on common GPU images:
all_gather_into_tensor). A direct call of either name broke one of them once;
these tests keep every call going through dearcomm._torch_collectives."""
import importlib
import pathlib
import re

import torch.distributed as dist

import dearcomm._torch_collectives as collectives

ROOT = pathlib.Path(__file__).resolve().parent.parent
DIRECT = re.compile(r"\bdist\.(all_gather_single|reduce_scatter_single|all_gather_into_tensor|reduce_scatter_tensor)\(")


def test_the_new_names_are_taken_where_torch_has_them():
    for new, old in [("all_gather_single", "all_gather_into_tensor"), ("reduce_scatter_single", "reduce_scatter_tensor")]:
        expected = getattr(dist, new, None) or getattr(dist, old)
        assert getattr(collectives, new) is expected


def test_a_torch_without_the_new_names_gets_the_old_ones(monkeypatch):
    for name in ("all_gather_single", "reduce_scatter_single"):
        monkeypatch.delattr(dist, name, raising=False)
    try:
        reloaded = importlib.reload(collectives)
        assert reloaded.all_gather_single is dist.all_gather_into_tensor
        assert reloaded.reduce_scatter_single is dist.reduce_scatter_tensor
    finally:
        monkeypatch.undo()
        importlib.reload(collectives)


def test_no_code_calls_either_name_directly():
    calls = []
    for folder in ("dearcomm", "benchmarks", "tests", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "_torch_collectives.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if DIRECT.search(line):
                    calls.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not calls, "call these through dearcomm._torch_collectives:\n" + "\n".join(calls)
