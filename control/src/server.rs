//! The control socket's server: a unix stream socket, mode 0600, served by
//! its own threads (off the data path: every op goes through [`Control`],
//! whose device methods message the reactors).
//!
//! Access: only udm's user, root and the `--socket-group`'s members
//! ([`Access`]) are served, checked by the socket file's mode and again
//! by each peer's credentials (`SO_PEERCRED`): anyone else gets one
//! `denied` error reply naming their uid, the connection is closed and the
//! refusal logged.
//!
//! Limits: a request line longer than [`MAX_LINE`] gets an error reply and
//! the connection is closed; a connection idle for [`IDLE`] is closed, and
//! one that starts a line but does not end it within [`LINE_DEADLINE`]; at
//! most [`MAX_CONNS`] connections at once (more get one `busy` error reply
//! and are closed). A request that is not JSON, or names an unknown op,
//! gets an error reply and the connection goes on. Requests on different
//! connections run concurrently (see [`Control`] for what waits for what).

use std::io::{BufRead, ErrorKind as IoKind, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use udm_core::access::Access;
use udm_core::{Error, ErrorKind};
use zeroize::Zeroizing;

use crate::dispatch::execute;
use crate::luks::push_wiped;
use crate::proto::{decode, Op, Reply, MAX_LINE};
use crate::verbs::Control;

/// Most connections served at once.
pub const MAX_CONNS: usize = 32;
/// A connection idle this long (between requests) is closed.
pub const IDLE: Duration = Duration::from_secs(60);
/// A request line must be complete this long after its first byte, else
/// the connection is closed (as the NBD server's handshake deadline).
pub const LINE_DEADLINE: Duration = Duration::from_secs(10);

/// Binds the control socket at `path` as `access` says (mode 0600, or
/// 0660 and the group's; its directory checked by
/// [`udm_core::access::check_dir`]). A stale socket (nobody listening) is
/// replaced; a live one or any other file is an error.
pub fn bind(path: &Path, access: Access) -> Result<UnixListener, Error> {
    let what = || format!("control socket '{}'", path.display());
    if let Ok(m) = std::fs::symlink_metadata(path) {
        if !m.file_type().is_socket() {
            return Err(Error::invalid(format!(
                "{}: exists and is not a socket",
                what()
            )));
        }
        if UnixStream::connect(path).is_ok() {
            return Err(Error::new(
                ErrorKind::Busy,
                format!("{}: another server is listening on it", what()),
            ));
        }
        let _ = std::fs::remove_file(path);
    }
    access.bind(path, &what())
}

/// Where a server puts its control socket when not told: beside its first
/// unix listen socket (`<sock>.ctl`), else in `$XDG_RUNTIME_DIR` (or the
/// temporary directory) as `udm-<pid>.ctl`.
pub fn default_path(first_unix: Option<&Path>) -> PathBuf {
    if let Some(p) = first_unix {
        let mut s = p.as_os_str().to_owned();
        s.push(".ctl");
        return PathBuf::from(s);
    }
    let dir = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|d| d.is_dir())
        .unwrap_or_else(std::env::temp_dir);
    dir.join(format!("udm-{}.ctl", std::process::id()))
}

struct Shared {
    ctl: Arc<Control>,
    conns: AtomicUsize,
    access: Access,
}

/// A running control socket.
pub struct ControlServer {
    path: PathBuf,
    shared: Arc<Shared>,
    wake: OwnedFd,
    accept: Option<JoinHandle<()>>,
}

