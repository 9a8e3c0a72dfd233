#!/usr/bin/env bash
# ZeRO++'s training quality (issue #22): zp_gpt and zp_demo, 300 steps in bf16 on 4 thread ranks
# laid out as 2 nodes of 2, with qwZ + hpZ + qgZ on and off, for each initial-weights seed. Prints
# each pair's final loss (the summary's, the mean of the last progress window) and their relative
# difference, the mean and standard deviation over the seeds, and counts the steps whose gradient
# norm (--log-json) is 0, inf or NaN. Exits 1 if a pair differs by more than 1% or a quantized
# run reports a bad norm where the unquantized one of its seed does not.
#
#   bash tools/zeropp_quality.sh BUILD_DIR [SEEDS...]   # BUILD_DIR has examples/zp_gpt, zp_demo
#                                                       # (a Release build); SEEDS default 1-5
set -euo pipefail
build=${1:?usage: zeropp_quality.sh BUILD_DIR [SEEDS...]}
shift
seeds=("$@")
[ ${#seeds[@]} -gt 0 ] || seeds=(1 2 3 4 5)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
zeropp="--zero-quantized-weights --zero-hpz-partition-size 2 --zero-quantized-gradients --ranks-per-node 2"
for prog in gpt demo; do
  for seed in "${seeds[@]}"; do
    for mode in off on; do
      flags="--ranks 4 --precision bf16 --steps 300 --init-seed $seed"
      [ $mode = on ] && flags="$flags $zeropp"
      # shellcheck disable=SC2086
      "$build/examples/zp_$prog" $flags --log-json "$work/$prog.$mode.$seed.json" \
        > "$work/$prog.$mode.$seed.log"
    done
  done
done
python3 - "$work" "${seeds[@]}" <<'EOF'
import json, math, statistics, sys
work, seeds, failed = sys.argv[1], sys.argv[2:], False
def run(prog, mode, seed):
    base = f"{work}/{prog}.{mode}.{seed}"
    summary = next(l for l in open(base + ".log") if l.startswith("summary:"))
    norms = [json.loads(l)["grad_norm"] for l in open(base + ".json")]
    bad = sum(g is None or not (math.isfinite(g) and g > 0) for g in norms)  # null: inf or NaN
    return float(summary.split("->")[1].split()[0]), bad, len(norms)
for prog in ("gpt", "demo"):
    off, on = [], []
    for seed in seeds:
        (a, bad_a, n_a), (b, bad_b, n_b) = run(prog, "off", seed), run(prog, "on", seed)
        off.append(a)
        on.append(b)
        diff = 100 * (b / a - 1)
        failed |= abs(diff) > 1 or bad_b > bad_a
        print(f"zp_{prog} seed {seed}: final loss off {a:.4f}, on {b:.4f} ({diff:+.2f}%); "
              f"bad gradient norms off {bad_a}/{n_a}, on {bad_b}/{n_b}")
    sd = lambda v: statistics.stdev(v) if len(v) > 1 else 0.0
    print(f"zp_{prog}: off {statistics.mean(off):.4f} (sd {sd(off):.4f}), "
          f"on {statistics.mean(on):.4f} (sd {sd(on):.4f}) over {len(seeds)} seeds")
sys.exit(1 if failed else 0)
EOF
