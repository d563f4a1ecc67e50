//! The least an NBD server can do per request, for a floor under the CPU
//! per request that `scripts/bench/nbd.sh` measures (docs/benchmarks.md,
//! "Where a request's CPU goes, and fio's ceiling"): one thread, blocking
//! system calls, a RAM disk of SIZE_MIB in an anonymous mapping, every
//! request parsed from one `recv` into a 256 KiB buffer, and the replies to
//! a `recv`'s requests sent in one `sendmsg` whose read data points at the
//! disk itself (no copy besides the kernel's). READ, WRITE, FLUSH and DISC
//! with simple replies; fixed newstyle with OPT_GO and OPT_EXPORT_NAME.
//! One client at a time, on a unix socket. Not a server: a measuring
//! stick (no checks beyond what keeps it in bounds).
//!
//! usage: nbd_floor SOCKET [SIZE_MIB=1024]

// A benchmark tool: a failed setup step ends it with its message.
#![allow(clippy::unwrap_used)]

use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};

use udm_exports::nbd::proto::*;

const RBUF: usize = 256 << 10;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).expect("usage: nbd_floor SOCKET [SIZE_MIB]");
    let mib: usize = args.get(2).map_or(1024, |s| s.parse().unwrap());
    let size = mib << 20;
    // SAFETY: a fresh private anonymous mapping, checked below.
    let disk = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    assert!(
        disk != libc::MAP_FAILED,
        "mmap: {}",
        io::Error::last_os_error()
    );
    let disk = disk.cast::<u8>();
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path).unwrap();
    for s in listener.incoming() {
        let Ok(mut s) = s else { continue };
        match handshake(&mut s, size as u64) {
            Ok(true) => {
                if let Err(e) = transmit(&mut s, disk, size as u64) {
                    eprintln!("nbd_floor: {e}");
                }
            }
            Ok(false) => {}
            Err(e) => eprintln!("nbd_floor: handshake: {e}"),
        }
    }
}

/// Fixed newstyle: true once the client is in transmission.
fn handshake(s: &mut UnixStream, size: u64) -> io::Result<bool> {
    let bad = |e: ProtoError| io::Error::other(format!("{e:?}"));
    let info = ExportInfo {
        name: String::new(),
        description: String::new(),
        size,
        flags: FLAG_HAS_FLAGS | FLAG_SEND_FLUSH,
        min_block: 1,
        pref_block: 4096,
        max_payload: 32 << 20,
    };
    let mut out = Vec::new();
    put_greeting(&mut out);
    s.write_all(&out)?;
    let mut cflags = [0u8; CLIENT_FLAGS_LEN];
    s.read_exact(&mut cflags)?;
    let no_zeroes = parse_client_flags(&cflags).map_err(bad)? & FLAG_C_NO_ZEROES != 0;
    loop {
        let mut h = [0u8; OPTION_HEADER_LEN];
        s.read_exact(&mut h)?;
        let OptionHeader { option, len } = parse_option_header(&h).map_err(bad)?;
        if len > 4096 {
            return Ok(false);
        }
        let mut data = vec![0u8; len as usize];
        s.read_exact(&mut data)?;
        out.clear();
        let go = match option {
            OPT_EXPORT_NAME => {
                put_export_name_reply(&mut out, &info, no_zeroes);
                true
            }
            OPT_GO | OPT_INFO => {
                put_info(&mut out, option, &info, &[]);
                put_option_reply(&mut out, option, REP_ACK, &[]);
                option == OPT_GO
            }
            OPT_ABORT => {
                put_option_reply(&mut out, option, REP_ACK, &[]);
                s.write_all(&out)?;
                return Ok(false);
            }
            _ => {
                put_option_reply(&mut out, option, REP_ERR_UNSUP, &[]);
                false
            }
        };
        s.write_all(&out)?;
        if go {
            return Ok(true);
        }
    }
}

