//! The `crypt` target end to end over RAM devices: what lands on the device
//! is what dm-crypt writes (checked against an independent AES, Python's
//! `cryptography`, i.e. OpenSSL), reads decrypt whatever the caller's
//! buffer layout, the caller's write buffer is left as it was, bad tables
//! are refused in one line, and the key appears in no table or status line
//! unless asked for.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Arc;

use common::{as_dev, pattern, Devices, Req, Tester, SECTOR};
use udm_core::{BlockDevice, Caps, Status};

const KEY512: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f\
                      f0e0d0c0b0a090807060504030201000ffeeddccbbaa99887766554433221100";
const KEY256: &str = "603deb1015ca71be2b73aef0857d77811f352c073b6108d72d9810a30914dff4";

/// Encrypts `plain` as dm-crypt would with an independent AES (OpenSSL,
/// through Python's `cryptography`): unit i (of `unit` bytes) with IV
/// number `ivs[i]`. `None` when Python or the module is missing.
fn reference(cipher: &str, key: &str, unit: usize, ivs: &[u64], plain: &[u8]) -> Option<Vec<u8>> {
    const SCRIPT: &str = r#"
import sys
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives import hashes
chain, ivmode, key, unit = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3]), int(sys.argv[4])
ivs = [int(x) for x in sys.argv[5].split(',')]
data = sys.stdin.buffer.read()
out = bytearray()
for i, n in enumerate(ivs):
    if ivmode == 'plain64':
        iv = n.to_bytes(8, 'little') + bytes(8)
    elif ivmode == 'plain':
        iv = (n & 0xffffffff).to_bytes(4, 'little') + bytes(12)
    else:
        h = hashes.Hash(hashes.SHA256()); h.update(key)
        e = Cipher(algorithms.AES(h.finalize()), modes.ECB()).encryptor()
        iv = e.update(n.to_bytes(8, 'little') + bytes(8)) + e.finalize()
    mode = modes.XTS(iv) if chain == 'xts' else modes.CBC(iv)
    e = Cipher(algorithms.AES(key), mode).encryptor()
    out += e.update(data[i * unit:(i + 1) * unit]) + e.finalize()
sys.stdout.buffer.write(out)
"#;
    let (chain, ivmode) = match cipher {
        "aes-xts-plain64" | "capi:xts(aes)-plain64" => ("xts", "plain64"),
        "aes-xts-plain" => ("xts", "plain"),
        "aes-cbc-essiv:sha256" => ("cbc", "essiv"),
        c => panic!("test bug: no reference for {c}"),
    };
    let ivs: Vec<String> = ivs.iter().map(u64::to_string).collect();
    let mut child = Command::new("python3")
        .args([
            "-c",
            SCRIPT,
            chain,
            ivmode,
            key,
            &unit.to_string(),
            &ivs.join(","),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .ok()?;
    child.stdin.take()?.write_all(plain).ok()?;
    let out = child.wait_with_output().ok()?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("No module named 'cryptography'"),
            "reference failed: {err}"
        );
        eprintln!("skipped: python3-cryptography is not installed");
        return None;
    }
    Some(out.stdout)
}

/// One crypt configuration and where a write lands.
struct Case {
    cipher: &'static str,
    key: &'static str,
    iv_offset: u64,
    dev_offset: u64,
    opts: &'static str,
    /// Bytes per encryption unit.
    unit: usize,
    large: bool,
}

/// Writes known plaintext through crypt at sector 16 and compares the
/// device's bytes with the reference's ciphertext, whose IV numbers are
/// dm-crypt's rule written out: (target sector + iv_offset), in 512-byte
/// sectors, divided by the unit's sectors with `iv_large_sectors`.
///
/// Both ways the target works: in the RAM disk's memory (direct access),
/// and over a device that gives none (bounce buffers down, decryption as
/// reads complete).
fn check_against_reference(c: &Case) {
    for direct in [true, false] {
        check_against_reference_on(c, direct);
    }
}

