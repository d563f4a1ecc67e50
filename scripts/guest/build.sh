#!/usr/bin/env bash
# Builds the guest's base image once: a Debian 6.12 kernel (it has dm,
# dm-log-writes, dm-thin, dm-crypt, ublk_drv, null_blk, kernel TLS and NVMe poll
# queues) and an initramfs with busybox, fio, dmsetup, e2fsprogs (mke2fs,
# e2fsck) and the kernel modules the tests load. Nothing is installed on
# the host: packages are downloaded and unpacked under $GUEST_DIR (default
# ~/.cache/udm/guest, kept across clones).
#
# Safe to run several times at once: the build holds an exclusive lock on
# $GUEST_DIR/.lock, works in a fresh directory and moves the finished files
# into place, writing base.version last; the image counts as built only
# when base.version matches, so a build killed halfway leaves nothing that
# passes for an image and the next run builds it again.
#
#   scripts/guest/build.sh            # no-op when the image exists
#   REBUILD=1 scripts/guest/build.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
W=${GUEST_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/udm/guest}
mkdir -p "$W"
# Bumped when the image's contents change: an older cached image is rebuilt.
BASE_VERSION=8
built() {
    [ -f "$W/base.cpio.gz" ] && [ -f "$W/vmlinuz" ] && [ -x "$W/busybox" ] &&
        [ "$(cat "$W/base.version" 2>/dev/null)" = "$BASE_VERSION" ]
}
if built && [ -z "${REBUILD:-}" ]; then
    exit 0
fi
exec 9>>"$W/.lock"
flock 9
# Built by another run while this one waited for the lock.
if built && [ -z "${REBUILD:-}" ]; then
    exit 0
fi
# Under the lock nobody else builds: what earlier runs left is stale.
rm -rf "$W"/build.* "$W"/kernel "$W"/rootfs "$W"/bb "$W"/dm "$W"/kmod
B=$(mktemp -d "$W/build.XXXXXX")
trap 'rm -rf "$B"' EXIT
cd "$B"
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
# Downloaded packages are kept in $W/debs, each moved in whole.
mkdir -p "$W/debs" dl
for p in "$KPKG" busybox-static dmsetup libdevmapper1.02.1 kmod; do
    ls "$W/debs/${p}"_*.deb >/dev/null 2>&1 && continue
    (cd dl && apt-get download -q "$p" >/dev/null 2>&1) ||
        { echo "guest/build: apt-get download $p failed" >&2; exit 2; }
    mv dl/"${p}"_*.deb "$W/debs/"
done
D=$W/debs
KD=$B/kernel
mkdir -p "$KD" bb dm kmod
dpkg -x "$D/${KPKG}"_*.deb "$KD"
dpkg -x "$D"/busybox-static_*.deb bb
dpkg -x "$D"/dmsetup_*.deb dm
dpkg -x "$D"/libdevmapper1.02.1_*.deb dm
dpkg -x "$D"/kmod_*.deb kmod
ln -sf kmod kmod/bin/depmod
[ -f "$KD/lib/modules/$KV/modules.dep" ] || kmod/bin/depmod -b "$KD" "$KV"
cp "$KD/boot/vmlinuz-$KV" vmlinuz

R=$B/rootfs
mkdir -p "$R"/{bin,sbin,dev,proc,sys,tmp,mnt,lib64,lib/x86_64-linux-gnu,usr/lib/x86_64-linux-gnu,lib/modules}
cp bb/bin/busybox "$R/bin/busybox"
cp bb/bin/busybox "$B/busybox" # the host's cpio, for run.sh
for a in $("$R/bin/busybox" --list); do [ "$a" = busybox ] || ln -sf busybox "$R/bin/$a"; done
"$HERE/libs.sh" "$R" /usr/bin/fio /bin/fio
"$HERE/libs.sh" "$R" "$B/dm/sbin/dmsetup" /sbin/dmsetup
cp "$B"/dm/lib/x86_64-linux-gnu/libdevmapper.so.1.02.1 "$R/lib/x86_64-linux-gnu/"
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
# crc32c_generic first: libcrc32c (dm-persistent-data's) asks the crypto
# API for crc32c when it loads.
for m in crc32c_generic virtio virtio_ring virtio_pci virtio_blk brd dm-mod dm-log-writes dm-flakey \
    dm-delay dm-dust dm-writecache dm-thin-pool dm-crypt xts essiv cbc aesni-intel ublk_drv nbd \
    null_blk nvme ext4 tls; do
    rel=$(grep -E "/$m\.ko(\.xz|\.zst)?:" "$MD/modules.dep" | cut -d: -f1 | head -1 || true)
    if [ -n "$rel" ]; then
        add_mod "$rel"
    elif ! grep -q "/$m\.ko" "$MD/modules.builtin"; then
        echo "guest/build: module $m not in $KV" >&2
    fi
done
cp "$HERE/init.sh" "$R/init"
chmod 755 "$R/init"
(cd "$R" && find . | "$B/bb/bin/busybox" cpio -o -H newc 2>/dev/null | gzip -1 >"$B/base.cpio.gz")
# Into place, the version last: readers (run.sh) copy under a shared lock.
rm -f "$W/base.version"
mv -f "$B/vmlinuz" "$B/busybox" "$B/base.cpio.gz" "$W/"
echo "$BASE_VERSION" >"$B/base.version"
mv -f "$B/base.version" "$W/base.version"
echo "guest/build: $(du -h "$W/base.cpio.gz" | cut -f1) initramfs, kernel $KV"
