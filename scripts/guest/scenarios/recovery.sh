# Scenario recovery (sourced by the guest's /test.sh; see scripts/guest.sh):
# udm killed with SIGKILL under fio, restarted, re-attaches /dev/ublkb0
# with --recover; fio sees a pause, not an error, and verifies every
# block. The data lives on a brd RAM disk (it outlives udm).
insmod /lib/modules/ublk_drv.ko 2>/dev/null
insmod /lib/modules/brd.ko rd_size=131072 rd_nr=1
[ -e /dev/ublk-control ] || mdev -s
export UDM_CONTROL=/tmp/udm-rec.sock
start_udm() { # LOG: a daemon serving d (file over /dev/ram0)
    start_daemon "$1" || return 1
    UDM_PID=$DAEMON_PID
    udm create d file:/dev/ram0
}
REC_SIZE=${FIO_SIZE:-16M}
check recover_first_daemon start_udm /tmp/rec1.log
check recover_export_add udm export add d --ublk --id 5 --queues 2
fio --name=rec --filename=/dev/ublkb5 --direct=1 --ioengine=io_uring --rw=randwrite --bs=4k \
    --iodepth=16 --size="$REC_SIZE" --rate_iops=400 --verify=crc32c --do_verify=1 --verify_fatal=1 \
    >/tmp/fio-rec.log 2>&1 &
FIO=$!
sleep 3
kill -9 $UDM_PID
wait $UDM_PID 2>/dev/null
check recover_device_kept test -b /dev/ublkb5
check recover_fio_still_running kill -0 $FIO
sleep 1
check recover_second_daemon start_udm /tmp/rec2.log
check recover_plain_add_says_recover sh -c '! udm export add d --ublk --id 5 2>/tmp/rec.err && grep -q -- "--recover" /tmp/rec.err'
cat /tmp/rec.err
check recover_reattach udm export add d --ublk --id 5 --recover
wait $FIO
FIO_RC=$?
grep -E "err=|verify" /tmp/fio-rec.log | head -5
check recover_fio_verified_after_kill sh -c "[ $FIO_RC = 0 ] && grep -q 'err= 0' /tmp/fio-rec.log"
# Flush durability: what was written and synced before the kill reads back.
dd if=/dev/urandom of=/tmp/synced bs=1M count=4 2>/dev/null
dd if=/tmp/synced of=/dev/ublkb5 bs=1M seek=20 conv=fsync 2>/dev/null
kill -9 $UDM_PID
wait $UDM_PID 2>/dev/null
check recover_again_daemon start_udm /tmp/rec3.log
check recover_again udm export add d --ublk --id 5 --recover
check recover_synced_data_intact sh -c 'dd if=/dev/ublkb5 bs=1M skip=20 count=4 iflag=direct 2>/dev/null | cmp - /tmp/synced'
# A filesystem written to across a kill passes fsck after the recovery.
ln -sf /proc/mounts /etc/mtab 2>/dev/null || true
mkdir -p /mnt/r
/sbin/mke2fs -q -F -t ext4 /dev/ublkb5 && mount -t ext4 /dev/ublkb5 /mnt/r
( i=0; while [ $i -lt 40 ]; do dd if=/dev/urandom of=/mnt/r/f$i bs=64k count=4 2>/dev/null; i=$((i + 1)); done ) &
WRITER=$!
sleep 2
kill -9 $UDM_PID
wait $UDM_PID 2>/dev/null
check recover_fs_daemon start_udm /tmp/rec4.log
check recover_fs_reattach udm export add d --ublk --id 5 --recover
wait $WRITER
check recover_fs_writer_done sh -c '[ -s /mnt/r/f39 ]'
sync
check recover_fs_umount umount /mnt/r
check recover_fs_fsck /sbin/e2fsck -f -n /dev/ublkb5
check recover_remove udm export remove d
check recover_device_gone sh -c '! test -e /dev/ublkb5'
kill $UDM_PID; wait $UDM_PID
