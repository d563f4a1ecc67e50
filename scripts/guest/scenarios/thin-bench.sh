# Scenario thin-bench (sourced by the guest's /test.sh; see scripts/guest.sh):
# allocating writes on a thin volume, udm's thin-pool over RAM exported
# through ublk against Linux's dm-thin over brd, the same fio jobs, rounds
# interleaved (the order reversed every other round), each round on a
# fresh pool (64 KiB data blocks, skip_block_zeroing) with:
#   first64k  one pass of 64 KiB random writes over a fresh 64 MiB volume:
#             every write provisions a whole block (no zeroing, no copy);
#   first4k   4 KiB writes, one at the start of each 64 KiB block of another
#             fresh volume: every write provisions a block it covers in part;
#   over64k   64 KiB random writes over the second volume, now provisioned:
#             overwrites, the floor the first three compare with;
#   break4k   the first volume snapshotted, then 4 KiB writes, one per block
#             of it: every write breaks sharing (a copy of the 64 KiB block);
#   lin64k    64 KiB random writes over linear (udm's over RAM, dm-linear over
#             brd): what the export and the RAM cost without thin;
#   lin4k     4 KiB writes over the same linear devices, one per 64 KiB as in
#             first4k and break4k: their floor without thin. Where udm's
#             lin* runs below the kernel's thin job, no thin target behind
#             ublk can reach dm-thin in this guest.
# QD32, one job. The data devices are written over once before the first
# round, so that no run pays first-touch page faults of the RAM under it.
# Prints each run and the medians as RESULT lines (write IOPS) and the
# ratios udm/kernel. Figures only compare within one guest run (TCG).
# Knobs: SCN_THIN_ROUNDS (default 5; 7 with --long). Needs GUEST_MEM=2G
# (two RAM disks of each side, and three exports' ublk buffers).
grep -q '^ublk_drv ' /proc/modules || insmod /lib/modules/ublk_drv.ko
grep -q '^brd ' /proc/modules || insmod /lib/modules/brd.ko rd_size=204800 rd_nr=3
[ -e /dev/ublk-control ] || mdev -s
export UDM_CONTROL=/tmp/udm-tb.sock
# Three volumes exported at once: 64 MiB of ublk buffers each.
start_daemon /tmp/udm-tb.log --max-inflight 512M
TB_PID=$DAEMON_PID
TB_POOL=409600 # the data device: 200 MiB (three 64 MiB volumes' worth and some)
TB_VOL=131072  # each volume: 64 MiB
TB_ROUNDS=${SCN_THIN_ROUNDS:-5}
[ "$LONG" = 1 ] && TB_ROUNDS=${SCN_THIN_ROUNDS:-7}
check tb_udm_data udm create tbdata ram:200M
# Touch every page of both data devices once.
udm create tbfill --table "0 $TB_POOL linear tbdata 0"
udm export add tbfill --ublk --id 30 >/dev/null
[ -e /dev/ublkb30 ] || mdev -s
dd if=/dev/zero of=/dev/ublkb30 bs=1M count=200 oflag=direct 2>/dev/null
udm export remove tbfill; udm remove tbfill
dd if=/dev/zero of=/dev/ram1 bs=1M count=200 oflag=direct 2>/dev/null
# The linear controls, 64 MiB each, written over once too.
udm create tblram ram:64M
udm create tblin --table "0 $TB_VOL linear tblram 0"
udm export add tblin --ublk --id 33 >/dev/null
[ -e /dev/ublkb33 ] || mdev -s
dd if=/dev/zero of=/dev/ublkb33 bs=1M count=64 oflag=direct 2>/dev/null
dmsetup create kblin --table "0 $TB_VOL linear /dev/ram2 0"
dd if=/dev/zero of=/dev/mapper/kblin bs=1M count=64 oflag=direct 2>/dev/null

