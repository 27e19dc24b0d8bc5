#!/usr/bin/env bash
# On a machine with NVIDIA GPUs: build with the CUDA part required, run every
# GPU test and the NCCL microbenchmarks, and write everything to one file.
#
#   bash scripts/gpu_check.sh [results/gpu-check.txt]
# Exit status: non-zero if the build, a test or a benchmark's check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/gpu-check.txt}
mkdir -p "$(dirname "$out")"
status=0
step() {
  echo; echo "### $*"
  "$@" || { echo "### FAILED ($?): $*"; status=1; }
}
exec > >(tee "$out") 2>&1  # everything below also goes to $out
echo "# dearcomm GPU check, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null)"
step nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
rm -f .venv/.dearcomm-built  # rebuild: the CUDA part is required here
step env DEARCOMM_CUDA=1 make build
step .venv/bin/python -c 'import torch, dearcomm; print("torch", torch.__version__, "CUDA", torch.version.cuda, "| dearcomm", dearcomm.build_info())'
gpus=$(.venv/bin/python -c 'import torch; print(torch.cuda.device_count())')
echo "GPUs visible: $gpus"
# One GPU runs everything at world size 1; tests that need two GPUs say so and skip.
step .venv/bin/python -m pytest -m gpu -v -rs --durations=10 tests
step .venv/bin/torchrun --nproc_per_node="$gpus" benchmarks/collectives.py --backend nccl --dtypes fp32 bf16
step .venv/bin/torchrun --nproc_per_node="$gpus" benchmarks/collectives.py --backend nccl --fusion 200x4-64KiB
echo; echo "### overall: $([ $status = 0 ] && echo PASSED || echo FAILED)"
exit $status
