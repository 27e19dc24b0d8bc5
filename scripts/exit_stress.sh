#!/usr/bin/env bash
# Runs a 2-rank job under torchrun N times and counts the runs that did not
# exit 0 (default job: tests/exit_worker.py --compare, a small model wrapped
# with dearcomm beside torch DDP, two GradScaler steps, no
# destroy_process_group()). Under torchrun (its output a pipe) that job aborted
# at exit in 8 of 100 runs before dearcomm/_exit.py; under tests/test_exit.py's
# own launcher it never did, so this is the measurement, not the suite.
#
#   bash scripts/exit_stress.sh 200
#   bash scripts/exit_stress.sh 100 --compare --schedule wfbp
#   PYTHONPATH=/other/checkout bash scripts/exit_stress.sh 100   # another dearcomm
set -uo pipefail
cd "$(dirname "$0")/.."
runs="${1:-100}"
shift || true
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--compare)
torchrun="${TORCHRUN:-$( [ -x .venv/bin/torchrun ] && echo .venv/bin/torchrun || echo torchrun )}"
log="$(mktemp -d)"
failed=0
for i in $(seq 1 "$runs"); do
  port=$(( 20000 + (RANDOM % 20000) ))
  if ! PYTHONPATH="${PYTHONPATH:-$PWD}" timeout 120 "$torchrun" --nproc_per_node=2 --master_port="$port" \
       tests/exit_worker.py "${args[@]}" > "$log/run$i.txt" 2>&1; then
    failed=$((failed + 1))
    echo "run $i failed: $(grep -m1 -E 'terminate called|exitcode|Error' "$log/run$i.txt")"
  else
    rm -f "$log/run$i.txt"
  fi
  printf '\r%d/%d runs, %d failed' "$i" "$runs" "$failed" >&2
done
echo >&2
echo "$failed of $runs runs did not exit 0 (logs of failed runs: $log)"
[ "$failed" -eq 0 ]
