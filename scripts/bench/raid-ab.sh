#!/usr/bin/env bash
# raid.sh's cases for two udm binaries A and B side by side: each round
# runs every case with A and with B (the order of the two reverses every
# round); prints per case the medians of I/Os per CPU-second (METRIC=iops:
# of IOPS) and of the per-round ratio B/A, and for each binary the
# medians of raid1 / linear. On a host other work shares, the ratios of
# one round are what to read.
#   CASES="lin_read raid_read lin_write raid_write lin_rw raid_rw raid_read_2jobs"
#   SIZE=1G SECTORS=2097152 (each leg, and linear's device)
#   usage: scripts/bench/raid-ab.sh ROUNDS UDM_A UDM_B
set -euo pipefail
ROUNDS=${1:-5}; A=${2:?usage: raid-ab.sh ROUNDS UDM_A UDM_B}; B=${3:?usage: raid-ab.sh ROUNDS UDM_A UDM_B}
CASES=${CASES:-"lin_read raid_read lin_write raid_write raid_read_2jobs"}
COMMON=(--iodepth 32 --runtime 1 --prefill --dispatch direct --json)
. "$(dirname "$0")/raid-stacks.sh"
S=${SIZE:-1G}; SEC=${SECTORS:-2097152}
raid_cases "$S" "$SEC"
OUT=$(mktemp); trap 'rm -f "$OUT"' EXIT
for ((r = 0; r < ROUNDS; r++)); do
  if ((r % 2)); then bins="B A"; else bins="A B"; fi
  for c in $CASES; do for x in $bins; do
    bin=${!x}
    v=$(eval "$bin bench ${CASE[$c]} ${COMMON[*]}" | per_cpu)
    echo "$r $x $c $v" >>"$OUT"
  done; done
done
python3 - "$OUT" <<'PY'
import sys, statistics as st
d={}
for l in open(sys.argv[1]):
    r,x,c,v=l.split(); d[(int(r),x,c)]=float(v)
rounds=sorted({k[0] for k in d}); cases=[]
for k in d:
    if k[2] not in cases: cases.append(k[2])
med=lambda f: st.median([f(r) for r in rounds])
for c in cases:
    print(f"{c:16s} A {med(lambda r:d[(r,'A',c)])/1e6:.3f}M  B {med(lambda r:d[(r,'B',c)])/1e6:.3f}M  B/A {med(lambda r:d[(r,'B',c)]/d[(r,'A',c)]):.3f}")
for x in "AB":
  for a,b in [("raid_read","lin_read"),("raid_write","lin_write"),("raid_read_2jobs","lin_read"),("raid_rw","lin_rw")]:
    if a in cases and b in cases:
      print(f"{x}: {a}/{b} {med(lambda r:d[(r,x,a)]/d[(r,x,b)]):.3f}")
PY
