#!/usr/bin/env bash
# Random 4 KiB writes at QD32, raid1 over two RAM legs against linear over
# one, at legs of 512 MiB and 1 GiB, and against linear over as much memory
# as the two legs together (the same footprint): what of raid1's write
# ratio is its path and what is the second leg's memory. `raid.sh`'s
# settings (--prefill, direct dispatch, regions kept dirty), runs of 1 s
# interleaved round by round (the order reverses every round); prints the
# median I/Os per CPU-second of each case and the medians of per-round
# ratios.
#   usage: scripts/bench/raid-footprint.sh [ROUNDS=5] [UDM_BINARY]
set -euo pipefail
ROUNDS=${1:-5}
UDM=${2:-target/release/udm}
COMMON=(--rw randwrite --iodepth 32 --runtime 1 --prefill --dispatch direct --json)
. "$(dirname "$0")/raid-stacks.sh"
declare -A CASE=(
    [lin_512M]=$(raid_lin 512M 1048576) [lin_1G]=$(raid_lin 1G 2097152) [lin_2G]=$(raid_lin 2G 4194304)
    [raid_512M]=$(raid_mirror 512M 1048576) [raid_1G]=$(raid_mirror 1G 2097152)
)
ORDER=(lin_512M raid_512M lin_1G raid_1G lin_2G)
OUT=$(mktemp)
trap 'rm -f "$OUT"' EXIT
for ((r = 0; r < ROUNDS; r++)); do
    if ((r % 2)); then seq=$(printf '%s\n' "${ORDER[@]}" | tac); else seq=$(printf '%s\n' "${ORDER[@]}"); fi
    for c in $seq; do
        v=$(eval "$UDM bench ${CASE[$c]} ${COMMON[*]}" | METRIC=cpu per_cpu)
        echo "$r $c $v" >>"$OUT"
    done
done
python3 - "$OUT" <<'PY'
import sys, statistics as st
by = {}
for r, c, v in (l.split() for l in open(sys.argv[1])):
    by.setdefault(c, {})[int(r)] = float(v)
for c in by:
    print(f"{c:10s} {st.median(by[c].values())/1e6:6.2f} M I/Os per CPU-second")
ratio = lambda a, b: st.median(by[a][r] / by[b][r] for r in by[a])
for a, b, what in [("raid_512M", "lin_512M", "legs of 512 MiB, linear over one"),
                   ("raid_1G", "lin_1G", "legs of 1 GiB, linear over one"),
                   ("raid_512M", "lin_1G", "legs of 512 MiB, linear over both's 1 GiB"),
                   ("raid_1G", "lin_2G", "legs of 1 GiB, linear over both's 2 GiB"),
                   ("lin_2G", "lin_1G", "linear over 2 GiB / over 1 GiB")]:
    print(f"{what:45s} {ratio(a, b):.3f}")
PY
