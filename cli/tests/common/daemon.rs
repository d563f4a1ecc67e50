//! A `udm daemon` child for the command-line tests, driven through the
//! `udm` verbs as an administrator would.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use super::TempDir;

/// A running `udm daemon` on a control socket in a temporary directory;
/// SIGTERM (then SIGKILL) when dropped.
pub struct Daemon {
    /// The daemon's process (None once stopped).
    pub child: Option<Child>,
    /// Its control socket.
    pub ctl: PathBuf,
    /// Its directory: the socket, stdout, stderr and what a test puts there.
    pub dir: TempDir,
}

impl Daemon {
    pub fn start(extra: &[&str]) -> Daemon {
        let dir = TempDir::new("daemon");
        Daemon::start_in(dir, extra)
    }

    pub fn start_in(dir: TempDir, extra: &[&str]) -> Daemon {
        Daemon::start_env(dir, extra, &[])
    }

    /// [`Daemon::start_in`] with `env` set for the daemon (e.g.
    /// `RUST_LOG=trace`).
    pub fn start_env(dir: TempDir, extra: &[&str], env: &[(&str, &str)]) -> Daemon {
        let ctl = dir.path("run/control");
        let child = Command::new(env!("CARGO_BIN_EXE_udm"))
            .arg("daemon")
            .args(extra)
            .envs(env.iter().copied())
            .stdin(std::process::Stdio::null())
            .env("UDM_CONTROL", &ctl)
            .stdout(std::fs::File::create(dir.path("stdout")).unwrap())
            .stderr(std::fs::File::create(dir.path("stderr")).unwrap())
            .spawn()
            .unwrap();
        let d = Daemon {
            child: Some(child),
            ctl,
            dir,
        };
        let t0 = Instant::now();
        while !d.out().contains("daemon ready") {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "no start: {}",
                d.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        d
    }

    pub fn out(&self) -> String {
        std::fs::read_to_string(self.dir.path("stdout")).unwrap_or_default()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path("stderr")).unwrap_or_default()
    }

    /// `udm ARGS` against this daemon (found through $UDM_CONTROL).
    pub fn udm(&self, args: &[&str]) -> (i32, String, String) {
        let out = Command::new(env!("CARGO_BIN_EXE_udm"))
            .args(args)
            .env("UDM_CONTROL", &self.ctl)
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// `udm ARGS` with `input` on its stdin (not a terminal).
    pub fn udm_stdin(&self, args: &[&str], input: &[u8]) -> (i32, String, String) {
        use std::io::Write;
        let mut c = Command::new(env!("CARGO_BIN_EXE_udm"))
            .args(args)
            .env("UDM_CONTROL", &self.ctl)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // udm may exit before reading all of it (a first line suffices).
        let _ = c.stdin.take().unwrap().write_all(input);
        let out = c.wait_with_output().unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// `udm ARGS`, which must succeed; its stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let (code, out, err) = self.udm(args);
        assert_eq!(code, 0, "udm {args:?}: {err}");
        out
    }

    /// `udm ARGS`, which must fail; its one-line error.
    pub fn fails(&self, args: &[&str]) -> String {
        let (code, _, err) = self.udm(args);
        assert_ne!(code, 0, "udm {args:?} succeeded");
        assert_eq!(err.lines().count(), 1, "{err}");
        err
    }

    /// Stops with SIGTERM; the exit status.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().unwrap();
        // SAFETY: signals our own child.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        let t0 = Instant::now();
        loop {
            if let Some(st) = c.try_wait().unwrap() {
                return st;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "no stop: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// Whether the daemon still runs.
    pub fn alive(&mut self) -> bool {
        self.child.as_mut().unwrap().try_wait().unwrap().is_none()
    }
}

/// `udm daemon --config CFG` (control socket CTL, stdin not a terminal),
/// which must refuse the file: exit status 2 and one line on stderr,
/// returned.
pub fn refused_config(cfg: &std::path::Path, ctl: &std::path::Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_udm"))
        .args(["daemon", "--config", cfg.to_str().unwrap()])
        .env("UDM_CONTROL", ctl)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    err
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: signals our own child.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(5) {
                if c.try_wait().ok().flatten().is_some() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
