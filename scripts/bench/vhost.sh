#!/usr/bin/env bash
# vhost-user-blk servers side by side over the same RAM file, driven by the
# same VM-less client (exports/examples/vhost_bench.rs: libblkio's
# virtio-blk-vhost-user driver), interleaved: udm serve (file backend,
# buffered, on /dev/shm) and qemu-storage-daemon's vhost-user-blk export
# (file driver, cache.direct=off, aio=io_uring, on the same file). One
# queue each. Per round and server: IOPS, and the server's CPU (utime+stime
# of /proc/PID/stat, all threads) per I/O during the run. Each round starts
# the servers in turn, a different one first each round; the report gives
# medians over rounds and the median of the per-round udm/qsd ratios.
#
# usage: scripts/bench/vhost.sh [ROUNDS=5] [RUNTIME_S=5] [QD=32] [BS=4096] [read|write]
set -euo pipefail
ROUNDS=${1:-5}
RUNTIME=${2:-5}
QD=${3:-32}
BS=${4:-4096}
RW=${5:-read}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
cargo build --release -q -p udm
cargo build --release -q -p udm-exports --example vhost_bench
UDM=$ROOT/target/release/udm
CLIENT=$ROOT/target/release/examples/vhost_bench
W=$(mktemp -d /dev/shm/udm-vhost-bench.XXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$W"' EXIT
IMG=$W/disk.img
dd if=/dev/urandom of="$IMG" bs=1M count=256 status=none
SOCK=$W/vhost.sock
CLK=$(getconf CLK_TCK)

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

start() {
    rm -f "$SOCK"
    case $1 in
    udm)
        "$UDM" serve --dev "f=file:$IMG,buffered" --vhost-user-blk "$SOCK" --queues 1 \
            >"$W/udm.out" 2>&1 &
        ;;
    qsd)
        qemu-storage-daemon \
            --blockdev "driver=file,node-name=f0,filename=$IMG,cache.direct=off,aio=io_uring" \
            --blockdev driver=raw,node-name=d0,file=f0 \
            --export "type=vhost-user-blk,id=e0,node-name=d0,addr.type=unix,addr.path=$SOCK,writable=on,num-queues=1" \
            >"$W/qsd.out" 2>&1 &
        ;;
    esac
    PID=$!
    for _ in $(seq 100); do [ -S "$SOCK" ] && return; sleep 0.05; done
    echo "bench/vhost: $1 did not listen" >&2
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
    # CPU microseconds per I/O.
    echo "$1 $iops $(awk -v c=$((c1 - c0)) -v k="$CLK" -v i="$iops" -v t="$RUNTIME" \
        'BEGIN { printf "%.2f", c / k * 1e6 / (i * t) }')"
}

echo "# $(date -u +%F) $(git rev-parse --short HEAD) $BS $RW QD$QD, $RUNTIME s x $ROUNDS rounds"
: >"$W/results"
for r in $(seq "$ROUNDS"); do
    if [ $((r % 2)) = 1 ]; then order="udm qsd"; else order="qsd udm"; fi
    for s in $order; do
        line=$(run "$s")
        echo "round $r: $line"
        echo "$r $line" >>"$W/results"
    done
done
python3 - "$W/results" <<'PY'
import sys, statistics as st
rows = [l.split() for l in open(sys.argv[1])]
by = {}
for r, s, iops, cpu in rows:
    by.setdefault(s, {})[int(r)] = (float(iops), float(cpu))
for s in ("udm", "qsd"):
    v = by[s].values()
    print(f"{s}: median {st.median(i for i, _ in v):.0f} IOPS, {st.median(c for _, c in v):.2f} us CPU/IO")
rs = sorted(by["udm"])
ri = st.median(by["udm"][r][0] / by["qsd"][r][0] for r in rs)
rc = st.median(by["udm"][r][1] / by["qsd"][r][1] for r in rs)
print(f"udm/qsd: IOPS x{ri:.2f}, CPU per I/O x{rc:.2f} (medians of per-round ratios)")
PY
