# Scenario poll (sourced by the guest's /test.sh; see scripts/guest.sh):
# seed 003, polled I/O through udm's stacks. The file backend's `iopoll`
# on devices with poll queues: the guest's QEMU NVMe disk (driver reloaded
# with poll_queues=2) and null_blk (poll_queues=2, memory-backed).
# Checks: `iopoll` is refused on the NVMe disk while it has no poll
# queues; with them, udm bench --verify (write a pattern, read it back)
# passes on the raw devices, linear over NVMe, striped over NVMe and
# null_blk (128 KiB I/Os: each splits into one child per device) and a
# mixed stripe (polled NVMe, interrupt-driven null_blk), in every
# completion mode; and polling is real: the NVMe's interrupt count does
# not move during the polled runs, and moves during an unpolled one.
# --long adds seed 003's table (see docs/polling.md): 4 KiB random reads
# at QD1 and QD32 through udm raw, linear and striped over the NVMe disk,
# interrupt vs polled completion, beside the kernel's own fio --hipri on
# the disk and on dm-linear and dm-striped over it, runs interleaved,
# medians. Knobs: SCN_POLL_RUNTIME (seconds per run, default 3),
# SCN_POLL_REPS (default 3), SCN_POLL_QDS (default "1 32"), SCN_POLL_MODES
# (udm's columns, default "irq interrupt poll hybrid adaptive").
# guest.sh: nvme
mkdir -p /sys/kernel/debug
# The sum of the NVMe I/O queues' interrupts (nvme0q1.., not the admin q0).
nvme_irqs() {
    awk '/ nvme0q[1-9][0-9]*$/ { for (i = 2; i <= NF && $i ~ /^[0-9]+$/; i++) s += $i } END { print s + 0 }' /proc/interrupts
}
# pbench NAME [udm bench args]: runs udm bench with --json into /tmp/NAME.json;
# true when it exited 0 having verified blocks with no mismatch.
pbench() {
    local name=$1
    shift
    udm bench --json "$@" >/tmp/$name.json 2>/tmp/$name.err
    local rc=$?
    if [ $rc != 0 ] || ! grep -q '"mismatches":0,' /tmp/$name.json ||
        grep -q '"verified_blocks":0,' /tmp/$name.json; then
        echo "pbench $name: rc $rc: $(cat /tmp/$name.json /tmp/$name.err)"
        return 1
    fi
}
mode_flag() { [ "$1" = interrupt ] || echo "--$1"; }

# Without poll queues, iopoll is refused in one line naming the cause.
udm bench --dev p=file:/dev/nvme0n1,iopoll --target p --size 1M >/tmp/refuse.out 2>/tmp/refuse.err
REFUSE_RC=$?
cat /tmp/refuse.err
check poll_refused_without_poll_queues sh -c "[ $REFUSE_RC = 2 ] && [ \$(wc -l </tmp/refuse.err) = 1 ] && grep -q 'does not support polled I/O' /tmp/refuse.err"

rmmod nvme
insmod /lib/modules/nvme.ko poll_queues=2
insmod /lib/modules/null_blk.ko queue_mode=2 poll_queues=2 memory_backed=1 gb=1 nr_devices=1
i=0
until [ -b /dev/nvme0n1 ] && [ -b /dev/nullb0 ]; do
    i=$((i + 1)); [ $i -lt 50 ] || break; mdev -s; sleep 0.1
done
check poll_nvme_has_poll_queues sh -c '[ "$(cat /sys/block/nvme0n1/queue/io_poll)" = 1 ]'
check poll_nullb_has_poll_queues sh -c '[ "$(cat /sys/block/nullb0/queue/io_poll)" = 1 ]'
grep nvme0q /proc/interrupts

NV=nv=file:/dev/nvme0n1,iopoll
NB=nb=file:/dev/nullb0,iopoll
IRQ0=$(nvme_irqs)
for m in interrupt poll hybrid adaptive; do
    f=$(mode_flag $m)
    check poll_${m}_nvme pbench p-$m-nvme --dev $NV --target nv --verify --size 8M $f
    check poll_${m}_nullb pbench p-$m-nullb --dev $NB --target nb --verify --size 8M $f
    check poll_${m}_linear pbench p-$m-lin --dev $NV --dev "lin=0 2097152 linear nv 0" \
        --target lin --verify --size 8M $f
    check poll_${m}_striped pbench p-$m-str --dev $NV --dev $NB \
        --dev "str=0 2097152 striped 2 128 nv 0 nb 0" --target str --bs 128k --verify --size 16M $f
done
# A stripe whose children go to a polled ring (NVMe) and to the
# interrupt-driven one (null_blk opened without iopoll).
check poll_mixed_striped pbench p-mixed --dev $NV --dev nbi=file:/dev/nullb0 \
    --dev "mix=0 2097152 striped 2 128 nv 0 nbi 0" --target mix --bs 128k --verify --size 16M
