//! A vhost-user-blk load generator on libblkio's `virtio-blk-vhost-user`
//! driver (no VM): random (`read`, `write`) or sequential (`seqread`,
//! `seqwrite`) reads or writes of BS bytes at QD in flight on one queue for
//! SECS seconds; prints `iops N` (and, on stderr, `ios N`: the I/Os done).
//!
//! The queue waits for completions on its call eventfd (`irq`, what a
//! guest's interrupt-driven virtio-blk queue does) or polls the used ring
//! with the server's notifications off (`poll`, what a guest's
//! `virtio_blk.poll_queues` or SPDK's virtio initiator does).
//!
//! usage: vhost_bench SOCKET [SECS=5] [QD=32] [BS=4096] [read|write|seqread|seqwrite] [irq|poll]

// A benchmark tool: a failed setup step ends it with its message.
#![allow(clippy::unwrap_used)]

use std::mem::MaybeUninit;
use std::time::{Duration, Instant};

use blkio::{Blkio, Completion, ReqFlags};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).expect(
        "usage: vhost_bench SOCKET [SECS] [QD] [BS] [read|write|seqread|seqwrite] [irq|poll]",
    );
    let arg = |i: usize, d: u64| args.get(i).map_or(d, |s| s.parse().unwrap());
    let secs = arg(2, 5);
    let qd = arg(3, 32) as usize;
    let bs = arg(4, 4096) as usize;
    let rw = args.get(5).map_or("read", String::as_str);
    let write = rw.ends_with("write");
    let seq = rw.starts_with("seq");
    let poll = match args.get(6).map_or("irq", String::as_str) {
        "irq" => false,
        "poll" => true,
        m => panic!("vhost_bench: completion mode {m:?} is neither irq nor poll"),
    };
    let mut b = Blkio::new("virtio-blk-vhost-user").unwrap();
    b.set_str("path", path).unwrap();
    b.connect().unwrap();
    b.set_i32("num-queues", i32::from(!poll)).unwrap();
    b.set_i32("num-poll-queues", i32::from(poll)).unwrap();
    let started = b.start().unwrap();
    let mut q = if poll {
        started.poll_queues
    } else {
        started.queues
    }
    .pop()
    .unwrap();
    let cap = b.get_u64("capacity").unwrap();
    let blocks = cap / bs as u64;
    let region = b.alloc_mem_region(qd * bs).unwrap();
    b.map_mem_region(&region).unwrap();
    let buf = |i: usize| (region.addr + i * bs) as *mut u8;
    // Sequential: the next block, wrapping; random: xorshift, a different
    // block each time, cheap to draw.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut cursor = 0u64;
    let mut next = || {
        if seq {
            cursor = (cursor + 1) % blocks;
            return cursor * bs as u64;
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % blocks) * bs as u64
    };
    let submit = |q: &mut blkio::Blkioq, slot: usize, off: u64| {
        if write {
            q.write(off, buf(slot), bs, slot, ReqFlags::empty());
        } else {
            q.read(off, buf(slot), bs, slot, ReqFlags::empty());
        }
    };
    for slot in 0..qd {
        let off = next();
        submit(&mut q, slot, off);
    }
    let mut done: Vec<MaybeUninit<Completion>> = (0..qd).map(|_| MaybeUninit::uninit()).collect();
    let mut n = 0u64;
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs(secs);
    while Instant::now() < end {
        let k = q.do_io(&mut done, 1, None, None).unwrap();
        for c in &done[..k] {
            // SAFETY: do_io filled the first k completions.
            let c = unsafe { c.assume_init_read() };
            assert_eq!(c.ret, 0, "I/O failed");
            n += 1;
            let off = next();
            submit(&mut q, c.user_data, off);
        }
    }
    let el = t0.elapsed().as_secs_f64();
    println!("iops {:.0}", n as f64 / el);
    // For per-I/O counts taken on the server (scripts/bench/server-cost.sh).
    eprintln!("ios {n}");
}
