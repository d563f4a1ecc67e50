//! A client of the control socket.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde_json::Value;
use udm_core::{Error, ErrorKind};
use zeroize::Zeroizing;

use crate::proto::{Op, Reply, Request, MAX_LINE};

/// A connection to a control socket; requests go one at a time.
pub struct Client {
    path: PathBuf,
    r: BufReader<UnixStream>,
    w: UnixStream,
    next_id: u64,
}

impl Client {
    /// Connects to the control socket at `path`.
    pub fn connect(path: &Path) -> Result<Client, Error> {
        let s = UnixStream::connect(path).map_err(|e| {
            Error::os(
                format!(
                    "control socket '{}' (is 'udm daemon' or 'udm serve' running?)",
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
            next_id: 1,
        })
    }

    /// Sends `op` and returns the reply's result, or the server's error
    /// (with its kind).
    pub fn call(&mut self, op: Op) -> Result<Value, Error> {
        let what = || format!("control socket '{}'", self.path.display());
        let id = self.next_id;
        self.next_id += 1;
        // Into a buffer that holds any valid line without growing, and is
        // zeroed after: a create request may carry a passphrase.
        let mut line = Zeroizing::new(Vec::with_capacity(MAX_LINE + 2));
        serde_json::to_writer(&mut *line, &Request::new(id, op))
            .map_err(|e| Error::invalid(format!("encoding the request: {e}")))?;
        line.push(b'\n');
        if line.len() > MAX_LINE + 1 {
            return Err(Error::invalid(format!(
                "request longer than {MAX_LINE} bytes"
            )));
        }
        let sent = self.w.write_all(&line);
        let mut l = String::new();
        if let Err(e) = sent {
            // A server that refuses a connection (not admitted, too many)
            // says why in one reply and closes, maybe before the request
            // is sent: its reply is still there to read.
            let closed = matches!(
                e.kind(),
                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
            );
            if !closed || !matches!(self.r.read_line(&mut l), Ok(n) if n > 0) {
                return Err(Error::os(what(), e));
            }
        }
        let n = if l.is_empty() {
            self.r.read_line(&mut l).map_err(|e| Error::os(what(), e))?
        } else {
            l.len()
        };
        if n == 0 {
            return Err(Error::new(
                ErrorKind::Io,
                format!("{}: the server closed the connection", what()),
            ));
        }
        let reply: Reply = serde_json::from_str(l.trim_end())
            .map_err(|e| Error::new(ErrorKind::Io, format!("{}: unreadable reply: {e}", what())))?;
        if reply.id.is_some() && reply.id != Some(id) {
            return Err(Error::new(
                ErrorKind::Io,
                format!("{}: reply to request {:?}, expected {id}", what(), reply.id),
            ));
        }
        reply.into_result()
    }

    /// [`Client::call`], with the result read as `T` (a type of
    /// [`crate::report`]).
    pub fn call_as<T: DeserializeOwned>(&mut self, op: Op) -> Result<T, Error> {
        let v = self.call(op)?;
        serde_json::from_value(v).map_err(|e| {
            Error::new(
                ErrorKind::Io,
                format!(
                    "control socket '{}': unexpected result: {e}",
                    self.path.display()
                ),
            )
        })
    }
}

/// One request on a new connection.
pub fn request(path: &Path, op: Op) -> Result<Value, Error> {
    Client::connect(path)?.call(op)
}
