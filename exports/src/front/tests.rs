//! The front over a memory device whose limits, capabilities and timing the
//! tests choose: 4 KiB blocks, 8 KiB bios at most, a volatile cache without
//! native FUA; bios are held until the test lets them complete.

// Test support: a failed setup step is a test failure.
#![allow(clippy::unwrap_used)]

use std::any::Any;
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::{Arc, Mutex};

use udm_core::{
    check_bio, BioFlags, BioPtr, BlockDevice, Caps, Channel, CompletionMode, Error, Limits, Op,
    Reactor, ReactorConfig, Status, SECTOR_SHIFT,
};

use super::*;

const BS: u32 = 4096;
const MAX_IO: u32 = 8192;
const SIZE: usize = 256 << 10;

/// What reached the device, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Logged {
    op: Op,
    off: u64,
    len: u32,
    flags: BioFlags,
    /// The segment's address (0 for dataless bios).
    base: usize,
    /// Segments.
    segs: usize,
}

struct MemDev {
    data: Mutex<Vec<u8>>,
    log: Mutex<Vec<Logged>>,
    /// Writes from this byte offset on fail with EIO.
    fail_from: u64,
    /// Reports that merging helps it ([`Caps::MERGE`]).
    merge: bool,
    /// Most segments in one bio.
    max_segments: u32,
}

impl MemDev {
    fn new() -> Arc<MemDev> {
        Arc::new(MemDev {
            data: Mutex::new(vec![0; SIZE]),
            log: Mutex::new(Vec::new()),
            fail_from: u64::MAX,
            merge: false,
            max_segments: 1024,
        })
    }
    /// A device that reports that merging helps it ([`Caps::MERGE`]).
    fn merging() -> Arc<MemDev> {
        Arc::new(MemDev {
            merge: true,
            ..Arc::into_inner(MemDev::new()).unwrap()
        })
    }
    fn log(&self) -> Vec<Logged> {
        self.log.lock().unwrap().clone()
    }
}

struct MemChan {
    dev: Arc<MemDev>,
    /// Submitted, not yet completed.
    held: RefCell<Vec<BioPtr>>,
}

