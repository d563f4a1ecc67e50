//! The conformance suite every block device in udm must pass: the backends
//! (ram, null, file in each of its modes, powercut) and the targets over
//! them (linear, striped, zero, error, writecache, flakey, delay, dust,
//! log-writes, crypt, thin-pool, thin and raid1). [`conformance`] takes a
//! device factory and what the device promises ([`Expect`]: whether reads
//! return data, zeroes, nothing or errors; its exact caps; its logical block
//! size; whether discard leaves zeroes) and runs each check against a fresh
//! device on its own reactor: limits and caps, reads of never-written space,
//! data patterns at aligned and unaligned places, multi-segment bios,
//! discard and write-zeroes, flush / FUA / PREFLUSH, malformed bios (which
//! must fail with Inval, never panic), many bios in flight in every
//! completion mode (including overlapping reads and a ring smaller than the
//! batch), and, over powercut wrappers, durability across a power cut.
//!
//! Every I/O is checked to complete exactly once, never inside `submit`, and
//! every wait is guarded by a watchdog, so a lost completion or wake-up fails
//! the test instead of hanging it. File devices live in `/dev/shm`.

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

#[path = "conformance/backend_specific.rs"]
mod backend_specific;
#[path = "conformance/checks.rs"]
mod checks;
mod common;
#[path = "conformance/durability.rs"]
mod durability;
#[path = "conformance/harness.rs"]
mod harness;

use std::sync::Arc;
use std::time::Duration;

use udm_backends::{FileDevice, FileOpts, NullDevice, Power, PowerCut, RamDevice};
use udm_core::{BlockDevice, Caps};

use checks::conformance;
use common::Devices;
use harness::*;

/// What ram, null and a table over them offer.
fn ram_caps() -> Caps {
    Caps::FLUSH | Caps::FUA | Caps::DISCARD | Caps::WRITE_ZEROES
}

/// A writecache: flush and FUA, discard passed to the origin, no
/// write-zeroes.
fn wc_caps() -> Caps {
    Caps::FLUSH | Caps::FUA | Caps::DISCARD
}
/// Sectors of every device under test.
const DEV_SECTORS: u64 = DEV_BYTES / 512;
/// A writecache's cache device: 8 MiB (about 2000 blocks of 4 KiB).
const CACHE_BYTES: u64 = 8 << 20;

fn ram(name: &str, bytes: u64) -> Arc<dyn BlockDevice> {
    Arc::new(RamDevice::new(name, bytes).unwrap())
}

fn null_expect(label: &'static str, delay: Option<Duration>) -> Expect {
    Expect {
        reads: Reads::Untouched,
        discard_zeroes: false,
        min_latency: delay,
        // A delay per request is what merging saves (seed 004).
        ..Expect::data(
            label,
            if delay.is_some() {
                ram_caps() | Caps::MERGE
            } else {
                ram_caps()
            },
        )
    }
}

/// A file on /dev/shm: persistent; with O_DIRECT it reports MERGE (auto
/// dispatch weighs queued against direct there), buffered it does not
/// (the page cache merges).
fn file_expect(label: &'static str, direct: bool) -> Expect {
    let caps = ram_caps() | Caps::PERSISTENT;
    Expect::data(label, if direct { caps | Caps::MERGE } else { caps })
}

/// A file device of `bytes` on a fresh `/dev/shm` file.
fn file_dev(label: &str, bytes: u64, opts: FileOpts) -> (Arc<dyn BlockDevice>, TempFile) {
    let file = TempFile::new(label);
    let opts = FileOpts {
        size: Some(bytes),
        ..opts
    };
    let dev = FileDevice::open(label, &file.path, opts)
        .unwrap_or_else(|err| panic!("{label}: open {}: {err}", file.path));
    assert_eq!(dev.path(), file.path);
    (Arc::new(dev), file)
}

