#!/usr/bin/env bash
# ZeRO-Infinity's point (issue #21): a run whose optimizer state does not fit a memory limit
# completes with the state on NVMe. zp_gpt (12.7M parameters, bf16, stage 3, 2 ranks: 145 MiB
# of fp32 master weights and AdamW state) runs once with --offload-optimizer nvme:DIR to learn
# its peak virtual memory V; under `ulimit -v` V + 48 MiB the same run completes with the same
# losses, and the run with the state in memory fails (it needs the 145 MiB less the swap's
# 26 MiB of buffers more).
#   nvme_memory_limit.sh <zp_gpt> <work dir>
set -euo pipefail
gpt=$1 dir=$2/nvme-memory-limit
rm -rf "$dir" && mkdir -p "$dir/swap"
export MALLOC_ARENA_MAX=1  # one heap for every thread: the same peak run after run
args=(--layers 4 --d-model 512 --heads 8 --ranks 2 --stage 3 --steps 2 --log-every 1 --micro-batch 2)
"$gpt" "${args[@]}" --offload-optimizer "nvme:$dir/swap" > "$dir/free.log"
peak=$(sed -n 's/^process peak (MiB): resident [0-9.]*  virtual \([0-9]*\).*/\1/p' "$dir/free.log")
[[ -n $peak ]] || { echo "no peak in $dir/free.log"; exit 1; }
limit=$(( (peak + 48) * 1024 ))
grep -q "of which on NVMe (ZeRO-Infinity): 72.756 MiB" "$dir/free.log"

(ulimit -v "$limit"; "$gpt" "${args[@]}" --offload-optimizer "nvme:$dir/swap") > "$dir/limited.log" 2>&1
diff <(grep '^step' "$dir/free.log" | cut -c1-22) <(grep '^step' "$dir/limited.log" | cut -c1-22)
if (ulimit -v "$limit"; "$gpt" "${args[@]}") > "$dir/memory.log" 2>&1; then
  echo "the run with the optimizer state in memory fit under ulimit -v $limit KiB: the test proves nothing"
  exit 1
fi
grep -Eq "bad_alloc|out of memory" "$dir/memory.log"
[[ -z $(ls "$dir/swap") ]]  # the swap files went with their engines
echo "under ulimit -v $((limit / 1024)) MiB: NVMe offload trained (peak $peak MiB), in memory: $(grep -Eo 'bad_alloc|out of memory' "$dir/memory.log" | head -1)"
