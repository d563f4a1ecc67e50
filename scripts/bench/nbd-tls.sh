#!/usr/bin/env bash
# NBD over TLS against plaintext, and udm against nbdkit, all over loopback
# TCP and driven by the same fio nbd jobs, interleaved round by round:
#   plain  udm serve on 127.0.0.1 (ram under linear), no TLS
#   tls    the same with --tls require (x509; certificates made here)
#   nbdkit nbdkit --tls=require --tls-certificates (the same directory) memory
# Jobs: 4k randread QD32 and 128k read QD8, RUNTIME_S seconds each, giving
# IOPS and MB/s; then a fixed amount of 4k random reads at QD32
# (CPU_MIB) on tls and nbdkit, giving the server's CPU microseconds per
# I/O (utime+stime of /proc/PID/stat, all threads, over the run).
# fio runs as nobody with $HOME/.pki/libnbd holding the client's
# certificates (its nbd engine may not name a certificate directory), for
# plaintext too, so the client is the same in every column.
# Prints each round, then medians and the ratios tls/plain and tls/nbdkit.
#
# usage: scripts/bench/nbd-tls.sh [ROUNDS=5] [RUNTIME_S=4] [CPU_MIB=256]
# Env: SERVE_ARGS, more `udm serve` options for both udm servers (e.g.
# --interrupt: reactors that sleep at once, so that CPU per I/O counts no
# idle polling).
set -euo pipefail
ROUNDS=${1:-5}
RUNTIME=${2:-4}
CPU_MIB=${3:-256}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
if [ -z "${UDM:-}" ]; then
    UDM=$ROOT/target/release/udm
    (cd "$ROOT" && cargo build --release -q -p udm)
fi
for t in fio nbdkit openssl setpriv python3; do
    command -v $t >/dev/null || { echo "bench/nbd-tls: $t missing (scripts/setup.sh installs it)" >&2; exit 2; }
done
W=$(mktemp -d /tmp/udm-bench-tls.XXXXXX)
chmod 755 "$W"
PID=
cleanup() {
    [ -n "$PID" ] && kill "$PID" 2>/dev/null && wait "$PID" 2>/dev/null || true
    rm -rf "$W"
}
trap cleanup EXIT

# Certificates: a CA, the server's for 127.0.0.1, the client's.
(
    cd "$W"
    mkdir srv home home/.pki home/.pki/libnbd
    q() { openssl "$@" >/dev/null 2>&1; }
    q req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca-key.pem \
        -out ca-cert.pem -days 30 -subj "/CN=bench CA" -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign"
    printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' >s.ext
    printf 'extendedKeyUsage=clientAuth\n' >c.ext
    q req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout srv/server-key.pem \
        -out s.csr -subj /CN=localhost
    q x509 -req -in s.csr -CA ca-cert.pem -CAkey ca-key.pem -set_serial 2 -days 30 -extfile s.ext \
        -out srv/server-cert.pem
    q req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
        -keyout home/.pki/libnbd/client-key.pem -out c.csr -subj "/O=Bench/CN=fio"
    q x509 -req -in c.csr -CA ca-cert.pem -CAkey ca-key.pem -set_serial 3 -days 30 -extfile c.ext \
        -out home/.pki/libnbd/client-cert.pem
    cp ca-cert.pem srv/
    cp ca-cert.pem home/.pki/libnbd/
    chmod -R a+rwX home
)

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

start() { # server -> PID, URI
    local p
    p=$(port)
    case $1 in
    plain)
        "$UDM" serve --dev r=ram:1G --dev 'lin=0 2097152 linear r 0' --export lin \
            --listen "127.0.0.1:$p" ${SERVE_ARGS:-} >"$W/serve.out" 2>&1 &
        URI="nbd://127.0.0.1:$p/lin" ;;
    tls)
        "$UDM" serve --dev r=ram:1G --dev 'lin=0 2097152 linear r 0' --export lin \
            --listen "127.0.0.1:$p" --tls require --tls-creds "$W/srv" ${SERVE_ARGS:-} >"$W/serve.out" 2>&1 &
        URI="nbds://127.0.0.1:$p/lin" ;;
    nbdkit)
        nbdkit -f -i 127.0.0.1 -p "$p" --tls=require --tls-certificates="$W/srv" memory 1G \
            >"$W/serve.out" 2>&1 &
        URI="nbds://127.0.0.1:$p/" ;;
    esac
    PID=$!
    for _ in $(seq 200); do
        (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null && return
        sleep 0.05
    done
    echo "bench/nbd-tls: $1 did not listen" >&2
    cat "$W/serve.out" >&2
    exit 1
}

stop() { kill "$PID"; wait "$PID" 2>/dev/null || true; PID=; }

fio_run() { # rw bs qd [extra fio args...] -> fio json on stdout
    local rw=$1 bs=$2 qd=$3
    shift 3
    setpriv --reuid 65534 --regid 65534 --clear-groups -- env HOME="$W/home" \
        fio --name=j --ioengine=nbd --uri="$URI" --rw="$rw" --bs="$bs" --iodepth="$qd" \
        --size=1G --directory="$W/home" --output-format=json "$@" 2>/dev/null
}

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

j() { python3 -c 'import json,sys
s=sys.stdin.read(); j=json.loads(s[s.index("{"):])["jobs"][0]["read"]
print("%.0f %.1f %d" % (j["iops"], j["bw_bytes"] / 1e6, j["total_ios"]))'; }

HZ=$(getconf CLK_TCK)
RES=$W/results
: >"$RES"
for r in $(seq "$ROUNDS"); do
    # Fill 1 GiB once per server and round, so reads return stored data.
    for s in plain tls nbdkit; do
        start $s
        fio_run write 1M 8 >/dev/null
        read -r iops _ _ < <(fio_run randread 4k 32 --time_based --runtime="$RUNTIME" | j)
        read -r _ mbs _ < <(fio_run read 128k 8 --time_based --runtime="$RUNTIME" | j)
        cpu=-
        if [ $s != plain ]; then
            t0=$(cpu_ticks "$PID")
            read -r _ _ ios < <(fio_run randread 4k 32 --io_size="${CPU_MIB}M" | j)
            t1=$(cpu_ticks "$PID")
            cpu=$(python3 -c "print(f'{($t1-$t0)/$HZ*1e6/$ios:.2f}')")
        fi
        stop
        echo "round $r $s: 4k-randread-qd32 ${iops} IOPS; 128k-read-qd8 ${mbs} MB/s; cpu_us/IO $cpu"
        echo "$s $iops $mbs $cpu" >>"$RES"
    done
done
python3 - "$RES" <<'EOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
med = {}
for s in ("plain", "tls", "nbdkit"):
    r = [x for x in rows if x[0] == s]
    iops = statistics.median(float(x[1]) for x in r)
    mbs = statistics.median(float(x[2]) for x in r)
    cpu = [float(x[3]) for x in r if x[3] != "-"]
    med[s] = (iops, mbs, statistics.median(cpu) if cpu else None)
    c = f"{med[s][2]:.2f}" if cpu else "-"
    print(f"median {s}: 4k-randread-qd32 {iops:.0f} IOPS; 128k-read-qd8 {mbs:.1f} MB/s; cpu_us/IO {c}")
print(f"tls/plain: 4k IOPS {med['tls'][0]/med['plain'][0]:.2f}x; 128k throughput {med['tls'][1]/med['plain'][1]:.2f}x")
print(f"tls/nbdkit: cpu per I/O {med['tls'][2]/med['nbdkit'][2]:.2f}x; 4k IOPS {med['tls'][0]/med['nbdkit'][0]:.2f}x")
EOF
