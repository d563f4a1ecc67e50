//! Device specs: `--dev NAME=SPEC`, built into a stack of devices.
//!
//! SPEC is a backend or a table:
//! - `ram:<size>[,prealloc]` — memory, allocated lazily (or all at once);
//! - `null:<size>[,delay=<µs>]` — completes without touching data;
//! - `file:<path>[,size=<size>][,buffered][,sqpoll][,iopoll][,ro]` — io_uring;
//! - anything else is a dm table: `<start> <length> <type> <args…>` lines
//!   separated by `;` or newlines, naming earlier devices or paths.
//!
//! Sizes take K, M, G, T (powers of 1024), optionally followed by `iB` or `B`,
//! or `s` for 512-byte sectors.

use std::sync::Arc;
use std::time::Duration;

use udm_backends::{FileDevice, FileOpts, NullDevice, RamDevice};
use udm_core::{BlockDevice, Error, ErrorKind};
use udm_mapper::{MappedDevice, Registry, Table};

/// Parses a size such as `4096`, `4k`, `1G`, `512MiB`, `8s`.
pub fn parse_size(s: &str) -> Result<u64, Error> {
    let bad = || {
        Error::invalid(format!(
            "invalid size '{s}': expected a number with an optional K/M/G/T or s (sectors) suffix"
        ))
    };
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    if digits == 0 {
        return Err(bad());
    }
    let n: u64 = t[..digits].parse().map_err(|_| bad())?;
    let mult: u64 = match t[digits..].to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "s" => 512,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(bad()),
    };
    n.checked_mul(mult).ok_or_else(bad)
}

/// The devices defined on a command line, in definition order.
#[derive(Default)]
pub struct Stack {
    devs: Vec<Arc<dyn BlockDevice>>,
    registry: Option<Registry>,
}

/// The built-in default: a 1 GiB RAM disk with linear over it, and a second
/// RAM disk so that a striped device spans two.
pub const DEFAULT_DEVS: &[&str] = &[
    "ram0=ram:1G",
    "ram1=ram:1G",
    "lin=0 2097152 linear ram0 0",
    "str=0 2097152 striped 2 128 ram0 0 ram1 0",
];

impl Stack {
    /// Builds devices from `NAME=SPEC` strings, each able to use earlier ones.
    pub fn build<S: AsRef<str>>(defs: &[S]) -> Result<Stack, Error> {
        let mut st = Stack {
            devs: Vec::new(),
            registry: Some(Registry::builtin()),
        };
        for d in defs {
            st.add(d.as_ref())?;
        }
        Ok(st)
    }

    /// Adds one `NAME=SPEC` definition.
    pub fn add(&mut self, def: &str) -> Result<(), Error> {
        let Some((name, spec)) = def.split_once('=') else {
            return Err(Error::invalid(format!(
                "--dev '{def}': expected NAME=SPEC (e.g. ram0=ram:1G)"
            )));
        };
        let name = name.trim();
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        {
            return Err(Error::invalid(format!(
                "--dev '{def}': invalid device name '{name}' (letters, digits, _ - . only)"
            )));
        }
        if self.get(name).is_some() {
            return Err(Error::invalid(format!(
                "--dev '{def}': device '{name}' is defined twice"
            )));
        }
        let dev = self
            .make(name, spec.trim())
            .map_err(|e| e.context(format!("device '{name}'")))?;
        self.devs.push(dev);
        Ok(())
    }

    fn make(&self, name: &str, spec: &str) -> Result<Arc<dyn BlockDevice>, Error> {
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
                            Error::invalid(format!(
                                "null: invalid delay '{us}': expected microseconds"
                            ))
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
        if let Some((kind, _)) = spec.split_once(':') {
            if !kind.contains(char::is_whitespace) && !kind.chars().any(|c| c.is_ascii_digit()) {
                return Err(Error::invalid(format!(
                    "unknown backend '{kind}:' (known: ram:, null:, file:; or a table)"
                )));
            }
        }
        let registry = match &self.registry {
            Some(r) => r,
            None => return Err(Error::invalid("no target registry")),
        };
        let resolve = |n: &str| self.resolve(n);
        let table = Table::from_text(spec, registry, &resolve)?;
        Ok(MappedDevice::new(name, table))
    }

