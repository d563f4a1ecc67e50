//! `crypt`: transparent encryption, sector for sector dm-crypt's.
//!
//! Table line (dm-crypt's syntax):
//!
//! ```text
//! <start> <length> crypt <cipher> <key> <iv_offset> <dev> <offset> [<#opt_params> <opt_params>...]
//! ```
//!
//! - `cipher`: `<cipher>-<chainmode>-<ivmode>` or the crypto-API form
//!   `capi:<chainmode>(<cipher>)-<ivmode>`; here the cipher is `aes`, the
//!   chain mode `xts` or `cbc`, the IV mode `plain64`, `plain` or
//!   `essiv:sha256` (e.g. `aes-xts-plain64`, `capi:xts(aes)-plain64`,
//!   `aes-cbc-essiv:sha256`);
//! - `key`: the key in hex (XTS: 256, 384 or 512 bits, two AES keys; CBC:
//!   128, 192 or 256 bits), or `:<key_size>:<user|logon>:<description>`
//!   from the kernel keyring (see `key.rs`);
//! - `iv_offset`: added to the sector number (in 512-byte sectors) that
//!   makes each sector's IV;
//! - `dev`, `offset`: where the ciphertext lies, as `linear`;
//! - options (`#opt_params` counts them):
//!   - `allow_discards`: pass discards down (off by default: a discard
//!     shows which areas are unused);
//!   - `sector_size:<bytes>`: the encryption unit, a power of two from 512
//!     to 4096; it becomes the device's logical block size, and the table
//!     line's start and length must be multiples of it;
//!   - `iv_large_sectors`: IVs count sectors of `sector_size`, not of 512
//!     bytes (what cryptsetup sets for LUKS2 with 4 KiB sectors);
//!   - `same_cpu_crypt`, `submit_from_crypt_cpus`, `no_read_workqueue`,
//!     `no_write_workqueue`: accepted and shown in the table line, and
//!     change nothing: they tune where dm-crypt's workqueues run, and udm
//!     has none. Every I/O is encrypted (a write, before it goes down) or
//!     decrypted (a read, as it completes) on the reactor thread that
//!     serves it, which is what the four of them ask for together.
//!
//! What is written, for the same key, sector size and IV mode, is what
//! dm-crypt writes: sector n of the target (its IV number n + iv_offset,
//! divided by sector_size/512 with `iv_large_sectors`) is encrypted alone.
//!
//! Status: `dmsetup status` prints nothing for crypt; the table line is
//! dm's, but a key given in hex is printed as `-` unless keys are asked for
//! ([`crate::Table::table_lines_with_keys`], `udm table --show-keys`), so
//! that keys stay out of listings, configuration dumps and logs. A key from
//! the keyring is printed by name, as dm does.
//!
//! The data path: when the device gives access to its memory
//! ([`udm_core::Channel::direct_access`], a RAM disk), `map` decrypts a
//! read from there straight into the caller's buffer and encrypts a write
//! from the caller's buffer straight into it, and completes the bio: one
//! pass over the data, no bio down, no buffer of the target's. Otherwise a
//! read is remapped and goes down into the caller's buffer, under a
//! completion frame of the target's (`read_done`, with the read's sector
//! as its context), which decrypts it there in place; and a write is
//! encrypted into a bounce buffer (`bounce.rs`, a pool per reactor) which
//! goes down in its place in a descriptor of its own. The caller's buffer
//! of a write is never changed. So crypt needs no per-I/O data and no
//! clone of the caller's bio: it takes the mapper's no-clone path, whose
//! completion frame keeps the table alive while the bio is in flight. The
//! cipher is in `cipher.rs`, the key and the memory that keeps it secret
//! in `key.rs`.

mod bounce;
pub mod cipher;
#[cfg(target_arch = "x86_64")]
mod xts_vaes;
/// Elsewhere than x86_64 there is no VAES: XTS is always the portable path.
#[cfg(not(target_arch = "x86_64"))]
mod xts_vaes {
    /// No value: [`XtsVaes::new`] never makes one.
    pub enum XtsVaes {}
    impl XtsVaes {
        pub fn new(_: &[u8], _: &[u8]) -> Option<XtsVaes> {
            None
        }
        pub fn units_to(
            &self,
            _: super::cipher::Dir,
            _: usize,
            _: impl FnMut(usize) -> [u8; 16],
            _: &[u8],
            _: &mut [u8],
            _: super::cipher::Stores,
        ) {
            match *self {}
        }
        pub fn units(
            &self,
            _: super::cipher::Dir,
            _: usize,
            _: impl FnMut(usize) -> [u8; 16],
            _: &mut [u8],
        ) {
            match *self {}
        }
    }
}
pub mod key;

