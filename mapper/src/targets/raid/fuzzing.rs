//! raid1 arrays assembled from arbitrary metadata (for
//! [`crate::fuzzing::raid_meta`]): the bytes give the table line and, for
//! each leg, what its metadata device holds (a superblock in the on-disk
//! layout, sealed with a valid checksum unless the input says not, and the
//! first bytes of the bitmap); the array is built through the table's
//! constructor, as a real table is, then taken live for a few writes and
//! reads.
//!
//! Layout of the input (missing bytes read as zero, so a short input is a
//! valid array of fresh-looking legs):
//!
//! - 6 header bytes:
//!   - `h0`: bit 0 the number of legs (2 or 3); bit 1 metadata devices too
//!     small (4 KiB); bit 2 the last data leg 8 sectors longer than the
//!     others; bit 3 every data leg 64 sectors longer than the array;
//!     bits 4-6 a message after the I/O (none, `idle`, `frozen`, `resync`,
//!     `recover`, `check`, `repair`, an unknown one);
//!   - `h1`: bits 0-2 `region_size` (none, 8, 32, 128, 512, 2048, 8192,
//!     or the invalid 12); bits 3-4 none, `nosync`, `sync`, both; bit 5
//!     `rebuild`; bit 6 `write_mostly`; bit 7 `daemon_sleep 1`;
//!   - `h2`: bits 0-1 the `rebuild` leg, bits 2-3 the `write_mostly` leg
//!     (3, or 2 of two legs, names no leg);
//!   - `h3`: the array's length, `128 * (1 + h3 % 16)` sectors (at most
//!     1 MiB);
//!   - `h4`: bits 0-1 how many writes (each read back); bit 2 the array
//!     is never taken live (built and dropped); bit 3 a discard too; bits
//!     4-7 where the I/O goes;
//!   - `h5`: the array's identity (16 bytes of it).
//! - Then per leg: a mode byte, the superblock's first [`SB_FIELDS`] bytes
//!   (as on disk: magic, version, legs, identity, role, region shift,
//!   length, events, failed, recovering, checkpoint), a count and that
//!   many bytes of bitmap. The mode's bits 0-2 ([`kind`]):
//!   0 and 1 a superblock of this array (magic, version, legs, role, region
//!   shift, length and identity as the table and `h5` say; events, masks
//!   and checkpoint as the input does; sealed), except the fields that
//!   bits 3-7 keep as the input gives them (identity, role, legs, region
//!   shift, length); 2 every field as given, magic and version set,
//!   sealed; 3 the version too as given, sealed; 4 no superblock (a blank
//!   leg); 5 the bytes as given, not sealed; 6 no metadata device (`-`); 7
//!   a metadata device whose every I/O fails.

use std::any::Any;
use std::cell::Cell;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use udm_core::{
    check_bio, BioPtr, BlockDevice, Caps, Channel, Error, Limits, Op, Reactor, ReactorConfig,
    Status, SECTOR_SHIFT,
};

use super::default_region_size;
use super::metadata::{meta_bytes, seal, BITMAP_OFFSET, MAGIC, SB_BYTES, VERSION};
use crate::device::MappedDevice;
use crate::table::{Registry, Table};

/// Bytes of the header.
const HEADER: usize = 6;
/// Bytes of a superblock an input gives (its fields; the rest is zero).
pub const SB_FIELDS: usize = 80;
/// Longest an I/O may take before the harness calls it a hang.
const HANG: Duration = Duration::from_secs(10);

/// What a leg's mode byte makes of its metadata device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A superblock of this array, sealed (fields the mode's bits 3-7
    /// name as the input gives them).
    Matching,
    /// Every field as given, with magic and version, sealed.
    Sealed,
    /// Magic set, version and fields as given, sealed.
    AnyVersion,
    /// No superblock: a blank leg (the bitmap bytes still written).
    Blank,
    /// The bytes as given, not sealed.
    Raw,
    /// No metadata device (`-`).
    NoMeta,
    /// A metadata device every I/O to which fails.
    Broken,
}

/// The kind a mode byte selects (bits 0-2).
pub fn kind(mode: u8) -> Kind {
    match mode & 7 {
        0 | 1 => Kind::Matching,
        2 => Kind::Sealed,
        3 => Kind::AnyVersion,
        4 => Kind::Blank,
        5 => Kind::Raw,
        6 => Kind::NoMeta,
        _ => Kind::Broken,
    }
}

