#!/bin/bash
# Runs timed twice in one row (X and X/again, interleaved, 8 rounds): the
# runs that missed 10% or auto's 5% in the last every-row run, beside a
# second timing of the same configuration.
#   bash docs/results/schedules/timed-twice/run.sh [rows] [auto] [loopback]   # default: all three
set -uo pipefail
cd "$(dirname "$0")/../../../.."
out=docs/results/schedules/timed-twice
export MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=1073741824
twice() { for r in "$@"; do printf '%s %s/again ' "$r" "$r"; done; }
timed() {  # timed NAME LAUNCHER... -- TRAIN_BENCH_ARGS...
  local name=$1; shift
  echo "### $name"; uptime
  "$@" --iters 3 --rounds 8 --json "$out/$name.json" 2>&1 | grep -v "^W1\|socket.cpp\|it/s\]" | tee "$out/$name.txt"
  uptime | tee -a "$out/$name.txt"
}
net() { local ranks=$1 name=$2; shift 2
  timed "$name" .venv/bin/python benchmarks/netlab.py --ranks "$ranks" --rate 1gbit -- benchmarks/train_bench.py "$@"; }
loop() { local name=$1; shift
  timed "$name" .venv/bin/torchrun --standalone --nproc_per_node=2 benchmarks/train_bench.py "$@"; }
parts=${*:-rows auto loopback}
if [[ " $parts " == *" rows "* ]]; then
  net 2 resnet-1gbit-2 --model resnet --batch 32 --runs $(twice ddp wfbp dear-sharded dear-sharded/p0.25 dear-replicated/p0.25 bytescheduler/p0.25)
  net 2 widein-b1024-1gbit-2 --model widein --batch 1024 --runs $(twice ddp wfbp/p4 dear-sharded/p4 dear-replicated/p4 bytescheduler/p4 usbyte)
  net 4 widein-1gbit-4 --model widein --batch 128 --runs $(twice ddp dear-sharded/p4 deft)
fi
if [[ " $parts " == *" auto "* ]]; then
  # auto-widein-*: the same two rows timed with the code before auto's confirmation took the prediction's size.
  net 2 auto-rule-widein-b1024-1gbit-2 --model widein --batch 1024 --runs $(twice ddp dear-sharded/p4 auto)
  net 4 auto-rule-widein-1gbit-4 --model widein --batch 128 --runs $(twice ddp dear-sharded/p4 auto)
fi
if [[ " $parts " == *" loopback "* ]]; then
  loop resnet-loopback-2 --model resnet --batch 32 --runs $(twice ddp dear-sharded dear-sharded/p0.25 bytescheduler/p0.25 deft)
  loop gpt-loopback-2 --model gpt --batch 8 --runs $(twice ddp dear-sharded dear-sharded/p4 deft)
fi
