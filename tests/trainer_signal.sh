#!/usr/bin/env bash
# SIGTERM or SIGINT stops a trainer after the step in flight: its ranks agree on the step, save it
# into --checkpoint-dir and exit with 128 + the signal's number, exporting nothing; the same
# command line with --resume then finishes, and its model equals, bit for bit, that of a run never
# stopped. zp_demo on 2 thread ranks (SIGTERM), zp_gpt on a dp 2 x pp 2 grid of threads (SIGINT),
# the device demo on 2 ranks of the simulated device (SIGTERM) and, given mpiexec, zp_demo as 2
# MPI processes with SIGTERM sent to one of them only. The device demo's checkpoints are
# zp_demo's: each resumes the other's last one at other ranks and another stage.
#   trainer_signal.sh <zp_demo> <zp_gpt> <zp_demo_sim> <work dir> [mpiexec]
set -euo pipefail
demo=$1 gpt=$2 sim=$3 work=$4/trainer-signal mpiexec=${5:-}
rm -rf "$work"

# stop_and_resume <name> <signal> <whom: run | one-rank> <steps> <command...>
stop_and_resume() {
  local name=$1 sig=$2 whom=$3 steps=$4
  shift 4
  local dir=$work/$name
  mkdir -p "$dir"
  "$@" --steps "$steps" --export "$dir/straight" > "$dir/straight.log" 2>&1 ||
    { cat "$dir/straight.log"; exit 1; }
  local cmd=("$@" --steps "$steps" --save-every 10 --checkpoint-dir "$dir/ckpt" --resume
    --export "$dir/stopped")
  "${cmd[@]}" > "$dir/first.log" 2>&1 &
  local pid=$! target
  # The first checkpoint exists, so the handlers are in place and most steps are still to come.
  for _ in $(seq 1200); do
    [ -f "$dir/ckpt/latest" ] && break
    sleep 0.05
  done
  target=$pid
  # One MPI process, not mpiexec: the ranks must learn it from each other.
  [ "$whom" = one-rank ] && target=$(pgrep -P "$pid" | head -n 1)
  kill "-$sig" "$target"
  local rc=0
  wait "$pid" || rc=$?
  local step
  step=$(sed -n "s/.*: SIG$sig: stopped after step \([0-9]*\); saved .*/\1/p" "$dir/first.log")
  if [ -z "$step" ] || [ "$step" -ge "$steps" ]; then
    echo "$name: no stop before step $steps (exit code $rc):"; cat "$dir/first.log"; exit 1
  fi
  if [ "$whom" = run ] && [ "$rc" -ne $((128 + $(kill -l "$sig"))) ]; then
    echo "$name: exit code $rc, not 128 + SIG$sig's number"; cat "$dir/first.log"; exit 1
  fi
  [ "$whom" = run ] || [ "$rc" -ne 0 ] || { echo "$name: exit code 0 after a stop"; exit 1; }
  [ "$(cat "$dir/ckpt/latest")" = "step$step" ]
  [ ! -e "$dir/stopped" ] || { echo "$name: a stopped run exported its model"; exit 1; }
  "${cmd[@]}" > "$dir/second.log" 2>&1 || { cat "$dir/second.log"; exit 1; }
  grep -q "resumed from $dir/ckpt/step$step at step $step" "$dir/second.log"
  cmp "$dir/straight/model.safetensors" "$dir/stopped/model.safetensors"
  echo "$name: SIG$sig stopped the run after step $step of $steps (exit code $rc); resumed, bitwise equal to a run never stopped"
}

stop_and_resume demo TERM run 80 "$demo" --ranks 2 --stage 2 --micro-batch 4 --log-every 1000

# A second signal, of either kind, ends the process at once: SIGINT then SIGTERM kills it (no
# stop reported, nothing more saved), where the first alone would finish its step. Threads may
# take the two in either order, so the killing one is either.
dir=$work/twice
mkdir -p "$dir"
"$demo" --ranks 2 --steps 100000 --micro-batch 512 --log-every 1000 --save-every 10 \
  --checkpoint-dir "$dir/ckpt" > "$dir/log" 2>&1 &
pid=$!
for _ in $(seq 1200); do
  [ -f "$dir/ckpt/latest" ] && break
  sleep 0.05
done
kill -INT "$pid"
kill -TERM "$pid"
rc=0
wait "$pid" || rc=$?
if { [ "$rc" -ne 143 ] && [ "$rc" -ne 130 ]; } || grep -q "stopped after step" "$dir/log"; then
  echo "twice: SIGINT then SIGTERM did not end the run at once (exit code $rc):"; cat "$dir/log"
  exit 1
fi
echo "twice: SIGINT then SIGTERM ended the run at once (exit code $rc)"
stop_and_resume gpt INT run 60 "$gpt" --ranks 4 --pp 2 --stage 1 --layers 2 --d-model 32 \
  --heads 4 --context 16 --micro-batch 4 --log-every 1000
stop_and_resume sim TERM run 80 "$sim" --ranks 2 --stage 3 --micro-batch 4 --log-every 1000

# resume_in <name> <checkpoint dir> <trainer...>: 10 steps more from the checkpoint at step 80.
resume_in() {
  local name=$1 ckpt=$2
  shift 2
  "$@" --steps 90 --micro-batch 4 --log-every 1000 --checkpoint-dir "$ckpt" --resume \
    > "$work/$name.log" 2>&1 || { cat "$work/$name.log"; exit 1; }
  grep -q "resumed from $ckpt/step80 at step 80" "$work/$name.log"
  grep -Eq "summary: loss [0-9.]+ -> [0-9.]+ in 10 steps" "$work/$name.log"
  echo "$name: resumed at step 80, trained 10 steps"
}
resume_in sim-in-demo "$work/sim/ckpt" "$demo" --ranks 3 --stage 1
resume_in demo-in-sim "$work/demo/ckpt" "$sim" --ranks 1 --stage 0

if [ -n "$mpiexec" ]; then
  stop_and_resume mpi TERM one-rank 80 "$mpiexec" -n 2 --oversubscribe "$demo" --backend mpi \
    --stage 3 --micro-batch 4 --log-every 1000
fi
rm -rf "$work"
