# Scenario thin (sourced by the guest's /test.sh; see scripts/guest.sh):
# pools move between Linux's dm-thin and udm's thin-pool. Linux makes a
# pool on /dev/ram0 (metadata) and /dev/ram1 (data) with a volume and a
# snapshot written apart; udm activates the same pool and reads the same
# bytes through both. Then the reverse on /dev/ram2 and /dev/ram3. Then
# fio --verify through a chain of snapshots on each side, and mkfs.ext4 +
# fsck on a udm thin volume over ublk.
grep -q '^ublk_drv ' /proc/modules || insmod /lib/modules/ublk_drv.ko
grep -q '^brd ' /proc/modules || insmod /lib/modules/brd.ko rd_size=65536 rd_nr=4
[ -e /dev/ublk-control ] || mdev -s
export UDM_CONTROL=/tmp/udm-thin.sock
# Four volumes exported at once: 64 MiB of ublk buffers each.
start_daemon /tmp/udm-thin.log --max-inflight 512M
TH_PID=$DAEMON_PID
POOL_SZ=131072 # the data device: 64 MiB
VOL_SZ=65536   # each volume: 32 MiB
BS=128         # 64 KiB data blocks
dd if=/dev/urandom of=/tmp/th-a bs=1M count=6 2>/dev/null
dd if=/dev/urandom of=/tmp/th-b bs=1M count=2 2>/dev/null
dd if=/dev/urandom of=/tmp/th-c bs=64k count=5 2>/dev/null
# th_write DEV0 DEV1: volume 0 gets A at 1 MiB; then (after the snapshot,
# made by the caller) B over part of it on volume 0 and C at 20 MiB on the
# snapshot, 4 KiB-unaligned to the data blocks.
th_write_origin() { dd if=/tmp/th-a of="$1" bs=1M seek=1 oflag=direct 2>/dev/null; }
th_write_after() {
    dd if=/tmp/th-b of="$1" bs=4k seek=300 oflag=direct 2>/dev/null &&
        dd if=/tmp/th-c of="$2" bs=4k seek=5121 oflag=direct 2>/dev/null
}
# udm_vol NAME POOL ID UBLK_ID: a thin volume of udm's exported over ublk
# as /dev/ublkbUBLK_ID; prints that node.
udm_vol() {
    udm create "$1" --table "0 $VOL_SZ thin $2 $3" >/dev/null &&
        udm export add "$1" --ublk --id "$4" >/dev/null &&
        { [ -e /dev/ublkb$4 ] || mdev -s; } && [ -b /dev/ublkb$4 ] && echo /dev/ublkb$4
}
udm_unvol() { udm export remove "$1" && udm remove "$1"; }

# Linux -> udm.
check thin_linux_pool dmsetup create kpool --table "0 $POOL_SZ thin-pool /dev/ram0 /dev/ram1 $BS 0"
check thin_linux_vol sh -c "dmsetup message kpool 0 'create_thin 0' &&
    dmsetup create kt0 --table '0 $VOL_SZ thin /dev/mapper/kpool 0'"
check thin_linux_origin_writes th_write_origin /dev/mapper/kt0
check thin_linux_snap sh -c "dmsetup suspend kt0 && dmsetup message kpool 0 'create_snap 1 0' &&
    dmsetup resume kt0 && dmsetup create kt1 --table '0 $VOL_SZ thin /dev/mapper/kpool 1'"
check thin_linux_after_writes th_write_after /dev/mapper/kt0 /dev/mapper/kt1
dd if=/dev/mapper/kt0 of=/tmp/lt0 bs=1M 2>/dev/null
dd if=/dev/mapper/kt1 of=/tmp/lt1 bs=1M 2>/dev/null
dmsetup status kpool
dmsetup remove kt1; dmsetup remove kt0; dmsetup remove kpool
udm create lmeta file:/dev/ram0
udm create ldata file:/dev/ram1
check thin_udm_opens_linux_pool udm create lpool --table "0 $POOL_SZ thin-pool lmeta ldata $BS 0"
udm status lpool
D0=$(udm_vol lt0 lpool 0 10)
D1=$(udm_vol lt1 lpool 1 11)
check thin_udm_reads_linux_origin cmp /tmp/lt0 "$D0"
check thin_udm_reads_linux_snap cmp /tmp/lt1 "$D1"
udm status lt0
udm_unvol lt0; udm_unvol lt1; udm remove lpool; udm remove lmeta; udm remove ldata

