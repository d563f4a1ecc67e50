#!/usr/bin/env bash
# udm over an RBD image against fio's own rbd engine on the same image:
# 4 KiB randread and randwrite at QD32, interleaved (udm-rbd, udm-linear,
# fio, … per round); each figure is the median of ROUNDS runs. CPU is the
# whole process's (user + system, librbd's threads included) per I/O,
# from getrusage of the child.
#
# Uses the cluster $CEPH_CONF names, or starts a one-node cluster with
# scripts/ceph-cluster.sh in a temporary directory (stopped at exit).
# Also: writecache with a RAM cache over the image, 4 KiB randwrite QD32.
# SPLIT=1 (with the cluster this script starts) puts the monitor and OSD on
# CPU 1 and the clients on CPU 0, so that neither client's CPU time comes
# out of the OSD's.
# UDM=path runs that binary instead of building this tree's; ONLY picks
# cases, comma-separated (e.g. ONLY='randwrite udm,randwrite udm-wc'; "vs
# fio" is then 0 unless the fio case is among them).
#   usage: scripts/bench/rbd-vs-fio.sh [ROUNDS] [RUNTIME_S]
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${1:-5}
RT=${2:-5}
fio --enghelp 2>/dev/null | grep -qw rbd || { echo "bench/rbd-vs-fio: this fio has no rbd engine" >&2; exit 2; }
if [ -z "${UDM:-}" ]; then
    cargo build --release -q -p udm
    UDM=./target/release/udm
fi
if [ -z "${CEPH_CONF:-}" ]; then
    DIR=$(mktemp -d /tmp/udm-rbd-bench.XXXXXX)
    trap 'scripts/ceph-cluster.sh stop "$DIR"; rm -rf "$DIR"' EXIT
    eval "$(CEPH_CPUS=${SPLIT:+1} CEPH_MON_PORT=${CEPH_MON_PORT:-16789} scripts/ceph-cluster.sh start "$DIR")"
fi
export CEPH_CONF
IMG=bench$$
SIZE_MB=256
rbd create --size ${SIZE_MB}M "rbd/$IMG"
trap 'rbd rm --no-progress "rbd/$IMG" >/dev/null 2>&1 || true; [ -n "${DIR:-}" ] && { scripts/ceph-cluster.sh stop "$DIR"; rm -rf "$DIR"; }' EXIT
# Every object written, so reads read data.
rbd bench --io-type write --io-size 4M --io-threads 4 --io-total ${SIZE_MB}M --io-pattern seq "rbd/$IMG" >/dev/null
SECTORS=$((SIZE_MB * 2048))

# Runs a command, prints "IOPS CPU_US_PER_IO" (CPU of the whole child).
run() { # kind rw
    python3 - "$@" <<'PY'
import json, os, resource, subprocess, sys
kind, rw, udm, img, rt, sectors = sys.argv[1:7]
if kind == "fio":
    cmd = ["fio", "--name=cmp", "--ioengine=rbd", "--clientname=admin", "--pool=rbd",
           f"--rbdname={img}", f"--rw={rw}", "--bs=4k", "--iodepth=32", f"--runtime={rt}",
           "--time_based", "--output-format=json"]
else:
    devs = ["--dev", f"r=rbd:rbd/{img}"]
    if kind == "udm-linear":
        devs += ["--dev", f"lin=0 {sectors} linear r 0"]; target = "lin"
    elif kind == "udm-wc":
        devs += ["--dev", "c=ram:256M", "--dev", f"wc=0 {sectors} writecache s r c 4096 0"]; target = "wc"
    else:
        target = "r"
    cmd = [udm, "bench", *devs, "--target", target, "--rw", rw, "--bs", "4k",
           "--iodepth", "32", "--runtime", rt, "--json"]
if os.environ.get("SPLIT"):
    cmd = ["taskset", "-c", "0", *cmd]
out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
cpu = ru.ru_utime + ru.ru_stime
if kind == "fio":
    j = json.loads(out)["jobs"][0]
    iops = j["read"]["iops"] + j["write"]["iops"]
    ios = j["read"]["total_ios"] + j["write"]["total_ios"]
else:
    j = json.loads(out[out.index("{"):])
    iops, ios = j["iops"], j["ios"]
print(f"{iops:.0f} {cpu / max(ios, 1) * 1e6:.1f}")
PY
}
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
declare -A I C
CASES=("randread udm" "randread udm-linear" "randread fio" "randwrite udm" "randwrite udm-linear" "randwrite fio" "randwrite udm-wc")
if [ -n "${ONLY:-}" ]; then IFS=, read -r -a CASES <<<"$ONLY"; fi
for r in $(seq "$ROUNDS"); do
    echo "round $r/$ROUNDS" >&2
    for c in "${CASES[@]}"; do
        read -r rw kind <<<"$c"
        read -r iops cpu < <(run "$kind" "$rw" "$UDM" "$IMG" "$RT" "$SECTORS")
        I["$c"]+="$iops "; C["$c"]+="$cpu "
    done
done
printf '\n%-22s %10s %14s %10s\n' "case" "IOPS" "CPU us/IO" "vs fio"
for c in "${CASES[@]}"; do
    read -r rw _ <<<"$c"
    i=$(echo "${I[$c]}" | median); cpu=$(echo "${C[$c]}" | median)
    f=$(echo "${I[$rw fio]:-}" | median || true)
    printf '%-22s %10.0f %14.1f %10.3f\n' "$c" "$i" "$cpu" "$([ -n "$f" ] && echo "$i / $f" | bc -l || echo 0)"
done
