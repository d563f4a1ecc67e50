# Scenario crypt-bench (sourced by the guest's /test.sh; see scripts/guest.sh):
# udm's crypt over a RAM disk of its own, exported over ublk, against
# Linux's dm-crypt over brd, the same table (aes-xts-plain64, 512-bit key,
# SCN_CRYPT_SECTOR-byte sectors, default 4096 as LUKS2's) and the same fio
# jobs: 4 KiB random reads and writes at QD32, 128 KiB sequential reads and
# writes at QD4, 2 jobs each. Linux runs twice: its default table (reads
# and writes through dm-crypt's workqueues) and with no_read_workqueue
# no_write_workqueue (each I/O encrypted on the CPU that submits or
# completes it, what udm does). Beside them, the same jobs without
# encryption, udm's linear over its RAM disk via ublk and Linux's dm-linear
# over brd: the share of the gap that is ublk's, not crypt's (SCN_CRYPT_FLOOR=0
# leaves them out). The cases take turns in every round, their order
# rotated; RESULT lines give each run's IOPS, the medians and udm's ratios
# to each Linux case. First, what the guest CPU offers (QEMU/TCG's
# `-cpu max`): its AES flags, the xts(aes) drivers Linux registered, and
# whether udm's crypt runs its VAES code (AVX-512) or the portable AES-NI
# path. Figures only compare within one guest run (TCG emulates every
# instruction, AES included). Knobs: SCN_CRYPT_SECTOR, SCN_CRYPT_RUNTIME
# (seconds per run, default 5), SCN_CRYPT_REPS (rounds, default 3),
# SCN_CRYPT_FLOOR.
grep -q '^ublk_drv ' /proc/modules || insmod /lib/modules/ublk_drv.ko
# Another scenario of the same guest run may have loaded brd already, with
# its own sizes: the disks are then as large as its /dev/ram0.
grep -q '^brd ' /proc/modules || insmod /lib/modules/brd.ko rd_size=65536 rd_nr=1
[ -e /dev/ublk-control ] || mdev -s
CB_SECTOR=${SCN_CRYPT_SECTOR:-4096}
CB_SZ=$(blockdev --getsz /dev/ram0)
[ "$CB_SZ" -gt 131072 ] && CB_SZ=131072
CB_SZ=$((CB_SZ / 8 * 8))
flags=$(grep -m1 '^flags' /proc/cpuinfo)
have=""
for f in aes pclmulqdq avx2 vaes vpclmulqdq avx512f avx512bw; do
    case " $flags " in *" $f "*) have="$have,$f" ;; esac
done
echo "RESULT crypt_bench_cpu=$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //; s/ /_/g')"
echo "RESULT crypt_bench_cpu_flags=${have#,}"
case ",$have," in
*,aes,*vaes,*vpclmulqdq,*avx512f,*avx512bw,*) echo "RESULT crypt_bench_udm_path=vaes" ;;
*,aes,*) echo "RESULT crypt_bench_udm_path=portable_aesni" ;;
*) echo "RESULT crypt_bench_udm_path=portable_software" ;;
esac
export UDM_CONTROL=/tmp/udm-cb.sock
start_daemon /tmp/cb.log
CB_PID=$DAEMON_PID
CB_KEY=$(od -An -tx1 -N64 /dev/urandom | tr -d ' \n')
CB_OPTS="1 sector_size:$CB_SECTOR"
[ "$CB_SECTOR" = 512 ] && CB_OPTS=""
udm create cbram "ram:${CB_SZ}s"
udm create cbcr --table "0 $CB_SZ crypt aes-xts-plain64 $CB_KEY 0 cbram 0 $CB_OPTS"
check crypt_bench_udm_export udm export add cbcr --ublk --id 11 --queues 2
i=0
until [ -b /dev/ublkb11 ]; do i=$((i + 1)); [ $i -lt 100 ] || break; sleep 0.1; mdev -s; done
CB_CASES="udm linux linux_nowq"
if [ "${SCN_CRYPT_FLOOR:-1}" = 1 ]; then
    udm create cblin --table "0 $CB_SZ linear cbram 0"
    check crypt_bench_udm_linear_export udm export add cblin --ublk --id 12 --queues 2
    i=0
    until [ -b /dev/ublkb12 ]; do i=$((i + 1)); [ $i -lt 100 ] || break; sleep 0.1; mdev -s; done
    check crypt_bench_linux_linear dmsetup create klb --table "0 $CB_SZ linear /dev/ram0 0"
    CB_CASES="$CB_CASES udm_linear linux_linear"
