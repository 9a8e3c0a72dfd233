#!/usr/bin/env bash
# zp_demo saving a checkpoint every step is killed with SIGKILL at random moments, again and
# again, each time restarted with the very same command line (--resume: from `latest`, or from
# step 0 when there is none yet). Whatever the moments, every restart must start, the run must
# finish, and its final model must equal, bit for bit, that of a run never killed; it keeps two
# checkpoints (--keep-checkpoints 2), so kills also land inside removals. With `nvme`,
# the killed runs keep their optimizer state on NVMe (--offload-optimizer nvme:DIR): each kill
# leaves a swap file behind, the next run removes it, and the model still equals the
# uninterrupted run's with its state in memory.
#   demo_kill_loop.sh <zp_demo> <work dir> [kills (default 30)] [nvme]
set -euo pipefail
demo=$1 work=$2/demo-kill-loop${4:+-$4} kills=${3:-30}
rm -rf "$work"
mkdir -p "$work"
offload=()
if [ "${4:-}" = nvme ]; then
  mkdir -p "$work/swap"
  offload=(--offload-optimizer "nvme:$work/swap")
fi
args=(--ranks 2 --stage 2 --steps 200 --micro-batch 4 --log-every 1000)
"$demo" "${args[@]}" --export "$work/straight" > "$work/straight.log"

cmd=("$demo" "${args[@]}" "${offload[@]}" --save-every 1 --keep-checkpoints 2
     --checkpoint-dir "$work/ckpt" --resume --export "$work/killed")
killed=0 runs=0 left=0
while :; do
  runs=$((runs + 1))
  "${cmd[@]}" > "$work/run.log" 2>&1 &
  pid=$!
  if [ "$killed" -lt "$kills" ]; then
    sleep "0.$(printf '%03d' $((RANDOM % 100)))"
    kill -9 "$pid" 2>/dev/null || true
  fi
  rc=0
  { wait "$pid"; } 2>/dev/null || rc=$?
  if [ "$rc" -eq 137 ]; then
    killed=$((killed + 1))
    [ ${#offload[@]} -gt 0 ] && left=$((left + $(ls "$work/swap" | wc -l)))
  elif [ "$rc" -eq 0 ]; then
    [ "$killed" -ge "$kills" ] && break
    echo "the run finished after only $killed kills; lower the step time or raise --steps"; exit 1
  else
    echo "restart $runs (after $killed kills) failed with exit code $rc:"; cat "$work/run.log"; exit 1
  fi
done
grep -q "summary" "$work/run.log" || { cat "$work/run.log"; exit 1; }
[ "$(cat "$work/ckpt/latest")" = step200 ]
# --keep-checkpoints 2, whatever the kills interrupted: the last two steps and nothing else.
kept=$(cd "$work/ckpt" && shopt -s dotglob && printf '%s ' *)
[ "$kept" = ".zp-save.lock latest step199 step200 " ] ||
  { echo "left in the checkpoint directory: $kept"; exit 1; }
cmp "$work/straight/model.safetensors" "$work/killed/model.safetensors"
if [ ${#offload[@]} -gt 0 ] && [ -n "$(ls "$work/swap")" ]; then
  echo "swap files outlived the job: $(ls "$work/swap")"; exit 1
fi
[ ${#offload[@]} -gt 0 ] && echo "the killed runs left swap files behind $left times; the next runs removed them"
echo "killed $killed times at random moments${4:+ (optimizer state on $4)}, restarted with the same command line $runs times: finished, bitwise equal to an uninterrupted run"
rm -rf "$work"
