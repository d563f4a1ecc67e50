# Host side of scenario ktls (sourced by scripts/guest.sh on the host): a
# CA, a server certificate for 127.0.0.1 and a client certificate, made
# with openssl and packed as a tar disk (its device name goes to the guest
# as SCN_KTLS_DISK); nbdcopy (libnbd, gnutls) goes in as the client.
KT=$T/ktls
mkdir -p "$KT/srv" "$KT/client"
kt_ssl() { (cd "$KT" && openssl "$@" 2>/dev/null); }
kt_ssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca-key.pem \
    -out ca-cert.pem -days 30 -subj "/CN=udm ktls test CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n' >"$KT/server.ext"
printf 'extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n' >"$KT/client.ext"
for role in server client; do
    d=srv
    [ $role = client ] && d=client
    cp "$KT/ca-cert.pem" "$KT/$d/"
    kt_ssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$d/$role-key.pem" \
        -out "$role.csr" -subj "/O=Example/CN=$role"
    kt_ssl x509 -req -in "$role.csr" -CA ca-cert.pem -CAkey ca-key.pem -set_serial "$RANDOM" \
        -days 30 -extfile "$role.ext" -out "$d/$role-cert.pem"
done
tar -cf "$T/ktls.tar" -C "$KT" srv client
KT_LETTERS=abcdefghijklmnop
SCN_KTLS_DISK=/dev/vd${KT_LETTERS:${#DISKS[@]}:1}
export SCN_KTLS_DISK
DISKS+=("$T/ktls.tar")
GUEST_BINS="${GUEST_BINS:-} $(command -v nbdcopy)"
export GUEST_BINS
