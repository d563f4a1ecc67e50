#!/usr/bin/env bash
# raid1's resync rate at the default max_recovery_rate: a new 1 GiB array
# between RAM legs, timed until idle (mapper/tests/raid.rs,
# resync_rate_between_ram_legs), ROUNDS times.
#   usage: scripts/bench/raid-resync.sh [ROUNDS]
set -euo pipefail
for ((i = 0; i < ${1:-5}; i++)); do
    cargo test -q --release -p udm-mapper --test raid resync_rate -- --ignored --nocapture 2>&1 |
        grep -o 'resync of 1 GiB.*'
done
