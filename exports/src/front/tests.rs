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
}

struct MemDev {
    data: Mutex<Vec<u8>>,
    log: Mutex<Vec<Logged>>,
    /// Writes from this byte offset on fail with EIO.
    fail_from: u64,
}

impl MemDev {
    fn new() -> Arc<MemDev> {
        Arc::new(MemDev {
            data: Mutex::new(vec![0; SIZE]),
            log: Mutex::new(Vec::new()),
            fail_from: u64::MAX,
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
            ..Limits::new(SIZE as u64 >> SECTOR_SHIFT)
        }
    }
    fn caps(&self) -> Caps {
        Caps::FLUSH | Caps::DISCARD | Caps::WRITE_ZEROES
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
                    let s = bio.segs()[0];
                    // SAFETY: the segment holds len bytes until completion.
                    let src = unsafe { std::slice::from_raw_parts(s.base, len) };
                    data[off..off + len].copy_from_slice(src);
                    Status::Ok
                }
                Op::Read => {
                    let s = bio.segs()[0];
                    // SAFETY: as above.
                    let dst = unsafe { std::slice::from_raw_parts_mut(s.base, len) };
                    dst.copy_from_slice(&data[off..off + len]);
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
