//! Test support shared by the workspace's test suites, compiled only with
//! the `test-util` feature (which crates turn on in their
//! `[dev-dependencies]`, so no release binary carries it):
//!
//! - [`Watchdog`]: waits on a [`Reactor`] that fail instead of hanging when
//!   a completion or a wake-up is lost.
//! - [`TempDir`]: a fresh directory under the system's temp dir, removed on
//!   drop.
//! - [`TempFile`]: a fresh path under /dev/shm, removed on drop or, when a
//!   wait times out, by [`timed_out`] before it aborts.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::{Reactor, ReactorHandle};

/// Wakes a reactor (over and over) once an armed deadline has passed, so a
/// reactor asleep waiting for something that never comes returns to its
/// `run_until` check, which then fails the test. It never wakes the reactor
/// before the deadline, so it cannot hide a lost wake-up.
///
/// ```no_run
/// # use std::time::Duration;
/// # use udm_core::{Reactor, ReactorConfig, testing::Watchdog};
/// # let reactor = Reactor::new(ReactorConfig::default()).unwrap();
/// # let done = || true;
/// let dog = Watchdog::new(reactor.handle(), Duration::from_secs(20));
/// dog.run_until(&reactor, "a message to a sleeping reactor", done);
/// ```
pub struct Watchdog {
    timeout: Duration,
    deadline: Arc<Mutex<Option<Instant>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// A [`Watchdog::try_run_until`] whose deadline passed before it was done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimedOut {
    /// How long it had.
    pub after: Duration,
}

impl Watchdog {
    /// A watchdog for the reactor behind `handle`, giving each wait
    /// `timeout`. Its thread runs until the watchdog is dropped.
    pub fn new(handle: ReactorHandle, timeout: Duration) -> Watchdog {
        let deadline = Arc::new(Mutex::new(None::<Instant>));
        let stop = Arc::new(AtomicBool::new(false));
        let (d, s) = (deadline.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Acquire) {
                std::thread::park_timeout(Duration::from_millis(50));
                let due = lock(&d).is_some_and(|t| Instant::now() >= t);
                if due {
                    handle.wake();
                }
            }
        });
        Watchdog {
            timeout,
            deadline,
            stop,
            thread: Some(thread),
        }
    }

    /// `reactor.run_until(done)`, or [`TimedOut`] once the timeout has
    /// passed. The deadline is checked before `done`, so work that only
    /// finishes because the watchdog woke the reactor still counts as timed
    /// out.
    pub fn try_run_until(
        &self,
        reactor: &Reactor,
        mut done: impl FnMut() -> bool,
    ) -> Result<(), TimedOut> {
        let deadline = Instant::now() + self.timeout;
        *lock(&self.deadline) = Some(deadline);
        let mut late = false;
        reactor.run_until(|| {
            late = Instant::now() > deadline;
            late || done()
        });
        *lock(&self.deadline) = None;
        if late {
            return Err(TimedOut {
                after: self.timeout,
            });
        }
        Ok(())
    }

    /// [`Watchdog::try_run_until`], aborting the test process through
    /// [`timed_out`] (naming `what`) if it times out.
    pub fn run_until(&self, reactor: &Reactor, what: &str, done: impl FnMut() -> bool) {
        if let Err(t) = self.try_run_until(reactor, done) {
            timed_out(what, t.after);
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// The deadline, even if a panicking test thread poisoned its lock.
fn lock(m: &Mutex<Option<Instant>>) -> std::sync::MutexGuard<'_, Option<Instant>> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A wait timed out after `after`: says so (naming `what`) and aborts the
/// process. I/O may still be in flight into buffers an unwinding stack
/// would free, so this aborts rather than panics. It writes to stderr
/// directly: the test harness does not capture that, and would lose what it
/// captured when the process aborts.
///
/// The live [`TempFile`]s are removed first, since no destructor will run.
pub fn timed_out(what: &str, after: Duration) -> ! {
    let _ = writeln!(std::io::stderr(), "TIMEOUT after {after:?}: {what}");
    if let Ok(live) = TEMP_FILES.try_lock() {
        for p in live.iter() {
            let _ = std::fs::remove_file(p);
        }
    }
    std::process::abort();
}

/// The live [`TempFile`]s' paths, for [`timed_out`] to remove.
static TEMP_FILES: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// A fresh path `/dev/shm/udm-test-PID-N-TAG` (in memory, and O_DIRECT
/// works there on this host's kernel, so a file device tested there does
/// real I/O without wearing a disk), not created: a
/// stale file of the name is removed. The file, if made, is removed on drop,
/// or by [`timed_out`].
pub struct TempFile {
    /// The path.
    pub path: String,
}

impl TempFile {
    /// A new path tagged `tag`.
    pub fn new(tag: &str) -> TempFile {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let path = format!("/dev/shm/udm-test-{}-{n}-{tag}", std::process::id());
        let _ = std::fs::remove_file(&path);
        TEMP_FILES
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(path.clone());
        TempFile { path }
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        let mut live = TEMP_FILES.lock().unwrap_or_else(PoisonError::into_inner);
        live.retain(|p| *p != self.path);
    }
}

/// A fresh directory `udm-test-TAG-PID-N` under [`std::env::temp_dir`],
/// removed with what it holds on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    /// Creates the directory (removing a stale one of the same name first).
    /// Panics, naming the path, if it cannot be created.
    pub fn new(tag: &str) -> TempDir {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("udm-test-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        if let Err(e) = std::fs::create_dir_all(&p) {
            panic!("creating {}: {e}", p.display());
        }
        TempDir(p)
    }

    /// Takes over an existing directory `dir`: it is removed on drop.
    pub fn adopt(dir: PathBuf) -> TempDir {
        TempDir(dir)
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.0
    }

    /// `name` in the directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ReactorConfig;

    #[test]
    fn a_wait_on_an_idle_reactor_times_out_at_its_deadline_instead_of_hanging() {
        let reactor = Reactor::new(ReactorConfig::default()).unwrap();
        let dog = Watchdog::new(reactor.handle(), Duration::from_millis(200));
        let t0 = Instant::now();
        let r = dog.try_run_until(&reactor, || false);
        assert_eq!(
            r,
            Err(TimedOut {
                after: Duration::from_millis(200)
            })
        );
        assert!(t0.elapsed() >= Duration::from_millis(200), "not before it");
        assert!(t0.elapsed() < Duration::from_secs(5), "soon after it");
        // Disarmed: a wait that is done at once is done.
        assert_eq!(dog.try_run_until(&reactor, || true), Ok(()));
    }

    #[test]
    fn a_temp_dir_is_fresh_and_removed_on_drop() {
        let d = TempDir::new("testing");
        let keep = d.dir().to_path_buf();
        std::fs::write(d.path("f"), b"x").unwrap();
        assert_eq!(std::fs::read(keep.join("f")).unwrap(), b"x");
        drop(d);
        assert!(!keep.exists());
    }

    #[test]
    fn a_temp_file_is_a_fresh_path_removed_on_drop() {
        let (a, b) = (TempFile::new("t"), TempFile::new("t"));
        assert_ne!(a.path, b.path);
        assert!(!Path::new(&a.path).exists(), "not created");
        std::fs::write(&a.path, b"x").unwrap();
        let keep = a.path.clone();
        drop(a);
        assert!(!Path::new(&keep).exists());
    }
}
