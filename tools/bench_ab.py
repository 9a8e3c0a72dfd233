#!/usr/bin/env python3
"""Same-run before/after comparison of two builds of one Google Benchmark binary.

    tools/bench_ab.py OLD_BINARY NEW_BINARY --filter REGEX [--rounds 3] [--reps 3] [--metric real_time]
                      [--save DIR]

Runs the two binaries alternately (old, new, old, new, ...) so that drift of the machine affects
both, each round with --benchmark_repetitions=REPS; per round and benchmark it takes the median
of the repetitions, and prints per benchmark the median over rounds of the ratio new/old
(> 1: the new build is slower), the smallest and largest round ratio, and both medians. This is
how bench/RESULTS.md's before/after tables are measured. --save DIR keeps every run's Google
Benchmark JSON (DIR/old.R.json, DIR/new.R.json for round R), counters included.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys


def run(binary, flt, reps, metric, save=None):
    out = subprocess.run(
        [binary, f"--benchmark_filter={flt}", f"--benchmark_repetitions={reps}",
         "--benchmark_format=json", "--benchmark_report_aggregates_only=false"],
        check=True, capture_output=True, text=True).stdout
    if save:
        with open(save, "w") as f:
            f.write(out)
    times = {}
    for b in json.loads(out)["benchmarks"]:
        if b.get("run_type") != "iteration" or b.get("error_occurred"):
            continue
        times.setdefault(b["run_name"], []).append(float(b[metric]))
    return {name: statistics.median(v) for name, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--filter", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--metric", default="real_time")
    ap.add_argument("--save", metavar="DIR")
    a = ap.parse_args()
    if a.rounds < 1 or a.reps < 1:
        sys.exit("bench_ab: --rounds and --reps must be >= 1")
    if a.save:
        os.makedirs(a.save, exist_ok=True)
    ratios, olds, news = {}, {}, {}
    for r in range(a.rounds):
        saved = {k: a.save and os.path.join(a.save, f"{k}.{r + 1}.json") for k in ("old", "new")}
        old = run(a.old, a.filter, a.reps, a.metric, saved["old"])
        new = run(a.new, a.filter, a.reps, a.metric, saved["new"])
        for name in old.keys() & new.keys():
            ratios.setdefault(name, []).append(new[name] / old[name])
            olds.setdefault(name, []).append(old[name])
            news.setdefault(name, []).append(new[name])
        print(f"bench_ab: round {r + 1} of {a.rounds} done", file=sys.stderr)
    if not ratios:
        sys.exit(f"bench_ab: no benchmark matched {a.filter!r} in both binaries")
    print(f"{'benchmark':60} {'new/old':>8} {'min':>6} {'max':>6} {'old':>10} {'new':>10}")
    for name in sorted(ratios):
        rs = ratios[name]
        print(f"{name:60} {statistics.median(rs):8.2f} {min(rs):6.2f} {max(rs):6.2f} "
              f"{statistics.median(olds[name]):10.3f} {statistics.median(news[name]):10.3f}")


if __name__ == "__main__":
    main()