# udm -> Linux.
udm create umeta file:/dev/ram2
udm create udata file:/dev/ram3
check thin_udm_pool udm create upool --table "0 $POOL_SZ thin-pool umeta udata $BS 0"
check thin_udm_vol udm message upool 0 create_thin 0
U0=$(udm_vol ut0 upool 0 12)
check thin_udm_origin_writes th_write_origin "$U0"
check thin_udm_snap sh -c 'udm suspend ut0 && udm message upool 0 create_snap 1 0 && udm resume ut0'
U1=$(udm_vol ut1 upool 1 13)
check thin_udm_after_writes th_write_after "$U0" "$U1"
dd if="$U0" of=/tmp/ut0 bs=1M 2>/dev/null
dd if="$U1" of=/tmp/ut1 bs=1M 2>/dev/null
udm status upool
udm_unvol ut0; udm_unvol ut1; udm remove upool; udm remove umeta; udm remove udata
echo 3 >/proc/sys/vm/drop_caches
check thin_linux_opens_udm_pool dmsetup create kpool2 --table "0 $POOL_SZ thin-pool /dev/ram2 /dev/ram3 $BS 0"
dmsetup create kt20 --table "0 $VOL_SZ thin /dev/mapper/kpool2 0"
dmsetup create kt21 --table "0 $VOL_SZ thin /dev/mapper/kpool2 1"
check thin_linux_reads_udm_origin cmp /tmp/ut0 /dev/mapper/kt20
check thin_linux_reads_udm_snap cmp /tmp/ut1 /dev/mapper/kt21
dmsetup status kpool2
dmsetup remove kt21; dmsetup remove kt20; dmsetup remove kpool2

# fio --verify through a chain of snapshots, on each side: volume 0 is
# written, snapshot 1 of it, more writes on 1, snapshot 2 of 1, writes on
# 2; each volume verifies its own last writes (fio's header carries the
# offset and a checksum, so a block from the wrong volume fails).
FIOV="--ioengine=psync --direct=1 --bs=4k --size=8M --verify=crc32c --do_verify=1 --randseed=7"
th_fio() { fio --name=v --filename="$1" --rw=randwrite $FIOV --offset="$2" >/tmp/fio.out 2>&1 || { tail -20 /tmp/fio.out; return 1; }; }
dmsetup create kpool3 --table "0 $POOL_SZ thin-pool /dev/ram0 /dev/ram1 $BS 0 1 skip_block_zeroing"
dmsetup message kpool3 0 'create_thin 5'
dmsetup create k5 --table "0 $VOL_SZ thin /dev/mapper/kpool3 5"
check thin_linux_chain_5 th_fio /dev/mapper/k5 0
dmsetup suspend k5 && dmsetup message kpool3 0 'create_snap 6 5' && dmsetup resume k5
dmsetup create k6 --table "0 $VOL_SZ thin /dev/mapper/kpool3 6"
check thin_linux_chain_6 th_fio /dev/mapper/k6 4M
dmsetup suspend k6 && dmsetup message kpool3 0 'create_snap 7 6' && dmsetup resume k6
dmsetup create k7 --table "0 $VOL_SZ thin /dev/mapper/kpool3 7"
check thin_linux_chain_7 th_fio /dev/mapper/k7 8M
dmsetup remove k7; dmsetup remove k6; dmsetup remove k5; dmsetup remove kpool3
udm create cmeta file:/dev/ram2
udm create cdata file:/dev/ram3
udm create cpool --table "0 $POOL_SZ thin-pool cmeta cdata $BS 0 1 skip_block_zeroing"
udm message cpool 0 create_thin 5
C5=$(udm_vol c5 cpool 5 14)
check thin_udm_chain_5 th_fio "$C5" 0
udm suspend c5 && udm message cpool 0 create_snap 6 5 && udm resume c5
C6=$(udm_vol c6 cpool 6 15)
check thin_udm_chain_6 th_fio "$C6" 4M
udm suspend c6 && udm message cpool 0 create_snap 7 6 && udm resume c6
C7=$(udm_vol c7 cpool 7 16)
check thin_udm_chain_7 th_fio "$C7" 8M
# A filesystem on a fresh volume.
udm message cpool 0 create_thin 9
C9=$(udm_vol c9 cpool 9 17)
check thin_udm_mkfs /sbin/mke2fs -t ext4 -q -F "$C9"
check thin_udm_fsck /sbin/e2fsck -fn "$C9"
udm status cpool
for v in c9 c7 c6 c5; do udm_unvol $v; done
udm remove cpool; udm remove cmeta; udm remove cdata
kill $TH_PID; wait $TH_PID
