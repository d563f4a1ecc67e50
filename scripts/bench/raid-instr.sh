#!/usr/bin/env bash
# Instructions per 4 KiB random I/O at QD32, one reactor, counted by
# callgrind (scripts/bench/instr-per-io.sh): raid1 over two RAM legs (with
# metadata) against linear over one, writes and reads. Only the job's
# thread counts (ONLY=Ring::reap). Valgrind holds its lock across a
# sleeping io_uring_enter, so no thread here sleeps in one:
# - the raid worker spins (UDM_RAID_WORKER_POLL=1); its thread is left out;
# - the job's reactor polls (--poll): asleep while its writes wait for the
#   worker to mark their region, it would stop the worker for good;
# - one region spans the array (region_size): the first write marks it and
#   the rest find it dirty, as in the steady state (daemon_sleep keeps it
#   so), and the job's spin while the worker marks it is the same in both
#   runs of the slope, as valgrind's fair scheduling (--fair-sched=yes)
#   hands the worker its turn at once.
#   usage: scripts/bench/raid-instr.sh [UDM_BINARY]
set -euo pipefail
cd "$(dirname "$0")/../.."
export UDM=${1:-target/release/udm} UDM_RAID_WORKER_POLL=1 ONLY=Ring::reap
export VALGRIND_OPTS="${VALGRIND_OPTS:-} --fair-sched=yes"
LIN=(--dev ram0=ram:1G --dev 'lin=0 2097152 linear ram0 0' --target lin)
RAID=(--dev m0=ram:1M --dev d0=ram:1G --dev m1=ram:1M --dev d1=ram:1G
      --dev 'r=0 2097152 raid raid1 6 0 nosync daemon_sleep 100000 region_size 2097152 2 m0 d0 m1 d1' --target r)
for rw in randwrite randread; do
    l=$(scripts/bench/instr-per-io.sh "${LIN[@]}" --rw $rw --iodepth 32 --dispatch direct --poll | cut -d' ' -f1)
    r=$(scripts/bench/instr-per-io.sh "${RAID[@]}" --rw $rw --iodepth 32 --dispatch direct --poll | cut -d' ' -f1)
    python3 -c "print(f'$rw: linear $l, raid1 $r instructions per I/O; linear/raid1 {$l/$r:.2f}')"
done
