//! The verbs that change a daemon's devices (`create`, `remove`, `load`,
//! `suspend`, `resume`, `reload`, `clear`), watch them (`ls`, `info`,
//! `deps`, `wait`) and save them (`dump-config`).

use std::io::{IsTerminal, Read};

use udm_control::luks::{LuksSpec, Passphrase};
use udm_control::report::{Deps, Done, Event, Info, List, Removed};
use udm_control::{Config, Op, RemoveMode};
use udm_core::Error;

use super::{print, CtlArgs};

/// A table from the command line, or from stdin (as dmsetup reads it)
/// when it is not given and stdin is not a terminal.
fn table_text(given: Option<String>, verb: &str) -> Result<String, Error> {
    if let Some(t) = given {
        return Ok(t);
    }
    let stdin = std::io::stdin();
    if stdin.is_terminal() {
        return Err(Error::invalid(format!(
            "{verb}: expected a table ('START LEN TYPE ARGS', lines separated by newlines or ';'), as an argument or on stdin"
        )));
    }
    let mut t = String::new();
    stdin
        .lock()
        .read_to_string(&mut t)
        .map_err(|e| Error::os("reading the table from stdin", e))?;
    Ok(t)
}

/// `udm create`.
#[derive(clap::Args, Debug)]
pub struct CreateArgs {
    #[command(flatten)]
    ctl: CtlArgs,
    /// The new device's name.
    name: String,
    /// A backend: ram:SIZE[,prealloc], null:SIZE[,delay=US],
    /// file:PATH[,size=SIZE][,buffered|direct][,sqpoll][,iopoll][,ro],
    /// luks:DEV[,key-file=PATH][,keyslot=N][,ro] (without key-file the
    /// passphrase is asked for on the terminal, or is stdin's first line;
    /// key-file=- reads all of stdin).
    #[arg(conflicts_with = "table")]
    spec: Option<String>,
    /// A mapped device's table ('-' or none with stdin not a terminal:
    /// read from stdin).
    #[arg(long, value_name = "TABLE")]
    table: Option<String>,
}

/// `udm create NAME SPEC | --table TABLE`.
pub fn create(a: CreateArgs) -> Result<i32, Error> {
    let spec = match (a.spec, a.table) {
        (Some(s), None) => s,
        (None, Some(t)) if t != "-" => t,
        _ => table_text(None, "create")?,
    };
    let (spec, passphrase) = luks_passphrase(&a.name, spec)?;
    // Quiet on success, as dmsetup's; the device's info with --json.
    let info: Info = a.ctl.call(Op::Create {
        name: a.name,
        spec,
        passphrase,
    })?;
    if a.ctl.json {
        print(&info, true)?;
    }
    Ok(0)
}

/// The passphrase of a `luks:` spec without a key file, read as
/// cryptsetup reads it: from the terminal without echo, or the first line
/// of stdin when stdin is not a terminal; with `key-file=-`, all of stdin
/// (and `key-file=-` leaves the spec). It goes to the daemon inside the
/// create request, never on a command line.
fn luks_passphrase(name: &str, spec: String) -> Result<(String, Option<Passphrase>), Error> {
    let Some(rest) = spec.trim().strip_prefix("luks:") else {
        return Ok((spec, None));
    };
    let l = LuksSpec::parse(rest)?;
    match l.key_file.as_deref() {
        Some("-") => {
            let kept: Vec<&str> = rest.split(',').filter(|p| *p != "key-file=-").collect();
            let p = Passphrase::read(&mut stdin_file()?, false)?;
            Ok((format!("luks:{}", kept.join(",")), Some(p)))
        }
        Some(_) => Ok((spec, None)),
        None => {
            let p = ask_passphrase(&format!("Enter passphrase for '{name}' ({}): ", l.dev))?;
            Ok((spec, Some(p)))
        }
    }
}

/// Stdin as a file of its own (a duplicate descriptor), read without
/// std's stdin buffer, which would keep a copy of the passphrase.
fn stdin_file() -> Result<std::fs::File, Error> {
    use std::os::fd::AsFd;
    std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .map(std::fs::File::from)
        .map_err(|e| Error::os("stdin", e))
}

