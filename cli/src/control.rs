//! The control socket of `udm serve` (dmsetup's role for a running server).
//!
//! A unix stream socket, mode 0600, served by its own threads (off the data
//! path: every operation goes through [`MappedDevice`]'s thread-safe control
//! methods, which message the reactors). Protocol `udm-ctl 1`, line based,
//! UTF-8:
//!
//! ```text
//! request:  one line, words separated by blanks, ending in '\n'
//! reply:    zero or more data lines, each "| " + text,
//!           then one final line: "ok" or "error: <one line>"
//! ```
//!
//! A connection may carry any number of requests, one after the other.
//! Requests:
//!
//! | request | reply data |
//! |---|---|
//! | `version` | `udm-ctl 1` |
//! | `status [DEV]...` | `DEV: start len type status…` per target (`dmsetup status`) |
//! | `table [DEV]...` | per device its size and caps, then `  table:  …` and `  status: …` per target |
//! | `message DEV SECTOR WORD...` | the target's reply, if any (`dmsetup message`) |
//! | `reload DEV TABLE` | none; TABLE is the rest of the line, target lines separated by `;` |
//!
//! A request line longer than 64 KiB, one that is not UTF-8, an empty one or
//! an unknown request gets one `error:` line (an overlong one also closes
//! the connection). A connection idle for 60 s is closed. At most 32
//! connections at once; more get `error: too many control connections` and
//! are closed. Requests run concurrently (a status poll while a long
//! `message … flush` runs, say); reloads run one at a time.

