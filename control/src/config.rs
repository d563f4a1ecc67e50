//! The daemon's configuration file: devices and exports, in TOML, in the
//! order they are created. `udm dump-config` prints a running daemon's
//! state in the same form, so a restart with it recreates the stack.
//!
//! ```toml
//! [[device]]
//! name = "ram0"
//! spec = "ram:1G"
//!
//! [[device]]
//! name = "lin"
//! table = "0 2097152 linear ram0 0"
//!
//! [[export]]
//! device = "lin"
//! nbd = "unix:/run/udm/lin.sock"
//! ```
//!
//! What a file does not hold: suspended states and inactive tables (a
//! restart starts every device live), and data (a RAM disk starts empty).

use std::path::Path;

use serde::{Deserialize, Serialize};
use toml::Spanned;
use udm_core::Error;

use crate::exports::{ExportInfo, ExportOpts, ExportSpec, LimitsDef};
use crate::luks::{LuksSpec, Passphrase};
use crate::registry::RemoveMode;
use crate::verbs::Control;

/// What [`Config::apply_asking`] calls with a device's name and `luks:`
/// spec for its passphrase.
pub type AskPassphrase<'a> = dyn FnMut(&str, &str) -> Result<Option<Passphrase>, Error> + 'a;

/// A device to create: a backend (`spec`) or a mapped device (`table`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceDef {
    /// Its name.
    pub name: String,
    /// A backend spec (`ram:1G`, `null:…`, `file:PATH,…`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<String>,
    /// A dm table (lines separated by newlines or `;`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table: Option<String>,
}

/// An export to start. Its options are [`ExportOpts`]'s fields spelled
/// out rather than a `#[serde(flatten)]` of it: serde does not support
/// `deny_unknown_fields` with `flatten`, and a misspelt key in a config
/// file must be an error, not an option silently left out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportDef {
    /// The device served.
    pub device: String,
    /// The name clients ask for (default: the device's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Served over NBD at this address (`unix:PATH`, `HOST:PORT`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd: Option<String>,
    /// Served over vhost-user-blk at this socket path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vhost_user_blk: Option<String>,
    /// Served as a ublk block device (`/dev/ublkbN`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ublk: bool,
    /// Refuse writes.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
    /// Queues (vhost-user-blk, ublk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queues: Option<u32>,
    /// Requests each queue holds (ublk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub depth: Option<u32>,
    /// The N of `/dev/ublkbN` (ublk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<u32>,
    /// Re-attach the device a udm that died left behind (ublk).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub recover: bool,
    /// A device of the daemon's user, not root's (ublk).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unprivileged: bool,
    /// `auto` (default), `direct` or `queued`: how requests go to the
    /// device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dispatch: Option<String>,
    /// NBD over TLS: `off`, `on` or `require`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<String>,
    /// The TLS credentials' directory (QEMU's x509 layout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_creds: Option<String>,
    /// Require a client certificate signed by the CA.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tls_verify_peer: bool,
    /// Admit only client certificates with these subject names.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tls_authz: Vec<String>,
    /// Serve plaintext on a TCP address off loopback.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub insecure: bool,
}

impl ExportDef {
    /// The export this entry asks for; an error unless it names exactly
    /// one protocol.
    pub fn spec(&self) -> Result<ExportSpec, Error> {
        let (protocol, address) = match (&self.nbd, &self.vhost_user_blk, self.ublk) {
            (Some(a), None, false) => ("nbd", a.clone()),
            (None, Some(p), false) => ("vhost-user-blk", p.clone()),
            (None, None, true) => ("ublk", String::new()),
            _ => {
                return Err(Error::invalid(format!(
                    "export of '{}': give exactly one of nbd, vhost_user_blk, ublk",
                    self.device
                )))
            }
        };
        let opts = ExportOpts {
            queues: self.queues,
            depth: self.depth,
            id: self.id,
            recover: self.recover,
            unprivileged: self.unprivileged,
            dispatch: self.dispatch.clone(),
            tls: self.tls.clone(),
            tls_creds: self.tls_creds.clone(),
            tls_verify_peer: self.tls_verify_peer,
            tls_authz: self.tls_authz.clone(),
            insecure: self.insecure,
        };
        opts.dispatch()
            .map_err(|e| e.context(format!("export of '{}'", self.device)))?;
        Ok(ExportSpec {
            device: self.device.clone(),
            protocol: protocol.into(),
            address,
            name: self.name.clone(),
            read_only: self.read_only,
            opts,
        })
    }

    /// The entry for a running export.
    pub fn of(e: ExportInfo) -> ExportDef {
        let mut d = ExportDef {
            name: (e.name != e.device).then_some(e.name),
            device: e.device,
            nbd: None,
            vhost_user_blk: None,
            ublk: false,
            read_only: e.read_only,
            queues: e.opts.queues,
            depth: e.opts.depth,
            id: e.opts.id,
            recover: e.opts.recover,
            unprivileged: e.opts.unprivileged,
            dispatch: e.opts.dispatch,
            tls: e.opts.tls,
            tls_creds: e.opts.tls_creds,
            tls_verify_peer: e.opts.tls_verify_peer,
            tls_authz: e.opts.tls_authz,
            insecure: e.opts.insecure,
        };
        match e.protocol.as_str() {
            "vhost-user-blk" => d.vhost_user_blk = Some(e.address),
            "ublk" => d.ublk = true,
            _ => d.nbd = Some(e.address),
        }
        d
    }
}

