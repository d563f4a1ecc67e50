//! DISCARD, as dm-writecache does it: the cached blocks of the range are
//! dropped and the discard goes on to the origin, in an order that no
//! crash can undo (see `Discarder::discard`).

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use udm_core::{BioPtr, Caps, Channel, Op, Status};

use super::map::unmapped_prefix;
use super::state::{Shared, State};

/// A discard's context word: how many times it tried to drop its cached
/// blocks, and whether it has any to drop (else the origin's completion
/// completes it).
const DISCARD_PASS: u64 = 1 << 32;
/// The discard waits for writeback of its range before going to the origin.
const DISCARD_WAIT_WB: u64 = 1 << 33;
/// Tries (one per commit) before a discard gives up on blocks that stay
/// under writeback or shadowed; they then stay cached, which a discard
/// allows (the range reads back as anything written there before).
const DISCARD_TRIES: u64 = 8;

/// The discards of one reactor's channel: their frames point at it (it
/// lives in the channel, behind its `Rc`, so it does not move).
pub(crate) struct Discarder {
    shared: Arc<Shared>,
    origin: Rc<dyn Channel>,
    /// Discards waiting for writeback of their range, or whose origin part
    /// is done and that wait to drop cached blocks that could not go yet
    /// (see `finish_discard`).
    wait: RefCell<Vec<BioPtr>>,
}

impl Discarder {
    pub fn new(shared: Arc<Shared>, origin: Rc<dyn Channel>) -> Discarder {
        Discarder {
            shared,
            origin,
            wait: RefCell::new(Vec::new()),
        }
    }

    /// Retries the discards that wait (the channel's `kick`: a commit or
    /// a writeback completed).
    pub fn kick(&self) {
        let discards: Vec<BioPtr> = std::mem::take(&mut *self.wait.borrow_mut());
        if discards.is_empty() {
            return;
        }
        self.shared.lock().discard_waiters -= discards.len() as u64;
        for bio in discards {
            if bio.ctx() & DISCARD_WAIT_WB != 0 {
                self.start_discard(bio);
            } else {
                self.finish_discard(bio, false);
            }
        }
    }

    /// DISCARD, as dm-writecache does it: the cached blocks of the range are
    /// dropped (so reads then go to the origin) and the discard goes on to
    /// the origin. The order is writeback's, so that no crash brings back
    /// data older than the newest durable write: the origin is discarded
    /// and flushed first, then each dropped block is unmapped and marked
    /// free in the next commit, and only once no older entry for its sector
    /// is left on disk (meta.rs, rule 4). A block whose first write is in
    /// flight belongs to a write racing the discard and stays.
    pub fn discard(&self, bio: BioPtr) {
        let sh = &*self.shared;
        let bs = sh.cfg.bs_sectors();
        if !bio.sector.is_multiple_of(bs) || !bio.sectors().is_multiple_of(bs) {
            return bio.complete(Status::Inval);
        }
        if !sh.cfg.origin.caps().contains(Caps::DISCARD) {
            return bio.complete(Status::NotSupp);
        }
        sh.lock().stats.discards += bio.sectors() / bs;
        let mut bio = bio.make_room();
        if !bio.push_end_io(discard_origin_done, self as *const Discarder as *mut ()) {
            // make_room left a free frame.
            return bio.complete(Status::NoMem);
        }
        bio.set_ctx(0);
        self.start_discard(bio);
    }

    /// Sends the discard on to the origin — once no writeback of the range
    /// is in flight: a block superseded while under writeback still writes
    /// its (older) data to the origin, which must not land on top of the
    /// discard (the newer copy, dropped, would then uncover it). For the
    /// same reason, with cached blocks to drop, the range is marked
    /// discarding until the discard completes: writeback takes none of its
    /// blocks meanwhile.
    fn start_discard(&self, mut bio: BioPtr) {
        let sh = &*self.shared;
        let bs = sh.cfg.bs_sectors();
        let (ob0, n) = ((bio.sector / bs) as usize, (bio.sectors() / bs) as usize);
        let cached = {
            let mut st = sh.lock();
            if st.error != 0 {
                drop(st);
                bio.pop_end_io();
                return bio.complete(Status::IoErr);
            }
            if st.wb_ob[ob0..ob0 + n].iter().any(|&w| w != 0) {
                st.discard_waiters += 1;
                drop(st);
                bio.set_ctx(DISCARD_WAIT_WB);
                self.wait.borrow_mut().push(bio);
                return;
            }
            let map = &st.map[ob0..ob0 + n];
            let cached = unmapped_prefix(map) < map.len();
            if cached {
                st.discarding.push((ob0 as u64, (ob0 + n) as u64));
            }
            cached
        };
        bio.set_ctx(if cached { 0 } else { DISCARD_PASS });
        // The target maps sector for sector onto the origin.
        self.origin.submit(bio);
    }

