#!/usr/bin/env bash
# Runs guest scenarios: boots the test guest once (scripts/guest/run.sh:
# the Debian 6.12 kernel under QEMU/TCG with udm inside) and runs each
# SCENARIO (scripts/guest/scenarios/NAME.sh) in it, in order.
#
#   scripts/guest.sh [--long] SCENARIO...      e.g. scripts/guest.sh ublk
#
# Every check prints `RESULT name=ok` or `RESULT name=FAIL` (figures:
# `RESULT name=value`); the exit status is 0 only when every check of
# every scenario passed and the guest finished. --long runs the longer
# forms (larger fio sizes, longer benchmarks). Env: UDM (the binary;
# default: builds target/release/udm), SCN_* (passed into the guest, for
# a scenario's knobs: e.g. SCN_UDM_ARGS=--interrupt for dm-compare), and
# run.sh's (GUEST_MEM, GUEST_TIMEOUT, GUEST_LOG). A scenario with the line
# `# guest.sh: nvme` gets a 1 GiB QEMU NVMe disk, /dev/nvme0n1 (its
# driver loaded without poll queues: the scenario reloads it as it needs).
# A scenario NAME.sh with a NAME.host.sh beside it has that sourced on the
# host first, with $T a scratch folder: it may make disk images and append
# them to DISKS (attached in order as /dev/vda, /dev/vdb, ...) and export
# SCN_* variables (e.g. keys) for the guest.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
LONG=0
SCEN=()
for a in "$@"; do
    case $a in
    --long) LONG=1 ;;
    -h | --help) sed -n '2,15p' "$0"; exit 0 ;;
    -*) echo "guest.sh: unknown option $a" >&2; exit 2 ;;
    *)
        [ -f "$HERE/guest/scenarios/$a.sh" ] || {
            echo "guest.sh: unknown scenario '$a' (known: $(cd "$HERE/guest/scenarios" && ls | grep -v '\.host\.sh$' | sed 's/\.sh$//' | tr '\n' ' '))" >&2
            exit 2
        }
        SCEN+=("$a")
        ;;
    esac
done
[ ${#SCEN[@]} -gt 0 ] || { echo "usage: scripts/guest.sh [--long] SCENARIO..." >&2; exit 2; }
if [ -z "${UDM:-}" ]; then
    (cd "$ROOT" && cargo build --release -q -p udm)
    export UDM=$ROOT/target/release/udm
fi
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
DISKS=()
for s in "${SCEN[@]}"; do
    if [ -f "$HERE/guest/scenarios/$s.host.sh" ]; then
        # shellcheck source=/dev/null
        . "$HERE/guest/scenarios/$s.host.sh"
    fi
done
for s in "${SCEN[@]}"; do
    if grep -q '^# guest.sh: nvme$' "$HERE/guest/scenarios/$s.sh"; then
        truncate -s 1G "$T/nvme.img"
        export GUEST_QEMU_ARGS="${GUEST_QEMU_ARGS:-} -drive file=$T/nvme.img,if=none,id=nvme0,format=raw,cache=unsafe -device nvme,drive=nvme0,serial=udm-nvme0"
        break
    fi
done
{
    echo 'set +e'
    echo "LONG=$LONG"
    while IFS='=' read -r k _; do
        printf 'export %s=%q\n' "$k" "${!k}"
    done < <(env | grep '^SCN_[A-Za-z0-9_]*=' || true)
    # check NAME CMD...: runs CMD, prints RESULT NAME=ok|FAIL.
    cat <<'SH'
FAILED=0
check() {
    local check_name=$1
    shift
    if "$@"; then
        echo "RESULT $check_name=ok"
    else
        echo "RESULT $check_name=FAIL"
        FAILED=$((FAILED + 1))
    fi
}
[ "$LONG" = 1 ] && export FIO_SIZE=512M
# start_daemon LOG [FLAG...]: `udm daemon FLAG...` on $UDM_CONTROL, its
# output in LOG; returns once it is ready (its log is shown and the call
# fails if it is not within 10 s). Its pid in DAEMON_PID.
start_daemon() {
    local log=$1 i=0
    shift
    : >"$log"
    udm daemon "$@" >"$log" 2>&1 &
    DAEMON_PID=$!
    until grep -q "daemon ready" "$log"; do
        i=$((i + 1))
        [ $i -lt 100 ] || { cat "$log"; return 1; }
        sleep 0.1
    done
}
SH
    for s in "${SCEN[@]}"; do
        echo "echo '== scenario $s'"
        cat "$HERE/guest/scenarios/$s.sh"
    done
    echo 'echo "RESULT failed_checks=$FAILED"'
    echo '[ "$FAILED" = 0 ]'
} >"$T/test.sh"
set +e
"$HERE/guest/run.sh" "$T/test.sh" ${DISKS[@]+"${DISKS[@]}"} | tee "$T/out"
rc=${PIPESTATUS[0]}
set -e
grep -q '^guest: RESULT ' "$T/out" || { echo "guest.sh: no results (rc $rc)" >&2; exit 3; }
if grep -q '^guest: RESULT .*=FAIL$' "$T/out"; then
    echo "guest.sh: failed: $(sed -n 's/^guest: RESULT \(.*\)=FAIL$/\1/p' "$T/out" | tr '\n' ' ')" >&2
    exit 1
fi
exit "$rc"
