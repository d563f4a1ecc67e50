//! Control-path errors: a kind, the context a person needs (device, argument,
//! path), and the OS error underneath if there is one. The data path uses
//! [`crate::Status`] instead.

use std::fmt;

/// What went wrong, broadly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// A malformed table, spec, argument or option.
    Invalid,
    /// A named device or file does not exist.
    NotFound,
    /// The device or kernel cannot do what was asked (e.g. IOPOLL here).
    Unsupported,
    /// The device is busy (e.g. already suspended).
    Busy,
    /// An operating-system call failed.
    Os,
    /// An I/O completed with an error.
    Io,
    /// A wait ran out of time.
    TimedOut,
    /// Refused: the caller is not admitted (a socket's peer, a directory
    /// others could write).
    Denied,
}

/// A control-path error. `Display` gives one line, naming what is wrong.
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    msg: String,
    source: Option<std::io::Error>,
}

impl Error {
    /// An error of `kind` saying `msg`.
    pub fn new(kind: ErrorKind, msg: impl Into<String>) -> Error {
        Error {
            kind,
            msg: msg.into(),
            source: None,
        }
    }
    /// A malformed-input error.
    pub fn invalid(msg: impl Into<String>) -> Error {
        Error::new(ErrorKind::Invalid, msg)
    }
    /// An OS error with what we were doing. The kind follows the OS error
    /// where a caller may act on it (a missing file is `NotFound`, an
    /// unsupported operation `Unsupported`, a busy device `Busy`).
    pub fn os(msg: impl Into<String>, source: std::io::Error) -> Error {
        let kind = match source.kind() {
            std::io::ErrorKind::NotFound => ErrorKind::NotFound,
            std::io::ErrorKind::Unsupported => ErrorKind::Unsupported,
            _ => match source.raw_os_error() {
                Some(libc::EBUSY) => ErrorKind::Busy,
                Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => ErrorKind::Unsupported,
                _ => ErrorKind::Os,
            },
        };
        Error {
            kind,
            msg: msg.into(),
            source: Some(source),
        }
    }
    /// The kind.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }
    /// The OS error number underneath, if there is one (as
    /// [`std::io::Error::raw_os_error`]).
    pub fn raw_os_error(&self) -> Option<i32> {
        self.source.as_ref().and_then(std::io::Error::raw_os_error)
    }
    /// Prefixes the message with more context ("table for 'lin': …").
    pub fn context(mut self, ctx: impl fmt::Display) -> Error {
        self.msg = format!("{ctx}: {}", self.msg);
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.source {
            Some(s) => write!(f, "{}: {}", self.msg, s),
            None => f.write_str(&self.msg),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_ref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// Shorthand for control-path results.
pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn os_errors_keep_the_kind_a_caller_acts_on() {
        let missing = std::fs::File::open("/nonexistent/udm-test").unwrap_err();
        let e = Error::os("file '/nonexistent/udm-test'", missing);
        assert_eq!(e.kind(), ErrorKind::NotFound);
        assert_eq!(
            e.to_string(),
            "file '/nonexistent/udm-test': No such file or directory (os error 2)"
        );
        let busy = Error::os("open", std::io::Error::from_raw_os_error(libc::EBUSY));
        assert_eq!(busy.kind(), ErrorKind::Busy);
        let perm = Error::os("open", std::io::Error::from_raw_os_error(libc::EACCES));
        assert_eq!(perm.kind(), ErrorKind::Os);
        assert_eq!(perm.raw_os_error(), Some(libc::EACCES));
        assert_eq!(Error::invalid("bad").raw_os_error(), None);
    }
}
