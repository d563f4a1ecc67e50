//! `udm status`, `udm table`, `udm message` and `udm reload`: dmsetup's
//! status, table, message and reload.
//!
//! Each acts either on a running `udm serve` through its control socket
//! (`--control PATH`, see [`crate::control`]) or, without it, on a stack
//! built in this process from `--dev` specs (useful only to check a stack:
//! it is gone when the command exits). Both ways run the same functions
//! here ([`status_lines`], [`table_report`], [`send_message`], [`reload`]),
//! in the server for `--control`, so the output is the same.
//!
//! A long message (writecache's `flush`) draws a progress bar on stderr,
//! when stderr is a terminal, from the target's status line, read while the
//! message runs (in process, or over a second control connection).

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use udm_core::{BlockDevice, Error, ErrorKind};
use udm_mapper::{MappedDevice, Table};

use crate::args::Args;
use crate::control;
use crate::spec::{Stack, DEFAULT_DEVS};

/// Where a command acts: a running server, or a stack built here.
enum On {
    Control(PathBuf),
    Local(Stack),
}

fn on(a: &mut Args) -> Result<On, Error> {
    let devs = a.many("--dev");
    match a.opt("--control") {
        Some(_) if !devs.is_empty() => Err(Error::invalid(
            "--control and --dev do not mix: --control acts on the devices of a running 'udm serve'",
        )),
        Some(p) => Ok(On::Control(PathBuf::from(p))),
        None if devs.is_empty() => Ok(On::Local(Stack::build(DEFAULT_DEVS)?)),
        None => Ok(On::Local(Stack::build(&devs)?)),
    }
}

fn print(lines: &[String]) {
    let mut o = std::io::stdout().lock();
    for l in lines {
        let _ = writeln!(o, "{l}");
    }
}

fn mapped(d: &Arc<dyn BlockDevice>) -> Option<&MappedDevice> {
    d.as_any().downcast_ref::<MappedDevice>()
}

/// The devices named (all when `names` is empty), or an error naming the
/// first unknown one.
fn select(st: &Stack, names: &[String]) -> Result<Vec<Arc<dyn BlockDevice>>, Error> {
    if let Some(p) = names.iter().find(|p| st.get(p).is_none()) {
        return Err(Error::new(
            ErrorKind::NotFound,
            format!("unknown device '{p}'"),
        ));
    }
    Ok(st
        .devices()
        .iter()
        .filter(|d| names.is_empty() || names.iter().any(|n| n == d.name()))
        .cloned()
        .collect())
}

fn mapped_named(st: &Stack, name: &str) -> Result<Arc<dyn BlockDevice>, Error> {
    let d = st
        .get(name)
        .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("unknown device '{name}'")))?;
    if mapped(&d).is_none() {
        return Err(Error::invalid(format!(
            "device '{name}' is not a mapped device (it has no table)"
        )));
    }
    Ok(d)
}

/// `NAME: start len type args` per target of each mapped device named (all
/// when `names` is empty), as `dmsetup status`.
pub fn status_lines(st: &Stack, names: &[String]) -> Result<Vec<String>, Error> {
    let mut out = Vec::new();
    for d in select(st, names)? {
        if let Some(m) = mapped(&d) {
            for l in m.table().status_lines() {
                out.push(format!("{}: {l}", d.name()));
            }
        }
    }
    Ok(out)
}

/// For each device named (all when `names` is empty): its size and
/// capabilities, and for mapped devices `dmsetup table` and `status` lines.
pub fn table_report(st: &Stack, names: &[String]) -> Result<Vec<String>, Error> {
    let mut out = Vec::new();
    for d in select(st, names)? {
        let l = d.limits();
        out.push(format!(
            "{}: {} sectors, lbs {}, max io {}, caps {:?}{}",
            d.name(),
            l.sectors,
            l.logical_block_size,
            l.max_io_bytes,
            d.caps(),
            match mapped(&d) {
                Some(m) if m.is_suspended() => ", suspended",
                _ => "",
            }
        ));
        if let Some(m) = mapped(&d) {
            let t = m.table();
            for (tl, sl) in t.table_lines().iter().zip(t.status_lines()) {
                out.push(format!("  table:  {tl}"));
                out.push(format!("  status: {sl}"));
            }
        }
    }
    Ok(out)
}

