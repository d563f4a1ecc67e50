#!/usr/bin/env bash
# A server's cost per request, on the server: system calls (strace -c -f,
# the counts divided by the client's I/Os) and, in a second run without
# strace, CPU time (utime+stime of /proc/PID/stat, all threads) per I/O.
# (Not callgrind: valgrind holds its lock across the reactor's sleeping
# io_uring_enter, so a served client stalls; --poll would count the spin.)
#
#   scripts/bench/server-cost.sh vhost|nbd [MODE=direct] [RW=randread] [QD=32] [BS=4096]
#
# vhost: `udm serve --dev d=ram:256M --vhost-user-blk SOCK --queues 1
# --dispatch MODE` driven by the VM-less client
# (exports/examples/vhost_bench.rs; RW read/write are random, seqread/
# seqwrite sequential). nbd: `udm serve` over linear on RAM (as
# scripts/bench/nbd.sh) driven by fio's nbd engine (RW as fio spells it).
# Env: UDM (binary; default builds target/release/udm), AMOUNT (vhost:
# seconds, default 3; nbd: MiB, default 256), NULL=1 serves null:256M
# instead of RAM, SERVE_ARGS adds `udm serve` options (e.g. --interrupt).
# Prints "cpu_us/IO <c> syscalls/IO <s> (<top calls>; <n> I/Os)".
set -euo pipefail
cd "$(dirname "$0")/../.."
PROTO=$1
MODE=${2:-direct}
RW=${3:-randread}
QD=${4:-32}
BS=${5:-4096}
if [ -z "${UDM:-}" ]; then
    cargo build --release -q -p udm
    UDM=target/release/udm
fi
CLIENT=target/release/examples/vhost_bench
[ "$PROTO" = vhost ] && [ ! -x "$CLIENT" ] && cargo build --release -q -p udm-exports --example vhost_bench
W=$(mktemp -d /dev/shm/udm-server-cost.XXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$W"' EXIT
SOCK=$W/sock
DEV=d=ram:256M
SERVE_ARGS=${SERVE_ARGS:-}
[ "${NULL:-0}" = 1 ] && DEV=d=null:256M
serve() { # wrapper... -> starts the server under the wrapper, sets PID
    rm -f "$SOCK"
    # shellcheck disable=SC2086 # SERVE_ARGS: options, split on spaces
    case $PROTO in
    vhost) exec "$@" "$UDM" serve $SERVE_ARGS --dev "$DEV" --vhost-user-blk "$SOCK" --queues 1 --dispatch "$MODE" ;;
    nbd) exec "$@" "$UDM" serve $SERVE_ARGS --dev "${DEV/d=/r=}" --dev 'lin=0 524288 linear r 0' --export lin \
        --listen "unix:$SOCK" --dispatch "$MODE" ;;
    esac >"$W/serve.out" 2>&1 &
    PID=$!
    for _ in $(seq 400); do [ -S "$SOCK" ] && return; sleep 0.05; done
    echo "server-cost: the server did not listen" >&2
    exit 1
}
client() { # amount -> I/Os done
    case $PROTO in
    vhost)
        timeout 120 "$CLIENT" "$SOCK" "$1" "$QD" "$BS" "$RW" 2>&1 >/dev/null | awk '/^ios/ {print $2}'
        ;;
    nbd)
        timeout 300 fio --name=j --ioengine=nbd --uri="nbd+unix:///lin?socket=$SOCK" --rw="$RW" --bs="$BS" \
            --iodepth="$QD" --size=256M --io_size="${1}M" --output-format=json |
            python3 -c 'import json,sys; s=sys.stdin.read(); j=json.loads(s[s.index("{"):])["jobs"][0]; print(j["read"]["total_ios"] + j["write"]["total_ios"])'
        ;;
    esac
}
stop() { # the server (strace's child, when traced), then its wrapper
    pkill -TERM -P "$PID" 2>/dev/null || true
    kill -TERM "$PID" 2>/dev/null || true
    wait "$PID" 2>/dev/null || true
}
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
if [ "$PROTO" = vhost ]; then AMOUNT=${AMOUNT:-3}; else AMOUNT=${AMOUNT:-256}; fi
serve
c0=$(cpu "$PID")
n0=$(client "$AMOUNT")
c1=$(cpu "$PID")
stop
instr=$(awk -v c=$((c1 - c0)) -v k="$(getconf CLK_TCK)" -v n="$n0" 'BEGIN { printf "%.2f", c / k * 1e6 / n }')
serve strace -c -f -o "$W/strace"
n=$(client "$AMOUNT")
stop
python3 - "$W/strace" "$n" "$instr" <<'PY'
import sys
path, n, instr = sys.argv[1], int(sys.argv[2]), sys.argv[3]
calls = {}
for line in open(path):
    f = line.split()
    if len(f) >= 5 and f[-1] not in ("syscall", "total") and f[3].isdigit():
        calls[f[-1]] = int(f[3])
total = sum(calls.values())
top = sorted(calls.items(), key=lambda kv: -kv[1])[:5]
print(f"cpu_us/IO {instr} syscalls/IO {total / n:.3f} ("
      + ", ".join(f"{k} {v / n:.3f}" for k, v in top) + f"; {n} I/Os)")
PY
