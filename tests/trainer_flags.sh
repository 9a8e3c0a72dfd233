#!/usr/bin/env bash
# zp_demo's, zp_gpt's and the device demo's command lines: each mistake is refused before any
# training, with exit status 2 (1 for a file that cannot be read or a setting the engine
# refuses) and a message naming the flag and what was wrong; --help (-h) prints the usage and
# exits 0.
#   trainer_flags.sh <zp_demo> <zp_gpt> <zp_demo_sim> <work dir> [mpiexec]
set -euo pipefail
demo=$1 gpt=$2 sim=$3 dir=$4/trainer-flags mpiexec=${5:-}
rm -rf "$dir" && mkdir -p "$dir"
echo '{"zero_optimization": {"stage": 1}}' > "$dir/ds.json"
echo '{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4096}' > "$dir/accum.json"
echo '{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}}' > "$dir/stage1.json"

# refused <status> <message> <program> <flags...>: the run fails with that status and message.
refused() {
  local want=$1 msg=$2 prog=$3 rc=0
  shift 3
  timeout 60 "$prog" "$@" > "$dir/out.log" 2>&1 || rc=$?
  if [ "$rc" != "$want" ]; then
    echo "$(basename "$prog") $*: exit status $rc, expected $want"; cat "$dir/out.log"; exit 1
  fi
  if ! grep -qF -- "$msg" "$dir/out.log"; then
    echo "$(basename "$prog") $*: no '$msg' in:"; cat "$dir/out.log"; exit 1
  fi
  if grep -q "^step\|summary:" "$dir/out.log"; then
    echo "$(basename "$prog") $*: trained before refusing"; exit 1
  fi
}

: > "$dir/a-file"
for prog in "$demo" "$gpt" "$sim"; do
  # Found before the training, not by the first save or the export at its end.
  refused 2 "--checkpoint-dir $dir/a-file is not a directory" "$prog" --checkpoint-dir \
    "$dir/a-file" --save-every 5
  refused 2 "--checkpoint-dir $dir/a-file/ckpt: $dir/a-file, where it goes, is not a directory" \
    "$prog" --checkpoint-dir "$dir/a-file/ckpt" --resume
  refused 2 "--export $dir/a-file is not a directory" "$prog" --export "$dir/a-file"
  refused 2 "--export $dir/ck/../ck/latest is inside --checkpoint-dir $dir/ck, whose entries the saves manage" \
    "$prog" --checkpoint-dir "$dir/ck" --export "$dir/ck/../ck/latest"
  refused 2 "--micro-batch expects an integer in [1, 65536], got '10abc'" "$prog" --micro-batch 10abc
  refused 2 "--ranks expects an integer in [1, 256], got ' 2'" "$prog" --ranks " 2"
  refused 2 "--ranks expects an integer in [1, 256], got '+2'" "$prog" --ranks +2
  refused 2 "--stage is given twice" "$prog" --stage 1 --stage 3
  refused 2 "--offload-optimizer is given twice" "$prog" --offload-optimizer cpu --offload-optimizer none
  refused 2 "--export expects a value, got the flag '--resume'" "$prog" --export --resume
  refused 2 "--log-json expects a value, got an empty one" "$prog" --log-json ""
  refused 2 "unknown flag '--offload'" "$prog" --offload cpu  # --offload-optimizer's old alias
  refused 2 "--stage with --config: the config sets it (zero_optimization.stage)" \
    "$prog" --config "$dir/ds.json" --stage 2
  refused 2 "--offload-param with --config: the config sets it (zero_optimization.offload_param)" \
    "$prog" --config "$dir/ds.json" --offload-param cpu
  refused 1 "text file '$dir' is a directory, not a file" "$prog" --text "$dir"
  refused 1 "cannot read text file '/dev/zero': not a file or a pipe" "$prog" --text /dev/zero
  refused 1 "accum.json: a micro-batch of 4 x 4096 accumulation steps; $(basename "$prog") takes at most 65536 x 1024" \
    "$prog" --config "$dir/accum.json"
  refused 2 "--keep-checkpoints and --resume need --checkpoint-dir" "$prog" --keep-checkpoints 2
  refused 2 "--keep-checkpoints expects an integer in [0, 10000000], got '-1'" "$prog" --keep-checkpoints -1
  refused 2 "--precision expects fp32, bf16 or fp16, got 'fp8'" "$prog" --precision fp8
  refused 2 "--lr expects a number in (0, 1], got '2'" "$prog" --lr 2
  refused 2 "--lr expects a number in (0, 1], got '1e-50' (0 as a float)" "$prog" --lr 1e-50
  refused 2 "--ranks-per-node 2 needs --zero-quantized-gradients" "$prog" --ranks-per-node 2
  refused 2 "--ranks-per-node expects an integer in [0, 1048576], got '-1'" "$prog" --ranks-per-node -1
  refused 2 "--offload-optimizer expects none, cpu or nvme:DIR (a directory on the drive), got 'nvme:'" \
    "$prog" --offload-optimizer nvme:
  refused 2 "--init-seed expects an integer in [0, 2147483647], got '-1'" "$prog" --init-seed -1
  refused 1 "cannot open --log-json $dir/absent/log.json: No such file or directory" \
    "$prog" --log-json "$dir/absent/log.json" --steps 1
  "$prog" --help > "$dir/help.log"  # the usage on stdout, exit status 0, nothing trained
  grep -q "^usage: $(basename "$prog") \[options\]" "$dir/help.log"
  "$prog" --steps 5 -h > "$dir/help.log"
  grep -q "^usage: " "$dir/help.log"
  if grep -q "^step" "$dir/help.log"; then
    echo "$prog -h trained"
    exit 1
  fi
