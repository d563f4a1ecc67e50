#!/usr/bin/env bash
# The dispatch table: `udm bench` with direct, queued, stream and
# auto dispatch over QD 1/4/32 x sequential/random x read/write, on a RAM
# disk (prefilled) and on an O_DIRECT file on /dev/shm, in interleaved
# rounds (the modes' order reverses every round); a markdown table of
# medians: direct's IOPS, each mode's median per-round ratio to the direct
# run beside it, and auto / the better of direct and queued (the median of
# the per-round ratios to the mode whose median is the higher, the rounds'
# range after it; bold below 0.95), then
# how many cells are below 0.95; the same again for I/Os per CPU-second of
# the job's thread (what a run costs, which being descheduled on a loaded
# host changes far less than its IOPS), and the load average before and
# after.
#
#   scripts/bench/dispatch-table.sh [ROUNDS=3]
#
# Env: RUNTIME (seconds per run, default 1), BS (default 4k), DEVS (default
# "ram file"), FILE (default /dev/shm/udm-dispatch-table.img, 256 MiB,
# written once before the rounds and kept: scripts/once.sh), CPUS (passed
# to --cpus: pin the job, e.g. 1), UDM (binary; default builds
# target/release/udm).
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/once.sh
ROUNDS=${1:-3}
RUNTIME=${RUNTIME:-1}
BS=${BS:-4k}
DEVS=${DEVS:-ram file}
FILE=${FILE:-/dev/shm/udm-dispatch-table.img}
if [ -z "${UDM:-}" ]; then
    cargo build --release -q -p udm
    UDM=target/release/udm
fi
OUT=$(mktemp)
trap 'rm -f "$OUT"' EXIT
PIN=()
[ -z "${CPUS:-}" ] || PIN=(--cpus "$CPUS")
LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)
MODES=(direct queued stream auto)
for dev in $DEVS; do
    case $dev in
    ram) SPEC=d=ram:256M EXTRA=(--prefill) ;;
    file)
        # A shorter file is not one once made (a plain dd killed halfway):
        # made again.
        [ "$(stat -c %s "$FILE" 2>/dev/null || echo 0)" -ge $((256 << 20)) ] || rm -f "$FILE"
        once "$FILE" sh -c 'dd if=/dev/zero of="$OUT" bs=1M count=256 status=none'
        SPEC=d=file:$FILE EXTRA=()
        ;;
    esac
    for r in $(seq "$ROUNDS"); do
        echo "$dev: round $r/$ROUNDS" >&2
        order=("${MODES[@]}")
        (( r % 2 )) || mapfile -t order < <(printf '%s\n' "${MODES[@]}" | tac)
        for rw in read randread write randwrite; do
            for qd in 1 4 32; do
                for m in "${order[@]}"; do
                    res=$("$UDM" bench --dev "$SPEC" --target d --rw "$rw" --bs "$BS" --iodepth "$qd" \
                        --runtime "$RUNTIME" --dispatch "$m" "${EXTRA[@]}" "${PIN[@]}" --json |
                        python3 -c 'import json,sys; j=json.load(sys.stdin); print(j["iops"], j["ios"] / max(j["cpu_user_s"] + j["cpu_sys_s"], 1e-6))')
                    echo "$dev $rw $qd $r $m $res" >>"$OUT"
                done
            done
        done
    done
done
LOAD1=$(cut -d' ' -f1-3 /proc/loadavg)
python3 - "$OUT" "$LOAD0" "$LOAD1" <<'PY'
import sys, statistics as st
from collections import defaultdict
runs = [defaultdict(dict), defaultdict(dict)]
for dev, rw, qd, r, m, iops, per_cpu in (l.split() for l in open(sys.argv[1])):
    runs[0][(dev, rw, int(qd))].setdefault(int(r), {})[m] = float(iops)
    runs[1][(dev, rw, int(qd))].setdefault(int(r), {})[m] = float(per_cpu)
for what, table in zip(["IOPS", "I/Os per CPU-second of the job's thread"], runs):
    print(f"{what}:")
    print()
    print("| device | rw | QD | direct | queued / direct | stream / direct | auto / direct | auto / the better of direct and queued |")
    print("|---|---|---|---|---|---|---|---|")
    below = 0
    for (dev, rw, qd), rounds in table.items():
        rs = rounds.values()
        med = lambda f: st.median(f(v) for v in rs)
        d = med(lambda v: v["direct"])
        ratio = lambda m: med(lambda v: v[m] / v["direct"])
        # The better of direct and queued is chosen once per cell, by
        # their medians over the rounds: taking the larger of the two in
        # each round would pick up each round's noise and set auto against
        # a bar above either mode's own rate where the two run alike.
        better = max(("direct", "queued"), key=lambda m: med(lambda v: v[m]))
        per = [v["auto"] / v[better] for v in rs]
        best = st.median(per)
        below += best < 0.95
        cell = f"{best:.2f}" if best >= 0.95 else f"**{best:.2f}**"
        fmt = f"{d / 1e6:.2f} M" if d >= 1e6 else f"{d / 1e3:.0f} k"
        print(f"| {dev} | {rw} | {qd} | {fmt} | {ratio('queued'):.2f} | {ratio('stream'):.2f} | {ratio('auto'):.2f} | {cell} ({min(per):.2f}-{max(per):.2f}, {better}) |")
    print()
    print(f"cells where auto < 0.95x the better of direct and queued: {below} of {len(table)}")
    print()
print(f"load average (1, 5, 15 min) before: {sys.argv[2]}; after: {sys.argv[3]}")
PY
