#!/usr/bin/env bash
# Fuzzes the NBD handshake and request parsers with cargo-fuzz (libFuzzer on
# the stable toolchain through RUSTC_BOOTSTRAP), then minimises each corpus
# back into fuzz/corpus/<target>/, which `cargo test -p udm-exports` replays.
# Not part of CI (scripts/test.sh): it installs cargo-fuzz and takes minutes.
#
# usage: scripts/fuzz.sh [SECONDS_PER_TARGET=60] [TARGET...]
set -euo pipefail
SECS=${1:-60}
shift || true
TARGETS=${*:-"nbd_handshake nbd_request"}
cd "$(dirname "$0")/../fuzz"
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
export RUSTC_BOOTSTRAP=1
for t in $TARGETS; do
    mkdir -p "corpus/$t"
    cargo fuzz run "$t" "corpus/$t" -- -max_total_time="$SECS" -max_len=70000
    # Keep the corpus small in git: only inputs that add coverage.
    cargo fuzz cmin "$t" "corpus/$t"
done
