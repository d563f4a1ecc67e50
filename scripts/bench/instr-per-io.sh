#!/usr/bin/env bash
# Instructions per I/O of `udm bench`, counted by callgrind: the slope
# between a run over SMALL and one over LARGE bytes (same command otherwise),
# so start-up and tear-down cancel out.
#
#   scripts/bench/instr-per-io.sh [bench options...]
#   e.g. scripts/bench/instr-per-io.sh --target lin --rw read --bs 512 --iodepth 1
#
# Env: SMALL (default 4M), LARGE (default 12M), UDM (binary; default builds
# target/release/udm), ONLY (count only the threads whose profile names
# this function, e.g. ONLY=Ring::reap: the reactor's, leaving out the
# main thread, whose count moves with the host's load). Prints
# "<instructions per I/O> <I/Os in the slope>".
#
# Threads are counted separately and background workers (a writecache's
# worker thread, made to spin with UDM_WC_WORKER_POLL=1 because valgrind
# holds its lock across a sleeping io_uring_enter) are left out: the figure
# is the cost on the threads that submit and complete the I/O.
set -euo pipefail
cd "$(dirname "$0")/../.."
SMALL=${SMALL:-4M}
LARGE=${LARGE:-12M}
if [ -z "${UDM:-}" ]; then
    cargo build --release -q -p udm
    UDM=target/release/udm
fi
command -v valgrind >/dev/null || { echo "instr-per-io: valgrind is not installed (scripts/setup.sh)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
count() { # size -> "instructions ios"
    rm -f "$tmp"/cg*
    UDM_WC_WORKER_POLL=1 valgrind --tool=callgrind --separate-threads=yes \
        --callgrind-out-file="$tmp/cg" "$UDM" bench --jobs 1 "$@" --size "$SIZE" --json >"$tmp/out" 2>/dev/null
    local ir=0 ios f
    for f in "$tmp"/cg-*; do
        # The worker's reactor runs its poller (run() itself is inlined).
        grep -q -e 'writeback::run' -e 'WorkerPoller' "$f" && continue
        [ -z "${ONLY:-}" ] || grep -q -F "$ONLY" "$f" || continue
        ir=$(( ir + $(grep -m1 -E '^(summary|totals):' "$f" | awk '{print $2}') ))
    done
    ios=$(grep -o '"ios": *[0-9]*' "$tmp/out" | head -1 | grep -o '[0-9]*$')
    echo "$ir $ios"
}
read -r a na < <(SIZE=$SMALL count "$@")
read -r b nb < <(SIZE=$LARGE count "$@")
echo "$(( (b - a) / (nb - na) )) $(( nb - na ))"
