#!/bin/sh
# /init of the test guest: loads the modules, runs /test.sh (added by
# run.sh) and prints its exit status as GUEST_RC=N on the console.
# Modules that take parameters (brd, null_blk, nbd, ublk_drv) are left to
# the test: insmod /lib/modules/NAME.ko ARGS.
export PATH=/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp
for m in $(cat /lib/modules/order); do
    case $m in brd.ko | nbd.ko | ublk_drv.ko | null_blk.ko) continue ;; esac
    insmod /lib/modules/$m 2>/dev/null
done
mdev -s 2>/dev/null
export DM_DISABLE_UDEV=1
echo "GUEST_UP kernel=$(uname -r) cpus=$(nproc)"
sh -e /test.sh
echo "GUEST_RC=$?"
sync
poweroff -f