impl BlockDevice for MemDev {
    fn name(&self) -> &str {
        "mem"
    }
    fn limits(&self) -> Limits {
        Limits {
            logical_block_size: BS,
            physical_block_size: BS,
            max_io_bytes: MAX_IO,
            max_segments: self.max_segments,
            ..Limits::new(SIZE as u64 >> SECTOR_SHIFT)
        }
    }
    fn caps(&self) -> Caps {
        let caps = Caps::FLUSH | Caps::DISCARD | Caps::WRITE_ZEROES;
        if self.merge {
            caps | Caps::MERGE
        } else {
            caps
        }
    }
    fn open(self: Arc<Self>, _: &Reactor) -> Result<Rc<dyn Channel>, Error> {
        Ok(Rc::new(MemChan {
            dev: self,
            held: RefCell::new(Vec::new()),
        }))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Channel for MemChan {
    fn submit(&self, bio: BioPtr) {
        let Some(bio) = check_bio(bio, &self.dev.limits(), self.dev.caps()) else {
            return;
        };
        self.dev.log.lock().unwrap().push(Logged {
            op: bio.op,
            off: bio.sector << SECTOR_SHIFT,
            len: bio.len(),
            flags: bio.flags,
            base: bio.segs().first().map_or(0, |s| s.base as usize),
            segs: bio.nr_segs(),
        });
        self.held.borrow_mut().push(bio);
    }
}

impl MemChan {
    /// Completes every bio held, doing its I/O now (as a device would
    /// when it completes it).
    fn release(&self) -> usize {
        let bios = std::mem::take(&mut *self.held.borrow_mut());
        let n = bios.len();
        for bio in bios {
            let off = (bio.sector << SECTOR_SHIFT) as usize;
            let len = bio.len() as usize;
            let mut data = self.dev.data.lock().unwrap();
            let st = match bio.op {
                Op::Write if off as u64 >= self.dev.fail_from => Status::IoErr,
                Op::Write => {
                    bio.copy_out(0, &mut data[off..off + len]);
                    Status::Ok
                }
                Op::Read => {
                    bio.copy_in(0, &data[off..off + len]);
                    Status::Ok
                }
                Op::WriteZeroes | Op::Discard => {
                    data[off..off + len].fill(0);
                    Status::Ok
                }
                Op::Flush => Status::Ok,
            };
            drop(data);
            bio.complete(st);
        }
        n
    }
}

/// The requests finished, as (token, result), in order.
type DoneList = RefCell<Vec<(u64, Result<(), FrontError>)>>;

/// A front over a fresh [`MemDev`] on a reactor of this thread.
struct Rig {
    /// Boxed: the front keeps its address.
    reactor: Box<Reactor>,
    dev: Arc<MemDev>,
    chan: Rc<MemChan>,
    front: Option<Rc<Front>>,
    done: Rc<DoneList>,
}

impl Rig {
    fn new(dev: Arc<MemDev>) -> Rig {
        let reactor = Box::new(
            Reactor::new(ReactorConfig {
                mode: CompletionMode::Poll,
                ..ReactorConfig::default()
            })
            .unwrap(),
        );
        let chan = Rc::new(MemChan {
            dev: dev.clone(),
            held: RefCell::new(Vec::new()),
        });
        // SAFETY: the rig drops the front before the reactor (Drop below).
        let front = unsafe { Front::new(&reactor, &*dev, chan.clone()) };
        Rig {
            reactor,
            dev,
            chan,
            front: Some(front),
            done: Rc::new(RefCell::new(Vec::new())),
        }
    }

    fn front(&self) -> &Rc<Front> {
        self.front.as_ref().unwrap()
    }

    /// Submits `op` with token `token`; `buf` must outlive its completion.
    fn submit(
        &self,
        token: u64,
        op: FrontOp,
        off: u64,
        buf: &mut [u8],
        flags: ReqFlags,
    ) -> Submitted {
        let req = Request {
            op,
            offset: off,
            len: buf.len() as u32,
            flags,
            buf: buf.as_mut_ptr(),
            buf_index: udm_core::Bio::NO_BUF,
            token,
            done: record,
            ctx: Rc::as_ptr(&self.done).cast_mut().cast(),
        };
        // SAFETY: every test keeps `buf` alive and untouched until it ran
        // the request to completion.
        unsafe { self.front().submit(req) }
    }

    /// Completes what the device holds, until nothing is in flight.
    fn run(&self) {
        while self.front().in_flight() > 0 {
            self.chan.release();
            self.reactor.poll_once();
        }
    }

    /// One round: the device completes what it holds, then the reactor
    /// runs the end_ios (which may submit more).
    fn step(&self) {
        self.chan.release();
        self.reactor.poll_once();
    }

    fn results(&self) -> Vec<(u64, Result<(), FrontError>)> {
        std::mem::take(&mut *self.done.borrow_mut())
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.front = None;
    }
}

fn record(ctx: *mut (), d: Done<'_>) {
    // SAFETY: ctx is the rig's `done` list, alive for the whole test.
    let done = unsafe { &*(ctx as *const DoneList) };
    done.borrow_mut().push((d.token, d.result));
}

fn pattern(seed: u8, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn aligned_requests_are_split_at_the_device_limit_and_not_copied() {
    let rig = Rig::new(MemDev::new());
    let mut w = pattern(1, 20 << 10);
    assert_eq!(
        rig.submit(1, FrontOp::Write, 8192, &mut w, ReqFlags::default()),
        Submitted::Later
    );
    rig.run();
    let base = w.as_ptr() as usize;
    let log = rig.dev.log();
    let got: Vec<(Op, u64, u32, usize)> =
        log.iter().map(|l| (l.op, l.off, l.len, l.base)).collect();
    assert_eq!(
        got,
        vec![
            (Op::Write, 8192, 8192, base),
            (Op::Write, 16384, 8192, base + 8192),
            (Op::Write, 24576, 4096, base + 16384),
        ]
    );
    let mut r = vec![0u8; 20 << 10];
    rig.submit(2, FrontOp::Read, 8192, &mut r, ReqFlags::default());
    rig.run();
    assert_eq!(r, w);
    assert_eq!(rig.results(), vec![(1, Ok(())), (2, Ok(()))]);
}

#[test]
fn fua_on_a_device_without_it_completes_after_a_flush_that_follows_the_write() {
    let rig = Rig::new(MemDev::new());
    let mut w = pattern(2, 16 << 10);
    let fua = ReqFlags {
        fua: true,
        ..ReqFlags::default()
    };
    rig.submit(7, FrontOp::Write, 0, &mut w, fua);
    rig.step(); // the writes complete; the flush goes out
    assert!(rig.results().is_empty(), "done before the flush");
    let ops: Vec<Op> = rig.dev.log().iter().map(|l| l.op).collect();
    assert_eq!(ops, vec![Op::Write, Op::Write, Op::Flush]);
    assert!(rig
        .dev
        .log()
        .iter()
        .all(|l| !l.flags.contains(BioFlags::FUA)));
    rig.run();
    assert_eq!(rig.results(), vec![(7, Ok(()))]);
}

#[test]
fn sub_block_reads_and_writes_match_a_byte_model() {
    let rig = Rig::new(MemDev::new());
    let mut model = vec![0u8; SIZE];
    let mut seed = 0x1234_5678u64;
    let mut next = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    for i in 0..300u64 {
        let len = 1 + next(3 * BS as u64) as usize;
        let off = next((SIZE - len) as u64);
        if i % 3 == 0 {
            let mut r = vec![0xeeu8; len];
            assert_eq!(
                rig.submit(i, FrontOp::Read, off, &mut r, ReqFlags::default()),
                Submitted::Later
            );
            rig.run();
            assert_eq!(
                r,
                model[off as usize..off as usize + len],
                "read {len} at {off}"
            );
        } else if i % 7 == 0 {
            let mut z = vec![0u8; len];
            rig.submit(i, FrontOp::WriteZeroes, off, &mut z, ReqFlags::default());
            rig.run();
            model[off as usize..off as usize + len].fill(0);
        } else {
            let mut w = pattern(i as u8, len);
            rig.submit(i, FrontOp::Write, off, &mut w, ReqFlags::default());
            rig.run();
            model[off as usize..off as usize + len].copy_from_slice(&w);
        }
    }
    assert_eq!(*rig.dev.data.lock().unwrap(), model);
    assert!(rig.results().iter().all(|(_, r)| r.is_ok()));
    // The classic pair: read 1000 bytes at 1, write 5 bytes at 3.
    let mut five = *b"hello";
    rig.submit(1, FrontOp::Write, 3, &mut five, ReqFlags::default());
    rig.run();
    model[3..8].copy_from_slice(b"hello");
    let mut r = vec![0u8; 1000];
    rig.submit(2, FrontOp::Read, 1, &mut r, ReqFlags::default());
    rig.run();
    assert_eq!(r, model[1..1001]);
}

#[test]
fn a_sub_block_write_waits_for_the_writes_it_overlaps_and_holds_back_later_ones() {
    let rig = Rig::new(MemDev::new());
    let none = ReqFlags::default();
    // An aligned write of block 1 is in flight.
    let mut a = pattern(1, BS as usize);
    rig.submit(1, FrontOp::Write, BS as u64, &mut a, none);
    // A sub-block write inside block 1 must not read the block yet.
    let mut b = *b"BBBB";
    rig.submit(2, FrontOp::Write, BS as u64 + 10, &mut b, none);
    // A later aligned write to block 1 waits behind the sub-block one; one
    // to block 3 does not.
    let mut c = pattern(3, BS as usize);
    rig.submit(3, FrontOp::Write, BS as u64, &mut c, none);
    let mut d = pattern(4, BS as usize);
    rig.submit(4, FrontOp::Write, 3 * BS as u64, &mut d, none);
    let offs: Vec<(Op, u64)> = rig.dev.log().iter().map(|l| (l.op, l.off)).collect();
    assert_eq!(offs, vec![(Op::Write, 4096), (Op::Write, 12288)]);
    rig.step(); // 1 and 4 complete; 2 reads block 1
    assert_eq!(rig.results(), vec![(1, Ok(())), (4, Ok(()))]);
    rig.step(); // 2 writes block 1 back
    rig.step(); // 2 completes; 3 goes
    rig.run();
    assert_eq!(rig.results(), vec![(2, Ok(())), (3, Ok(()))]);
    let offs: Vec<(Op, u64)> = rig.dev.log().iter().map(|l| (l.op, l.off)).collect();
    assert_eq!(
        offs,
        vec![
            (Op::Write, 4096),
            (Op::Write, 12288),
            (Op::Read, 4096),
            (Op::Write, 4096),
            (Op::Write, 4096)
        ]
    );
    // The last writer of block 1 wins whole: 2's patch went over 1's data.
    assert_eq!(rig.dev.data.lock().unwrap()[4096..8192], c[..]);
}

#[test]
fn two_sub_block_writes_to_one_block_both_land() {
    let rig = Rig::new(MemDev::new());
    let none = ReqFlags::default();
    let mut x = *b"xxxx";
    let mut y = *b"yy";
    rig.submit(1, FrontOp::Write, 100, &mut x, none);
    rig.submit(2, FrontOp::Write, 4000, &mut y, none);
    rig.run();
    let data = rig.dev.data.lock().unwrap();
    assert_eq!(&data[100..104], b"xxxx");
    assert_eq!(&data[4000..4002], b"yy");
}

#[test]
fn errors_and_refusals_reach_the_export_as_front_errors() {
    let dev = Arc::new(MemDev {
        fail_from: 64 << 10,
        ..Arc::into_inner(MemDev::new()).unwrap()
    });
    let rig = Rig::new(dev);
    let none = ReqFlags::default();
    let mut w = vec![1u8; BS as usize];
    rig.submit(1, FrontOp::Write, 64 << 10, &mut w, none);
    rig.run();
    assert_eq!(rig.results(), vec![(1, Err(FrontError::Io))]);
    let fast = ReqFlags {
        fast_zero: true,
        ..none
    };
    let mut z = vec![0u8; 10];
    assert_eq!(
        rig.submit(2, FrontOp::WriteZeroes, 5, &mut z, fast),
        Submitted::Now(Err(FrontError::NotFast))
    );
    let mut r = vec![0u8; 8];
    assert_eq!(
        rig.submit(3, FrontOp::Read, SIZE as u64 - 4, &mut r, none),
        Submitted::Now(Err(FrontError::Invalid))
    );
    assert_eq!(
        rig.submit(4, FrontOp::Read, 0, &mut [], none),
        Submitted::Now(Ok(()))
    );
    // A sub-block discard covering no whole block does nothing; one that
    // covers some discards only those.
    let mut d = vec![0u8; 100];
    assert_eq!(
        rig.submit(5, FrontOp::Discard, 10, &mut d, none),
        Submitted::Now(Ok(()))
    );
    let mut d = vec![0u8; 3 * BS as usize];
    rig.submit(6, FrontOp::Discard, 10, &mut d, none);
    rig.run();
    let last = rig.dev.log().pop().unwrap();
    assert_eq!((last.op, last.off, last.len), (Op::Discard, 4096, 8192));
    assert_eq!(
        FrontError::from_status(Status::NotSupp, none),
        FrontError::NotSupported
    );
}

#[test]
fn steady_state_recycles_slots_and_bounce_buffers() {
    let rig = Rig::new(MemDev::new());
    let mut w = pattern(9, 100);
    rig.submit(0, FrontOp::Write, 7, &mut w, ReqFlags::default());
    rig.run();
    let slots = rig.front().slots.borrow().capacity();
    for i in 1..10 {
        rig.submit(i, FrontOp::Write, 7, &mut w, ReqFlags::default());
        rig.run();
    }
    // Neither the slab nor the bounce pool grew after the first request.
    assert_eq!(rig.front().slots.borrow().capacity(), slots);
    assert_eq!(rig.front().slots.borrow().len(), 0);
    assert_eq!(rig.front().bounces.borrow().len(), 1);
}

// ---------------------------------------------------------------------------
// Dispatch (seed 004)
// ---------------------------------------------------------------------------

/// (op, offset, length, segments) of what reached the device.
fn shapes(dev: &MemDev) -> Vec<(Op, u64, u32, usize)> {
    dev.log()
        .iter()
        .map(|l| (l.op, l.off, l.len, l.segs))
        .collect()
}

fn queued_rig(dev: Arc<MemDev>) -> Rig {
    let rig = Rig::new(dev);
    rig.front().set_dispatch(Dispatch::Queued);
    rig
}

#[test]
fn direct_sends_each_request_as_it_arrives_and_unplug_has_nothing_to_do() {
    let rig = Rig::new(MemDev::new());
    assert_eq!(rig.front().dispatch(), Dispatch::Direct);
    let none = ReqFlags::default();
    let (mut a, mut b) = (pattern(1, BS as usize), pattern(2, BS as usize));
    rig.submit(1, FrontOp::Write, 0, &mut a, none);
    assert_eq!(shapes(&rig.dev), vec![(Op::Write, 0, BS, 1)]);
    rig.submit(2, FrontOp::Write, BS as u64, &mut b, none);
    rig.front().unplug();
    assert_eq!(
        shapes(&rig.dev),
        vec![(Op::Write, 0, BS, 1), (Op::Write, BS as u64, BS, 1)],
        "adjacent writes stay two bios"
    );
    rig.run();
    assert_eq!(rig.results(), vec![(1, Ok(())), (2, Ok(()))]);
}

#[test]
fn queued_holds_a_batch_and_merges_adjacent_requests_up_to_the_max_io_size() {
    let rig = queued_rig(MemDev::new());
    let none = ReqFlags::default();
    let mut w: Vec<Vec<u8>> = (0..5).map(|i| pattern(i, BS as usize)).collect();
    // Out of order: 3, 0, 2, 4, 1 (blocks 0..5 of 4 KiB; bios of 8 KiB).
    for &k in &[3usize, 0, 2, 4, 1] {
        let off = k as u64 * BS as u64;
        let r = rig.submit(k as u64, FrontOp::Write, off, &mut w[k], none);
        assert_eq!(r, Submitted::Later);
    }
    assert!(rig.dev.log().is_empty(), "nothing goes before unplug");
    rig.front().unplug();
    let b = BS as u64;
    assert_eq!(
        shapes(&rig.dev),
        vec![
            (Op::Write, 0, MAX_IO, 2),
            (Op::Write, 2 * b, MAX_IO, 2),
            (Op::Write, 4 * b, BS, 1),
        ]
    );
    // Each segment is the request's own buffer: nothing copied.
    assert_eq!(rig.dev.log()[0].base, w[0].as_ptr() as usize);
    rig.run();
    let mut got = rig.results();
    got.sort_by_key(|d| d.0);
    assert_eq!(got, (0..5).map(|k| (k, Ok(()))).collect::<Vec<_>>());
    assert_eq!(rig.front().in_flight(), 0);

    // Reads merge too, and the merged read's data lands in each buffer.
    let mut r: Vec<Vec<u8>> = (0..5).map(|_| vec![0u8; BS as usize]).collect();
    for (k, buf) in r.iter_mut().enumerate().rev() {
        rig.submit(10 + k as u64, FrontOp::Read, k as u64 * b, buf, none);
    }
    rig.front().unplug();
    let reads: Vec<_> = shapes(&rig.dev)
        .into_iter()
        .filter(|s| s.0 == Op::Read)
        .collect();
    assert_eq!(
        reads,
        vec![
            (Op::Read, 0, MAX_IO, 2),
            (Op::Read, 2 * b, MAX_IO, 2),
            (Op::Read, 4 * b, BS, 1)
        ]
    );
    rig.run();
    assert_eq!(r, w, "each request reads its own block back");
}

#[test]
fn queued_does_not_merge_across_a_gap_or_across_ops() {
    let rig = queued_rig(MemDev::new());
    let none = ReqFlags::default();
    let b = BS as u64;
    let mut bufs: Vec<Vec<u8>> = (0..4).map(|i| pattern(i, BS as usize)).collect();
    let [w0, r1, w3, w1] = &mut bufs[..] else {
        unreachable!()
    };
    rig.submit(0, FrontOp::Write, 0, w0, none);
    rig.submit(1, FrontOp::Read, b, r1, none); // a read between two writes
    rig.submit(2, FrontOp::Write, 3 * b, w3, none); // a gap at block 2
    rig.submit(3, FrontOp::Write, 5 * b, w1, none);
    rig.front().unplug();
    assert_eq!(
        shapes(&rig.dev),
        vec![
            (Op::Read, b, BS, 1),
            (Op::Write, 0, BS, 1),
            (Op::Write, 3 * b, BS, 1),
            (Op::Write, 5 * b, BS, 1),
        ]
    );
    rig.run();
    assert_eq!(rig.results().len(), 4);
}

#[test]
fn an_error_on_a_merged_bio_fails_each_request_in_it_and_no_other() {
    let dev = Arc::new(MemDev {
        fail_from: 64 << 10,
        ..Arc::into_inner(MemDev::new()).unwrap()
    });
    let rig = queued_rig(dev);
    let none = ReqFlags::default();
    let mut bufs: Vec<Vec<u8>> = (0..3).map(|i| pattern(i, BS as usize)).collect();
    let [a, b, c] = &mut bufs[..] else {
        unreachable!()
    };
    rig.submit(1, FrontOp::Write, 64 << 10, a, none);
    rig.submit(2, FrontOp::Write, (64 << 10) + BS as u64, b, none);
    rig.submit(3, FrontOp::Write, 0, c, none);
    rig.front().unplug();
    assert_eq!(
        shapes(&rig.dev),
        vec![(Op::Write, 0, BS, 1), (Op::Write, 64 << 10, MAX_IO, 2)]
    );
    rig.run();
    let mut got = rig.results();
    got.sort_by_key(|d| d.0);
    assert_eq!(
        got,
        vec![
            (1, Err(FrontError::Io)),
            (2, Err(FrontError::Io)),
            (3, Ok(()))
        ]
    );
}

#[test]
fn queued_fua_writes_merge_and_each_still_completes_after_its_flush() {
    // The device has no native FUA: the bios carry no FUA flag, so a FUA
    // write merges with a plain one, and only the FUA one waits for a flush.
    let rig = queued_rig(MemDev::new());
    let fua = ReqFlags {
        fua: true,
        ..ReqFlags::default()
    };
    let mut bufs: Vec<Vec<u8>> = (0..2).map(|i| pattern(i, BS as usize)).collect();
    let [a, b] = &mut bufs[..] else {
        unreachable!()
    };
    rig.submit(1, FrontOp::Write, 0, a, fua);
    rig.submit(2, FrontOp::Write, BS as u64, b, ReqFlags::default());
    rig.front().unplug();
    rig.step();
    assert_eq!(rig.results(), vec![(2, Ok(()))], "the FUA write waits");
    assert_eq!(
        shapes(&rig.dev),
        vec![(Op::Write, 0, MAX_IO, 2), (Op::Flush, 0, 0, 0)]
    );
    rig.run();
    assert_eq!(rig.results(), vec![(1, Ok(()))]);
}

#[test]
fn queued_sends_at_once_what_one_bio_cannot_carry() {
    let rig = queued_rig(MemDev::new());
    let none = ReqFlags::default();
    let mut big = pattern(1, 2 * MAX_IO as usize);
    rig.submit(1, FrontOp::Write, 0, &mut big, none);
    let mut odd = pattern(2, 100);
    rig.submit(2, FrontOp::Write, 100 << 10, &mut odd, none); // sub-block: RMW
    rig.submit(3, FrontOp::Flush, 0, &mut [], none);
    let mut z = vec![0u8; BS as usize];
    rig.submit(4, FrontOp::WriteZeroes, 128 << 10, &mut z, none);
    let ops: Vec<Op> = rig.dev.log().iter().map(|l| l.op).collect();
    assert_eq!(
        ops,
        vec![Op::Write, Op::Write, Op::Read, Op::Flush, Op::WriteZeroes],
        "nothing held"
    );
    rig.run();
    assert_eq!(rig.results().len(), 4);
}

#[test]
fn auto_queues_only_where_the_device_reports_that_merging_helps() {
    let rig = Rig::new(MemDev::new());
    rig.front().set_dispatch(Dispatch::Auto);
    assert_eq!(rig.front().dispatch(), Dispatch::Auto, "chosen per request");
    let dev = MemDev::merging();
    let rig = Rig::new(dev);
    rig.front().set_dispatch(Dispatch::Auto);
    assert_eq!(rig.front().dispatch(), Dispatch::Queued);
    // Back to direct: what was held goes at once.
    let mut w = pattern(1, BS as usize);
    rig.submit(1, FrontOp::Write, 0, &mut w, ReqFlags::default());
    assert!(rig.dev.log().is_empty());
    rig.front().set_dispatch(Dispatch::Direct);
    assert_eq!(shapes(&rig.dev), vec![(Op::Write, 0, BS, 1)]);
    rig.run();
    assert_eq!(rig.results(), vec![(1, Ok(()))]);
}

#[test]
fn auto_where_merging_helps_goes_direct_while_direct_serves_more_and_back_when_not() {
    let dev = MemDev::merging();
    let rig = Rig::new(dev);
    let front = rig.front();
    let report = Arc::new(AutoReport::default());
    front.set_report(report.clone());
    front.set_dispatch(Dispatch::Auto);
    assert_eq!(
        front.dispatch(),
        Dispatch::Queued,
        "the device's report first"
    );
    assert_eq!(report.counts().queued_now, 1);
    // The trial on the test's clock, an hour ahead of the real one: the
    // unplugs the front makes itself never end an epoch.
    let mut now = Instant::now() + std::time::Duration::from_secs(3600);
    front
        .trial
        .set(Some(AutoTrial::new(now, front.taken.get())));
    let mut bufs: Vec<Vec<u8>> = (0..256).map(|_| vec![0; BS as usize]).collect();
    // One epoch of a workload that takes `queued` reads in queued epochs
    // and `direct` in direct ones, in batches of 8 (each unplugged and
    // completed); the epoch ends at the next batch's end. Returns the
    // mode the trial chose for the next epoch.
    let mut epoch = |queued: usize, direct: usize| {
        let n = if front.dispatch() == Dispatch::Queued {
            queued
        } else {
            direct
        };
        for (i, b) in bufs[..n].iter_mut().enumerate() {
            let off = (i as u64 % 64) * BS as u64;
            rig.submit(i as u64, FrontOp::Read, off, b, ReqFlags::default());
            if i % 8 == 7 {
                front.unplug();
                rig.run();
            }
        }
        front.unplug();
        rig.run();
        rig.results();
        now += udm_core::dispatch::EPOCH;
        front.weigh(now);
        front.dispatch()
    };
    // Direct serves twice queued's rate: chosen within a few epochs.
    let modes: Vec<Dispatch> = (0..20).map(|_| epoch(100, 200)).collect();
    assert_eq!(modes.last(), Some(&Dispatch::Direct), "{modes:?}");
    let (q, d) = front.auto_epochs().unwrap();
    assert!(d > q, "{q} queued, {d} direct");
    // The export's report says so: the front runs direct now, and the
    // epochs it ran each way.
    assert_eq!(
        report.counts(),
        AutoCounts {
            queued_now: 0,
            direct_now: 1,
            queued_epochs: q,
            direct_epochs: d,
        }
    );
    // In direct mode a batch goes as it comes: one bio per read.
    rig.dev.log.lock().unwrap().clear();
    let mut b = vec![0; 2 * BS as usize];
    let (lo, hi) = b.split_at_mut(BS as usize);
    rig.submit(1, FrontOp::Read, 0, lo, ReqFlags::default());
    rig.submit(2, FrontOp::Read, BS as u64, hi, ReqFlags::default());
    assert_eq!(shapes(&rig.dev).len(), 2);
    front.unplug();
    rig.run();
    rig.results();
    // Queued serves twice direct's: back to queued by the next try.
    let modes: Vec<Dispatch> = (0..66).map(|_| epoch(200, 100)).collect();
    assert_eq!(modes.last(), Some(&Dispatch::Queued), "{modes:?}");
    // Asked for direct: the trial ends.
    front.set_dispatch(Dispatch::Direct);
    assert_eq!(front.auto_epochs(), None);
    let c = report.counts();
    assert_eq!((c.queued_now, c.direct_now), (0, 0), "no trial runs");
    assert!(c.queued_epochs > q && c.direct_epochs >= d, "{c:?}");
}

#[test]
fn a_front_that_goes_leaves_its_export_report() {
    let dev = MemDev::merging();
    let report = Arc::new(AutoReport::default());
    {
        let rig = Rig::new(dev);
        // Set after the dispatch, the report still counts the trial.
        rig.front().set_dispatch(Dispatch::Auto);
        rig.front().set_report(report.clone());
        assert_eq!(report.counts().queued_now, 1);
    }
    assert_eq!(report.counts(), AutoCounts::default());
}

#[test]
fn stream_holds_only_what_continues_the_request_before_and_sends_the_rest_as_it_comes() {
    let rig = Rig::new(MemDev::new());
    rig.front().set_dispatch(Dispatch::Stream);
    let none = ReqFlags::default();
    let b = BS as u64;
    let mut w: Vec<Vec<u8>> = (0..6).map(|i| pattern(i, BS as usize)).collect();
    // 5 goes at once (nothing before it); 6 and 7 continue it and are
    // held as one run; 8 continues too, but the run is a full bio (MAX_IO
    // is two blocks), so 6+7 go and 8 is held; 3 does not continue 8: 8
    // goes, then 3 at once; 2 (before 3) is not merged backwards: stream
    // mode does not sort.
    let order = [5u64, 6, 7, 8, 3, 2];
    let mut sent = vec![];
    for (k, &blk) in order.iter().enumerate() {
        rig.submit(k as u64, FrontOp::Write, blk * b, &mut w[k], none);
        sent.push(shapes(&rig.dev).len());
    }
    assert_eq!(sent, vec![1, 1, 1, 2, 4, 5], "bios sent after each request");
    rig.front().unplug();
    assert_eq!(
        shapes(&rig.dev),
        vec![
            (Op::Write, 5 * b, BS, 1),
            (Op::Write, 6 * b, MAX_IO, 2),
            (Op::Write, 8 * b, BS, 1),
            (Op::Write, 3 * b, BS, 1),
            (Op::Write, 2 * b, BS, 1),
        ]
    );
    rig.run();
    let mut got = rig.results();
    got.sort_by_key(|d| d.0);
    assert_eq!(got, (0..6).map(|k| (k, Ok(()))).collect::<Vec<_>>());
    {
        let data = rig.dev.data.lock().unwrap();
        for (k, &blk) in order.iter().enumerate() {
            let o = (blk * b) as usize;
            assert_eq!(&data[o..o + BS as usize], &w[k][..], "block {blk}");
        }
    }

    // A read right after a write that it continues is another class: the
    // held write goes, the read is held until the batch's end.
    let mut w3 = pattern(9, BS as usize);
    let mut r = vec![0u8; BS as usize];
    rig.submit(20, FrontOp::Write, 3 * b, &mut w3, none);
    assert_eq!(shapes(&rig.dev).len(), 5, "the write continues 2: held");
    rig.submit(21, FrontOp::Read, 4 * b, &mut r, none);
    assert_eq!(shapes(&rig.dev).len(), 6, "the read sends the write");
    rig.front().unplug();
    let tail: Vec<_> = shapes(&rig.dev).into_iter().skip(5).collect();
    assert_eq!(
        tail,
        vec![(Op::Write, 3 * b, BS, 1), (Op::Read, 4 * b, BS, 1)]
    );
    rig.run();
    assert_eq!(rig.results().len(), 2);
}

#[test]
fn auto_holds_a_request_only_while_it_continues_the_one_before_and_others_are_in_flight() {
    let rig = Rig::new(MemDev::new());
    rig.front().set_dispatch(Dispatch::Auto);
    let none = ReqFlags::default();
    let b = BS as u64;
    let mut w: Vec<Vec<u8>> = (0..8).map(|i| pattern(i, BS as usize)).collect();
    let mut w = w.iter_mut();
    let mut next = || w.next().unwrap();
    // Lone requests (nothing else in flight) go at once, sequential or not:
    // holding one could merge it with nothing.
    rig.submit(0, FrontOp::Write, 0, next(), none);
    assert_eq!(shapes(&rig.dev).len(), 1, "the first went at once");
    rig.run();
    rig.submit(1, FrontOp::Write, b, next(), none);
    assert_eq!(shapes(&rig.dev).len(), 2, "a lone sequential one too");
    // With 1 in flight, 2 continues it: held, and 3 joins it (a full bio:
    // MAX_IO is two blocks).
    rig.submit(2, FrontOp::Write, 2 * b, next(), none);
    rig.submit(3, FrontOp::Write, 3 * b, next(), none);
    assert_eq!(shapes(&rig.dev).len(), 2, "2 and 3 held as one run");
    rig.front().unplug();
    assert_eq!(shapes(&rig.dev)[2], (Op::Write, 2 * b, MAX_IO, 2));
    // 4 continues 3 and is held; 7 does not continue it but follows a
    // held run: a stream's jump, held where it lands (4 goes first).
    rig.submit(4, FrontOp::Write, 4 * b, next(), none);
    assert_eq!(shapes(&rig.dev).len(), 3, "4 held");
    rig.submit(5, FrontOp::Write, 7 * b, next(), none);
    assert_eq!(shapes(&rig.dev)[3..], [(Op::Write, 4 * b, BS, 1)], "7 held");
    // 5 continues neither 7 nor a run: it goes at once, though others
    // are in flight, sending 7 first.
    rig.submit(6, FrontOp::Write, 5 * b, next(), none);
    assert_eq!(
        shapes(&rig.dev)[4..],
        [(Op::Write, 7 * b, BS, 1), (Op::Write, 5 * b, BS, 1)]
    );
    rig.front().unplug();
    assert_eq!(shapes(&rig.dev).len(), 6, "nothing was left held");
    rig.run();
    let mut got = rig.results();
    got.sort_by_key(|d| d.0);
    assert_eq!(got, (0..7).map(|k| (k, Ok(()))).collect::<Vec<_>>());
    let data = rig.dev.data.lock().unwrap();
    for (k, blk) in [0u64, 1, 2, 3, 4, 7, 5].into_iter().enumerate() {
        let o = (blk * b) as usize;
        assert_eq!(
            data[o..o + BS as usize],
            pattern(k as u8, BS as usize)[..],
            "block {blk}"
        );
    }
}

#[test]
fn auto_merges_a_sequential_stream_across_its_jump_and_scattered_requests_go_direct_after_one() {
    let rig = Rig::new(MemDev::new());
    rig.front().set_dispatch(Dispatch::Auto);
    let none = ReqFlags::default();
    let b = BS as u64;
    let mut w: Vec<Vec<u8>> = (0..7).map(|i| pattern(i, BS as usize)).collect();
    let blocks = [20u64, 21, 0, 1, 40, 9, 30];
    let mut sent = vec![];
    for (k, buf) in w.iter_mut().enumerate() {
        rig.submit(k as u64, FrontOp::Write, blocks[k] * b, buf, none);
        sent.push(shapes(&rig.dev));
        if k == 3 {
            // The batch's end.
            rig.front().unplug();
            sent.push(shapes(&rig.dev));
        }
    }
    let w1 = |blk: u64| (Op::Write, blk * b, BS, 1);
    // 20 is alone in flight: it goes. 21 continues it: held. 0 is the
    // stream wrapping to the device's start: held where it lands (21 goes),
    // and 1 joins it, so the batch's end sends 0 and 1 as one bio, as
    // queued dispatch would (sent direct, 0 would go alone and 1 after it).
    assert_eq!(sent[0], [w1(20)]);
    assert_eq!(sent[1], [w1(20)], "21 held");
    assert_eq!(sent[2], [w1(20), w1(21)], "the jump to 0 held, 21 sent");
    assert_eq!(sent[3], [w1(20), w1(21)], "1 joins 0");
    assert_eq!(sent[4], [w1(20), w1(21), (Op::Write, 0, MAX_IO, 2)]);
    // The run went on to the batch's end: 40, the next batch's first, is
    // held wherever it starts; 9 does not continue it (40 goes, 9 is held:
    // it may start a run); 30 continues nothing held: scattered requests are
    // back on direct's path (9 goes first, then 30).
    assert_eq!(sent[5].len(), 3, "40 held");
    assert_eq!(sent[6][3..], [w1(40)], "9 held, 40 sent");
    assert_eq!(sent[7][3..], [w1(40), w1(9), w1(30)], "30 direct");
    rig.front().unplug();
    assert_eq!(shapes(&rig.dev).len(), 6, "nothing was left held");
    rig.run();
    let mut got = rig.results();
    got.sort_by_key(|d| d.0);
    assert_eq!(got, (0..7).map(|k| (k, Ok(()))).collect::<Vec<_>>());
    let data = rig.dev.data.lock().unwrap();
    for (k, &blk) in blocks.iter().enumerate() {
        let o = (blk * b) as usize;
        assert_eq!(data[o..o + BS as usize], w[k][..], "block {blk}");
    }
}

/// Three back-to-back 1-block reads that allow lending, in stream mode on
/// `dev`, into `bufs` (which must outlive them); returns the rig (nothing
/// unplugged yet) and how many bios had gone down after each read.
fn stream_lendable_reads(dev: Arc<MemDev>, bufs: &mut [Vec<u8>; 3]) -> (Rig, Vec<usize>) {
    let rig = Rig::new(dev);
    rig.front().set_dispatch(Dispatch::Stream);
    let lend = ReqFlags {
        may_lend: true,
        ..ReqFlags::default()
    };
    let mut sent = vec![];
    for (k, buf) in bufs.iter_mut().enumerate() {
        rig.submit(k as u64, FrontOp::Read, k as u64 * BS as u64, buf, lend);
        sent.push(shapes(&rig.dev).len());
    }
    (rig, sent)
}

#[test]
fn stream_merges_reads_that_allow_lending_where_merging_helps_the_device() {
    // A device that merging helps (a file, a network disk) lends nothing:
    // reads that would allow it merge as any others.
    let mut bufs = [(); 3].map(|_| vec![0u8; BS as usize]);
    let (rig, _) = stream_lendable_reads(MemDev::merging(), &mut bufs);
    rig.front().unplug();
    let b = BS as u64;
    assert_eq!(
        shapes(&rig.dev),
        vec![(Op::Read, 0, BS, 1), (Op::Read, b, MAX_IO, 2)],
        "the first went at once, the two after it as one bio"
    );
    rig.run();
    assert_eq!(rig.results().len(), 3);
}

#[test]
fn stream_sends_a_read_the_device_may_lend_to_alone() {
    // A merged bio cannot be lent: stream mode does not hold such reads,
    // even back to back, so each can be served from the device's memory.
    let mut bufs = [(); 3].map(|_| vec![0u8; BS as usize]);
    let (rig, sent) = stream_lendable_reads(MemDev::new(), &mut bufs);
    assert_eq!(sent, vec![1, 2, 3], "each read went at once");
    rig.run();
    assert_eq!(rig.results().len(), 3);
}

#[test]
fn switching_mode_sends_what_is_held() {
    let rig = Rig::new(MemDev::new());
    rig.front().set_dispatch(Dispatch::Stream);
    let mut w: Vec<Vec<u8>> = (0..2).map(|i| pattern(i, BS as usize)).collect();
    for (k, buf) in w.iter_mut().enumerate() {
        let off = k as u64 * BS as u64;
        rig.submit(k as u64, FrontOp::Write, off, buf, ReqFlags::default());
    }
    assert_eq!(shapes(&rig.dev).len(), 1, "the second may still grow a run");
    rig.front().set_dispatch(Dispatch::Queued);
    assert_eq!(
        shapes(&rig.dev),
        vec![(Op::Write, 0, BS, 1), (Op::Write, BS as u64, BS, 1)]
    );
    rig.run();
    assert_eq!(rig.results().len(), 2);
}

#[test]
fn queued_steady_state_reuses_the_plug_list_and_slots() {
    let rig = queued_rig(MemDev::new());
    let mut bufs: Vec<Vec<u8>> = (0..8).map(|i| pattern(i, BS as usize)).collect();
    let mut batch = |rig: &Rig| {
        for (k, b) in bufs.iter_mut().enumerate() {
            rig.submit(
                k as u64,
                FrontOp::Write,
                k as u64 * BS as u64,
                b,
                ReqFlags::default(),
            );
        }
        rig.front().unplug();
        rig.run();
        assert_eq!(rig.results().len(), 8);
    };
    batch(&rig);
    let plug = rig.front().plug.borrow().capacity();
    let slots = rig.front().slots.borrow().capacity();
    for _ in 0..10 {
        batch(&rig);
    }
    assert_eq!(rig.front().plug.borrow().capacity(), plug);
    assert_eq!(rig.front().slots.borrow().capacity(), slots);
    assert!(rig.front().plug.borrow().is_empty());
}

#[test]
fn queued_merges_no_more_requests_than_the_device_takes_segments() {
    // A device taking one segment per bio: adjacent requests cannot
    // share one, so each is its own bio.
    let dev = Arc::new(MemDev {
        max_segments: 1,
        ..Arc::into_inner(MemDev::new()).unwrap()
    });
    let rig = queued_rig(dev);
    let mut w: Vec<Vec<u8>> = (0..3).map(|i| pattern(i, BS as usize)).collect();
    for (k, b) in w.iter_mut().enumerate() {
        rig.submit(
            k as u64,
            FrontOp::Write,
            k as u64 * BS as u64,
            b,
            ReqFlags::default(),
        );
    }
    rig.front().unplug();
    let b = BS as u64;
    assert_eq!(
        shapes(&rig.dev),
        vec![
            (Op::Write, 0, BS, 1),
            (Op::Write, b, BS, 1),
            (Op::Write, 2 * b, BS, 1)
        ]
    );
    rig.run();
    assert_eq!(rig.results().len(), 3);
}

#[test]
fn bounce_buffers_stay_within_the_budget_and_the_requests_that_wait_all_finish() {
    let rig = Rig::new(MemDev::new());
    let none = ReqFlags::default();
    let budget = Arc::new(Budget::new(64 << 10, 1));
    rig.front().set_budget(budget.clone());
    // What one holder may have: its share and half of the lent part.
    let cap = budget.share() + budget.lendable() / 2;
    let mut model = pattern(9, SIZE);
    let mut init = model.clone();
    rig.submit(0, FrontOp::Write, 0, &mut init, none);
    rig.run();
    // 48 sub-block requests at once, writes and reads at disjoint bytes
    // (neighbours share blocks): 48 bounces of 4-8 KiB would need far more
    // than the budget.
    let mut bufs: Vec<Vec<u8>> = (0..48).map(|i| pattern(i as u8, 3000)).collect();
    for (i, b) in bufs.iter_mut().enumerate() {
        let off = i as u64 * 5000 + 7;
        let op = if i % 2 == 0 {
            FrontOp::Write
        } else {
            FrontOp::Read
        };
        assert_eq!(rig.submit(i as u64 + 1, op, off, b, none), Submitted::Later);
    }
    let sent = rig.dev.log().len() - 32; // the 32 bios of the initial write
    assert!(
        sent < 48,
        "every request got its bounce at once ({sent} bios)"
    );
    while rig.front().in_flight() > 0 {
        assert!(
            rig.front().bounce_bytes() <= cap,
            "{} > {cap}",
            rig.front().bounce_bytes()
        );
        rig.step();
    }
    assert_eq!((rig.front().bounce_bytes(), budget.lent()), (0, 0));
    for (i, b) in bufs.iter().enumerate() {
        let off = i * 5000 + 7;
        if i % 2 == 0 {
            model[off..off + 3000].copy_from_slice(b);
        } else {
            assert_eq!(&b[..], &model[off..off + 3000], "read {i}");
        }
    }
    assert_eq!(*rig.dev.data.lock().unwrap(), model);
    let res = rig.results();
    assert_eq!(res.len(), 49);
    assert!(res.iter().all(|(_, r)| r.is_ok()));
}

#[test]
fn a_bounce_larger_than_the_budget_still_goes_when_it_is_the_fronts_only_one() {
    let rig = Rig::new(MemDev::new());
    let budget = Arc::new(Budget::new(16 << 10, 1));
    rig.front().set_budget(budget.clone());
    let mut r = vec![0u8; 100 << 10];
    rig.submit(1, FrontOp::Read, 1, &mut r, ReqFlags::default());
    rig.run();
    assert_eq!(rig.results(), vec![(1, Ok(()))]);
    assert_eq!(budget.lent(), 0);
}

/// The reads [`Front::read_direct`] sent, as (ctx, status), in order.
type DirectList = RefCell<Vec<(u64, Status)>>;

fn direct_done(bio: BioPtr) {
    // SAFETY: private is the test's list, alive for the whole test.
    let list = unsafe { &*(bio.private() as *const DirectList) };
    list.borrow_mut().push((bio.ctx(), bio.status()));
}

/// An aligned read of one bio goes straight to the device with the
/// caller's end_io and context, and takes no slot; any read the front
/// must split, bounce, refuse or (in queued and stream mode, or when auto
/// would merge it) hold is left to `submit`.
#[test]
fn read_direct_sends_one_aligned_bio_and_leaves_the_rest_to_submit() {
    let rig = Rig::new(MemDev::new());
    let mut w = pattern(9, BS as usize);
    rig.submit(1, FrontOp::Write, BS as u64, &mut w, ReqFlags::default());
    rig.run();
    let list: DirectList = RefCell::new(Vec::new());
    let private = (&list as *const DirectList).cast_mut().cast();
    let mut r = vec![0u8; MAX_IO as usize + BS as usize];
    let rp = r.as_mut_ptr();
    let direct = |off: u64, len: usize, ctx: u64| {
        // SAFETY: `r` outlives the reads, which the test runs to the end
        // before it looks at `r`; `private` is the list direct_done wants.
        unsafe {
            rig.front().read_direct(
                off,
                len as u32,
                rp,
                udm_core::Bio::NO_BUF,
                direct_done,
                private,
                ctx,
            )
        }
    };
    assert!(direct(BS as u64, BS as usize, 7));
    assert_eq!(rig.front().in_flight(), 0, "no slot taken");
    assert!(!direct(BS as u64, 512, 8), "sub-block");
    assert!(
        !direct(0, MAX_IO as usize + BS as usize, 8),
        "more than one bio"
    );
    assert!(!direct(SIZE as u64, BS as usize, 8), "past the end");
    assert!(!direct(0, 0, 8), "empty");
    while list.borrow().is_empty() {
        rig.step();
    }
    assert_eq!(*list.borrow(), vec![(7, Status::Ok)]);
    assert_eq!(r[..BS as usize], w[..]);
    assert_eq!(shapes(&rig.dev)[1..], [(Op::Read, BS as u64, BS, 1)]);

    rig.front().set_dispatch(Dispatch::Auto);
    assert!(
        direct(0, BS as usize, 9),
        "auto: a read that continues nothing"
    );
    assert!(
        !direct(BS as u64, BS as usize, 9),
        "auto: one that continues it"
    );
    rig.front().set_dispatch(Dispatch::Queued);
    assert!(!direct(3 * BS as u64, BS as usize, 9), "queued");
    rig.front().set_dispatch(Dispatch::Stream);
    assert!(!direct(3 * BS as u64, BS as usize, 9), "stream");
    while list.borrow().len() < 2 {
        rig.step();
    }
}
