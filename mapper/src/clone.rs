//! The clone path: what the fast path does not take.
//!
//! The caller's bio becomes the parent: its completion is saved in a frame
//! (as on the fast path) and it is split into clones, one per target piece
//! (at target boundaries and `max_io_len` windows) or, for a flush, one per
//! device. Clones point into the parent's buffers (nothing is copied) and
//! come from the reactor's descriptor cache. The parent completes when its
//! last clone does, with the first error any clone saw.
//!
//! A PREFLUSH bio first sends a flush to every device, then its data.

use udm_core::{Bio, BioFlags, BioPtr, Op, Status, SECTOR_SHIFT};

use crate::table_io::{ctx_target_dev, TableIo};
use crate::target::MapCtx;

/// Parent stage, kept in the parent's context word.
const STAGE_DATA: u64 = 0;
const STAGE_PREFLUSH: u64 = 1;
const STAGE_FLUSH: u64 = 2;

/// Context word of a flush clone: it belongs to no target.
const FLUSH_CLONE: u64 = u32::MAX as u64;

/// Takes `bio` down the clone path of `tio`'s table.
pub(crate) fn submit(tio: &TableIo, bio: BioPtr) {
    // More stacked layers than a bio has frames for: a fresh descriptor
    // stands in for it (dm's clone fallback).
    let mut bio = bio.make_room();
    if !bio.push_end_io(parent_endio, tio as *const TableIo as *mut ()) {
        // make_room left a free frame.
        return bio.complete(Status::NoMem);
    }
    tio.get();
    bio.set_status(Status::Ok);
    bio.pending = 1; // held until every clone is issued
    let p = bio.into_raw();
    // SAFETY: `p` came from into_raw just above; clones only complete on a
    // later reactor turn (devices never complete inside submit), so nothing
    // else touches the parent until put_parent drops our hold.
    let parent = unsafe { &mut *p };
    if parent.op == Op::Flush {
        parent.set_ctx(STAGE_FLUSH);
        fan_out_flush(tio, p);
    } else if parent.flags.contains(BioFlags::PREFLUSH) {
        parent.set_ctx(STAGE_PREFLUSH);
        fan_out_flush(tio, p);
    } else {
        parent.set_ctx(STAGE_DATA);
        split(tio, p);
    }
    put_parent(p, false);
}

/// Issues one clone per target piece of the parent's range.
fn split(tio: &TableIo, p: *mut Bio) {
    // SAFETY: the caller holds a pending count on the parent, so it is alive.
    let parent = unsafe { &mut *p };
    let table = &*tio.table;
    let mut sector = parent.sector;
    let end = parent.end_sector();
    let mut offset = 0usize;
    while sector < end {
        let ti = table.find(sector);
        let t = &tio.targets[ti];
        let rel = sector - t.begin;
        let n = t.split_room(rel).min(end - sector);
        let bytes = (n << SECTOR_SHIFT) as usize;
        // alloc_clone removes MAY_LEND: a clone's data must land in the
        // parent's buffer.
        let mut c = parent.alloc_clone();
        c.flags.remove(BioFlags::PREFLUSH);
        if parent.op.has_data() {
            c.add_segs_from(parent, offset, bytes);
        } else {
            c.set_dataless(parent.op, 0, bytes as u32);
        }
        c.sector = rel;
        c.set_end_io(clone_endio, p.cast());
        c.set_ctx(ti as u64);
        parent.pending += 1;
        map_clone(tio, ti, c);
        sector += n;
        offset += bytes;
    }
}

/// Sends an empty flush to every device of the table.
fn fan_out_flush(tio: &TableIo, p: *mut Bio) {
    // SAFETY: the caller holds a pending count on the parent.
    let parent = unsafe { &mut *p };
    for ch in &tio.flush_chans {
        let mut c = parent.alloc_clone();
        c.flags = BioFlags::NONE;
        c.set_dataless(Op::Flush, 0, 0);
        c.set_end_io(clone_endio, p.cast());
        c.set_ctx(FLUSH_CLONE);
        parent.pending += 1;
        ch.submit(c);
    }
}

fn map_clone(tio: &TableIo, ti: usize, c: BioPtr) {
    let t = &tio.targets[ti];
    let m = t.target().map(c, &MapCtx { devs: &t.chans });
    if let Some(c) = tio.dispatch(ti, m) {
        tio.state.requeue_clones.borrow_mut().push_back(c);
        tio.state.kick();
    }
}

/// Maps a clone again after its target asked for a retry (through the table
/// its parent started on).
pub(crate) fn remap_clone(c: BioPtr) {
    // SAFETY: a clone's private is its parent, alive while the clone is
    // pending; the parent's private is the TableIo it was split on, alive
    // while the parent is in flight.
    let tio = unsafe { &*((*(c.private() as *const Bio)).private() as *const TableIo) };
    let (ti, _) = ctx_target_dev(c.ctx());
    map_clone(tio, ti, c);
}

fn clone_endio(mut c: BioPtr) {
    let p = c.private() as *mut Bio;
    // SAFETY: as in remap_clone.
    let parent = unsafe { &mut *p };
    // SAFETY: as in remap_clone.
    let tio = unsafe { &*(parent.private() as *const TableIo) };
    let status = c.status();
    if c.ctx() != FLUSH_CLONE {
        let (ti, dev) = ctx_target_dev(c.ctx());
        let t = &tio.targets[ti];
        if t.end_io.applies(status.is_ok()) {
            t.target().end_io(&mut c, dev);
        }
    }
    drop(c);
    if !status.is_ok() && parent.status().is_ok() {
        parent.set_status(status);
    }
    put_parent(p, true);
}

/// Drops one pending count; the last one completes the parent (at once from
/// a completion, deferred from a submit).
fn put_parent(p: *mut Bio, in_completion: bool) {
    // SAFETY: the caller holds one of the parent's pending counts.
    let parent = unsafe { &mut *p };
    parent.pending -= 1;
    if parent.pending == 0 {
        // SAFETY: that was the last count: we own the parent again.
        let bio = unsafe { BioPtr::from_raw(p) };
        if in_completion {
            parent_endio(bio);
        } else {
            let s = bio.status();
            bio.complete(s);
        }
    }
}

/// The parent's end_io: after a PREFLUSH, send the data; otherwise restore
/// the caller's completion and run it.
fn parent_endio(mut bio: BioPtr) {
    // SAFETY: pushed in `submit`; alive while the parent is in flight.
    let tio = unsafe { &*(bio.private() as *const TableIo) };
    if bio.ctx() == STAGE_PREFLUSH && bio.status().is_ok() {
        bio.flags.remove(BioFlags::PREFLUSH);
        bio.set_ctx(STAGE_DATA);
        bio.pending = 1;
        let p = bio.into_raw();
        split(tio, p);
        return put_parent(p, true);
    }
    bio.pop_end_io();
    tio.done(&bio);
    bio.endio();
}
