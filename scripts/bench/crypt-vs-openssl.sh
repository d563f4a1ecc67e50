#!/usr/bin/env bash
# The crypt target against OpenSSL's AES-XTS, one reactor, over RAM.
#
#   scripts/bench/crypt-vs-openssl.sh [ROUNDS] [RUNTIME_S]
#
# Each round, for 4096 and then 512-byte sectors: `openssl speed -elapsed
# -evp aes-256-xts -bytes N`, then `udm bench` 128 KiB sequential writes
# and reads (QD4, over a prefilled disk) through `crypt aes-xts-plain64` with a
# 512-bit key and `sector_size:N` over `ram:1G`, on the VAES code and on
# the portable path (UDM_CRYPT_NO_VAES=1); the udm runs reverse their order
# every round. Prints every run, then the medians of GB/s and of the
# per-round ratios to the openssl run beside them. UDM=path runs a saved
# build.
set -euo pipefail
ROUNDS=${1:-3}
RUNTIME=${2:-3}
cd "$(dirname "$0")/../.."
if [[ -z ${UDM:-} ]]; then
    cargo build --release -q -p udm
    UDM=target/release/udm
fi
KEY=$(python3 -c "import os; print(os.urandom(64).hex())")
out=$(mktemp)
trap 'rm -f "$out"' EXIT

udm_gbs() { # PATH RW SECTOR
    local env=()
    [[ $1 == portable ]] && env=(UDM_CRYPT_NO_VAES=1)
    # Prefilled for writes too: a fresh RAM disk's first-touch page faults
    # would be measured, not the data path.
    local pre=(--prefill)
    env "${env[@]}" "$UDM" bench --dev r=ram:1G \
        --dev "c=0 2097152 crypt aes-xts-plain64 $KEY 0 r 0 1 sector_size:$3" \
        --target c --rw "$2" --bs 128k --iodepth 4 --runtime "$RUNTIME" "${pre[@]}" --json |
        python3 -c "import json,sys; print(json.load(sys.stdin)['mib_per_s']*1048576/1e9)"
}

for r in $(seq "$ROUNDS"); do
    echo "round $r/$ROUNDS (load $(cut -d' ' -f1 /proc/loadavg))" >&2
    runs=(vaes:write vaes:read portable:write portable:read)
    if (( r % 2 == 0 )); then runs=(portable:read portable:write vaes:read vaes:write); fi
    for s in 4096 512; do
        o=$(openssl speed -elapsed -evp aes-256-xts -bytes "$s" 2>/dev/null | tail -1 |
            awk '{sub("k","",$2); print $2*1000/1e9}')
        echo "$r $s openssl - $o" | tee -a "$out"
        for run in "${runs[@]}"; do
            echo "$r $s ${run%%:*} ${run##*:} $(udm_gbs "${run%%:*}" "${run##*:}" "$s")" | tee -a "$out"
        done
    done
done

python3 - "$out" <<'PY'
import sys, statistics as st
rows = [l.split() for l in open(sys.argv[1])]
ossl = {(r, s): float(v) for r, s, p, rw, v in rows if p == "openssl"}
print("\n| sectors | path | rw | GB/s (median) | / openssl (median of per-round ratios) | openssl GB/s (median) |")
print("|---|---|---|---|---|---|")
for s in ("4096", "512"):
    o = st.median(v for (r, ss), v in ossl.items() if ss == s)
    for p in ("vaes", "portable"):
        for rw in ("write", "read"):
            vs = [(r, float(v)) for r, ss, pp, w, v in rows if ss == s and pp == p and w == rw]
            g = st.median(v for _, v in vs)
            ratio = st.median(v / ossl[(r, s)] for r, v in vs)
            print(f"| {s} B | {p} | {rw} | {g:.2f} | {ratio:.2f}x (min {min(v / ossl[(r, s)] for r, v in vs):.2f}) | {o:.2f} |")
PY
