#!/usr/bin/env bash
# zp_demo killed with SIGKILL in the middle of training (possibly inside a save) resumes from its
# last complete checkpoint at another rank count, stage and backend, and finishes. Killed once
# on the threads backend and, given mpiexec, once as a 2-process MPI job (every process killed).
#   demo_resume.sh <zp_demo> <work dir> [mpiexec]
set -euo pipefail
# shellcheck source=kill_helpers.sh
source "$(dirname "$0")/kill_helpers.sh"
demo=$1 work=$2 mpiexec=${3:-}
steps=150

# kill_and_resume <name> <command that starts the first run...>
kill_and_resume() {
  local name=$1
  shift
  local dir=$work/demo-resume-$name
  rm -rf "$dir"
  mkdir -p "$dir"
  "$@" --steps $steps --micro-batch 8 --save-every 3 --log-every 50 --stage 2 --checkpoint-dir "$dir/ckpt" \
    > "$dir/first.log" 2>&1 &
  local pid=$!
  # Kill it once a few checkpoints exist, at a moment unrelated to its saves.
  for _ in $(seq 600); do
    [ -f "$dir/ckpt/latest" ] && [ "$(ls -d "$dir"/ckpt/step* 2>/dev/null | wc -l)" -ge 3 ] && break
    sleep 0.05
  done
  sleep 0.0$((RANDOM % 10))
  kill -0 "$pid" 2>/dev/null || { echo "zp_demo ($name) ended before it could be killed"; cat "$dir/first.log"; exit 1; }
  kill_naming "--checkpoint-dir $dir/ckpt"  # every process of the run
  wait "$pid" 2>/dev/null || true
  local latest
  latest=$(cat "$dir/ckpt/latest")
  echo "$name: killed; latest checkpoint: $latest"
  "$demo" --steps $steps --micro-batch 8 --log-every 100 --ranks 3 --stage 3 --checkpoint-dir "$dir/ckpt" --resume \
    --export "$dir/export" | tee "$dir/second.log"
  grep -q "resumed from $dir/ckpt/$latest at step ${latest#step}" "$dir/second.log"
  grep -Eq "summary: loss [0-9.]+ -> [0-9.]+ in $((steps - ${latest#step})) steps" "$dir/second.log"
  test -s "$dir/export/model.safetensors"
  rm -rf "$dir"
  echo "$name: resume after kill -9: ok"
}

kill_and_resume threads "$demo" --ranks 2
if [ -n "$mpiexec" ]; then
  kill_and_resume mpi "$mpiexec" -n 2 --oversubscribe "$demo" --backend mpi
fi

# A checkpoint at or past --steps: said, nothing trained. Checkpoints without a `latest` naming
# one: refused before training (a start from step 0 would fail at its first save of their tags).
dir=$work/demo-resume-edges
rm -rf "$dir" && mkdir -p "$dir"
"$demo" --ranks 2 --steps 10 --micro-batch 4 --log-every 100 --save-every 10 \
  --checkpoint-dir "$dir/ckpt" > "$dir/first.log"
"$demo" --ranks 2 --steps 5 --micro-batch 4 --checkpoint-dir "$dir/ckpt" --resume > "$dir/past.log"
grep -q "zp_demo: the checkpoint is at step 10, not before --steps 5: nothing to train" \
  "$dir/past.log"
if grep -q "summary:" "$dir/past.log"; then echo "trained past the checkpoint's step"; exit 1; fi
mkdir "$dir/copy" && cp -r "$dir/ckpt/step10" "$dir/copy/"
if "$demo" --ranks 2 --steps 20 --micro-batch 4 --checkpoint-dir "$dir/copy" --resume \
  --save-every 5 > "$dir/copy.log" 2>&1; then
  echo "resumed from step 0 beside a checkpoint that latest does not name"; exit 1
fi
grep -qF -- "--resume: $dir/copy holds checkpoints (step10) but no \`latest\` naming one" \
  "$dir/copy.log"
rm -rf "$dir"
echo "a checkpoint past --steps said; checkpoints without latest refused"
