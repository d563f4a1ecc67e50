//! The typed results of the verbs: serialized as the protocol's `ok`
//! values (and by `--json`), displayed as dmsetup-like text.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::registry::Holder;

/// One device, as `info` and `ls` report it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Info {
    /// Its name.
    pub name: String,
    /// `ram`, `null`, `file` or `mapped`.
    pub kind: String,
    /// Size in 512-byte sectors.
    pub sectors: u64,
    /// Logical block size in bytes.
    pub logical_block_size: u32,
    /// Largest I/O in bytes.
    pub max_io_bytes: u32,
    /// Capabilities, as `flush|fua|…`.
    pub caps: String,
    /// Whether I/O is held (a mapped device between suspend and resume).
    pub suspended: bool,
    /// Whether an inactive table is loaded.
    pub inactive_table: bool,
    /// What holds it.
    pub holders: Vec<Holder>,
    /// The devices its tables use (empty for a backend).
    #[serde(default)]
    pub deps: Vec<String>,
    /// Its event counter (table swaps and target events; `udm wait`).
    #[serde(default)]
    pub event_nr: u64,
    /// A deferred remove is pending: it goes when its last holder does.
    #[serde(default)]
    pub deferred_remove: bool,
    /// What lies behind a backend, if it says (an RBD image's size,
    /// features, object size and cache mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// Whether merging adjacent requests helps the device, and why:
    /// `yes (file on a disk, O_DIRECT)` (its report, seed 004).
    #[serde(default)]
    pub merging: String,
    /// The exports of the device, each with the dispatch it uses and why:
    /// `lin (nbd): queued (auto: merging helps (…))`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exports: Vec<String>,
}

impl fmt::Display for Info {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = if self.suspended {
            "SUSPENDED"
        } else {
            "ACTIVE"
        };
        let tables = match (self.kind == "mapped", self.inactive_table) {
            (true, true) => "LIVE & INACTIVE",
            (true, false) => "LIVE",
            (false, _) => "None (a backend)",
        };
        writeln!(f, "Name:              {}", self.name)?;
        writeln!(f, "Kind:              {}", self.kind)?;
        writeln!(f, "State:             {state}")?;
        writeln!(f, "Tables present:    {tables}")?;
        writeln!(f, "Sectors:           {}", self.sectors)?;
        writeln!(f, "Block size:        {}", self.logical_block_size)?;
        writeln!(f, "Max I/O:           {}", self.max_io_bytes)?;
        writeln!(f, "Caps:              {}", self.caps)?;
        writeln!(f, "Event number:      {}", self.event_nr)?;
        if let Some(b) = &self.backend {
            writeln!(f, "Backend:           {b}")?;
        }
        writeln!(f, "Merging helps:     {}", self.merging)?;
        for e in &self.exports {
            writeln!(f, "Export dispatch:   {e}")?;
        }
        if self.deferred_remove {
            writeln!(f, "Deferred remove:   pending")?;
        }
        let holders: Vec<String> = self.holders.iter().map(|h| h.to_string()).collect();
        write!(
            f,
            "Holders:           {}",
            if holders.is_empty() {
                "none".to_string()
            } else {
                holders.join(", ")
            }
        )
    }
}

/// `ls`: every device, in creation order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct List {
    /// The devices.
    pub devices: Vec<Info>,
}

impl fmt::Display for List {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, d) in self.devices.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{}\t{}\t{} sectors", d.name, d.kind, d.sectors)?;
        }
        Ok(())
    }
}

/// The status lines of one mapped device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceStatus {
    /// The device.
    pub name: String,
    /// `start len type status…` per target, as `dmsetup status`.
    pub lines: Vec<String>,
}

/// `status`: the mapped devices named (or all).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// Per device, in creation order.
    pub devices: Vec<DeviceStatus>,
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for d in &self.devices {
            for l in &d.lines {
                if !first {
                    writeln!(f)?;
                }
                first = false;
                write!(f, "{}: {l}", d.name)?;
            }
        }
        Ok(())
    }
}

/// One target of a live table: its table line and its status line.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetLines {
    /// `start len type args…`, as `dmsetup table`.
    pub table: String,
    /// `start len type status…`, as `dmsetup status`.
    pub status: String,
}

/// One device in a `table` report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceTable {
    /// The device.
    pub name: String,
    /// Size in sectors.
    pub sectors: u64,
    /// Logical block size in bytes.
    pub logical_block_size: u32,
    /// Largest I/O in bytes.
    pub max_io_bytes: u32,
    /// Capabilities, as `flush|fua|…`.
    pub caps: String,
    /// Whether I/O is held.
    pub suspended: bool,
    /// The live table's targets (empty for a backend).
    pub targets: Vec<TargetLines>,
    /// The inactive table's lines, if one is loaded.
    pub inactive: Option<Vec<String>>,
}

/// `table`: the devices named (or all).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tables {
    /// Per device, in creation order.
    pub devices: Vec<DeviceTable>,
}

impl fmt::Display for Tables {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = Vec::new();
        for d in &self.devices {
            out.push(format!(
                "{}: {} sectors, lbs {}, max io {}, caps {}{}",
                d.name,
                d.sectors,
                d.logical_block_size,
                d.max_io_bytes,
                d.caps,
                if d.suspended { ", suspended" } else { "" }
            ));
            for t in &d.targets {
                out.push(format!("  table:  {}", t.table));
                out.push(format!("  status: {}", t.status));
            }
            for l in d.inactive.iter().flatten() {
                out.push(format!("  inactive: {l}"));
            }
        }
        f.write_str(&out.join("\n"))
    }
}

