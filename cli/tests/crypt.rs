//! The crypt target from the command line: a key given in a table line
//! appears in no output or log of `udm table`, `udm status` or an error
//! unless `--show-keys` asks for it.

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

mod common;

use std::process::Command;

use common::daemon::Daemon;
use common::udm;

const KEY: &str = "8c1b7f0e9a2d4c6b5e3f1a0d9c8b7a6f5e4d3c2b1a0f9e8d7c6b5a4f3e2d1c0b\
                   11223344556677889900aabbccddeeff00112233445566778899aabbccddeeff";

/// `udm ARGS` with every log level on; (exit code, stdout, stderr).
fn udm_logged(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_udm"))
        .args(args)
        .env("RUST_LOG", "trace")
        .output()
        .expect("run udm");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// No 16 hex digits in a row of the key anywhere in `text`.
fn assert_no_key(text: &str, what: &str) {
    for w in (0..KEY.len() - 16).step_by(8) {
        assert!(
            !text.contains(&KEY[w..w + 16]),
            "{what} shows the key:\n{text}"
        );
    }
}

#[test]
fn the_key_is_in_no_output_or_log_unless_shown() {
    let table = format!("c=0 16384 crypt aes-xts-plain64 {KEY} 0 r 0 1 sector_size:4096");
    let devs = ["--dev", "r=ram:8M", "--dev", &table];
    let (code, out, err) = udm_logged(&[&["table"], &devs[..]].concat());
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("0 16384 crypt aes-xts-plain64 - 0 r 0 1 sector_size:4096"),
        "{out}"
    );
    assert_no_key(&out, "udm table");
    assert_no_key(&err, "udm table's log");

    let (code, out, err) = udm_logged(&[&["status"], &devs[..]].concat());
    assert_eq!(code, 0, "{err}");
    assert_no_key(&format!("{out}{err}"), "udm status");

    let (code, out, err) = udm_logged(&[&["table", "--show-keys"], &devs[..]].concat());
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&format!("crypt aes-xts-plain64 {KEY} 0 r 0")),
        "{out}"
    );

    // A bad table: one line, exit 2, and still no key.
    let bad = format!("c=0 16384 crypt aes-xts-plain64 {KEY} 0 r 0 1 sector_size:3000");
    let (code, out, err) = udm_logged(&["table", "--dev", "r=ram:8M", "--dev", &bad]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("invalid sector_size '3000'"), "{err}");
    assert_no_key(&format!("{out}{err}"), "the error");
}

fn have_cryptsetup() -> bool {
    let ok = Command::new("cryptsetup")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("skipped: cryptsetup is not installed");
    }
    ok
}

/// A 20 MiB LUKS2 volume `v.img` in `d` made by cryptsetup with
/// `passphrase` (fast PBKDF2); its path.
fn luks_volume(d: &common::TempDir, passphrase: &str) -> String {
    let img = d.path("v.img");
    let pass = d.path("format-pass");
    std::fs::write(&pass, passphrase).unwrap();
    std::fs::File::create(&img)
        .unwrap()
        .set_len(20 << 20)
        .unwrap();
    let ok = Command::new("cryptsetup")
        .args(["luksFormat", "-q", "--type", "luks2", "--pbkdf", "pbkdf2"])
        .args(["--pbkdf-force-iterations", "1000", "--key-file"])
        .arg(&pass)
        .arg(&img)
        .status()
        .unwrap();
    assert!(ok.success());
    std::fs::remove_file(&pass).unwrap();
    img.to_str().unwrap().to_string()
}

/// A LUKS2 volume made by cryptsetup opens from `--dev NAME=luks:…`; a
/// wrong passphrase exits 2 with one line and makes no device.
#[test]
fn luks_volumes_open_from_the_command_line() {
    if !have_cryptsetup() {
        return;
    }
    let d = common::TempDir::new("luks-cli");
    let img = luks_volume(&d, "pass phrase");
    let pass = d.path("pass");
    let bad = d.path("bad");
    std::fs::write(&pass, "pass phrase").unwrap();
    std::fs::write(&bad, "wrong").unwrap();
    let (pass, bad) = (pass.to_str().unwrap(), bad.to_str().unwrap());
    let (code, out, err) =
        udm_logged(&["table", "--dev", &format!("v=luks:{img},key-file={pass}")]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("0 8192 crypt aes-xts-plain64 - 0 ")
            && out.contains(" 32768 1 sector_size:4096"),
        "{out}"
    );
    let (code, out, err) = udm(&["table", "--dev", &format!("v=luks:{img},key-file={bad}")]);
    assert_eq!(code, 2, "{out}{err}");
    assert_eq!(
        err.trim_end(),
        "udm: device 'v': luks: wrong passphrase (no keyslot opens with it)"
    );
}

