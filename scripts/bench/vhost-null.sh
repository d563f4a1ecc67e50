#!/usr/bin/env bash
# vhost-user-blk servers over null devices, so that only the protocol path
# is measured: udm serve over `null:256M` and qemu-storage-daemon's
# vhost-user-blk export over `null-co` (read-zeroes=off: neither touches
# the data), driven by the same VM-less client (exports/examples/
# vhost_bench.rs, libblkio's virtio-blk-vhost-user driver, one queue), in
# interleaved rounds (scripts/bench/vhost-rounds.sh: the first server
# alternates; medians of IOPS, of server CPU per I/O and of per-round
# ratios).
#
# usage: scripts/bench/vhost-null.sh [ROUNDS=5] [RUNTIME_S=5] [QD=32] [BS=4096] [read|write]
#   A=udm B=qsd pick the two servers: udm (udm serve, default reactors),
#   udm-interrupt (--interrupt), udm-b (the binary at $UDM_B), udm+OPTS
#   (udm serve OPTS, commas for spaces), qsd (the main loop),
#   qsd-iothread (the export in an iothread, which polls adaptively).
#   WAIT=poll: the client polls its used ring with the servers'
#   notifications off (a guest's virtio_blk.poll_queues); default irq: it
#   sleeps on its call eventfd.
set -euo pipefail
ROUNDS=${1:-5}
RUNTIME=${2:-5}
QD=${3:-32}
BS=${4:-4096}
RW=${5:-read}
A=${A:-udm}
B=${B:-qsd}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
if [ -z "${UDM:-}" ]; then
    cargo build --release -q -p udm
    UDM=$ROOT/target/release/udm
fi
cargo build --release -q -p udm-exports --example vhost_bench
CLIENT=$ROOT/target/release/examples/vhost_bench
W=$(mktemp -d /dev/shm/udm-vhost-null.XXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$W"' EXIT
SOCK=$W/vhost.sock
. scripts/bench/vhost-rounds.sh

start() {
    rm -f "$SOCK"
    local bin=$UDM extra=()
    case $1 in
    qsd | qsd-iothread)
        local io=() ioe=
        if [ "$1" = qsd-iothread ]; then io=(--object iothread,id=io0); ioe=,iothread=io0; fi
        qemu-storage-daemon "${io[@]}" \
            --blockdev driver=null-co,node-name=d0,size=268435456,read-zeroes=off \
            --export "type=vhost-user-blk,id=e0,node-name=d0,addr.type=unix,addr.path=$SOCK,writable=on,num-queues=1$ioe" \
            >"$W/$1.out" 2>&1 &
        vhost_listening "$1"
        return
        ;;
    udm-interrupt) extra=(--interrupt) ;;
    udm-b) bin=${UDM_B:?udm-b needs UDM_B=/path/to/udm} ;;
    udm-b+*) bin=${UDM_B:?udm-b needs UDM_B=/path/to/udm}; IFS=, read -r -a extra <<<"${1#*+}" ;;
    udm+*) IFS=, read -r -a extra <<<"${1#*+}" ;;
    esac
    "$bin" serve "${extra[@]}" --dev d=null:256M --vhost-user-blk "$SOCK" --queues 1 \
        >"$W/$1.out" 2>&1 &
    vhost_listening "$1"
}

echo "# $(date -u +%F) $(git rev-parse --short HEAD) null devices, $BS $RW QD$QD, client ${WAIT:-irq}, $RUNTIME s x $ROUNDS rounds, load $(cut -d' ' -f1-3 /proc/loadavg)"
vhost_rounds "$ROUNDS" "$W/results" "$A" "$B"
