# Scenario ublk (sourced by the guest's /test.sh; see scripts/guest.sh):
# udm's ublk export under real kernel clients. Each check prints
# `RESULT name=ok|FAIL`; `check` counts failures in $FAILED.
insmod /lib/modules/ublk_drv.ko
[ -e /dev/ublk-control ] || mdev -s
export UDM_CONTROL=/tmp/udm.sock
start_daemon /tmp/udm.log
UDM_PID=$DAEMON_PID
udm create r0 ram:128M
udm create r1 ram:64M
udm create r2 ram:64M
udm create lin --table "0 262144 linear r0 0"
udm create str --table "0 262144 striped 2 128 r1 0 r2 0"

fio_verify() { # DEV NAME [more fio args]
    local dev=$1 name=$2 rc
    shift 2
    fio --name="$name" --filename="$dev" --direct=1 --ioengine=io_uring --rw=randwrite \
        --bs=4k --bsrange=4k-256k --iodepth=16 --size="${FIO_SIZE:-48M}" --verify=crc32c \
        --verify_fatal=1 --do_verify=1 --numjobs=1 "$@" >/tmp/fio-$name.log 2>&1
    rc=$?
    grep -E "err=|IOPS" /tmp/fio-$name.log | head -3
    return $rc
}

# fio --verify over linear, then striped.
check ublk_add_linear udm export add lin --ublk --id 0 --queues 2 --depth 64
check ublk_dev_appears test -b /dev/ublkb0
check ublk_size_is_the_devices sh -c '[ "$(cat /sys/block/ublkb0/size)" = 262144 ]'
check ublk_fio_linear fio_verify /dev/ublkb0 lin
check ublk_remove_linear udm export remove lin
check ublk_dev_gone sh -c '! test -e /dev/ublkb0'
check ublk_add_striped udm export add str --ublk --id 0
check ublk_fio_striped fio_verify /dev/ublkb0 str --iodepth=32
# An id the kernel has given to another server: refused, naming it.
export UDM_CONTROL=/tmp/udm2.sock
start_daemon /tmp/udm2.log --max-inflight 64M
UDM2=$DAEMON_PID
export UDM_CONTROL=/tmp/udm.sock
UDM_CONTROL=/tmp/udm2.sock udm create other ram:16M
check ublk_id_in_use_refused sh -c '! UDM_CONTROL=/tmp/udm2.sock udm export add other --ublk --id 0 --queues 1 --depth 16 2>/tmp/id.err && grep -q "ublk device 0 exists" /tmp/id.err'
cat /tmp/id.err
# Its buffers (queues x depth x 512 KiB) come from the daemon's in-flight
# budget: with --max-inflight 64M, 32 MiB are lent to exports and
# connections, so one queue of 64 fits, a second export does not until the
# first is removed.
U2="env UDM_CONTROL=/tmp/udm2.sock udm"
$U2 create other2 ram:16M
check ublk_budget_refuses_too_big sh -c "! $U2 export add other --ublk --queues 1 --depth 128 2>/tmp/b.err && grep -q 'its buffers (64 MiB) do not fit in the in-flight budget' /tmp/b.err"
cat /tmp/b.err
check ublk_budget_fits $U2 export add other --ublk --id 5 --queues 1 --depth 64
check ublk_budget_full sh -c "! $U2 export add other2 --ublk --queues 1 --depth 1 2>/tmp/b.err && grep -q '(0 MiB free of the 32 MiB' /tmp/b.err"
cat /tmp/b.err
check ublk_budget_given_back sh -c "$U2 export remove other && $U2 export add other2 --ublk --id 5 --queues 1 --depth 64"
kill $UDM2; wait $UDM2
# Discard: the RAM device zeroes what is discarded.
dd if=/dev/urandom of=/dev/ublkb0 bs=1M count=2 oflag=direct 2>/dev/null
check ublk_discard blkdiscard -o 0 -l 1048576 /dev/ublkb0
check ublk_discard_zeroes sh -c 'dd if=/dev/ublkb0 bs=1M count=1 iflag=direct 2>/dev/null | cmp - /dev/zero -n 1048576'
# A filesystem: mkfs, mount, copy, unmount, fsck.
ln -sf /proc/mounts /etc/mtab 2>/dev/null || true
mkdir -p /mnt/u
check ublk_mkfs_ext4 /sbin/mke2fs -q -F -t ext4 /dev/ublkb0
check ublk_mount mount -t ext4 /dev/ublkb0 /mnt/u
dd if=/dev/urandom of=/tmp/blob bs=1M count=8 2>/dev/null
cp /tmp/blob /mnt/u/blob && cp -r /bin /mnt/u/bin
# While mounted, the export cannot be removed.
check ublk_remove_refused_while_open sh -c '! udm export remove str 2>/tmp/rm.err && grep -q "is open" /tmp/rm.err'
cat /tmp/rm.err
check ublk_umount umount /mnt/u
check ublk_fsck /sbin/e2fsck -f -n /dev/ublkb0
check ublk_remount mount -t ext4 -o ro /dev/ublkb0 /mnt/u
check ublk_copy_intact sh -c 'grep -q "^/dev/ublkb0 /mnt/u " /proc/mounts && cmp /tmp/blob /mnt/u/blob && diff -r /bin /mnt/u/bin' 
umount /mnt/u
# Open by a reader: refused; --force removes it, the reader gets errors.
sleep 30 </dev/ublkb0 &
HOLDER=$!
check ublk_remove_refused_while_held sh -c '! udm export remove str 2>/dev/null'
check ublk_remove_forced udm export remove --force str
kill $HOLDER 2>/dev/null
check ublk_dev_gone_after_force sh -c '! test -e /dev/ublkb0'
# Read-only: the kernel sees a read-only disk; reads work, writes fail.
udm export add lin --ublk --id 2 --read-only >/dev/null
check ublk_ro_flag sh -c '[ "$(cat /sys/block/ublkb2/ro)" = 1 ]'
check ublk_ro_reads dd if=/dev/ublkb2 of=/dev/null bs=1M count=4 iflag=direct
check ublk_ro_writes_fail sh -c '! dd if=/dev/zero of=/dev/ublkb2 bs=4k count=1 oflag=direct 2>/dev/null'
check ublk_ro_remove udm export remove lin
# A forced removal under fio: fio gets errors and ends, udm goes on.
udm export add lin --ublk --id 1 >/dev/null
fio --name=race --filename=/dev/ublkb1 --direct=1 --ioengine=io_uring --rw=randrw --bs=4k \
    --iodepth=32 --time_based --runtime=60 >/tmp/fio-race.log 2>&1 &
