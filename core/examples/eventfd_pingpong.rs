//! The floor of a server's CPU per request when its client waits for each
//! reply on an eventfd (vhost-user-blk at QD1 with an interrupt-driven
//! driver; docs/benchmarks.md, "A sleeping reactor at QD1"): two
//! processes, unpinned, pass a token through two eventfds, as a driver's
//! kick and a device's call do, and do nothing else. The client writes
//! the kick and sleeps in `read` on the call. The server waits for the
//! kick one of three ways:
//!
//! - `sleep`: in a blocking `read` of the kick (a switch to idle and back
//!   per round trip);
//! - `uring`: in `io_uring_enter` on a ring set up as udm's reactors' are
//!   (DEFER_TASKRUN), over a multishot poll of the kick;
//! - `spin`: on a non-blocking `read` of the kick, in a loop (it pays the
//!   client's wakeup in CPU).
//!
//! Prints the server's CPU time (user + system) per round trip and the
//! round trips per second.
//!
//! ```sh
//! cargo run --release -p udm-core --example eventfd_pingpong -- [ROUND_TRIPS] [sleep|uring|spin]
//! ```

use std::io;
use std::time::Instant;

use io_uring::{opcode, types, IoUring};

#[derive(Clone, Copy, PartialEq)]
enum Wait {
    Sleep,
    Uring,
    Spin,
}

fn main() {
    let mut args = std::env::args().skip(1);
    let n: u64 = match args.next().map(|s| s.parse()) {
        None => 200_000,
        Some(Ok(n)) if n > 0 => n,
        Some(_) => usage(),
    };
    let wait = match args.next().as_deref() {
        None | Some("sleep") => Wait::Sleep,
        Some("uring") => Wait::Uring,
        Some("spin") => Wait::Spin,
        Some(_) => usage(),
    };
    let flags = if wait == Wait::Spin {
        libc::EFD_NONBLOCK
    } else {
        0
    };
    // SAFETY: plain syscalls; the fds are checked below.
    let (kick, call) = unsafe { (libc::eventfd(0, flags), libc::eventfd(0, 0)) };
    if kick < 0 || call < 0 {
        fail("eventfd", io::Error::last_os_error());
    }
    // SAFETY: no other thread exists yet; both sides only make syscalls.
    match unsafe { libc::fork() } {
        -1 => fail("fork", io::Error::last_os_error()),
        0 => serve(kick, call, n, wait),
        pid => {
            for _ in 0..n {
                if !signal(kick) || !consume(call) {
                    fail("client", io::Error::last_os_error());
                }
            }
            let mut status = 0;
            // SAFETY: waits for the child forked above.
            unsafe { libc::waitpid(pid, &mut status, 0) };
            std::process::exit(if status == 0 { 0 } else { 1 });
        }
    }
}

/// The server: waits for each kick the chosen way and answers it with a call.
fn serve(kick: i32, call: i32, n: u64, wait: Wait) -> ! {
    let t0 = Instant::now();
    match wait {
        Wait::Sleep => {
            for _ in 0..n {
                if !consume(kick) || !signal(call) {
                    fail("server", io::Error::last_os_error());
                }
            }
        }
        Wait::Spin => {
            for _ in 0..n {
                while !consume(kick) {}
                if !signal(call) {
                    fail("server", io::Error::last_os_error());
                }
            }
        }
        Wait::Uring => {
            let mut ring: IoUring = IoUring::builder()
                .setup_single_issuer()
                .setup_coop_taskrun()
                .setup_taskrun_flag()
                .setup_defer_taskrun()
                .build(64)
                .unwrap_or_else(|e| fail("io_uring_setup", e));
            let poll = opcode::PollAdd::new(types::Fd(kick), libc::POLLIN as u32)
                .multi(true)
                .build();
            // SAFETY: the entry names no memory.
            if unsafe { ring.submission().push(&poll) }.is_err() {
                fail("io_uring", io::Error::other("SQ full"));
            }
            let mut done = 0;
            while done < n {
                if let Err(e) = ring.submit_and_wait(1) {
                    fail("io_uring_enter", e);
                }
                let cqes = ring.completion().count();
                // Each kick counted: the eventfd is readable, so this
                // read does not block (udm's reactor does not read it).
                for _ in 0..cqes {
                    if !consume(kick) || !signal(call) {
                        fail("server", io::Error::last_os_error());
                    }
                    done += 1;
                }
            }
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    let (user, system) = udm_core::cputime::process_cpu();
    let cpu = (user + system).as_secs_f64();
    let name = match wait {
        Wait::Sleep => "sleep",
        Wait::Uring => "uring",
        Wait::Spin => "spin",
    };
    println!(
        "{name}: {:.2} us of server CPU per round trip, {:.0} round trips/s",
        cpu * 1e6 / n as f64,
        n as f64 / wall
    );
    std::process::exit(0)
}

/// Adds 1 to the eventfd `fd`.
fn signal(fd: i32) -> bool {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64.
    unsafe { libc::write(fd, (&one as *const u64).cast(), 8) == 8 }
}

/// Reads (and so clears) the eventfd `fd`: false if it was zero and non-blocking.
fn consume(fd: i32) -> bool {
    let mut v: u64 = 0;
    // SAFETY: reads 8 bytes into a live u64.
    unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) == 8 }
}

fn usage() -> ! {
    eprintln!("usage: eventfd_pingpong [ROUND_TRIPS] [sleep|uring|spin]");
    std::process::exit(2)
}

fn fail(what: &str, e: io::Error) -> ! {
    eprintln!("eventfd_pingpong: {what}: {e}");
    std::process::exit(1)
}