done
for prog in "$demo" "$gpt"; do
  refused 1 "shard_group_size 3 does not divide the 4 data-parallel ranks" \
    "$prog" --ranks 4 --stage 3 --shard-group-size 3
  refused 1 "hybrid sharding (shard_group_size 2) needs ZeRO stage 1, 2 or 3" \
    "$prog" --ranks 4 --stage 0 --shard-group-size 2
  set_by_config="the config sets it (zero_optimization.mics_shard_size)"
  refused 2 "--shard-group-size with --config: $set_by_config" \
    "$prog" --config "$dir/ds.json" --shard-group-size 2
  refused 1 "reshard_after_forward = false) needs ZeRO stage 3 (below it no parameters are gathered), got stage 2" \
    "$prog" --stage 2 --no-reshard-after-forward
  refused 1 "got stage 1" "$prog" --config "$dir/stage1.json" --no-reshard-after-forward
  refused 1 "--max-reuse-distance 5 needs ZeRO stage 3 (below it no parameters are gathered), got stage 2" \
    "$prog" --stage 2 --max-reuse-distance 5
  refused 2 "--max-reuse-distance expects an integer in [0, 2000000000], got '-1'" \
    "$prog" --max-reuse-distance -1
  refused 2 "--max-reuse-distance with --config: the config sets it (zero_optimization.stage3_max_reuse_distance)" \
    "$prog" --config "$dir/ds.json" --max-reuse-distance 0
done
refused 2 "--temperature without --sample N: nothing is sampled" "$gpt" --temperature 0.5
refused 2 "--eval-every without --eval PATH: nothing to evaluate" "$gpt" --eval-every 10
refused 2 "--decay expects all or matrices, got 'bias'" "$gpt" --decay bias
refused 2 "--temperature expects a number >= 0, got '-1'" "$gpt" --sample 5 --temperature -1
refused 2 "--top-k expects an integer in [0, 1048576], got 'x'" "$gpt" --sample 5 --top-k x
refused 2 "--seed expects an integer in [0, 2147483647], got '-3'" "$gpt" --sample 5 --seed -3
refused 2 "--schedule expects 1f1b or gpipe, got 'zb'" "$gpt" --schedule zb
refused 2 "--heads 3 does not divide --d-model 64" "$gpt" --heads 3
refused 2 "--tp 3 does not divide --heads 4" "$gpt" --tp 3
refused 2 "--pp 5 is more than the 4 modules of the model (--layers + 2)" "$gpt" --pp 5
refused 1 "zp_gpt: 3 ranks do not divide into --tp 2 x --pp 1" "$gpt" --ranks 3 --tp 2
refused 2 "--eval-every expects an integer in [1, 10000000], got '0'" "$gpt" --eval-every 0
refused 2 "--text and --tokens: train on a text or on token files, not both" \
  "$gpt" --text "$dir/ds.json" --tokens "$dir/ds.json"
