#!/usr/bin/env bash
# Fuzzes every target in fuzz/fuzz_targets/ (the NBD handshake and request
# parsers, the table parser, the writecache's metadata load, ...) with
# cargo-fuzz (libFuzzer on the stable toolchain through RUSTC_BOOTSTRAP),
# SECONDS each. The committed corpus fuzz/corpus/<target>/ seeds each run;
# what the run finds goes to target/fuzz-corpus/<target>/, and only inputs
# that add coverage are merged back into the committed corpus, which
# `cargo test` replays (exports/tests/fuzz_corpus.rs,
# mapper/tests/fuzz_corpus.rs). A crash leaves its input in
# fuzz/artifacts/<target>/; the script goes on with the other targets and
# fails at the end.
# scripts/test.sh runs every target briefly with FUZZ_MERGE=0 (nothing is
# written back to the committed corpus).
#
# usage: [FUZZ_MERGE=0] scripts/fuzz.sh [SECONDS_PER_TARGET=60] [TARGET...]
set -euo pipefail
SECS=${1:-60}
shift || true
cd "$(dirname "$0")/../fuzz"
if [ $# -gt 0 ]; then
    TARGETS="$*"
else
    TARGETS=$(for f in fuzz_targets/*.rs; do basename "$f" .rs; done)
fi
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
export RUSTC_BOOTSTRAP=1
failed=""
for t in $TARGETS; do
    mkdir -p "corpus/$t" "../target/fuzz-corpus/$t"
    echo "== $t: ${SECS}s"
    if ! cargo fuzz run "$t" "../target/fuzz-corpus/$t" "corpus/$t" -- \
        -max_total_time="$SECS" -max_len=70000; then
        failed="$failed $t"
        continue
    fi
    [ "${FUZZ_MERGE:-1}" = 0 ] && continue
    # Keep the corpus small in git: only inputs that add coverage.
    cargo fuzz run "$t" "corpus/$t" "../target/fuzz-corpus/$t" -- -merge=1 -max_len=70000
done
if [ -n "$failed" ]; then
    echo "fuzz: crashes in:$failed (inputs under fuzz/artifacts/)" >&2
    exit 1
fi
