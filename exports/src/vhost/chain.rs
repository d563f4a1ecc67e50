//! One virtio-blk request out of its descriptor chain (VIRTIO 1.2 §5.2.6):
//! a 16-byte header the driver wrote, the data, and a status byte the
//! device writes, laid over the descriptors in any framing.
//!
//! The walk trusts nothing: every descriptor must lie whole inside one of
//! the guest's memory regions (the caller's `map` says where it is in this
//! process, or refuses it), readable descriptors come before writable
//! ones, and the header and status must fit. The chain's length is
//! bounded by the ring (a loop ends when the ring's size is used up: see
//! virtio-queue's `DescriptorChain`).

use virtio_bindings::virtio_blk::{VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress, GuestMemory};

/// Bytes of a request's header (type, reserved, sector).
pub const HEADER_LEN: usize = 16;

/// A run of guest memory, mapped into this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seg {
    /// Where it is mapped.
    pub ptr: *mut u8,
    /// Its length in bytes.
    pub len: u32,
    /// The device writes it (else it reads it).
    pub writable: bool,
}

/// A descriptor as the chain gives it: guest address, length, whether
/// the device may write it.
pub type Desc = (u64, u32, bool);

/// A chain that cannot be a request: nothing can be reported to the
/// driver through it but its return with no bytes written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BadChain {
    /// A descriptor lies (in part) outside the guest's memory.
    Unmapped {
        /// Its guest address.
        addr: u64,
        /// Its length.
        len: u32,
    },
    /// A readable descriptor follows a writable one.
    ReadAfterWrite,
    /// Fewer than 16 readable bytes for the header.
    ShortHeader,
    /// No writable byte for the status.
    NoStatus,
    /// More descriptors than a request may have.
    TooLong,
}

impl std::fmt::Display for BadChain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BadChain::Unmapped { addr, len } => write!(
                f,
                "descriptor {addr:#x}+{len} lies outside the guest's memory"
            ),
            BadChain::ReadAfterWrite => f.write_str("a readable descriptor follows a writable one"),
            BadChain::ShortHeader => f.write_str("fewer than 16 bytes for the request header"),
            BadChain::NoStatus => f.write_str("no writable byte for the status"),
            BadChain::TooLong => f.write_str("too many descriptors"),
        }
    }
}

/// A request's header and where its status goes; its data segments are
/// `segs[first..]` of the caller's vector ([`Parsed::data`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Parsed {
    /// VIRTIO_BLK_T_*.
    pub kind: u32,
    /// The header's sector.
    pub sector: u64,
    /// The status byte.
    pub status: *mut u8,
    /// Whether the data's direction is the one the type needs (writable
    /// for IN and GET_ID, readable for the others, none for FLUSH).
    pub layout_ok: bool,
    /// Bytes of data.
    pub data_len: u64,
    /// The first data segment in the caller's vector (those before it
    /// held the header alone).
    pub first: usize,
    /// Past the last data segment (the one after it, if any, held the
    /// status alone).
    pub end: usize,
}

impl Parsed {
    /// The request's data segments, out of the vector [`parse`] filled.
    #[inline]
    pub fn data<'a>(&self, segs: &'a [Seg]) -> &'a [Seg] {
        segs.get(self.first..self.end).unwrap_or_default()
    }
}

/// Descriptors one request may have: SEG_MAX data segments, the header
/// and the status, with room for split headers.
pub const MAX_DESCS: usize = 1024;

/// Walks `descs`, mapping each with `map(addr, len)`, into `segs` (cleared
/// first: the header's segments, then the data's, [`Parsed::data`]) and
/// the [`Parsed`] header.
///
/// One pass: the readable and writable bytes are counted as the
/// descriptors come (readable ones first), which is all the header, the
/// status and the layout need; the header is copied out of the first
/// segments after.
#[inline]
pub fn parse(
    descs: impl Iterator<Item = Desc>,
    map: impl Fn(u64, u32) -> Option<*mut u8>,
    segs: &mut Vec<Seg>,
) -> Result<Parsed, BadChain> {
    let mut out = Out::new(segs);
    let mut seen_write = false;
    // Readable bytes, and all bytes (u64: at most MAX_DESCS lengths of
    // u32 each).
    let (mut rd, mut total) = (0u64, 0u64);
    for (n, desc) in descs.enumerate() {
        if n >= MAX_DESCS {
            return Err(BadChain::TooLong);
        }
        total += desc.1 as u64;
        add_desc(&map, &mut out, &mut seen_write, &mut rd, desc)?;
    }
    finish(out.done(segs), rd, total - rd)
}