refused 2 "--vocab without --tokens: a text's vocabulary is its characters" "$gpt" --vocab 300
refused 2 "--vocab expects an integer in [1, 65536], got '65537'" "$gpt" --vocab 65537
refused 2 "--sample with --tokens needs --prompt: the token ids to continue" \
  "$gpt" --tokens "$dir/ds.json" --sample 5
refused 1 "token file $dir/ds.json is 36 bytes, shorter than the 1024-byte header" \
  "$gpt" --tokens "$dir/ds.json"
# A checkpoint whose user data claims a step count no run reaches, sealed with valid checksums
# as a buggy or hostile writer would, is refused at --resume (2^31 trained from step -2^31 + 1
# and saved thousands of checkpoints; -3 saved step-2).
"$demo" --ranks 2 --steps 2 --micro-batch 2 --save-every 2 --checkpoint-dir "$dir/seal" > /dev/null
for bad in 2147483648 -3 1; do
  python3 "$(dirname "$0")/seal_user_step.py" "$dir/seal/step2" $bad
  refused 1 "the checkpoint $dir/seal/step2 says its run did $bad steps, not a count in [2 (the updates it applied), 2147483647]: its user data is corrupt" \
    "$demo" --ranks 2 --steps 4 --micro-batch 2 --checkpoint-dir "$dir/seal" --resume
done
# A run that would save a tag the directory holds is refused before it trains (the save failed
# after the training up to it): a new run in a used directory, a resume from an earlier step.
refused 1 "--checkpoint-dir $dir/seal already holds step2, which this run would save at step 2 (it starts at step 0)" \
  "$demo" --ranks 2 --steps 4 --micro-batch 2 --save-every 1 --checkpoint-dir "$dir/seal"
"$demo" --ranks 2 --steps 2 --micro-batch 2 --save-every 1 --checkpoint-dir "$dir/back" > /dev/null
echo step1 > "$dir/back/latest"
refused 1 "--checkpoint-dir $dir/back already holds step2, which this run would save at step 2 (it starts at step 1)" \
  "$demo" --ranks 2 --steps 3 --micro-batch 2 --save-every 1 --checkpoint-dir "$dir/back" --resume
# A pipe is read to its end (--text <(zcat a.gz)); a FIFO that no process writes is an empty
# text, not a wait.
"$gpt" --ranks 2 --steps 1 --micro-batch 2 \
  --eval <(for _ in $(seq 20); do echo "the quick brown fox jumps over the lazy dog"; done) > "$dir/pipe.log"
grep -q "^eval: loss" "$dir/pipe.log"
mkfifo "$dir/fifo"
refused 1 "--eval $dir/fifo is too short: 0 character(s)" "$gpt" --eval "$dir/fifo"
# --log-json: a FIFO no process reads is refused (its open never returned, not even on SIGTERM);
# a write that fails is said, not ignored, and the run goes on.
refused 1 "cannot open --log-json $dir/fifo: No such device or address (a FIFO that no process reads)" \
  "$demo" --ranks 2 --steps 2 --log-json "$dir/fifo"