fn file_fixture(label: &'static str, opts: FileOpts, fixed_buffers: bool) -> Fixture {
    let (dev, file) = file_dev(label, DEV_BYTES, opts);
    Fixture {
        fixed_buffers,
        backing: Some(file),
        ..Fixture::plain(dev)
    }
}

/// A mapped device called `name` with the one-line table `line` over `devs`.
fn mapped(devs: &Devices, name: &str, line: &str) -> Arc<dyn BlockDevice> {
    common::as_dev(&devs.mapped(name, line))
}

fn wc_line() -> String {
    format!("0 {DEV_SECTORS} writecache s origin cache 4096 0")
}

// ---------------------------------------------------------------------------
// Backends.

#[test]
fn ram_conforms() {
    conformance(
        || Fixture::plain(ram("ram", DEV_BYTES)),
        Expect::data("ram", ram_caps()),
    );
}

#[test]
fn null_conforms() {
    conformance(
        || Fixture::plain(Arc::new(NullDevice::new("null", DEV_BYTES, None).unwrap())),
        null_expect("null", None),
    );
}

#[test]
fn null_with_delay_conforms() {
    let delay = Duration::from_micros(300);
    conformance(
        move || {
            Fixture::plain(Arc::new(
                NullDevice::new("null-delay", DEV_BYTES, Some(delay)).unwrap(),
            ))
        },
        null_expect("null delay=300", Some(delay)),
    );
}

#[test]
fn file_direct_conforms() {
    conformance(
        || file_fixture("file-direct", FileOpts::default(), false),
        file_expect("file (O_DIRECT)", true),
    );
}

#[test]
fn file_buffered_conforms() {
    let opts = FileOpts {
        buffered: true,
        ..FileOpts::default()
    };
    conformance(
        || file_fixture("file-buffered", opts.clone(), false),
        file_expect("file,buffered", false),
    );
}

#[test]
fn file_sqpoll_conforms() {
    let opts = FileOpts {
        sqpoll: true,
        ..FileOpts::default()
    };
    conformance(
        || file_fixture("file-sqpoll", opts.clone(), false),
        file_expect("file,sqpoll", true),
    );
}

#[test]
fn file_registered_buffers_conform() {
    conformance(
        || file_fixture("file-fixed", FileOpts::default(), true),
        file_expect("file + registered buffers", true),
    );
}

#[test]
fn file_sqpoll_registered_buffers_conform() {
    let opts = FileOpts {
        sqpoll: true,
        ..FileOpts::default()
    };
    conformance(
        || file_fixture("file-sqpoll-fixed", opts.clone(), true),
        file_expect("file,sqpoll + registered buffers", true),
    );
}

/// A powercut wrapper over a fresh ram device of `bytes`, on `power`.
fn powercut(name: &str, bytes: u64, power: &Arc<Power>) -> Arc<PowerCut> {
    let inner = ram(&format!("{name}-ram"), bytes);
    Arc::new(PowerCut::new(name, inner, vec![0; bytes as usize], power.clone()).unwrap())
}

#[test]
fn powercut_over_ram_conforms() {
    conformance(
        || {
            let power = Power::new();
            let pc = powercut("pc", DEV_BYTES, &power);
            let again = pc.clone();
            Fixture {
                power: Some(PowerRig {
                    power,
                    cuts: vec![pc.clone()],
                    reopen: Box::new(move || again.clone()),
                    loses_unflushed: true,
                }),
                ..Fixture::plain(pc)
            }
        },
        Expect::data("powercut over ram", ram_caps()),
    );
}

// ---------------------------------------------------------------------------
// Targets.

#[test]
fn linear_over_ram_conforms() {
    conformance(
        || {
            let mut devs = Devices::new();
            devs.ram("r", DEV_SECTORS + 64);
            // Not at the start of its device: the map adds the offset.
            Fixture::plain(mapped(
                &devs,
                "lin",
                &format!("0 {DEV_SECTORS} linear r 64"),
            ))
        },
        Expect::data("linear over ram", ram_caps()),
    );
}