    /// The origin is discarded and flushed: drop what is cached in the
    /// range, then complete the discard (or wait for a commit and try
    /// again, for blocks that cannot go yet).
    fn finish_discard(&self, mut bio: BioPtr, in_completion: bool) {
        let sh = &*self.shared;
        let bs = sh.cfg.bs_sectors();
        let (ob0, n) = (bio.sector / bs, bio.sectors() / bs);
        let tries = bio.ctx() + 1;
        let retry = {
            let mut st = sh.lock();
            if st.error != 0 && bio.status().is_ok() {
                bio.set_status(Status::IoErr);
            }
            let (dropped, left) = drop_range(&mut st, ob0, n);
            let retry = left && tries < DISCARD_TRIES && st.error == 0;
            if dropped || retry {
                // Free the blocks soon; what is left needs a commit first.
                let pg = st.pending_gen;
                st.commit_wanted = st.commit_wanted.max(pg);
            }
            if retry {
                st.discard_waiters += 1;
            }
            retry
        };
        if retry {
            bio.set_ctx(tries);
            self.wait.borrow_mut().push(bio);
            sh.poke();
            return;
        }
        sh.poke();
        self.done_discarding(&bio);
        bio.pop_end_io();
        if in_completion {
            bio.endio();
        } else {
            let s = bio.status();
            bio.complete(s);
        }
    }

    /// A discard with cached blocks (marked discarding by start_discard)
    /// ends: writeback may take its range's blocks again.
    fn done_discarding(&self, bio: &BioPtr) {
        if bio.ctx() & (DISCARD_PASS | DISCARD_WAIT_WB) != 0 {
            return;
        }
        let sh = &*self.shared;
        let bs = sh.cfg.bs_sectors();
        let range = (bio.sector / bs, (bio.sector + bio.sectors()) / bs);
        let mut st = sh.lock();
        if let Some(i) = st.discarding.iter().position(|&r| r == range) {
            st.discarding.swap_remove(i);
            drop(st);
            sh.poke();
        }
    }
}

/// Drops the cached blocks of origin blocks `ob0..ob0+n` that may go now:
/// unmapped, out of the writeback order, marked free in the next commit
/// and reusable once that is durable (as written-back blocks). Returns
/// whether it dropped any, and whether some must wait: under writeback, or
/// with older entries of their sector whose free markers are not durable
/// yet (a torn commit could then keep those and lose this one's marker,
/// bringing back data older than this block's).
fn drop_range(st: &mut State, ob0: u64, n: u64) -> (bool, bool) {
    let (mut dropped, mut left) = (false, false);
    let end = ob0 + n;
    let mut ob = ob0;
    while ob < end {
        // Uncached stretches in bulk.
        ob += unmapped_prefix(&st.map[ob as usize..end as usize]) as u64;
        if ob >= end {
            break;
        }
        let this = ob;
        ob += 1;
        let b = st.map[this as usize];
        let e = st.entries[b as usize];
        if st.any_unwritten(b, 1) {
            // A first write racing the discard: ordered after it.
            continue;
        }
        if e.wb || st.shadowed(this) {
            left = true;
            continue;
        }
        st.release_live(b, this);
        dropped = true;
    }
    (dropped, left)
}

/// End_io of a discard the engine sent on to the origin.
fn discard_origin_done(mut bio: BioPtr) {
    // SAFETY: the private of the engine's frame is the Discarder that
    // pushed it, inside its channel, kept alive by its table while I/O is
    // in flight.
    let d = unsafe { &*(bio.private() as *const Discarder) };
    if !bio.status().is_ok() || bio.ctx() & DISCARD_PASS != 0 {
        d.done_discarding(&bio);
        bio.pop_end_io();
        return bio.endio();
    }
    if !d.shared.cfg.origin.caps().contains(Caps::FLUSH) {
        return d.finish_discard(bio, true);
    }
    // Flush the origin before any block of the range is marked free, so
    // that a crash cannot lose the discard but keep the markers.
    let mut f = bio.alloc_clone();
    f.flags = udm_core::BioFlags::NONE;
    f.set_dataless(Op::Flush, 0, 0);
    f.set_end_io(discard_flush_done, bio.into_raw().cast());
    d.origin.submit(f);
}

fn discard_flush_done(f: BioPtr) {
    // SAFETY: the flush's private is the discard, given up with into_raw in
    // discard_origin_done and taken back only here.
    let mut bio = unsafe { BioPtr::from_raw(f.private().cast()) };
    let s = f.status();
    drop(f);
    // SAFETY: as in discard_origin_done: the discard's frame is ours.
    let d = unsafe { &*(bio.private() as *const Discarder) };
    if !s.is_ok() {
        bio.set_status(s);
        d.done_discarding(&bio);
        bio.pop_end_io();
        return bio.endio();
    }
    d.finish_discard(bio, true);
}