use std::ptr::NonNull;

use udm_core::{Bio, BioPtr, Caps, Error, Limits, Op, Status, SECTOR_SHIFT};

use crate::target::{parse_sector, CtrCtx, DevArea, Map, MapCtx, StatusType, Target, TargetType};
use bounce::Bounce;
use cipher::{Cipher, CipherSpec, Dir, Stores};
use key::{Key, Secret};

/// The `crypt` target type.
pub const CRYPT: TargetType = TargetType {
    name: "crypt",
    version: [1, 27, 0],
    summary: "encrypts the range onto another device, as dm-crypt",
    usage: "<cipher> <key> <iv_offset> <dev> <offset> [<#opt_params> <opt_params>...]",
    min_args: 5,
    max_args: None,
    splits: true,
    exclusive_args: &[],
    ctr: crypt_ctr,
};

/// I/O is split at this many sectors (1 MiB, the largest bounce buffer).
pub const MAX_IO_SECTORS: u64 = (bounce::MAX_BOUNCE >> SECTOR_SHIFT) as u64;

/// The options, as parsed (and printed back in dm's order).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Opts {
    allow_discards: bool,
    same_cpu_crypt: bool,
    submit_from_crypt_cpus: bool,
    no_read_workqueue: bool,
    no_write_workqueue: bool,
    /// Bytes per encryption unit.
    sector_size: u32,
    iv_large_sectors: bool,
}

struct Crypt {
    devs: [DevArea; 1],
    spec: CipherSpec,
    key: Key,
    cipher: Secret<Cipher>,
    iv_offset: u64,
    opts: Opts,
    /// log2 of sector_size / 512.
    shift: u32,
    /// How writes are encrypted into the device's memory: streamed when
    /// the target is at least twice the last-level cache, so a random write's
    /// page is rarely in the caches and rarely read back from them, and a
    /// cached store would first read its line in from memory (4 KiB random
    /// writes over 64 MiB-1 GiB: 1.1-1.35x; a device that fits in the
    /// cache keeps its pages there: 0.65-0.75x streamed at 8 MiB).
    write_stores: Stores,
}

/// The last-level cache's size in bytes (32 MiB where sysfs says
/// nothing).
fn llc_bytes() -> u64 {
    udm_core::affinity::last_level_cache().unwrap_or(32 << 20)
}

fn bad(m: impl std::fmt::Display) -> Error {
    Error::invalid(format!("crypt: {m}"))
}

fn crypt_ctr(ctx: &CtrCtx<'_>, argv: &[&str]) -> Result<Box<dyn Target>, Error> {
    // At least five arguments: the core checked the count (CRYPT.min_args).
    let spec = CipherSpec::parse(argv[0]).map_err(bad)?;
    let key = Key::parse(argv[1]).map_err(bad)?;
    let iv_offset = argv[2].parse::<u64>().map_err(|_| {
        bad(format!(
            "invalid iv_offset '{}': expected a number",
            argv[2]
        ))
    })?;
    let start = parse_sector("device sector", argv[4]).map_err(bad)?;
    let opts = parse_opts(&argv[5..])?;
    let shift = (opts.sector_size >> SECTOR_SHIFT).trailing_zeros();
    let unit = 1u64 << shift;
    if !ctx.len.is_multiple_of(unit) || !ctx.begin.is_multiple_of(unit) {
        return Err(bad(format!(
            "the target ({} sectors at {}) is not a multiple of sector_size {}",
            ctx.len, ctx.begin, opts.sector_size
        )));
    }
    let cipher = Secret::new(Cipher::new(&spec, key.bytes()).map_err(bad)?)?;
    let dev = ctx.get_device(argv[3]).map_err(|e| e.context("crypt"))?;
    Ok(Box::new(Crypt {
        devs: [DevArea {
            dev,
            start,
            len: ctx.len,
        }],
        spec,
        key,
        cipher,
        iv_offset,
        opts,
        shift,
        write_stores: if ctx.len << SECTOR_SHIFT >= 2 * llc_bytes() {
            Stores::Streamed
        } else {
            Stores::Cached
        },
    }))
}

