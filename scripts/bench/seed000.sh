#!/usr/bin/env bash
# Seed 000's comparison, in process: raw RAM vs linear vs striped over it,
# with the no-clone fast path and without (the clone path), plus the
# descriptor cache on/off and null-backend throughput. Runs are interleaved
# (A B C … A B C …) and each figure is the median of ROUNDS runs.
#   usage: scripts/bench/seed000.sh [ROUNDS] [RUNTIME_S]
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${1:-5}
RT=${2:-2}
cargo build --release -q -p udm
UDM=./target/release/udm
RAM=(--dev ram0=ram:1G --dev ram1=ram:1G
     --dev 'lin=0 2097152 linear ram0 0'
     --dev 'str=0 2097152 striped 2 128 ram0 0 ram1 0')
NULL=(--dev null0=null:1G --dev 'nlin=0 2097152 linear null0 0')
declare -A R
iops() { grep -o '"iops":[0-9.]*' | cut -d: -f2; }
run() { # key args...
    local key=$1; shift
    R[$key]+="$("$UDM" bench --json "$@" | iops) "
}
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

# Jobs are pinned (--cpus) so that A and B runs get the same placement.
S512=(--rw read --bs 512 --iodepth 1 --jobs 2 --cpus 0,1 --runtime "$RT" --prefill --size 256M)
R4K=(--rw randread --bs 4k --iodepth 32 --jobs 1 --cpus 1 --runtime "$RT" --prefill --size 512M)
N4K=(--rw randread --bs 4k --iodepth 32 --jobs 1 --cpus 1 --runtime "$RT")
for r in $(seq "$ROUNDS"); do
    echo "round $r/$ROUNDS" >&2
    for shape in S512 R4K; do
        declare -n A=$shape
        run "$shape raw"        "${RAM[@]}" --target ram0 "${A[@]}"
        run "$shape lin"        "${RAM[@]}" --target lin  "${A[@]}"
        run "$shape str"        "${RAM[@]}" --target str  "${A[@]}"
        run "$shape lin-clone"  "${RAM[@]}" --target lin  "${A[@]}" --no-fast-path
        run "$shape str-clone"  "${RAM[@]}" --target str  "${A[@]}" --no-fast-path
        unset -n A
    done
    run "null raw cache"     "${NULL[@]}" --target null0 "${N4K[@]}"
    run "null raw nocache"   "${NULL[@]}" --target null0 "${N4K[@]}" --no-cache
    run "null lin cache"     "${NULL[@]}" --target nlin  "${N4K[@]}"
    run "null lin nocache"   "${NULL[@]}" --target nlin  "${N4K[@]}" --no-cache
done
printf '\n%-22s %12s %8s\n' "case" "IOPS(med)" "ratio"
for shape in S512 R4K; do
    raw=$(echo "${R[$shape raw]}" | median)
    for k in raw lin str lin-clone str-clone; do
        m=$(echo "${R[$shape $k]}" | median)
        printf '%-22s %12.0f %8.3f\n' "$shape $k" "$m" "$(echo "$m / $raw" | bc -l)"
    done
done
for k in "null raw cache" "null raw nocache" "null lin cache" "null lin nocache"; do
    printf '%-22s %12.0f\n' "$k" "$(echo "${R[$k]}" | median)"
done

# Instructions per I/O (callgrind; exact and repeatable, unlike the clock).
# CALLGRIND=0 skips this part.
if [ "${CALLGRIND:-1}" != 0 ] && command -v valgrind >/dev/null; then
    printf '\n%-22s %12s\n' "case" "instr/IO"
    ipi() { UDM=$UDM scripts/bench/instr-per-io.sh "$@" | cut -d' ' -f1; }
    Q1=(--rw read --bs 512 --iodepth 1)
    printf '%-22s %12s\n' "S512 raw" "$(ipi "${RAM[@]}" --target ram0 "${Q1[@]}")"
    printf '%-22s %12s\n' "S512 lin" "$(ipi "${RAM[@]}" --target lin "${Q1[@]}")"
    printf '%-22s %12s\n' "S512 str" "$(ipi "${RAM[@]}" --target str "${Q1[@]}")"
    printf '%-22s %12s\n' "S512 lin-clone" "$(ipi "${RAM[@]}" --target lin "${Q1[@]}" --no-fast-path)"
    Q32=(--rw randread --bs 4k --iodepth 32)
    printf '%-22s %12s\n' "null raw" "$(ipi "${NULL[@]}" --target null0 "${Q32[@]}")"
    printf '%-22s %12s\n' "null lin" "$(ipi "${NULL[@]}" --target nlin "${Q32[@]}")"
fi