/// Sends `argv` to the target of device `name` holding `sector`; returns
/// the target's reply.
pub fn send_message(st: &Stack, name: &str, sector: u64, argv: &[&str]) -> Result<String, Error> {
    let d = mapped_named(st, name)?;
    let Some(m) = mapped(&d) else {
        unreachable!("checked by mapped_named")
    };
    m.message(sector, argv)
        .map_err(|e| e.context(format!("device '{name}'")))
}

/// dm's load + suspend + resume: builds `text` as the new table of the live
/// device `name`, suspends it (in-flight I/O drains and is flushed; new I/O
/// waits), makes the new table live and resumes. If the suspend fails, the
/// device resumes on its old table.
///
/// Refused, before anything is built: a table that changes the device's
/// size, logical block size or lowers its max I/O size (clients that are
/// connected were told those), one that names the device itself or a device
/// defined after it, and a writecache over a cache device that a live
/// writecache uses (two cache engines must not share a cache).
pub fn reload(st: &Stack, name: &str, text: &str) -> Result<(), Error> {
    let d = mapped_named(st, name)?;
    let Some(m) = mapped(&d) else {
        unreachable!("checked by mapped_named")
    };
    let ctx = |e: Error| e.context(format!("reload '{name}'"));
    for s in udm_mapper::parse(text).map_err(ctx)? {
        if s.ty != "writecache" {
            continue;
        }
        let Some(cache) = s.args.get(2) else { continue };
        if let Some(user) = live_cache_user(st, cache) {
            return Err(ctx(Error::new(
                ErrorKind::Busy,
                format!(
                    "cache device '{cache}' is in use by the live writecache of '{user}' \
                     (reloading a writecache over its own cache is not supported)"
                ),
            )));
        }
    }
    let table: Table = st.build_table(name, text).map_err(ctx)?;
    let (old, new) = (d.limits(), table.limits);
    if new.sectors != old.sectors {
        return Err(ctx(Error::invalid(format!(
            "the new table has {} sectors, the device {}: resizing a live device is not supported",
            new.sectors, old.sectors
        ))));
    }
    if new.logical_block_size != old.logical_block_size {
        return Err(ctx(Error::invalid(format!(
            "the new table's logical block size is {}, the device's {}: it must not change",
            new.logical_block_size, old.logical_block_size
        ))));
    }
    if new.max_io_bytes < old.max_io_bytes {
        return Err(ctx(Error::invalid(format!(
            "the new table's max I/O size is {} bytes, the device's {}: it must not shrink",
            new.max_io_bytes, old.max_io_bytes
        ))));
    }
    if let Err(e) = m.suspend(true) {
        if m.is_suspended() {
            m.resume()
                .map_err(|r| ctx(r.context("resume after a failed suspend")))?;
        }
        return Err(ctx(e.context("suspend")));
    }
    m.load(table);
    m.resume().map_err(|e| ctx(e.context("resume")))
}

/// The device whose live table has a writecache over `cache`, if any.
fn live_cache_user(st: &Stack, cache: &str) -> Option<String> {
    st.devices().iter().find_map(|d| {
        let uses = mapped(d)?.table().table_lines().iter().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.get(2) == Some(&"writecache") && f.get(5) == Some(&cache)
        });
        uses.then(|| d.name().to_string())
    })
}

/// `udm status [--control PATH | --dev …] [DEVICE]...`
pub fn status(mut a: Args) -> Result<i32, Error> {
    let on = on(&mut a)?;
    let names = a.rest();
    a.finish()?;
    let lines = match on {
        On::Control(p) => control::request(&p, &control::join("status", &names))?,
        On::Local(st) => status_lines(&st, &names)?,
    };
    print(&lines);
    Ok(0)
}

/// `udm table [--control PATH | --dev …] [DEVICE]...`
pub fn table(mut a: Args) -> Result<i32, Error> {
    let on = on(&mut a)?;
    let names = a.rest();
    a.finish()?;
    let lines = match on {
        On::Control(p) => control::request(&p, &control::join("table", &names))?,
        On::Local(st) => table_report(&st, &names)?,
    };
    print(&lines);
    Ok(0)
}