#[test]
fn linear_over_file_conforms() {
    conformance(
        || {
            let (dev, file) = file_dev("lin-file", DEV_BYTES, FileOpts::default());
            let mut devs = Devices::new();
            devs.add(dev);
            Fixture {
                // Mapped from the file's start: the file holds the device.
                backing: Some(file),
                ..Fixture::plain(mapped(
                    &devs,
                    "lin",
                    &format!("0 {DEV_SECTORS} linear lin-file 0"),
                ))
            }
        },
        file_expect("linear over file", true),
    );
}

#[test]
fn striped_over_ram_conforms() {
    conformance(
        || {
            let mut devs = Devices::new();
            devs.ram("s0", DEV_SECTORS / 2);
            devs.ram("s1", DEV_SECTORS / 2);
            Fixture::plain(mapped(
                &devs,
                "str",
                &format!("0 {DEV_SECTORS} striped 2 128 s0 0 s1 0"),
            ))
        },
        Expect::data("striped over ram", ram_caps()),
    );
}

/// flakey in its up interval (an hour up, a second down): a pass-through.
#[test]
fn flakey_up_over_ram_conforms() {
    conformance(
        || {
            let mut devs = Devices::new();
            devs.ram("r", DEV_SECTORS + 64);
            Fixture::plain(mapped(
                &devs,
                "flakey",
                &format!("0 {DEV_SECTORS} flakey r 64 3600 1"),
            ))
        },
        Expect::data("flakey (up) over ram", ram_caps()),
    );
}

/// delay 0: a pure remap.
#[test]
fn delay_zero_over_ram_conforms() {
    conformance(
        || {
            let mut devs = Devices::new();
            devs.ram("r", DEV_SECTORS + 64);
            Fixture::plain(mapped(
                &devs,
                "delay0",
                &format!("0 {DEV_SECTORS} delay r 64 0"),
            ))
        },
        Expect::data("delay 0 over ram", ram_caps()),
    );
}

/// delay with every class delayed (reads 1 ms, writes 2 ms, flushes 1 ms,
/// writes on a second device): every I/O takes at least the smallest.
#[test]
fn delay_over_ram_conforms() {
    conformance(
        || {
            let mut devs = Devices::new();
            devs.ram("r", DEV_SECTORS);
            Fixture::plain(mapped(
                &devs,
                "delay",
                &format!("0 {DEV_SECTORS} delay r 0 1 r 0 2 r 0 1"),
            ))
        },
        Expect {
            min_latency: Some(Duration::from_millis(1)),
            ..Expect::data("delay over ram", ram_caps())
        },
    );
}

/// dust with no bad blocks (4 KiB blocks: I/O is split at each).
#[test]
fn dust_over_ram_conforms() {
    conformance(
        || {
            let mut devs = Devices::new();
            devs.ram("r", DEV_SECTORS);
            Fixture::plain(mapped(
                &devs,
                "dust",
                &format!("0 {DEV_SECTORS} dust r 0 4096"),
            ))
        },
        Expect::data("dust over ram", ram_caps()),
    );
}

/// log-writes over ram, logging to ram.
#[test]
fn log_writes_over_ram_conforms() {
    conformance(
        || {
            let mut devs = Devices::new();
            devs.ram("r", DEV_SECTORS);
            devs.ram("log", 4 * DEV_SECTORS);
            Fixture::plain(mapped(
                &devs,
                "lw",
                &format!("0 {DEV_SECTORS} log-writes r log"),
            ))
        },
        Expect::data("log-writes over ram", ram_caps()),
    );
}

#[test]
fn zero_conforms() {
    conformance(
        || {
            Fixture::plain(mapped(
                &Devices::new(),
                "zero",
                &format!("0 {DEV_SECTORS} zero"),
            ))
        },
        Expect {
            reads: Reads::Zeroes,
            ..Expect::data("zero", ram_caps())
        },
    );
}