/// Where a parse writes its segments: the caller's vector, cleared and
/// with room for [`MAX_DESCS`] (so a segment is three stores, with no
/// test of the capacity and no update of the vector's length until
/// [`Out::done`]); `k` written so far.
struct Out {
    base: *mut Seg,
    k: usize,
}

impl Out {
    #[inline(always)]
    fn new(segs: &mut Vec<Seg>) -> Out {
        segs.clear();
        segs.reserve(MAX_DESCS);
        Out {
            base: segs.as_mut_ptr(),
            k: 0,
        }
    }

    /// Appends `s`.
    ///
    /// # Safety
    /// Fewer than [`MAX_DESCS`] segments were appended before (a parse
    /// appends at most one per descriptor, and refuses the descriptor
    /// past MAX_DESCS first).
    #[inline(always)]
    unsafe fn push(&mut self, s: Seg) {
        // SAFETY: k < MAX_DESCS <= the capacity reserved in `new`, in the
        // vector `done` takes back (nothing else touched it meanwhile).
        unsafe { self.base.add(self.k).write(s) };
        self.k += 1;
    }

    /// The segments, in `segs` (the vector `new` was given).
    #[inline(always)]
    fn done(self, segs: &mut Vec<Seg>) -> &mut [Seg] {
        debug_assert!(std::ptr::eq(segs.as_ptr(), self.base));
        // SAFETY: the first k entries were written by `push`, within the
        // capacity; Seg is Copy (nothing to drop).
        unsafe { segs.set_len(self.k) };
        segs
    }
}

/// One descriptor's step of a parse ([`parse`], [`parse_chain`]): no
/// readable descriptor after a writable one, the segment mapped (an empty
/// one skipped) and pushed, its bytes counted in `rd` if readable.
#[inline(always)]
fn add_desc(
    map: &impl Fn(u64, u32) -> Option<*mut u8>,
    out: &mut Out,
    seen_write: &mut bool,
    rd: &mut u64,
    (addr, len, writable): Desc,
) -> Result<(), BadChain> {
    if writable {
        *seen_write = true;
    } else if *seen_write {
        return Err(BadChain::ReadAfterWrite);
    }
    if len == 0 {
        return Ok(());
    }
    let ptr = map(addr, len).ok_or(BadChain::Unmapped { addr, len })?;
    // SAFETY: one segment per descriptor, and the callers refuse the
    // descriptor past MAX_DESCS before this step.
    unsafe { out.push(Seg { ptr, len, writable }) };
    if !writable {
        *rd += len as u64;
    }
    Ok(())
}

/// The walk of the chain whose head is descriptor `head` of the table at
/// guest address `table` (`size` entries; mapped whole here at `host`,
/// or null) and its parse, in one loop: what [`parse`] gives for the
/// descriptors [`walk_mapped`] yields (the fuzz target checks it), with
/// the walk's state and the parse's in locals rather than an iterator's
/// fields, and the walk's byte count the parse's.
#[inline]
pub fn parse_chain(
    map: impl Fn(u64, u32) -> Option<*mut u8>,
    table: u64,
    host: *const u8,
    size: u16,
    head: u16,
    segs: &mut Vec<Seg>,
) -> Result<Parsed, BadChain> {
    let mut out = Out::new(segs);
    let (mut table, mut host, mut size) = (table, host, size);
    let (mut next, mut ttl, mut indirect) = (head, size, false);
    let mut n = 0;
    let mut seen_write = false;
    // Readable bytes, and all bytes (the walk ends a chain whose total
    // would pass u32).
    let (mut rd, mut total) = (0u64, 0u64);
    while ttl != 0 && next < size {
        let raw = if !host.is_null() {
            // SAFETY: host maps the table's `size` descriptors whole (the
            // caller's, or `map`'s below), next < size.
            unsafe { load_desc(host.add(next as usize * 16)) }
        } else {
            let Some(p) = table
                .checked_add(next as u64 * 16)
                .and_then(|at| map(at, 16))
            else {
                break;
            };
            // SAFETY: `map` vouched for 16 bytes at p.
            unsafe { load_desc(p) }
        };
        let (addr, len) = (raw as u64, (raw >> 64) as u32);
        let (flags, link) = ((raw >> 96) as u16, (raw >> 112) as u16);
        if flags & F_INDIRECT != 0 {
            let k = len / 16;
            if indirect || !len.is_multiple_of(16) || k > u16::MAX as u32 {
                break;
            }
            indirect = true;
            table = addr;
            size = k as u16;
            ttl = size;
            next = 0;
            host = map(addr, len).map_or(std::ptr::null(), |p| p.cast_const());
            continue;
        }
        // A descriptor that would take the total past u32 ends the chain
        // before it, as the walk does: none of its bytes count.
        if total + len as u64 > u32::MAX as u64 {
            break;
        }
        total += len as u64;
        if flags & F_NEXT != 0 {
            next = link;
            ttl -= 1;
        } else {
            ttl = 0;
        }
        if n >= MAX_DESCS {
            return Err(BadChain::TooLong);
        }
        n += 1;
        let writable = flags & F_WRITE != 0;
        add_desc(
            &map,
            &mut out,
            &mut seen_write,
            &mut rd,
            (addr, len, writable),
        )?;
    }
    finish(out.done(segs), rd, total - rd)
}

