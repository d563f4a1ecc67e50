//! Queued and stream dispatch (seed 004): requests held until the
//! export's [`Front::unplug`], then sorted and merged into multi-segment
//! bios (the kernel's plug list, `blk_finish_plug`); in stream mode, held
//! only while each continues the one before (the kernel's plug merge); in
//! auto mode, only while it does and other requests are in flight, and
//! across a stream's jump (the request after a held run).

use std::time::Instant;

use udm_core::{BioFlags, BioPtr, Dispatch, Op, SECTOR_SHIFT};

use super::{Front, FrontOp, Request, NO_SLOT};

/// Auto dispatch's `next_off` once a request that continued the one before
/// was held: the next request is held too, wherever it starts
/// ([`Front::hold_auto`]). An offset no request ends at.
pub(super) const STREAMING: u64 = u64::MAX;

/// Auto dispatch's `next_off` before any request, or after a change of
/// mode: continues nothing and follows no run. An offset no request ends at.
pub(super) const NOWHERE: u64 = u64::MAX - 1;

/// A request held for queued dispatch: one bio's worth, aligned.
#[derive(Clone, Copy)]
pub(super) struct Plugged {
    idx: usize,
    op: Op,
    flags: BioFlags,
    off: u64,
    len: u32,
    buf: *mut u8,
}

impl Plugged {
    /// Requests merge when these are equal (and their ranges touch).
    /// MAY_LEND does not keep them apart: a merged bio drops it.
    #[inline]
    fn class(&self) -> (u8, u8) {
        (
            self.op as u8,
            self.flags.difference(BioFlags::MAY_LEND).bits(),
        )
    }
}

impl Front {
    /// Holds an aligned read or write of at most one bio until
    /// [`Front::unplug`] and returns true (queued, stream and auto
    /// dispatch); false when the request is to go now. In stream mode only
    /// a request that starts where the one before it ended is held (what is
    /// held goes first when it cannot take this one); any other sends what
    /// is held and goes now. Auto holds as stream does, but only while
    /// other requests are in flight (a lone request could merge with
    /// nothing, and holding it would only cost), and goes on across a
    /// stream's jump: the request after a held run is held wherever it
    /// starts ([`STREAMING`]).
    ///
    /// Auto's test is inline, so that the requests it sends on direct's
    /// path pay only it (a comparison, a store and a count) and not the call.
    #[inline(always)]
    pub(super) fn hold(&self, idx: usize, req: Request) -> bool {
        let mode = self.mode.get();
        if mode == Dispatch::Queued {
            return self.hold_run(idx, req, true);
        }
        let last = self.next_off.get();
        if mode == Dispatch::Auto {
            if (last != req.offset && last != STREAMING) || self.slots.borrow().len() <= 1 {
                self.next_off.set(req.offset + req.len as u64);
                self.unplug();
                return false;
            }
            return self.hold_auto(idx, req);
        }
        self.next_off.set(req.offset + req.len as u64);
        self.hold_run(idx, req, last == req.offset)
    }

    /// Whether stream and auto dispatch may hold `req`: a read or a write
    /// of at most one bio, and not a read the device may lend its memory
    /// to where merging does not help it (a merged bio cannot be lent, and
    /// on the memory-like devices that lend, which merging does not help,
    /// the copy saved is worth more than the bios merged; a device that
    /// merging helps, a file or a network disk, lends nothing).
    #[inline]
    fn streamable(&self, req: &Request) -> bool {
        matches!(req.op, FrontOp::Read | FrontOp::Write)
            && req.len <= self.max_bio
            && (!req.flags.may_lend || self.merge_helps)
    }

    /// [`Front::hold`]'s work, out of line; `follows`: the request starts
    /// where the one before it ended (always true in queued mode, which
    /// does not ask).
    #[inline(never)]
    fn hold_run(&self, idx: usize, req: Request, follows: bool) -> bool {
        let stream = self.mode.get() != Dispatch::Queued;
        if stream {
            if !(follows && self.streamable(&req)) {
                self.unplug();
                return false;
            }
        } else if !(matches!(req.op, FrontOp::Read | FrontOp::Write) && req.len <= self.max_bio) {
            return false;
        }
        let p = self.plugged(idx, req);
        if stream && !self.continues_plug(&p) {
            self.unplug();
        }
        self.plug.borrow_mut().push(p);
        true
    }

    /// Auto dispatch's holding, out of line, for a request that continues
    /// the one before it or follows a held run, with others in flight. One
    /// that extends the run held (or starts one: nothing held) keeps the
    /// stream's mark, so the next is held whatever it starts at; one that
    /// does not is a jump: the run goes, this one starts the next, and the
    /// request after it is held only if it continues it (scattered
    /// requests drop back to direct's path after one held request). As
    /// `udm bench` does: sent direct, a stream's jump (a client wrapping
    /// to the device's start, or seeking) would go alone, and on a device
    /// whose completions come back in the groups they went down in (an
    /// O_DIRECT file on tmpfs) stay alone, splitting every later batch.
    #[inline(never)]
    fn hold_auto(&self, idx: usize, req: Request) -> bool {
        let end = req.offset + req.len as u64;
        if !self.streamable(&req) {
            self.next_off.set(end);
            self.unplug();
            return false;
        }
        let p = self.plugged(idx, req);
        if self.continues_plug(&p) {
            self.next_off.set(STREAMING);
        } else {
            self.unplug();
            self.next_off.set(end);
        }
        self.plug.borrow_mut().push(p);
        true
    }