/// Through the daemon: the key given to `udm create` is in no answer of
/// ls, info, table, status or dump-config, nor in the daemon's log (at
/// its default level); only `udm table --show-keys` and
/// `udm dump-config --show-keys` print it.
#[test]
fn the_daemon_keeps_the_key_out_of_every_answer_and_its_log() {
    let d = Daemon::start(&[]);
    d.ok(&["create", "r", "ram:8M"]);
    let table = format!("0 16384 crypt aes-xts-plain64 {KEY} 0 r 0");
    d.ok(&["create", "c", "--table", &table]);
    let mut all = String::new();
    for args in [
        &["ls", "--tree"][..],
        &["info", "c"],
        &["info", "--json", "c"],
        &["table"],
        &["table", "--json"],
        &["status"],
        &["dump-config"],
    ] {
        all.push_str(&d.ok(args));
    }
    all.push_str(&d.log());
    assert_no_key(&all, "the daemon's answers and log");
    assert!(d.ok(&["table", "--show-keys", "c"]).contains(KEY));

    // Asked for, the keys go into the dump, which recreates the device.
    let cfg = d.ok(&["dump-config", "--show-keys"]);
    assert!(cfg.contains(KEY), "{cfg}");
    let dir = common::TempDir::new("crypt-cfg");
    let path = dir.path("udm.toml");
    std::fs::write(&path, cfg).unwrap();
    let d2 = Daemon::start(&["--config", path.to_str().unwrap()]);
    assert!(d2.ok(&["table", "--show-keys", "c"]).contains(&table));
}

/// `udm create NAME luks:PATH` without a key file reads the passphrase as
/// cryptsetup does (stdin's first line when stdin is not a terminal; all
/// of stdin with `key-file=-`) and sends it in the create request. A wrong
/// one is one line, exit 2, and no device. The passphrase is in no answer,
/// no dump and not in the daemon's log at its most verbose; the dump keeps
/// the spec, and a daemon applying it with no terminal to ask on refuses
/// in one line that says how to open the volume.
#[test]
fn a_passphrase_comes_in_the_create_request_and_stays_secret() {
    if !have_cryptsetup() {
        return;
    }
    const PASS: &str = "udm-secret-7f3a9c51e2";
    let dir = common::TempDir::new("luks-pass");
    let img = luks_volume(&dir, PASS);
    let spec = format!("luks:{img}");
    let d = Daemon::start_env(
        common::TempDir::new("daemon"),
        &[],
        &[("RUST_LOG", "trace")],
    );

    let wrong = d.udm_stdin(&["create", "v", &spec], b"not it\n");
    assert_eq!(wrong.0, 2, "{wrong:?}");
    assert_eq!(
        wrong.2,
        "udm: device 'v': luks: wrong passphrase (no keyslot opens with it)\n"
    );
    d.fails(&["info", "v"]); // no device
                             // key-file=- keeps the newline, as cryptsetup's --key-file -.
    let kept = d.udm_stdin(
        &["create", "v", &format!("{spec},key-file=-")],
        format!("{PASS}\n").as_bytes(),
    );
    assert_eq!(kept.0, 2, "{kept:?}");

    let (code, out, err) = d.udm_stdin(
        &["create", "v", &spec],
        format!("{PASS}\nsecond line\n").as_bytes(),
    );
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = d.udm_stdin(
        &["create", "w", &format!("{spec},ro,key-file=-")],
        PASS.as_bytes(),
    );
    assert_eq!(code, 0, "{out}{err}");
    let table = d.ok(&["table", "v"]);
    assert!(table.contains("crypt aes-xts-plain64 - 0 "), "{table}");

    let mut all = String::new();
    for args in [
        &["ls"][..],
        &["info", "--json", "v"],
        &["table", "--show-keys"],
        &["table", "--json"],
        &["status"],
        &["dump-config", "--json"],
        &["dump-config", "--show-keys"],
    ] {
        all.push_str(&d.ok(args));
    }
    all.push_str(&d.log());
    let b64 = "dWRtLXNlY3JldC03ZjNhOWM1MWUy"; // base64 of PASS
    assert!(!all.contains(PASS) && !all.contains(b64), "{all}");

    // The dump names the volume, without a key file: opening it again
    // needs the passphrase, which a daemon without a terminal cannot ask for.
    let cfg = d.ok(&["dump-config"]);
    assert!(cfg.contains(&format!("spec = \"{spec}\"")), "{cfg}");
    let path = dir.path("udm.toml");
    std::fs::write(&path, &cfg).unwrap();
    let err = common::daemon::refused_config(&path, &dir.path("ctl2"));
    assert!(
        err.contains("device 'v': luks: no key-file, and no terminal to ask for the passphrase on")
            && err.contains(&format!("`udm create v {spec}`")),
        "{err}"
    );
}
