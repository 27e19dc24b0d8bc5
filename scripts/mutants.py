"""Mutation check: do the tests fail when the code is wrong?

Each scripts/mutants/NN-name.patch plants one small, realistic bug in csrc/ or
dearcomm/. Its header names the bug and the tests that must catch it:

    # bug: what is wrong
    # tests: pytest arguments (files or node ids; no -k: the baseline runs every
    # mutant's tests in one pytest command)

For every patch, in a scratch copy of the tree (never the working tree): apply
it, rebuild dearcomm._C (CPU part only) if it touches csrc/, run its tests
under a timeout, and revert it. CAUGHT: pytest failed (or hung past the
timeout); MISSED: the tests passed with the bug in place. The unpatched tree
must pass every listed test first (baseline), or nothing is judged. Exits
non-zero if a mutant is missed, a patch no longer applies, or a run errs.

Run through scripts/mutants.sh (see there); not part of CI.
"""
from __future__ import annotations

import argparse
import glob
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCH_DIR = os.path.join(REPO, "scripts", "mutants")


def parse(path):
    bug, tests = None, None
    with open(path) as f:
        for line in f:
            if line.startswith("# bug:"):
                bug = line[len("# bug:"):].strip()
            elif line.startswith("# tests:"):
                tests = shlex.split(line[len("# tests:"):])
            elif line.startswith("diff --git"):
                break
    if not bug or not tests:
        raise SystemExit(f"{path}: needs '# bug:' and '# tests:' header lines before the diff")
    touched = [line.split()[2][2:] for line in open(path) if line.startswith("diff --git")]
    return bug, tests, touched


def run(cmd, cwd, log, timeout=None, env=None):
    """Runs cmd, appending its output to log; returns the exit status (124: timed out)."""
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # pytest and the worker processes it spawned
            proc.wait()
            out.write(f"\n[mutants] timed out after {timeout} s\n")
            return 124


def copy_tree(dest, working_tree):
    """HEAD (or HEAD plus uncommitted changes and untracked files) into dest."""
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    if working_tree:
        diff = subprocess.run(["git", "diff", "--binary", "HEAD"], cwd=REPO, capture_output=True, check=True).stdout
        if diff:
            subprocess.run(["git", "apply", "--whitespace=nowarn"], cwd=dest, input=diff, check=True)
        untracked = subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "-z"], cwd=REPO,
                                   capture_output=True, check=True).stdout.decode().split("\0")
        for name in filter(None, untracked):
            os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
            shutil.copy2(os.path.join(REPO, name), os.path.join(dest, name))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="only these mutants (name or number prefix)")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per pytest run (a hang counts as caught)")
    parser.add_argument("--working-tree", action="store_true",
                        help="mutate HEAD plus uncommitted changes (default: HEAD only)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy and its logs")
    args = parser.parse_args()
    args.python = os.path.abspath(shutil.which(args.python) or args.python)  # runs are in the scratch copy

    patches = sorted(glob.glob(os.path.join(PATCH_DIR, "*.patch")))
    if args.names:
        patches = [p for p in patches if any(os.path.basename(p).startswith(n) for n in args.names)]
    if not patches:
        raise SystemExit("no mutant selected")
    mutants = [(os.path.basename(p)[:-len(".patch")], p, *parse(p)) for p in patches]

    scratch = tempfile.mkdtemp(prefix="dearcomm-mutants-")
    tree, logs = os.path.join(scratch, "tree"), os.path.join(scratch, "logs")
    os.makedirs(tree)
    os.makedirs(logs)
    copy_tree(tree, args.working_tree)
    env = dict(os.environ, DEARCOMM_CUDA="0", PYTHONPATH=tree, PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTEST_ADDOPTS", None)
    print(f"scratch copy: {tree}  (logs: {logs})", flush=True)
    started = time.monotonic()

    def build(log):
        return run([args.python, "setup.py", "build_ext", "--inplace"], tree, log, env=env) == 0

    def pytest(test_args, log):
        return run([args.python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *test_args], tree, log,
                   timeout=args.timeout, env=env)

    # Baseline: the unpatched tree passes every test a mutant lists.
    baseline_log = os.path.join(logs, "baseline.log")
    if not build(baseline_log):
        raise SystemExit(f"baseline build failed: see {baseline_log}")
    all_tests = list(dict.fromkeys(t for m in mutants for t in m[3]))
    t0 = time.monotonic()
    status = pytest(all_tests, baseline_log)
    print(f"baseline: {'pass' if status == 0 else 'FAIL'} ({time.monotonic() - t0:.0f} s, {len(all_tests)} test args)",
          flush=True)
    if status != 0:
        raise SystemExit(f"the unpatched tree fails its own tests (exit {status}): see {baseline_log}")

    rows, built_clean = [], True
    for name, path, bug, tests, touched in mutants:
        log = os.path.join(logs, name + ".log")
        t0 = time.monotonic()
        native = any(f.startswith("csrc/") for f in touched)
        if run(["git", "apply", "--check", path], tree, log) != 0:
            rows.append((name, "NO-APPLY", 0.0, bug))
            print(f"{name}: NO-APPLY", flush=True)
            continue
        run(["git", "apply", path], tree, log)
        try:
            if not native and not built_clean:
                ok = build(log)  # the previous mutant's native code is still in _C
                built_clean = ok
            elif native:
                built_clean = False
                ok = build(log)
            else:
                ok = True
            if not ok:
                verdict = "NO-BUILD"
            else:
                status = pytest(tests, log)
                verdict = {0: "MISSED", 1: "CAUGHT", 124: "CAUGHT(hang)"}.get(status, f"ERROR({status})")
        finally:
            run(["git", "apply", "-R", path], tree, log)
        rows.append((name, verdict, time.monotonic() - t0, bug))
        print(f"{name}: {verdict} ({time.monotonic() - t0:.0f} s)", flush=True)

    width = max(len(r[0]) for r in rows)
    print(f"\n{'mutant':<{width}}  {'verdict':<12}  {'time':>5}  bug")
    for name, verdict, seconds, bug in rows:
        print(f"{name:<{width}}  {verdict:<12}  {seconds:>4.0f}s  {bug}")
    caught = sum(r[1].startswith("CAUGHT") for r in rows)
    print(f"\ncaught {caught}/{len(rows)} in {time.monotonic() - started:.0f} s")
    if args.keep or caught != len(rows):
        print(f"logs kept in {logs}")
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