    /// A device named in a table: an earlier `--dev`, or a path opened with
    /// the file backend's defaults.
    fn resolve(&self, n: &str) -> Result<Arc<dyn BlockDevice>, Error> {
        if let Some(d) = self.get(n) {
            return Ok(d);
        }
        if n.starts_with('/') || n.starts_with("./") {
            return Ok(Arc::new(FileDevice::open(n, n, FileOpts::default())?));
        }
        Err(Error::new(
            ErrorKind::NotFound,
            format!("unknown device '{n}' (define it with an earlier --dev, or give a path)"),
        ))
    }

    /// Builds a new table for the existing device `name` (for a reload):
    /// it may name only devices defined before `name` (or paths), as when
    /// the stack was built, so a reload cannot make a device map onto
    /// itself or onto a device stacked over it.
    pub fn build_table(&self, name: &str, text: &str) -> Result<Table, Error> {
        let Some(idx) = self.devs.iter().position(|d| d.name() == name) else {
            return Err(Error::new(
                ErrorKind::NotFound,
                format!("unknown device '{name}'"),
            ));
        };
        let registry = match &self.registry {
            Some(r) => r,
            None => return Err(Error::invalid("no target registry")),
        };
        let below = &self.devs[..idx];
        let resolve = |n: &str| -> Result<Arc<dyn BlockDevice>, Error> {
            if let Some(d) = below.iter().find(|d| d.name() == n) {
                return Ok(d.clone());
            }
            if self.get(n).is_some() {
                return Err(Error::invalid(format!(
                    "device '{n}' is '{name}' itself or defined after it: a table may use only devices defined before it"
                )));
            }
            self.resolve(n)
        };
        Table::from_text(text, registry, &resolve)
    }

    /// The device called `name`.
    pub fn get(&self, name: &str) -> Option<Arc<dyn BlockDevice>> {
        self.devs.iter().find(|d| d.name() == name).cloned()
    }

    /// All devices, in definition order.
    pub fn devices(&self) -> &[Arc<dyn BlockDevice>] {
        &self.devs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_accept_binary_suffixes_and_sectors() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("8s").unwrap(), 4096);
        for bad in ["", "G", "1X", "-1", "1.5G", "99999999999999999999T"] {
            let e = parse_size(bad).unwrap_err().to_string();
            assert!(e.contains("invalid size"), "{bad}: {e}");
        }
    }

    #[test]
    fn specs_build_backends_and_tables_in_order() {
        let st = Stack::build(DEFAULT_DEVS).unwrap();
        assert_eq!(st.devices().len(), 4);
        assert_eq!(st.get("lin").unwrap().limits().sectors, 2097152);
        assert_eq!(st.get("str").unwrap().limits().io_opt, 2 * 128 * 512);
    }

    #[test]
    fn a_reloaded_table_may_use_only_devices_defined_before_its_device() {
        let st =
            Stack::build(&["a=ram:1M", "l=0 2048 linear a 0", "top=0 2048 linear l 0"]).unwrap();
        let t = st
            .build_table("l", "0 1024 linear a 0; 1024 1024 zero")
            .unwrap();
        assert_eq!(t.sectors(), 2048);
        for bad in ["0 2048 linear l 0", "0 2048 linear top 0"] {
            let e = st.build_table("l", bad).err().unwrap().to_string();
            assert!(e.contains("defined after it"), "{bad}: {e}");
        }
        let e = st
            .build_table("nope", "0 8 zero")
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("unknown device 'nope'"), "{e}");
    }

    #[test]
    fn bad_specs_name_the_offending_token() {
        let err = |defs: &[&str]| Stack::build(defs).err().unwrap().to_string();
        assert!(err(&["ram0"]).contains("expected NAME=SPEC"));
        assert!(err(&["r@m=ram:1G"]).contains("invalid device name 'r@m'"));
        assert!(err(&["a=ram:1Q"]).contains("invalid size '1Q'"));
        assert!(err(&["a=ram:1G", "a=ram:1G"]).contains("defined twice"));
        assert!(err(&["a=ram:1M,bogus"]).contains("ram: unknown option 'bogus'"));
        assert!(err(&["a=disk:1G"]).contains("unknown backend 'disk:'"));
        assert!(err(&["a=null:1G,slow"]).contains("unknown option 'slow'"));
        assert!(err(&["l=0 8 linear nope 0"]).contains("unknown device 'nope'"));
        assert!(err(&["r=ram:4k", "l=0 16 linear r 0"]).contains("too small"));
        assert!(err(&["r=ram:1M", "l=0 8 linear r zz"]).contains("invalid device sector 'zz'"));
        assert!(err(&["a=file:/nonexistent/x"]).contains("/nonexistent/x"));
    }
}