/// The header, the status and the layout of a chain whose segments are
/// in `segs`, `rd` bytes readable and `wr` writable.
#[inline]
fn finish(segs: &mut [Seg], rd: u64, wr: u64) -> Result<Parsed, BadChain> {
    // The header: the first 16 readable bytes (readable segments come
    // first, so there are enough iff rd >= 16).
    if rd < HEADER_LEN as u64 {
        return Err(BadChain::ShortHeader);
    }
    // The status: the last writable byte, in the last segment (writable
    // ones come last, and none is empty).
    if wr == 0 {
        return Err(BadChain::NoStatus);
    }
    let mut hdr = [0u8; HEADER_LEN];
    let mut got = 0;
    let mut first = 0;
    // The first segment is readable (rd > 0 and readable ones come
    // first); it holds the whole header in the drivers seen (Linux, QEMU,
    // libblkio: a descriptor of its own).
    let s = &mut segs[0];
    if s.len as usize >= HEADER_LEN {
        // SAFETY: `map` vouched for s.len >= 16 bytes at s.ptr; a byte
        // array needs no alignment (values only, validated from here on).
        hdr = unsafe { std::ptr::read_unaligned(s.ptr.cast::<[u8; HEADER_LEN]>()) };
        got = HEADER_LEN;
        if s.len as usize == HEADER_LEN {
            first = 1;
        } else {
            // SAFETY: 16 < s.len: still inside the segment.
            s.ptr = unsafe { s.ptr.add(HEADER_LEN) };
            s.len -= HEADER_LEN as u32;
        }
    }
    while got < HEADER_LEN {
        // rd >= 16 readable bytes lie in the segments from the first on.
        let s = &mut segs[first];
        let n = (HEADER_LEN - got).min(s.len as usize);
        // SAFETY: `map` vouched for s.len bytes at s.ptr, n <= s.len; the
        // guest may change them meanwhile, which only changes the values
        // read (they are validated as values from here on).
        unsafe { std::ptr::copy_nonoverlapping(s.ptr, hdr[got..].as_mut_ptr(), n) };
        got += n;
        if n == s.len as usize {
            first += 1;
        } else {
            // SAFETY: n < s.len: still inside the segment.
            s.ptr = unsafe { s.ptr.add(n) };
            s.len -= n as u32;
        }
    }
    let last = segs.len() - 1;
    let s = &mut segs[last];
    s.len -= 1;
    // SAFETY: the segment had len >= 1 bytes (empty ones were skipped);
    // this is its last.
    let status = unsafe { s.ptr.add(s.len as usize) };
    // An emptied status segment stays out of the data.
    let end = if s.len == 0 { last } else { last + 1 };
    let kind = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
    let sector = u64::from_le_bytes([
        hdr[8], hdr[9], hdr[10], hdr[11], hdr[12], hdr[13], hdr[14], hdr[15],
    ]);
    // Data segments of one direction only: no readable byte past the
    // header, or no writable byte before the status.
    let (no_out, no_in) = (rd == HEADER_LEN as u64, wr == 1);
    let layout_ok = match kind {
        VIRTIO_BLK_T_FLUSH => no_out && no_in,
        VIRTIO_BLK_T_IN | VIRTIO_BLK_T_GET_ID => no_out,
        _ => no_in,
    };
    Ok(Parsed {
        kind,
        sector,
        status,
        layout_ok,
        data_len: rd + wr - HEADER_LEN as u64 - 1,
        first,
        end,
    })
}

