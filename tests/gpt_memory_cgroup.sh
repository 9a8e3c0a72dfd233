#!/usr/bin/env bash
# zp_gpt in a memory cgroup without swap (docker --memory, a Kubernetes memory limit), where the
# kernel kills a process that passes the limit. zp_gpt (8 layers, d 512, bf16, stage 3, 2
# ranks: 386 MiB of model states, 450 MiB with the buckets' first slots and two blocks
# gathered, one prefetched) under 352 MiB: with the optimizer state in memory it is refused before it
# allocates, with an error naming the cgroup (without the check: killed, rc 137); with it on
# NVMe it trains (peak resident 286 MiB here). With 4 layers (258 MiB planned, peak resident
# 337 MiB) in 290 MiB it is refused too: zp_gpt allocates its activations and its modules'
# fp32 copies (69 MiB in use) before the engine, whose check then counts them (allocated after
# it, they were not: the check passed and the kernel killed the run). Exits 77 (skipped) where
# tests/in_cgroup.sh can make no memory cgroup.
#   gpt_memory_cgroup.sh <zp_gpt> <work dir>
set -euo pipefail
gpt=$1 dir=$2/gpt-memory-cgroup
here=$(dirname "$0")
rm -rf "$dir" && mkdir -p "$dir/swap"
args=(--layers 8 --d-model 512 --heads 8 --ranks 2 --stage 3 --steps 2 --log-every 1 --micro-batch 2)
limit=$((352 << 20))
rc=0
bash "$here/in_cgroup.sh" memory=$limit "$gpt" "${args[@]}" > "$dir/memory.log" 2>&1 || rc=$?
if [[ $rc == 77 ]]; then
  cat "$dir/memory.log"
  exit 77
fi
if [[ $rc != 1 ]]; then
  echo "the run with the optimizer state in memory ended with rc $rc, not 1 (an error):"
  tail -5 "$dir/memory.log"
  exit 1
fi
grep -q "out of memory: engine: not enough host memory: ranks 0, 1 need 450.5 MiB, more than the .* left by the memory cgroup /.*zp-test-" "$dir/memory.log" || {
  echo "no error naming the cgroup in $dir/memory.log:"
  tail -5 "$dir/memory.log"
  exit 1
}
small=(--layers 4 "${args[@]:2}")
rc=0
bash "$here/in_cgroup.sh" memory=$((290 << 20)) "$gpt" "${small[@]}" > "$dir/small.log" 2>&1 || rc=$?
[[ $rc == 1 ]] && grep -q "ranks 0, 1 need 258.1 MiB, more than the .* left by the memory cgroup" "$dir/small.log" || {
  echo "4 layers in 290 MiB: rc $rc, not refused by the check:"
  tail -5 "$dir/small.log"
  exit 1
}
rc=0
bash "$here/in_cgroup.sh" memory=$limit "$gpt" "${args[@]}" --offload-optimizer "nvme:$dir/swap" \
  > "$dir/nvme.log" 2>&1 || rc=$?
if [[ $rc != 0 ]]; then
  echo "the NVMe run failed under the limit (rc $rc):"
  tail -5 "$dir/nvme.log"
  exit 1
fi
grep -q '^step *2' "$dir/nvme.log"
[[ -z $(ls "$dir/swap") ]]  # the swap files went with their engines
echo "under a memory cgroup of $((limit >> 20)) MiB: in memory refused ($(grep -o 'more than the [0-9.]* MiB left' "$dir/memory.log")), on NVMe trained ($(grep -o 'resident [0-9.]*' "$dir/nvme.log") MiB); 4 layers in 290 MiB refused ($(grep -o '[0-9.]* MiB in use' "$dir/small.log"))"