/// Reads the input front to back; past its end, zeroes.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }

    /// Up to `n` bytes (fewer where the input ends).
    fn take(&mut self, n: usize) -> &[u8] {
        let (a, b) = self.0.split_at(n.min(self.0.len()));
        self.0 = b;
        a
    }
}

/// A RAM disk whose I/O completes at once (or fails, if `broken`).
struct Disk {
    name: String,
    sectors: u64,
    data: Mutex<Vec<u8>>,
    broken: bool,
}

impl Disk {
    fn new(name: String, bytes: Vec<u8>, broken: bool) -> Arc<Disk> {
        Arc::new(Disk {
            name,
            sectors: bytes.len() as u64 >> SECTOR_SHIFT,
            data: Mutex::new(bytes),
            broken,
        })
    }
}

struct DiskChannel(Arc<Disk>);

impl BlockDevice for Disk {
    fn name(&self) -> &str {
        &self.name
    }
    fn limits(&self) -> Limits {
        Limits::new(self.sectors)
    }
    fn caps(&self) -> Caps {
        Caps::FLUSH | Caps::FUA | Caps::DISCARD | Caps::WRITE_ZEROES
    }
    fn open(self: Arc<Self>, _: &Reactor) -> Result<Rc<dyn Channel>, Error> {
        Ok(Rc::new(DiskChannel(self)))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Channel for DiskChannel {
    fn submit(&self, bio: BioPtr) {
        let d = &*self.0;
        let Some(bio) = check_bio(bio, &d.limits(), d.caps()) else {
            return;
        };
        if d.broken {
            return bio.complete(Status::IoErr);
        }
        let off = (bio.sector << SECTOR_SHIFT) as usize;
        let len = bio.len() as usize;
        let mut data = d.data.lock().unwrap_or_else(|p| p.into_inner());
        // check_bio kept the range inside the device.
        let Some(range) = data.get_mut(off..off + len) else {
            drop(data);
            return bio.complete(Status::Inval);
        };
        match bio.op {
            Op::Read => bio.copy_in(0, range),
            Op::Write => bio.copy_out(0, range),
            Op::Discard | Op::WriteZeroes => range.fill(0),
            Op::Flush => {}
        }
        drop(data);
        bio.complete(Status::Ok);
    }
}

/// The metadata device image of a leg (`mode`, the superblock's fields as
/// given, the bitmap's first bytes), `bytes` long; `array` gives what a
/// matching superblock says: (legs, role, region shift, length, identity).
fn meta_image(
    mode: u8,
    fields: &[u8],
    bitmap: &[u8],
    bytes: usize,
    array: (u32, u32, u32, u64, [u8; 16]),
) -> Vec<u8> {
    let mut img = vec![0u8; bytes];
    let mut sb = [0u8; SB_BYTES];
    sb[..fields.len()].copy_from_slice(fields);
    let (legs, role, shift, len, uuid) = array;
    let k = kind(mode);
    if matches!(k, Kind::Matching | Kind::Sealed | Kind::AnyVersion) {
        sb[0..8].copy_from_slice(&MAGIC.to_le_bytes());
    }
    if matches!(k, Kind::Matching | Kind::Sealed) {
        sb[8..12].copy_from_slice(&VERSION.to_le_bytes());
    }
    if k == Kind::Matching {
        let keep = |bit: u8| mode & (1 << bit) != 0;
        if !keep(3) {
            sb[16..32].copy_from_slice(&uuid);
        }
        if !keep(4) {
            sb[32..36].copy_from_slice(&role.to_le_bytes());
        }
        if !keep(5) {
            sb[12..16].copy_from_slice(&legs.to_le_bytes());
        }
        if !keep(6) {
            sb[36..40].copy_from_slice(&shift.to_le_bytes());
        }
        if !keep(7) {
            sb[40..48].copy_from_slice(&len.to_le_bytes());
        }
    }
    if matches!(k, Kind::Matching | Kind::Sealed | Kind::AnyVersion) {
        seal(&mut sb);
    }
    if k == Kind::Blank {
        // A blank leg holds no magic, whatever else it holds.
        sb[0..8].fill(0);
    }
    let n = SB_BYTES.min(img.len());
    img[..n].copy_from_slice(&sb[..n]);
    let at = BITMAP_OFFSET as usize;
    if let Some(room) = img.get_mut(at..) {
        let n = room.len().min(bitmap.len());
        room[..n].copy_from_slice(&bitmap[..n]);
    }
    img
}

/// Checks a status line of the array as dm-raid's:
/// `<start> <len> raid raid1 <#devs> <health> <synced>/<total> <action>
/// <mismatches> <data offset> <journal char>`.
fn check_status(line: &str, legs: usize, len: u64) {
    let f: Vec<&str> = line.split(' ').collect();
    assert_eq!(f.len(), 11, "status '{line}' has 11 fields");
    assert!(
        f[0] == "0" && f[1] == len.to_string() && f[2] == "raid" && f[3] == "raid1",
        "status '{line}': start, length, target, raid type"
    );
    assert_eq!(f[4], legs.to_string(), "status '{line}': #devs");
    assert!(
        f[5].len() == legs && f[5].chars().all(|c| matches!(c, 'A' | 'a' | 'D')),
        "status '{line}': a health char per leg"
    );
    let (synced, total) = f[6]
        .split_once('/')
        .and_then(|(s, t)| Some((s.parse::<u64>().ok()?, t.parse::<u64>().ok()?)))
        .unwrap_or_else(|| panic!("status '{line}': <synced>/<total>"));
    assert!(
        synced <= total && total == len,
        "status '{line}': synced <= total = length"
    );
    assert!(
        ["idle", "frozen", "resync", "recover", "check", "repair"].contains(&f[7]),
        "status '{line}': sync action"
    );
    assert!(f[8].parse::<u64>().is_ok(), "status '{line}': mismatches");
    assert_eq!(
        (f[9], f[10]),
        ("0", "-"),
        "status '{line}': offset, journal"
    );
}

fn io_done(bio: BioPtr) {
    // SAFETY: private is the Rc leaked by `run_io` for this bio, taken
    // back once, here.
    let slot = unsafe { Rc::from_raw(bio.private() as *const Cell<Option<Status>>) };
    slot.set(Some(bio.status()));
}

/// One I/O on `ch` to completion (`buf` its data), turning `r`; a hang is
/// a bug.
fn run_io(r: &Reactor, ch: &dyn Channel, op: Op, sector: u64, buf: &mut Vec<u8>) -> Status {
    let slot = Rc::new(Cell::new(None));
    let mut bio = r.alloc_bio();
    if op.has_data() {
        bio.op = op;
        bio.sector = sector;
        // SAFETY: `buf` is not touched until the completion ran (or is
        // leaked below if it never does).
        unsafe { bio.add_seg(buf.as_mut_ptr(), buf.len()) };
    } else {
        bio.set_dataless(op, sector, buf.len() as u32);
    }
    bio.set_end_io(io_done, Rc::into_raw(slot.clone()) as *mut ());
    ch.submit(bio);
    let t0 = Instant::now();
    while slot.get().is_none() {
        if r.poll_once() == 0 {
            std::thread::yield_now();
        }
        if t0.elapsed() > HANG {
            // The bio still points at the buffer.
            std::mem::forget(std::mem::take(buf));
            panic!("raid: a {} at {sector} did not complete", op.name());
        }
    }
    slot.get().unwrap_or(Status::IoErr)
}

/// Builds the array `data` describes (see the module docs) and checks the
/// contract: the table either fails with a one-line error or gives an
/// array whose status reads as dm-raid's, which then takes writes and
/// reads them back. Returns whether the array assembled.
pub fn load(data: &[u8]) -> bool {
    let mut input = Input(data);
    let h: [u8; HEADER] = std::array::from_fn(|_| input.byte());
    let legs = 2 + (h[0] & 1) as usize;
    let len = 128 * (1 + (h[3] % 16) as u64);
    let region = match h[1] & 7 {
        0 => None,
        7 => Some(12),
        k => Some(8u64 << (2 * (k - 1))),
    };
    let shift = region
        .filter(|r| r.is_power_of_two())
        .unwrap_or_else(|| default_region_size(len))
        .trailing_zeros();
    let nregions = len.div_ceil(1 << shift);
    let meta_len = if h[0] & 2 != 0 {
        4096
    } else {
        meta_bytes(nregions) as usize
    };
    let uuid = [h[5]; 16];
    let mut devs: Vec<Arc<dyn BlockDevice>> = Vec::new();
    let mut names = Vec::new();
    for i in 0..legs {
        let mode = input.byte();
        let fields = input.take(SB_FIELDS).to_vec();
        let n = input.byte() as usize;
        let bitmap = input.take(n).to_vec();
        match kind(mode) {
            Kind::NoMeta => names.push("-".to_string()),
            k => {
                let shape = (legs as u32, i as u32, shift, len, uuid);
                let img = meta_image(mode, &fields, &bitmap, meta_len, shape);
                let m = Disk::new(format!("m{i}"), img, k == Kind::Broken);
                names.push(m.name.clone());
                devs.push(m);
            }
        }
        let mut sectors = len;
        if h[0] & 8 != 0 {
            sectors += 64;
        }
        if h[0] & 4 != 0 && i + 1 == legs {
            sectors += 8;
        }
        let d = Disk::new(
            format!("d{i}"),
            vec![0; (sectors << SECTOR_SHIFT) as usize],
            false,
        );
        names.push(d.name.clone());
        devs.push(d);
    }
    let mut params = vec!["0".to_string()];
    if let Some(r) = region {
        params.push(format!("region_size {r}"));
    }
    match (h[1] >> 3) & 3 {
        0 => {}
        1 => params.push("nosync".into()),
        2 => params.push("sync".into()),
        _ => params.push("sync nosync".into()),
    }
    if h[1] & 0x20 != 0 {
        params.push(format!("rebuild {}", h[2] & 3));
    }
    if h[1] & 0x40 != 0 {
        params.push(format!("write_mostly {}", (h[2] >> 2) & 3));
    }
    if h[1] & 0x80 != 0 {
        params.push("daemon_sleep 1".into());
    }
    let params = params.join(" ");
    let line = format!(
        "0 {len} raid raid1 {} {params} {legs} {}",
        params.split(' ').count(),
        names.join(" ")
    );
    let resolve = |name: &str| -> Result<Arc<dyn BlockDevice>, Error> {
        devs.iter()
            .find(|d| d.name() == name)
            .cloned()
            .ok_or_else(|| Error::invalid(format!("no device '{name}'")))
    };
    let table = match Table::from_text(&line, &Registry::builtin(), &resolve) {
        Ok(t) => t,
        Err(e) => {
            let m = e.to_string();
            assert!(!m.contains('\n'), "{line}: a multi-line error '{m}'");
            return false;
        }
    };
    for s in table.status_lines() {
        check_status(&s, legs, len);
    }
    if h[4] & 4 != 0 {
        return true;
    }
    // Live: the worker writes the metadata and resyncs meanwhile.
    let md = MappedDevice::new("raid", table);
    let Ok(r) = Reactor::new(ReactorConfig::default()) else {
        return true;
    };
    let dev: Arc<dyn BlockDevice> = md.clone();
    let Ok(ch) = dev.open(&r) else {
        return true;
    };
    let mut at = (h[4] >> 4) as u64 * 61;
    for k in 0..(h[4] & 3) {
        let sector = at % (len - 8);
        at += 97;
        let pattern: Vec<u8> = (0..8 << SECTOR_SHIFT)
            .map(|x: usize| (x as u8) ^ k ^ h[4])
            .collect();
        let mut w = pattern.clone();
        if run_io(&r, &*ch, Op::Write, sector, &mut w) != Status::Ok {
            continue;
        }
        let mut rd = vec![0xa5; 8 << SECTOR_SHIFT];
        if run_io(&r, &*ch, Op::Read, sector, &mut rd) == Status::Ok {
            assert!(
                rd == pattern,
                "raid: a read at {sector} returns what was written"
            );
        }
    }
    if h[4] & 8 != 0 {
        let mut d = vec![0; 16 << SECTOR_SHIFT];
        let _ = run_io(&r, &*ch, Op::Discard, at % (len - 16), &mut d);
    }
    let _ = run_io(&r, &*ch, Op::Flush, 0, &mut Vec::new());
    let msg = match (h[0] >> 4) & 7 {
        0 => None,
        1 => Some("idle"),
        2 => Some("frozen"),
        3 => Some("resync"),
        4 => Some("recover"),
        5 => Some("check"),
        6 => Some("repair"),
        _ => Some("bogus"),
    };
    if let Some(m) = msg {
        if let Err(e) = md.table().message(0, &[m]) {
            let e = e.to_string();
            assert!(!e.contains('\n'), "message '{m}': a multi-line error '{e}'");
        }
    }
    for s in md.table().status_lines() {
        check_status(&s, legs, len);
    }
    drop(ch);
    drop(md);
    drop(r);
    true
}