/// `deps`: the devices a mapped device's tables use.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deps {
    /// The device.
    pub name: String,
    /// The devices its live and inactive tables use.
    pub deps: Vec<String>,
}

impl fmt::Display for Deps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} dependencies\t: {}",
            self.deps.len(),
            self.deps
                .iter()
                .map(|d| format!("({d})"))
                .collect::<Vec<_>>()
                .join(" ")
        )
    }
}

/// `message`: the target's reply (often empty).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessageReply {
    /// The reply text.
    pub reply: String,
}

impl fmt::Display for MessageReply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.reply.trim_end_matches('\n'))
    }
}

/// One target type.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetInfo {
    /// Its name in table lines.
    pub name: String,
    /// Its version.
    pub version: [u32; 3],
    /// What it does, in one line.
    pub summary: String,
    /// Its table-line arguments, as dm documents them.
    pub usage: String,
    /// Fewest arguments.
    pub min_args: usize,
    /// Most arguments (`None`: no upper bound).
    pub max_args: Option<usize>,
    /// Whether it splits I/O at boundaries of its own.
    pub splits: bool,
    /// Argument positions naming devices it claims exclusively.
    pub exclusive_args: Vec<usize>,
}

/// `targets`: the target types tables may use.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Targets {
    /// The types.
    pub targets: Vec<TargetInfo>,
}

impl fmt::Display for Targets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let lines: Vec<String> = self
            .targets
            .iter()
            .map(|t| {
                let [a, b, c] = t.version;
                format!(
                    "{:<12} v{a}.{b}.{c}  {}\n{:<12}   args: {}",
                    t.name,
                    t.summary,
                    "",
                    if t.usage.is_empty() { "none" } else { &t.usage }
                )
            })
            .collect();
        f.write_str(&lines.join("\n"))
    }
}

/// `version`: udm's and the protocol's.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Version {
    /// udm's version.
    pub udm: String,
    /// The control protocol's version.
    pub protocol: u32,
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "udm {}\ncontrol protocol {}", self.udm, self.protocol)
    }
}

/// A verb that returns nothing but success.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Done {}

impl fmt::Display for Done {
    fn fmt(&self, _: &mut fmt::Formatter<'_>) -> fmt::Result {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_renders_as_dmsetup_status() {
        let s = Status {
            devices: vec![
                DeviceStatus {
                    name: "lin".into(),
                    lines: vec!["0 8 linear".into()],
                },
                DeviceStatus {
                    name: "two".into(),
                    lines: vec!["0 4 zero".into(), "4 4 error".into()],
                },
            ],
        };
        assert_eq!(
            s.to_string(),
            "lin: 0 8 linear\ntwo: 0 4 zero\ntwo: 4 4 error"
        );
    }

    #[test]
    fn reports_round_trip_through_json() {
        let i = Info {
            name: "a".into(),
            kind: "ram".into(),
            sectors: 8,
            logical_block_size: 512,
            max_io_bytes: 1 << 20,
            caps: "flush".into(),
            suspended: false,
            inactive_table: false,
            holders: vec![Holder::Table { device: "l".into() }],
            deps: vec![],
            event_nr: 0,
            deferred_remove: false,
            backend: Some("rbd rbd/img size 8".into()),
            merging: "no (RAM: a request costs only its copy)".into(),
            exports: vec!["a (nbd): direct (asked for)".into()],
        };
        let j = serde_json::to_string(&i).unwrap();
        assert!(
            j.contains(r#""holders":[{"kind":"table","device":"l"}]"#),
            "{j}"
        );
        assert_eq!(serde_json::from_str::<Info>(&j).unwrap(), i);
        assert!(i
            .to_string()
            .contains("Holders:           the table of 'l'"));
        assert!(i
            .to_string()
            .contains("Export dispatch:   a (nbd): direct (asked for)\n"));
    }
}

impl List {
    /// The devices as a forest, as `dmsetup ls --tree` draws it: each
    /// device that no table uses at the root, the devices its tables use
    /// below it (a device used by two tables appears under both).
    pub fn tree(&self) -> String {
        let used: Vec<&str> = self
            .devices
            .iter()
            .flat_map(|d| d.deps.iter().map(String::as_str))
            .collect();
        let mut out = String::new();
        for d in self
            .devices
            .iter()
            .filter(|d| !used.contains(&d.name.as_str()))
        {
            self.draw(d, "", "", &mut out, 0);
        }
        out.pop();
        out
    }

    fn draw(&self, d: &Info, first: &str, rest: &str, out: &mut String, depth: usize) {
        out.push_str(&format!(
            "{first}{} ({}, {} sectors)\n",
            d.name, d.kind, d.sectors
        ));
        if depth > self.devices.len() {
            return; // a cycle cannot be built, but a bad reply must not loop
        }
        for (i, dep) in d.deps.iter().enumerate() {
            let last = i + 1 == d.deps.len();
            let (branch, cont) = if last {
                ("└─", "  ")
            } else {
                ("├─", "│ ")
            };
            let f = format!("{rest} {branch}");
            let r = format!("{rest} {cont}");
            match self.devices.iter().find(|x| &x.name == dep) {
                Some(x) => self.draw(x, &f, &r, out, depth + 1),
                None => out.push_str(&format!("{f}{dep}\n")),
            }
        }
    }
}

/// `wait`: the device's event counter once it passed the one waited for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// The device.
    pub name: String,
    /// Its event counter.
    pub event_nr: u64,
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: event {}", self.name, self.event_nr)
    }
}

/// `remove --all`: the devices removed, top of the stack first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Removed {
    /// Their names.
    pub removed: Vec<String>,
}

impl fmt::Display for Removed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.removed.join("\n"))
    }
}
