//! Starting a cache: load the superblock and the entry array and rebuild
//! the state from them, or format a new cache.

use std::cell::Cell;
use std::rc::Rc;

use udm_core::{AlignedBuf, BioFlags, Error, ErrorKind, Op, SECTOR_SHIFT};

use super::entry::{Entry, St, NONE};
use super::meta::{DiskEntry, Geometry, Super, MBLOCK_BYTES, SB_BYTES};
use super::state::State;
use super::worker::Worker;

/// Writes of the entry array a format keeps in flight.
const FORMAT_DEPTH: usize = 4;

/// A format's progress (see [`Worker::format`]).
struct Format {
    /// Bytes of the entry array, and the most one write carries.
    total: u64,
    chunk: u64,
    /// Where the next write starts.
    next: Cell<u64>,
    /// Writers still running.
    inflight: Cell<usize>,
    ok: Cell<bool>,
    result: Rc<Cell<Option<Result<(), Error>>>>,
}

impl Worker {
    pub fn load(self: &Rc<Self>, result: Rc<Cell<Option<Result<(), Error>>>>) {
        let sh = self.shared.clone();
        let me = self.clone();
        let sb_sector = sh.cfg.start_sector;
        self.io(
            true,
            Op::Read,
            BioFlags::NONE,
            sb_sector,
            AlignedBuf::new(SB_BYTES as usize),
            move |s, buf| {
                if !s.is_ok() {
                    return result.set(Some(Err(Error::new(
                        ErrorKind::Io,
                        format!("writecache: reading the superblock failed: {s}"),
                    ))));
                }
                match check_super(&sh.geo, &buf) {
                    Err(e) => result.set(Some(Err(e))),
                    Ok(None) => me.format(result),
                    Ok(Some(sb)) => me.read_entries(sb.seq, result),
                }
            },
        );
    }

    /// A new cache: zero the entry array, then write a superblock. The
    /// array goes out in writes no larger than the cache takes
    /// ([`Worker::max_meta_io`]), [`FORMAT_DEPTH`] at a time, each from a
    /// zeroed buffer it reuses: a large cache's array is gigabytes, and
    /// allocating it all at once as write buffers could exhaust memory.
    fn format(self: &Rc<Self>, result: Rc<Cell<Option<Result<(), Error>>>>) {
        let total = self.shared.geo.mblocks as u64 * MBLOCK_BYTES as u64;
        let f = Rc::new(Format {
            total,
            chunk: self.max_meta_io() as u64,
            next: Cell::new(0),
            inflight: Cell::new(0),
            ok: Cell::new(true),
            result,
        });
        for _ in 0..FORMAT_DEPTH {
            if f.next.get() >= total || !f.ok.get() {
                break;
            }
            f.inflight.set(f.inflight.get() + 1);
            let n = f.chunk.min(total);
            self.format_next(f.clone(), AlignedBuf::new(n as usize));
        }
    }

    /// Writes the next piece of the entry array from `buf` (zeroes), or,
    /// when none is left, retires this writer; the last one writes the
    /// superblock.
    fn format_next(self: &Rc<Self>, f: Rc<Format>, mut buf: AlignedBuf) {
        let off = f.next.get();
        if off >= f.total || !f.ok.get() {
            f.inflight.set(f.inflight.get() - 1);
            if f.inflight.get() == 0 {
                self.format_done(&f);
            }
            return;
        }
        let n = f.chunk.min(f.total - off);
        f.next.set(off + n);
        buf.resize(n as usize);
        let sector = self.shared.cfg.start_sector + ((SB_BYTES + off) >> SECTOR_SHIFT);
        let me = self.clone();
        self.io(
            true,
            Op::Write,
            BioFlags::NONE,
            sector,
            buf,
            move |s, buf| {
                if !s.is_ok() {
                    f.ok.set(false);
                }
                me.format_next(f, buf);
            },
        );
    }

    fn format_done(self: &Rc<Self>, f: &Format) {
        let result = f.result.clone();
        if !f.ok.get() {
            return result.set(Some(Err(Error::new(
                ErrorKind::Io,
                "writecache: formatting the metadata failed",
            ))));
        }
        let n = self.shared.geo.n_blocks;
        self.shared.lock().free.free(0, n);
        self.write_super(0, move |s| {
            result.set(Some(if s.is_ok() {
                Ok(())
            } else {
                Err(Error::new(
                    ErrorKind::Io,
                    "writecache: writing the superblock failed",
                ))
            }))
        });
    }

