# Scenario logwrites (sourced by the guest's /test.sh; see scripts/guest.sh):
# the same writes, flushes, discards and marks go through Linux's
# dm-log-writes and through udm's log-writes (exported over ublk); the two
# logs must be the same bytes, so a tool that reads Linux's log (xfstests'
# replay-log) reads udm's, and `udm log-replay` replays either.
grep -q '^ublk_drv ' /proc/modules || insmod /lib/modules/ublk_drv.ko
grep -q '^brd ' /proc/modules || insmod /lib/modules/brd.ko rd_size=65536 rd_nr=2
[ -e /dev/ublk-control ] || mdev -s
export UDM_CONTROL=/tmp/udm-lw.sock
start_daemon /tmp/udm-lw.log
LW_PID=$DAEMON_PID
udm create lwdata ram:64M
udm create lwlog ram:64M
udm create lw --table "0 131072 log-writes lwdata lwlog"
check lw_ublk_add udm export add lw --ublk --id 5
check lw_linux_create dmsetup create klw --table "0 131072 log-writes /dev/ram0 /dev/ram1"
dd if=/dev/urandom of=/tmp/lw-one bs=4k count=64 2>/dev/null
dd if=/dev/urandom of=/tmp/lw-two bs=4k count=16 2>/dev/null
# The same sequence on each: O_DIRECT writes one at a time (no merging),
# a flush (fsync), a mark, a discard, more writes, a mark.
lw_run() { # DEV MARK_CMD...
    local dev=$1
    shift
    dd if=/tmp/lw-one of="$dev" bs=4k oflag=direct conv=fsync 2>/dev/null &&
        "$@" one &&
        blkdiscard -o 1048576 -l 65536 "$dev" &&
        dd if=/tmp/lw-two of="$dev" bs=4k seek=300 oflag=direct conv=fsync 2>/dev/null &&
        "$@" two
}
check lw_linux_writes lw_run /dev/mapper/klw dmsetup message klw 0 mark
check lw_udm_writes lw_run /dev/ublkb5 udm message lw 0 mark
dmsetup status klw
udm status lw
check lw_linux_remove dmsetup remove klw
check lw_udm_remove udm export remove lw
udm remove lw
# The log device, read through ublk.
check lw_log_export udm export add lwlog --ublk --id 6
# The used part: the super block says how many entries; compare the whole
# device (both start zeroed).
check lw_logs_identical cmp /dev/ram1 /dev/ublkb6
cmp /dev/ram1 /dev/ublkb6 2>&1 | head -3
od -A d -t x4 -N 64 /dev/ram1 | head -4
od -A d -t x4 -N 64 /dev/ublkb6 | head -4
udm export remove lwlog
kill $LW_PID; wait $LW_PID
