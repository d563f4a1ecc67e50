# Host side of scenario crypt (sourced by scripts/guest.sh on the host): a
# LUKS2 volume made by the host's cryptsetup (argon2id, 4 KiB sectors,
# cryptsetup's defaults otherwise) and its key file, attached as /dev/vda
# and /dev/vdb; the volume key and data offset go to the guest so that
# Linux's dm-crypt can open the volume without cryptsetup.
truncate -s 48M "$T/luks.img"
head -c 4096 /dev/urandom >"$T/luks.key"
cryptsetup luksFormat -q --type luks2 --pbkdf argon2id --pbkdf-memory 32768 \
    --pbkdf-force-iterations 4 --key-file "$T/luks.key" "$T/luks.img"
SCN_LUKS_VK=$(cryptsetup luksDump --dump-volume-key -q --key-file "$T/luks.key" "$T/luks.img" |
    sed -n '/^MK dump:/,/^[^ \t]/p' | sed 's/^MK dump://' | tr -d ' \t\n' | grep -o '^[0-9a-f]*')
SCN_LUKS_OFFSET=$(($(cryptsetup luksDump "$T/luks.img" | sed -n 's/^\toffset: \([0-9]*\) \[bytes\]$/\1/p' | head -1) / 512))
SCN_LUKS_SECTOR=$(cryptsetup luksDump "$T/luks.img" | sed -n 's/^\tsector: \([0-9]*\) \[bytes\]$/\1/p' | head -1)
export SCN_LUKS_VK SCN_LUKS_OFFSET SCN_LUKS_SECTOR
DISKS+=("$T/luks.img" "$T/luks.key")
