#!/usr/bin/env bash
# The thin target's figures (docs/benchmarks.md, "Thin volumes over RAM"):
#
#   scripts/bench/thin.sh ab ROUNDS RW UDM [BASE]  linear vs a provisioned thin volume (and thin
#                                                   on BASE, another build), 4 KiB QD32 RW over
#                                                   256 MiB, interleaved rounds
#   scripts/bench/thin.sh alloc ROUNDS UDM          one pass of 4 KiB random writes over a fresh
#                                                   volume (allocating) vs a prefilled one
#                                                   (overwrites) vs linear, data on a tmpfs file
#   scripts/bench/thin.sh two ROUNDS UDM            one reactor on one volume vs two reactors on
#                                                   two volumes of one pool, provisioned randwrite;
#                                                   the same for two linear devices over one RAM disk
#   scripts/bench/thin.sh instr UDM                 instructions per 512 B read at QD1: linear
#                                                   over RAM vs a provisioned thin volume
#
# Each run prints IOPS and I/Os per CPU-second of the job threads (user +
# system): on a loaded host the second is what the code costs, the first
# also how much CPU the host left it.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -ge 2 ] || { sed -n 2,19p "$0"; exit 2; }
mode=$1; shift
f() { python3 -c 'import json,sys; j=json.loads(sys.stdin.read()); print("%.0f %.0f" % (j["iops"], j["ios"]/max(1e-9,j["cpu_user_s"]+j["cpu_sys_s"])))'; }
THIN=(--dev meta=ram:64M --dev data=ram:1G --dev 'pool=0 2097152 thin-pool meta data 128 0 1 skip_block_zeroing'
      --message 'pool 0 create_thin 0' --dev 't=0 2097152 thin pool 0' --target t)
LIN=(--dev ram0=ram:1G --dev 'lin=0 2097152 linear ram0 0' --target lin)
case $mode in
ab)
    R=$1; RW=$2; U=$3; B=${4:-$3}
    C=(--rw "$RW" --iodepth 32 --size 256M --runtime 2 --prefill --dispatch direct --cpus 1 --json)
    for r in $(seq 1 "$R"); do
        if (( r % 2 )); then
            a=$("$U" bench "${LIN[@]}" "${C[@]}" | f); b=$("$U" bench "${THIN[@]}" "${C[@]}" | f); c=$("$B" bench "${THIN[@]}" "${C[@]}" | f)
        else
            c=$("$B" bench "${THIN[@]}" "${C[@]}" | f); b=$("$U" bench "${THIN[@]}" "${C[@]}" | f); a=$("$U" bench "${LIN[@]}" "${C[@]}" | f)
        fi
        echo "$RW $r lin $a thin $b thin-base $c"
    done ;;
alloc)
    R=$1; U=$2; D=/dev/shm/udm-thin-bench-data.img
    dd if=/dev/zero of=$D bs=1M count=512 status=none
    trap 'rm -f $D' EXIT
    C=(--rw randwrite --bs 4k --iodepth 32 --size 256M --dispatch direct --cpus 1 --json)
    P=(--dev meta=ram:64M --dev data=file:$D --dev 'pool=0 1048576 thin-pool meta data 128 0 1 skip_block_zeroing'
       --message 'pool 0 create_thin 0' --dev 't=0 1048576 thin pool 0' --target t)
    for r in $(seq 1 "$R"); do
        a=$("$U" bench "${P[@]}" "${C[@]}" | f); b=$("$U" bench "${P[@]}" "${C[@]}" --prefill | f)
        c=$("$U" bench --dev data=file:$D --dev 'lin=0 1048576 linear data 0' --target lin "${C[@]}" | f)
        echo "alloc $r fresh $a overwrite $b linear $c"
    done ;;
two)
    R=$1; U=$2
    P=(--dev meta=ram:64M --dev data=ram:512M --dev 'pool=0 1048576 thin-pool meta data 128 0 1 skip_block_zeroing'
       --message 'pool 0 create_thin 0' --dev 't0=0 524288 thin pool 0' --message 'pool 0 create_thin 1' --dev 't1=0 524288 thin pool 1')
    # The host's own ceiling: two linear devices over one RAM disk.
    L=(--dev ram0=ram:512M --dev 'l0=0 524288 linear ram0 0' --dev 'l1=0 524288 linear ram0 524288')
    C=(--rw randwrite --bs 4k --iodepth 32 --size 256M --runtime 2 --prefill --dispatch direct --json)
    for r in $(seq 1 "$R"); do
        if (( r % 2 )); then a=$("$U" bench "${P[@]}" --target t0 --jobs 1 "${C[@]}" | f); b=$("$U" bench "${P[@]}" --target t0,t1 --jobs 2 "${C[@]}" | f)
            c=$("$U" bench "${L[@]}" --target l0 --jobs 1 "${C[@]}" | f); d=$("$U" bench "${L[@]}" --target l0,l1 --jobs 2 "${C[@]}" | f)
        else d=$("$U" bench "${L[@]}" --target l0,l1 --jobs 2 "${C[@]}" | f); c=$("$U" bench "${L[@]}" --target l0 --jobs 1 "${C[@]}" | f)
            b=$("$U" bench "${P[@]}" --target t0,t1 --jobs 2 "${C[@]}" | f); a=$("$U" bench "${P[@]}" --target t0 --jobs 1 "${C[@]}" | f); fi
        echo "two $r one $a two $b linear-one $c linear-two $d"
    done ;;
instr)
    # The volume is provisioned beforehand (metadata in a file) so that the
    # counted runs only read: a prefill would be counted with them, and its
    # trips to the pool's worker hang under valgrind (a reactor sleeping in
    # io_uring_enter holds valgrind's lock).
    U=$(realpath "$1"); M=/dev/shm/udm-thin-bench-meta.img
    rm -f $M; truncate -s 16M $M
    trap 'rm -f $M' EXIT
    P=(--dev meta=file:$M --dev data=ram:64M --dev 'pool=0 131072 thin-pool meta data 128 0 1 skip_block_zeroing')
    "$U" bench "${P[@]}" --message 'pool 0 create_thin 0' --dev 't=0 131072 thin pool 0' --target t --rw write --bs 64k --size 12M >/dev/null
    C=(--rw read --bs 512 --iodepth 1 --dispatch direct)
    echo "linear: $(UDM=$U ONLY=Ring::reap scripts/bench/instr-per-io.sh --dev ram0=ram:64M --dev 'lin=0 131072 linear ram0 0' --target lin "${C[@]}")"
    echo "thin:   $(UDM=$U ONLY=Ring::reap scripts/bench/instr-per-io.sh "${P[@]}" --dev 't=0 131072 thin pool 0' --target t "${C[@]}")" ;;
*) sed -n 2,19p "$0"; exit 2 ;;
esac
