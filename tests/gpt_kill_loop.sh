#!/usr/bin/env bash
# zp_gpt saving a checkpoint every step is killed with SIGKILL at random moments (every process
# of the run); each restart resumes from `latest` on the next grid of a cycle, at another stage,
# so every checkpoint is loaded by another grid than the one that saved it. Threads: a
# dp 2 x tp 2 x pp 2 grid, then 2 x 1 x 1, 1 x 4 x 1, 1 x 2 x 2; given mpiexec, a 4-process MPI
# job: 1 x 2 x 2, 4 x 1 x 1, 1 x 4 x 1, 2 x 1 x 2. Whatever the moments, every restart must start
# and the run must finish at the last step with the loss lower than where it began.
#   gpt_kill_loop.sh <zp_gpt> <work dir> [mpiexec]
set -euo pipefail
# shellcheck source=kill_helpers.sh
source "$(dirname "$0")/kill_helpers.sh"
gpt=$1 mpiexec=${3:-}
if [ -z "$mpiexec" ]; then
  work=$2/gpt-kill-loop kills=6 steps=600 launch=("$gpt")
  grids=("--ranks 8 --tp 2 --pp 2 --stage 2" "--ranks 2 --stage 3" "--ranks 4 --tp 4 --stage 1"
    "--ranks 4 --tp 2 --pp 2 --stage 0")
else
  # TCP between the processes: a killed job leaves no shared-memory segment behind.
  work=$2/gpt-kill-loop-mpi kills=4 steps=400
  launch=("$mpiexec" -n 4 --oversubscribe --mca btl self,tcp "$gpt" --backend mpi)
  grids=("--tp 2 --pp 2 --stage 2" "--stage 3" "--tp 4 --stage 1" "--pp 2 --stage 0")
fi
rm -rf "$work"
mkdir -p "$work"
args=(--layers 2 --d-model 32 --heads 4 --context 16 --micro-batch 4 --log-every 1
  --steps "$steps" --save-every 1 --keep-checkpoints 3 --checkpoint-dir "$work/ckpt" --resume)

killed=0 runs=0
while :; do
  # shellcheck disable=SC2206  # the grid's flags split into words on purpose
  grid=(${grids[$((runs % ${#grids[@]}))]})
  runs=$((runs + 1))
  "${launch[@]}" "${args[@]}" "${grid[@]}" > "$work/run.log" 2>&1 &
  pid=$!
  if [ "$killed" -lt "$kills" ]; then
    sleep "$((RANDOM % 2)).$(printf '%03d' $((RANDOM % 1000)))"
    kill_naming "--checkpoint-dir $work/ckpt"  # every process of the run
  fi
  rc=0
  { wait "$pid"; } 2>/dev/null || rc=$?
  cat "$work/run.log" >> "$work/all.log"
  if [ "$rc" -eq 0 ]; then
    [ "$(cat "$work/ckpt/latest")" = "step$steps" ] && break
  elif [ "$rc" -eq 137 ] || grep -q "signal 9" "$work/run.log"; then
    killed=$((killed + 1))  # (mpiexec, when its ranks are killed first, says so)
  else
    echo "restart $runs (grid: ${grid[*]}, after $killed kills) failed with exit code $rc:"
    cat "$work/run.log"
    exit 1
  fi
done
grep -q "summary" "$work/run.log" || { cat "$work/run.log"; exit 1; }
[ "$killed" -ge 3 ] || { echo "only $killed kills landed: lengthen the run"; exit 1; }
kept=$(cd "$work/ckpt" && shopt -s dotglob && printf '%s ' *)
[ "$kept" = ".zp-save.lock latest step$((steps - 2)) step$((steps - 1)) step$steps " ] ||
  { echo "left in the checkpoint directory (--keep-checkpoints 3): $kept"; exit 1; }
# It learned across the grids: the last step's loss (the global batch's mean) below the first's.
loss_at() { grep -E "^step +$1 +loss" "$work/all.log" | tail -1 | awk '{print $4}'; }
first=$(loss_at 1) last=$(loss_at "$steps")
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 0.2) }' ||
  { echo "loss $first at step 1, $last at step $steps: it did not learn"; exit 1; }
echo "killed $killed times at random moments, restarted $runs times on a cycle of 4 grids:" \
  "finished at step $steps, loss $first -> $last"
rm -rf "$work"
