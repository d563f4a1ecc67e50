#!/usr/bin/env bash
# Instructions per request of the vhost-user-blk export's reactor thread,
# counted by callgrind (which the host's load does not change): `udm serve
# --poll --dev d=null:256M --vhost-user-blk SOCK --queues 1` under
# `valgrind --tool=callgrind --separate-threads=yes`, driven by the VM-less
# client (exports/examples/vhost_bench.rs) for SECS seconds; the inclusive
# instructions of the reactor thread's functions divided by the client's
# I/Os. (--poll: the reactor never sleeps in io_uring_enter, across which
# valgrind would hold its lock and stall the client; the idle turns' look
# at a polled ring then counts in the thread's total, and the load moves
# that figure: the functions' figures are the ones to compare.)
#
#   scripts/bench/vhost-instr.sh [SECS=5] [QD=32] [BS=4096] [read|write]
#
# Env: UDM (binary; default builds target/release/udm), KEEP / KEEP_RAW
# (copy the annotated profile / the thread's callgrind file there), SERVE_ARGS (more
# `udm serve` options). Prints one line per function, "<name>
# <instructions per I/O>", then the thread's total and the I/Os.
set -euo pipefail
cd "$(dirname "$0")/../.."
SECS=${1:-5}
QD=${2:-32}
BS=${3:-4096}
RW=${4:-read}
if [ -z "${UDM:-}" ]; then
    cargo build --release -q -p udm
    UDM=target/release/udm
fi
command -v valgrind >/dev/null || { echo "vhost-instr: valgrind is not installed (scripts/setup.sh)" >&2; exit 2; }
CLIENT=target/release/examples/vhost_bench
[ -x "$CLIENT" ] || cargo build --release -q -p udm-exports --example vhost_bench
W=$(mktemp -d /dev/shm/udm-vhost-instr.XXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$W"' EXIT
SOCK=$W/sock
# shellcheck disable=SC2086 # SERVE_ARGS: options, split on spaces
valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file="$W/cg" \
    "$UDM" serve --poll ${SERVE_ARGS:-} --dev d=null:256M --vhost-user-blk "$SOCK" --queues 1 \
    >"$W/serve.out" 2>&1 &
PID=$!
for _ in $(seq 1200); do [ -S "$SOCK" ] && break; sleep 0.05; done
[ -S "$SOCK" ] || { echo "vhost-instr: the server did not listen" >&2; cat "$W/serve.out" >&2; exit 1; }
ios=$(timeout 300 "$CLIENT" "$SOCK" "$SECS" "$QD" "$BS" "$RW" 2>&1 >/dev/null | awk '/^ios/ {print $2}')
kill -TERM "$PID"
wait "$PID" || true
# The reactor thread's profile: the one that ran the queue.
f=$(grep -l 'VQueue' "$W"/cg-* | head -1)
[ -n "$f" ] || { echo "vhost-instr: no thread ran a queue" >&2; exit 1; }
callgrind_annotate --inclusive=yes --threshold=100 "$f" >"$W/annot" 2>/dev/null
[ -z "${KEEP:-}" ] || cp "$W/annot" "$KEEP"
[ -z "${KEEP_RAW:-}" ] || cp "$f" "$KEEP_RAW"
total=$(grep -m1 -E '^(summary|totals):' "$f" | awk '{print $2}')
for fn in 'vhost::queue::VQueue::process' 'vhost::chain::parse' 'vhost::queue::VQueue::add_used' \
    'vhost::queue::VQueue::piece_done' 'vhost::queue::VQueue::notify' 'vhost::queue::VQueue::flush_used' \
    'front::Front::submit' 'Poller for udm_exports::vhost::queue::Worker>::poll'; do
    n=$(grep -F "$fn" "$W/annot" | head -1 | awk '{gsub(",","",$1); print $1}' || true)
    if [ -n "$n" ]; then echo "$fn $((n / ios))"; fi
done
echo "thread $((total / ios))"
echo "ios $ios"