RACE=$!
sleep 2
check ublk_forced_removal_under_io udm export remove --force lin
i=0
while kill -0 $RACE 2>/dev/null && [ $i -lt 100 ]; do i=$((i + 1)); sleep 0.1; done
check ublk_fio_ended_after_forced_removal sh -c "! kill -0 $RACE 2>/dev/null"
wait $RACE 2>/dev/null
check ublk_daemon_alive_after_forced_removal udm ls
# udm serve --ublk: the one-shot form, until SIGTERM.
udm serve --dev sr=ram:32M --ublk --control /tmp/serve.ctl >/tmp/serve.log 2>&1 &
SERVE=$!
i=0
until grep -q "control socket" /tmp/serve.log; do i=$((i + 1)); [ $i -lt 100 ] || break; sleep 0.1; done
SDEV=$(sed -n "s/^udm: serving 'sr' .* at //p" /tmp/serve.log)
cat /tmp/serve.log
check ublk_serve_device sh -c "[ -b '$SDEV' ] && [ \"\$(blockdev --getsize64 '$SDEV')\" = 33554432 ]"
check ublk_serve_fio fio_verify "$SDEV" serve --size=16M
kill $SERVE
wait $SERVE
check ublk_serve_stops sh -c "! test -e '$SDEV'"
# Dispatch (seed 004). Queued: the requests one reap of the ring brings
# are sorted and merged, so sequential 4 KiB writes (which the kernel is
# told not to merge itself) reach the device as fewer bios; stream: the
# back-to-back ones among them are merged, so the same; direct: one bio
# each. Data written through a queued or stream export reads back.
writes_of() { udm stats "$1" | sed -n 's/^Writes: *\([0-9]*\).*/\1/p'; }
for mode in queued stream direct; do
    udm create "r$mode" ram:16M
    udm create "d$mode" --table "0 32768 linear r$mode 0"
    check ublk_add_$mode udm export add "d$mode" --ublk --id 4 --dispatch $mode
    check ublk_info_$mode sh -c "udm info d$mode | grep -q 'Export dispatch: .*(ublk): $mode (asked for)'"
    echo 2 >/sys/block/ublkb4/queue/nomerges
    w0=$(writes_of "d$mode")
    fio --name=seq --filename=/dev/ublkb4 --direct=1 --ioengine=io_uring --rw=write --bs=4k \
        --iodepth=32 --iodepth_batch_submit=32 --size=8M >/tmp/fio-seq.log 2>&1
    w1=$(writes_of "d$mode")
    eval "BIOS_$mode=$((w1 - w0))"
    echo "RESULT ublk_${mode}_bios_for_2048_writes=$((w1 - w0))"
    # Stream merges only back-to-back requests: verify a sequential job.
    [ $mode = queued ] && check ublk_queued_fio_verify fio_verify /dev/ublkb4 queued --size=16M
    [ $mode = stream ] && check ublk_stream_fio_verify fio_verify /dev/ublkb4 stream --size=16M --rw=write
    udm export remove "d$mode"
done
check ublk_queued_merges sh -c "[ 0 -lt $BIOS_queued ] && [ $BIOS_queued -lt 2048 ]"
check ublk_stream_merges sh -c "[ 0 -lt $BIOS_stream ] && [ $BIOS_stream -lt 2048 ]"
check ublk_direct_does_not_merge [ "$BIOS_direct" -eq 2048 ]
# auto follows the device's report: a slow device gains from merging.
udm create slow null:16M,delay=100
udm export add slow --ublk --id 4 >/dev/null
check ublk_auto_follows_the_device sh -c "udm info slow | grep -q 'Export dispatch: .*(ublk): auto (auto: merging helps'"
udm info slow | grep "Export dispatch"
udm export remove slow
# A daemon stop deletes the devices it serves.
udm export add lin --ublk --id 3 >/dev/null
kill $UDM_PID; wait $UDM_PID
check ublk_daemon_stop_deletes sh -c '! test -e /dev/ublkb3 && ! test -e /dev/ublkc3'
