#!/usr/bin/env bash
# vhost-user-blk in a Linux guest: udm serve and qemu-storage-daemon, each
# over its own 256 MiB file on /dev/shm (buffered, one queue each), attached
# to the same test guest (QEMU/TCG, scripts/guest/run.sh) as /dev/vda (udm)
# and /dev/vdb (qemu-storage-daemon). In the guest fio runs the same jobs on
# each, interleaved, a different device first each round: 4 KiB random
# reads at QD1 and QD32 (io_uring, O_DIRECT). Prints the guest's IOPS per
# round and the medians with udm/qsd.
#
# usage: scripts/bench/vhost-guest.sh [ROUNDS=3] [RUNTIME_S=5]
set -euo pipefail
ROUNDS=${1:-3}
RUNTIME=${2:-5}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
cargo build --release -q -p udm
UDM=$ROOT/target/release/udm
W=$(mktemp -d /dev/shm/udm-vhost-guest.XXXX)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$W"' EXIT
for s in udm qsd; do
    dd if=/dev/urandom of="$W/$s.img" bs=1M count=256 status=none
done
"$UDM" serve --dev "f=file:$W/udm.img,buffered" --vhost-user-blk "$W/udm.sock" --queues 1 \
    >"$W/udm.out" 2>&1 &
qemu-storage-daemon \
    --blockdev "driver=file,node-name=f0,filename=$W/qsd.img,cache.direct=off,aio=io_uring" \
    --blockdev driver=raw,node-name=d0,file=f0 \
    --export "type=vhost-user-blk,id=e0,node-name=d0,addr.type=unix,addr.path=$W/qsd.sock,writable=on,num-queues=1" \
    >"$W/qsd.out" 2>&1 &
for _ in $(seq 100); do [ -S "$W/udm.sock" ] && [ -S "$W/qsd.sock" ] && break; sleep 0.05; done
cat >"$W/test.sh" <<SH
for r in \$(seq $ROUNDS); do
    if [ \$((r % 2)) = 1 ]; then order="vda vdb"; else order="vdb vda"; fi
    for qd in 1 32; do
        for d in \$order; do
            iops=\$(fio --name=j --filename=/dev/\$d --direct=1 --ioengine=io_uring --rw=randread \
                --bs=4k --iodepth=\$qd --runtime=$RUNTIME --time_based --output-format=terse \
                | cut -d';' -f8)
            echo "BENCH \$d qd\$qd \$iops"
        done
    done
done
SH
GUEST_MEM=512M GUEST_QEMU_ARGS="-chardev socket,id=c0,path=$W/udm.sock -device vhost-user-blk-pci,chardev=c0,num-queues=1 -chardev socket,id=c1,path=$W/qsd.sock -device vhost-user-blk-pci,chardev=c1,num-queues=1" \
    UDM=$UDM scripts/guest/run.sh "$W/test.sh" | tee "$W/out" | grep 'BENCH' || true
python3 - "$W/out" <<'PY'
import statistics, sys
v = {}
for line in open(sys.argv[1]):
    if "BENCH" not in line:
        continue
    dev, qd, iops = line.split("BENCH", 1)[1].split()[:3]
    v.setdefault((qd, dev), []).append(float(iops))
for qd in ("qd1", "qd32"):
    u, q = v.get((qd, "vda"), []), v.get((qd, "vdb"), [])
    if u and q:
        mu, mq = statistics.median(u), statistics.median(q)
        print(f"randread 4k {qd}: udm {mu:.0f} IOPS, qemu-storage-daemon {mq:.0f} IOPS, udm/qsd {mu / mq:.2f}")
PY
