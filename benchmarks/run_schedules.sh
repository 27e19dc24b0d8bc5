#!/usr/bin/env bash
# Every schedule side by side (ddp, wfbp, dear-sharded, dear-replicated,
# bytescheduler; each dearcomm one with and without partitioning; bytescheduler
# at several credits on the MLPs) at an emulated 1 Gbit/s, 2 and 4 ranks, plus
# the same models on loopback and the loopback overhead. Needs root (netlab). Results in docs/benchmarks.md,
# "Schedules side by side at 1 Gbit/s".
#   bash benchmarks/run_schedules.sh [OUT]      # OUT default results/schedules
#   ROUNDS=8 NO_TIMELINE=1 bash ...             # the prediction check (~2 hours: ~95 min netlab, 20 loopback): see below
# Each run is timed over ROUNDS (default 2) rounds of ITERS (3) iterations,
# interleaved with the row's other runs. Over 2 rounds the same schedule in two
# runs of a row (ddp, wfbp) measured up to 12% apart, over 8 within 1.7% on 8
# of 9 rows: check predictions against 8 (docs/benchmarks.md, "Predicted
# against measured").
#   ONLY="mlp-1gbit-4a overhead" bash benchmarks/run_schedules.sh     # some of them
#   ONLY="mlp-1gbit-2 widein-1gbit-2" ROUNDS=6 ITERS=2 SUFFIX=-rep2 NO_TIMELINE=1 bash ...  # a repeat, more rounds
#   GLIBC_MALLOC=default bash ...     # keep glibc's own trimming (see below)
# Every run shares its process with the others, and glibc's heap, by default,
# gives freed memory back to the kernel wherever its top happens to land: a
# run's page faults then depend on which runs share the process (4 ranks of
# ResNet: DDP 9.6-18.7k faults per iteration, more alone than beside
# dearcomm; with a fixed policy DDP and dearcomm take the same). So the
# runs here keep what they free, as torch's CPU launcher does by preloading
# tcmalloc or jemalloc (docs/benchmarks.md, "Findings: ResNet at 4 ranks").
set -euo pipefail
if [[ ${GLIBC_MALLOC:-fixed} != default ]]; then
  export MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=1073741824
fi
cd "$(dirname "$0")/.."
out=${1:-results/schedules}
py=${PY:-.venv/bin/python}
torchrun=${TORCHRUN:-.venv/bin/torchrun}
mkdir -p "$out"
run() { local name=$1; shift; echo "### $name: $*"; uptime; "$@" 2>&1 | grep -v "^W1\|socket.cpp\|it/s\]" | tee "$out/$name.txt"; uptime | tee -a "$out/$name.txt"; }
want() { [[ -z "${ONLY:-}" || " $ONLY " == *" $1 "* ]]; }
net() {
  local ranks=$1 name=$2 a=(); shift 2; want "$name" || return 0; name=$name${SUFFIX:-}
  while (($#)); do if [[ $1 == --timeline && -n ${NO_TIMELINE:-} ]]; then shift 2; else a+=("$1"); shift; fi; done
  run "$name" $py benchmarks/netlab.py --ranks "$ranks" --rate 1gbit -- benchmarks/train_bench.py "${a[@]}" \
    --iters ${ITERS:-3} --rounds ${ROUNDS:-2} --json "$out/$name.json"
}

all="--partition-mb 4 --credit-mb 1 4 64"
# Communication-bound: mlp (C/T_bwd 2-4), widein (16 MiB first layer, 67% of parameters, batch 128).
net 2 mlp-1gbit-2 --model mlp --batch 256 $all --timeline "$out/timeline-mlp-1gbit-2"
net 2 widein-1gbit-2 --model widein --batch 128 $all --timeline "$out/timeline-widein-1gbit-2"
# 4 ranks x 11 models of 64 MiB (with AdamW state) do not fit in 24 GiB: two runs, ddp in each.
net 4 mlp-1gbit-4a --model mlp --batch 128 --runs ddp wfbp wfbp/p4 dear-sharded dear-sharded/p4 dear-replicated dear-replicated/p4
net 4 mlp-1gbit-4b --model mlp --batch 128 --runs ddp bytescheduler bytescheduler/p4/c1 bytescheduler/p4/c4 bytescheduler/p4/c64 auto dear-bo
net 4 widein-1gbit-4 --model widein --batch 128 $all
# gpt: C/T_bwd ~1 at 2 ranks; its largest tensor (the tied 8 MiB embedding) splits at 4 MiB.
net 2 gpt-1gbit-2 --model gpt --batch 8 --partition-mb 4 --timeline "$out/timeline-gpt-1gbit-2"
net 4 gpt-1gbit-4 --model gpt --batch 8 --partition-mb 4
# Compute-bound: resnet (0.7 M parameters; its largest tensor is 0.56 MiB, so partition at 0.25), widein at batch 1024.
net 2 resnet-1gbit-2 --model resnet --batch 32 --partition-mb 0.25 --timeline "$out/timeline-resnet-1gbit-2"
net 4 resnet-1gbit-4 --model resnet --batch 32 --partition-mb 0.25
net 2 widein-b1024-1gbit-2 --model widein --batch 1024 --partition-mb 4
# Loopback, 2 ranks (no emulated link): the prediction check where the cores, not the link, are shared.
loop() {
  local name=$1; shift; want "$name" || return 0; name=$name${SUFFIX:-}
  run "$name" $torchrun --standalone --nproc_per_node=2 benchmarks/train_bench.py "$@" \
    --iters ${ITERS:-3} --rounds ${ROUNDS:-2} --json "$out/$name.json"
}
loop mlp-loopback-2 --model mlp --batch 256 --partition-mb 4
loop widein-loopback-2 --model widein --batch 128 --partition-mb 4
loop gpt-loopback-2 --model gpt --batch 8 --partition-mb 4
loop resnet-loopback-2 --model resnet --batch 32 --partition-mb 0.25
# Loopback, 4 ranks on the 2 cores: the same rows as at 1 Gbit/s, 4 ranks (the MLP split in two to fit memory).
loop4() {
  local name=$1; shift; want "$name" || return 0; name=$name${SUFFIX:-}
  run "$name" $torchrun --standalone --nproc_per_node=4 benchmarks/train_bench.py "$@" \
    --iters ${ITERS:-3} --rounds ${ROUNDS:-2} --json "$out/$name.json"
}
loop4 mlp-loopback-4a --model mlp --batch 128 --runs ddp wfbp wfbp/p4 dear-sharded dear-sharded/p4 dear-replicated dear-replicated/p4
loop4 mlp-loopback-4b --model mlp --batch 128 --runs ddp bytescheduler bytescheduler/p4/c1 bytescheduler/p4/c4 bytescheduler/p4/c64 auto dear-bo
loop4 widein-loopback-4 --model widein --batch 128 --partition-mb 4
loop4 gpt-loopback-4 --model gpt --batch 8 --partition-mb 4
loop4 resnet-loopback-4 --model resnet --batch 32 --partition-mb 0.25
# Engine overhead on loopback, compute-bound (target <= 1.05x DDP), bytescheduler included.
if want overhead; then run overhead $torchrun --nproc_per_node=2 benchmarks/overhead.py --json "$out/overhead.json"; fi
