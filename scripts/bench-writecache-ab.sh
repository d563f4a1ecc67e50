#!/usr/bin/env bash
# Two (or more) udm builds side by side on one row of seed 001's table:
# 512 KiB random writes at QD32 over 400 MiB through writecache on RAM
# devices, at one cache block size, against the raw cache device. Each
# round runs raw, then every build, in turn; the report gives per build the
# median MiB/s and the median of its per-round ratios to raw (the rounds are
# ~50 ms each, so pairing each run with the raw run beside it cancels some
# of this VM's drift).
#   usage: scripts/bench-writecache-ab.sh ROUNDS BLOCK_SIZE UDM_BINARY...
#   e.g.:  scripts/bench-writecache-ab.sh 15 512 /tmp/udm-before target/release/udm
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,12p' "$0" >&2; exit 2; }
ROUNDS=$1 BS=$2
shift 2
RAW_UDM=$1
TABLE=(--rw randwrite --bs 512k --iodepth 32 --size 400M)
mib() { grep -o '"mib_per_s":[0-9.]*' | cut -d: -f2; }
OUT=$(mktemp)
trap 'rm -f "$OUT"' EXIT
for r in $(seq "$ROUNDS"); do
    echo "round $r/$ROUNDS" >&2
    line="raw $("$RAW_UDM" bench --json --dev c=ram:1G,prealloc --target c "${TABLE[@]}" | mib)"
    for b in "$@"; do
        line+=" $b $("$b" bench --json --dev o=ram:1G --dev c=ram:1G,prealloc \
            --dev "wc=0 2097152 writecache s o c $BS 0" --target wc "${TABLE[@]}" | mib)"
    done
    echo "$line" >>"$OUT"
done
python3 - "$OUT" "$BS" <<'EOF'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    f = line.split()
    for name, v in zip(f[0::2], f[1::2]):
        runs.setdefault(name, []).append(float(v))
raw = runs["raw"]
print(f"512k randwrite QD32, 400 MiB, cache block {sys.argv[2]} B, {len(raw)} rounds")
print(f"{'':40} {'MiB/s':>8} {'x raw':>7}")
for name, v in runs.items():
    ratio = statistics.median(a / b for a, b in zip(v, raw))
    print(f"{name:40} {statistics.median(v):8.0f} {ratio:7.3f}")
EOF
