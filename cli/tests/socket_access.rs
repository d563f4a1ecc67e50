//! Who gets into udm's sockets (docs/security.md): the control socket and
//! vhost-user-blk sockets (and NBD unix sockets) are made 0600 (0660 and the group's with
//! `--socket-group`) in directories no one else can write, and a client
//! running as another user (`setpriv --reuid 65534`) is refused by its
//! credentials even after the socket and its directory are opened to all;
//! root (udm's user here) and the group's members get in. The metrics
//! endpoint listens on loopback unless an address is written out.
//!
//! Running a client as another user needs root: as anyone else these
//! tests say so and skip.

#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::daemon::Daemon;
use common::{Serve, TempDir};

/// The group `--socket-group` names in these tests: a bare gid, so that
/// no entry in /etc/group is needed.
const GROUP: u32 = 4242;
/// The other user.
const NOBODY: u32 = 65534;

fn root() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    eprintln!("skipped: running a client as another user (setpriv --reuid) needs root");
    false
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().mode() & 0o7777
}

fn chmod(p: &Path, m: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
}

/// A copy of the udm binary the other user can run (the build tree may sit
/// where they cannot reach it).
fn udm_for_all(dir: &TempDir) -> PathBuf {
    let p = dir.path("udm-bin");
    std::fs::copy(env!("CARGO_BIN_EXE_udm"), &p).unwrap();
    chmod(&p, 0o755);
    p
}

