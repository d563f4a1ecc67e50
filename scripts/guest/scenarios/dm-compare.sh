# Scenario dm-compare (sourced by the guest's /test.sh; see scripts/guest.sh):
# udm linear over RAM exported through ublk against the kernel's dm-linear
# over brd, the same fio jobs (4 KiB random reads, 2 jobs, QD1 and QD32),
# runs interleaved. Beside them, ublk's own floor: udm's null device over
# ublk and, when the guest has it (GUEST_BINS=.../ublk-null-ref, see
# docs/benchmarks.md), libublk's null server, so that the gap splits into
# what any ublk server pays here and what udm adds. Prints each run and
# the medians as RESULT lines (IOPS; `_cpu` lines: the server's CPU per
# I/O in µs, from its utime+stime), and the ratios to the kernel's.
# Figures only compare within one guest run (TCG: no KVM). Knobs:
# SCN_UDM_ARGS (udm daemon's flags, e.g. --interrupt), SCN_QUEUES (each
# export's queues; default 2), SCN_STRACE=1 (with GUEST_BINS=.../strace:
# io_uring_enter calls per I/O of udm's queues), SCN_UDM_B (the name of
# another udm binary put in the guest with GUEST_BINS: its linear over RAM
# runs as case udm_b, interleaved with the rest, an A/B of two builds).
insmod /lib/modules/ublk_drv.ko 2>/dev/null
insmod /lib/modules/brd.ko rd_size=131072 rd_nr=1 2>/dev/null
[ -e /dev/ublk-control ] || mdev -s
export UDM_CONTROL=/tmp/udm-cmp.sock
# shellcheck disable=SC2086 # the flags split on spaces
start_daemon /tmp/cmp.log ${SCN_UDM_ARGS:-}
CMP_PID=$DAEMON_PID
CMP_Q=${SCN_QUEUES:-2}
udm create cr ram:128M
udm create clin --table "0 262144 linear cr 0"
udm create cnull null:128M
check cmp_udm_export udm export add clin --ublk --id 7 --queues "$CMP_Q"
check cmp_udm_null_export udm export add cnull --ublk --id 8 --queues "$CMP_Q"
echo "RESULT cmp_udm_daemon_args=${SCN_UDM_ARGS:-default} cmp_queues=$CMP_Q"
check cmp_kernel_dm dmsetup create klin --table "0 262144 linear /dev/ram0 0"
CMP_CASES="udm_ublk kernel_dm udm_null"
REF_PID=
if command -v ublk-null-ref >/dev/null; then
    ublk-null-ref 9 "$CMP_Q" 64 128 >/tmp/ref.log 2>&1 &
    REF_PID=$!
    i=0
    until [ -b /dev/ublkb9 ]; do i=$((i + 1)); [ $i -lt 100 ] || break; sleep 0.1; mdev -s; done
    check cmp_ref_null_started [ -b /dev/ublkb9 ]
    CMP_CASES="$CMP_CASES ref_null"
fi
B_PID=
if [ -n "${SCN_UDM_B:-}" ]; then
    : >/tmp/cmp-b.log
    UDM_CONTROL=/tmp/udm-cmp-b.sock "$SCN_UDM_B" daemon ${SCN_UDM_ARGS:-} >/tmp/cmp-b.log 2>&1 &
    B_PID=$!
    i=0
    until grep -q "daemon ready" /tmp/cmp-b.log; do i=$((i + 1)); [ $i -lt 100 ] || break; sleep 0.1; done
    UDM_CONTROL=/tmp/udm-cmp-b.sock "$SCN_UDM_B" create br ram:128M
    UDM_CONTROL=/tmp/udm-cmp-b.sock "$SCN_UDM_B" create blin --table "0 262144 linear br 0"
    check cmp_udm_b_export env UDM_CONTROL=/tmp/udm-cmp-b.sock "$SCN_UDM_B" export add blin --ublk --id 10 --queues "$CMP_Q"
    dd if=/dev/urandom of=/dev/ublkb10 bs=1M count=128 oflag=direct 2>/dev/null
    CMP_CASES="$CMP_CASES udm_b"
    echo "RESULT cmp_udm_b=$SCN_UDM_B"
