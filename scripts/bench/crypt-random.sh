#!/usr/bin/env bash
# 4 KiB random I/O at QD32 through crypt against linear over the same RAM.
#
#   scripts/bench/crypt-random.sh [ROUNDS] [RUNTIME_S] [SECTOR_SIZE]
#
# Each round, for randread then randwrite: `udm bench` over `ram:1G`
# (prefilled) through `linear` and through `crypt aes-xts-plain64` with a
# 512-bit key and `sector_size:SECTOR_SIZE` (default 4096, LUKS2's), one
# job, QD32; the two runs swap their order every round. Prints every run,
# then the medians of IOPS and of the per-round ratios crypt / linear.
# UDM=path runs a saved build; UDM_CRYPT_NO_VAES=1 the portable path.
set -euo pipefail
ROUNDS=${1:-5}
RUNTIME=${2:-2}
SECTOR=${3:-4096}
cd "$(dirname "$0")/../.."
if [[ -z ${UDM:-} ]]; then
    cargo build --release -q -p udm
    UDM=target/release/udm
fi
KEY=$(python3 -c "import os; print(os.urandom(64).hex())")
out=$(mktemp)
trap 'rm -f "$out"' EXIT

iops() { # linear|crypt RW
    local t="0 2097152 linear r 0"
    [[ $1 == crypt ]] && t="0 2097152 crypt aes-xts-plain64 $KEY 0 r 0 1 sector_size:$SECTOR"
    "$UDM" bench --dev r=ram:1G --dev "d=$t" --target d --rw "$2" --bs 4k --iodepth 32 \
        --runtime "$RUNTIME" --prefill --json |
        python3 -c "import json,sys; print(json.load(sys.stdin)['iops'])"
}

for r in $(seq "$ROUNDS"); do
    echo "round $r/$ROUNDS (load $(cut -d' ' -f1 /proc/loadavg))" >&2
    order=(linear crypt)
    if (( r % 2 == 0 )); then order=(crypt linear); fi
    for rw in randread randwrite; do
        for t in "${order[@]}"; do
            echo "$r $rw $t $(iops "$t" "$rw")" | tee -a "$out"
        done
    done
done

python3 - "$out" <<'PY'
import sys, statistics as st
rows = [l.split() for l in open(sys.argv[1])]
v = {(r, rw, t): float(x) for r, rw, t, x in rows}
rounds = sorted({r for r, _, _ in v})
print("\n| rw | linear IOPS (median) | crypt IOPS (median) | crypt / linear (median of per-round ratios) | lowest round |")
print("|---|---|---|---|---|")
for rw in ("randread", "randwrite"):
    lin = [v[(r, rw, "linear")] for r in rounds]
    cr = [v[(r, rw, "crypt")] for r in rounds]
    ratios = [c / l for c, l in zip(cr, lin)]
    print(f"| {rw} | {st.median(lin)/1e3:.0f}k | {st.median(cr)/1e3:.0f}k | **{st.median(ratios):.2f}** | {min(ratios):.2f} |")
PY
