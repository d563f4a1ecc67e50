//! A real one-node Ceph cluster for the rbd tests: started once per test
//! binary (per name) with `scripts/ceph-cluster.sh`, stopped at exit.

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// A running cluster.
pub struct Ceph {
    pub dir: String,
    pub conf: String,
}

static STARTED: Mutex<Vec<String>> = Mutex::new(Vec::new());
static IMAGE_SEQ: AtomicUsize = AtomicUsize::new(0);

fn script() -> String {
    format!("{}/../scripts/ceph-cluster.sh", env!("CARGO_MANIFEST_DIR"))
}

extern "C" fn stop_all() {
    let dirs = match STARTED.lock() {
        Ok(d) => d.clone(),
        Err(p) => p.into_inner().clone(),
    };
    for d in dirs {
        let _ = Command::new(script()).args(["stop", &d]).status();
        let _ = std::fs::remove_dir_all(&d);
    }
}

/// Whether the ceph binaries are installed (scripts/setup.sh installs them).
pub fn available() -> bool {
    ["ceph-mon", "ceph-osd", "rbd", "rados"].iter().all(|b| {
        Command::new("sh")
            .args(["-c", &format!("command -v {b}")])
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// Starts a cluster called `tag` for this process: its own directory and
/// monitor port, so that test binaries (and other users) do not collide.
pub fn start(tag: u16) -> Ceph {
    let pid = std::process::id();
    let dir = format!("/tmp/udm-rbd-{pid}-{tag}");
    let port = 20000 + ((pid as u16 % 1000) * 10 + tag) % 20000;
    let out = Command::new(script())
        .args(["start", &dir])
        .env("CEPH_MON_PORT", port.to_string())
        .output()
        .expect("run ceph-cluster.sh");
    {
        let mut s = STARTED.lock().unwrap();
        if s.is_empty() {
            // SAFETY: registering a plain extern "C" fn with no arguments.
            unsafe { libc::atexit(stop_all) };
        }
        s.push(dir.clone());
    }
    assert!(
        out.status.success(),
        "ceph-cluster.sh start {dir} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ceph {
        conf: format!("{dir}/ceph.conf"),
        dir,
    }
}

/// The cluster shared by this binary's tests, or None (with a message) when
/// ceph is not installed.
pub fn shared() -> Option<&'static Ceph> {
    static C: OnceLock<Option<Ceph>> = OnceLock::new();
    C.get_or_init(|| {
        if !available() {
            eprintln!("SKIPPED: ceph binaries missing (scripts/setup.sh installs ceph-mon ceph-osd ceph-common)");
            return None;
        }
        Some(start(0))
    })
    .as_ref()
}

impl Ceph {
    /// Runs `rbd ARGS` against this cluster; panics on failure.
    pub fn rbd(&self, args: &[&str]) -> String {
        let out = Command::new("rbd")
            .arg("-c")
            .arg(&self.conf)
            .args(args)
            .output()
            .expect("run rbd");
        assert!(
            out.status.success(),
            "rbd {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A new image of `bytes`; returns its name.
    pub fn image(&self, bytes: u64) -> String {
        let name = format!("t{}", IMAGE_SEQ.fetch_add(1, Ordering::Relaxed));
        self.rbd(&[
            "create",
            "--size",
            &format!("{}K", bytes >> 10),
            &format!("rbd/{name}"),
        ]);
        name
    }

    /// The `rbd:` spec of image `name`, with extra options.
    pub fn spec(&self, name: &str, extra: &str) -> String {
        format!("rbd/{name},conf={}{extra}", self.conf)
    }

    /// Stops the OSD (the cluster stops answering I/O).
    pub fn stop_osd(&self) {
        let st = Command::new(script())
            .args(["stop-osd", &self.dir])
            .status()
            .expect("run ceph-cluster.sh");
        assert!(st.success());
    }
}
