# Sourced by the vhost-user-blk bench scripts: two servers in interleaved
# rounds against the VM-less client (exports/examples/vhost_bench.rs).
#
# The caller sets CLIENT, SOCK, RUNTIME, QD, BS, RW (and WAIT: the
# client waits on its call eventfd, `irq`, the default, or polls,
# `poll`) and defines
# `start NAME`, which starts server NAME in the background listening on
# $SOCK and calls `vhost_listening NAME` (it sets PID).
#
#   vhost_rounds ROUNDS RESULTS A B
#
# runs A and B once per round (B first in even rounds) and prints, per
# server, the median IOPS and server CPU per I/O (utime+stime of
# /proc/PID/stat, all threads, during the run), then the medians of the
# per-round A/B ratios.

# Waits for $SOCK to appear; sets PID to the last background job.
vhost_listening() {
    PID=$!
    for _ in $(seq 100); do [ -S "$SOCK" ] && return; sleep 0.05; done
    echo "bench: $1 did not listen on $SOCK" >&2
    exit 1
}

# One run of server $1: prints "NAME IOPS CPU_US_PER_IO".
vhost_run() {
    start "$1"
    local clk c0 out iops c1
    clk=$(getconf CLK_TCK)
    c0=$(awk '{print $14 + $15}' "/proc/$PID/stat")
    out=$("$CLIENT" "$SOCK" "$RUNTIME" "$QD" "$BS" "$RW" "${WAIT:-irq}" 2>/dev/null)
    c1=$(awk '{print $14 + $15}' "/proc/$PID/stat")
    kill "$PID"
    wait "$PID" 2>/dev/null || true
    iops=${out#iops }
    echo "$1 $iops $(awk -v c=$((c1 - c0)) -v k="$clk" -v i="$iops" -v t="$RUNTIME" \
        'BEGIN { printf "%.2f", c / k * 1e6 / (i * t) }')"
}

vhost_rounds() {
    local rounds=$1 results=$2 a=$3 b=$4 r s order line
    : >"$results"
    for r in $(seq "$rounds"); do
        if [ $((r % 2)) = 1 ]; then order="$a $b"; else order="$b $a"; fi
        for s in $order; do
            line=$(vhost_run "$s")
            echo "round $r: $line"
            echo "$r $line" >>"$results"
        done
    done
    python3 - "$results" "$a" "$b" <<'PY'
import sys, statistics as st
path, a, b = sys.argv[1:4]
by = {}
for r, s, iops, cpu in (l.split() for l in open(path)):
    by.setdefault(s, {})[int(r)] = (float(iops), float(cpu))
for s in (a, b):
    v = by[s].values()
    print(f"{s}: median {st.median(i for i, _ in v):.0f} IOPS, {st.median(c for _, c in v):.2f} us CPU/IO")
rs = sorted(by[a])
ri = st.median(by[a][r][0] / by[b][r][0] for r in rs)
rc = st.median(by[a][r][1] / by[b][r][1] for r in rs)
print(f"{a}/{b}: IOPS x{ri:.2f}, CPU per I/O x{rc:.2f} (medians of per-round ratios)")
PY
}