/// Runs `cmd ARGS` as uid/gid 65534, with `groups` as its supplementary
/// groups (none if empty).
fn as_nobody(groups: &[u32], cmd: &Path, args: &[&str]) -> Output {
    let ids = NOBODY.to_string();
    let mut c = Command::new("setpriv");
    c.args(["--reuid", &ids, "--regid", &ids]);
    let list: Vec<String> = groups.iter().map(u32::to_string).collect();
    if list.is_empty() {
        c.arg("--clear-groups");
    } else {
        c.args(["--groups", &list.join(",")]);
    }
    c.arg(cmd)
        .args(args)
        .output()
        .expect("setpriv (util-linux)")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A vhost-user frontend's first message (GET_FEATURES), then its answer:
/// `reply` when the server answers, `closed` when it hangs up.
const PROBE: &str = r#"
import socket, struct, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(20)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print("connect failed:", e.strerror)
    sys.exit(0)
try:
    s.sendall(struct.pack('<III', 1, 1, 0))
    r = s.recv(64)
except OSError as e:
    print("closed:", e.strerror)
    sys.exit(0)
print("reply" if len(r) >= 20 else "closed")
"#;

/// The system's python3 (one on PATH may sit under /root, out of the
/// other user's reach).
const PYTHON: &str = "/usr/bin/python3";

fn probe_vhost(sock: &Path, who: Option<&[u32]>) -> String {
    let s = sock.to_str().unwrap();
    let o = match who {
        Some(groups) => as_nobody(groups, Path::new(PYTHON), &["-c", PROBE, s]),
        None => Command::new(PYTHON)
            .args(["-c", PROBE, s])
            .output()
            .unwrap(),
    };
    assert!(o.status.success(), "{}", text(&o));
    text(&o).trim().to_string()
}

fn wait_log(d: &Daemon, needle: &str) -> String {
    let t0 = Instant::now();
    loop {
        let l = d.log();
        if l.contains(needle) {
            return l;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the log never said '{needle}':\n{l}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_control_socket_is_0600_and_refuses_other_users_even_when_opened_to_all() {
    if !root() {
        return;
    }
    let d = Daemon::start(&[]);
    let run = d.ctl.parent().unwrap().to_path_buf();
    assert_eq!(mode(&d.ctl), 0o600, "the control socket");
    assert_eq!(mode(&run), 0o700, "the directory udm made for it");
    let udm = udm_for_all(&d.dir);
    let ctl = d.ctl.to_str().unwrap();

    // The mode alone keeps the other user out.
    let o = as_nobody(&[], &udm, &["ls", "--control", ctl]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("Permission denied"), "{}", text(&o));

    // Opened to all by mistake: the peer's credentials still refuse it,
    // in one line naming its uid.
    chmod(&run, 0o777);
    chmod(&d.ctl, 0o777);
    let o = as_nobody(&[], &udm, &["ls", "--control", ctl]);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("uid 65534") && err.contains("not admitted (root only)"),
        "{err}"
    );
    let log = wait_log(&d, "control: refused a connection");
    assert!(log.contains("uid 65534"), "{log}");
    assert!(
        !log.contains("panicked"),
        "the refusal harmed the server: {log}"
    );

    // Root (udm's user here) still gets in.
    d.ok(&["create", "r", "ram:1M"]);
    assert!(d.ok(&["ls"]).contains('r'));
}

#[test]
fn a_vhost_user_socket_is_0600_and_refuses_other_frontends_even_when_opened_to_all() {
    if !root() {
        return;
    }
    let d = Daemon::start(&[]);
    let sock = d.dir.path("vhost.sock");
    let s = sock.to_str().unwrap();
    d.ok(&["create", "r", "ram:16M"]);
    d.ok(&["export", "add", "r", "--vhost-user-blk", s]);
    assert_eq!(mode(&sock), 0o600);

    // Closed to the other user by the mode...
    let r = probe_vhost(&sock, Some(&[]));
    assert!(r.starts_with("connect failed"), "{r}");
    // ...and by its credentials once the socket and its directory are
    // opened to all: the connection is closed before a single reply.
    chmod(d.dir.dir(), 0o777);
    chmod(&sock, 0o777);
    assert!(probe_vhost(&sock, Some(&[])).starts_with("closed"));
    let log = wait_log(&d, "refused a frontend");
    assert!(log.contains("uid 65534"), "{log}");

    // Root's frontend is served, after the refusal as before it.
    assert_eq!(probe_vhost(&sock, None), "reply");
    chmod(d.dir.dir(), 0o755);
}

#[test]
fn udm_serve_makes_its_vhost_and_control_sockets_0600_and_checks_frontends() {
    if !root() {
        return;
    }
    let dir = TempDir::new("serve-vhost-access");
    let sock = dir.path("v.sock");
    let mut srv = Serve::start_as_given(&[
        "--dev",
        "r=ram:16M",
        "--vhost-user-blk",
        sock.to_str().unwrap(),
    ]);
    let t0 = Instant::now();
    while !sock.exists() {
        assert!(t0.elapsed() < Duration::from_secs(10), "{}", srv.log());
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(mode(&sock), 0o600);
    assert_eq!(mode(&srv.ctl()), 0o600);
    chmod(&sock, 0o777);
    chmod(dir.dir(), 0o777);
    assert!(probe_vhost(&sock, Some(&[])).starts_with("closed"));
    srv.wait_log("refused a frontend", 1);
    assert_eq!(probe_vhost(&sock, None), "reply");
    assert!(srv.stop().success());
    chmod(dir.dir(), 0o755);
}

#[test]
fn socket_group_admits_its_members_and_no_one_else() {
    if !root() {
        return;
    }
    let g = GROUP.to_string();
    let d = Daemon::start(&["--socket-group", &g]);
    let run = d.ctl.parent().unwrap().to_path_buf();
    let m = std::fs::metadata(&d.ctl).unwrap();
    assert_eq!((m.mode() & 0o7777, m.gid()), (0o660, GROUP));
    let m = std::fs::metadata(&run).unwrap();
    assert_eq!((m.mode() & 0o7777, m.gid()), (0o750, GROUP));
    let udm = udm_for_all(&d.dir);
    let ctl = d.ctl.to_str().unwrap();

    // A member (a supplementary group) is served...
    d.ok(&["create", "r", "ram:16M"]);
    let o = as_nobody(&[GROUP], &udm, &["ls", "--control", ctl]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains('r'));
    // ...as is one whose primary group it is.
    let o = Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", &g, "--clear-groups"])
        .arg(&udm)
        .args(["ls", "--control", ctl])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    // Anyone else is not, even with everything opened.
    chmod(&run, 0o777);
    chmod(&d.ctl, 0o777);
    let o = as_nobody(&[], &udm, &["ls", "--control", ctl]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("not admitted (root and group 4242)"),
        "{}",
        text(&o)
    );
    chmod(&run, 0o750);

    // The vhost-user-blk sockets follow the same rule.
    let sock = d.dir.path("vhost.sock");
    d.ok(&[
        "export",
        "add",
        "r",
        "--vhost-user-blk",
        sock.to_str().unwrap(),
    ]);
    let m = std::fs::metadata(&sock).unwrap();
    assert_eq!((m.mode() & 0o7777, m.gid()), (0o660, GROUP));
    assert_eq!(probe_vhost(&sock, Some(&[GROUP])), "reply");
    chmod(&sock, 0o777);
    assert!(probe_vhost(&sock, Some(&[])).starts_with("closed"));
}

#[test]
fn a_directory_others_can_write_is_refused_and_a_sticky_one_taken() {
    let dir = TempDir::new("socket-dir");
    let open = dir.path("open");
    std::fs::create_dir(&open).unwrap();
    chmod(&open, 0o777);
    let ctl = open.join("control");
    let out = Command::new(env!("CARGO_BIN_EXE_udm"))
        .args(["daemon", "--control", ctl.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("(mode 0777) can be written by others and is not sticky"),
        "{err}"
    );
    assert!(!ctl.exists());

    // Sticky, as /tmp: no one else can remove or rename udm's socket.
    chmod(&open, 0o1777);
    let mut d = Daemon::start(&["--control", ctl.to_str().unwrap()]);
    assert_eq!(mode(&ctl), 0o600);
    assert!(d.stop().success());
}

#[test]
fn metrics_listen_on_loopback_unless_an_address_is_written_out() {
    let d = Daemon::start(&["--metrics", "0"]);
    assert!(
        d.out().contains("udm: metrics at http://127.0.0.1:"),
        "{}",
        d.out()
    );
    drop(d);
    let d = Daemon::start(&["--metrics", ":0"]);
    assert!(d.out().contains("udm: metrics at http://127.0.0.1:"));
    drop(d);
    let srv = Serve::start(&["--metrics", "0"]);
    assert!(srv.out().contains("udm: metrics at http://127.0.0.1:"));
    drop(srv);
    // Written out, any address is taken.
    let d = Daemon::start(&["--metrics", "0.0.0.0:0"]);
    assert!(d.out().contains("udm: metrics at http://0.0.0.0:"));
    let (code, _, err) = common::udm(&["daemon", "--metrics", "nope"]);
    assert_eq!(code, 2);
    assert_eq!(
        err.trim(),
        "udm: --metrics 'nope': expected PORT, :PORT (both on 127.0.0.1) or HOST:PORT"
    );
}

#[test]
fn an_nbd_unix_socket_is_0600_and_other_users_cannot_connect() {
    if !root() {
        return;
    }
    let s = Serve::start(&["--dev", "r=ram:16M"]);
    assert_eq!(mode(&s.sock), 0o600);
    let uri = s.uri("r");
    let nbdinfo = Path::new("/usr/bin/nbdinfo");
    let o = as_nobody(&[], nbdinfo, &["--size", &uri]);
    assert!(!o.status.success(), "another user connected: {}", text(&o));
    assert!(text(&o).contains("Permission denied"), "{}", text(&o));
    // udm's own user (root here) is served.
    let o = Command::new(nbdinfo)
        .args(["--size", &uri])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "16777216");
}
