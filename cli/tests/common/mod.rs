//! Shared by the command-line tests: running `udm`, and a `udm serve` child
//! on a temporary unix socket, killed (SIGTERM, then SIGKILL) when dropped.

#![allow(dead_code)]
// Test support: a failed setup step is a test failure, with its panic message.
#![allow(clippy::unwrap_used)]

pub mod daemon;
pub mod guest;
pub mod raw;

/// A writecache device `wc`: a 16 MiB RAM origin `o` under a 4 MiB RAM
/// cache `c`, 4 KiB blocks, writeback from 60% full.
pub const WC_DEVS: [&str; 6] = [
    "--dev",
    "o=ram:16M",
    "--dev",
    "c=ram:4M",
    "--dev",
    "wc=0 32768 writecache s o c 4096 2 high_watermark 60",
];

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

pub use udm_core::testing::TempDir;

/// A running `udm serve`.
pub struct Serve {
    pub child: Option<Child>,
    pub sock: PathBuf,
    pub dir: TempDir,
    stderr: PathBuf,
    stdout: PathBuf,
}

impl Serve {
    /// Starts `udm serve ARGS --listen unix:<tmp>/nbd.sock` and waits until
    /// the socket accepts and the control socket is announced.
    pub fn start(args: &[&str]) -> Serve {
        let dir = TempDir::new("serve");
        let sock = dir.path("nbd.sock");
        let mut a: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        a.push("--listen".into());
        a.push(format!("unix:{}", sock.display()));
        Serve::spawn(dir, sock, &a)
    }

    /// Starts `udm serve ARGS` as given (their own --listen) and waits until
    /// it announced its control socket (it listens by then).
    pub fn start_as_given(args: &[&str]) -> Serve {
        let dir = TempDir::new("serve");
        let a: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        Serve::spawn(dir, PathBuf::new(), &a)
    }

    fn spawn(dir: TempDir, sock: PathBuf, args: &[String]) -> Serve {
        let stderr = dir.path("stderr");
        let stdout = dir.path("stdout");
        let child = Command::new(env!("CARGO_BIN_EXE_udm"))
            .arg("serve")
            .args(args)
            .stdout(std::fs::File::create(&stdout).unwrap())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .expect("spawn udm serve");
        let s = Serve {
            child: Some(child),
            sock,
            dir,
            stderr,
            stdout,
        };
        let t0 = Instant::now();
        while !s.out().contains("udm: control socket at ")
            || (!s.sock.as_os_str().is_empty() && UnixStream::connect(&s.sock).is_err())
        {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "udm serve did not listen: {}{}",
                s.out(),
                s.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        s
    }

    /// What the server printed on stdout so far (URIs, control socket).
    pub fn out(&self) -> String {
        std::fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    /// The control socket the server announced.
    pub fn ctl(&self) -> PathBuf {
        let out = self.out();
        let p = out
            .lines()
            .find_map(|l| l.strip_prefix("udm: control socket at "))
            .unwrap_or_else(|| panic!("no control socket announced: {out}"));
        PathBuf::from(p)
    }

    /// The NBD URI of `export`.
    pub fn uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.sock.display())
    }

    /// What the server logged so far.
    pub fn log(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.stderr) {
            let _ = f.read_to_string(&mut s);
        }
        s
    }

    /// Waits until the log holds `n` lines containing `needle`.
    pub fn wait_log(&self, needle: &str, n: usize) -> String {
        wait_file(&self.stderr, needle, n, Duration::from_secs(10))
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn stop(&mut self) -> ExitStatus {
        let mut c = self.child.take().expect("running");
        // SAFETY: signalling our own child.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        let t0 = Instant::now();
        loop {
            if let Some(st) = c.try_wait().unwrap() {
                return st;
            }
            if t0.elapsed() > Duration::from_secs(20) {
                let _ = c.kill();
                panic!("udm serve did not stop on SIGTERM: {}", self.log());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(5) {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs a client tool; panics with its output unless it succeeds.
pub fn run(cmd: &str, args: &[&str]) -> String {
    // nbdsh runs `python3 -m nbd`: the distribution's python3 has the
    // libnbd bindings, one earlier on PATH (pyenv, venv) may not.
    let path = format!("/usr/bin:{}", std::env::var("PATH").unwrap_or_default());
    let out = Command::new(cmd)
        .args(args)
        .env("PATH", path)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e} (installed by scripts/setup.sh)"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd} {args:?} failed:\n{text}");
    text
}

/// Writes `len` pseudo-random bytes to `path`.
pub fn random_file(path: &Path, len: usize, seed: u64) {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    std::fs::write(path, v).unwrap();
}

/// Runs `udm ARGS`; returns its exit code, stdout and stderr.
pub fn udm(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_udm"))
        .args(args)
        .output()
        .expect("run udm");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A child process killed when dropped (unless waited for).
pub struct KillOnDrop(pub Option<Child>);

impl KillOnDrop {
    /// Whether the child has not exited yet.
    pub fn running(&mut self) -> bool {
        let c = self.0.as_mut().expect("running");
        matches!(c.try_wait(), Ok(None))
    }

    /// Calls `round(i)` for as long as the child runs, and `at_least` times
    /// however soon it ends (failing past `deadline`); returns how many
    /// rounds ran, and how many of them ran whole while the child ran.
    pub fn rounds_while_running(
        &mut self,
        at_least: usize,
        deadline: Instant,
        mut round: impl FnMut(usize),
    ) -> (usize, usize) {
        let (mut rounds, mut beside) = (0, 0);
        while rounds < at_least || self.running() {
            let running = self.running();
            round(rounds);
            rounds += 1;
            beside += usize::from(running && self.running());
            assert!(Instant::now() < deadline, "never ended");
        }
        (rounds, beside)
    }

    /// Waits for the child; returns its stdout and stderr together.
    pub fn wait_with_output(mut self) -> String {
        let c = self.0.take().expect("running");
        let out = c.wait_with_output().expect("wait");
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Waits until the file at `path` (a process's log) holds `needle` `n`
/// times, `within` at most; returns its text.
pub fn wait_file(path: &Path, needle: &str, n: usize, within: Duration) -> String {
    let t0 = Instant::now();
    loop {
        let l = std::fs::read_to_string(path).unwrap_or_default();
        if l.matches(needle).count() >= n {
            return l;
        }
        assert!(
            t0.elapsed() < within,
            "{} never showed {n} x '{needle}':\n{l}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A TCP port nobody listens on right now on loopback (the kernel's pick,
/// released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("binding 127.0.0.1:0")
        .local_addr()
        .expect("its address")
        .port()
}
