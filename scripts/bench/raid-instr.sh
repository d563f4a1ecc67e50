#!/usr/bin/env bash
# Instructions per 4 KiB random I/O at QD32, one reactor, counted by
# callgrind (scripts/bench/instr-per-io.sh, which the host's load does not
# change): raid1 over two RAM legs (with metadata, regions already dirty)
# against linear over one, writes and reads. The raid worker spins instead
# of sleeping (UDM_RAID_WORKER_POLL=1: valgrind would otherwise stop every
# thread while it sleeps) and is left out of the count.
#   usage: scripts/bench/raid-instr.sh [UDM_BINARY]
set -euo pipefail
cd "$(dirname "$0")/../.."
export UDM=${1:-target/release/udm} UDM_RAID_WORKER_POLL=1
LIN=(--dev ram0=ram:1G --dev 'lin=0 2097152 linear ram0 0' --target lin)
RAID=(--dev m0=ram:1M --dev d0=ram:1G --dev m1=ram:1M --dev d1=ram:1G
      --dev 'r=0 2097152 raid raid1 4 0 nosync daemon_sleep 100000 2 m0 d0 m1 d1' --target r)
for rw in randwrite randread; do
    l=$(scripts/bench/instr-per-io.sh "${LIN[@]}" --rw $rw --iodepth 32 --dispatch direct | cut -d' ' -f1)
    r=$(scripts/bench/instr-per-io.sh "${RAID[@]}" --rw $rw --iodepth 32 --dispatch direct | cut -d' ' -f1)
    python3 -c "print(f'$rw: linear $l, raid1 $r instructions per I/O; linear/raid1 {$l/$r:.2f}')"
done
