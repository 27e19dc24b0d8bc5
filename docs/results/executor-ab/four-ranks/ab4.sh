#!/usr/bin/env bash
# Alternating A/B of run_schedules.sh's 4-rank rows: BEFORE = a checkout of
# 4f184eb (the last commit before the executor) built in place
# (python setup.py build_ext --inplace), AFTER = this checkout. The runs both
# builds have; each build runs its own train_bench.py. Needs root (netlab).
#   BEFORE=/path/to/4f184eb bash ab4.sh; python benchmarks/ab_summary.py OUT
set -uo pipefail
export MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=1073741824
after=$(cd "$(dirname "$0")/../../../.." && pwd)
before=${BEFORE:?a built checkout of 4f184eb}
py=${PY:-$after/.venv/bin/python}
out=${OUT:-$after/docs/results/executor-ab/four-ranks}
mkdir -p "$out"
row() {  # build rep name args...
  local build=$1 rep=$2 name=$3; shift 3
  local dir=$after; [[ $build == before ]] && dir=$before
  local f="$out/$name-$build-$rep"
  echo "### $(date +%T) $build $rep $name"
  (cd "$dir" && PYTHONPATH=$dir $py benchmarks/netlab.py --ranks 4 --rate 1gbit -- benchmarks/train_bench.py "$@" \
     --iters 3 --rounds 2 --json "$f.json" 2>&1 | grep -v "^W1\|socket.cpp\|it/s\]" > "$f.txt")
  uptime >> "$f.txt"
}
pass() {
  local b=$1 r=$2
  row $b $r mlp-1gbit-4a --model mlp --batch 128 --runs ddp wfbp wfbp/p4 dear-sharded dear-sharded/p4 dear-replicated dear-replicated/p4
  row $b $r mlp-1gbit-4b --model mlp --batch 128 --runs ddp bytescheduler bytescheduler/p4/c1 bytescheduler/p4/c4 bytescheduler/p4/c64
  row $b $r widein-1gbit-4 --model widein --batch 128 --runs ddp wfbp wfbp/p4 dear-sharded dear-sharded/p4 dear-replicated dear-replicated/p4 bytescheduler bytescheduler/p4/c1 bytescheduler/p4/c4 bytescheduler/p4/c64
  row $b $r gpt-1gbit-4 --model gpt --batch 8 --runs ddp wfbp wfbp/p4 dear-sharded dear-sharded/p4 dear-replicated dear-replicated/p4 bytescheduler bytescheduler/p4
  row $b $r resnet-1gbit-4 --model resnet --batch 32 --runs ddp wfbp wfbp/p0.25 dear-sharded dear-sharded/p0.25 dear-replicated dear-replicated/p0.25 bytescheduler bytescheduler/p0.25
}
for r in ${REPS:-1 2 3}; do
  if (( r % 2 )); then pass before $r; pass after $r; else pass after $r; pass before $r; fi
done
echo "### $(date +%T) all done"
