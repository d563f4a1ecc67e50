#!/usr/bin/env bash
# Per-CPU-second A/B of `udm bench` runs over a RAM disk: each BIN:MODE
# (a udm binary and a --dispatch mode) run once per round, the order
# reversed every other round; prints each one's median I/Os per
# CPU-second of the job's thread (ios / (cpu_user_s + cpu_sys_s)) and the
# median of its per-round ratios to the first, with the rounds' range.
#
#   scripts/bench/cpu-ab.sh ROUNDS RW QD BIN:MODE...
#   e.g. cp target/release/udm /tmp/udm-a
#        scripts/bench/cpu-ab.sh 7 randread 32 /tmp/udm-a:direct /tmp/udm-a:queued /tmp/udm-a:auto
#
# Env: SIZE (RAM disk, default 256M, prefilled), BS (default 4k), RT
# (seconds per run, default 1).
set -euo pipefail
R=$1; RW=$2; QD=$3; shift 3; CFG=("$@")
OUT=$(mktemp)
for r in $(seq $R); do
  order=("${CFG[@]}"); (( r % 2 )) || mapfile -t order < <(printf '%s\n' "${CFG[@]}" | tac)
  for c in "${order[@]}"; do b=${c%%:*}; m=${c##*:}
    v=$($b bench --dev d=ram:${SIZE:-256M} --prefill --target d --rw $RW --bs ${BS:-4k} --iodepth $QD --runtime ${RT:-1} --dispatch $m --json | python3 -c 'import json,sys; j=json.load(sys.stdin); print(j["ios"]/(j["cpu_user_s"]+j["cpu_sys_s"]))')
    echo "$r $c $v" >>$OUT
  done
done
python3 - "$OUT" "${CFG[@]}" <<'PY'
import sys,statistics as st
from collections import defaultdict
d=defaultdict(dict)
for l in open(sys.argv[1]):
    r,c,v=l.split(); d[int(r)][c]=float(v)
cfg=sys.argv[2:]
for c in cfg:
    med=st.median(d[r][c] for r in d)
    rat=sorted(d[r][c]/d[r][cfg[0]] for r in d)
    print(f"{c:28s} {med/1e6:6.2f} M/cpu-s  vs first {st.median(rat):.3f} ({rat[0]:.2f}-{rat[-1]:.2f})")
PY
rm -f $OUT