/// The descriptors of the chain whose head is descriptor `head` of the
/// table at guest address `table` (a ring of `size` entries), as
/// virtio-queue's `DescriptorChain` walks a chain it pops (one indirect
/// table at most, of a whole number of descriptors; at most as many
/// descriptors as the table holds, so a loop ends; a descriptor that
/// cannot be read, or a total length past u32, ends the chain; the fuzz
/// target checks that the walks agree), each read through `mem`.
pub fn walk<M: GuestMemory>(
    mem: &M,
    table: u64,
    size: u16,
    head: u16,
) -> Walk<impl Fn(u64) -> Option<u128> + '_, impl Fn(u64, u32) -> Option<*mut u8>> {
    Walk::new(
        move |at| {
            mem.read_obj::<Descriptor>(GuestAddress(at)).ok().map(|d| {
                u128::from(d.addr().0)
                    | u128::from(d.len()) << 64
                    | u128::from(d.flags()) << 96
                    | u128::from(d.next()) << 112
            })
        },
        |_, _| None,
        table,
        std::ptr::null(),
        size,
        head,
    )
}

/// The same walk, each descriptor read where `map(addr, 16)` says it is
/// mapped here (a lookup in the few regions and one 16-byte load), or,
/// when the table lies whole in one region, at `host` (the direct table,
/// mapped by the caller: null if not) or where `map` put the indirect
/// table: one load per descriptor. virtio-queue's reads go through its
/// generic guest-memory accessors (two thirds of the instructions of
/// taking a request).
pub fn walk_mapped<M: Fn(u64, u32) -> Option<*mut u8> + Copy>(
    map: M,
    table: u64,
    host: *const u8,
    size: u16,
    head: u16,
) -> Walk<impl Fn(u64) -> Option<u128>, M> {
    Walk::new(
        move |at| {
            let p = map(at, 16)?;
            // SAFETY: `map` vouched for 16 bytes at p.
            Some(unsafe { load_desc(p) })
        },
        map,
        table,
        host,
        size,
        head,
    )
}

/// The 16 bytes of a descriptor at `p`, as one little-endian u128.
///
/// # Safety
/// `p` is valid for a 16-byte read (guest memory, mapped).
#[inline]
unsafe fn load_desc(p: *const u8) -> u128 {
    // Volatile: the guest may write the descriptor meanwhile, which only
    // changes the values read (validated as values by the walk and by
    // parse).
    if p.align_offset(8) == 0 {
        // SAFETY: the caller's; 8-aligned (the table's 16-byte alignment,
        // which virtio-queue checks for the direct table): two words.
        let [lo, hi] = unsafe { std::ptr::read_volatile(p.cast::<[u64; 2]>()) };
        u128::from(u64::from_le(lo)) | u128::from(u64::from_le(hi)) << 64
    } else {
        // SAFETY: the caller's; a byte array needs no alignment.
        u128::from_le_bytes(unsafe { std::ptr::read_volatile(p.cast::<[u8; 16]>()) })
    }
}

const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
const F_INDIRECT: u16 = 4;

/// The iterator of [`walk`] and [`walk_mapped`]; `read` reads the
/// descriptor at a guest address (None: outside the guest's memory),
/// `map_table` maps a whole indirect table (None: read each descriptor).
pub struct Walk<R, T> {
    read: R,
    map_table: T,
    table: u64,
    /// The table being walked, mapped here whole (null: each descriptor
    /// is read with `read`).
    host: *const u8,
    size: u16,
    next: u16,
    ttl: u16,
    indirect: bool,
    /// Bytes yielded so far: the chain ends where they would pass u32.
    bytes: u32,
}

impl<R, T> Walk<R, T> {
    fn new(read: R, map_table: T, table: u64, host: *const u8, size: u16, head: u16) -> Walk<R, T> {
        Walk {
            read,
            map_table,
            table,
            host,
            size,
            next: head,
            ttl: size,
            indirect: false,
            bytes: 0,
        }
    }
}

impl<R: Fn(u64) -> Option<u128>, T: Fn(u64, u32) -> Option<*mut u8>> Iterator for Walk<R, T> {
    type Item = Desc;

