#!/usr/bin/env bash
# The whole test suite: installs what it needs, then checks formatting,
# lints and rustdoc, and runs every test (unit, property, integration, end to end).
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup.sh

echo "== cargo fmt --check"
cargo fmt --all -- --check
# The ci profile (Cargo.toml): release code without link-time optimisation,
# which would re-optimise the whole crate graph for each test binary.
echo "== cargo clippy"
cargo clippy --all-targets --profile ci -- -D warnings
echo "== cargo doc"
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --workspace --profile ci -q
echo "== cargo test"
mkdir -p target # the logs' place, wherever CARGO_TARGET_DIR builds
# --no-fail-fast: one run reports every failing binary, not just the first.
cargo test --profile ci --workspace --no-fail-fast 2>&1 | tee target/test.log
echo "== fuzz (every target, briefly)"
if ! FUZZ_MERGE=0 ./scripts/fuzz.sh "${FUZZ_SECONDS:-10}" >target/fuzz.log 2>&1; then
    tail -40 target/fuzz.log
    exit 1
fi
grep -E '^==|^Done [0-9]+ runs' target/fuzz.log
# One closing line for CI: the totals over every test binary.
awk '/^test result:/ { p += $4; f += $6; i += $8 } END { printf "%d passed, %d failed, %d skipped\n", p, f, i }' target/test.log
