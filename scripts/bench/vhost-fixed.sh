#!/usr/bin/env bash
# udm's vhost-user-blk export with the guest's memory registered with the
# reactors' io_uring (fixed buffers: READ_FIXED/WRITE_FIXED, no page
# pinning per I/O) against the same server with registration turned off
# (UDM_VHOST_FIXED_BUFFERS=0), same file, same VM-less client
# (exports/examples/vhost_bench.rs, libblkio's virtio-blk-vhost-user
# driver, one queue), interleaved rounds, the first server alternating.
# Per round and server: IOPS and the server's CPU per I/O (utime+stime of
# /proc/PID/stat, all threads, during the run).
#
# usage: scripts/bench/vhost-fixed.sh [ROUNDS=5] [RUNTIME_S=5] [QD=32] [BS=4096]
#            [read|write] [direct|buffered] [DIR]
# DIR holds the 256 MiB test file: default /tmp for direct (O_DIRECT on a
# disk), /dev/shm for buffered.
set -euo pipefail
ROUNDS=${1:-5}
RUNTIME=${2:-5}
QD=${3:-32}
BS=${4:-4096}
RW=${5:-read}
MODE=${6:-direct}
if [ "$MODE" = buffered ]; then DIR=${7:-/dev/shm}; OPT=",buffered"; else DIR=${7:-/tmp}; OPT=""; fi
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
cargo build --release -q -p udm
cargo build --release -q -p udm-exports --example vhost_bench
UDM=$ROOT/target/release/udm
CLIENT=$ROOT/target/release/examples/vhost_bench
W=$(mktemp -d "$DIR/udm-vhost-fixed.XXXX")
S=$(mktemp -d /dev/shm/udm-vhost-fixed-sock.XXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$W" "$S"' EXIT
IMG=$W/disk.img
dd if=/dev/urandom of="$IMG" bs=1M count=256 status=none
SOCK=$S/vhost.sock
CLK=$(getconf CLK_TCK)

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

start() {
    rm -f "$SOCK"
    local fixed=1
    [ "$1" = plain ] && fixed=0
    UDM_VHOST_FIXED_BUFFERS=$fixed "$UDM" serve --dev "f=file:$IMG$OPT" \
        --vhost-user-blk "$SOCK" --queues 1 >"$S/$1.out" 2>&1 &
    PID=$!
    for _ in $(seq 100); do [ -S "$SOCK" ] && return; sleep 0.05; done
    echo "bench/vhost-fixed: $1 did not listen" >&2
    exit 1
}

run() {
    start "$1"
    local c0 out iops c1
    c0=$(cpu_ticks "$PID")
    out=$("$CLIENT" "$SOCK" "$RUNTIME" "$QD" "$BS" "$RW")
    c1=$(cpu_ticks "$PID")
    kill "$PID"
    wait "$PID" 2>/dev/null || true
    iops=${out#iops }
    echo "$1 $iops $(awk -v c=$((c1 - c0)) -v k="$CLK" -v i="$iops" -v t="$RUNTIME" \
        'BEGIN { printf "%.2f", c / k * 1e6 / (i * t) }')"
}

echo "# $(date -u +%F) $(git rev-parse --short HEAD) $MODE file in $DIR, $BS $RW QD$QD, $RUNTIME s x $ROUNDS rounds, load $(cut -d' ' -f1-3 /proc/loadavg)"
: >"$S/results"
for r in $(seq "$ROUNDS"); do
    if [ $((r % 2)) = 1 ]; then order="fixed plain"; else order="plain fixed"; fi
    for s in $order; do
        line=$(run "$s")
        echo "round $r: $line"
        echo "$r $line" >>"$S/results"
    done
done
python3 - "$S/results" <<'PY'
import sys, statistics as st
rows = [l.split() for l in open(sys.argv[1])]
by = {}
for r, s, iops, cpu in rows:
    by.setdefault(s, {})[int(r)] = (float(iops), float(cpu))
for s in ("fixed", "plain"):
    v = by[s].values()
    print(f"{s}: median {st.median(i for i, _ in v):.0f} IOPS, {st.median(c for _, c in v):.2f} us CPU/IO")
rs = sorted(by["fixed"])
ri = st.median(by["fixed"][r][0] / by["plain"][r][0] for r in rs)
rc = st.median(by["fixed"][r][1] / by["plain"][r][1] for r in rs)
print(f"fixed/plain: IOPS x{ri:.2f}, CPU per I/O x{rc:.2f} (medians of per-round ratios)")
PY
