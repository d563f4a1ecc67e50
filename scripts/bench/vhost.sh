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
. scripts/bench/vhost-rounds.sh

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
    vhost_listening "$1"
}

echo "# $(date -u +%F) $(git rev-parse --short HEAD) $BS $RW QD$QD, $RUNTIME s x $ROUNDS rounds"
vhost_rounds "$ROUNDS" "$W/results" udm qsd