# fio_w DEV RW BS -> write IOPS
fio_w() {
    fio --name=w --filename="$1" --direct=1 --ioengine=io_uring --rw="$2" --bs="$3" \
        --iodepth=32 --numjobs=1 --size=64M --output-format=terse --terse-version=3 \
        2>/dev/null | cut -d';' -f49
}
# One round on udm: prints "first64k first4k over64k break4k lin64k lin4k".
round_udm() {
    local a b c o l l4
    l=$(fio_w /dev/ublkb33 randwrite 64k)
    l4=$(fio_w /dev/ublkb33 write:60k 4k)
    local n=0
    udm create tbmeta ram:16M >/dev/null || return 1
    # The last round's pool lets go of the data device once every reactor
    # dropped its tables: retry for a moment.
    until udm create tbpool --table "0 $TB_POOL thin-pool tbmeta tbdata 128 0 1 skip_block_zeroing" >/dev/null; do
        n=$((n + 1)); [ $n -lt 50 ] || return 1; sleep 0.1
    done
    udm message tbpool 0 create_thin 0 && udm message tbpool 0 create_thin 1 &&
        udm create tbv0 --table "0 $TB_VOL thin tbpool 0" >/dev/null &&
        udm create tbv1 --table "0 $TB_VOL thin tbpool 1" >/dev/null &&
        udm export add tbv0 --ublk --id 31 >/dev/null &&
        udm export add tbv1 --ublk --id 32 >/dev/null || return 1
    [ -e /dev/ublkb32 ] || mdev -s
    a=$(fio_w /dev/ublkb31 randwrite 64k)
    b=$(fio_w /dev/ublkb32 write:60k 4k)
    o=$(fio_w /dev/ublkb32 randwrite 64k)
    udm suspend tbv0 && udm message tbpool 0 create_snap 2 0 && udm resume tbv0 || return 1
    c=$(fio_w /dev/ublkb31 write:60k 4k)
    udm status tbpool >&2
    udm export remove tbv0; udm export remove tbv1
    udm remove tbv0; udm remove tbv1; udm remove tbpool; udm remove tbmeta
    echo "$a $b $o $c $l $l4"
}
# The same on Linux's dm-thin: metadata on /dev/ram0, data on /dev/ram1.
round_kernel() {
    local a b c o l l4
    l=$(fio_w /dev/mapper/kblin randwrite 64k)
    l4=$(fio_w /dev/mapper/kblin write:60k 4k)
    dd if=/dev/zero of=/dev/ram0 bs=1M count=16 oflag=direct 2>/dev/null
    dmsetup create kbpool --table "0 $TB_POOL thin-pool /dev/ram0 /dev/ram1 128 0 1 skip_block_zeroing" &&
        dmsetup message kbpool 0 'create_thin 0' && dmsetup message kbpool 0 'create_thin 1' &&
        dmsetup create kbv0 --table "0 $TB_VOL thin /dev/mapper/kbpool 0" &&
        dmsetup create kbv1 --table "0 $TB_VOL thin /dev/mapper/kbpool 1" || return 1
    a=$(fio_w /dev/mapper/kbv0 randwrite 64k)
    b=$(fio_w /dev/mapper/kbv1 write:60k 4k)
    o=$(fio_w /dev/mapper/kbv1 randwrite 64k)
    dmsetup suspend kbv0 && dmsetup message kbpool 0 'create_snap 2 0' && dmsetup resume kbv0 || return 1
    c=$(fio_w /dev/mapper/kbv0 write:60k 4k)
    dmsetup status kbpool >&2
    dmsetup remove kbv0; dmsetup remove kbv1; dmsetup remove kbpool
    echo "$a $b $o $c $l $l4"
}
median() { tr ' ' '\n' | grep . | sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
TB_JOBS="first64k first4k over64k break4k lin64k lin4k"
for j in $TB_JOBS; do eval "U_$j= K_$j= R_$j="; done
r=0
while [ $r -lt "$TB_ROUNDS" ]; do
    r=$((r + 1))
    if [ $((r % 2)) = 1 ]; then
        u=$(round_udm); k=$(round_kernel)
    else
        k=$(round_kernel); u=$(round_udm)
    fi
    check tb_round${r}_udm [ -n "$u" ]
    check tb_round${r}_kernel [ -n "$k" ]
    set -- $u
    for j in $TB_JOBS; do eval "U_$j=\"\$U_$j $1\""; echo "RESULT tb_run${r}_udm_$j=$1"; shift; done
    set -- $k
    for j in $TB_JOBS; do eval "K_$j=\"\$K_$j $1\""; echo "RESULT tb_run${r}_kernel_$j=$1"; shift; done
    # Per-round ratios, for their median.
    set -- $u
    for j in $TB_JOBS; do
        uk=$1; shift
        eval "kk=\$(echo \$K_$j | awk '{print \$NF}')"
        eval "R_$j=\"\$R_$j $(awk -v u="$uk" -v k="$kk" 'BEGIN {printf "%.3f", (k > 0 ? u / k : 0)}')\""
    done
done
for j in $TB_JOBS; do
    eval "mu=\$(echo \"\$U_$j\" | median) mk=\$(echo \"\$K_$j\" | median)"
    eval "rs=\"\$R_$j\""
    echo "RESULT tb_median_udm_$j=$mu"
    echo "RESULT tb_median_kernel_$j=$mk"
    echo "RESULT tb_ratio_$j=$(echo "$rs" | median) tb_ratios_$j=$(echo $rs | tr ' ' ',')"
done
dmsetup remove kblin
udm export remove tblin; udm remove tblin; udm remove tblram
udm remove tbdata
kill $TB_PID; wait $TB_PID
