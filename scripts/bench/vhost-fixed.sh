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
. scripts/bench/vhost-rounds.sh

start() {
    rm -f "$SOCK"
    local fixed=1
    [ "$1" = plain ] && fixed=0
    UDM_VHOST_FIXED_BUFFERS=$fixed "$UDM" serve --dev "f=file:$IMG$OPT" \
        --vhost-user-blk "$SOCK" --queues 1 >"$S/$1.out" 2>&1 &
    vhost_listening "$1"
}

echo "# $(date -u +%F) $(git rev-parse --short HEAD) $MODE file in $DIR, $BS $RW QD$QD, $RUNTIME s x $ROUNDS rounds, load $(cut -d' ' -f1-3 /proc/loadavg)"
vhost_rounds "$ROUNDS" "$S/results" fixed plain