/// A RAM disk `ram0` of `sectors`, and the name of the device a crypt table
/// goes over: `ram0` itself (`direct`), or a linear device over all of it,
/// which gives no direct access to the memory.
fn ram_below(
    devs: &mut Devices,
    sectors: u64,
    direct: bool,
) -> (Arc<dyn BlockDevice>, &'static str) {
    let ram = devs.ram("ram0", sectors);
    if direct {
        return (ram, "ram0");
    }
    let lin = as_dev(&devs.mapped("lin0", &format!("0 {sectors} linear ram0 0")));
    devs.add(lin);
    (ram, "lin0")
}

fn check_against_reference_on(c: &Case, direct: bool) {
    let mut devs = Devices::new();
    let (ram, below) = ram_below(&mut devs, 1024, direct);
    let len = 512 - 64;
    let table = format!(
        "0 {len} crypt {} {} {} {below} {} {}",
        c.cipher, c.key, c.iv_offset, c.dev_offset, c.opts
    );
    let dev = as_dev(&devs.mapped("c", &table));
    let t = Tester::new();
    let at = 16u64;
    let plain = pattern(7, at, 32);
    t.write(&dev, at, plain.clone());

    let unit_sectors = (c.unit / SECTOR) as u64;
    let ivs: Vec<u64> = (0..(plain.len() / c.unit) as u64)
        .map(|i| {
            let n = at + i * unit_sectors + c.iv_offset;
            if c.large {
                n / unit_sectors
            } else {
                n
            }
        })
        .collect();
    let Some(want) = reference(c.cipher, c.key, c.unit, &ivs, &plain) else {
        return;
    };
    let raw = t.read(&ram, c.dev_offset + at, 32);
    assert!(raw == want, "{table}: the device holds other ciphertext");
    // And it reads back, into a buffer cut in uneven pieces.
    let d = t.run(&dev, Req::read(at, 32).segs(5));
    assert_eq!(d.status, Status::Ok);
    assert!(d.data == plain, "{table}: read back differs");
}

#[test]
fn xts_plain64_writes_what_dm_crypt_writes() {
    check_against_reference(&Case {
        cipher: "aes-xts-plain64",
        key: KEY512,
        iv_offset: 0,
        dev_offset: 0,
        opts: "",
        unit: 512,
        large: false,
    });
}

#[test]
fn iv_offset_and_device_offset_count_as_dm_crypt_counts_them() {
    check_against_reference(&Case {
        cipher: "aes-xts-plain64",
        key: KEY512,
        iv_offset: 5,
        dev_offset: 40,
        opts: "",
        unit: 512,
        large: false,
    });
}

/// With 4 KiB sectors and no `iv_large_sectors`, IVs still count 512-byte
/// sectors (each unit's IV is its first 512-byte sector).
#[test]
fn sector_size_4096_counts_ivs_in_512_byte_sectors() {
    check_against_reference(&Case {
        cipher: "aes-xts-plain64",
        key: KEY512,
        iv_offset: 8,
        dev_offset: 8,
        opts: "1 sector_size:4096",
        unit: 4096,
        large: false,
    });
}

/// LUKS2's default with 4 KiB sectors: IVs count 4 KiB sectors.
#[test]
fn iv_large_sectors_counts_ivs_in_sectors_of_sector_size() {
    check_against_reference(&Case {
        cipher: "aes-xts-plain64",
        key: KEY512,
        iv_offset: 16,
        dev_offset: 0,
        opts: "2 sector_size:4096 iv_large_sectors",
        unit: 4096,
        large: true,
    });
}

/// `plain` keeps only the low 32 bits of the sector number: an iv_offset
/// just below 2^32 makes the written sectors wrap to IV 0.
#[test]
fn plain_truncates_the_sector_number_to_32_bits() {
    check_against_reference(&Case {
        cipher: "aes-xts-plain",
        key: KEY512,
        iv_offset: (1 << 32) - 20,
        dev_offset: 0,
        opts: "",
        unit: 512,
        large: false,
    });
}

