#!/usr/bin/env bash
# A one-node Ceph cluster on 127.0.0.1 for trying and testing udm's rbd
# backend: one monitor and one memstore OSD, no manager, no systemd, no root
# services. Everything lives in DIR (config, keyrings, logs, pids).
#
#   scripts/ceph-cluster.sh start DIR   # prints: export CEPH_CONF=DIR/ceph.conf
#   scripts/ceph-cluster.sh stop DIR    # stops the OSD, then the monitor
#   scripts/ceph-cluster.sh stop-osd DIR  # stops only the OSD (a failure)
#
# CEPH_CPUS=LIST runs the monitor and the OSD on those CPUs only (taskset
# -c LIST), e.g. apart from the clients of a benchmark.
# Ports: the monitor listens on 127.0.0.1:$CEPH_MON_PORT (v1, default 6789)
# and :$((CEPH_MON_PORT - 3489)) (v2, default 3300). Ready when
# `rados -p rbd put` succeeds; the pool `rbd` exists and is initialised.
set -euo pipefail

cmd=${1:-}; dir=${2:-}
if [ -z "$cmd" ] || [ -z "$dir" ]; then
    echo "usage: $0 start|stop|stop-osd DIR" >&2; exit 2
fi
for b in ceph-mon ceph-osd ceph monmaptool ceph-authtool rados rbd; do
    command -v "$b" >/dev/null 2>&1 || { echo "ceph-cluster: '$b' not found (apt-get install ceph-mon ceph-osd ceph-common)" >&2; exit 3; }
done

stop_pid() {
    local f=$1
    [ -f "$f" ] || return 0
    local pid; pid=$(cat "$f")
    if kill "$pid" 2>/dev/null; then
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
}

case "$cmd" in
stop)
    stop_pid "$dir/osd.pid"; stop_pid "$dir/mon.pid"; exit 0 ;;
stop-osd)
    stop_pid "$dir/osd.pid"; exit 0 ;;
start) ;;
*) echo "usage: $0 start|stop|stop-osd DIR" >&2; exit 2 ;;
esac

port=${CEPH_MON_PORT:-6789}
port2=$((port - 3489))
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
if [ -f "$dir/mon.pid" ] && kill -0 "$(cat "$dir/mon.pid")" 2>/dev/null; then
    echo "ceph-cluster: already running in $dir" >&2; exit 1
fi
rm -rf "$dir"/mon "$dir"/osd "$dir"/*.keyring "$dir"/monmap "$dir"/*.log
mkdir -p "$dir/mon" "$dir/osd/ceph-0" "$dir/run"
fsid=$(cat /proc/sys/kernel/random/uuid)
cat > "$dir/ceph.conf" <<CONF
[global]
fsid = $fsid
mon host = [v2:127.0.0.1:$port2,v1:127.0.0.1:$port]
mon initial members = a
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
keyring = $dir/admin.keyring
run dir = $dir/run
osd objectstore = memstore
memstore device bytes = 2147483648
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
paxos propose interval = 0.05
osd data = $dir/osd/ceph-\$id
mon data = $dir/mon/ceph-\$id
osd op num shards = 1
osd op num threads per shard = 2
ms bind ipv6 = false
[mon]
mon pg warn min per osd = 0
admin socket = $dir/run/\$name.asok
log file = $dir/\$name.log
[osd]
admin socket = $dir/run/\$name.asok
log file = $dir/\$name.log
[client]
admin socket =
log file = $dir/client.log
CONF
export CEPH_CONF="$dir/ceph.conf"
q() { "$@" >>"$dir/setup.log" 2>&1; }
q ceph-authtool --create-keyring "$dir/mon.keyring" --gen-key -n mon. --cap mon 'allow *'
q ceph-authtool --create-keyring "$dir/admin.keyring" --gen-key -n client.admin \
    --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *'
q ceph-authtool "$dir/mon.keyring" --import-keyring "$dir/admin.keyring"
q monmaptool --create --addv a "[v2:127.0.0.1:$port2,v1:127.0.0.1:$port]" --fsid "$fsid" "$dir/monmap"
q ceph-mon --mkfs -i a --monmap "$dir/monmap" --keyring "$dir/mon.keyring"
${CEPH_CPUS:+taskset -c "$CEPH_CPUS"} ceph-mon -i a --pid-file "$dir/mon.pid" 2>>"$dir/setup.log"
uuid=$(cat /proc/sys/kernel/random/uuid)
id=$(ceph --connect-timeout 10 osd new "$uuid" 2>>"$dir/setup.log")
ceph-authtool --create-keyring "$dir/osd/ceph-$id/keyring" --gen-key -n "osd.$id" >>"$dir/setup.log" 2>&1
q ceph auth add "osd.$id" osd 'allow *' mon 'allow profile osd' -i "$dir/osd/ceph-$id/keyring"
q ceph-osd -i "$id" --mkfs --osd-uuid "$uuid" --keyring "$dir/osd/ceph-$id/keyring"
${CEPH_CPUS:+taskset -c "$CEPH_CPUS"} ceph-osd -i "$id" --pid-file "$dir/osd.pid" --keyring "$dir/osd/ceph-$id/keyring" 2>>"$dir/setup.log"
q ceph osd pool create rbd 8 8
q ceph osd pool set rbd size 1 --yes-i-really-mean-it
echo probe > "$dir/probe"
for _ in $(seq 200); do
    if timeout 5 rados -p rbd put probe "$dir/probe" >/dev/null 2>&1; then
        q rbd pool init rbd
        echo "export CEPH_CONF=$dir/ceph.conf"
        exit 0
    fi
    sleep 0.1
done
echo "ceph-cluster: not ready after 20 s (see $dir/*.log, $dir/setup.log)" >&2
exit 1
