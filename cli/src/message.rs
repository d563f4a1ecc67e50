//! `udm status` and `udm message`: dmsetup's status and message, on the
//! devices built from `--dev` specs in this process. The message plumbing
//! is the mapper's (`MappedDevice::message`); this is only the front end.
//! A long message (writecache's `flush`) shows a progress bar on stderr,
//! drawn from the target's status line while the message runs.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use udm_core::{BlockDevice, Error};
use udm_mapper::MappedDevice;

use crate::args::Args;
use crate::spec::{Stack, DEFAULT_DEVS};

fn build(a: &mut Args) -> Result<Stack, Error> {
    let devs = a.many("--dev");
    if devs.is_empty() {
        Stack::build(DEFAULT_DEVS)
    } else {
        Stack::build(&devs)
    }
}

fn positional(a: &mut Args) -> Vec<String> {
    a.rest()
}

fn mapped(st: &Stack, name: &str) -> Result<Arc<dyn BlockDevice>, Error> {
    let d = st
        .get(name)
        .ok_or_else(|| Error::invalid(format!("unknown device '{name}'")))?;
    if d.as_any().downcast_ref::<MappedDevice>().is_none() {
        return Err(Error::invalid(format!(
            "device '{name}' is not a mapped device (it has no table)"
        )));
    }
    Ok(d)
}

fn as_md(d: &Arc<dyn BlockDevice>) -> &MappedDevice {
    match d.as_any().downcast_ref::<MappedDevice>() {
        Some(m) => m,
        None => unreachable!("checked by mapped()"),
    }
}

/// `udm status [DEVICE]`: `name: start len type args` per target, as
/// `dmsetup status`.
pub fn status(mut a: Args) -> Result<i32, Error> {
    let st = build(&mut a)?;
    let pos = positional(&mut a);
    a.finish()?;
    for d in st.devices() {
        if !pos.is_empty() && !pos.iter().any(|p| p == d.name()) {
            continue;
        }
        if let Some(m) = d.as_any().downcast_ref::<MappedDevice>() {
            for l in m.table().status_lines() {
                println!("{}: {l}", d.name());
            }
        }
    }
    if let Some(p) = pos.iter().find(|p| st.get(p).is_none()) {
        return Err(Error::invalid(format!("unknown device '{p}'")));
    }
    Ok(0)
}

/// `udm message DEVICE [SECTOR] MESSAGE...`: sends the message to the
/// target holding SECTOR (default 0) and prints the reply.
pub fn message(mut a: Args) -> Result<i32, Error> {
    let st = build(&mut a)?;
    let quiet = a.flag("--no-progress");
    let mut pos = positional(&mut a);
    a.finish()?;
    if pos.len() < 2 {
        return Err(Error::invalid(
            "message: expected DEVICE [SECTOR] MESSAGE... (e.g. 'udm message --dev … wc flush')",
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
    let md = mapped(&st, &name)?;
    let argv: Vec<&str> = pos.iter().map(String::as_str).collect();
    let done = Arc::new(AtomicBool::new(false));
    let bar = if quiet {
        None
    } else {
        let (md, done) = (md.clone(), done.clone());
        Some(std::thread::spawn(move || progress(as_md(&md), &done)))
    };
    let r = as_md(&md).message(sector, &argv);
    done.store(true, Ordering::Release);
    if let Some(b) = bar {
        let _ = b.join();
    }
    let reply = r.map_err(|e| e.context(format!("device '{name}'")))?;
    if !reply.is_empty() {
        println!("{reply}");
    }
    Ok(0)
}

/// Draws `[####    ] used/total` from the first target's status line while
/// a message runs, if it looks like a cache's (error, blocks, free, …).
fn progress(md: &MappedDevice, done: &AtomicBool) {
    let tty = std::io::stderr().is_terminal();
    let mut start_used = None;
    let mut drew = false;
    let mut waited = 0;
    while !done.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(50));
        waited += 1;
        if waited < 4 {
            continue; // a quick message needs no bar
        }
        let l = md.table().status_lines();
        let Some(first) = l.first() else { break };
        let f: Vec<u64> = first
            .split_whitespace()
            .skip(3)
            .filter_map(|x| x.parse().ok())
            .collect();
        if f.len() < 4 || f[1] == 0 {
            break;
        }
        let used = f[1] - f[2];
        let start = *start_used.get_or_insert(used.max(1));
        let gone = start.saturating_sub(used);
        let pct = (gone * 100 / start).min(100);
        let w = 40;
        let fill = (pct as usize * w) / 100;
        let line = format!(
            "[{}{}] {pct:3}%  {used} blocks dirty, {} under writeback",
            "#".repeat(fill),
            " ".repeat(w - fill),
            f[3]
        );
        let mut e = std::io::stderr();
        if tty {
            let _ = write!(e, "\r{line}");
        } else {
            let _ = writeln!(e, "{line}");
        }
        let _ = e.flush();
        drew = true;
    }
    if drew && tty {
        let _ = writeln!(std::io::stderr(), "\r[{}] 100%", "#".repeat(40));
    }
}