fi
CB_NOWQ="$((${CB_OPTS%% *} + 2)) ${CB_OPTS#* } no_read_workqueue no_write_workqueue"
[ -z "$CB_OPTS" ] && CB_NOWQ="2 no_read_workqueue no_write_workqueue"
check crypt_bench_linux_dm dmsetup create kcb --table "0 $CB_SZ crypt aes-xts-plain64 $CB_KEY 0 /dev/ram0 0 $CB_OPTS"
echo "RESULT crypt_bench_table=aes-xts-plain64_512bit_key_${CB_SECTOR}B_sectors_${CB_SZ}_sectors"
# The drivers the crypto API registered for XTS (dm-crypt takes the one of
# highest priority), now that dm-crypt has asked for it.
awk '/^name/ {n = $3} /^driver/ {d = $3} /^priority/ {p = $3}
     /^$/ {if (n == "xts(aes)") printf "%s(%s) ", d, p; n = ""} END {print ""}' /proc/crypto |
    sed 's/ $//; s/ /,/g; s/^/RESULT crypt_bench_linux_xts_drivers=/'
# Written once through each, so that reads decrypt real ciphertext.
dd if=/dev/urandom of=/dev/ublkb11 bs=1M count=$((CB_SZ / 2048)) oflag=direct 2>/dev/null
dd if=/dev/urandom of=/dev/mapper/kcb bs=1M count=$((CB_SZ / 2048)) oflag=direct 2>/dev/null
CB_RUNTIME=${SCN_CRYPT_RUNTIME:-5}
CB_REPS=${SCN_CRYPT_REPS:-3}
[ "$LONG" = 1 ] && { CB_RUNTIME=20; CB_REPS=5; }
cb_dev() {
    case $1 in
    udm) echo /dev/ublkb11 ;; udm_linear) echo /dev/ublkb12 ;;
    linux_linear) echo /dev/mapper/klb ;; *) echo /dev/mapper/kcb ;;
    esac
}
# The Linux cases share one device: its table is reloaded between them.
cb_table() {
    case $1 in
    linux) echo "0 $CB_SZ crypt aes-xts-plain64 $CB_KEY 0 /dev/ram0 0 $CB_OPTS" ;;
    linux_nowq) echo "0 $CB_SZ crypt aes-xts-plain64 $CB_KEY 0 /dev/ram0 0 $CB_NOWQ" ;;
    esac
}
CB_LOADED=linux
cb_run() { # CASE RW BS QD -> IOPS (reads + writes)
    if [ "${1#linux}" != "$1" ] && [ "$1" != linux_linear ] && [ "$1" != "$CB_LOADED" ]; then
        dmsetup suspend kcb && dmsetup load kcb --table "$(cb_table "$1")" && dmsetup resume kcb
        CB_LOADED=$1
    fi
    fio --name=cb --filename="$(cb_dev "$1")" --direct=1 --ioengine=io_uring --rw="$2" --bs="$3" \
        --iodepth="$4" --numjobs=2 --group_reporting --time_based --runtime="$CB_RUNTIME" \
        --output-format=terse --terse-version=3 2>/dev/null |
        awk -F';' '{printf "%d\n", $8 + $49}'
}
median() { tr ' ' '\n' | grep . | sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
for job in "randread 4k 32" "randwrite 4k 32" "read 128k 4" "write 128k 4"; do
    set -- $job
    jn="${1}_${2}_qd$3"
    for c in $CB_CASES; do eval "I_$c="; done
    r=0
    while [ $r -lt $CB_REPS ]; do
        r=$((r + 1))
        # Rotate the order each round: round r starts with the r-th case.
        order=$(echo $CB_CASES $CB_CASES | awk -v r=$r -v n="$(echo $CB_CASES | wc -w)" \
            '{for (i = 0; i < n; i++) printf "%s ", $((r - 1) % n + 1 + i)}')
        for c in $order; do
            v=$(cb_run "$c" "$1" "$2" "$3")
            echo "RESULT crypt_bench_${jn}_run${r}_$c=$v"
            eval "I_$c=\"\$I_$c $v\""
        done
    done
    for c in $CB_CASES; do
        eval "m=\$(echo \"\$I_$c\" | median)"
        eval "M_$c=$m"
        echo "RESULT crypt_bench_${jn}_median_$c=$m"
    done
    echo "RESULT crypt_bench_${jn}_ratio_linux=$(awk -v u="$M_udm" -v k="$M_linux" 'BEGIN {printf "%.2f", (k > 0 ? u / k : 0)}')"
    echo "RESULT crypt_bench_${jn}_ratio_linux_nowq=$(awk -v u="$M_udm" -v k="$M_linux_nowq" 'BEGIN {printf "%.2f", (k > 0 ? u / k : 0)}')"
    if [ -n "${M_linux_linear:-}" ]; then
        echo "RESULT crypt_bench_${jn}_ratio_linear=$(awk -v u="$M_udm_linear" -v k="$M_linux_linear" 'BEGIN {printf "%.2f", (k > 0 ? u / k : 0)}')"
    fi
    check "crypt_bench_${jn}_measured" sh -c "[ '${M_udm:-0}' -gt 0 ] && [ '${M_linux:-0}' -gt 0 ] && [ '${M_linux_nowq:-0}' -gt 0 ]"
done
dmsetup remove kcb
if [ "${SCN_CRYPT_FLOOR:-1}" = 1 ]; then
    dmsetup remove klb
    udm export remove cblin
    udm remove cblin
fi
udm export remove cbcr
udm remove cbcr
udm remove cbram
kill $CB_PID
wait $CB_PID