#[test]
fn error_conforms() {
    conformance(
        || {
            Fixture::plain(mapped(
                &Devices::new(),
                "err",
                &format!("0 {DEV_SECTORS} error"),
            ))
        },
        Expect {
            reads: Reads::Fail,
            ..Expect::data("error", ram_caps())
        },
    );
}

/// A crypt device (aes-xts-plain64, `opts`) over a fresh RAM disk, 64
/// sectors in, whose every sector was first written with zeroes through
/// the target (as a new encrypted volume is wiped): never-written space
/// then reads as zeroes, as every device's does. With `direct` the target
/// works in the RAM disk's memory; without, the RAM disk lies under a
/// linear device, which gives no direct access, so writes go down from
/// bounce buffers and reads are decrypted as they complete.
fn crypt_over_ram(opts: &str, direct: bool) -> Fixture {
    const KEY: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f\
                       f0e0d0c0b0a090807060504030201000ffeeddccbbaa99887766554433221100";
    let mut devs = Devices::new();
    if direct {
        devs.ram("r", DEV_SECTORS + 64);
    } else {
        devs.ram("r0", DEV_SECTORS + 64);
        let lin = mapped(&devs, "r", &format!("0 {} linear r0 0", DEV_SECTORS + 64));
        devs.add(lin);
    }
    let line = format!("0 {DEV_SECTORS} crypt aes-xts-plain64 {KEY} 0 r 64 {opts}");
    {
        let fill = mapped(&devs, "wipe", &line);
        let t = common::Tester::new();
        for s in (0..DEV_SECTORS).step_by(2048) {
            t.write(&fill, s, vec![0; 1 << 20]);
        }
    }
    Fixture::plain(mapped(&devs, "crypt", &line))
}

/// Crypt passes flush and FUA down; discards only with `allow_discards`,
/// and write-zeroes never (zeroes below would not read back as zeroes).
#[test]
fn crypt_over_ram_conforms() {
    conformance(
        || crypt_over_ram("", true),
        Expect::data("crypt over ram", Caps::FLUSH | Caps::FUA),
    );
}

#[test]
fn crypt_4096_byte_sectors_over_ram_conforms() {
    conformance(
        || crypt_over_ram("2 sector_size:4096 iv_large_sectors", true),
        Expect {
            lbs: 4096,
            ..Expect::data("crypt sector_size:4096 over ram", Caps::FLUSH | Caps::FUA)
        },
    );
}

#[test]
fn crypt_over_linear_over_ram_conforms() {
    conformance(
        || crypt_over_ram("", false),
        Expect::data("crypt over linear over ram", Caps::FLUSH | Caps::FUA),
    );
}

#[test]
fn crypt_4096_byte_sectors_over_linear_over_ram_conforms() {
    conformance(
        || crypt_over_ram("2 sector_size:4096 iv_large_sectors", false),
        Expect {
            lbs: 4096,
            ..Expect::data(
                "crypt sector_size:4096 over linear over ram",
                Caps::FLUSH | Caps::FUA,
            )
        },
    );
}

#[test]
fn writecache_over_ram_conforms() {
    conformance(
        || {
            let mut devs = Devices::new();
            devs.ram("origin", DEV_SECTORS);
            devs.ram("cache", CACHE_BYTES / 512);
            Fixture::plain(mapped(&devs, "wc", &wc_line()))
        },
        Expect {
            lbs: 4096,
            ..Expect::data("writecache over ram", wc_caps())
        },
    );
}

#[test]
fn writecache_over_file_conforms() {
    conformance(
        || {
            let (origin, of) = file_dev("origin", DEV_BYTES, FileOpts::default());
            let (cache, cf) = file_dev("cache", CACHE_BYTES, FileOpts::default());
            let mut devs = Devices::new();
            devs.add(origin);
            devs.add(cache);
            Fixture {
                keep: vec![of, cf],
                ..Fixture::plain(mapped(&devs, "wc", &wc_line()))
            }
        },
        Expect {
            lbs: 4096,
            ..Expect::data("writecache over file", wc_caps() | Caps::PERSISTENT)
        },
    );
}

