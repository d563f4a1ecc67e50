#!/usr/bin/env bash
# Boots the test guest (QEMU, TCG: no KVM here) with the udm binary and a
# test script, and exits with the script's exit status.
#
#   scripts/guest/run.sh SCRIPT [DISK...]
#
# SCRIPT runs in the guest as /test.sh under `sh -e` (busybox, fio,
# dmsetup, udm on PATH; modules in /lib/modules). Each DISK (a raw image on
# the host) is attached as a virtio disk, /dev/vda, /dev/vdb, ... in order:
# the way data goes in and comes back. Env: UDM (the binary; default
# target/release/udm), GUEST_MEM (default 1G), GUEST_TIMEOUT (seconds,
# default 300), GUEST_LOG (console log path), GUEST_QEMU_ARGS (more QEMU
# arguments, split on spaces: e.g. a vhost-user-blk device; guest memory
# is a shared memfd so a vhost-user backend can map it), GUEST_REBOOT (set:
# a reboot in the guest resets the machine and boots it again, /test.sh
# included, instead of ending QEMU), GUEST_BINS (more host binaries, split
# on spaces, each put on the guest's PATH under its own name with its
# libraries: e.g. strace, or a reference server). Needs qemu-system-x86_64
# (scripts/setup.sh installs it) and builds the base image on first use.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
W=${GUEST_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/udm/guest}
SCRIPT=${1:?usage: run.sh SCRIPT [DISK...]}
shift
UDM=${UDM:-$ROOT/target/release/udm}
command -v qemu-system-x86_64 >/dev/null || { echo "guest/run: qemu-system-x86_64 missing (scripts/setup.sh)" >&2; exit 2; }
[ -x "$UDM" ] || { echo "guest/run: no udm binary at $UDM (cargo build --release)" >&2; exit 2; }
"$HERE/build.sh"
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
# The test's files go in a second cpio, appended: the kernel unpacks both.
mkdir -p "$T/r/bin"
"$HERE/libs.sh" "$T/r" "$UDM" /bin/udm
for b in ${GUEST_BINS:-}; do
    [ -x "$b" ] || { echo "guest/run: GUEST_BINS: no executable $b" >&2; exit 2; }
    "$HERE/libs.sh" "$T/r" "$b" "/bin/$(basename "$b")"
done
install -m755 "$SCRIPT" "$T/r/test.sh"
# The base image is copied under a shared lock on the cache, so a rebuild
# (which holds it exclusively) never swaps it halfway through a copy.
exec 9>>"$W/.lock"
flock -s 9
cp "$W/busybox" "$W/vmlinuz" "$T/"
cat "$W/base.cpio.gz" >"$T/initrd.gz"
flock -u 9
exec 9>&-
(cd "$T/r" && find . | "$T/busybox" cpio -o -H newc 2>/dev/null | gzip -1 >"$T/test.cpio.gz")
cat "$T/test.cpio.gz" >>"$T/initrd.gz"
DRIVES=()
i=0
for d in "$@"; do
    DRIVES+=(-drive "file=$d,if=virtio,format=raw,cache=unsafe,index=$i")
    i=$((i + 1))
done
LOG=${GUEST_LOG:-$T/console.log}
NO_REBOOT=-no-reboot
[ -z "${GUEST_REBOOT:-}" ] || NO_REBOOT=
timeout "${GUEST_TIMEOUT:-300}" qemu-system-x86_64 -accel tcg,thread=multi -cpu max -smp 2 \
    -m "${GUEST_MEM:-1G}" -object "memory-backend-memfd,id=mem,size=${GUEST_MEM:-1G},share=on" \
    -machine q35,memory-backend=mem -nographic $NO_REBOOT -nic none \
    -kernel "$T/vmlinuz" -initrd "$T/initrd.gz" \
    -append "console=ttyS0 quiet panic=-1" "${DRIVES[@]}" ${GUEST_QEMU_ARGS:-} </dev/null >"$LOG" 2>&1 || true
tr -d '\r' <"$LOG" | grep -v '^\s*$' | sed 's/^/guest: /'
rc=$(tr -d '\r' <"$LOG" | sed -n 's/^GUEST_RC=\([0-9]*\)$/\1/p' | tail -1)
[ -n "$rc" ] || { echo "guest/run: the guest did not finish (timeout or crash)" >&2; exit 3; }
exit "$rc"