/// `udm message [--control PATH | --dev …] DEVICE [SECTOR] MESSAGE...`:
/// sends the message to the target holding SECTOR (default 0) and prints
/// the reply.
pub fn message(mut a: Args) -> Result<i32, Error> {
    let on = on(&mut a)?;
    let quiet = a.flag("--no-progress");
    let mut pos = a.rest();
    a.finish()?;
    if pos.len() < 2 {
        return Err(Error::invalid(
            "message: expected DEVICE [SECTOR] MESSAGE... (e.g. 'udm message --control PATH wc flush')",
        ));
    }
    let name = pos.remove(0);
    let sector = match pos[0].parse::<u64>() {
        Ok(s) if pos.len() > 1 => {
            pos.remove(0);
            s
        }
        _ => 0,
    };
    let bar = !quiet && std::io::stderr().is_terminal();
    let done = Arc::new(AtomicBool::new(false));
    let reply = match on {
        On::Local(st) => {
            let st = Arc::new(st);
            let drawer = bar.then(|| {
                let (st, done, name) = (st.clone(), done.clone(), name.clone());
                std::thread::spawn(move || {
                    progress(&done, || {
                        let d = st.get(&name)?;
                        mapped(&d)?.table().status_lines().into_iter().next()
                    })
                })
            });
            let argv: Vec<&str> = pos.iter().map(String::as_str).collect();
            let r = send_message(&st, &name, sector, &argv);
            finish_bar(&done, drawer);
            r.map(|s| s.lines().map(str::to_string).collect())
        }
        On::Control(p) => {
            let drawer = bar.then(|| {
                let (p, done, name) = (p.clone(), done.clone(), name.clone());
                std::thread::spawn(move || {
                    // A second connection polls status while the first one
                    // waits for the message's reply.
                    let mut c = None;
                    progress(&done, || {
                        if c.is_none() {
                            c = control::Client::connect(&p).ok();
                        }
                        let l = c.as_mut()?.call(&format!("status {name}")).ok()?;
                        let first = l.into_iter().next()?;
                        Some(first.split_once(": ")?.1.to_string())
                    })
                })
            });
            let mut line = format!("message {name} {sector}");
            for w in &pos {
                line.push(' ');
                line.push_str(w);
            }
            let r = control::request(&p, &line);
            finish_bar(&done, drawer);
            r
        }
    };
    print(&reply?);
    Ok(0)
}

/// `udm reload --control PATH DEVICE 'TABLE'`: load + suspend + resume of a
/// new table on a device of a running server.
pub fn reload_cmd(mut a: Args) -> Result<i32, Error> {
    let on = on(&mut a)?;
    let pos = a.rest();
    a.finish()?;
    let On::Control(p) = on else {
        return Err(Error::invalid(
            "reload: needs --control PATH: it changes a device of a running 'udm serve'",
        ));
    };
    let [name, table] = &pos[..] else {
        return Err(Error::invalid(
            "reload: expected DEVICE 'TABLE' (e.g. udm reload --control PATH lin '0 2097152 linear ram0 0')",
        ));
    };
    // The protocol is one line per request: table lines go `;`-separated.
    let table = table.replace(['\n', '\r'], ";");
    print(&control::request(&p, &format!("reload {name} {table}"))?);
    Ok(0)
}

fn finish_bar(done: &AtomicBool, drawer: Option<std::thread::JoinHandle<()>>) {
    done.store(true, Ordering::Release);
    if let Some(b) = drawer {
        let _ = b.join();
    }
}

/// Draws `[####    ] pct  used blocks dirty, n under writeback` on stderr
/// (a terminal) until `done`, from the status line `first_status` returns
/// (`start len type error blocks free writeback …`, a cache's), if the
/// message runs long enough to need one.
pub fn progress(done: &AtomicBool, mut first_status: impl FnMut() -> Option<String>) {
    let mut start_used = None;
    let mut drew = false;
    let mut waited = 0;
    while !done.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(50));
        waited += 1;
        if waited < 4 {
            continue; // a quick message needs no bar
        }
        let Some(first) = first_status() else { break };
        let f: Vec<u64> = first
            .split_whitespace()
            .skip(3)
            .filter_map(|x| x.parse().ok())
            .collect();
        if f.len() < 4 || f[1] == 0 {
            break;
        }
        let used = f[1].saturating_sub(f[2]);
        let start = *start_used.get_or_insert(used.max(1));
        let gone = start.saturating_sub(used);
        let pct = (gone * 100 / start).min(100);
        let w = 40;
        let fill = (pct as usize * w) / 100;
        let mut e = std::io::stderr();
        let _ = write!(
            e,
            "\r[{}{}] {pct:3}%  {used} blocks dirty, {} under writeback",
            "#".repeat(fill),
            " ".repeat(w - fill),
            f[3]
        );
        let _ = e.flush();
        drew = true;
    }
    if drew {
        let _ = writeln!(std::io::stderr(), "\r[{}] 100%\x1b[K", "#".repeat(40));
    }
}
