#!/usr/bin/env bash
# zp_gpt on a dp 2 x tp 2 x pp 2 grid, saving a checkpoint every step, is killed with SIGKILL at
# random moments; each restart resumes from `latest` on the next grid of a cycle (2 x 2 x 2,
# 2 data-parallel ranks at stage 3, tp 4 at stage 1, 1 x 2 x 2 at stage 0), so every checkpoint
# is loaded by another grid than the one that saved it. Whatever the moments, every restart must
# start and the run must finish at the last step with the loss lower than where it began.
#   gpt_kill_loop.sh <zp_gpt> <work dir> [kills (default 12)]
set -euo pipefail
gpt=$1 work=$2/gpt-kill-loop kills=${3:-12}
rm -rf "$work"
mkdir -p "$work"
steps=600
args=(--layers 2 --d-model 32 --heads 4 --context 16 --micro-batch 4 --log-every 1
  --steps "$steps" --save-every 1 --checkpoint-dir "$work/ckpt" --resume)
grids=("--ranks 8 --tp 2 --pp 2 --stage 2" "--ranks 2 --stage 3" "--ranks 4 --tp 4 --stage 1"
  "--ranks 4 --tp 2 --pp 2 --stage 0")

killed=0 runs=0
while :; do
  # shellcheck disable=SC2206  # the grid's flags split into words on purpose
  grid=(${grids[$((runs % ${#grids[@]}))]})
  runs=$((runs + 1))
  "$gpt" "${args[@]}" "${grid[@]}" > "$work/run.log" 2>&1 &
  pid=$!
  if [ "$killed" -lt "$kills" ]; then
    sleep "0.$(printf '%03d' $((RANDOM % 1000)))"
    kill -9 "$pid" 2>/dev/null || true
  fi
  rc=0
  { wait "$pid"; } 2>/dev/null || rc=$?
  cat "$work/run.log" >> "$work/all.log"
  if [ "$rc" -eq 137 ]; then
    killed=$((killed + 1))
  elif [ "$rc" -eq 0 ]; then
    [ "$(cat "$work/ckpt/latest")" = "step$steps" ] && break
  else
    echo "restart $runs (grid: ${grid[*]}, after $killed kills) failed with exit code $rc:"
    cat "$work/run.log"
    exit 1
  fi
  if [ -f "$work/ckpt/latest" ]; then  # retention: tags older than `latest` go
    latest=$(cat "$work/ckpt/latest")
    for d in "$work"/ckpt/step*; do
      [ -d "$d" ] && [ "${d##*/step}" -lt "${latest#step}" ] && rm -rf "$d"
    done
  fi
done
grep -q "summary" "$work/run.log" || { cat "$work/run.log"; exit 1; }
[ "$killed" -ge 3 ] || { echo "only $killed kills landed: lengthen the run"; exit 1; }
# It learned across the grids: the last step's loss (the global batch's mean) below the first's.
loss_at() { grep -E "^step +$1 +loss" "$work/all.log" | tail -1 | awk '{print $4}'; }
first=$(loss_at 1) last=$(loss_at "$steps")
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 0.2) }' ||
  { echo "loss $first at step 1, $last at step $steps: it did not learn"; exit 1; }
echo "killed $killed times at random moments, restarted $runs times on a cycle of 4 grids:" \
  "finished at step $steps, loss $first -> $last"
rm -rf "$work"