    #[inline]
    fn next(&mut self) -> Option<Desc> {
        loop {
            if self.ttl == 0 || self.next >= self.size {
                return None;
            }
            let raw = if self.host.is_null() {
                let at = self.table.checked_add(self.next as u64 * 16)?;
                (self.read)(at)?
            } else {
                // SAFETY: host maps the table's `size` descriptors whole
                // (the caller's, or map_table's below), next < size.
                unsafe { load_desc(self.host.add(self.next as usize * 16)) }
            };
            let (addr, len) = (raw as u64, (raw >> 64) as u32);
            let (flags, next) = ((raw >> 96) as u16, (raw >> 112) as u16);
            if flags & F_INDIRECT != 0 {
                let n = len / 16;
                if self.indirect || !len.is_multiple_of(16) || n > u16::MAX as u32 {
                    return None;
                }
                self.indirect = true;
                self.table = addr;
                self.size = n as u16;
                self.ttl = self.size;
                self.next = 0;
                self.host = match (self.map_table)(addr, len) {
                    Some(p) => p,
                    None => std::ptr::null(),
                };
                continue;
            }
            self.bytes = self.bytes.checked_add(len)?;
            if flags & F_NEXT != 0 {
                self.next = next;
                self.ttl -= 1;
            } else {
                self.ttl = 0;
            }
            return Some((addr, len, flags & F_WRITE != 0));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_blk::VIRTIO_BLK_T_OUT;

    /// A fake guest memory of 4 KiB at guest address 0x1000.
    struct Guest(Vec<u8>);

    impl Guest {
        fn map(&self) -> impl Fn(u64, u32) -> Option<*mut u8> + '_ {
            move |addr, len| {
                let off = addr.checked_sub(0x1000)? as usize;
                (off + len as usize <= self.0.len())
                    .then(|| self.0.as_ptr().wrapping_add(off).cast_mut())
            }
        }
        fn header(&mut self, at: usize, kind: u32, sector: u64) {
            self.0[at..at + 4].copy_from_slice(&kind.to_le_bytes());
            self.0[at + 8..at + 16].copy_from_slice(&sector.to_le_bytes());
        }
    }

    #[test]
    fn a_read_in_three_descriptors_has_one_data_segment_and_the_status_after_it() {
        let mut g = Guest(vec![0; 4096]);
        g.header(0, VIRTIO_BLK_T_IN, 7);
        let mut segs = Vec::new();
        let descs = [(0x1000, 16, false), (0x1200, 512, true), (0x1400, 1, true)];
        let p = parse(descs.into_iter(), g.map(), &mut segs).unwrap();
        assert_eq!(
            (p.kind, p.sector, p.layout_ok, p.data_len),
            (0, 7, true, 512)
        );
        let data = p.data(&segs);
        assert_eq!(data.len(), 1);
        assert_eq!(data[0].ptr, g.0.as_ptr().wrapping_add(0x200).cast_mut());
        assert_eq!(p.status, g.0.as_ptr().wrapping_add(0x400).cast_mut());
    }

    #[test]
    fn header_data_and_status_may_share_descriptors() {
        let mut g = Guest(vec![0; 4096]);
        g.header(0, VIRTIO_BLK_T_OUT, 3);
        let mut segs = Vec::new();
        // Header + 512 bytes of data in one, status in a 1-byte tail.
        let descs = [(0x1000, 16 + 512, false), (0x1800, 1, true)];
        let p = parse(descs.into_iter(), g.map(), &mut segs).unwrap();
        assert_eq!(
            (p.kind, p.sector, p.layout_ok, p.data_len),
            (1, 3, true, 512)
        );
        assert_eq!(
            p.data(&segs)[0].ptr,
            g.0.as_ptr().wrapping_add(16).cast_mut()
        );
        // The header split over two descriptors, the second going on
        // with the data.
        let descs = [
            (0x1000, 8, false),
            (0x1008, 8 + 512, false),
            (0x1800, 1, true),
        ];
        let p = parse(descs.into_iter(), g.map(), &mut segs).unwrap();
        assert_eq!(
            (p.kind, p.sector, p.layout_ok, p.data_len),
            (1, 3, true, 512)
        );
        assert_eq!(p.data(&segs).len(), 1);
        assert_eq!(
            p.data(&segs)[0].ptr,
            g.0.as_ptr().wrapping_add(16).cast_mut()
        );
        // A read whose status ends its data descriptor.
        g.header(0x100, VIRTIO_BLK_T_IN, 0);
        let descs = [(0x1100, 16, false), (0x1200, 513, true)];
        let p = parse(descs.into_iter(), g.map(), &mut segs).unwrap();
        assert_eq!((p.layout_ok, p.data_len), (true, 512));
        assert_eq!(p.status, g.0.as_ptr().wrapping_add(0x400).cast_mut());
    }

    #[test]
    fn malformed_chains_are_named() {
        let mut g = Guest(vec![0; 4096]);
        g.header(0, VIRTIO_BLK_T_IN, 0);
        let mut segs = Vec::new();
        let cases: [(&[Desc], BadChain); 5] = [
            (
                &[(0x1000, 16, false), (0x1f00, 512, true)],
                BadChain::Unmapped {
                    addr: 0x1f00,
                    len: 512,
                },
            ),
            (
                &[(0x1000, 16, false), (0x1200, 1, true), (0x1300, 8, false)],
                BadChain::ReadAfterWrite,
            ),
            (
                &[(0x1000, 8, false), (0x1200, 1, true)],
                BadChain::ShortHeader,
            ),
            (
                &[(0x1000, 16, false), (0x1200, 512, false)],
                BadChain::NoStatus,
            ),
            (&[(0x1000, 16, false)], BadChain::NoStatus),
        ];
        for (descs, want) in cases {
            let got = parse(descs.iter().copied(), g.map(), &mut segs);
            assert_eq!(got, Err(want), "{descs:?}");
        }
        // An address that wraps around is outside too.
        let descs = [(u64::MAX - 4, 16, false), (0x1200, 1, true)];
        assert!(matches!(
            parse(descs.into_iter(), g.map(), &mut segs),
            Err(BadChain::Unmapped { .. })
        ));
    }

    #[test]
    fn data_in_the_wrong_direction_is_a_bad_request_not_a_bad_chain() {
        let mut g = Guest(vec![0; 4096]);
        g.header(0, VIRTIO_BLK_T_OUT, 0);
        let mut segs = Vec::new();
        // A write whose data the device would write: refused by status.
        let descs = [(0x1000, 16, false), (0x1200, 512, true), (0x1400, 1, true)];
        let p = parse(descs.into_iter(), g.map(), &mut segs).unwrap();
        assert!(!p.layout_ok);
        g.header(0, VIRTIO_BLK_T_FLUSH, 0);
        let p = parse(descs.into_iter(), g.map(), &mut segs).unwrap();
        assert!(!p.layout_ok);
    }

    #[test]
    fn a_chain_taken_again_by_head_follows_next_and_one_indirect_table_and_ends_in_a_loop() {
        use virtio_queue::desc::split::Descriptor as D;
        use vm_memory::GuestMemoryMmap;
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let put = |at: u64, d: D| mem.write_obj(d, GuestAddress(at)).unwrap();
        const NEXT: u16 = 1;
        const WRITE: u16 = 2;
        const INDIRECT: u16 = 4;
        // Ring of 4 at 0x1000: head 2 -> 0 -> (indirect table at 0x2000 of 2).
        put(0x1000 + 2 * 16, D::new(0x5000, 16, NEXT, 0));
        put(0x1000, D::new(0x2000, 32, INDIRECT, 0));
        put(0x2000, D::new(0x6000, 512, NEXT | WRITE, 1));
        put(0x2010, D::new(0x7000, 1, WRITE, 0));
        let got: Vec<Desc> = walk(&mem, 0x1000, 4, 2).collect();
        assert_eq!(
            got,
            [(0x5000, 16, false), (0x6000, 512, true), (0x7000, 1, true)]
        );
        // 1 -> 3 -> 1 -> ...: ends once the ring's size is used up.
        put(0x1000 + 16, D::new(0x5000, 16, NEXT, 3));
        put(0x1000 + 3 * 16, D::new(0x5000, 16, NEXT, 1));
        assert_eq!(walk(&mem, 0x1000, 4, 1).count(), 4);
        // A head past the ring, and a table outside memory: nothing.
        assert_eq!(walk(&mem, 0x1000, 4, 4).count(), 0);
        assert_eq!(walk(&mem, 0xffff_0000, 4, 0).count(), 0);
    }
}