#[test]
fn cbc_essiv_sha256_writes_what_dm_crypt_writes() {
    check_against_reference(&Case {
        cipher: "aes-cbc-essiv:sha256",
        key: KEY256,
        iv_offset: 3,
        dev_offset: 0,
        opts: "",
        unit: 512,
        large: false,
    });
}

#[test]
fn the_crypto_api_form_names_the_same_cipher() {
    check_against_reference(&Case {
        cipher: "capi:xts(aes)-plain64",
        key: KEY256,
        iv_offset: 0,
        dev_offset: 0,
        opts: "1 sector_size:1024",
        unit: 1024,
        large: false,
    });
}

/// A write goes down from a copy: the caller's buffer still holds the
/// plaintext when the write completes, and writes with odd segments land
/// as one contiguous write would.
#[test]
fn writes_leave_the_callers_buffer_as_it_was() {
    for direct in [true, false] {
        writes_leave_the_callers_buffer_as_it_was_on(direct);
    }
}

fn writes_leave_the_callers_buffer_as_it_was_on(direct: bool) {
    let mut devs = Devices::new();
    let (ram, below) = ram_below(&mut devs, 256, direct);
    let dev = as_dev(&devs.mapped(
        "c",
        &format!("0 256 crypt aes-xts-plain64 {KEY512} 0 {below} 0"),
    ));
    let t = Tester::new();
    let plain = pattern(3, 0, 64);
    let d = t.run(&dev, Req::write(0, plain.clone()).segs(7));
    assert_eq!(d.status, Status::Ok);
    assert!(d.req.data == plain);
    let first = t.read(&ram, 0, 64);
    t.write(&dev, 0, plain.clone());
    assert!(
        t.read(&ram, 0, 64) == first,
        "segmented and contiguous writes differ"
    );
    assert!(first != plain, "the device holds plaintext");
    assert!(t.read(&dev, 0, 64) == plain);
}

/// Writes larger than the largest bounce buffer are split and still land
/// sector for sector.
#[test]
fn large_writes_are_split_and_read_back() {
    for direct in [true, false] {
        large_writes_are_split_and_read_back_on(direct);
    }
}

fn large_writes_are_split_and_read_back_on(direct: bool) {
    let mut devs = Devices::new();
    let (_, below) = ram_below(&mut devs, 8192, direct);
    let dev = as_dev(&devs.mapped(
        "c",
        &format!("0 8192 crypt aes-xts-plain64 {KEY512} 0 {below} 0 1 sector_size:4096"),
    ));
    let t = Tester::new();
    let plain = pattern(9, 8, 4096 + 8);
    t.write(&dev, 8, plain.clone());
    assert!(t.read(&dev, 8, 4096 + 8) == plain);
    assert!(t.read(&dev, 16, 8) == plain[8 * SECTOR..16 * SECTOR]);
}

#[test]
fn sector_size_sets_the_logical_block_size_and_discards_need_allowing() {
    let mut devs = Devices::new();
    devs.ram("ram0", 256);
    let t = devs.table(&format!(
        "0 256 crypt aes-xts-plain64 {KEY512} 0 ram0 0 1 sector_size:4096"
    ));
    assert_eq!(t.limits.logical_block_size, 4096);
    assert!(!t.caps.contains(Caps::DISCARD));
    assert!(!t.caps.contains(Caps::WRITE_ZEROES));
    let t = devs.table(&format!(
        "0 256 crypt aes-xts-plain64 {KEY512} 0 ram0 0 1 allow_discards"
    ));
    assert!(t.caps.contains(Caps::DISCARD));
    assert_eq!(t.limits.logical_block_size, 512);
}