/// A passphrase from the terminal (prompted on stderr, not echoed) when
/// stdin is one, else stdin's first line.
pub(crate) fn ask_passphrase(prompt: &str) -> Result<Passphrase, Error> {
    let mut f = stdin_file()?;
    if !f.is_terminal() {
        return Passphrase::read(&mut f, true);
    }
    eprint!("{prompt}");
    let _echo = NoEcho::on(&f)?;
    Passphrase::read(&mut f, true)
}

/// The terminal's echo turned off (the newline still shows) until dropped.
struct NoEcho {
    fd: std::os::fd::RawFd,
    saved: libc::termios,
}

impl NoEcho {
    fn on(f: &std::fs::File) -> Result<NoEcho, Error> {
        use std::os::fd::AsRawFd;
        let fd = f.as_raw_fd();
        // SAFETY: termios is plain data; tcgetattr fills it for an open fd.
        let mut saved: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: fd is open (f is borrowed) and saved is a valid termios.
        if unsafe { libc::tcgetattr(fd, &mut saved) } != 0 {
            return Err(Error::os("the terminal", std::io::Error::last_os_error()));
        }
        let mut quiet = saved;
        quiet.c_lflag &= !libc::ECHO;
        quiet.c_lflag |= libc::ECHONL;
        // SAFETY: as above; quiet is a copy of the terminal's own settings.
        if unsafe { libc::tcsetattr(fd, libc::TCSAFLUSH, &quiet) } != 0 {
            return Err(Error::os("the terminal", std::io::Error::last_os_error()));
        }
        Ok(NoEcho { fd, saved })
    }
}

impl Drop for NoEcho {
    fn drop(&mut self) {
        // SAFETY: restores the settings read from this fd, which the
        // caller's File keeps open for as long as this guard lives.
        unsafe { libc::tcsetattr(self.fd, libc::TCSAFLUSH, &self.saved) };
    }
}

/// `udm remove`.
#[derive(clap::Args, Debug)]
pub struct RemoveArgs {
    #[command(flatten)]
    ctl: CtlArgs,
    /// Even while held: a mapped device's table is replaced by one that
    /// fails every I/O, so whatever still uses it gets EIO.
    #[arg(long, conflicts_with = "deferred")]
    force: bool,
    /// Now if nothing holds it, else when its last holder goes.
    #[arg(long)]
    deferred: bool,
    /// Every device, top of the stack first.
    #[arg(long, conflicts_with = "name")]
    all: bool,
    /// The device.
    #[arg(required_unless_present = "all")]
    name: Option<String>,
}

/// `udm remove [--force|--deferred] NAME | --all`.
pub fn remove(a: RemoveArgs) -> Result<i32, Error> {
    let mode = if a.force {
        RemoveMode::Force
    } else if a.deferred {
        RemoveMode::Deferred
    } else {
        RemoveMode::Normal
    };
    match a.name {
        Some(name) if !a.all => a.ctl.run::<Done>(Op::Remove { name, mode }),
        _ => a.ctl.run::<Removed>(Op::RemoveAll { mode }),
    }
}

/// `udm load` and `udm reload`.
#[derive(clap::Args, Debug)]
pub struct LoadArgs {
    #[command(flatten)]
    ctl: CtlArgs,
    /// The mapped device.
    name: String,
    /// The table (none, or '-', with stdin not a terminal: read from stdin).
    #[arg(value_name = "TABLE")]
    table_arg: Option<String>,
    /// The table (as the argument).
    #[arg(long, value_name = "TABLE", conflicts_with = "table_arg")]
    table: Option<String>,
}

impl LoadArgs {
    fn text(&mut self, verb: &str) -> Result<String, Error> {
        let t = self.table_arg.take().or(self.table.take());
        table_text(t.filter(|t| t != "-"), verb)
    }
}

/// `udm load NAME TABLE`: stages an inactive table (live at `resume`).
pub fn load(mut a: LoadArgs) -> Result<i32, Error> {
    let table = a.text("load")?;
    a.ctl.run::<Done>(Op::Load {
        name: a.name,
        table,
    })
}

/// `udm reload NAME TABLE`: load + suspend + resume.
pub fn reload(mut a: LoadArgs) -> Result<i32, Error> {
    let table = a.text("reload")?;
    a.ctl.run::<Done>(Op::Reload {
        name: a.name,
        table,
    })
}

/// `udm suspend`.
#[derive(clap::Args, Debug)]
pub struct SuspendArgs {
    #[command(flatten)]
    ctl: CtlArgs,
    /// Do not flush the devices below once the I/O in flight drained.
    #[arg(long)]
    noflush: bool,
    /// The mapped device.
    name: String,
}

