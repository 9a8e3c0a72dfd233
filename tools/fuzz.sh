#!/usr/bin/env bash
# tools/fuzz.sh: coverage-guided fuzzing (libFuzzer; Clang 16 with ASan and UBSan) of zp's
# readers of untrusted bytes: safetensors files, checkpoint manifests (their checksum recomputed,
# as a hostile file's would be) and ds_config files. Each reader must accept an input or refuse
# it with zp::Error. Not part of CI, whose time goes to the tests; run it after changing a reader.
#   bash tools/fuzz.sh [seconds per target (default 60)] [target ...]
# Targets: tools/fuzz/<target>.fuzz.cpp (default all). Corpora stay in build/fuzz/corpus/<target>,
# so a run goes on from where the last one stopped (the first one seeds them). An input that
# crashes, leaks, hangs or runs out of memory is kept as build/fuzz/<target>/crash-* (leak-*,
# timeout-*, oom-*); replay it with `build/fuzz/<target>/fuzz <file>`. Exits 1 naming the targets
# that failed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash cmake/install-deps.sh tests  # Clang 16 and its libFuzzer runtime
seconds=${1:-60}
[[ "$seconds" =~ ^[1-9][0-9]*$ ]] ||
  { echo "fuzz: seconds must be a positive integer, got '$seconds'" >&2; exit 2; }
shift $(($# > 0 ? 1 : 0))
targets=("$@")
((${#targets[@]})) || targets=(safetensors manifest ds_config)
for t in "${targets[@]}"; do
  [ -f "tools/fuzz/$t.fuzz.cpp" ] ||
    { echo "fuzz: no target '$t' (tools/fuzz/$t.fuzz.cpp)" >&2; exit 2; }
done
out=build/fuzz
failed=()
for t in "${targets[@]}"; do
  src=tools/fuzz/$t.fuzz.cpp
  mkdir -p "$out/$t" "$out/corpus/$t"
  echo "=== fuzz $t: building"
  clang++-16 -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined \
    -fno-sanitize-recover=undefined -Iinclude "$src" -o "$out/$t/fuzz"
  seeds=""
  [ -n "$(ls -A "$out/corpus/$t")" ] || seeds=$out/corpus/$t
  echo "=== fuzz $t: $seconds s (log: $out/$t/log)"
  if ZP_FUZZ_SCRATCH="$out/$t/scratch" ZP_FUZZ_SEEDS="$seeds" "$out/$t/fuzz" \
      -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 \
      -artifact_prefix="$out/$t/" "$out/corpus/$t" > "$out/$t/log" 2>&1; then
    grep -E "^stat::(number_of_executed_units|new_units_added)" "$out/$t/log" | tr '\n' ' '
    echo "corpus $(ls "$out/corpus/$t" | wc -l) inputs"
  else
    grep -E "ERROR|runtime error|Test unit written" "$out/$t/log" | head -5
    failed+=("$t")
  fi
done
((${#failed[@]} == 0)) || { echo "fuzz: FAILED: ${failed[*]}" >&2; exit 1; }
echo "fuzz: no failure in ${targets[*]}"
