#!/usr/bin/env bash
# zp_gpt --estimate-memory prints, without training, the plan the engine checks before it
# allocates (Engine::estimate_memory); a one-step run of the same flags reports what it
# allocated. Their model states and buckets must agree, and the least stage 3 gathers planned
# (besides the persistent modules) must not exceed the run's peak of them (stage 1 with the
# optimizer offloaded, stage 3 with hybrid sharding, 2 x 2 grids at stages 2 and 3; the
# embedding and head persist at stage 3), and the estimate must not train.
#   gpt_estimate_memory.sh <zp_gpt> <work dir>
set -euo pipefail
gpt=$1 dir=$2/gpt-estimate-memory
rm -rf "$dir" && mkdir -p "$dir"
base=(--layers 2 --d-model 64 --heads 4 --micro-batch 2 --log-every 1)
# field <name> <log>: the number after <name> on the plan's or the summary's memory line.
field() { sed -n "s/^memory \(plan \)\?per rank.* $1 \([0-9.]*\).*/\2/p" "$2"; }
check() {
  "$gpt" "${base[@]}" "$@" --estimate-memory > "$dir/plan.log" 2>&1
  "$gpt" "${base[@]}" "$@" --steps 1 > "$dir/run.log" 2>&1
  if grep -q "^step" "$dir/plan.log"; then echo "--estimate-memory $*: it trained"; exit 1; fi
  for f in "model states" buckets; do
    local want got
    want=$(field "$f" "$dir/run.log") got=$(field "$f" "$dir/plan.log")
    if [ -z "$want" ] || [ "$want" != "$got" ]; then
      echo "$*: $f planned '$got' MiB, allocated '$want' MiB"; cat "$dir/plan.log"; exit 1
    fi
  done
  local least peak
  least=$(field "gathered at least" "$dir/plan.log") peak=$(field "gathered peak" "$dir/run.log")
  if ! awk -v a="$least" -v b="$peak" 'BEGIN { exit !(a != "" && b != "" && a + 0 <= b + 0) }'; then
    echo "$*: planned at least '$least' MiB gathered, the run's peak was '$peak' MiB"; exit 1
  fi
  echo "$*: $(grep '^memory plan' "$dir/plan.log")"
}
check --ranks 2 --stage 1 --offload-optimizer cpu
check --ranks 4 --stage 3 --shard-group-size 2
check --ranks 4 --stage 2 --tp 2
check --ranks 4 --stage 3 --tp 2 --zero-quantized-weights --zero-quantized-gradients