/// `udm suspend [--noflush] NAME`: holds new I/O, waits for I/O in flight.
pub fn suspend(a: SuspendArgs) -> Result<i32, Error> {
    a.ctl.run::<Done>(Op::Suspend {
        name: a.name,
        flush: !a.noflush,
    })
}

/// Verbs that take one device.
#[derive(clap::Args, Debug)]
pub struct NameArgs {
    #[command(flatten)]
    ctl: CtlArgs,
    /// The device.
    name: String,
}

/// `udm resume NAME`: swaps in the inactive table, if any; releases I/O.
pub fn resume(a: NameArgs) -> Result<i32, Error> {
    a.ctl.run::<Done>(Op::Resume { name: a.name })
}

/// `udm clear NAME`: drops the inactive table.
pub fn clear(a: NameArgs) -> Result<i32, Error> {
    a.ctl.run::<Done>(Op::Clear { name: a.name })
}

/// `udm info NAME`.
pub fn info(a: NameArgs) -> Result<i32, Error> {
    a.ctl.run::<Info>(Op::Info { name: a.name })
}

/// `udm deps NAME`.
pub fn deps(a: NameArgs) -> Result<i32, Error> {
    a.ctl.run::<Deps>(Op::Deps { name: a.name })
}

/// `udm ls`.
#[derive(clap::Args, Debug)]
pub struct LsArgs {
    #[command(flatten)]
    ctl: CtlArgs,
    /// Draw the stack: each device over the devices its table uses.
    #[arg(long)]
    tree: bool,
}

/// `udm ls [--tree]`.
pub fn ls(a: LsArgs) -> Result<i32, Error> {
    let l: List = a.ctl.call(Op::Ls {})?;
    if a.tree && !a.ctl.json {
        let t = l.tree();
        if !t.is_empty() {
            println!("{t}");
        }
        return Ok(0);
    }
    print(&l, a.ctl.json)
}

/// `udm wait`.
#[derive(clap::Args, Debug)]
pub struct WaitArgs {
    #[command(flatten)]
    ctl: CtlArgs,
    /// Give up after this many seconds (exit 1).
    #[arg(long, value_name = "SECS")]
    timeout: Option<f64>,
    /// The device.
    name: String,
    /// Return once the device's event counter passes this (default 0: at
    /// its first event; 'udm info' shows the counter).
    #[arg(default_value_t = 0)]
    event_nr: u64,
}

/// `udm wait NAME [EVENT_NR]`: returns when the device's event counter
/// passes EVENT_NR (a table swapped in, a target's event).
pub fn wait(a: WaitArgs) -> Result<i32, Error> {
    let timeout_ms = match a.timeout {
        Some(t) if t.is_finite() && t >= 0.0 => Some((t * 1000.0) as u64),
        Some(t) => {
            return Err(Error::invalid(format!(
                "--timeout {t}: expected seconds, 0 or more"
            )))
        }
        None => None,
    };
    match a.ctl.call::<Event>(Op::Wait {
        name: a.name,
        event_nr: a.event_nr,
        timeout_ms,
    }) {
        Ok(e) => print(&e, a.ctl.json),
        Err(e) if e.kind() == udm_core::ErrorKind::TimedOut => {
            eprintln!("udm: {e}");
            Ok(1)
        }
        Err(e) => Err(e),
    }
}

/// `udm dump-config`.
#[derive(clap::Args, Debug)]
pub struct DumpConfigArgs {
    #[command(flatten)]
    ctl: CtlArgs,
    /// Write crypt keys into the tables, so that the file recreates crypt
    /// devices given by a hex key (without it they are `-`).
    #[arg(long)]
    show_keys: bool,
}

/// `udm dump-config [--show-keys]`: the daemon's devices and exports as a
/// configuration file (TOML; JSON with --json) that `udm daemon --config`
/// recreates.
pub fn dump_config(a: DumpConfigArgs) -> Result<i32, Error> {
    let c: Config = a.ctl.call(Op::DumpConfig {
        show_keys: a.show_keys,
    })?;
    if a.ctl.json {
        let s =
            serde_json::to_string(&c).map_err(|e| Error::invalid(format!("encoding JSON: {e}")))?;
        println!("{s}");
        return Ok(0);
    }
    print!("{}", c.to_toml()?);
    Ok(0)
}