IRQ1=$(nvme_irqs)
echo "RESULT poll_nvme_irqs_during_polled_runs=$((IRQ1 - IRQ0))"
check poll_polled_runs_raise_no_nvme_interrupt [ "$IRQ1" = "$IRQ0" ]
# The same I/O unpolled: the observable moves.
check poll_unpolled_run pbench p-irq --dev nv=file:/dev/nvme0n1 --target nv --verify --size 8M
IRQ2=$(nvme_irqs)
echo "RESULT poll_nvme_irqs_during_unpolled_run=$((IRQ2 - IRQ1))"
check poll_unpolled_run_raises_nvme_interrupts [ "$IRQ2" -gt "$IRQ1" ]

# Caps::POLL says a device's completions are polled, through the stack: a
# table has it when every device under it does.
export UDM_CONTROL=/tmp/udm-poll.sock
start_daemon /tmp/udm-poll.log
POLL_DAEMON=$DAEMON_PID
udm create nv file:/dev/nvme0n1,iopoll
udm create nbi file:/dev/nullb0
udm create plin --table "0 2097152 linear nv 0"
udm create pmix --table "0 2097152 striped 2 128 nv 0 nbi 0"
udm info plin | grep -i caps
udm info pmix | grep -i caps
check poll_caps_of_a_polled_stack sh -c 'udm info plin | grep -i "^caps:" | grep -qw poll'
check poll_caps_not_of_a_mixed_stack sh -c 'udm info pmix | grep -i "^caps:" | grep -vqw poll'
kill $POLL_DAEMON
wait $POLL_DAEMON

if [ "$LONG" = 1 ]; then
    RT=${SCN_POLL_RUNTIME:-3}
    REPS=${SCN_POLL_REPS:-3}
    dmsetup create klin --table "0 2097152 linear /dev/nvme0n1 0"
    dmsetup create kstr --table "0 2097152 striped 2 128 /dev/nvme0n1 0 /dev/nvme0n1 1048576"
    echo "RESULT poll_kernel_dm_io_poll=$(cat /sys/block/dm-0/queue/io_poll)"
    # udm's devices: raw, linear and striped over the two halves (as kstr).
    udm_iops() { # STACK IOPOLL(,iopoll or empty) MODE QD
        udm bench --dev "raw=file:/dev/nvme0n1$2" --dev "lin=0 2097152 linear raw 0" \
            --dev "str=0 2097152 striped 2 128 raw 0 raw 1048576" --target "$1" \
            --rw randread --bs 4k --iodepth "$4" --runtime "$RT" --json $(mode_flag "$3") 2>/dev/null |
            sed -n 's/.*"iops":\([0-9.]*\).*/\1/p' | cut -d. -f1
    }
    kernel_iops() { # DEV HIPRI QD
        fio --name=k --filename="$1" --direct=1 --ioengine=io_uring --hipri="$2" --rw=randread \
            --bs=4k --iodepth="$3" --numjobs=1 --time_based --runtime="$RT" \
            --output-format=terse --terse-version=3 2>/dev/null | cut -d';' -f8
    }
    # Configurations: udm STACK.MODE (irq: no iopoll; the others iopoll
    # with that reactor mode) and kernel DEV.hipri0|1.
    UCFG=${SCN_POLL_MODES:-irq interrupt poll hybrid adaptive}
    r=0
    while [ $r -lt "$REPS" ]; do
        r=$((r + 1))
        for qd in ${SCN_POLL_QDS:-1 32}; do
            for s in raw lin str; do
                for c in $UCFG; do
                    if [ $c = irq ]; then v=$(udm_iops $s "" interrupt $qd); else v=$(udm_iops $s ,iopoll $c $qd); fi
                    echo "RESULT tab_qd${qd}_udm_${s}_${c}_run$r=${v:-0}"
                    echo "$qd udm_${s}_${c} ${v:-0}" >>/tmp/tab
                done
            done
            for k in raw:/dev/nvme0n1 lin:/dev/mapper/klin str:/dev/mapper/kstr; do
                for h in 0 1; do
                    v=$(kernel_iops ${k#*:} $h $qd)
                    echo "RESULT tab_qd${qd}_kernel_${k%%:*}_hipri${h}_run$r=${v:-0}"
                    echo "$qd kernel_${k%%:*}_hipri$h ${v:-0}" >>/tmp/tab
                done
            done
        done
    done
    # Medians per configuration.
    for key in $(awk '{print $1 "_" $2}' /tmp/tab | sort -u); do
        qd=${key%%_*} cfg=${key#*_}
        med=$(awk -v q="$qd" -v c="$cfg" '$1 == q && $2 == c {print $3}' /tmp/tab | sort -n |
            awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}')
        echo "RESULT tab_qd${qd}_${cfg}_median=$med"
    done
    check poll_table_measured sh -c '! grep -q " 0$" /tmp/tab'
    dmsetup remove kstr
    dmsetup remove klin
fi