use std::io::{BufRead, BufReader, ErrorKind as IoKind, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use udm_core::{Error, ErrorKind};

use crate::message;
use crate::spec::Stack;

/// The protocol's name and version, as `version` replies.
pub const PROTOCOL: &str = "udm-ctl 1";
/// Longest request line.
pub const MAX_LINE: usize = 64 << 10;
/// Most connections served at once.
pub const MAX_CONNS: usize = 32;
const IDLE: Duration = Duration::from_secs(60);

struct Shared {
    stack: Arc<Stack>,
    /// Held by a reload, and by shutdown for good.
    reload: Mutex<()>,
    closing: AtomicBool,
    conns: AtomicUsize,
}

/// A running control socket.
pub struct ControlServer {
    path: PathBuf,
    shared: Arc<Shared>,
    wake: OwnedFd,
    accept: Option<JoinHandle<()>>,
}

/// Binds the control socket at `path`, mode 0600. A stale socket (nobody
/// listening) is replaced; a live one or any other file is an error.
/// Call before starting threads (it sets the umask around the bind).
pub fn bind(path: &Path) -> Result<UnixListener, Error> {
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
    // SAFETY: umask only swaps the process's file-creation mask; restored below.
    let old = unsafe { libc::umask(0o177) };
    let l = UnixListener::bind(path);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    let l = l.map_err(|e| Error::os(what(), e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| Error::os(what(), e))?;
    Ok(l)
}

impl ControlServer {
    /// Serves `listener` (from [`bind`] at `path`) on its own thread.
    pub fn start(
        listener: UnixListener,
        path: PathBuf,
        stack: Arc<Stack>,
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
            stack,
            reload: Mutex::new(()),
            closing: AtomicBool::new(false),
            conns: AtomicUsize::new(0),
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

    /// Stops accepting, removes the socket file and waits for a reload in
    /// progress to finish (no new one starts); requests still running on
    /// open connections get `error: server is shutting down` for any new
    /// request.
    pub fn shutdown(mut self) {
        self.shared.closing.store(true, Ordering::Release);
        // SAFETY: writes one byte from a local to our own pipe.
        unsafe { libc::write(self.wake.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
        // Wait for a reload in progress: the devices must not stay suspended.
        let g = self.shared.reload.lock().unwrap_or_else(|p| p.into_inner());
        drop(g);
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
            if std::io::Error::last_os_error().kind() == IoKind::Interrupted {
                continue;
            }
            eprintln!(
                "udm: control: poll: {}; control socket closed",
                std::io::Error::last_os_error()
            );
            return;
        }
        if fds[1].revents != 0 || sh.closing.load(Ordering::Acquire) {
            return;
        }
        if fds[0].revents == 0 {
            continue;
        }
        let s = match l.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == IoKind::Interrupted || e.kind() == IoKind::WouldBlock => continue,
            Err(e) => {
                eprintln!("udm: control: accept: {e}");
                // e.g. EMFILE: do not spin.
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if sh.conns.fetch_add(1, Ordering::AcqRel) >= MAX_CONNS {
            sh.conns.fetch_sub(1, Ordering::AcqRel);
            let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
            let _ = (&s).write_all(
                format!("error: too many control connections (at most {MAX_CONNS})\n").as_bytes(),
            );
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
            eprintln!("udm: control: spawning a connection thread: {e}");
        }
    }
}

/// What reading one request line gave.
enum Line {
    Text(String),
    Eof,
    TooLong,
    NotUtf8,
}

fn read_line(r: &mut impl BufRead) -> std::io::Result<Line> {
    let mut buf = Vec::new();
    let n = r.take(MAX_LINE as u64 + 1).read_until(b'\n', &mut buf)?;
    if n == 0 {
        return Ok(Line::Eof);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
        if buf.last() == Some(&b'\r') {
            buf.pop();
        }
    } else if buf.len() > MAX_LINE {
        return Ok(Line::TooLong);
    }
    match String::from_utf8(buf) {
        Ok(s) => Ok(Line::Text(s)),
        Err(_) => Ok(Line::NotUtf8),
    }
}

fn serve_conn(s: UnixStream, sh: &Shared) {
    let _ = s.set_read_timeout(Some(IDLE));
    let _ = s.set_write_timeout(Some(IDLE));
    let Ok(w) = s.try_clone() else { return };
    let mut w = std::io::BufWriter::new(w);
    let mut r = BufReader::new(s);
    loop {
        let (reply, close) = match read_line(&mut r) {
            Ok(Line::Eof) | Err(_) => return, // closed, idle or broken
            Ok(Line::TooLong) => (
                Err(Error::invalid(format!(
                    "request line longer than {MAX_LINE} bytes"
                ))),
                true,
            ),
            Ok(Line::NotUtf8) => (Err(Error::invalid("request is not UTF-8")), false),
            Ok(Line::Text(l)) => {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handle(sh, &l)));
                match r {
                    Ok(r) => (r, false),
                    Err(_) => (
                        Err(Error::invalid("internal error (see the server's log)")),
                        false,
                    ),
                }
            }
        };
        let mut out = String::new();
        match reply {
            Ok(lines) => {
                for l in lines {
                    for part in l.lines() {
                        out.push_str("| ");
                        out.push_str(part);
                        out.push('\n');
                    }
                }
                out.push_str("ok\n");
            }
            Err(e) => {
                let msg = e.to_string().replace(['\n', '\r'], " ");
                out.push_str(&format!("error: {msg}\n"));
            }
        }
        if w.write_all(out.as_bytes()).and_then(|_| w.flush()).is_err() || close {
            return;
        }
    }
}

/// Runs one request; returns its data lines.
fn handle(sh: &Shared, line: &str) -> Result<Vec<String>, Error> {
    let line = line.trim();
    let (cmd, rest) = line
        .split_once(char::is_whitespace)
        .map(|(c, r)| (c, r.trim_start()))
        .unwrap_or((line, ""));
    let words: Vec<String> = rest.split_whitespace().map(str::to_string).collect();
    if sh.closing.load(Ordering::Acquire) && cmd != "version" {
        return Err(Error::new(ErrorKind::Busy, "server is shutting down"));
    }
    let st = &sh.stack;
    match cmd {
        "" => Err(Error::invalid("empty request")),
        "version" if words.is_empty() => Ok(vec![PROTOCOL.to_string()]),
        "status" => message::status_lines(st, &words),
        "table" => message::table_report(st, &words),
        "message" => {
            let [dev, sector, msg @ ..] = &words[..] else {
                return Err(Error::invalid("message: expected DEV SECTOR MESSAGE..."));
            };
            if msg.is_empty() {
                return Err(Error::invalid("message: expected DEV SECTOR MESSAGE..."));
            }
            let sector: u64 = sector.parse().map_err(|_| {
                Error::invalid(format!(
                    "message: invalid sector '{sector}': expected a number"
                ))
            })?;
            let argv: Vec<&str> = msg.iter().map(String::as_str).collect();
            let r = message::send_message(st, dev, sector, &argv)?;
            Ok(r.lines().map(str::to_string).collect())
        }
        "reload" => {
            let Some((dev, table)) = rest.split_once(char::is_whitespace) else {
                return Err(Error::invalid("reload: expected DEV TABLE"));
            };
            let g = sh.reload.lock().unwrap_or_else(|p| p.into_inner());
            if sh.closing.load(Ordering::Acquire) {
                return Err(Error::new(ErrorKind::Busy, "server is shutting down"));
            }
            let r = message::reload(st, dev, table.trim());
            drop(g);
            r.map(|_| Vec::new())
        }
        "version" => Err(Error::invalid("version: takes no arguments")),
        other => {
            let shown: String = other.chars().take(40).collect();
            Err(Error::invalid(format!(
                "unknown request '{shown}' ({PROTOCOL} knows: version, status, table, message, reload)"
            )))
        }
    }
}

/// A client connection to a control socket.
pub struct Client {
    path: PathBuf,
    r: BufReader<UnixStream>,
    w: UnixStream,
}

impl Client {
    /// Connects to the control socket at `path`.
    pub fn connect(path: &Path) -> Result<Client, Error> {
        let s = UnixStream::connect(path).map_err(|e| {
            Error::os(
                format!(
                    "control socket '{}' (is 'udm serve' running?)",
                    path.display()
                ),
                e,
            )
        })?;
        let w = s
            .try_clone()
            .map_err(|e| Error::os(format!("control socket '{}'", path.display()), e))?;
        Ok(Client {
            path: path.to_path_buf(),
            r: BufReader::new(s),
            w,
        })
    }

    /// Sends one request line and returns the reply's data lines, or the
    /// server's error.
    pub fn call(&mut self, line: &str) -> Result<Vec<String>, Error> {
        let what = || format!("control socket '{}'", self.path.display());
        if line.contains(['\n', '\r']) {
            return Err(Error::invalid("a control request is one line"));
        }
        self.w
            .write_all(format!("{line}\n").as_bytes())
            .map_err(|e| Error::os(what(), e))?;
        let mut data = Vec::new();
        loop {
            let mut l = String::new();
            let n = self.r.read_line(&mut l).map_err(|e| Error::os(what(), e))?;
            if n == 0 {
                return Err(Error::new(
                    ErrorKind::Io,
                    format!("{}: the server closed the connection mid-reply", what()),
                ));
            }
            let l = l.trim_end_matches(['\n', '\r']);
            if let Some(d) = l.strip_prefix("| ") {
                data.push(d.to_string());
            } else if l == "|" {
                data.push(String::new());
            } else if l == "ok" {
                return Ok(data);
            } else if let Some(e) = l.strip_prefix("error: ") {
                return Err(Error::invalid(e.to_string()));
            } else {
                return Err(Error::new(
                    ErrorKind::Io,
                    format!("{}: unexpected reply line '{l}'", what()),
                ));
            }
        }
    }
}

/// One request on a new connection.
pub fn request(path: &Path, line: &str) -> Result<Vec<String>, Error> {
    Client::connect(path)?.call(line)
}

/// `cmd` followed by `args`, blank-separated.
pub fn join(cmd: &str, args: &[String]) -> String {
    let mut s = cmd.to_string();
    for a in args {
        s.push(' ');
        s.push_str(a);
    }
    s
}

/// Where `udm serve` puts its control socket when `--control` is not
/// given: beside its first unix listen socket (`<sock>.ctl`), else in
/// `$XDG_RUNTIME_DIR` (or the temporary directory) as `udm-<pid>.ctl`.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_lines_end_at_newline_and_are_bounded() {
        let mut r = std::io::Cursor::new(b"status wc\r\nversion".to_vec());
        assert!(matches!(read_line(&mut r).unwrap(), Line::Text(s) if s == "status wc"));
        assert!(matches!(read_line(&mut r).unwrap(), Line::Text(s) if s == "version"));
        assert!(matches!(read_line(&mut r).unwrap(), Line::Eof));
        let mut r = std::io::Cursor::new(vec![b'x'; MAX_LINE + 10]);
        assert!(matches!(read_line(&mut r).unwrap(), Line::TooLong));
        let mut r = std::io::Cursor::new(b"\xff\xfe\n".to_vec());
        assert!(matches!(read_line(&mut r).unwrap(), Line::NotUtf8));
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
