#!/usr/bin/env bash
# Seed 004's table: `udm bench` with direct, queued, stream and auto dispatch, 4 KiB
# at QD32, interleaved rounds (ab-rounds.sh), medians (ab-report.py; "raw"
# is direct, each ratio is to direct).
#
#   scripts/bench/dispatch-ab.sh [ROUNDS]
#
# Rows: sequential and random reads and writes on a RAM disk (prefilled,
# unmeasured), and sequential writes on an O_DIRECT file on this machine's
# disk. Env: RUNTIME (seconds per run, default 3), FILE (default
# /var/tmp/udm-dispatch.img, written once in full before the rounds),
# ROWS (default "ram file").
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/bench/ab-rounds.sh
ROUNDS=${1:-7}
RUNTIME=${RUNTIME:-3}
FILE=${FILE:-/var/tmp/udm-dispatch.img}
ROWS=${ROWS:-ram file}
cargo build --release -q -p udm
UDM=target/release/udm
one() {
    local mode=$1
    [ "$mode" = raw ] && mode=direct
    "$UDM" bench "${DEV[@]}" --target d --rw "$RW" --bs 4k --iodepth 32 \
        --runtime "$RUNTIME" --dispatch "$mode" "${EXTRA[@]}" --json |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["iops"])'
}
for row in $ROWS; do
    case $row in
    ram)
        DEV=(--dev d=ram:256M)
        EXTRA=(--prefill)
        for RW in read write randread randwrite; do
            ab_rounds "$ROUNDS" IOPS "RAM, $RW 4k QD32 (raw = direct)" queued stream auto
        done
        ;;
    file)
        if [ ! -s "$FILE" ] || [ "$(stat -c %s "$FILE")" -lt $((1 << 30)) ]; then
            dd if=/dev/zero of="$FILE" bs=1M count=1024 oflag=direct status=none
        fi
        DEV=(--dev "d=file:$FILE")
        EXTRA=()
        RW=write
        ab_rounds "$ROUNDS" IOPS "O_DIRECT file on $(df --output=source "$FILE" | tail -1), write 4k QD32 (raw = direct)" queued stream auto
        ;;
    esac
done
