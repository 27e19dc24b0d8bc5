#!/usr/bin/env bash
# Mutation check (not part of CI): plants each bug of scripts/mutants/*.patch
# in a scratch copy of HEAD, rebuilds the CPU extension where csrc/ changed,
# runs the tests that the patch's header names, and reports CAUGHT or MISSED.
# The unpatched tree must pass the same tests first. Exit status 0 only if
# every mutant is caught. The working tree is never modified.
#
#   bash scripts/mutants.sh                 # every mutant (about 20 minutes on 2 cores)
#   bash scripts/mutants.sh 07 13           # only these (number or name prefix)
#   bash scripts/mutants.sh --working-tree  # HEAD plus uncommitted changes
#   PYTHON=/path/to/python bash scripts/mutants.sh
#
# A new mutant: a `git diff` with two header lines before it,
#   # bug: what is wrong
#   # tests: pytest arguments that must fail with it (files or node ids)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
exec "$PYTHON" scripts/mutants.py --python "$PYTHON" "$@"
