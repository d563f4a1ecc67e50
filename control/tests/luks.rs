//! `luks:` specs against real volumes made by cryptsetup on files: LUKS1
//! and LUKS2, PBKDF2 and Argon2id keyslots, 512 and 4096-byte sectors.
//! What udm writes decrypts with the volume key cryptsetup dumps, through
//! an independent AES (Python's `cryptography`, i.e. OpenSSL), and what
//! that AES writes reads back through udm. Wrong passphrases, damaged or
//! truncated headers and unknown ciphers are refused in one line.
//!
//! Skipped (with a message) where cryptsetup or python3-cryptography is
//! missing.

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

use std::cell::Cell;
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Arc;

use udm_control::Control;
use udm_core::testing::TempDir;
use udm_core::{AlignedBuf, BioPtr, BlockDevice, Op, Reactor, ReactorConfig, Status};

const PASS: &[u8] = b"correct horse battery staple";

fn have_tools() -> bool {
    let cs = Command::new("cryptsetup")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    let py = Command::new("python3")
        .args(["-c", "import cryptography"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !(cs && py) {
        eprintln!("skipped: needs cryptsetup and python3-cryptography");
    }
    cs && py
}

/// `cryptsetup luksFormat` arguments for a LUKS2 volume with a fast
/// PBKDF2 keyslot (1000 iterations).
const LUKS2_PBKDF2: &[&str] = &[
    "--type",
    "luks2",
    "--pbkdf",
    "pbkdf2",
    "--pbkdf-force-iterations",
    "1000",
];

/// The same with a small Argon2id keyslot (32 MiB, 4 passes).
const LUKS2_ARGON2ID: &[&str] = &[
    "--type",
    "luks2",
    "--pbkdf",
    "argon2id",
    "--pbkdf-memory",
    "32768",
    "--pbkdf-force-iterations",
    "4",
];

/// A test's volume: `v.img` made by cryptsetup in a directory of its own,
/// the key file holding [`PASS`], and the volume key cryptsetup dumps.
struct Volume {
    dir: TempDir,
    img: String,
    pass: String,
    key: Vec<u8>,
}

impl Volume {
    /// A volume of `mb` MiB made with `luksFormat ARGS`; `None` (and a
    /// message) where the tools are missing, and the test is skipped.
    fn new(tag: &str, mb: u64, args: &[&str]) -> Option<Volume> {
        if !have_tools() {
            return None;
        }
        let dir = TempDir::new(tag);
        let (img, pass, key) = format(&dir, "v.img", mb, args);
        Some(Volume {
            dir,
            img,
            pass,
            key,
        })
    }

    /// The spec that opens it with its key file.
    fn spec(&self) -> String {
        format!("luks:{},key-file={}", self.img, self.pass)
    }
}

/// A LUKS volume of `mb` MiB made by `cryptsetup luksFormat ARGS` in `dir`,
/// and its volume key as cryptsetup dumps it.
fn format(dir: &TempDir, name: &str, mb: u64, args: &[&str]) -> (String, String, Vec<u8>) {
    let img = dir.path(name).to_str().unwrap().to_string();
    let pass = dir.path("pass").to_str().unwrap().to_string();
    std::fs::write(&pass, PASS).unwrap();
    std::fs::File::create(&img)
        .unwrap()
        .set_len(mb << 20)
        .unwrap();
    let out = Command::new("cryptsetup")
        .args(["luksFormat", "-q", "--key-file", &pass])
        .args(args)
        .arg(&img)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "luksFormat: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new("cryptsetup")
        .args([
            "luksDump",
            "-q",
            "--dump-volume-key",
            "--key-file",
            &pass,
            &img,
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let mut key = Vec::new();
    let mut on = false;
    for l in text.lines() {
        if l.starts_with("MK dump:") {
            on = true;
        } else if !l.starts_with(['\t', ' ']) {
            on = false;
        }
        if on {
            let hex = l.trim_start_matches("MK dump:");
            key.extend(
                hex.split_whitespace()
                    .map(|b| u8::from_str_radix(b, 16).unwrap()),
            );
        }
    }
    assert!(!key.is_empty(), "no volume key in:\n{text}");
    (img, pass, key)
}

fn sync_done(bio: BioPtr) {
    // SAFETY: `io` points private at a Cell on its stack and turns the
    // reactor until this has run.
    let cell = unsafe { &*(bio.private() as *const Cell<Option<Status>>) };
    cell.set(Some(bio.status()));
}

/// One synchronous read or write of `buf` at byte `off` of `dev`.
fn io(dev: &Arc<dyn BlockDevice>, op: Op, off: u64, buf: &mut AlignedBuf) -> Status {
    let r = Reactor::new(ReactorConfig::default()).unwrap();
    let ch = dev.clone().open(&r).unwrap();
    let cell: Cell<Option<Status>> = Cell::new(None);
    let mut bio = r.alloc_bio();
    bio.op = op;
    bio.sector = off / 512;
    // SAFETY: `buf` outlives the I/O: we turn the reactor until it is done.
    unsafe { bio.add_seg(buf.as_mut_ptr(), buf.len()) };
    bio.set_end_io(
        sync_done,
        (&cell as *const Cell<Option<Status>>).cast_mut().cast(),
    );
    ch.submit(bio);
    r.run_until(|| cell.get().is_some());
    cell.get().unwrap()
}

/// Encrypts (`enc`) or decrypts `data` as dm-crypt does for LUKS: AES-XTS,
/// units of `unit` bytes, unit i's IV the 512-byte sector number of its
/// start within the data segment (`first`, in sectors, for the first).
fn reference(enc: bool, key: &[u8], unit: usize, first: u64, data: &[u8]) -> Vec<u8> {
    const SCRIPT: &str = r#"
import sys
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
enc, key, unit, first = sys.argv[1] == 'e', bytes.fromhex(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
data = sys.stdin.buffer.read()
out = bytearray()
for i in range(len(data) // unit):
    iv = (first + i * unit // 512).to_bytes(16, 'little')
    c = Cipher(algorithms.AES(key), modes.XTS(iv))
    c = c.encryptor() if enc else c.decryptor()
    out += c.update(data[i * unit:(i + 1) * unit]) + c.finalize()
sys.stdout.buffer.write(out)
"#;
    let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let mut child = Command::new("python3")
        .args([
            "-c",
            SCRIPT,
            if enc { "e" } else { "d" },
            &hex,
            &unit.to_string(),
            &first.to_string(),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(data).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    out.stdout
}

fn pattern(seed: u8, len: usize) -> AlignedBuf {
    let mut b = AlignedBuf::new(len);
    for (i, x) in b.iter_mut().enumerate() {
        *x = (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8;
    }
    b
}

/// Opens the volume with udm, writes through it and checks the file's
/// bytes with the dumped key; then writes ciphertext with the reference
/// and reads it back through udm.
fn round_trip(args: &[&str], data_offset: u64, unit: usize) {
    let Some(v) = Volume::new("luks", 24, args) else {
        return;
    };
    let (img, key) = (&v.img, &v.key);
    let ctl = Control::default();
    ctl.create("v", &v.spec()).unwrap();
    let dev = ctl.registry().get("v").unwrap();
    assert_eq!(dev.limits().logical_block_size as usize, unit);
    assert_eq!(dev.limits().bytes(), (24 << 20) - data_offset);

    // udm writes; the reference decrypts the file.
    let at = 64 * 1024u64;
    let mut w = pattern(1, 32 * 1024);
    assert_eq!(io(&dev, Op::Write, at, &mut w), Status::Ok);
    let file = std::fs::read(img).unwrap();
    let raw = &file[(data_offset + at) as usize..][..w.len()];
    assert!(raw != &w[..], "plaintext on disk");
    let plain = reference(false, key, unit, at / 512, raw);
    assert!(
        plain == w[..],
        "{args:?}: what udm wrote does not decrypt with the volume key"
    );

    // The reference writes; udm reads.
    let at2 = 1024 * 1024u64;
    let p2 = pattern(2, 16 * 1024);
    let c2 = reference(true, key, unit, at2 / 512, &p2);
    let f = std::fs::OpenOptions::new().write(true).open(img).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &c2, data_offset + at2).unwrap();
    drop(f);
    let mut r = AlignedBuf::new(p2.len());
    assert_eq!(io(&dev, Op::Read, at2, &mut r), Status::Ok);
    assert!(
        r[..] == p2[..],
        "{args:?}: udm does not read what the reference wrote"
    );
}

#[test]
fn luks2_pbkdf2_4096_byte_sectors() {
    round_trip(LUKS2_PBKDF2, 16 << 20, 4096);
}

#[test]
fn luks2_argon2id_512_byte_sectors() {
    round_trip(
        &[LUKS2_ARGON2ID, &["--sector-size", "512"]].concat(),
        16 << 20,
        512,
    );
}

#[test]
fn luks1_pbkdf2() {
    round_trip(
        &[
            "--type",
            "luks1",
            "--pbkdf-force-iterations",
            "1000",
            "--key-size",
            "256",
        ],
        2 << 20,
        512,
    );
}

fn create_err(spec: &str) -> String {
    let ctl = Control::default();
    let e = ctl.create("v", spec).err().unwrap().to_string();
    assert!(!e.contains('\n'), "{e}");
    assert!(
        ctl.registry().get("v").is_none(),
        "a device was left behind"
    );
    e
}

#[test]
fn wrong_passphrases_damaged_headers_and_unknown_ciphers_are_refused() {
    let Some(Volume { dir, img, pass, .. }) = Volume::new("luks-bad", 20, LUKS2_PBKDF2) else {
        return;
    };
    let bad = dir.path("bad").to_str().unwrap().to_string();
    std::fs::write(&bad, b"not it").unwrap();
    let e = create_err(&format!("luks:{img},key-file={bad}"));
    assert_eq!(
        e,
        "device 'v': luks: wrong passphrase (no keyslot opens with it)"
    );
    let e = create_err(&format!("luks:{img},key-file={pass},keyslot=3"));
    assert!(e.contains("keyslot 3 is not in use"), "{e}");
    let e = create_err(&format!("luks:{img}"));
    assert!(e.contains("give key-file=PATH"), "{e}");
    let e = create_err(&format!("luks:{img},key-file={pass},fast"));
    assert!(e.contains("unknown option 'fast'"), "{e}");

    // One damaged copy of the header: the other opens the volume.
    let mut bytes = std::fs::read(&img).unwrap();
    bytes[4096 + 10] ^= 0xff;
    std::fs::write(&img, &bytes).unwrap();
    let ctl = Control::default();
    ctl.create("v", &format!("luks:{img},key-file={pass}"))
        .unwrap();
    // Both damaged: refused.
    bytes[16384 + 4096 + 10] ^= 0xff;
    std::fs::write(&img, &bytes).unwrap();
    let e = create_err(&format!("luks:{img},key-file={pass}"));
    assert!(e.contains("luks: damaged header: checksum mismatch"), "{e}");

    // Truncated to its first 8 KiB.
    let t = dir.path("t.img").to_str().unwrap().to_string();
    std::fs::write(&t, &bytes[..8192]).unwrap();
    let e = create_err(&format!("luks:{t},key-file={pass}"));
    assert!(e.contains("luks: damaged header"), "{e}");

    // Not LUKS at all.
    let z = dir.path("z.img").to_str().unwrap().to_string();
    std::fs::write(&z, vec![0u8; 1 << 20]).unwrap();
    let e = create_err(&format!("luks:{z},key-file={pass}"));
    assert!(e.contains("not a LUKS volume"), "{e}");

    // A udm device by name: read through a reactor of udm's own.
    let ctl = Control::default();
    ctl.create("r", "ram:4M").unwrap();
    let e = ctl
        .create("v", &format!("luks:r,key-file={pass}"))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("not a LUKS volume"), "{e}");
    let e = ctl
        .create("v", &format!("luks:r,key-file={pass},ro"))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("'ro' applies to a path; 'r' is a udm device"),
        "{e}"
    );
    let e = create_err(&format!("luks:nosuch,key-file={pass}"));
    assert!(e.contains("unknown device 'nosuch'"), "{e}");

    // A LUKS1 header naming a cipher udm lacks (LUKS1 has no checksum).
    let (v1, pass1, _) = format(
        &dir,
        "v1.img",
        4,
        &["--type", "luks1", "--pbkdf-force-iterations", "1000"],
    );
    let mut h = std::fs::read(&v1).unwrap();
    h[8..40].fill(0);
    h[8..15].copy_from_slice(b"twofish");
    std::fs::write(&v1, &h).unwrap();
    let e = create_err(&format!("luks:{v1},key-file={pass1}"));
    assert!(e.contains("unknown cipher 'twofish'"), "{e}");
}

/// The volume key is in no table line or dump of the configuration; the
/// spec (with the key file's path, not the key) is what a dump keeps.
#[test]
fn the_volume_key_stays_out_of_tables_and_configuration_dumps() {
    let Some(v) = Volume::new("luks-key", 20, LUKS2_PBKDF2) else {
        return;
    };
    let ctl = Control::default();
    let spec = v.spec();
    ctl.create("v", &spec).unwrap();
    let hex: String = v.key.iter().map(|b| format!("{b:02x}")).collect();
    let t = ctl.table(&[]).unwrap().to_string();
    assert!(!t.contains(&hex[..16]), "{t}");
    assert!(t.contains("crypt aes-xts-plain64 - 0"), "{t}");
    let shown = ctl.table_shown(&[], true).unwrap().to_string();
    assert!(shown.contains(&hex), "{shown}");
    let dump = udm_control::Config::dump(&ctl).unwrap().to_toml().unwrap();
    assert!(!dump.contains(&hex[..16]), "{dump}");
    assert!(dump.contains(&spec), "{dump}");
}

/// A volume on another udm device, named in the spec: a RAM disk holding
/// a LUKS2 image (Argon2id) opens, and its table maps onto that device.
#[test]
fn a_volume_on_a_udm_device_opens_by_name() {
    // Bound whole: its directory lives as long as the test.
    let Some(v) = Volume::new("luks-dev", 20, LUKS2_ARGON2ID) else {
        return;
    };
    let (img, pass) = (&v.img, &v.pass);
    let ctl = Control::default();
    ctl.create("r", "ram:20M").unwrap();
    let ram = ctl.registry().get("r").unwrap();
    let bytes = std::fs::read(img).unwrap();
    let mut b = AlignedBuf::new(bytes.len());
    b.copy_from_slice(&bytes);
    assert_eq!(io(&ram, Op::Write, 0, &mut b), Status::Ok);
    ctl.create("v", &format!("luks:r,key-file={pass}")).unwrap();
    let t = ctl.table(&["v".into()]).unwrap().to_string();
    assert!(
        t.contains("crypt aes-xts-plain64 - 0 r 32768 1 sector_size:4096"),
        "{t}"
    );
    // The RAM disk is held by the volume's table.
    assert!(ctl.registry().holders("r").len() == 1);
}
