#!/usr/bin/env bash
# Every benchmark of docs/benchmarks.md, into results/ (tables .txt, numbers
# .json, timelines .png/.json). The emulated-network runs need root.
#   bash benchmarks/run_all.sh            # ~40 min on 2 cores
set -euo pipefail
cd "$(dirname "$0")/.."
out=results
mkdir -p "$out"
py=.venv/bin/python
run() { local name=$1; shift; echo "### $name: $*"; "$@" 2>&1 | grep -v "^W1\|socket.cpp\|it/s\]" | tee "$out/$name.txt"; }

run overhead .venv/bin/torchrun --nproc_per_node=2 benchmarks/overhead.py --json $out/overhead.json
run collectives-loopback .venv/bin/torchrun --nproc_per_node=2 benchmarks/collectives.py --dtypes fp32 --max-bytes 67108864 --json $out/collectives-loopback.json
run fusion-loopback .venv/bin/torchrun --nproc_per_node=2 benchmarks/collectives.py --fusion 200x4-64KiB --json $out/fusion-loopback.json
run grad-views .venv/bin/torchrun --nproc_per_node=2 benchmarks/grad_views.py --rounds 6 --json $out/grad-views.json
run collectives-1gbit $py benchmarks/netlab.py --ranks 2 --rate 1gbit -- benchmarks/collectives.py --dtypes fp32 --min-bytes 1048576 --max-bytes 67108864 --json $out/collectives-1gbit.json
# Per-rank batches: mlp 256 puts C/T_bwd near DeAR's sweet spot at 1 Gbit/s; resnet and gpt are
# compute-bound here (one core per rank), gpt at batch 8 (x 64 tokens) to keep the run short.
declare -A batch=([mlp]=256 [resnet]=256 [gpt]=8) loopback_batch=([mlp]=64 [resnet]=64 [gpt]=8)
for model in mlp resnet gpt; do
  run train-$model-loopback-2 .venv/bin/torchrun --nproc_per_node=2 benchmarks/train_bench.py --model $model --batch ${loopback_batch[$model]} --json $out/train-$model-loopback-2.json
  run train-$model-1gbit-2 $py benchmarks/netlab.py --ranks 2 --rate 1gbit -- benchmarks/train_bench.py --model $model --batch ${batch[$model]} --iters 3 --rounds 2 --timeline $out/timeline-$model-1gbit-2 --json $out/train-$model-1gbit-2.json
done
run train-mlp-1gbit-4 $py benchmarks/netlab.py --ranks 4 --rate 1gbit -- benchmarks/train_bench.py --model mlp --batch 128 --iters 3 --rounds 2 --json $out/train-mlp-1gbit-4.json
run train-mlp-10gbit-2 $py benchmarks/netlab.py --ranks 2 --rate 10gbit -- benchmarks/train_bench.py --model mlp --batch 256 --iters 3 --rounds 2 --json $out/train-mlp-10gbit-2.json
# Every schedule (with partitions and bytescheduler credits) side by side, 1 Gbit/s, 2 and 4 ranks.
bash benchmarks/run_schedules.sh $out/schedules
run soak .venv/bin/torchrun --nproc_per_node=2 benchmarks/soak.py --steps 1000 --json $out/soak.json
# Simulated: every schedule at 8-128 ranks; the pipeline planner against its baselines and the
# exhaustive optimum. Measured: the pipeline runtime under netlab against the simulator's models
# (contention factors measured in each run; the transfer-CPU model with docs/benchmarks.md's calibration).
run at-scale $py benchmarks/at_scale.py --out $out/at-scale
run pipeline-plans $py benchmarks/pipeline_bench.py plans --quick --out $out/pipeline
run pipeline-optimality $py benchmarks/pipeline_bench.py optimality --out $out/pipeline
for rates in 1gbit,1gbit,500mbit 200mbit,200mbit,100mbit; do
  cpu=$([ $rates = 1gbit,1gbit,500mbit ] && echo 0.000,8.024,0.215,6.781 || echo 1.206,4.284,6.478,9.473)
  run pipeline-netlab-$rates $py benchmarks/pipeline_bench.py netlab --rates $rates --blocks 6 --steps 12 \
    --transfer-cpu $cpu --host-cores 2 --out $out/pipeline
done