    fn read_entries(self: &Rc<Self>, sb_seq: u64, result: Rc<Cell<Option<Result<(), Error>>>>) {
        let g = self.shared.geo;
        let total = g.mblocks as usize * MBLOCK_BYTES;
        // In pieces no larger than the cache takes in one I/O (a file caps
        // I/Os at 8 MiB; the array of a 1 GiB cache of 512-byte blocks is
        // 32 MiB), gathered into one buffer.
        let chunk = self.max_meta_io();
        let pieces = total.div_ceil(chunk);
        let left = Rc::new(Cell::new(pieces));
        let ok = Rc::new(Cell::new(true));
        let all = Rc::new(std::cell::RefCell::new(vec![0u8; total]));
        let mut off = 0;
        while off < total {
            let n = chunk.min(total - off);
            let sector = self.shared.cfg.start_sector + ((SB_BYTES + off as u64) >> SECTOR_SHIFT);
            let (me, left, ok, all, result) = (
                self.clone(),
                left.clone(),
                ok.clone(),
                all.clone(),
                result.clone(),
            );
            let at = off;
            self.io(
                true,
                Op::Read,
                BioFlags::NONE,
                sector,
                AlignedBuf::new(n),
                move |s, buf| {
                    ok.set(ok.get() && s.is_ok());
                    all.borrow_mut()[at..at + buf.len()].copy_from_slice(&buf);
                    left.set(left.get() - 1);
                    if left.get() > 0 {
                        return;
                    }
                    if !ok.get() {
                        return result.set(Some(Err(Error::new(
                            ErrorKind::Io,
                            "writecache: reading the metadata failed",
                        ))));
                    }
                    me.rebuild(sb_seq, &all.borrow());
                    // Commit the cleaned-up image before serving I/O: stale
                    // and torn leftovers become free markers on disk.
                    me.shared.lock().commit_wanted = sb_seq + 1;
                    let r2 = result.clone();
                    me.start_commit(Some(Box::new(move |ok| {
                        r2.set(Some(if ok {
                            Ok(())
                        } else {
                            Err(Error::new(
                                ErrorKind::Io,
                                "writecache: committing the recovered metadata failed",
                            ))
                        }))
                    })));
                },
            );
            off += n;
        }
    }

    /// Rebuilds the in-memory state from the entry array (see [`rebuild`]).
    fn rebuild(&self, sb_seq: u64, buf: &[u8]) {
        let sh = &*self.shared;
        rebuild(
            &mut sh.lock(),
            sb_seq,
            buf,
            sh.cfg.bs_sectors(),
            sh.origin_blocks,
        );
    }
}

/// Decodes the superblock read from the cache and checks it against the
/// table's geometry: `Ok(None)` for a cache with none (to be formatted).
pub(crate) fn check_super(g: &Geometry, buf: &[u8]) -> Result<Option<Super>, Error> {
    let Some(sb) = Super::decode(buf)? else {
        return Ok(None);
    };
    if sb.block_size != g.block_size {
        return Err(Error::invalid(format!(
            "writecache: block size {} does not match the cache's ({})",
            g.block_size, sb.block_size
        )));
    }
    if sb.n_blocks != g.n_blocks {
        return Err(Error::invalid(format!(
            "writecache: the cache holds {} blocks but this table gives it {}",
            sb.n_blocks, g.n_blocks
        )));
    }
    Ok(Some(sb))
}

/// Rebuilds `st` (new, as `State::new` made it) from the entry array `buf`
/// (whole metadata blocks) of a cache whose last commit was `sb_seq`, with
/// blocks of `bs` sectors over `origin_blocks` origin blocks: for each
/// origin block the committed entry with the highest seq wins; everything
/// else is free, and entries that are neither free nor a winner get a free
/// marker in the next commit.
pub(crate) fn rebuild(st: &mut State, sb_seq: u64, buf: &[u8], bs: u64, origin_blocks: u64) {
    let n = st.entries.len() as u32;
    st.committed = sb_seq;
    st.pending_gen = sb_seq + 1;
    let mut winners: Vec<(u64, u32)> = Vec::new();
    for b in 0..n {
        let o = b as usize * 16;
        let e = DiskEntry::decode(&buf[o..o + 16]);
        let valid = e.seq != 0
            && e.seq <= sb_seq
            && e.sector.is_multiple_of(bs)
            && e.sector / bs < origin_blocks;
        // Entries start free (State::new): a loser or a leftover only
        // needs its free marker written.
        if !valid {
            if e != DiskEntry::FREE {
                st.mark_free(b);
            }
            continue;
        }
        let ob = e.sector / bs;
        let cur = st.map[ob as usize];
        if cur != NONE {
            if st.entries[cur as usize].seq >= e.seq {
                st.mark_free(b);
                continue;
            }
            st.entries[cur as usize] = Entry::FREE;
            st.mark_free(cur);
        }
        st.map[ob as usize] = b;
        let en = &mut st.entries[b as usize];
        en.ob = ob as u32;
        en.seq = e.seq;
        en.st = St::Live;
        winners.push((e.seq, b));
    }
    // The image, from the rebuilt states (the markers above are in it
    // already; the winners are not).
    for &(_, b) in &winners {
        let e = st.disk_entry(b as usize, bs);
        st.set_image(b, e);
    }
    // Oldest first in the writeback order.
    winners.sort_unstable();
    for &(_, b) in &winners {
        if st.entries[b as usize].st == St::Live && st.map[st.entries[b as usize].ob as usize] == b
        {
            st.lru_push(b);
            st.live += 1;
        }
    }
    let mut b = 0;
    while b < n {
        if st.entries[b as usize].st == St::Free {
            let s = b;
            while b < n && st.entries[b as usize].st == St::Free {
                b += 1;
            }
            st.free.free(s, b - s);
        } else {
            b += 1;
        }
    }
}
