# Sourced by scripts that make a file or folder once and keep it (a
# benchmark's image, a built tool): `once DEST COMMAND...` makes DEST
# unless it exists. COMMAND runs with $OUT naming a fresh path beside DEST
# (same filesystem), under an exclusive lock on DEST.lock, and what it made
# at $OUT is renamed to DEST only when it succeeded. So DEST exists only
# whole: a run killed halfway leaves an OUT that the next run removes and
# makes again, and runs started together wait for the one that makes it.
# (scripts/guest/build.sh does the same for the guest image, with a version
# to rebuild an older one.)
#
#   . scripts/once.sh
#   once /var/tmp/x.img sh -c 'dd if=/dev/zero of="$OUT" bs=1M count=64'
once() {
    local dest=$1
    shift
    [ -e "$dest" ] && return 0
    mkdir -p "$(dirname "$dest")"
    (
        exec 8>>"$dest.lock"
        flock 8
        # Made by another run while this one waited for the lock.
        [ -e "$dest" ] && exit 0
        # Under the lock nobody else makes it: what earlier runs left is
        # stale.
        rm -rf "$dest".part.*
        OUT=$(mktemp -u "$dest.part.XXXXXX")
        export OUT
        trap 'rm -rf "$OUT"' EXIT
        "$@" || exit $?
        [ -e "$OUT" ] || { echo "once: $* made no $OUT" >&2; exit 1; }
        mv -T "$OUT" "$dest"
    )
}