    /// The slot's request as held: its slot marked active, one bio pending.
    #[inline]
    fn plugged(&self, idx: usize, req: Request) -> Plugged {
        let op = if req.op == FrontOp::Read {
            Op::Read
        } else {
            Op::Write
        };
        let mut flags = self.write_flags(req);
        if req.flags.may_lend && op == Op::Read {
            flags.insert(BioFlags::MAY_LEND);
        }
        self.with_slot(idx, |s| {
            s.active = true;
            s.pending = 1;
        });
        Plugged {
            idx,
            op,
            flags,
            off: req.offset,
            len: req.len,
            buf: req.buf,
        }
    }

    /// Stream and auto dispatch: whether `p` can join the run held (or
    /// nothing is held): it starts where the run's last request ended, is
    /// of its class, and fits the device's limits. In auto dispatch it may
    /// not (a stream's jump).
    fn continues_plug(&self, p: &Plugged) -> bool {
        let plug = self.plug.borrow();
        let (Some(first), Some(last)) = (plug.first(), plug.last()) else {
            return true;
        };
        last.off + last.len as u64 == p.off
            && last.class() == p.class()
            && plug.len() < self.max_segs
            && p.off + p.len as u64 - first.off <= self.max_bio as u64
    }

    /// Submits the requests held since the last call (the kernel's
    /// `blk_finish_plug`): sorted by offset (queued mode; stream mode's are
    /// one run already), adjacent ones of the same op and flags merged into
    /// one bio of several segments, up to the device's `max_io_bytes` and
    /// `max_segments`. Exports call it at the end of each batch of
    /// requests; with nothing held (always, in direct mode) it returns at
    /// once. Auto dispatch weighing queued against direct reads the clock
    /// here, after what was held has gone: the trial may change the mode.
    #[inline]
    pub fn unplug(&self) {
        if !self.plug.borrow().is_empty() {
            self.send_plug();
        }
        if self.trial.get().is_some() {
            self.weigh(Instant::now());
        }
    }

    /// [`Front::unplug`]'s work, out of line: the hot callers only test
    /// whether anything is held.
    #[inline(never)]
    fn send_plug(&self) {
        // Taken out (and put back, keeping its capacity) so that no borrow
        // is held while bios go down.
        let mut list = std::mem::take(&mut *self.plug.borrow_mut());
        if self.mode.get() == Dispatch::Queued {
            // Unstable (a stable sort may allocate); the slot index keeps
            // equal offsets in a fixed order.
            list.sort_unstable_by_key(|p| (p.class(), p.off, p.idx));
        }
        let mut i = 0;
        while i < list.len() {
            let first = list[i];
            let (mut j, mut len) = (i + 1, first.len);
            while j < list.len()
                && j - i < self.max_segs
                && list[j].class() == first.class()
                && list[j].off == first.off + len as u64
                && len + list[j].len <= self.max_bio
            {
                len += list[j].len;
                j += 1;
            }
            if j == i + 1 {
                self.submit_bios(
                    first.idx,
                    first.op,
                    first.off,
                    first.len,
                    first.buf,
                    first.flags,
                );
            } else {
                self.submit_merged(&list[i..j], len);
            }
            i = j;
        }
        list.clear();
        *self.plug.borrow_mut() = list;
    }

    /// Submits `run` (adjacent, same class, sorted) as one bio of `len`
    /// bytes, a segment per request, chained through the slots' `next`.
    fn submit_merged(&self, run: &[Plugged], len: u32) {
        let first = run[0];
        let mut bio = self.reactor().alloc_bio();
        bio.op = first.op;
        bio.sector = first.off >> SECTOR_SHIFT;
        bio.flags = first.flags.difference(BioFlags::MAY_LEND);
        {
            let mut slots = self.slots.borrow_mut();
            for (k, p) in run.iter().enumerate() {
                // SAFETY: the request's buffer holds p.len bytes and stays
                // untouched until the request finishes (submit's
                // contract), which is after this bio completes.
                unsafe { bio.add_seg(p.buf, p.len as usize) };
                slots[p.idx].next = run.get(k + 1).map_or(NO_SLOT, |n| n.idx);
            }
        }
        debug_assert_eq!(bio.len(), len);
        bio.set_ctx(first.idx as u64);
        bio.set_end_io(
            front_merged_end_io,
            (self as *const Front).cast_mut().cast(),
        );
        self.chan.submit(bio);
    }
}

/// The end_io of a merged bio (queued dispatch): private is the front, ctx
/// the first slot of the chain its requests form; each request takes the
/// bio's status.
fn front_merged_end_io(bio: BioPtr) {
    // SAFETY: private is the front that sent the bio, kept alive by the
    // references its requests hold until `finish`: while a request of the
    // chain is unfinished, so is the front.
    let front = unsafe { &*(bio.private() as *const Front) };
    let mut idx = bio.ctx() as usize;
    let st = bio.status();
    drop(bio);
    loop {
        // Read before the request finishes (its slot is freed, and the
        // last one's reference to the front given back).
        let next = front.with_slot(idx, |s| std::mem::replace(&mut s.next, NO_SLOT));
        front.bio_done(idx, st, None);
        if next == NO_SLOT {
            return;
        }
        idx = next;
    }
}
