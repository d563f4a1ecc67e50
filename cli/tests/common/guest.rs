//! The test guest (`scripts/guest/`, the Debian kernel under QEMU/TCG with
//! this build's udm inside): [`Guest`] boots it with a test script
//! (`scripts/guest/run.sh`), [`run_scenarios`] with named scenarios
//! (`scripts/guest.sh`), each check reported as a `RESULT name=ok|FAIL`
//! line.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::TempDir;

fn scripts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts")
}

/// `scripts/guest/run.sh`: one boot of the guest running a test script, as
/// the builder's calls set it up (disks, memory, QEMU arguments, ...).
pub struct Guest {
    cmd: Command,
    console: Option<PathBuf>,
}

impl Guest {
    /// The guest running `script` (written to `test.sh` in `dir`) under
    /// `sh -e`, with this build's udm on its PATH.
    pub fn new(dir: &TempDir, script: &str) -> Guest {
        let path = dir.path("test.sh");
        std::fs::write(&path, script).unwrap();
        let mut cmd = Command::new(scripts().join("guest/run.sh"));
        cmd.arg(&path).env("UDM", env!("CARGO_BIN_EXE_udm"));
        Guest { cmd, console: None }
    }

    /// Raw images attached as `/dev/vda`, `/dev/vdb`, ... in order.
    pub fn disks(mut self, disks: &[&Path]) -> Guest {
        self.cmd.args(disks);
        self
    }

    /// The guest's memory, e.g. `512M` (`GUEST_MEM`).
    pub fn mem(mut self, size: &str) -> Guest {
        self.cmd.env("GUEST_MEM", size);
        self
    }

    /// More QEMU arguments, split on spaces (`GUEST_QEMU_ARGS`): e.g. a
    /// vhost-user-blk device.
    pub fn qemu_args(mut self, args: impl AsRef<OsStr>) -> Guest {
        self.cmd.env("GUEST_QEMU_ARGS", args);
        self
    }

    /// Where the console goes as the guest runs (`GUEST_LOG`), for a test
    /// to follow with [`Running::wait_console`].
    pub fn console_log(mut self, path: &Path) -> Guest {
        self.cmd.env("GUEST_LOG", path);
        self.console = Some(path.to_owned());
        self
    }

    /// A reboot in the guest resets the machine and boots it again, the
    /// script included, instead of ending QEMU (`GUEST_REBOOT`).
    pub fn reboot(mut self) -> Guest {
        self.cmd.env("GUEST_REBOOT", "1");
        self
    }

    /// How long QEMU may run, in seconds (`GUEST_TIMEOUT`).
    pub fn timeout(mut self, secs: u32) -> Guest {
        self.cmd.env("GUEST_TIMEOUT", secs.to_string());
        self
    }

    /// Boots the guest and waits for it; returns its console and run.sh's
    /// messages. Panics with them, followed by `context()` (e.g. udm's
    /// log), unless the script succeeded.
    #[track_caller]
    pub fn run(self, context: impl FnOnce() -> String) -> String {
        let (ok, text) = self.spawn().wait();
        assert!(ok, "the guest's test failed:\n{text}{}", context());
        text
    }

    /// Boots the guest and returns at once, for a test that acts on the
    /// host (kills udm, reloads a table) while the guest runs.
    pub fn spawn(self) -> Running {
        Running::start(self.cmd, "scripts/guest/run.sh", self.console)
    }
}

/// A guest booted by [`Guest::spawn`] (or the scenarios' run).
pub struct Running {
    child: Child,
    console: Option<PathBuf>,
}

impl Running {
    fn start(mut cmd: Command, what: &str, console: Option<PathBuf>) -> Running {
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        Running { child, console }
    }

    /// Waits until the console (see [`Guest::console_log`]) shows
    /// `needle`: false if the guest ended first or 240 s went by.
    pub fn wait_console(&mut self, needle: &str) -> bool {
        let log = self.console.as_deref().expect("Guest::console_log was set");
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(240) {
            if std::fs::read_to_string(log).is_ok_and(|s| s.contains(needle)) {
                return true;
            }
            if self.child.try_wait().unwrap().is_some() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    /// Waits for the end: whether the script succeeded, and the console
    /// and the run's messages.
    pub fn wait(self) -> (bool, String) {
        let out = self.child.wait_with_output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    }
}

/// Runs `scripts/guest.sh SCENARIO...` with this build's udm and returns
/// its output; panics with that output unless it exited 0 and every
/// check in `checks` printed `RESULT check=ok`.
#[track_caller]
pub fn run_scenarios<S: AsRef<str>>(scenarios: &[&str], checks: &[S]) -> String {
    let mut cmd = Command::new(scripts().join("guest.sh"));
    cmd.args(scenarios).env("UDM", env!("CARGO_BIN_EXE_udm"));
    let (ok, text) = Running::start(cmd, "scripts/guest.sh", None).wait();
    assert!(ok, "the guest's scenarios {scenarios:?} failed:\n{text}");
    for check in checks {
        let check = check.as_ref();
        assert!(
            text.contains(&format!("RESULT {check}=ok")),
            "{check}:\n{text}"
        );
    }
    text
}
