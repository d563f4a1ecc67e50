//! Backend factories: a device from a spec string.
//!
//! - `ram:<size>[,prealloc]` — memory, allocated lazily (or all at once);
//! - `null:<size>[,delay=<µs>]` — completes without touching data;
//! - `file:<path>[,size=<size>][,buffered][,direct][,sqpoll][,iopoll][,ro]`
//!   — a file or block device through io_uring;
//! - `rbd:<pool>/<image>[@<snap>][,conf=<path>][,id=<client>][,cluster=<name>][,ro][,timeout=<s>]`
//!   — a Ceph RBD image through librbd (feature `rbd`);
//! - `luks:<device or path>[,key-file=PATH][,keyslot=N][,ro]` — a LUKS
//!   volume, opened by the registry as a crypt table over its device (it
//!   may name another udm device, which a backend factory cannot see; see
//!   [`crate::luks`]).

use std::sync::Arc;
use std::time::Duration;

use udm_backends::{FileDevice, FileOpts, NullDevice, RamDevice};
use udm_core::{BlockDevice, Error};

use crate::size::parse_size;

/// The backend kinds a spec may name, as `kind:` prefixes.
pub const KINDS: &[&str] = &["ram", "null", "file", "rbd", "luks"];

/// Whether `spec` names a backend (`kind:…`) rather than a table. A table
/// line starts with a sector number, so a word of letters before the first
/// `:` is a backend kind (known or not).
pub fn is_backend_spec(spec: &str) -> bool {
    match spec.split_once(':') {
        Some((kind, _)) => {
            !kind.is_empty()
                && !kind.contains(char::is_whitespace)
                && !kind.chars().any(|c| c.is_ascii_digit())
        }
        None => false,
    }
}

/// The kind of a backend spec (`ram`, `null`, `file`), if it is one.
pub fn backend_kind(spec: &str) -> Option<&str> {
    is_backend_spec(spec).then(|| spec.split_once(':').map_or("", |(k, _)| k))
}

/// Opens the backend `spec` describes, as a device called `name`.
pub fn open_backend(name: &str, spec: &str) -> Result<Arc<dyn BlockDevice>, Error> {
    let spec = spec.trim();
    if let Some(rest) = spec.strip_prefix("ram:") {
        let mut parts = rest.split(',');
        let dev = RamDevice::new(name, parse_size(parts.next().unwrap_or(""))?)?;
        for p in parts {
            match p {
                "prealloc" => dev.prealloc()?,
                _ => {
                    return Err(Error::invalid(format!(
                        "ram: unknown option '{p}' (known: prealloc)"
                    )))
                }
            }
        }
        return Ok(Arc::new(dev));
    }
    if let Some(rest) = spec.strip_prefix("null:") {
        let mut parts = rest.split(',');
        let size = parse_size(parts.next().unwrap_or(""))?;
        let mut delay = None;
        for p in parts {
            match p.split_once('=') {
                Some(("delay", us)) => {
                    let us: u64 = us.parse().map_err(|_| {
                        Error::invalid(format!("null: invalid delay '{us}': expected microseconds"))
                    })?;
                    delay = Some(Duration::from_micros(us));
                }
                _ => {
                    return Err(Error::invalid(format!(
                        "null: unknown option '{p}' (known: delay=<µs>)"
                    )))
                }
            }
        }
        return Ok(Arc::new(NullDevice::new(name, size, delay)?));
    }
    if let Some(rest) = spec.strip_prefix("file:") {
        let mut parts = rest.split(',');
        let path = parts.next().unwrap_or("");
        if path.is_empty() {
            return Err(Error::invalid("file: missing path (file:<path>[,options])"));
        }
        let mut o = FileOpts::default();
        for p in parts {
            match p.split_once('=') {
                Some(("size", v)) => o.size = Some(parse_size(v)?),
                None if p == "buffered" => o.buffered = true,
                None if p == "direct" => o.buffered = false,
                None if p == "sqpoll" => o.sqpoll = true,
                None if p == "iopoll" => o.iopoll = true,
                None if p == "ro" => o.read_only = true,
                _ => {
                    return Err(Error::invalid(format!(
                    "file: unknown option '{p}' (known: size=, buffered, direct, sqpoll, iopoll, ro)"
                )))
                }
            }
        }
        return Ok(Arc::new(FileDevice::open(name, path, o)?));
    }
    if let Some(rest) = spec.strip_prefix("rbd:") {
        return open_rbd(name, rest);
    }
    let kind = backend_kind(spec).unwrap_or(spec);
    Err(Error::invalid(format!(
        "unknown backend '{kind}:' (known: ram:, null:, file:, rbd:, luks:; or a table)"
    )))
}

#[cfg(feature = "rbd")]
fn open_rbd(name: &str, rest: &str) -> Result<Arc<dyn BlockDevice>, Error> {
    let o = udm_backends::RbdOpts::parse(rest)?;
    Ok(Arc::new(udm_backends::RbdDevice::open(name, &o)?))
}

#[cfg(not(feature = "rbd"))]
fn open_rbd(_name: &str, _rest: &str) -> Result<Arc<dyn BlockDevice>, Error> {
    Err(Error::new(
        udm_core::ErrorKind::Unsupported,
        "rbd: this udm was built without the 'rbd' feature",
    ))
}

/// Opens a device named by path in a table (`/…` or `./…`) with the file
/// backend's defaults; `None` for a name that is not a path.
pub fn open_path(path: &str) -> Option<Result<Arc<dyn BlockDevice>, Error>> {
    (path.starts_with('/') || path.starts_with("./")).then(|| {
        FileDevice::open(path, path, FileOpts::default())
            .map(|d| Arc::new(d) as Arc<dyn BlockDevice>)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_name_their_backend_and_options() {
        let r = open_backend("r", "ram:1M").unwrap();
        assert_eq!(r.limits().sectors, 2048);
        let n = open_backend("n", "null:1G,delay=5").unwrap();
        assert_eq!(n.limits().bytes(), 1 << 30);
        let err = |s: &str| open_backend("x", s).err().unwrap().to_string();
        assert!(err("ram:1Q").contains("invalid size '1Q'"));
        assert!(err("ram:1M,bogus").contains("ram: unknown option 'bogus'"));
        assert!(err("null:1G,slow").contains("unknown option 'slow'"));
        assert!(err("null:1G,delay=x").contains("invalid delay 'x'"));
        assert!(err("disk:1G").contains("unknown backend 'disk:'"));
        assert!(err("file:").contains("missing path"));
        assert!(err("file:/nonexistent/x").contains("/nonexistent/x"));
        assert!(err("file:/tmp/x,fast").contains("file: unknown option 'fast'"));
        assert!(err("rbd:noslash").contains("expected <pool>/<image>"));
        assert!(err("rbd:p/i,fast").contains("rbd: unknown option 'fast'"));
        assert!(err("rbd:p/i,timeout=0").contains("invalid timeout '0'"));
    }

    #[test]
    fn table_lines_are_not_backend_specs() {
        assert!(is_backend_spec("ram:1G"));
        assert!(is_backend_spec("disk:1G"));
        assert!(!is_backend_spec("0 8 linear r 0"));
        assert!(!is_backend_spec("0 8 linear /dev/x:1 0"));
        assert_eq!(backend_kind("file:/x"), Some("file"));
        assert_eq!(backend_kind("0 8 zero"), None);
    }
}