/// A configuration: limits, devices, then exports, each in order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The exports' limits.
    #[serde(default, skip_serializing_if = "LimitsDef::is_empty")]
    pub limits: LimitsDef,
    /// The devices, in creation order (a table uses earlier ones).
    #[serde(default, rename = "device")]
    pub devices: Vec<DeviceDef>,
    /// The exports.
    #[serde(default, rename = "export")]
    pub exports: Vec<ExportDef>,
    /// Where each entry starts in the file it was read from, as "FILE
    /// line N" (empty for a config not read from a file).
    #[serde(skip)]
    origin: Origin,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Origin {
    limits: String,
    devices: Vec<String>,
    exports: Vec<String>,
}

/// The file's shape with each entry's place, for errors naming the line.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Spanned_ {
    #[serde(default)]
    limits: Option<Spanned<LimitsDef>>,
    #[serde(default, rename = "device")]
    devices: Vec<Spanned<DeviceDef>>,
    #[serde(default, rename = "export")]
    exports: Vec<Spanned<ExportDef>>,
}

fn line_of(text: &str, at: usize) -> usize {
    text.as_bytes()[..at.min(text.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

impl Config {
    /// Parses `text` (from `what`, named in errors with the line).
    pub fn parse(text: &str, what: &str) -> Result<Config, Error> {
        let s: Spanned_ = toml::from_str(text).map_err(|e| {
            let at = e
                .span()
                .map(|s| format!(" line {}", line_of(text, s.start)))
                .unwrap_or_default();
            Error::invalid(format!("{what}{at}: {}", e.message()))
        })?;
        let place =
            |span: std::ops::Range<usize>| format!("{what} line {}", line_of(text, span.start));
        let mut c = Config::default();
        if let Some(l) = s.limits {
            c.origin.limits = place(l.span());
            c.limits = l.into_inner();
        }
        for d in s.devices {
            c.origin.devices.push(place(d.span()));
            let d = d.into_inner();
            if d.spec.is_some() == d.table.is_some() {
                return Err(Error::invalid(format!(
                    "{}: device '{}': give one of spec (a backend) or table (a mapped device)",
                    c.origin.devices[c.devices.len()],
                    d.name
                )));
            }
            c.devices.push(d);
        }
        for e in s.exports {
            c.origin.exports.push(place(e.span()));
            let e = e.into_inner();
            e.spec()
                .map_err(|err| err.context(c.origin.exports[c.exports.len()].clone()))?;
            c.exports.push(e);
        }
        Ok(c)
    }

    /// Reads and parses the file at `path`.
    pub fn read(path: &Path) -> Result<Config, Error> {
        let what = format!("config '{}'", path.display());
        let text = std::fs::read_to_string(path).map_err(|e| Error::os(what.clone(), e))?;
        Config::parse(&text, &what)
    }

    /// Where the `[limits]` table is, as "FILE line N" (for errors in
    /// its values; empty if the file has none).
    pub fn limits_origin(&self) -> &str {
        &self.origin.limits
    }

    /// The file's text.
    pub fn to_toml(&self) -> Result<String, Error> {
        toml::to_string(self).map_err(|e| Error::invalid(format!("writing the config: {e}")))
    }

    fn place(list: &[String], i: usize) -> String {
        list.get(i)
            .cloned()
            .unwrap_or_else(|| format!("entry {}", i + 1))
    }

    /// Creates the devices, then starts the exports, in order. On an error
    /// (naming the entry and its line) whatever this call made is undone:
    /// exports stopped, devices removed, top first.
    pub fn apply(&self, ctl: &Control) -> Result<(), Error> {
        self.apply_asking(ctl, &mut |_, _| Ok(None))
    }

    /// [`Config::apply`], calling `ask(name, spec)` for the passphrase of
    /// each `luks:` spec without a `key-file` (the daemon asks on its
    /// terminal); `None` leaves the spec to fail in one line.
    pub fn apply_asking(&self, ctl: &Control, ask: &mut AskPassphrase<'_>) -> Result<(), Error> {
        let mut made = Vec::new();
        let mut exported = Vec::new();
        let r = (|| {
            for (i, d) in self.devices.iter().enumerate() {
                let at = |e: Error| e.context(Config::place(&self.origin.devices, i));
                let spec = d.spec.as_deref().or(d.table.as_deref()).unwrap_or_default();
                let pass = match spec.trim().strip_prefix("luks:").map(LuksSpec::parse) {
                    Some(Ok(l)) if l.key_file.is_none() => ask(&d.name, spec)
                        .map_err(|e| e.context(format!("device '{}'", d.name)))
                        .map_err(at)?,
                    _ => None,
                };
                ctl.create_with(&d.name, spec, pass.as_ref()).map_err(at)?;
                made.push(d.name.clone());
            }
            for (i, e) in self.exports.iter().enumerate() {
                let info = e
                    .spec()
                    .and_then(|spec| ctl.export_add(spec))
                    .map_err(|err| err.context(Config::place(&self.origin.exports, i)))?;
                exported.push(info.name);
            }
            Ok(())
        })();
        if r.is_err() {
            for n in exported.iter().rev() {
                let _ = ctl.export_remove(n, true);
            }
            for n in made.iter().rev() {
                let _ = ctl.remove(n, RemoveMode::Normal);
            }
        }
        r
    }

    /// The running state of `ctl` as a configuration: every device (a
    /// mapped one with its live table), then every export.
    pub fn dump(ctl: &Control) -> Result<Config, Error> {
        Config::dump_shown(ctl, false)
    }

    /// [`Config::dump`], with crypt keys written into the tables when
    /// `show_keys` (otherwise they are `-`, and a crypt table given by a
    /// hex key is dumped in a form that does not load again).
    pub fn dump_shown(ctl: &Control, show_keys: bool) -> Result<Config, Error> {
        let mut c = Config {
            limits: ctl.limits(),
            ..Config::default()
        };
        {
            let r = ctl.registry();
            for e in r.entries() {
                // A LUKS volume is dumped as its spec, never with a secret:
                // with its key file's path it opens again as it is; without
                // one (its passphrase came in the create request) the
                // daemon applying the file asks for the passphrase on its
                // terminal, as `udm create` did.
                let (spec, table) = match e.mapped() {
                    Some(m) if e.kind() != "luks" => {
                        let t = m.table();
                        let lines = if show_keys {
                            t.table_lines_with_keys()
                        } else {
                            t.table_lines()
                        };
                        (None, Some(lines.join("\n")))
                    }
                    _ => (Some(e.spec().to_string()), None),
                };
                c.devices.push(DeviceDef {
                    name: e.name().to_string(),
                    spec,
                    table,
                });
            }
        }
        if let Ok(list) = ctl.export_ls() {
            for e in list.exports {
                c.exports.push(ExportDef::of(e));
            }
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_lists_devices_then_exports_and_round_trips() {
        let text = r#"
[[device]]
name = "ram0"
spec = "ram:1M"

[[device]]
name = "lin"
table = "0 2048 linear ram0 0"

[[export]]
device = "lin"
nbd = "unix:/tmp/x.sock"
"#;
        let c = Config::parse(text, "test").unwrap();
        assert_eq!(c.devices.len(), 2);
        assert_eq!(c.exports[0].nbd.as_deref(), Some("unix:/tmp/x.sock"));
        let again = Config::parse(&c.to_toml().unwrap(), "again").unwrap();
        assert_eq!(again.devices, c.devices);
        assert_eq!(again.exports, c.exports);
    }

    #[test]
    fn errors_name_the_file_and_line() {
        let e = Config::parse("[[device]]\nname = 1\n", "f").unwrap_err();
        assert!(e.to_string().starts_with("f line 2: "), "{e}");
        let e = Config::parse(
            "[[device]]\nname = \"a\"\nspec = \"ram:1M\"\n\n[[device]]\nname = \"b\"\n",
            "f",
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("line 5: device 'b': give one of spec"),
            "{e}"
        );
        let e = Config::parse("[[devices]]\n", "f").unwrap_err();
        assert!(e.to_string().contains("unknown field"), "{e}");
    }

    #[test]
    fn a_failing_entry_leaves_nothing_behind() {
        let text = "[[device]]\nname = \"r\"\nspec = \"ram:1M\"\n\n[[device]]\nname = \"l\"\ntable = \"0 2048 linear nope 0\"\n";
        let c = Config::parse(text, "f").unwrap();
        let ctl = Control::default();
        let e = c.apply(&ctl).unwrap_err().to_string();
        assert!(e.starts_with("f line 5: "), "{e}");
        assert!(e.contains("unknown device 'nope'"), "{e}");
        assert!(ctl.ls().devices.is_empty());
    }

    #[test]
    fn dump_gives_the_live_tables() {
        let ctl = Control::build(&["r=ram:1M", "s=ram:1M", "l=0 2048 linear r 0"]).unwrap();
        ctl.reload("l", "0 1024 linear s 0; 1024 1024 zero")
            .unwrap();
        let c = Config::dump(&ctl).unwrap();
        assert_eq!(c.devices[0].spec.as_deref(), Some("ram:1M"));
        assert_eq!(
            c.devices[2].table.as_deref(),
            Some("0 1024 linear s 0\n1024 1024 zero")
        );
        let again = Control::default();
        Config::parse(&c.to_toml().unwrap(), "dump")
            .unwrap()
            .apply(&again)
            .unwrap();
        assert_eq!(again.table(&[]).unwrap(), ctl.table(&[]).unwrap());
    }
}
