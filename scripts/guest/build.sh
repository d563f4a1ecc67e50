#!/usr/bin/env bash
# Builds the guest's base image once: a Debian 6.12 kernel (it has dm,
# dm-log-writes, ublk_drv, null_blk and NVMe poll queues) and an initramfs
# with busybox, fio, dmsetup, e2fsprogs (mke2fs, e2fsck) and the kernel
# modules the tests load. Nothing
# is installed on the host: packages are downloaded and unpacked under
# $GUEST_DIR (default ~/.cache/udm/guest, kept across clones).
#
#   scripts/guest/build.sh            # no-op when the image exists
#   REBUILD=1 scripts/guest/build.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
W=${GUEST_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/udm/guest}
mkdir -p "$W"
cd "$W"
# Bumped when the image's contents change: an older cached image is rebuilt.
BASE_VERSION=4
if [ -f base.cpio.gz ] && [ -f vmlinuz ] && [ -x busybox ] && [ -z "${REBUILD:-}" ] &&
    [ "$(cat base.version 2>/dev/null)" = "$BASE_VERSION" ]; then
    exit 0
fi
# bookworm-security's 6.12 (Debian 12's 6.1 has no ublk).
kpkg() { apt-cache search --names-only '^linux-image-6\.12\.[0-9]+\+deb12-amd64$' | awk '{print $1}' | sort -V | tail -1; }
KPKG=$(kpkg)
if [ -z "$KPKG" ]; then
    apt-get update -qq >/dev/null 2>&1 || true
    KPKG=$(kpkg)
fi
[ -n "$KPKG" ] || { echo "guest/build: no linux-image-6.12 package in apt's lists (apt-get update?)" >&2; exit 2; }
KV=${KPKG#linux-image-}
echo "guest/build: kernel $KV"
mkdir -p debs
(cd debs && for p in "$KPKG" busybox-static dmsetup libdevmapper1.02.1 kmod; do
    ls ./"${p}"_*.deb >/dev/null 2>&1 || apt-get download -q "$p" >/dev/null 2>&1 ||
        { echo "guest/build: apt-get download $p failed" >&2; exit 2; }
done)
KD=$W/kernel
rm -rf "$KD" bb dm kmod
mkdir -p "$KD" bb dm kmod
dpkg -x debs/"${KPKG}"_*.deb "$KD"
dpkg -x debs/busybox-static_*.deb bb
dpkg -x debs/dmsetup_*.deb dm
dpkg -x debs/libdevmapper1.02.1_*.deb dm
dpkg -x debs/kmod_*.deb kmod
ln -sf kmod kmod/bin/depmod
[ -f "$KD/lib/modules/$KV/modules.dep" ] || kmod/bin/depmod -b "$KD" "$KV"
cp "$KD/boot/vmlinuz-$KV" vmlinuz

R=$W/rootfs
rm -rf "$R"
mkdir -p "$R"/{bin,sbin,dev,proc,sys,tmp,mnt,lib64,lib/x86_64-linux-gnu,usr/lib/x86_64-linux-gnu,lib/modules}
cp bb/bin/busybox "$R/bin/busybox"
cp bb/bin/busybox "$W/busybox" # the host's cpio, for run.sh
for a in $("$R/bin/busybox" --list); do [ "$a" = busybox ] || ln -sf busybox "$R/bin/$a"; done
"$HERE/libs.sh" "$R" /usr/bin/fio /bin/fio
"$HERE/libs.sh" "$R" "$W/dm/sbin/dmsetup" /sbin/dmsetup
cp "$W"/dm/lib/x86_64-linux-gnu/libdevmapper.so.1.02.1 "$R/lib/x86_64-linux-gnu/"
for b in mke2fs e2fsck; do
    "$HERE/libs.sh" "$R" "/sbin/$b" "/sbin/$b"
done
mkdir -p "$R/etc"
[ -f /etc/mke2fs.conf ] && cp /etc/mke2fs.conf "$R/etc/"

# Modules and what they need, decompressed, with a load order.
MD=$KD/lib/modules/$KV
: >"$R/lib/modules/order"
declare -A seen
add_mod() {
    local rel=$1 dep base
    [ -n "${seen[$rel]:-}" ] && return
    seen[$rel]=1
    for dep in $(grep "^$rel:" "$MD/modules.dep" | cut -d: -f2-); do add_mod "$dep"; done
    base=$(basename "$rel")
    base=${base%.xz}
    base=${base%.zst}
    case "$rel" in
    *.xz) xz -dc "$MD/$rel" >"$R/lib/modules/$base" ;;
    *.zst) zstd -qdc "$MD/$rel" >"$R/lib/modules/$base" ;;
    *) cp "$MD/$rel" "$R/lib/modules/$base" ;;
    esac
    echo "$base" >>"$R/lib/modules/order"
}
for m in virtio virtio_ring virtio_pci virtio_blk brd dm-mod dm-log-writes dm-flakey dm-delay \
    dm-dust dm-writecache ublk_drv nbd null_blk nvme crc32c_generic ext4; do
    rel=$(grep -E "/$m\.ko(\.xz|\.zst)?:" "$MD/modules.dep" | cut -d: -f1 | head -1 || true)
    if [ -n "$rel" ]; then
        add_mod "$rel"
    elif ! grep -q "/$m\.ko" "$MD/modules.builtin"; then
        echo "guest/build: module $m not in $KV" >&2
    fi
done
cp "$HERE/init.sh" "$R/init"
chmod 755 "$R/init"
(cd "$R" && find . | "$W/bb/bin/busybox" cpio -o -H newc 2>/dev/null | gzip -1 >"$W/base.cpio.gz")
rm -rf "$R" bb dm kmod
echo "$BASE_VERSION" >base.version
echo "guest/build: $(du -h base.cpio.gz | cut -f1) initramfs, kernel $KV"