/// The transmission phase: one recv, its requests, one sendmsg.
fn transmit(s: &mut UnixStream, disk: *mut u8, size: u64) -> io::Result<()> {
    let mut rbuf = vec![0u8; RBUF];
    let (mut start, mut end) = (0usize, 0usize);
    // Reply headers of one batch (a stable home for the iovecs to name).
    let mut hdrs: Vec<[u8; SIMPLE_REPLY_LEN]> = Vec::with_capacity(RBUF / REQUEST_LEN + 1);
    let mut iov: Vec<libc::iovec> = Vec::with_capacity(2 * (RBUF / REQUEST_LEN + 1));
    let mut reads: Vec<(usize, usize)> = Vec::new();
    loop {
        if start == end {
            (start, end) = (0, 0);
        } else if RBUF - end < REQUEST_LEN {
            rbuf.copy_within(start..end, 0);
            (start, end) = (0, end - start);
        }
        let n = s.read(&mut rbuf[end..])?;
        if n == 0 {
            return Ok(());
        }
        end += n;
        hdrs.clear();
        reads.clear();
        while end - start >= REQUEST_LEN {
            let r = parse_request(&rbuf[start..start + REQUEST_LEN])
                .map_err(|e| io::Error::other(format!("request: {e:?}")))?;
            let (cmd, cookie, off, len) = (r.cmd, r.cookie, r.offset, r.len as usize);
            if (cmd == CMD_READ || cmd == CMD_WRITE)
                && (len > 32 << 20 || off.checked_add(len as u64).is_none_or(|e| e > size))
            {
                return Err(io::Error::other("request out of bounds"));
            }
            start += REQUEST_LEN;
            match cmd {
                CMD_READ => reads.push((off as usize, len)),
                CMD_WRITE => {
                    // SAFETY: off + len <= size: inside the mapping.
                    let dst =
                        unsafe { std::slice::from_raw_parts_mut(disk.add(off as usize), len) };
                    let have = (end - start).min(len);
                    dst[..have].copy_from_slice(&rbuf[start..start + have]);
                    start += have;
                    s.read_exact(&mut dst[have..])?;
                    reads.push((0, 0));
                }
                CMD_DISC => return Ok(()),
                _ => reads.push((0, 0)),
            }
            let mut h = [0u8; SIMPLE_REPLY_LEN];
            encode_simple_reply(&mut h, 0, cookie);
            hdrs.push(h);
        }
        iov.clear();
        for (h, &(off, len)) in hdrs.iter().zip(&reads) {
            iov.push(libc::iovec {
                iov_base: h.as_ptr() as *mut _,
                iov_len: SIMPLE_REPLY_LEN,
            });
            if len > 0 {
                iov.push(libc::iovec {
                    // SAFETY: checked in bounds above.
                    iov_base: unsafe { disk.add(off) }.cast(),
                    iov_len: len,
                });
            }
        }
        send_all(s, &mut iov)?;
    }
}

/// One sendmsg for the batch, and more only if the socket took part of it.
fn send_all(s: &UnixStream, iov: &mut [libc::iovec]) -> io::Result<()> {
    let mut at = 0;
    while at < iov.len() {
        let n_iov = (iov.len() - at).min(1024);
        // SAFETY: a zeroed msghdr is valid; it names iov[at..at + n_iov].
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov[at..].as_mut_ptr();
        msg.msg_iovlen = n_iov;
        // SAFETY: every iovec names live memory (headers, the mapping).
        let sent = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut sent = sent as usize;
        while at < iov.len() && sent >= iov[at].iov_len {
            sent -= iov[at].iov_len;
            at += 1;
        }
        if sent > 0 {
            // SAFETY: advances within the iovec's own buffer.
            iov[at].iov_base = unsafe { iov[at].iov_base.cast::<u8>().add(sent) }.cast();
            iov[at].iov_len -= sent;
        }
    }
    Ok(())
}
