#!/usr/bin/env bash
# zp_demo killed with SIGKILL in the middle of training (possibly inside a save) resumes from its
# last complete checkpoint at another rank count and stage, and finishes.
#   demo_resume.sh <zp_demo> <work dir>
set -euo pipefail
demo=$1
dir=$2/demo-resume
rm -rf "$dir"
mkdir -p "$dir"
"$demo" --steps 150 --micro-batch 8 --save-every 3 --log-every 50 --ranks 2 --stage 2 --checkpoint-dir "$dir/ckpt" > "$dir/first.log" 2>&1 &
pid=$!
# Kill it once a few checkpoints exist, at a moment unrelated to its saves.
for _ in $(seq 600); do
  [ -f "$dir/ckpt/latest" ] && [ "$(ls -d "$dir"/ckpt/step* 2>/dev/null | wc -l)" -ge 3 ] && break
  sleep 0.05
done
sleep 0.0$((RANDOM % 10))
kill -9 "$pid" 2>/dev/null || { echo "zp_demo ended before it could be killed"; cat "$dir/first.log"; exit 1; }
wait "$pid" 2>/dev/null || true
latest=$(cat "$dir/ckpt/latest")
echo "killed; latest checkpoint: $latest"
"$demo" --steps 150 --micro-batch 8 --log-every 100 --ranks 3 --stage 3 --checkpoint-dir "$dir/ckpt" --resume \
  --export "$dir/export" | tee "$dir/second.log"
grep -q "resumed from $dir/ckpt/$latest at step ${latest#step}" "$dir/second.log"
grep -Eq "summary: loss [0-9.]+ -> [0-9.]+ in $((150 - ${latest#step})) steps" "$dir/second.log"
test -s "$dir/export/model.safetensors"
rm -rf "$dir"
echo "resume after kill -9: ok"
