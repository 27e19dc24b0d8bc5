#!/usr/bin/env bash
# On a machine with NVIDIA GPUs: build with the CUDA part required, run every
# GPU test and the NCCL microbenchmarks, and write everything to one file.
#
#   bash scripts/gpu_check.sh [results/gpu-check.txt]
#   PY=python3 bash scripts/gpu_check.sh ...   use that python (torch installed) and build in place
# Exit status: non-zero if the build, a test or a benchmark's check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/gpu-check.txt}
mkdir -p "$(dirname "$out")"
status=0
began=$(date +%s)
# Runs a step under a time limit (STEP_LIMIT seconds, default 300), so one hang
# costs one step, not the machine's whole lease; says how long each took.
step() {
  echo; echo "### $*"
  local t0=$(date +%s) rc=0
  timeout -k 10 "${STEP_LIMIT:-300}" "$@" || rc=$?
  echo "### $([ $rc = 0 ] && echo ok || echo "FAILED ($rc$([ $rc = 124 ] && echo ', timed out'))") in $(( $(date +%s) - t0 )) s (at $(( $(date +%s) - began )) s): $*"
  [ $rc = 0 ] || status=1
}
exec > >(tee "$out") 2>&1  # everything below also goes to $out
echo "# dearcomm GPU check, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null)"
step nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
# The project's .venv where make can make one; otherwise (a GPU machine with no
# network, torch preinstalled) the python that holds torch, building in place.
if [ -n "${PY:-}" ]; then
  # The GPU image's CC/CXX (/opt/gcc) built an extension that carried its own
  # copy of libstdc++'s stream code and crashed formatting the first number of
  # an error message; the system compiler links the libstdc++ torch uses.
  if [ -x /usr/bin/g++ ] && [ -x /usr/bin/gcc ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi
  STEP_LIMIT=900 step env DEARCOMM_CUDA=1 MAX_JOBS="$(nproc)" "$PY" setup.py -q build_ext --inplace
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # torchrun's workers import the in-place build
else
  PY=.venv/bin/python
  rm -f .venv/.dearcomm-built  # rebuild: the CUDA part is required here
  STEP_LIMIT=900 step env DEARCOMM_CUDA=1 make build
fi
step "$PY" -c 'import torch, dearcomm; print("torch", torch.__version__, "CUDA", torch.version.cuda, "| dearcomm", dearcomm.build_info())'
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
echo "GPUs visible: $gpus"
# The benchmarks first: short, and what a lease is mostly for.
step "$PY" -m torch.distributed.run --nproc_per_node="$gpus" benchmarks/collectives.py --backend nccl --dtypes fp32 bf16
step "$PY" -m torch.distributed.run --nproc_per_node="$gpus" benchmarks/collectives.py --backend nccl --fusion 200x4-64KiB
step "$PY" -m torch.distributed.run --nproc_per_node="$gpus" benchmarks/gpu_overlap.py
# One GPU runs everything at world size 1; tests that need two GPUs say so and skip.
# One pytest per file: a crash in one (a segfault kills pytest) hides no other file's results.
files=$(grep -l "requires_gpu\|mark.gpu" tests/test_*.py)
[ -n "$files" ] || { echo "### FAILED: no GPU test files found"; status=1; }
for file in $files; do
  step "$PY" -m pytest -m gpu -v -rs --durations=10 "$file"
done
echo; echo "### overall: $([ $status = 0 ] && echo PASSED || echo FAILED)"
exit $status
