"""Runs a command the way the README and docs tell users to (a launcher,
torchrun, an example script) from the repository root, under a deadline."""
import os
import subprocess
import sys
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parent.parent


def launch(command: List[str], timeout: float = 240, **env: str) -> str:
    """Runs `command` (one thread per process, `env` added); returns its
    stdout, failing the test with its output where it exits non-zero."""
    result = subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr[-4000:]}"
    return result.stdout


def torchrun(nproc: int, *args: str, timeout: float = 240) -> str:
    """`torchrun --standalone --nproc_per_node=nproc ARGS`, with this Python."""
    return launch([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   *args], timeout=timeout)
