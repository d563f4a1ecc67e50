#!/usr/bin/env bash
# Two (or more) udm builds side by side on one row of seed 001's table:
# 512 KiB random writes at QD32 over 400 MiB through writecache on RAM
# devices, at one cache block size, against the raw cache device. Each
# round runs raw and every build, in an order that reverses every round;
# the report gives per build the
# median MiB/s and the median of its per-round ratios to raw (the rounds are
# ~50 ms each, so pairing each run with the raw run beside it cancels some
# of this VM's drift) and in how many rounds each build beat the one
# before it (scripts/bench/ab-report.py). Raw runs with the first build only: for
# a build's own ratio to raw (the goal's), give it alone or first.
#   usage: scripts/bench/writecache-ab.sh ROUNDS BLOCK_SIZE UDM_BINARY...
#   e.g.:  scripts/bench/writecache-ab.sh 15 512 /tmp/udm-before target/release/udm
set -euo pipefail
# The job thread is pinned: see pinned.sh (CPU=N moves it).
. "$(dirname "$0")/pinned.sh"
[ $# -ge 3 ] || { sed -n '2,12p' "$0" >&2; exit 2; }
ROUNDS=$1 BS=$2
shift 2
RAW_UDM=$1
TABLE=(--rw randwrite --bs 512k --iodepth 32 --size 400M)
mib() { grep -o '"mib_per_s":[0-9.]*' | cut -d: -f2; }
# One run: "raw" (the raw cache device, with the first build) or a build.
one() {
    if [ "$1" = raw ]; then
        bench_pinned "$RAW_UDM" --json --dev c=ram:1G,prealloc --target c "${TABLE[@]}" | mib
    else
        bench_pinned "$1" --json --dev o=ram:1G --dev c=ram:1G,prealloc \
            --dev "wc=0 2097152 writecache s o c $BS 0" --target wc "${TABLE[@]}" | mib
    fi
}
. "$(dirname "$0")/ab-rounds.sh"
ab_rounds "$ROUNDS" MiB/s "512k randwrite QD32, 400 MiB, cache block $BS B" "$@"