impl ControlServer {
    /// Serves `listener` (from [`bind`] at `path`) on its own thread, to
    /// the peers `access` admits.
    pub fn start(
        listener: UnixListener,
        path: PathBuf,
        ctl: Arc<Control>,
        access: Access,
    ) -> Result<ControlServer, Error> {
        let mut fds = [0i32; 2];
        // SAFETY: pipe2 writes two fds into the array; result checked.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(Error::os(
                "control socket: pipe",
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: both fds were just created and are owned only here.
        let (rd, wake) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let shared = Arc::new(Shared {
            ctl,
            conns: AtomicUsize::new(0),
            access,
        });
        let sh = shared.clone();
        let accept = std::thread::Builder::new()
            .name("udm-ctl".into())
            .spawn(move || accept_loop(listener, rd, sh))
            .map_err(|e| Error::os("control socket: spawning its thread", e))?;
        Ok(ControlServer {
            path,
            shared,
            wake,
            accept: Some(accept),
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stops accepting, removes the socket file and closes the [`Control`]
    /// (waiting for a change in progress, a reload say, to finish; none
    /// starts after). Open connections get `busy` for any new change.
    pub fn shutdown(mut self) {
        // SAFETY: writes one byte from a local to our own pipe.
        unsafe { libc::write(self.wake.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
        self.shared.ctl.close();
    }
}

fn accept_loop(l: UnixListener, stop: OwnedFd, sh: Arc<Shared>) {
    loop {
        let mut fds = [
            libc::pollfd {
                fd: l.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: stop.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: poll on a local array of two valid pollfds.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == IoKind::Interrupted {
                continue;
            }
            tracing::error!("control: poll: {e}; control socket closed");
            return;
        }
        if fds[1].revents != 0 {
            return;
        }
        if fds[0].revents == 0 {
            continue;
        }
        let s = match l.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == IoKind::Interrupted || e.kind() == IoKind::WouldBlock => continue,
            Err(e) => {
                tracing::warn!("control: accept: {e}");
                // e.g. EMFILE: do not spin.
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if let Err(e) = sh.access.check(&s) {
            // Before anything else: a refused peer learns nothing more.
            tracing::warn!("control: refused a connection: {e}");
            let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
            let _ = (&s).write_all(Reply::from_result(None, Err(e)).to_line().as_bytes());
            continue;
        }
        if sh.conns.fetch_add(1, Ordering::AcqRel) >= MAX_CONNS {
            sh.conns.fetch_sub(1, Ordering::AcqRel);
            let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
            let r = Reply::from_result(
                None,
                Err(Error::new(
                    ErrorKind::Busy,
                    format!("too many control connections (at most {MAX_CONNS})"),
                )),
            );
            let _ = (&s).write_all(r.to_line().as_bytes());
            continue;
        }
        let sh2 = sh.clone();
        let r = std::thread::Builder::new()
            .name("udm-ctl-conn".into())
            .spawn(move || {
                serve_conn(s, &sh2);
                sh2.conns.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = r {
            sh.conns.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!("control: spawning a connection thread: {e}");
        }
    }
}

/// What reading one request line gave.
enum Line {
    Bytes(Zeroizing<Vec<u8>>),
    Eof,
    TooLong,
}

/// A buffered reader that zeroes its buffer when dropped: a create
/// request may carry a passphrase, and no copy of it may outlive the
/// connection in freed memory.
struct WipedReader<R> {
    inner: R,
    buf: Zeroizing<Vec<u8>>,
    pos: usize,
    end: usize,
}

impl<R: Read> WipedReader<R> {
    fn new(inner: R) -> WipedReader<R> {
        WipedReader {
            inner,
            buf: Zeroizing::new(vec![0; 8192]),
            pos: 0,
            end: 0,
        }
    }
}

impl<R: Read> Read for WipedReader<R> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        let n = {
            let avail = self.fill_buf()?;
            let n = avail.len().min(out.len());
            out[..n].copy_from_slice(&avail[..n]);
            n
        };
        self.consume(n);
        Ok(n)
    }
}

impl<R: Read> BufRead for WipedReader<R> {
    fn fill_buf(&mut self) -> std::io::Result<&[u8]> {
        if self.pos == self.end {
            self.end = self.inner.read(&mut self.buf)?;
            self.pos = 0;
        }
        Ok(&self.buf[self.pos..self.end])
    }

    fn consume(&mut self, n: usize) {
        self.pos = (self.pos + n).min(self.end);
    }
}

/// Reads one request line. `set_timeout` is called before each wait for
/// bytes with how long that wait may last: [`IDLE`] before the line's
/// first byte, then what is left of [`LINE_DEADLINE`]. A wait that runs
/// out is an error (the connection closes).
fn read_line(
    r: &mut impl BufRead,
    set_timeout: &mut dyn FnMut(Duration) -> std::io::Result<()>,
) -> std::io::Result<Line> {
    let mut buf = Zeroizing::new(Vec::new());
    let mut started: Option<Instant> = None;
    loop {
        let wait = match started {
            None => IDLE,
            Some(t) => match LINE_DEADLINE.checked_sub(t.elapsed()) {
                Some(d) if !d.is_zero() => d,
                _ => {
                    return Err(std::io::Error::new(
                        IoKind::TimedOut,
                        "request line not finished in time",
                    ))
                }
            },
        };
        set_timeout(wait)?;
        let avail = r.fill_buf()?;
        if avail.is_empty() {
            return Ok(if buf.is_empty() {
                Line::Eof
            } else {
                Line::Bytes(buf)
            });
        }
        started.get_or_insert_with(Instant::now);
        let (n, done) = match avail.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (avail.len(), false),
        };
        push_wiped(&mut buf, &avail[..n]);
        r.consume(n);
        if done {
            buf.pop();
            if buf.len() > MAX_LINE {
                return Ok(Line::TooLong);
            }
            return Ok(Line::Bytes(buf));
        }
        if buf.len() > MAX_LINE {
            return Ok(Line::TooLong);
        }
    }
}

fn serve_conn(s: UnixStream, sh: &Shared) {
    let _ = s.set_read_timeout(Some(IDLE));
    let _ = s.set_write_timeout(Some(IDLE));
    let Ok(w) = s.try_clone() else { return };
    let mut w = std::io::BufWriter::new(w);
    let t = s.try_clone();
    let mut r = WipedReader::new(s);
    let Ok(t) = t else { return };
    let mut set_timeout = |d: Duration| t.set_read_timeout(Some(d));
    loop {
        let (reply, close) = match read_line(&mut r, &mut set_timeout) {
            Ok(Line::Eof) | Err(_) => return, // closed, idle or broken
            Ok(Line::TooLong) => (
                Reply::from_result(
                    None,
                    Err(Error::invalid(format!(
                        "request line longer than {MAX_LINE} bytes"
                    ))),
                ),
                true,
            ),
            Ok(Line::Bytes(b)) => (handle(&sh.ctl, &b), false),
        };
        let line = reply.to_line();
        if w.write_all(line.as_bytes())
            .and_then(|_| w.flush())
            .is_err()
            || close
        {
            return;
        }
    }
}

/// Decodes and runs one request line.
fn handle(ctl: &Control, line: &[u8]) -> Reply {
    let req = match decode(line) {
        Ok(r) => r,
        Err((id, e)) => return Reply::from_result(id, Err(e)),
    };
    if ctl.is_closing() && !matches!(req.op, Op::Version {}) {
        return Reply::from_result(
            req.id,
            Err(Error::new(ErrorKind::Busy, "server is shutting down")),
        );
    }
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| execute(ctl, req.op)));
    let r = r.unwrap_or_else(|_| {
        Err(Error::new(
            ErrorKind::Io,
            "internal error (see the server's log)",
        ))
    });
    Reply::from_result(req.id, r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_lines_end_at_newline_and_are_bounded() {
        let mut t = |_| Ok(());
        let mut r = std::io::Cursor::new(b"{}\r\n{\"v\":1}".to_vec());
        assert!(
            matches!(read_line(&mut r, &mut t).unwrap(), Line::Bytes(b) if b[..] == b"{}\r"[..])
        );
        assert!(
            matches!(read_line(&mut r, &mut t).unwrap(), Line::Bytes(b) if b[..] == b"{\"v\":1}"[..])
        );
        assert!(matches!(read_line(&mut r, &mut t).unwrap(), Line::Eof));
        let mut r = std::io::Cursor::new(vec![b'x'; MAX_LINE + 10]);
        assert!(matches!(read_line(&mut r, &mut t).unwrap(), Line::TooLong));
    }

    #[test]
    fn a_line_started_must_end_within_the_deadline() {
        use std::os::unix::net::UnixStream;
        let (a, b) = UnixStream::pair().unwrap();
        (&a).write_all(b"{\"op\":").unwrap();
        let mut waits = Vec::new();
        let t = b.try_clone().unwrap();
        let mut set = |d: Duration| {
            waits.push(d);
            // Scaled down: the test waits 100 ms, not LINE_DEADLINE.
            t.set_read_timeout(Some(if d == IDLE {
                d
            } else {
                Duration::from_millis(100)
            }))
        };
        let t0 = Instant::now();
        let r = read_line(&mut WipedReader::new(b), &mut set);
        assert!(r.is_err(), "a stalled line is an error");
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert_eq!(waits[0], IDLE);
        assert!(waits[1] <= LINE_DEADLINE && waits[1] > LINE_DEADLINE / 2);
        drop(a);
    }

    #[test]
    fn the_default_control_socket_sits_beside_the_first_unix_socket() {
        assert_eq!(
            default_path(Some(Path::new("/run/udm.sock"))),
            PathBuf::from("/run/udm.sock.ctl")
        );
        assert!(default_path(None)
            .to_string_lossy()
            .ends_with(&format!("udm-{}.ctl", std::process::id())));
    }
}
