#!/usr/bin/env bash
# NBD servers side by side, driven by the same fio nbd jobs, interleaved:
#   udm serve (ram under linear), nbdkit memory + offset filter, qemu-nbd and
#   qemu-storage-daemon (a raw file on /dev/shm), and nbdkit null (the
#   client's ceiling).
# Jobs: 4k randread QD1, 4k randread QD32, 4k randwrite QD32, 128k read QD8.
# Per server and job: IOPS, p99 completion latency, and the server's CPU
# seconds per million I/Os (utime+stime of /proc/PID/stat, all threads).
# Each round starts every server in turn (a different one first each round)
# and runs every job on it; the report gives the median over rounds.
#
# usage: scripts/bench/nbd.sh [ROUNDS=3] [RUNTIME_S=4]
#   SERVERS="udm udm-null nbdkit-null" JOBS="randwrite-4k-qd32" picks a subset
#   (udm-null: udm over the null backend, the server's cost without storing data;
#   nbd-floor: exports/examples/nbd_floor.rs, the least a server can do per request;
#   udm-b: the udm binary at $UDM_B, to compare two builds side by side;
#   udm+OPTS: udm serve with OPTS, commas for spaces, e.g. udm+--adaptive,100;
#   udm-b+OPTS: the same for the build at $UDM_B)
#   UDM=/path/to/udm measures that binary as "udm" (default: builds target/release/udm)
#   PIN=same runs server and fio on CPU 0, PIN=split the server on CPU 1 and fio
#   on CPU 0. Unpinned (the default), QD1 figures follow where the scheduler puts
#   the two: on one vCPU a request costs no cross-CPU wakeup, on two it costs two
#   wakeups of an idle vCPU (tens of microseconds each in a VM), so a run's QD1
#   IOPS swing with placement; PIN shows each case on its own.
# Each server's 1 GiB is written over once before its jobs (PREFILL=0 skips
# it), so reads return stored data: a read of never-written space is a
# zero fill in every server and measures no data path.
# After its jobs, each server sits idle for IDLE_S seconds (default 2) with
# its connection closed; "idle CPU%" is what it burned meanwhile (a server
# that spins when nobody asked shows here).
# The "other%" column is the CPU that neither the server nor fio used during the
# job (other processes on the machine), in % of one CPU: rows with a high value
# were measured on a busy machine. "fio%" is the client's own CPU: near 100%
# of a CPU, fio is the ceiling and a faster server cannot raise the IOPS.
# Last, each server against the first in SERVERS: medians of per-round ratios.
set -euo pipefail
ROUNDS=${1:-3}
RUNTIME=${2:-4}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
if [ -z "${UDM:-}" ]; then
    UDM=$ROOT/target/release/udm
    (cd "$ROOT" && cargo build --release -q -p udm)
fi
case " ${SERVERS:-} " in
*" nbd-floor "*) (cd "$ROOT" && cargo build --release -q -p udm-exports --example nbd_floor) ;;
esac
for t in fio nbdkit qemu-nbd qemu-storage-daemon; do
    command -v $t >/dev/null || { echo "bench/nbd: $t missing (scripts/setup.sh installs it)" >&2; exit 2; }
done
W=$(mktemp -d /tmp/udm-bench-nbd.XXXXXX)
IMG=/dev/shm/udm-bench-nbd-$$.raw
PID=
cleanup() {
    [ -n "$PID" ] && kill "$PID" 2>/dev/null && wait "$PID" 2>/dev/null || true
    rm -rf "$W" "$IMG"
}
trap cleanup EXIT
truncate -s 1G "$IMG"
: >"$W/idle.tsv"
TCK=$(getconf CLK_TCK)
SERVERS=${SERVERS:-"udm udm-interrupt nbdkit-memory qemu-nbd qsd nbdkit-null"}
case ${PIN:-} in
"") SPIN=(); CPIN=() ;;
same) SPIN=(taskset -c 0); CPIN=(taskset -c 0) ;;
split) SPIN=(taskset -c 1); CPIN=(taskset -c 0) ;;
*) echo "bench/nbd: PIN=same or PIN=split" >&2; exit 2 ;;
esac
JOBS=${JOBS:-"randread-4k-qd1 randread-4k-qd32 randwrite-4k-qd32 read-128k-qd8"}

