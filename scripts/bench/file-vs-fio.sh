#!/usr/bin/env bash
# udm's file backend against fio's io_uring engine on the same /dev/shm file,
# same block size and depth, O_DIRECT, with fio batching as GUIDE.md says
# (fio submits one I/O per call unless told otherwise). Runs interleave
# (udm fio udm fio …); each figure is the median of ROUNDS runs.
#
# Both run pinned to one CPU (CPU=N moves them; CPU= leaves them to the
# scheduler). tmpfs cannot read or write O_DIRECT without blocking, so
# io_uring hands every I/O to an io-wq worker, which inherits the
# submitter's CPUs. Unpinned, a QD1 I/O then wakes a thread on the other
# vCPU and is woken back: two cross-CPU wakeups, which in this VM cost ten
# times the I/O (30k IOPS against 350k pinned), so the figure would measure
# where the scheduler put the threads, not udm or fio.
#   usage: scripts/bench/file-vs-fio.sh [ROUNDS] [RUNTIME_S]
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${1:-5}
RT=${2:-3}
CPU=${CPU-0}
UDM_PIN=() FIO_PIN=()
if [ -n "$CPU" ]; then UDM_PIN=(--cpus "$CPU"); FIO_PIN=(--cpus_allowed="$CPU"); fi
command -v fio >/dev/null || { echo "bench/file-vs-fio: fio is not installed (scripts/setup.sh)" >&2; exit 2; }
cargo build --release -q -p udm
UDM=./target/release/udm
# A fresh file per run unless IMG names one to make once and keep (a fixed
# path removed at exit would go from under another run using it).
if [ -n "${IMG:-}" ]; then
    . scripts/once.sh
    once "$IMG" sh -c 'dd if=/dev/urandom of="$OUT" bs=1M count=512 status=none'
else
    IMG=$(mktemp /dev/shm/udm-bench-fio.XXXXXX)
    trap 'rm -f "$IMG"' EXIT
    dd if=/dev/urandom of="$IMG" bs=1M count=512 status=none
fi
declare -A R
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
udm() { # rw bs qd
    "$UDM" bench --dev "f=file:$IMG" --target f --rw "$1" --bs "$2" --iodepth "$3" \
        --runtime "$RT" "${UDM_PIN[@]}" --json | grep -o '"iops":[0-9.]*' | cut -d: -f2
}
fio_() { # rw bs qd
    fio --name=cmp --filename="$IMG" --ioengine=io_uring --direct=1 --rw="$1" --bs="$2" \
        --iodepth="$3" --iodepth_batch_submit=16 --iodepth_batch_complete_min=1 \
        --iodepth_batch_complete_max=32 --runtime="$RT" --time_based "${FIO_PIN[@]}" \
        --output-format=json | python3 -c 'import json,sys
j=json.load(sys.stdin)["jobs"][0]; print(j["read"]["iops"]+j["write"]["iops"])'
}
CASES=("randread 4k 32" "randwrite 4k 32" "randread 4k 1" "read 128k 8")
for r in $(seq "$ROUNDS"); do
    echo "round $r/$ROUNDS" >&2
    for c in "${CASES[@]}"; do
        read -r rw bs qd <<<"$c"
        R["$c udm"]+="$(udm "$rw" "$bs" "$qd") "
        R["$c fio"]+="$(fio_ "$rw" "$bs" "$qd") "
    done
done
printf '\n%-18s %12s %12s %8s\n' "case" "udm IOPS" "fio IOPS" "udm/fio"
for c in "${CASES[@]}"; do
    u=$(echo "${R[$c udm]}" | median)
    f=$(echo "${R[$c fio]}" | median)
    printf '%-18s %12.0f %12.0f %8.3f\n' "$c" "$u" "$f" "$(echo "$u / $f" | bc -l)"
done
