#!/usr/bin/env python3
"""Summary of an interleaved A/B benchmark run, for the *-ab.sh scripts.

usage: ab-report.py RUNS_FILE UNIT TITLE

RUNS_FILE has one line per round: "raw V name V name V ..." (the raw
device's figure, then each build's). Per build it prints the median figure,
the median of its per-round ratios to raw (pairing each run with the raw
run beside it cancels some of the VM's drift) with a 90% bootstrap
interval for that median (rounds resampled with replacement), and in how
many rounds it beat the build listed before it, with the median of its
per-round ratios to that build. On this VM an interval that does not hold
the goal is the honest way to say a run missed it.
"""
import random
import statistics
import sys


def ci90(xs, n=2000, seed=1):
    """90% bootstrap interval of the median of xs."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return meds[int(0.05 * n)], meds[int(0.95 * n) - 1]


path, unit, title = sys.argv[1:4]
runs = {}
for line in open(path):
    f = line.split()
    for name, v in zip(f[0::2], f[1::2]):
        runs.setdefault(name, []).append(float(v))
raw = runs["raw"]
print(f"{title}, {len(raw)} rounds")
print(f"{'':40} {unit:>12} {'x raw':>7} {'90% interval':>15} {'wins':>6} {'x prev':>7}")
prev = None
for name, v in runs.items():
    ratios = [a / b for a, b in zip(v, raw)]
    lo, hi = ci90(ratios)
    ci = "" if name == "raw" else f"[{lo:.3f}, {hi:.3f}]"
    wins = vs = ""
    if prev is not None and name != "raw":
        wins = f"{sum(a > b for a, b in zip(v, prev))}/{len(v)}"
        vs = f"{statistics.median(a / b for a, b in zip(v, prev)):.3f}"
    print(f"{name:40} {statistics.median(v):12.0f} {statistics.median(ratios):7.3f} {ci:>15} {wins:>6} {vs:>7}")
    if name != "raw":
        prev = v
