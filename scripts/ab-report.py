#!/usr/bin/env python3
"""Summary of an interleaved A/B benchmark run, for the *-ab.sh scripts.

usage: ab-report.py RUNS_FILE UNIT TITLE

RUNS_FILE has one line per round: "raw V name V name V ..." (the raw
device's figure, then each build's). Per build it prints the median figure,
the median of its per-round ratios to raw (pairing each run with the raw
run beside it cancels some of the VM's drift) and in how many rounds it beat
the build listed before it.
"""
import statistics
import sys

path, unit, title = sys.argv[1:4]
runs = {}
for line in open(path):
    f = line.split()
    for name, v in zip(f[0::2], f[1::2]):
        runs.setdefault(name, []).append(float(v))
raw = runs["raw"]
print(f"{title}, {len(raw)} rounds")
print(f"{'':40} {unit:>12} {'x raw':>7} {'wins':>6}")
prev = None
for name, v in runs.items():
    ratio = statistics.median(a / b for a, b in zip(v, raw))
    wins = "" if prev is None or name == "raw" else f"{sum(a > b for a, b in zip(v, prev))}/{len(v)}"
    print(f"{name:40} {statistics.median(v):12.0f} {ratio:7.3f} {wins:>6}")
    if name != "raw":
        prev = v
