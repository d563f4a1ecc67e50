#!/usr/bin/env bash
# raid1 over two RAM legs against linear over one, 4 KiB at QD32, runs
# interleaved round by round (the order reverses every round): random
# reads and writes with one job, random reads with two jobs (against
# linear's one job), and random writes with and without the bitmap (legs
# with metadata devices, regions already dirty: daemon_sleep keeps them
# so, against legs with `-` for metadata). Prints per case the median
# IOPS over the rounds and the median of the per-round ratios.
#   usage: scripts/bench/raid.sh [ROUNDS] [UDM_BINARY]
set -euo pipefail
ROUNDS=${1:-7}
UDM=${2:-target/release/udm}
COMMON=(--iodepth 32 --runtime 1 --prefill --dispatch direct --json)
LIN=(--dev ram0=ram:1G,prealloc --dev 'lin=0 2097152 linear ram0 0' --target lin)
RAID=(--dev m0=ram:1M --dev d0=ram:1G,prealloc --dev m1=ram:1M --dev d1=ram:1G,prealloc
      --dev 'r=0 2097152 raid raid1 4 0 nosync daemon_sleep 100000 2 m0 d0 m1 d1' --target r)
NOMETA=(--dev d0=ram:1G,prealloc --dev d1=ram:1G,prealloc
        --dev 'r=0 2097152 raid raid1 2 0 nosync 2 - d0 - d1' --target r)
iops() { grep -o '"iops":[0-9.]*' | cut -d: -f2; }
declare -A CASE=(
    [lin_read]="${LIN[*]@Q} --rw randread"
    [raid_read]="${RAID[*]@Q} --rw randread"
    [lin_write]="${LIN[*]@Q} --rw randwrite"
    [raid_write]="${RAID[*]@Q} --rw randwrite"
    [nometa_write]="${NOMETA[*]@Q} --rw randwrite"
    [raid_read_2jobs]="${RAID[*]@Q} --rw randread --jobs 2"
)
ORDER=(lin_read raid_read lin_write raid_write nometa_write raid_read_2jobs)
OUT=$(mktemp)
for ((r = 0; r < ROUNDS; r++)); do
    if ((r % 2)); then seq=$(printf '%s\n' "${ORDER[@]}" | tac); else seq=$(printf '%s\n' "${ORDER[@]}"); fi
    for c in $seq; do
        v=$(eval "$UDM bench ${CASE[$c]} ${COMMON[*]}" | iops)
        echo "$r $c $v" >>"$OUT"
    done
done
python3 - "$OUT" <<'PY'
import sys, statistics as st
rows = [l.split() for l in open(sys.argv[1])]
by = {}
for r, c, v in rows:
    by.setdefault(c, {})[int(r)] = float(v)
med = lambda c: st.median(by[c].values())
ratio = lambda a, b: st.median(by[a][r] / by[b][r] for r in by[a])
for c in by:
    print(f"{c:18s} {med(c)/1e3:8.0f}k IOPS")
print(f"raid1/linear randread, 1 job:         {ratio('raid_read', 'lin_read'):.2f}x")
print(f"raid1/linear randwrite, 1 job:        {ratio('raid_write', 'lin_write'):.2f}x")
print(f"raid1 2 jobs / linear 1 job randread: {ratio('raid_read_2jobs', 'lin_read'):.2f}x")
print(f"bitmap cost, randwrite (1 - with/without): {1 - ratio('raid_write', 'nometa_write'):.3f}")
PY
rm -f "$OUT"