#[test]
fn writecache_over_powercut_conforms() {
    conformance(
        || {
            let power = Power::new();
            let origin = powercut("origin", DEV_BYTES, &power);
            let cache = powercut("cache", CACHE_BYTES, &power);
            let mut devs = Devices::new();
            devs.add(origin.clone());
            devs.add(cache.clone());
            let dev = mapped(&devs, "wc", &wc_line());
            Fixture {
                power: Some(PowerRig {
                    power,
                    cuts: vec![origin, cache],
                    reopen: Box::new(move || mapped(&devs, "wc", &wc_line())),
                    loses_unflushed: false,
                }),
                ..Fixture::plain(dev)
            }
        },
        Expect {
            lbs: 4096,
            ..Expect::data("writecache over powercut", wc_caps())
        },
    );
}

fn raid1_line() -> String {
    format!("0 {DEV_SECTORS} raid raid1 3 0 region_size 1024 2 m0 d0 m1 d1")
}

/// raid1 over two ram legs with metadata (a new array: the initial resync
/// runs under the checks).
#[test]
fn raid1_over_ram_conforms() {
    conformance(
        || {
            let mut devs = Devices::new();
            for n in ["m0", "m1"] {
                devs.ram(n, 64);
            }
            for n in ["d0", "d1"] {
                devs.ram(n, DEV_SECTORS);
            }
            Fixture::plain(mapped(&devs, "raid", &raid1_line()))
        },
        Expect::data("raid1 over ram", ram_caps()),
    );
}

/// raid1 whose four devices lose power together.
#[test]
fn raid1_over_powercut_conforms() {
    conformance(
        || {
            let power = Power::new();
            let cuts: Vec<Arc<PowerCut>> = [
                ("m0", 64 * 512),
                ("d0", DEV_BYTES),
                ("m1", 64 * 512),
                ("d1", DEV_BYTES),
            ]
            .iter()
            .map(|(n, b)| powercut(n, *b, &power))
            .collect();
            let mut devs = Devices::new();
            for c in &cuts {
                devs.add(c.clone());
            }
            let dev = mapped(&devs, "raid", &raid1_line());
            Fixture {
                power: Some(PowerRig {
                    power,
                    cuts,
                    reopen: Box::new(move || mapped(&devs, "raid", &raid1_line())),
                    loses_unflushed: false,
                }),
                ..Fixture::plain(dev)
            }
        },
        Expect::data("raid1 over powercut", ram_caps()),
    );
}

// ---------------------------------------------------------------------------
// Read-only devices.

#[test]
fn linear_over_a_read_only_file_refuses_writes_and_reads_data() {
    use udm_core::{BioFlags, Op, ReactorConfig, Status};
    let f = TempFile::new("lin-ro");
    let data = harness::pattern(7, 0, 64 << 10);
    std::fs::write(&f.path, &data).unwrap();
    let opts = FileOpts {
        read_only: true,
        ..FileOpts::default()
    };
    let mut devs = Devices::new();
    devs.add(Arc::new(FileDevice::open("ro", &f.path, opts).unwrap()));
    let dev = mapped(&devs, "lin-ro", "0 128 linear ro 0");
    assert!(dev.caps().contains(Caps::READ_ONLY), "{:?}", dev.caps());
    let h = Harness::new(
        "linear over ro file",
        Fixture::plain(dev),
        ReactorConfig::default(),
    );
    let (st, got) = h.read(0, 64 << 10);
    assert_eq!(st, Status::Ok);
    assert_same("linear over ro file", "read", 0, &got, &data);
    assert_eq!(h.write(0, &[0u8; 512]), Status::Inval, "write");
    assert_eq!(
        h.write_flags(8, &[0u8; 4096], BioFlags::FUA),
        Status::Inval,
        "FUA write"
    );
    for op in [Op::Discard, Op::WriteZeroes] {
        assert_eq!(
            h.dataless(op, BioFlags::NONE, 0, 512),
            Status::Inval,
            "{}",
            op.name()
        );
    }
    assert_eq!(h.dataless(Op::Flush, BioFlags::NONE, 0, 0), Status::Ok);
    drop(h);
    assert_eq!(std::fs::read(&f.path).unwrap(), data, "the file changed");
}

