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
# FUZZ_TARGET_DIR: where cargo-fuzz builds (default fuzz/target).
#
# usage: [FUZZ_MERGE=0] scripts/fuzz.sh [SECONDS_PER_TARGET=60] [TARGET...]
set -euo pipefail
SECS=${1:-60}
shift || true
TD=(--target-dir "$(realpath -m "${FUZZ_TARGET_DIR:-$(dirname "$0")/../fuzz/target}")")
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
    if ! cargo fuzz run "${TD[@]}" "$t" "../target/fuzz-corpus/$t" "corpus/$t" -- \
        -max_total_time="$SECS" -max_len=70000; then
        failed="$failed $t"
        continue
    fi
    [ "${FUZZ_MERGE:-1}" = 0 ] && continue
    # Keep the corpus small in git: only inputs that add coverage. libFuzzer
    # writes them into its first folder as it goes (a kill leaves half an
    # input), so the merge goes into a copy beside the corpus (same
    # filesystem), under a lock against another run's merge, and each new
    # input is renamed in whole; a killed merge's copy is removed.
    (
        exec 8>>"corpus/.tmp.$t.lock"
        flock 8
        rm -rf "corpus/.tmp.$t.merge".*
        m=$(mktemp -d "corpus/.tmp.$t.merge.XXXXXX")
        trap 'rm -rf "$m"' EXIT
        cp -a "corpus/$t/." "$m/"
        cargo fuzz run "${TD[@]}" "$t" "$m" "../target/fuzz-corpus/$t" -- -merge=1 -max_len=70000
        for f in "$m"/*; do
            [ -e "$f" ] && [ ! -e "corpus/$t/${f##*/}" ] && mv "$f" "corpus/$t/"
        done
        true
    )
done
if [ -n "$failed" ]; then
    echo "fuzz: crashes in:$failed (inputs under fuzz/artifacts/)" >&2
    exit 1
fi
