# Scenario crypt (sourced by the guest's /test.sh; see scripts/guest.sh):
# udm's crypt target writes what Linux's dm-crypt writes. For each cipher,
# IV mode and sector size, the same plaintext goes through Linux's dm-crypt
# onto /dev/ram0 and through udm's crypt (exported over ublk) onto
# /dev/ram1: the two ciphertexts must be the same bytes, and each side
# reads back the plaintext through the other's device. Then a LUKS2 volume
# made by the host's cryptsetup (/dev/vda, key file /dev/vdb; see
# crypt.host.sh): what Linux writes through the volume key, udm opens with
# luks: and the key file and reads back, and the reverse.
grep -q '^ublk_drv ' /proc/modules || insmod /lib/modules/ublk_drv.ko
grep -q '^brd ' /proc/modules || insmod /lib/modules/brd.ko rd_size=16384 rd_nr=2
[ -e /dev/ublk-control ] || mdev -s
export UDM_CONTROL=/tmp/udm-crypt.sock
start_daemon /tmp/udm-crypt.log
CR_PID=$DAEMON_PID
udm create cr0 file:/dev/ram0
udm create cr1 file:/dev/ram1
K512=$(od -An -tx1 -N64 /dev/urandom | tr -d ' \n')
K256=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
dd if=/dev/urandom of=/tmp/cr-plain bs=1M count=8 2>/dev/null
dd if=/dev/urandom of=/tmp/cr-plain2 bs=1M count=8 2>/dev/null
# A ublk device of udm's, named $1, over table $2; waits for the node.
cr_export() {
    udm create "$1" --table "$2" && udm export add "$1" --ublk --id 7 &&
        { [ -e /dev/ublkb7 ] || mdev -s; } && [ -b /dev/ublkb7 ]
}
cr_unexport() { udm export remove "$1" && udm remove "$1"; }
# cr_case NAME CIPHER KEY IV_OFFSET OPTS: OPTS is dm-crypt's optional
# parameter list with its count ("" or "1 sector_size:4096" ...).
cr_case() {
    local name=$1 cipher=$2 key=$3 ivo=$4 opts=$5
    local sz=32768
    dmsetup create kcr --table "0 $sz crypt $cipher $key $ivo /dev/ram0 0 $opts" || return 1
    dd if=/tmp/cr-plain of=/dev/mapper/kcr bs=1M oflag=direct 2>/dev/null || return 1
    dmsetup remove kcr || return 1
    cr_export ucr "0 $sz crypt $cipher $key $ivo cr1 0 $opts" || return 1
    dd if=/tmp/cr-plain of=/dev/ublkb7 bs=1M oflag=direct 2>/dev/null || return 1
    cr_unexport ucr || return 1
    echo 3 >/proc/sys/vm/drop_caches
    check "crypt_${name}_same_ciphertext" cmp -n 8388608 /dev/ram0 /dev/ram1
    # Each reads what the other wrote.
    cr_export ucr "0 $sz crypt $cipher $key $ivo cr0 0 $opts" || return 1
    check "crypt_${name}_udm_reads_linux" cmp -n 8388608 /tmp/cr-plain /dev/ublkb7
    cr_unexport ucr || return 1
    dmsetup create kcr --table "0 $sz crypt $cipher $key $ivo /dev/ram1 0 $opts" || return 1
    check "crypt_${name}_linux_reads_udm" cmp -n 8388608 /tmp/cr-plain /dev/mapper/kcr
    dmsetup remove kcr
}
check crypt_xts_plain64_512 cr_case xts_plain64_512 aes-xts-plain64 "$K512" 0 ""
check crypt_xts_plain64_4096 cr_case xts_plain64_4096 aes-xts-plain64 "$K512" 0 "1 sector_size:4096"
check crypt_xts_plain64_4096_large cr_case xts_plain64_4096_large aes-xts-plain64 "$K512" 0 \
    "2 sector_size:4096 iv_large_sectors"
check crypt_xts_plain64_ivoffset cr_case xts_plain64_ivoffset aes-xts-plain64 "$K512" 123456789 ""
check crypt_xts_plain cr_case xts_plain aes-xts-plain "$K512" 0 ""
check crypt_cbc_essiv cr_case cbc_essiv aes-cbc-essiv:sha256 "$K256" 0 ""
check crypt_capi cr_case capi 'capi:xts(aes)-plain64' "$K512" 0 ""