// ---------------------------------------------------------------------------
// Thin volumes.

/// A pool over ram (64 KiB blocks, room for four volumes' worth) with
/// device 0 created; the pool device is added to `devs` as "pool".
fn thin_pool(devs: &mut Devices) -> Arc<udm_mapper::MappedDevice> {
    devs.ram("meta", 8192);
    devs.ram("data", 4 * DEV_SECTORS);
    let pool = devs.mapped(
        "pool",
        &format!("0 {} thin-pool meta data 128 0", 4 * DEV_SECTORS),
    );
    pool.message(0, &["create_thin", "0"]).unwrap();
    devs.add(common::as_dev(&pool));
    pool
}

/// Writes zeroes over the whole of `dev` (every block provisioned).
fn provision(dev: &Arc<dyn BlockDevice>) {
    let t = common::Tester::new();
    let chunk = 1 << 20;
    for off in (0..DEV_BYTES).step_by(chunk) {
        t.write(dev, off / 512, vec![0u8; chunk]);
    }
}

/// A fresh thin volume: every block is provisioned by the checks' writes.
#[test]
fn thin_fresh_conforms() {
    conformance(
        || {
            let mut devs = Devices::new();
            thin_pool(&mut devs);
            Fixture::plain(mapped(
                &devs,
                "thin",
                &format!("0 {DEV_SECTORS} thin pool 0"),
            ))
        },
        Expect {
            // Only whole 64 KiB blocks are unmapped by a discard.
            discard_zeroes: false,
            ..Expect::data("thin (fresh)", wc_caps())
        },
    );
}

/// A thin volume whose every block is provisioned: the fast path.
#[test]
fn thin_provisioned_conforms() {
    conformance(
        || {
            let mut devs = Devices::new();
            thin_pool(&mut devs);
            let dev = mapped(&devs, "thin", &format!("0 {DEV_SECTORS} thin pool 0"));
            provision(&dev);
            Fixture::plain(dev)
        },
        Expect {
            discard_zeroes: false,
            ..Expect::data("thin (provisioned)", wc_caps())
        },
    );
}

/// A snapshot of a provisioned volume: every write breaks sharing.
#[test]
fn thin_snapshot_conforms() {
    conformance(
        || {
            let mut devs = Devices::new();
            let pool = thin_pool(&mut devs);
            let origin = mapped(&devs, "origin", &format!("0 {DEV_SECTORS} thin pool 0"));
            provision(&origin);
            pool.message(0, &["create_snap", "1", "0"]).unwrap();
            Fixture::plain(mapped(
                &devs,
                "snap",
                &format!("0 {DEV_SECTORS} thin pool 1"),
            ))
        },
        Expect {
            discard_zeroes: false,
            ..Expect::data("thin (snapshot)", wc_caps())
        },
    );
}

/// A volume over an external origin (never written, so zeroes): reads of
/// unprovisioned blocks go to the origin, partial writes copy from it.
#[test]
fn thin_external_origin_conforms() {
    conformance(
        || {
            let mut devs = Devices::new();
            thin_pool(&mut devs);
            devs.ram("base", DEV_SECTORS);
            Fixture::plain(mapped(
                &devs,
                "thin",
                &format!("0 {DEV_SECTORS} thin pool 0 base"),
            ))
        },
        Expect {
            discard_zeroes: false,
            ..Expect::data("thin (external origin)", wc_caps())
        },
    );
}
