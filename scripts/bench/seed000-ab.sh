#!/usr/bin/env bash
# Two (or more) udm builds side by side on seed 000's hardest row: 512 B
# sequential reads at QD1, 2 jobs (pinned), through TARGET (lin or str) over
# RAM, against the raw RAM device. Each round runs raw (with the first
# build) and every build, in turn, in an order that reverses every round;
# the report gives per build the median
# IOPS, the median of its per-round ratios to raw (pairing each run with the
# raw run beside it cancels some of this VM's drift) and in how many rounds
# it beat the build before it.
# Raw runs with the FIRST build only, so the "x raw" of a later build is not
# its own ratio: code layout moves raw by up to 6% from build to build with
# its code unchanged. For a build's own ratio (seed 000's goal), give it alone.
#   usage: scripts/bench/seed000-ab.sh ROUNDS TARGET UDM_BINARY...
#   e.g.:  scripts/bench/seed000-ab.sh 11 lin /tmp/udm-before target/release/udm
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,13p' "$0" >&2; exit 2; }
ROUNDS=$1 TARGET=$2
shift 2
RAM=(--dev ram0=ram:1G --dev ram1=ram:1G
     --dev 'lin=0 2097152 linear ram0 0'
     --dev 'str=0 2097152 striped 2 128 ram0 0 ram1 0')
S512=(--rw read --bs 512 --iodepth 1 --jobs 2 --cpus 0,1 --runtime 2 --prefill --size 256M)
iops() { grep -o '"iops":[0-9.]*' | cut -d: -f2; }
# One run: "raw" (the raw device, with the first build) or a build.
one() {
    if [ "$1" = raw ]; then
        "$RAW_UDM" bench --json "${RAM[@]}" --target ram0 "${S512[@]}" | iops
    else
        "$1" bench --json "${RAM[@]}" --target "$TARGET" "${S512[@]}" | iops
    fi
}
RAW_UDM=$1
. "$(dirname "$0")/ab-rounds.sh"
ab_rounds "$ROUNDS" IOPS "512 B seq read QD1, 2 jobs, $TARGET over RAM" "$@"
