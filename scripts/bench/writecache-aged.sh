#!/usr/bin/env bash
# Seed 001's table on an aged cache against a fresh one (issue 4's "aged"
# goal: aged >= 0.8x fresh at every cache block size).
#
# Origin and cache are files in /dev/shm, so the cache persists from one
# `udm` process to the next (each run loads it from its metadata, exactly
# as after a restart). Per cache block size:
#
#   age:   fill the cache with 600 MiB of sequential 512 KiB writes (past
#          the high watermark: writeback runs), write everything back
#          (`udm message … flush`), then PASSES passes of random
#          overwrites (4 KiB, or one cache block when blocks are larger)
#          over a 256 MiB region for 3 s each, with watermark writeback
#          running; every pass ends with a full writeback, as issue 4's
#          procedure says ("passes of random 4 KiB overwrites and
#          writebacks"), so both sides start the table equally empty and
#          neither crosses the high watermark merely because the other
#          started fuller. KEEP_LAST=1 leaves the last pass's blocks cached
#          instead (a quarter of the cache, scattered): the aged table then
#          runs on fragmented free space and past the high watermark, with
#          writeback competing, which the fresh run does not have — a
#          harder, unequal test, kept to measure writeback's cost.
#   table: 512 KiB random writes at QD32 over 400 MiB (one pass), on a
#          copy of the aged cache and on a fresh cache, interleaved
#          (aged, fresh, aged, fresh …); the median of ROUNDS runs each.
#
# Files are fully written (no holes) so that neither side pays for tmpfs
# page allocation the other does not. A `udm bench` process does not commit
# at exit, so what the last pass wrote after its last autocommit (1 s) is
# not in the aged cache: the aged state is what the metadata holds.
#   usage: scripts/bench/writecache-aged.sh [ROUNDS] [PASSES] [BLOCK SIZES…]
set -euo pipefail
# The job thread is pinned: see pinned.sh (CPU=N moves it).
. "$(dirname "$0")/pinned.sh"
cd "$(dirname "$0")/../.."
ROUNDS=${1:-5}
PASSES=${2:-4}
shift $(( $# > 2 ? 2 : $# ))
SIZES=("$@")
[ ${#SIZES[@]} -gt 0 ] || SIZES=(512 1024 2048 4096 8192 16384 32768 65536)
# UDM=path measures another build (e.g. a saved copy of a baseline).
if [ -z "${UDM:-}" ]; then
    cargo build --release -q -p udm
    UDM=./target/release/udm
fi
D=${SHM:-/dev/shm}/udm-wc-aged.$$
mkdir -p "$D"
trap 'rm -rf "$D"' EXIT
mib() { grep -o '"mib_per_s":[0-9.]*' | cut -d: -f2; }
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
# Written zeroes, not fallocate: tmpfs still populates fallocated pages on
# their first write, which made a fresh cache 5x slower than a copied one.
fresh() { rm -f "$1"; dd if=/dev/zero of="$1" bs=1M count=1024 status=none; }
devs() { # cache-file block-size -> DEVS
    DEVS=(--dev "o=file:$D/origin,size=1G" --dev "c=file:$1,size=1G"
          --dev "wc=0 2097152 writecache s o c $2 0")
}
TABLE=(--rw randwrite --bs 512k --iodepth 32 --size 400M)
fresh "$D/origin"
declare -A R
for bs in "${SIZES[@]}"; do
    echo "block size $bs: aging ($PASSES passes)" >&2
    fresh "$D/aged"
    devs "$D/aged" "$bs"
    bench_pinned "$UDM" "${DEVS[@]}" --target wc --rw write --bs 512k --iodepth 32 --size 600M >/dev/null
    "$UDM" message "${DEVS[@]}" wc flush 2>/dev/null
    obs=$(( bs > 4096 ? bs : 4096 ))
    for p in $(seq "$PASSES"); do
        bench_pinned "$UDM" "${DEVS[@]}" --target wc --rw randwrite --bs "$obs" --iodepth 32 \
            --size 256M --runtime 3 >/dev/null
        if [ "$p" -lt "$PASSES" ] || [ "${KEEP_LAST:-0}" != 1 ]; then
            "$UDM" message "${DEVS[@]}" wc flush 2>/dev/null
        fi
    done
    echo "  aged cache: $("$UDM" status "${DEVS[@]}" wc | awk '{print "blocks", $6, "free", $7}')" >&2
    for r in $(seq "$ROUNDS"); do
        echo "  round $r/$ROUNDS" >&2
        rm -f "$D/run"
        cp --sparse=never "$D/aged" "$D/run"
        devs "$D/run" "$bs"
        R[aged $bs]+="$(bench_pinned "$UDM" --json "${DEVS[@]}" --target wc "${TABLE[@]}" | mib) "
        fresh "$D/run"
        devs "$D/run" "$bs"
        R[fresh $bs]+="$(bench_pinned "$UDM" --json "${DEVS[@]}" --target wc "${TABLE[@]}" | mib) "
    done
done
printf '\n512k randwrite QD32, 400 MiB, on /dev/shm files, MiB/s (median of %s)\n' "$ROUNDS"
printf '%-8s %9s %9s %11s\n' "block" "fresh" "aged" "aged/fresh"
for bs in "${SIZES[@]}"; do
    f=$(echo "${R[fresh $bs]}" | median)
    a=$(echo "${R[aged $bs]}" | median)
    printf '%-8s %9.0f %9.0f %11.3f\n' "$bs" "$f" "$a" "$(echo "$a / $f" | bc -l)"
done