#[test]
fn bad_tables_are_refused_in_one_line() {
    let mut devs = Devices::new();
    devs.ram("ram0", 256);
    let e = |args: &str| {
        let m = devs.table_err(&format!("0 256 crypt {args}"));
        assert!(!m.contains('\n'), "{m}");
        m
    };
    let m = e(&format!("aes-xts-plain64 {} 0 ram0 0", &KEY512[..40]));
    assert!(
        m.contains(
            "crypt: key of 160 bits does not fit aes-xts-plain64: expected 256, 384, 512 bits"
        ),
        "{m}"
    );
    let m = e(&format!("serpent-xts-plain64 {KEY512} 0 ram0 0"));
    assert!(m.contains("unknown cipher 'serpent'"), "{m}");
    let m = e(&format!("aes-xts-benbi {KEY512} 0 ram0 0"));
    assert!(m.contains("unknown IV mode 'benbi'"), "{m}");
    let m = e(&format!(
        "aes-xts-plain64 {KEY512} 0 ram0 0 1 sector_size:1000"
    ));
    assert!(
        m.contains("invalid sector_size '1000': expected a power of two from 512 to 4096"),
        "{m}"
    );
    let m = e(&format!(
        "aes-xts-plain64 {KEY512} 0 ram0 0 1 sector_size:8192"
    ));
    assert!(m.contains("invalid sector_size '8192'"), "{m}");
    let m = devs.table_err(&format!(
        "0 260 crypt aes-xts-plain64 {KEY512} 0 ram0 0 1 sector_size:4096"
    ));
    assert!(
        m.contains("the target (260 sectors at 0) is not a multiple of sector_size 4096"),
        "{m}"
    );
    let m = e(&format!(
        "aes-xts-plain64 {KEY512} 0 ram0 0 2 allow_discards"
    ));
    assert!(
        m.contains("number of optional parameters is 2 but 1 follow"),
        "{m}"
    );
    let m = e(&format!("aes-xts-plain64 {KEY512} 0 ram0 0 1 fast"));
    assert!(m.contains("unknown optional parameter 'fast'"), "{m}");
    let m = e(&format!("aes-xts-plain64 {KEY512} x ram0 0"));
    assert!(m.contains("invalid iv_offset 'x'"), "{m}");
    let m = e("aes-xts-plain64 00zz 0 ram0 0");
    assert!(
        m.contains("invalid key: character 3 is not a hex digit"),
        "{m}"
    );
    let m = e(&format!("aes-xts-plain64 {KEY512} 0 ram9 0"));
    assert!(m.contains("no device 'ram9'"), "{m}");
}

/// The key given in the table line is in no table or status line, nor in
/// an error; `table_lines_with_keys` shows it, and its lines build the same
/// target again.
#[test]
fn the_key_appears_only_when_keys_are_asked_for() {
    let mut devs = Devices::new();
    devs.ram("ram0", 512);
    let text = format!(
        "0 256 crypt aes-xts-plain64 {KEY512} 7 ram0 8 3 allow_discards same_cpu_crypt sector_size:4096"
    );
    let t = devs.table(&text);
    let shown = format!(
        "0 256 crypt aes-xts-plain64 {KEY512} 7 ram0 8 3 allow_discards same_cpu_crypt sector_size:4096"
    );
    assert_eq!(t.table_lines_with_keys(), vec![shown.clone()]);
    assert_eq!(
        t.table_lines(),
        vec!["0 256 crypt aes-xts-plain64 - 7 ram0 8 3 allow_discards same_cpu_crypt sector_size:4096"]
    );
    assert_eq!(t.status_lines(), vec!["0 256 crypt"]);
    let again = devs.table(&shown);
    assert_eq!(again.table_lines_with_keys(), vec![shown]);
    // A table printed without keys does not load back with some key.
    let e = devs.table_err(&t.table_lines()[0]);
    assert!(e.contains("invalid key"), "{e}");
    // Nor does an error quote a bad key.
    let bad = format!("{}zz", &KEY512[..62]);
    let e = devs.table_err(&format!("0 256 crypt aes-xts-plain64 {bad} 0 ram0 0"));
    assert!(!e.contains(&bad[..40]), "{e}");
    let all = format!("{:?}{:?}", t.table_lines(), t.status_lines());
    assert!(!all.contains(&KEY512[..32]) && !all.contains(&KEY512[64..96]));
}

