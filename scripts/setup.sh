#!/usr/bin/env bash
# Installs what building and testing udm needs on a fresh Debian machine.
# Idempotent: installs only what is missing. Run as root (or with sudo).
set -euo pipefail

# libclang-dev: bindgen, for scripts/bench/ublk-null-ref (libublk); strace: the
# guest's system-call counts (docs/benchmarks.md, dm-compare); thin-provisioning-tools:
# thin_check, thin_dump and thin_restore for the thin metadata's format tests.
APT_PACKAGES=(build-essential pkg-config valgrind bc fio e2fsprogs nbdkit libnbd-bin python3-libnbd zstd xz-utils
    librbd-dev librados-dev ceph-mon ceph-osd ceph-common libclang-dev strace thin-provisioning-tools)
# QEMU from Debian 12's backports (10.x: qemu-img, qemu-io, qemu-nbd,
# qemu-storage-daemon, and qemu-system-x86_64 for the test guest): the two
# packages must come from the same release, or apt removes one for the other.
QEMU_PACKAGES=(qemu-utils qemu-system-x86)

SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
missing=()
for p in "${APT_PACKAGES[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
qemu_missing=()
for p in "${QEMU_PACKAGES[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || qemu_missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ] || [ ${#qemu_missing[@]} -gt 0 ]; then
    QEMU_FROM=()
    if [ ${#qemu_missing[@]} -gt 0 ] && grep -q '^VERSION_CODENAME=bookworm' /etc/os-release 2>/dev/null; then
        if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
            echo "deb http://deb.debian.org/debian bookworm-backports main" |
                $SUDO tee /etc/apt/sources.list.d/udm-backports.list >/dev/null
        fi
        QEMU_FROM=(-t bookworm-backports)
    fi
    echo "setup: installing ${missing[*]} ${qemu_missing[*]}"
    $SUDO apt-get update -qq
    if [ ${#missing[@]} -gt 0 ]; then
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
    fi
    if [ ${#qemu_missing[@]} -gt 0 ]; then
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
            "${QEMU_FROM[@]}" "${QEMU_PACKAGES[@]}"
    fi
fi

if ! command -v cargo >/dev/null 2>&1; then
    echo "setup: cargo not found; install Rust (rustup) first" >&2
    exit 1
fi
rustup component add rustfmt clippy >/dev/null 2>&1 || true
