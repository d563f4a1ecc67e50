#!/usr/bin/env bash
# Installs what building and testing udm needs on a fresh Debian machine.
# Idempotent: installs only what is missing. Run as root (or with sudo).
set -euo pipefail

APT_PACKAGES=(build-essential pkg-config valgrind bc fio nbdkit libnbd-bin python3-libnbd qemu-utils
              librbd-dev librados-dev ceph-mon ceph-osd ceph-common)

missing=()
for p in "${APT_PACKAGES[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
    echo "setup: installing ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if ! command -v cargo >/dev/null 2>&1; then
    echo "setup: cargo not found; install Rust (rustup) first" >&2
    exit 1
fi
rustup component add rustfmt clippy >/dev/null 2>&1 || true