fi
dev_of() {
    case $1 in
    udm_ublk) echo /dev/ublkb7 ;; kernel_dm) echo /dev/mapper/klin ;;
    udm_null) echo /dev/ublkb8 ;; ref_null) echo /dev/ublkb9 ;; udm_b) echo /dev/ublkb10 ;;
    esac
}
pid_of() {
    case $1 in
    udm_b) echo $B_PID ;; udm_*) echo $CMP_PID ;; ref_null) echo $REF_PID ;; *) echo ;;
    esac
}
# Written once, so that reads touch memory on both sides.
dd if=/dev/urandom of=/dev/ublkb7 bs=1M count=128 oflag=direct 2>/dev/null
dd if=/dev/urandom of=/dev/mapper/klin bs=1M count=128 oflag=direct 2>/dev/null
CMP_RUNTIME=5
CMP_REPS=3
[ "$LONG" = 1 ] && { CMP_RUNTIME=20; CMP_REPS=5; }
ticks() { [ -n "$1" ] && awk '{print $14 + $15}' "/proc/$1/stat" || echo 0; }
run1() { # CASE QD -> "IOPS CPU_US_PER_IO"
    local p t0 t1 out
    p=$(pid_of "$1")
    t0=$(ticks "$p")
    out=$(fio --name=c --filename="$(dev_of "$1")" --direct=1 --ioengine=io_uring --rw=randread --bs=4k \
        --iodepth="$2" --numjobs=2 --group_reporting --time_based --runtime="$CMP_RUNTIME" \
        --output-format=terse --terse-version=3 2>/dev/null | cut -d';' -f6,8)
    t1=$(ticks "$p")
    # field 6: KiB read (4 per I/O); ticks are 10 ms
    echo "$out" | awk -F';' -v t=$((t1 - t0)) '{ios = $1 / 4; printf "%d %d\n", $2, (ios > 0 ? t * 10000 / ios : 0)}'
}
median() { tr ' ' '\n' | grep . | sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
for qd in 1 32; do
    for c in $CMP_CASES; do eval "I_$c= C_$c="; done
    r=0
    while [ $r -lt $CMP_REPS ]; do
        r=$((r + 1))
        for c in $CMP_CASES; do
            set -- $(run1 "$c" $qd)
            echo "RESULT cmp_qd${qd}_run${r}_$c=$1"
            eval "I_$c=\"\$I_$c $1\" C_$c=\"\$C_$c $2\""
        done
    done
    for c in $CMP_CASES; do
        eval "m=\$(echo \"\$I_$c\" | median) mc=\$(echo \"\$C_$c\" | median)"
        eval "M_$c=$m"
        echo "RESULT cmp_qd${qd}_median_$c=$m"
        [ "$c" = kernel_dm ] || echo "RESULT cmp_qd${qd}_median_${c}_cpu=$mc"
    done
    for c in $CMP_CASES; do
        [ "$c" = kernel_dm ] && continue
        eval "u=\$M_$c"
        echo "RESULT cmp_qd${qd}_ratio_$c=$(awk -v u="$u" -v k="$M_kernel_dm" 'BEGIN {printf "%.2f", (k > 0 ? u / k : 0)}')"
    done
    # The issue's figure: udm linear over RAM against dm-linear over brd.
    echo "RESULT cmp_qd${qd}_ratio=$(awk -v u="$M_udm_ublk" -v k="$M_kernel_dm" 'BEGIN {printf "%.2f", (k > 0 ? u / k : 0)}')"
    check cmp_qd${qd}_measured sh -c "[ -n '$M_udm_ublk' ] && [ -n '$M_kernel_dm' ] && [ '$M_udm_ublk' != 0 ]"
done
if [ "${SCN_STRACE:-0}" = 1 ] && command -v strace >/dev/null; then
    for qd in 1 32; do
        strace -c -f -p $CMP_PID -o /tmp/cmp-strace.txt 2>/dev/null &
        s=$!
        sleep 1
        ios=$(fio --name=c --filename=/dev/ublkb7 --direct=1 --ioengine=io_uring --rw=randread --bs=4k \
            --iodepth=$qd --numjobs=2 --group_reporting --time_based --runtime="$CMP_RUNTIME" \
            --output-format=terse --terse-version=3 2>/dev/null | awk -F';' '{print int($6 / 4)}')
        kill -INT $s; wait $s
        enters=$(awk '$NF == "io_uring_enter" {print $4}' /tmp/cmp-strace.txt)
        echo "RESULT cmp_qd${qd}_strace_ios=$ios cmp_qd${qd}_strace_enters=${enters:-0}"
        echo "RESULT cmp_qd${qd}_enters_per_io=$(awk -v e="${enters:-0}" -v n="$ios" 'BEGIN {printf "%.2f", (n > 0 ? e / n : 0)}')"
        grep -v '^-' /tmp/cmp-strace.txt | sed 's/^/strace: /'
    done
fi
[ -n "$REF_PID" ] && { kill $REF_PID; wait $REF_PID; } 2>/dev/null
[ -n "$B_PID" ] && { kill $B_PID; wait $B_PID; } 2>/dev/null
dmsetup remove klin
check cmp_remove udm export remove clin
check cmp_remove_null udm export remove cnull
kill $CMP_PID; wait $CMP_PID
