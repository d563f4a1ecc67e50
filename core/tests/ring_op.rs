//! The generic op API of the reactor's ring: `Ring::push_op` and `RingOp`.

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

use std::cell::Cell;

use udm_core::io_uring::{opcode, types};
use udm_core::{cqe_more, Reactor, ReactorConfig, RingOp};

#[repr(C)]
struct Counted {
    op: RingOp,
    calls: Cell<u32>,
    last_res: Cell<i32>,
    finals: Cell<u32>,
}

fn counted_complete(op: *mut RingOp, res: i32, flags: u32) {
    // SAFETY: every op pushed in these tests is the first field of a live,
    // #[repr(C)] Counted.
    let c = unsafe { &*(op as *const Counted) };
    c.calls.set(c.calls.get() + 1);
    c.last_res.set(res);
    if !cqe_more(flags) {
        c.finals.set(c.finals.get() + 1);
    }
}

fn counted() -> Box<Counted> {
    Box::new(Counted {
        op: RingOp {
            complete: counted_complete,
        },
        calls: Cell::new(0),
        last_res: Cell::new(i32::MIN),
        finals: Cell::new(0),
    })
}

#[test]
fn an_op_completes_once_through_its_callback_and_leaves_nothing_in_flight() {
    let r = Reactor::new(ReactorConfig::default()).unwrap();
    let mut c = counted();
    let op: *mut RingOp = &mut c.op;
    // SAFETY: a NOP names no memory; `c` outlives the drain below.
    unsafe { r.ring().push_op(opcode::Nop::new().build(), op) };
    assert_eq!(r.ring().inflight(), 1);
    r.drain();
    assert_eq!((c.calls.get(), c.finals.get(), c.last_res.get()), (1, 1, 0));
    assert_eq!(r.ring().inflight(), 0);
}

#[test]
fn a_multishot_op_stays_in_flight_until_its_final_cqe() {
    let r = Reactor::new(ReactorConfig::default()).unwrap();
    // SAFETY: plain syscall, checked.
    let efd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK) };
    assert!(efd >= 0);
    let mut c = counted();
    let op: *mut RingOp = &mut c.op;
    let poll = opcode::PollAdd::new(types::Fd(efd), libc::POLLIN as u32)
        .multi(true)
        .build();
    // SAFETY: a poll names no memory; `c` outlives the cancel's completion.
    unsafe { r.ring().push_op(poll, op) };
    let one = 1u64;
    // SAFETY: 8 bytes from a live u64 to our eventfd.
    unsafe { libc::write(efd, (&one as *const u64).cast(), 8) };
    r.run_until(|| c.calls.get() >= 1);
    assert_eq!(c.finals.get(), 0, "a firing multishot poll posts F_MORE");
    assert_eq!(r.ring().inflight(), 1);
    // Cancel it: the final CQE (without F_MORE) ends it.
    let mut k = counted();
    let kop: *mut RingOp = &mut k.op;
    let cancel = opcode::AsyncCancel::new(RingOp::user_data(op)).build();
    // SAFETY: a cancel names no memory; `k` outlives the drain.
    unsafe { r.ring().push_op(cancel, kop) };
    r.drain();
    assert_eq!(c.finals.get(), 1);
    assert_eq!(k.finals.get(), 1);
    assert_eq!(r.ring().inflight(), 0);
    // SAFETY: our own fd.
    unsafe { libc::close(efd) };
}
