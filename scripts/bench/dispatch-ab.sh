#!/usr/bin/env bash
# Seed 004's table: `udm bench` with direct, queued, stream and auto dispatch, 4 KiB
# at QD32, interleaved rounds (ab-rounds.sh), medians (ab-report.py; "raw"
# is direct, each ratio is to direct).
#
#   scripts/bench/dispatch-ab.sh [ROUNDS]
#
# Rows: sequential and random reads and writes on a RAM disk (prefilled,
# unmeasured), and sequential writes on an O_DIRECT file on this machine's
# disk, through `udm bench`; row "vhost": the same four on a RAM disk
# served by `udm serve --vhost-user-blk` (one queue) to the VM-less client
# (exports/examples/vhost_bench.rs). Env: RUNTIME (seconds per run, default
# 3), FILE (default /var/tmp/udm-dispatch.img, written once in full before
# the rounds and kept: scripts/once.sh), ROWS (default "ram file vhost"),
# RAM_SIZE (the RAM disk's size, default 256M; 8M fits the CPU's caches,
# so the rows then show each mode's CPU cost rather than memory stalls).
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/bench/ab-rounds.sh
. scripts/once.sh
ROUNDS=${1:-7}
RUNTIME=${RUNTIME:-3}
FILE=${FILE:-/var/tmp/udm-dispatch.img}
ROWS=${ROWS:-ram file vhost}
cargo build --release -q -p udm
cargo build --release -q -p udm-exports --example vhost_bench
UDM=target/release/udm
CLIENT=target/release/examples/vhost_bench
W=$(mktemp -d /dev/shm/udm-dispatch.XXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$W"' EXIT
SOCK=$W/sock QD=32 BS=4096
. scripts/bench/vhost-rounds.sh
start() {
    rm -f "$SOCK"
    "$UDM" serve --dev d=ram:256M --vhost-user-blk "$SOCK" --queues 1 --dispatch "$1" \
        >"$W/serve.out" 2>&1 &
    vhost_listening "$1"
}
# One run through the vhost-user-blk export: prints IOPS.
one_vhost() {
    local line
    line=$(RW=$VRW vhost_run "$1")
    line=${line#* }
    echo "${line% *}"
}
one() {
    local mode=$1
    [ "$mode" = raw ] && mode=direct
    [ -n "${VRW:-}" ] && { one_vhost "$mode"; return; }
    "$UDM" bench "${DEV[@]}" --target d --rw "$RW" --bs 4k --iodepth 32 \
        --runtime "$RUNTIME" --dispatch "$mode" "${EXTRA[@]}" --json |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["iops"])'
}
for row in $ROWS; do
    case $row in
    ram)
        DEV=(--dev "d=ram:${RAM_SIZE:-256M}")
        EXTRA=(--prefill)
        for RW in read write randread randwrite; do
            ab_rounds "$ROUNDS" IOPS "RAM ${RAM_SIZE:-256M}, $RW 4k QD32 (raw = direct)" queued stream auto
        done
        ;;
    file)
        # A shorter file is not one once made (a plain dd killed halfway):
        # made again.
        [ "$(stat -c %s "$FILE" 2>/dev/null || echo 0)" -ge $((1 << 30)) ] || rm -f "$FILE"
        once "$FILE" sh -c 'dd if=/dev/zero of="$OUT" bs=1M count=1024 oflag=direct status=none'
        DEV=(--dev "d=file:$FILE")
        EXTRA=()
        RW=write
        ab_rounds "$ROUNDS" IOPS "O_DIRECT file on $(df --output=source "$FILE" | tail -1), write 4k QD32 (raw = direct)" queued stream auto
        ;;
    vhost)
        for VRW in seqread seqwrite read write; do
            ab_rounds "$ROUNDS" IOPS "vhost-user-blk over RAM, $VRW 4k QD32 (raw = direct)" queued stream auto
        done
        unset VRW
        ;;
    esac
done
