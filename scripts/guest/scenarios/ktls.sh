# Scenario ktls (sourced by the guest's /test.sh; see scripts/guest.sh):
# NBD over TLS with the record layer in the guest kernel (kTLS; the host's
# kernel has no CONFIG_TLS). udm serve with --tls require and client
# certificates; nbdcopy (gnutls) writes 32 MiB through it and reads them
# back, once with kernel TLS and once with UDM_TLS_RECORDS=user (rustls
# keeps the records), each read back compared with cmp. Checks that each
# run's log names its record layer, and prints each copy's MiB/s as
# RESULT lines (TCG: compare only within one run).
grep -q '^tls ' /proc/modules || insmod /lib/modules/tls.ko
ip link set lo up 2>/dev/null || ifconfig lo 127.0.0.1 up
mkdir -p /tmp/pki
tar -xf "$SCN_KTLS_DISK" -C /tmp/pki
dd if=/dev/urandom of=/tmp/kt-data bs=1M count=32 2>/dev/null
KT_URI="nbds://127.0.0.1:10809/kr?tls-certificates=/tmp/pki/client"
# kt_run NAME [ENV...]: serves a RAM disk over TLS (ENV set for udm),
# copies the data in and out, stops the server.
kt_run() {
    local name=$1 t0 t1 ms
    shift
    : >"/tmp/kt-$name.log"
    env "$@" udm serve --dev kr=ram:32M --export kr --listen 127.0.0.1:10809 --tls require \
        --tls-creds /tmp/pki/srv --tls-verify-peer >"/tmp/kt-$name.log" 2>&1 &
    KT_PID=$!
    i=0
    until grep -q "control socket at" "/tmp/kt-$name.log"; do
        i=$((i + 1)); [ $i -lt 300 ] || break; sleep 0.1
    done
    t0=$(cut -d' ' -f1 /proc/uptime | tr -d .)
    check "ktls_${name}_write" nbdcopy /tmp/kt-data "$KT_URI"
    check "ktls_${name}_read" nbdcopy "$KT_URI" "/tmp/kt-back-$name"
    t1=$(cut -d' ' -f1 /proc/uptime | tr -d .)
    check "ktls_${name}_same" cmp /tmp/kt-data "/tmp/kt-back-$name"
    # 2 x 32 MiB moved, in centiseconds.
    [ $((t1 - t0)) -gt 0 ] && echo "RESULT ktls_${name}_mib_s=$((6400 / (t1 - t0)))"
    kill "$KT_PID"
    wait "$KT_PID" 2>/dev/null
    [ "$FAILED" = 0 ] || cat "/tmp/kt-$name.log"
    rm -f "/tmp/kt-back-$name"
}
kt_run kernel
check ktls_kernel_records grep -q "TLS records in the kernel (kTLS)" /tmp/kt-kernel.log
# Every connection handed over and ended at the client's request.
check ktls_kernel_clean sh -c '! grep -q "kernel TLS:\|stay in userspace\|closed: \(send\|recv\|TLS\)" /tmp/kt-kernel.log'
grep "closed:" /tmp/kt-kernel.log
kt_run user UDM_TLS_RECORDS=user
check ktls_user_records grep -q "UDM_TLS_RECORDS=user" /tmp/kt-user.log
check ktls_user_not_kernel sh -c '! grep -q "TLS records in the kernel" /tmp/kt-user.log'