start() { # server -> sets PID and URI
    local s=$1 sock=$W/$1.sock
    rm -f "$sock"
    case $s in
    udm)
        "${SPIN[@]}" "$UDM" serve --dev ram0=ram:1G --dev 'lin=0 2097152 linear ram0 0' \
            --listen "unix:$sock" >"$W/$s.log" 2>&1 &
        URI="nbd+unix:///lin?socket=$sock" ;;
    udm-b) # another build of udm, for A/B runs: UDM_B=/path/to/udm
        "${SPIN[@]}" "${UDM_B:?udm-b needs UDM_B=/path/to/udm}" serve --dev ram0=ram:1G \
            --dev 'lin=0 2097152 linear ram0 0' --listen "unix:$sock" >"$W/$s.log" 2>&1 &
        URI="nbd+unix:///lin?socket=$sock" ;;
    udm+* | udm-b+*) # udm serve with extra options, commas for spaces: udm+--adaptive,100
        local extra bin=$UDM
        [ "${s%%+*}" = udm-b ] && bin=${UDM_B:?udm-b needs UDM_B=/path/to/udm}
        read -r -a extra <<<"${s#*+}"
        extra=(${extra[@]//,/ })
        "${SPIN[@]}" "$bin" serve "${extra[@]}" --dev ram0=ram:1G --dev 'lin=0 2097152 linear ram0 0' \
            --listen "unix:$sock" >"$W/$s.log" 2>&1 &
        URI="nbd+unix:///lin?socket=$sock" ;;
    udm-interrupt) # reactors always sleep when idle (the default spins adaptively)
        "${SPIN[@]}" "$UDM" serve --interrupt --dev ram0=ram:1G --dev 'lin=0 2097152 linear ram0 0' \
            --listen "unix:$sock" >"$W/$s.log" 2>&1 &
        URI="nbd+unix:///lin?socket=$sock" ;;
    udm-hybrid) # reactors spin 50 us after their last work, then sleep
        "${SPIN[@]}" "$UDM" serve --hybrid 50 --dev ram0=ram:1G --dev 'lin=0 2097152 linear ram0 0' \
            --listen "unix:$sock" >"$W/$s.log" 2>&1 &
        URI="nbd+unix:///lin?socket=$sock" ;;
    udm-null) # the server's own cost: no data stored
        "${SPIN[@]}" "$UDM" serve --dev null0=null:1G --dev 'lin=0 2097152 linear null0 0' \
            --listen "unix:$sock" >"$W/$s.log" 2>&1 &
        URI="nbd+unix:///lin?socket=$sock" ;;
    nbd-floor) # the least a server can do (exports/examples/nbd_floor.rs)
        "${SPIN[@]}" "$ROOT/target/release/examples/nbd_floor" "$sock" 1024 >"$W/$s.log" 2>&1 &
        URI="nbd+unix:///?socket=$sock" ;;
    nbdkit-memory)
        "${SPIN[@]}" nbdkit -f -U "$sock" --filter=offset memory 1G offset=0 range=1G >"$W/$s.log" 2>&1 &
        URI="nbd+unix:///?socket=$sock" ;;
    nbdkit-null)
        "${SPIN[@]}" nbdkit -f -U "$sock" null 1G >"$W/$s.log" 2>&1 &
        URI="nbd+unix:///?socket=$sock" ;;
    qemu-nbd)
        "${SPIN[@]}" qemu-nbd -f raw -t -e 4 --socket="$sock" "$IMG" >"$W/$s.log" 2>&1 &
        URI="nbd+unix:///?socket=$sock" ;;
    qsd)
        "${SPIN[@]}" qemu-storage-daemon \
            --blockdev driver=file,node-name=file0,filename="$IMG" \
            --blockdev driver=raw,node-name=disk0,file=file0 \
            --nbd-server addr.type=unix,addr.path="$sock" \
            --export type=nbd,id=e0,node-name=disk0,name=disk0,writable=on >"$W/$s.log" 2>&1 &
        URI="nbd+unix:///disk0?socket=$sock" ;;
    esac
    PID=$!
    for _ in $(seq 200); do [ -S "$sock" ] && return 0; sleep 0.05; done
    echo "bench/nbd: $s did not start:" >&2; cat "$W/$s.log" >&2; exit 1
}

stop() { kill "$PID" 2>/dev/null; wait "$PID" 2>/dev/null || true; PID=; }

cpu_ticks() { awk '{print $14 + $15}' "/proc/$PID/stat"; }
busy_ticks() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8 + $9}' /proc/stat; }

run_job() { # job -> fio json on stdout
    local rw bs qd
    IFS=- read -r rw bs qd <<<"$1"
    "${CPIN[@]}" fio --name=j --ioengine=nbd --uri="$URI" --rw="$rw" --bs="$bs" --iodepth="${qd#qd}" \
        --size=1G --time_based --runtime="$RUNTIME" --norandommap --randrepeat=0 \
        --output-format=json
}