"$demo" --ranks 2 --steps 2 --micro-batch 2 --log-json /dev/full > "$dir/full.log" 2>&1
grep -q "^warning: --log-json /dev/full: a write failed (No space left on device); the log ends before step 1$" "$dir/full.log"
grep -q "summary:" "$dir/full.log"
# The device demo: no fp16 engines (nor from a config).
refused 2 "--save-every, --keep-checkpoints and --resume need --checkpoint-dir" "$sim" --resume
refused 2 "--save-every expects an integer in [0, 10000000], got '-3'" "$sim" --save-every -3
refused 2 "--precision fp16 is not offered by the device demo" "$sim" --precision fp16
echo '{"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": true}}' > "$dir/fp16.json"
refused 1 "fp16.enabled: config asks for precision fp16, this program was built with element types {fp32, bf16}" \
  "$sim" --config "$dir/fp16.json"
refused 2 "--backend expects cuda_threads or nccl, got 'threads'" "$sim" --backend threads
# Under MPI the processes are the ranks: a --ranks that differs is refused, not ignored.
if [ -n "$mpiexec" ]; then
  for prog in "$demo" "$gpt"; do
    refused 2 "--ranks 4 with --backend mpi: the job has 2 processes" \
      "$mpiexec" -n 2 --oversubscribe "$prog" --backend mpi --ranks 4
  done
  # A setting every process refuses (the engine's, the grid's) is said once, and the job ends
  # with status 1, not an abort.
  mpi_refused() {
    refused 1 "$@"
    if [ "$(grep -c "zp: invalid argument:" "$dir/out.log")" != 1 ] ||
      grep -q "MPI_ABORT\|aborting the job\|job is aborted" "$dir/out.log"; then
      echo "${*:3}: not one error and a clean end:"; cat "$dir/out.log"; exit 1
    fi
  }
  mpi_refused "engine: hpz_partition_size 3 does not divide the 2 data-parallel ranks" \
    "$mpiexec" -n 2 --oversubscribe "$demo" --backend mpi --zero-hpz-partition-size 3
  mpi_refused "engine: hpz_partition_size 3 does not divide the 2 data-parallel ranks" \
    "$mpiexec" -n 4 --oversubscribe "$gpt" --backend mpi --tp 2 --zero-hpz-partition-size 3
  mpi_refused "zp_gpt: 2 ranks do not divide into --tp 1 x --pp 4" \
    "$mpiexec" -n 2 --oversubscribe "$gpt" --backend mpi --pp 4
  # ZP_RANKS_PER_NODE that does not read, or differs between the processes (it hung in the
  # node's splits, silently), is an error on every process.
  no_abort() {
    if grep -q "MPI_ABORT\|aborting the job\|job is aborted" "$dir/out.log"; then
      echo "an error every process raised aborted the job:"; cat "$dir/out.log"; exit 1
    fi
  }
  refused 1 'ZP_RANKS_PER_NODE="abc" is not a positive number of ranks per node' \
    "$mpiexec" -n 2 --oversubscribe env ZP_RANKS_PER_NODE=abc "$demo" --backend mpi
  no_abort
  refused 1 "the ranks ask for different ranks per node, from 0 to 1" \
    "$mpiexec" -n 1 --oversubscribe env ZP_RANKS_PER_NODE=1 "$demo" --backend mpi : \
    -n 1 env -u ZP_RANKS_PER_NODE "$demo" --backend mpi
  no_abort
fi
# A default the help names, given, is not a mistake: --ranks-per-node 0 (the backend's nodes),
# --save-every 0 (never), --keep-checkpoints 0 (all), --shard-group-size 0 (plain ZeRO).
"$gpt" --ranks 2 --stage 2 --zero-quantized-gradients --ranks-per-node 0 --steps 1 --save-every 0 \
  --checkpoint-dir "$dir/zero" --shard-group-size 0 > "$dir/rpn.log"
grep -q "summary:" "$dir/rpn.log"
if grep -q "hybrid sharding" "$dir/rpn.log" || [ -e "$dir/zero/latest" ]; then
  echo "a default given changed the run"; exit 1
fi
"$demo" --ranks 2 --steps 3 --micro-batch 2 --save-every 1 --keep-checkpoints 0 \
  --checkpoint-dir "$dir/all" > /dev/null
test -d "$dir/all/step1" && test -d "$dir/all/step2" && test -d "$dir/all/step3"
rm -rf "$dir"
echo "trainer flags: every mistake refused before training"
