#!/usr/bin/env bash
# Seed 001's table, in process: 512 KiB random writes at QD32 over a 400 MiB
# region (one pass, as fio --size=400M), through writecache on RAM devices,
# for cache block sizes 512 B … 64 KiB, with coalescing off (the udm feature
# 'nocoalesce': one cache write per block, the kernel before the seed's
# patch) and on, against the raw cache RAM device. Then 4 KiB random writes
# and reads that hit the cache, against the raw device. Runs are interleaved
# (raw, off, on, raw, off, on …); each figure is the median of ROUNDS runs.
#
# RAM devices are preallocated (`ram:1G,prealloc`, RAM=ram:1G for lazy
# ones): a lazily allocated RAM disk makes first-touch page allocation the
# larger part of the cost, and a log-structured cache touches all of its
# fresh space while random writes to the raw device revisit ~37% of theirs,
# so lazy devices measure page faults, not the data path.
#   usage: scripts/bench/writecache.sh [ROUNDS]
set -euo pipefail
# The job thread is pinned: see pinned.sh (CPU=N moves it).
. "$(dirname "$0")/pinned.sh"
cd "$(dirname "$0")/../.."
ROUNDS=${1:-5}
cargo build --release -q -p udm
UDM=./target/release/udm
declare -A R
RAM=${RAM:-ram:1G,prealloc}
mib() { grep -o '"mib_per_s":[0-9.]*' | cut -d: -f2; }
iops() { grep -o '"iops":[0-9.]*' | cut -d: -f2; }
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
# Median of the per-round ratios A_i/B_i of two run lists (same order): each
# run is paired with the raw run of its own round, which cancels some of the
# machine's drift between rounds (runs are ~50 ms).
ratio() { python3 -c 'import statistics,sys; a,b=(list(map(float,x.split())) for x in sys.argv[1:3]); print(statistics.median(x/y for x,y in zip(a,b)))' "$1" "$2"; }
TABLE=(--rw randwrite --bs 512k --iodepth 32 --size 400M)
wc() { # block-size features... -> WC=(device specs)
    local bs=$1; shift
    WC=(--dev o=ram:1G --dev c=$RAM --dev "wc=0 2097152 writecache s o c $bs $*")
}
for r in $(seq "$ROUNDS"); do
    echo "round $r/$ROUNDS" >&2
    for bs in 512 1024 2048 4096 8192 16384 32768 65536; do
        R[raw $bs]+="$(bench_pinned "$UDM" --json --dev c=$RAM --target c "${TABLE[@]}" | mib) "
        wc "$bs" 1 nocoalesce
        R[off $bs]+="$(bench_pinned "$UDM" --json "${WC[@]}" --target wc "${TABLE[@]}" | mib) "
        wc "$bs" 0
        R[on $bs]+="$(bench_pinned "$UDM" --json "${WC[@]}" --target wc "${TABLE[@]}" | mib) "
    done
    # 4 KiB hits: the region is written first (--prefill), so every I/O hits.
    HIT=(--bs 4k --iodepth 32 --size 256M --runtime 2 --prefill)
    R[raw 4k randwrite]+="$(bench_pinned "$UDM" --json --dev c=$RAM --target c --rw randwrite "${HIT[@]}" | iops) "
    wc 4096 0
    R[wc 4k randwrite]+="$(bench_pinned "$UDM" --json "${WC[@]}" --target wc --rw randwrite "${HIT[@]}" | iops) "
    R[raw 4k randread]+="$(bench_pinned "$UDM" --json --dev c=$RAM --target c --rw randread "${HIT[@]}" | iops) "
    R[wc 4k randread]+="$(bench_pinned "$UDM" --json "${WC[@]}" --target wc --rw randread "${HIT[@]}" | iops) "
done
printf '\n512k randwrite QD32, 400 MiB, MiB/s (median of %s; ratios: median of per-round ratios)\n' "$ROUNDS"
printf '%-8s %9s %9s %9s %9s %9s\n' "block" "raw" "off" "on" "on/off" "on/raw"
for bs in 512 1024 2048 4096 8192 16384 32768 65536; do
    raw=$(echo "${R[raw $bs]}" | median)
    off=$(echo "${R[off $bs]}" | median)
    on=$(echo "${R[on $bs]}" | median)
    printf '%-8s %9.0f %9.0f %9.0f %9.2f %9.3f\n' "$bs" "$raw" "$off" "$on" \
        "$(ratio "${R[on $bs]}" "${R[off $bs]}")" "$(ratio "${R[on $bs]}" "${R[raw $bs]}")"
done
printf '\n4k QD32 cache hits, IOPS (median)\n'
for rw in randwrite randread; do
    raw=$(echo "${R[raw 4k $rw]}" | median)
    w=$(echo "${R[wc 4k $rw]}" | median)
    printf '%-10s raw %10.0f  writecache %10.0f  ratio %.3f\n' "$rw" "$raw" "$w" "$(ratio "${R[wc 4k $rw]}" "${R[raw 4k $rw]}")"
done