fn parse_opts(args: &[&str]) -> Result<Opts, Error> {
    let mut o = Opts {
        sector_size: 512,
        ..Opts::default()
    };
    let Some((n, rest)) = args.split_first() else {
        return Ok(o);
    };
    let n: usize = n
        .parse()
        .map_err(|_| bad(format!("invalid number of optional parameters '{n}'")))?;
    if n != rest.len() {
        return Err(bad(format!(
            "number of optional parameters is {n} but {} follow",
            rest.len()
        )));
    }
    for &a in rest {
        match a {
            "allow_discards" => o.allow_discards = true,
            "same_cpu_crypt" => o.same_cpu_crypt = true,
            "submit_from_crypt_cpus" => o.submit_from_crypt_cpus = true,
            "no_read_workqueue" => o.no_read_workqueue = true,
            "no_write_workqueue" => o.no_write_workqueue = true,
            "iv_large_sectors" => o.iv_large_sectors = true,
            _ => {
                if let Some(v) = a.strip_prefix("sector_size:") {
                    o.sector_size = v
                        .parse::<u32>()
                        .ok()
                        .filter(|s| s.is_power_of_two() && (512..=4096).contains(s))
                        .ok_or_else(|| {
                            bad(format!(
                                "invalid sector_size '{v}': expected a power of two from 512 to 4096"
                            ))
                        })?;
                } else if a.starts_with("integrity:") {
                    return Err(bad(format!(
                        "'{a}': authenticated encryption (dm-integrity) is not supported"
                    )));
                } else {
                    return Err(bad(format!("unknown optional parameter '{a}'")));
                }
            }
        }
    }
    Ok(o)
}

impl Crypt {
    /// The IV number of the unit at target-relative 512-byte sector `rel`.
    #[inline]
    fn iv_number(&self, rel: u64) -> u64 {
        let n = rel.wrapping_add(self.iv_offset);
        if self.opts.iv_large_sectors {
            n >> self.shift
        } else {
            n
        }
    }