if [ -n "${SCN_LUKS_VK:-}" ]; then
    LSZ=$(($(blockdev --getsz /dev/vda) - SCN_LUKS_OFFSET))
    LT="0 $LSZ crypt aes-xts-plain64 $SCN_LUKS_VK 0 /dev/vda $SCN_LUKS_OFFSET 1 sector_size:$SCN_LUKS_SECTOR"
    # Linux writes through the volume key; udm opens the volume with the key file.
    check luks_linux_writes sh -c "dmsetup create kl --table '$LT' &&
        dd if=/tmp/cr-plain of=/dev/mapper/kl bs=1M oflag=direct 2>/dev/null && dmsetup remove kl"
    check luks_udm_opens sh -c 'udm create ul luks:/dev/vda,key-file=/dev/vdb &&
        udm export add ul --ublk --id 8 && { [ -e /dev/ublkb8 ] || mdev -s; }'
    check luks_udm_reads_linux cmp -n 8388608 /tmp/cr-plain /dev/ublkb8
    check luks_udm_writes sh -c "[ -b /dev/ublkb8 ] && dd if=/tmp/cr-plain2 of=/dev/ublkb8 bs=1M oflag=direct 2>/dev/null"
    udm export remove ul
    udm remove ul
    echo 3 >/proc/sys/vm/drop_caches
    dmsetup create kl --table "$LT"
    check luks_linux_reads_udm cmp -n 8388608 /tmp/cr-plain2 /dev/mapper/kl
    dmsetup remove kl
    # A wrong key file: one line, no device.
    head -c 4096 /dev/zero >/tmp/wrong.key
    check luks_wrong_key sh -c '! udm create bad luks:/dev/vda,key-file=/tmp/wrong.key 2>/tmp/wrong.err &&
        [ "$(wc -l </tmp/wrong.err)" = 1 ] && ! udm info bad >/dev/null 2>&1'
    cat /tmp/wrong.err
fi
udm remove cr0
udm remove cr1

# SCN_CRYPT_BENCH=1: udm's crypt over a RAM disk of its own, exported over
# ublk, against Linux's dm-crypt over brd (aes-xts-plain64, 4 KiB sectors),
# the same fio jobs, SCN_CRYPT_ROUNDS (default 3) interleaved rounds;
# RESULT lines give each side's median IOPS and udm's ratio to Linux's.
if [ "${SCN_CRYPT_BENCH:-0}" = 1 ]; then
    udm create bram ram:64M
    cr_export bcr "0 131072 crypt aes-xts-plain64 $K512 0 bram 0 1 sector_size:4096"
    dmsetup create kb --table "0 32768 crypt aes-xts-plain64 $K512 0 /dev/ram0 0 1 sector_size:4096"
    dd if=/dev/zero of=/dev/ublkb7 bs=1M count=64 oflag=direct 2>/dev/null
    dd if=/dev/zero of=/dev/mapper/kb bs=1M count=16 oflag=direct 2>/dev/null
    cr_fio() { # DEV RW BS QD -> IOPS
        fio --name=b --filename="$1" --rw="$2" --bs="$3" --iodepth="$4" --numjobs=1 \
            --ioengine=io_uring --direct=1 --size=16M --runtime="${SCN_CRYPT_SECS:-4}" --time_based \
            --output-format=terse 2>/dev/null |
            awk -F';' '{ r = $8 + $49; printf "%d", r }'
    }
    median() { tr ' ' '\n' | grep . | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
    for job in "randread 4k 32" "randwrite 4k 32" "read 128k 4" "write 128k 4"; do
        set -- $job
        u=""; k=""
        for r in $(seq 1 "${SCN_CRYPT_ROUNDS:-3}"); do
            u="$u $(cr_fio /dev/ublkb7 "$1" "$2" "$3")"
            k="$k $(cr_fio /dev/mapper/kb "$1" "$2" "$3")"
        done
        um=$(echo "$u" | median); km=$(echo "$k" | median)
        echo "RESULT crypt_bench_${1}_${2}_qd${3}_udm=$um linux=$km ratio=$(echo "$um $km" | awk '{ printf "%.2f", $2 ? $1 / $2 : 0 }') rounds_udm=[$u ] rounds_linux=[$k ]"
    done
    dmsetup remove kb
    cr_unexport bcr
    udm remove bram
fi
kill $CR_PID; wait $CR_PID
