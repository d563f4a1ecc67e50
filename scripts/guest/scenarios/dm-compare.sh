# Scenario dm-compare (sourced by the guest's /test.sh; see scripts/guest.sh):
# udm linear over RAM exported through ublk against the kernel's dm-linear
# over brd, the same fio jobs (4 KiB random reads, 2 jobs, QD1 and QD32),
# runs interleaved. Prints each run and the medians as RESULT lines
# (IOPS), and the ratio udm/kernel. Figures only compare within one
# guest run (TCG: no KVM). Knobs: SCN_UDM_ARGS (udm daemon's flags, e.g.
# --interrupt), SCN_QUEUES (the export's queues; default 2).
insmod /lib/modules/ublk_drv.ko 2>/dev/null
insmod /lib/modules/brd.ko rd_size=131072 rd_nr=1 2>/dev/null
[ -e /dev/ublk-control ] || mdev -s
export UDM_CONTROL=/tmp/udm-cmp.sock
: >/tmp/cmp.log
udm daemon ${SCN_UDM_ARGS:-} >/tmp/cmp.log 2>&1 &
CMP_PID=$!
i=0
until grep -q "daemon ready" /tmp/cmp.log; do i=$((i + 1)); [ $i -lt 100 ] || break; sleep 0.1; done
udm create cr ram:128M
udm create clin --table "0 262144 linear cr 0"
check cmp_udm_export udm export add clin --ublk --id 7 --queues "${SCN_QUEUES:-2}"
echo "RESULT cmp_udm_daemon_args=${SCN_UDM_ARGS:-default} cmp_queues=${SCN_QUEUES:-2}"
check cmp_kernel_dm dmsetup create klin --table "0 262144 linear /dev/ram0 0"
# Written once, so that reads touch memory on both sides.
dd if=/dev/urandom of=/dev/ublkb7 bs=1M count=128 oflag=direct 2>/dev/null
dd if=/dev/urandom of=/dev/mapper/klin bs=1M count=128 oflag=direct 2>/dev/null
CMP_RUNTIME=5
CMP_REPS=3
[ "$LONG" = 1 ] && { CMP_RUNTIME=20; CMP_REPS=5; }
iops() { # DEV QD -> read IOPS (fio terse field 8)
    fio --name=c --filename="$1" --direct=1 --ioengine=io_uring --rw=randread --bs=4k \
        --iodepth="$2" --numjobs=2 --group_reporting --time_based --runtime="$CMP_RUNTIME" \
        --output-format=terse --terse-version=3 2>/dev/null | cut -d';' -f8
}
median() { tr ' ' '\n' | grep . | sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
for qd in 1 32; do
    U= K=
    r=0
    while [ $r -lt $CMP_REPS ]; do
        r=$((r + 1))
        u=$(iops /dev/ublkb7 $qd)
        k=$(iops /dev/mapper/klin $qd)
        echo "RESULT cmp_qd${qd}_run${r}_udm_ublk=$u"
        echo "RESULT cmp_qd${qd}_run${r}_kernel_dm=$k"
        U="$U $u" K="$K $k"
    done
    mu=$(echo "$U" | median) mk=$(echo "$K" | median)
    echo "RESULT cmp_qd${qd}_median_udm_ublk=$mu"
    echo "RESULT cmp_qd${qd}_median_kernel_dm=$mk"
    echo "RESULT cmp_qd${qd}_ratio=$(awk -v u="$mu" -v k="$mk" 'BEGIN {printf "%.2f", (k > 0 ? u / k : 0)}')"
    check cmp_qd${qd}_measured sh -c "[ -n '$mu' ] && [ -n '$mk' ] && [ '$mu' != 0 ]"
done
dmsetup remove klin
check cmp_remove udm export remove clin
kill $CMP_PID; wait $CMP_PID