    /// Encrypts a write: straight into the device's memory when it gives
    /// access to it ([`udm_core::Channel::direct_access`], a RAM disk), so
    /// the data is passed over once and no bio goes down; else into a
    /// bounce buffer which goes down in its place.
    fn write(&self, bio: BioPtr, ctx: &MapCtx<'_>) -> Map {
        let len = bio.len() as usize;
        if len > bounce::MAX_BOUNCE {
            // Split at MAX_IO_SECTORS by the core; never larger.
            return Map::Kill(bio, Status::Inval);
        }
        let dev_sector = bio.sector + self.devs[0].start;
        if let Some(p) = ctx.devs[0].direct_access(dev_sector, len, true) {
            // SAFETY: the device's memory for these `len` bytes, valid while
            // the device lives (the channel keeps it); only I/O overlapping
            // this write touches it meanwhile (direct_access's contract),
            // and it is not the caller's buffer.
            let dst = unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), len) };
            self.encrypt_into(&bio, dst, self.write_stores);
            bio.complete(Status::Ok);
            return Map::Submitted;
        }
        let b = bounce::take(len);
        // SAFETY: the buffer from `take` holds at least `len` bytes and is
        // ours until given back in `write_done`.
        let dst = unsafe { std::slice::from_raw_parts_mut(b.ptr.as_ptr(), len) };
        // The bounce buffers are few and reused: they stay cached.
        self.encrypt_into(&bio, dst, Stores::Cached);
        self.submit_write(bio, b, len, ctx)
    }

    /// The IV number of unit `i` of an I/O at target-relative sector `rel`.
    #[inline]
    fn unit_iv(&self, rel: u64, i: usize) -> u64 {
        self.iv_number(rel + ((i as u64) << self.shift))
    }

    /// Encrypts the write `bio`'s data into `dst` (its length): the units
    /// inside each segment in one call, from there, a unit that straddles
    /// segments from a copy in `dst`, with `stores`.
    fn encrypt_into(&self, bio: &Bio, dst: &mut [u8], stores: Stores) {
        let unit = self.opts.sector_size as usize;
        let rel = bio.sector;
        runs(bio, unit, |off, p, len| match p {
            Some(p) => {
                // SAFETY: a run of the caller's segment (`runs`), readable
                // until the bio completes (add_seg's contract), and not
                // `dst`.
                let src = unsafe { std::slice::from_raw_parts(p, len) };
                let first = off / unit;
                let n = |i| self.unit_iv(rel, first + i);
                let d = &mut dst[off..off + len];
                self.cipher.units_to(Dir::Encrypt, unit, n, src, d, stores);
            }
            None => {
                let d = &mut dst[off..off + unit];
                bio.copy_out(off, d);
                self.cipher.encrypt(self.unit_iv(rel, off / unit), d);
            }
        });
    }

    /// Decrypts a read from `src` (the device's memory, the bio's length)
    /// into the caller's buffers: the units inside each segment in one
    /// call, a unit that straddles segments through a copy on the stack.
    fn decrypt_from(&self, bio: &Bio, rel: u64, src: &[u8]) {
        let unit = self.opts.sector_size as usize;
        runs(bio, unit, |off, p, len| match p {
            Some(p) => {
                // SAFETY: a run of the caller's segment (`runs`), writable
                // until the bio completes (add_seg's contract), and not the
                // device's memory.
                let dst = unsafe { std::slice::from_raw_parts_mut(p, len) };
                let first = off / unit;
                let n = |i| self.unit_iv(rel, first + i);
                self.cipher.units_to(
                    Dir::Decrypt,
                    unit,
                    n,
                    &src[off..off + len],
                    dst,
                    Stores::Cached,
                );
            }
            None => {
                // Here only, not per call: zeroing it costs a pass.
                let mut tmp = [0u8; 4096];
                let t = &mut tmp[..unit];
                let n = self.unit_iv(rel, off / unit);
                self.cipher
                    .sector_to(Dir::Decrypt, n, &src[off..off + unit], t);
                bio.copy_in(off, t);
                zeroize::Zeroize::zeroize(&mut tmp);
            }
        });
    }

    /// Sends the bounce buffer `b`, `len` bytes encrypted, down in a clone
    /// of the write `bio`.
    fn submit_write(&self, bio: BioPtr, b: Bounce, len: usize, ctx: &MapCtx<'_>) -> Map {
        let rel = bio.sector;
        let mut w = bio.alloc_clone();
        w.sector = rel + self.devs[0].start;
        // SAFETY: the buffer stays ours (not reused, not freed) until
        // `write_done` runs, after the device completed `w`.
        unsafe { w.add_seg(b.ptr.as_ptr(), len) };
        w.per_io[0] = b.class as u64;
        w.set_end_io(write_done, bio.into_raw().cast());
        ctx.devs[0].submit(w);
        Map::Submitted
    }

    /// Decrypts a completed read in the caller's buffers: the units inside
    /// each segment in one call, where they are, a unit that straddles
    /// segments (a caller's odd iovec) through a copy on the stack.
    fn decrypt(&self, bio: &Bio, rel: u64) {
        let unit = self.opts.sector_size as usize;
        runs(bio, unit, |off, p, len| match p {
            Some(p) => {
                // SAFETY: a run of the caller's segment (`runs`), writable
                // until the bio completes (add_seg's contract).
                let data = unsafe { std::slice::from_raw_parts_mut(p, len) };
                let first = off / unit;
                let n = |i| self.unit_iv(rel, first + i);
                self.cipher.units(Dir::Decrypt, unit, n, data);
            }
            None => {
                let mut tmp = [0u8; 4096];
                let t = &mut tmp[..unit];
                bio.copy_out(off, t);
                self.cipher.decrypt(self.unit_iv(rel, off / unit), t);
                bio.copy_in(off, t);
                zeroize::Zeroize::zeroize(&mut tmp);
            }
        });
    }
}

/// Walks `bio`'s data a unit at a time, in runs: `f(off, Some(p), len)`
/// for each run of whole units that lie in one segment (`len` bytes at
/// `p`, bytes `off..off + len` of the bio), `f(off, None, unit)` for each
/// unit that straddles segments (bytes `off..off + unit` of the bio). The
/// runs and units follow each other and cover the bio's whole units; a
/// one-segment bio is one run. Batching a segment's units into one call
/// keeps the cipher's per-call work (round keys, the tweaks' encryption,
/// 4 units at a time) off each 512-byte unit of a merged bio.
#[inline]
fn runs(bio: &Bio, unit: usize, mut f: impl FnMut(usize, Option<*mut u8>, usize)) {
    let total = bio.len() as usize / unit * unit;
    let mut off = 0;
    let mut seg_start = 0;
    for s in bio.segs() {
        let seg_end = seg_start + s.len;
        if off < seg_end {
            let whole = (seg_end - off) / unit * unit;
            if whole > 0 {
                // In bounds: off - seg_start + whole <= s.len.
                f(off, Some(s.base.wrapping_add(off - seg_start)), whole);
                off += whole;
            }
            if off < seg_end && off + unit <= total {
                f(off, None, unit);
                off += unit;
            }
        }
        seg_start = seg_end;
    }
}