RES=$W/results.tsv
read -r -a SRV <<<"$SERVERS"
for r in $(seq "$ROUNDS"); do
    # Each round starts with a different server, so no server always runs
    # first: in two runs the first server's 4 KiB writes measured 0.8x of
    # the same build run second, and swapping the order evened them.
    ORDER=("${SRV[@]:$(((r - 1) % ${#SRV[@]}))}" "${SRV[@]:0:$(((r - 1) % ${#SRV[@]}))}")
    for s in "${ORDER[@]}"; do
        start "$s"
        if [ "${PREFILL:-1}" = 1 ]; then
            "${CPIN[@]}" fio --name=fill --ioengine=nbd --uri="$URI" --rw=write --bs=1m --iodepth=4 \
                --size=1G --output-format=terse >/dev/null 2>&1
        fi
        for j in $JOBS; do
            c0=$(cpu_ticks); b0=$(busy_ticks)
            run_job "$j" >"$W/out.json"
            c1=$(cpu_ticks); b1=$(busy_ticks)
            python3 - "$W/out.json" "$s" "$j" "$r" "$c0" "$c1" "$TCK" "$b0" "$b1" "$RUNTIME" >>"$RES" <<'PY'
import json, sys
f, s, j, r, c0, c1, tck, b0, b1, rt = sys.argv[1:]
t = open(f).read()
# the nbd engine prints a line of its own before the JSON
d = json.loads(t[t.index("{"):])["jobs"][0]
side = d["read"] if d["read"]["total_ios"] > 0 else d["write"]
ios = side["total_ios"]
p99 = side["clat_ns"]["percentile"].get("99.000000", 0) / 1000
cpu = (int(c1) - int(c0)) / int(tck)
# CPU used by neither the server nor fio (fio's usr/sys are % of the run)
fio_cpu = (d["usr_cpu"] + d["sys_cpu"]) / 100 * float(rt)
other = ((int(b1) - int(b0)) / int(tck) - cpu - fio_cpu) / float(rt) * 100
print(f"{s}\t{j}\t{r}\t{side['iops']:.0f}\t{p99:.1f}\t{cpu / max(ios, 1) * 1e6:.2f}\t{max(other, 0):.0f}\t{fio_cpu / float(rt) * 100:.0f}")
PY
        done
        if [ "${IDLE_S:-2}" != 0 ]; then
            c0=$(cpu_ticks)
            sleep "${IDLE_S:-2}"
            c1=$(cpu_ticks)
            echo -e "$s\t$r\t$(python3 -c "print(f'{($c1 - $c0) / $TCK / ${IDLE_S:-2} * 100:.1f}')")" >>"$W/idle.tsv"
        fi
        stop
    done
    echo "bench/nbd: round $r of $ROUNDS done" >&2
done

python3 - "$RES" "$SERVERS" "$JOBS" "$W/idle.tsv" <<'PY'
import sys, statistics as st
rows = [l.split("\t") for l in open(sys.argv[1]).read().splitlines()]
servers, jobs = sys.argv[2].split(), sys.argv[3].split()
print(f"medians of {len(set(r[2] for r in rows))} rounds; CPU = server CPU seconds per million I/Os;")
print("fio% = the client's CPU (usr+sys), % of one CPU: near 100, fio is the ceiling")
print(f"{'job':20} {'server':15} {'IOPS':>9} {'p99 us':>9} {'CPU s/MIO':>10} {'other%':>7} {'fio%':>5}")
for j in jobs:
    for s in servers:
        v = [r for r in rows if r[0] == s and r[1] == j]
        if not v:
            continue
        med = lambda i: st.median(float(x[i]) for x in v)
        print(f"{j:20} {s:15} {med(3):9.0f} {med(4):9.1f} {med(5):10.2f} {med(6):7.0f} {med(7):5.0f}")
    print()
# Each server against the first, round by round: medians of the per-round
# ratios, which a loaded host's swings between rounds move less than the
# ratio of medians.
first = servers[0]
print(f"per-round ratios to {first} (medians): IOPS, CPU per I/O")
for j in jobs:
    for s in servers[1:]:
        a = {x[2]: x for x in rows if x[0] == first and x[1] == j}
        b = {x[2]: x for x in rows if x[0] == s and x[1] == j}
        rs = [r for r in a if r in b]
        if not rs:
            continue
        iops = st.median(float(a[r][3]) / float(b[r][3]) for r in rs)
        cpu = st.median(float(a[r][5]) / float(b[r][5]) for r in rs)
        print(f"{j:20} {first} / {s:15} x{iops:.2f}  x{cpu:.2f}")
print()
idle = [l.split("\t") for l in open(sys.argv[4]).read().splitlines()]
print("idle CPU% (server CPU while no client is connected, % of one CPU):")
for s in servers:
    v = [float(r[2]) for r in idle if r[0] == s and r[2]]
    if v:
        print(f"  {s:15} {st.median(v):5.1f}")
PY
