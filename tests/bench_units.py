"""Benchmark counters hold what their names say: *_GBps in GB/s (1e9 bytes per second).

Runs a few fast rows of zp_bench_collectives and the membw probe with JSON output and recomputes
each row's algbw/busbw from its byte count and time: usage bench_units.py <zp_bench_collectives>.
"""
import json
import re
import subprocess
import sys

BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
       "all_gather": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0,
       "all_to_all": lambda n: (n - 1) / n, "all_to_all_v": lambda n: (n - 1) / n}
SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}

out = subprocess.run([sys.argv[1], "--benchmark_format=json",
                      "--benchmark_filter=^threads/(all_reduce|all_gather|reduce_scatter|all_to_all|all_to_all_v)"
                      "/ranks:2/bytes:(4096|65536)/"
                      "|^membw/copy/threads:1/"],
                     check=True, capture_output=True, text=True).stdout
rows = json.loads(out)["benchmarks"]
checked = 0
for row in rows:
    name, t = row["name"], row["real_time"] * SECONDS[row["time_unit"]]
    m = re.match(r"threads/(\w+)/ranks:(\d+)/bytes:(\d+)/", name)
    if m:
        op, n, size = m.group(1), int(m.group(2)), int(m.group(3))
        algbw = size / t / 1e9
        for key, want in (("algbw_GBps", algbw), ("busbw_GBps", algbw * BUS[op](n))):
            got = row[key]
            if abs(got - want) > 0.02 * want:
                sys.exit(f"{name}: {key} = {got}, but {size} bytes in {t} s is {want} GB/s")
        checked += 1
    elif name.startswith("membw/"):
        # A streaming copy on any machine moves between 0.1 and 10,000 GB/s: bytes/s would be 1e9 x more.
        if not 0.1 < row["GBps"] < 1e4:
            sys.exit(f"{name}: GBps = {row['GBps']} is not in GB/s")
        checked += 1
if checked < 11:
    sys.exit(f"only {checked} rows checked; the filter matched {[r['name'] for r in rows]}")
print(f"bench_units: {checked} rows, every *_GBps counter in GB/s")