/// dm-crypt's workqueue options are accepted and printed back, in dm's order.
#[test]
fn workqueue_options_are_accepted_and_printed_back() {
    let mut devs = Devices::new();
    devs.ram("ram0", 256);
    let t = devs.table(&format!(
        "0 256 crypt aes-xts-plain64 {KEY512} 0 ram0 0 5 no_write_workqueue iv_large_sectors \
         no_read_workqueue submit_from_crypt_cpus same_cpu_crypt"
    ));
    assert_eq!(
        t.table_lines(),
        vec![
            "0 256 crypt aes-xts-plain64 - 0 ram0 0 5 same_cpu_crypt submit_from_crypt_cpus \
              no_read_workqueue no_write_workqueue iv_large_sectors"
        ]
    );
}

/// Steady state allocates nothing: bounce buffers and descriptors come back
/// to their caches (over a device without direct access, where writes go
/// down from bounce buffers; over RAM, no descriptor goes down at all).
#[test]
fn steady_writes_reuse_bounce_buffers_and_descriptors() {
    for direct in [true, false] {
        steady_writes_reuse_bounce_buffers_and_descriptors_on(direct);
    }
}

fn steady_writes_reuse_bounce_buffers_and_descriptors_on(direct: bool) {
    let mut devs = Devices::new();
    let (_, below) = ram_below(&mut devs, 256, direct);
    let dev = as_dev(&devs.mapped(
        "c",
        &format!("0 256 crypt aes-xts-plain64 {KEY512} 0 {below} 0"),
    ));
    let t = Tester::new();
    for _ in 0..3 {
        t.write(&dev, 0, pattern(1, 0, 16));
    }
    let s0 = t.reactor.cache_stats();
    for i in 0..50 {
        t.write(&dev, i % 8 * 8, pattern(i, 0, 16));
    }
    let s1 = t.reactor.cache_stats();
    assert_eq!(s1.misses, s0.misses, "descriptors were allocated");
    let _: &dyn BlockDevice = &*dev;
}

/// What the target relies on to work in a RAM disk's memory: the channel
/// gives the memory that holds a range inside the device and nothing
/// beyond it, bytes there are the device's (a write's bytes read through
/// it, bytes stored through it read back), and a store makes its pages
/// data, not holes. A mapped device gives no such access.
#[test]
fn a_ram_disk_gives_direct_access_to_its_memory_and_nothing_beyond() {
    let mut devs = Devices::new();
    let ram = devs.ram("ram0", 64);
    let t = Tester::new();
    let ch = t.open(&ram);
    assert!(ch.direct_access(0, 0, false).is_none(), "an empty range");
    assert!(ch.direct_access(63, 1024, false).is_none(), "past the end");
    assert!(ch.direct_access(u64::MAX, 512, true).is_none(), "overflow");
    let written = pattern(4, 8, 8);
    t.write(&ram, 8, written.clone());
    let p = ch.direct_access(8, 4096, false).expect("ram gives access");
    // SAFETY: 4096 bytes of the device's memory, which lives as long as
    // `ram`; no I/O runs meanwhile.
    let seen = unsafe { std::slice::from_raw_parts(p.as_ptr(), 4096) };
    assert!(seen == &written[..], "the memory does not hold the write");

    let mut holes = Vec::new();
    ram.block_status(32, 8, &mut holes).expect("block status");
    assert_eq!(holes[0].alloc, udm_core::Alloc::Hole);
    let stored = pattern(5, 32, 8);
    let p = ch.direct_access(32, 4096, true).expect("ram gives access");
    // SAFETY: as above.
    unsafe { std::ptr::copy_nonoverlapping(stored.as_ptr(), p.as_ptr(), 4096) };
    assert!(t.read(&ram, 32, 8) == stored, "a store does not read back");
    let mut data = Vec::new();
    ram.block_status(32, 8, &mut data).expect("block status");
    assert_eq!(
        data[0].alloc,
        udm_core::Alloc::Data,
        "a stored page is a hole"
    );

    let lin = as_dev(&devs.mapped("lin", "0 64 linear ram0 0"));
    assert!(t.open(&lin).direct_access(0, 512, false).is_none());
}
