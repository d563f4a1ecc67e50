//! udm against the Linux kernel, in the test guest (`scripts/guest/`,
//! QEMU/TCG): what the kernel writes, udm reads the same way, and what udm
//! writes is what the kernel would.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;

use common::guest::Guest;
use common::{udm, TempDir};

fn image(path: &Path, len: u64) {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(len).unwrap();
}

/// Linux's dm-log-writes logs two marked phases of writes; udm's
/// log-replay replays the log to each mark and gets the bytes the device
/// held at that mark.
#[test]
fn a_log_written_by_linux_dm_log_writes_replays_with_udm_to_each_mark() {
    let dir = TempDir::new("guest-lw");
    let (log, one, fin) = (
        dir.path("log.img"),
        dir.path("one.img"),
        dir.path("final.img"),
    );
    for p in [&log, &one, &fin] {
        image(p, 64 << 20);
    }
    Guest::new(
        &dir,
        r#"
insmod /lib/modules/brd.ko rd_size=65536 rd_nr=2
dmsetup create lw --table "0 131072 log-writes /dev/ram0 /dev/ram1"
dd if=/dev/urandom of=/tmp/one bs=4k count=256 2>/dev/null
dd if=/tmp/one of=/dev/mapper/lw bs=4k conv=fsync 2>/dev/null
dmsetup message lw 0 mark one
dd if=/dev/urandom of=/dev/mapper/lw bs=4k count=128 seek=200 conv=fsync 2>/dev/null
dmsetup message lw 0 mark two
dmsetup status lw
dmsetup remove lw
dd if=/dev/ram1 of=/dev/vda bs=1M conv=fsync 2>/dev/null
dd if=/tmp/one of=/dev/vdb bs=1M conv=fsync 2>/dev/null
dd if=/dev/ram0 of=/dev/vdc bs=1M conv=fsync 2>/dev/null
"#,
    )
    .disks(&[&log, &one, &fin])
    .run(String::new);
    let mb = 1 << 20;
    for (mark, want, len) in [("one", &one, mb), ("two", &fin, 328 * 4096)] {
        let out = dir.path(&format!("replayed-{mark}.img"));
        image(&out, 64 << 20);
        let (code, _, err) = udm(&[
            "log-replay",
            "--log",
            log.to_str().unwrap(),
            "--replay",
            out.to_str().unwrap(),
            "--end-mark",
            mark,
        ]);
        assert_eq!(code, 0, "replay to '{mark}': {err}");
        let got = std::fs::read(&out).unwrap();
        let want = std::fs::read(want).unwrap();
        assert!(
            got[..len] == want[..len],
            "replayed to '{mark}', the first {len} bytes differ from the device's"
        );
        if mark == "one" {
            // The second phase's writes are not in yet.
            assert!(got[mb..mb + 4096].iter().all(|&b| b == 0));
        }
    }
}

/// The same O_DIRECT writes, flushes, a discard and marks, through Linux's
/// dm-log-writes and through udm's log-writes exported over ublk, in one
/// guest (`scripts/guest.sh logwrites`): the two logs are the same bytes,
/// so what reads Linux's logs (xfstests' replay-log) reads udm's.
#[test]
fn udm_logs_the_same_bytes_as_linux_dm_log_writes_for_the_same_io() {
    common::guest::run_scenarios(
        &["logwrites"],
        &["lw_linux_writes", "lw_udm_writes", "lw_logs_identical"],
    );
}

/// The same plaintext through Linux's dm-crypt and through udm's crypt
/// (exported over ublk) gives the same ciphertext, for each cipher, IV mode
/// and sector size, and each side reads what the other wrote; a LUKS2
/// volume made by the host's cryptsetup opens in udm with its key file and
/// reads what Linux wrote through its volume key, and the reverse
/// (`scripts/guest.sh crypt`).
#[test]
fn udm_crypt_writes_the_bytes_linux_dm_crypt_writes_and_opens_luks2() {
    let mut checks = vec![];
    for case in [
        "xts_plain64_512",
        "xts_plain64_4096",
        "xts_plain64_4096_large",
        "xts_plain64_ivoffset",
        "xts_plain",
        "cbc_essiv",
        "capi",
    ] {
        for what in ["same_ciphertext", "udm_reads_linux", "linux_reads_udm"] {
            checks.push(format!("crypt_{case}_{what}"));
        }
    }
    for what in [
        "luks_udm_opens",
        "luks_udm_reads_linux",
        "luks_linux_reads_udm",
        "luks_wrong_key",
    ] {
        checks.push(what.to_string());
    }
    common::guest::run_scenarios(&["crypt"], &checks);
}

/// Pools move between Linux's dm-thin and udm's thin-pool both ways: a
/// pool Linux made (a volume, a snapshot, writes apart) reads the same
/// through udm, and one udm made reads the same through Linux; fio
/// --verify through a chain of snapshots on each side; ext4 made and
/// checked on a udm thin volume over ublk (`scripts/guest.sh thin`).
#[test]
fn thin_pools_move_between_linux_dm_thin_and_udm_both_ways() {
    common::guest::run_scenarios(
        &["thin"],
        &[
            "thin_udm_opens_linux_pool",
            "thin_udm_reads_linux_origin",
            "thin_udm_reads_linux_snap",
            "thin_linux_opens_udm_pool",
            "thin_linux_reads_udm_origin",
            "thin_linux_reads_udm_snap",
            "thin_linux_chain_7",
            "thin_udm_chain_5",
            "thin_udm_chain_6",
            "thin_udm_chain_7",
            "thin_udm_mkfs",
            "thin_udm_fsck",
        ],
    );
}

/// NBD over TLS with the records in the guest kernel (kTLS; this host's
/// kernel has none): nbdcopy writes and reads a whole disk through udm
/// serve --tls require with client certificates, the same bytes come back,
/// and every connection handed its records to the kernel after the
/// handshake; with UDM_TLS_RECORDS=user the same run stays in rustls
/// (`scripts/guest.sh ktls`).
#[test]
fn nbd_tls_records_move_to_kernel_tls_where_the_kernel_has_it() {
    let mut checks = vec![];
    for side in ["kernel", "user"] {
        for what in ["write", "read", "same", "records"] {
            checks.push(format!("ktls_{side}_{what}"));
        }
    }
    checks.push("ktls_kernel_clean".into());
    checks.push("ktls_user_not_kernel".into());
    common::guest::run_scenarios(&["ktls"], &checks);
}
