#!/usr/bin/env bash
# libs.sh ROOT BINARY DEST: installs BINARY at ROOT/DEST with the shared
# libraries it links (as ldd resolves them on the host).
set -euo pipefail
R=$1 BIN=$2 DEST=$3
install -D -m755 "$BIN" "$R$DEST"
ldd "$BIN" | awk '/=> \//{print $3} /^\t\/lib64/{print $1}' | while read -r lib; do
    [ -e "$R$lib" ] || install -D -m755 "$(readlink -f "$lib")" "$R$lib"
done