/// A read that went down completed: decrypted in the caller's buffers
/// when it succeeded, then completed as the frame below says.
fn read_done(mut bio: BioPtr) {
    // SAFETY: the private of the frame pushed in `map` is the Crypt target,
    // kept alive by its table while I/O is in flight.
    let crypt = unsafe { &*(bio.private() as *const Crypt) };
    if bio.status().is_ok() {
        crypt.decrypt(&bio, bio.ctx());
    }
    bio.pop_end_io();
    bio.endio();
}

/// A bounce write completed: the buffer goes back to the pool and the
/// clone it stood in for completes with its status.
fn write_done(w: BioPtr) {
    let status = w.status();
    let b = Bounce {
        // A one-segment bio from `write`; the device does not move a
        // write's segment.
        ptr: NonNull::new(w.segs()[0].base).unwrap_or(NonNull::dangling()),
        class: w.per_io[0] as u8,
    };
    // SAFETY: `private` is the bio given up with into_raw in `write`, taken
    // back only here, once.
    let mut bio = unsafe { BioPtr::from_raw(w.private().cast()) };
    drop(w);
    bounce::give(b);
    bio.set_status(status);
    bio.endio();
}

impl Target for Crypt {
    fn map(&self, mut bio: BioPtr, ctx: &MapCtx<'_>) -> Map {
        match bio.op {
            Op::Read => {
                let len = bio.len() as usize;
                let dev_sector = bio.sector + self.devs[0].start;
                if let Some(p) = ctx.devs[0].direct_access(dev_sector, len, false) {
                    // SAFETY: the device's memory for these `len` bytes,
                    // valid while the device lives (the channel keeps it);
                    // only I/O overlapping this read writes it meanwhile
                    // (direct_access's contract).
                    let src = unsafe { std::slice::from_raw_parts(p.as_ptr(), len) };
                    let rel = bio.sector;
                    self.decrypt_from(&bio, rel, src);
                    bio.complete(Status::Ok);
                    return Map::Submitted;
                }
                let rel = bio.sector;
                let mut bio = bio.make_room();
                // The frame's private is this target, which the table keeps
                // alive while its I/O is in flight. make_room left a free
                // frame, so the push cannot fail.
                let me = self as *const Crypt as *mut ();
                let _ = bio.push_end_io_ctx(read_done, me, rel);
                bio.sector = rel + self.devs[0].start;
                Map::Remapped(bio, 0)
            }
            Op::Write => self.write(bio, ctx),
            Op::Discard if self.opts.allow_discards => {
                bio.sector += self.devs[0].start;
                Map::Remapped(bio, 0)
            }
            _ => Map::Kill(bio, Status::NotSupp),
        }
    }

    fn devices(&self) -> &[DevArea] {
        &self.devs
    }

    fn status(&self, ty: StatusType, out: &mut String) {
        if ty == StatusType::Table {
            self.table_line(false, out);
        }
    }

    fn table_with_secrets(&self, out: &mut String) {
        self.table_line(true, out);
    }

    fn no_clone(&self) -> bool {
        true
    }

    fn max_io_len(&self) -> u64 {
        MAX_IO_SECTORS
    }

    fn caps(&self, stacked: Caps) -> Caps {
        let mut c = stacked;
        // Zeroes written below would not read back as zeroes.
        c.remove(Caps::WRITE_ZEROES);
        if !self.opts.allow_discards {
            c.remove(Caps::DISCARD);
        }
        c
    }

    fn io_hints(&self, limits: &mut Limits) {
        let ss = self.opts.sector_size;
        limits.logical_block_size = limits.logical_block_size.max(ss);
        limits.physical_block_size = limits.physical_block_size.max(ss);
    }
}

impl Crypt {
    fn table_line(&self, show_key: bool, out: &mut String) {
        use std::fmt::Write as _;
        out.push_str(&self.spec.text);
        out.push(' ');
        self.key.write_table(show_key, out);
        let _ = write!(
            out,
            " {} {} {}",
            self.iv_offset,
            self.devs[0].dev.name(),
            self.devs[0].start
        );
        let o = &self.opts;
        let mut v: Vec<String> = [
            (o.allow_discards, "allow_discards"),
            (o.same_cpu_crypt, "same_cpu_crypt"),
            (o.submit_from_crypt_cpus, "submit_from_crypt_cpus"),
            (o.no_read_workqueue, "no_read_workqueue"),
            (o.no_write_workqueue, "no_write_workqueue"),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, n)| n.to_string())
        .collect();
        if o.sector_size != 512 {
            v.push(format!("sector_size:{}", o.sector_size));
        }
        if o.iv_large_sectors {
            v.push("iv_large_sectors".into());
        }
        if !v.is_empty() {
            let _ = write!(out, " {} {}", v.len(), v.join(" "));
        }
    }
}
