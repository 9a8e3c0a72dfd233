#!/usr/bin/env python3
"""Plots a JSON-lines timer log (zp_demo --log-json, one StepTimes per optimizer step) as a PNG:
stacked phase times per step and the loss on a second axis.

    python3 tools/plot_timers.py run.jsonl run.png [--title TEXT]

Needs matplotlib (Debian: apt-get install python3-matplotlib).
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PHASES = [  # (key, label): the phases partition each step
    ("forward_ms", "forward"),
    ("gather_wait_ms", "waiting for gathers"),
    ("backward_ms", "backward"),
    ("reduce_wait_ms", "waiting for reductions"),
    ("statistics_ms", "statistics"),
    ("optimizer_ms", "optimizer"),
    ("gather_ms", "parameter gather"),
    ("untracked_ms", "untracked"),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("png")
    ap.add_argument("--title", default="zp step time by phase")
    a = ap.parse_args()
    rows = []
    with open(a.log) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise SystemExit(f"{a.log}:{n}: not JSON: {e}")
    if not rows:
        raise SystemExit(f"{a.log}: no steps")
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    bottom = [0.0] * len(rows)
    for key, label in PHASES:
        vals = [max(0.0, r[key]) for r in rows]
        ax.bar(steps, vals, bottom=bottom, width=1.0, label=label, linewidth=0)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("ms per step")
    hidden = sum(r["hidden"] * r["reduce_span_ms"] for r in rows) / max(1e-9, sum(r["reduce_span_ms"] for r in rows))
    ax.set_title(f"{a.title} ({hidden:.0%} of reduction time hidden behind backward)")
    loss = ax.twinx()
    loss.plot(steps, [r["loss"] for r in rows], color="black", linewidth=1.2, label="loss")
    loss.set_ylabel("loss")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = loss.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(a.png)
    print(f"wrote {a.png} ({len(rows)} steps)")


if __name__ == "__main__":
    main()
