"""The README's and docs' Python snippets run as written (tests/doc_snippets.py
says how they are marked and what each marker provides)."""
import os

import pytest

from tests.doc_snippets import DOCS, FIXTURES, run_file, snippets
from tests.launch import ROOT, torchrun
from tests.multiprocess import run_workers

WORLD = 2


@pytest.mark.parametrize("path", DOCS)
def test_every_snippet_says_how_it_runs(path):
    """A new snippet without a marker (or with a misspelt one) fails here, not silently untested."""
    found = snippets(path)
    assert found, f"{path} has no python snippets: is DOCS up to date?"
    for s in found:
        assert s.fixture in FIXTURES or (s.fixture == "skip" and s.why), (
            f"{path}:{s.line}: the snippet needs a '<!-- doc-test: NAME -->' line before its fence, NAME one of "
            f"{sorted(FIXTURES)}, or 'skip: why'; got {s.fixture!r}")


def test_markers_are_read():
    """The parser sees a marker's fixture and a skip's reason (a snippet of this file's own making)."""
    text = ("# t\n<!-- doc-test: wrapped -->\n```python\nx = 1\n```\n\n"
            "  <!-- doc-test: skip: needs a GPU -->\n  ```python\n  y = 2\n  ```\n```python\nz = 3\n```\n")
    path = ROOT / "tests" / "_doc_snippets_probe.md"
    path.write_text(text)
    try:
        found = snippets(str(path.relative_to(ROOT)))
    finally:
        path.unlink()
    assert [(s.fixture, s.why, s.code) for s in found] == [("wrapped", "", "x = 1"), ("skip", "needs a GPU", "y = 2"),
                                                            ("", "", "z = 3")]


def _collectives_json(workdir):
    """What the guide's fit_network snippet reads: benchmarks/collectives.py's
    own --json, 256 KiB to 8 MiB (below that loopback's times need not grow
    with the size, and the fit refuses them)."""
    os.makedirs(os.path.join(workdir, "results"), exist_ok=True)
    out = os.path.join(workdir, "results", "collectives.json")
    torchrun(WORLD, "benchmarks/collectives.py", "--min-bytes", str(256 << 10), "--max-bytes", str(8 << 20),
             "--dtypes", "fp32", "--json", out, timeout=120)


@pytest.mark.parametrize("path", DOCS)
def test_snippets_run(path, tmp_path):
    if any(s.fixture == "collectives" for s in snippets(path)):
        _collectives_json(str(tmp_path))
    failures = run_workers(run_file, WORLD, path, str(tmp_path), deadline=420)
    for rank, failed in enumerate(failures):
        assert not failed, f"rank {rank}:\n" + "\n".join(failed)
