#!/usr/bin/env bash
# raid1 over two RAM legs against linear over one, 4 KiB at QD32, runs
# interleaved round by round (the order reverses every round): random
# reads and writes with one job, random reads with two jobs (against
# linear's one job), and random writes with and without the bitmap (legs
# with metadata devices, regions already dirty: daemon_sleep keeps them
# so, against legs with `-` for metadata). Prints per case the median
# IOPS over the rounds and the median of the per-round ratios, of IOPS and
# of I/Os per CPU-second (the process's user and system time: on a host
# other work shares, the cost per I/O, which that work does not change as
# much as it changes IOPS).
#   UDM_RAID_BENCH_CASES="lin_read raid_read ..." runs only those cases.
#   usage: scripts/bench/raid.sh [ROUNDS] [UDM_BINARY]
set -euo pipefail
ROUNDS=${1:-7}
UDM=${2:-target/release/udm}
COMMON=(--iodepth 32 --runtime 1 --prefill --dispatch direct --json)
. "$(dirname "$0")/raid-stacks.sh"
raid_cases 1G 2097152
iops() { python3 -c 'import json,sys; j=json.load(sys.stdin); print(j["iops"], j["ios"]/max(0.01, j["cpu_user_s"]+j["cpu_sys_s"]))'; }
read -r -a ORDER <<<"${UDM_RAID_BENCH_CASES:-lin_read raid_read lin_write raid_write nometa_write raid_read_2jobs}"
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
by, cpu = {}, {}
for r, c, v, k in rows:
    by.setdefault(c, {})[int(r)] = float(v)
    cpu.setdefault(c, {})[int(r)] = float(k)
med = lambda c: st.median(by[c].values())
ratio = lambda a, b, d=by: st.median(d[a][r] / d[b][r] for r in d[a])
for c in by:
    print(f"{c:18s} {med(c)/1e3:8.0f}k IOPS {st.median(cpu[c].values())/1e3:8.0f}k I/Os per CPU-second")
def show(what, a, b, one_minus=False):
    if a in by and b in by:
        x, y = ratio(a, b), ratio(a, b, cpu)
        if one_minus:
            x, y = 1 - x, 1 - y
        print(f"{what:42s} {x:.3f} (IOPS)  {y:.3f} (per CPU-second)")
show("raid1/linear randread, 1 job:", "raid_read", "lin_read")
show("raid1/linear randwrite, 1 job:", "raid_write", "lin_write")
show("raid1 2 jobs / linear 1 job randread:", "raid_read_2jobs", "lin_read")
show("raid1 2 jobs / raid1 1 job randread:", "raid_read_2jobs", "raid_read")
show("bitmap cost, randwrite (1 - with/without):", "raid_write", "nometa_write", True)
PY
rm -f "$OUT"
