#!/usr/bin/env bash
# Runs one test N times in a row and reports how many runs failed, keeping
# each failed run's output: for telling a test that fails by chance from one
# that passes.
#
#   scripts/stress.sh TEST [N=20] [-- TEST ARGS...]
#
# TEST is a test binary's name as cargo knows it (`writecache`,
# `vhost_restart`, `guest`, ...: a file under */tests/), or PACKAGE:lib for
# a crate's unit tests (`udm-mapper:lib`). The binary is built once
# (release, as the suite runs it) and run N times; arguments after `--` go
# to it (a test name filter, `--exact`, `--test-threads=1`). Failed runs'
# output is kept in target/stress/TEST.N.log. Exits 1 if any run failed.
set -euo pipefail
cd "$(dirname "$0")/.."
TEST=${1:?usage: scripts/stress.sh TEST [N] [-- ARGS...]}
shift
N=20
if [ $# -gt 0 ] && [ "$1" != -- ]; then N=$1; shift; fi
[ $# -gt 0 ] && [ "$1" = -- ] && shift
case $TEST in
*:lib) sel=(-p "${TEST%:lib}" --lib) ;;
*) sel=(--test "$TEST") ;;
esac
# The binary and its package's folder (where cargo test runs it), from
# cargo's own report of what it built.
read -r BIN PKG < <(cargo test --release "${sel[@]}" --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json, os, sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"], os.path.dirname(m["manifest_path"]))' | tail -1) || true
[ -n "${BIN:-}" ] || { echo "stress: no test binary for '$TEST' (cargo test --release ${sel[*]} --no-run)" >&2; exit 2; }
mkdir -p target/stress
fails=0
start=$(date +%s)
for i in $(seq 1 "$N"); do
    log=target/stress/${TEST//[:\/]/_}.$i.log
    if (cd "$PKG" && CARGO_MANIFEST_DIR=$PKG "$BIN" "$@") >"$log" 2>&1; then
        rm -f "$log"
    else
        fails=$((fails + 1))
        echo "stress: run $i of $N failed: $log ($(grep -m1 -E 'panicked|FAILED|failures:' "$log" || echo 'see log'))"
    fi
done
echo "stress: $TEST: $((N - fails)) passed, $fails failed in $N runs, $(($(date +%s) - start)) s"
[ "$fails" = 0 ]
