//! The writecache's worker: a thread with its own reactor and channels to
//! the origin and the cache (the kernel's workqueue). It loads or formats
//! the metadata, runs commits (on FLUSH, FUA, autocommit and to release
//! freed blocks), and writes back: above `high_watermark` down to
//! `low_watermark`, everything on `flush`/`cleaner`, and blocks older than
//! `max_age`. Writeback takes the oldest committed blocks, each with its
//! cached neighbours on the origin, sorts them by origin sector and merges
//! neighbours into large origin writes. The map path wakes the worker when
//! a write brings the cache to the high watermark.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use udm_core::{Error, Poller, Reactor, ReactorConfig};

use super::clean::Batch;
use super::entry::NONE;
use super::state::Shared;
use super::worker::Worker;

/// When the worker starts what (its scheduling).
impl Worker {
    /// Looks at the state and starts what is due.
    fn step(self: &Rc<Self>) {
        let sh = &*self.shared;
        if sh.stop.load(Ordering::Acquire) {
            return;
        }
        let now = Instant::now();
        let resume = {
            let mut st = sh.lock();
            let drained = st.barrier != 0 && st.inflight_writes[(st.barrier & 1) as usize] == 0;
            if drained {
                st.barrier = 0;
            }
            drained
        };
        if resume {
            if let Some((gen, then)) = self.barrier_then.take() {
                self.commit_flush(gen, true, then);
            }
        }
        let (commit, batch) = {
            let mut st = sh.lock();
            if !st.ready || st.error != 0 {
                // Parked bios must still hear about the error.
                (false, Batch::default())
            } else {
                // Pick first: it may find that writeback needs a commit.
                let batch = if self.wb_busy.get() {
                    Batch::default()
                } else {
                    self.pick(&mut st, now)
                };
                let auto_time = st
                    .dirty_since
                    .is_some_and(|t| now.duration_since(t) >= sh.cfg.autocommit_time);
                let commit = !self.commit_busy.get()
                    && (st.commit_wanted >= st.pending_gen
                        || st.uncommitted >= sh.cfg.autocommit_blocks
                        || auto_time);
                (commit, batch)
            }
        };
        if commit {
            self.start_commit(None);
        }
        if !batch.blocks.is_empty() {
            self.writeback(batch);
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        let sh = &*self.shared;
        let st = sh.lock();
        let mut d = st.dirty_since.map(|t| t + sh.cfg.autocommit_time);
        if sh.cfg.max_age.is_some() && st.lru_head != NONE {
            // Look again in a while; max_age is coarse (as in dm).
            let t = Instant::now() + Duration::from_millis(100);
            d = Some(d.map_or(t, |x| x.min(t)));
        }
        if st.last_origin_write.is_some() && st.wb_active {
            let t = Instant::now() + Duration::from_millis(50);
            d = Some(d.map_or(t, |x| x.min(t)));
        }
        d
    }
}

struct WorkerPoller(Rc<Worker>);

impl Poller for WorkerPoller {
    fn poll(&self) -> usize {
        let w = &self.0;
        let due = self.deadline().is_some_and(|d| d <= Instant::now());
        if w.shared.poked.swap(false, Ordering::AcqRel) || due {
            w.step();
            return 1;
        }
        0
    }

    fn deadline(&self) -> Option<Instant> {
        if self.0.shared.stop.load(Ordering::Acquire) {
            return None;
        }
        self.0.next_deadline()
    }
}

/// Starts the worker thread; returns once the metadata is loaded (or
/// formatted), or with the error that prevented it.
pub(crate) fn start(shared: Arc<Shared>) -> Result<std::thread::JoinHandle<()>, Error> {
    crate::targets::start_worker("writecache", "writecache", move |tx| run(shared, tx))
}

fn run(sh: Arc<Shared>, tx: mpsc::Sender<Result<(), Error>>) {
    // UDM_WC_WORKER_POLL=1 makes the worker spin instead of sleeping in
    // io_uring_enter: valgrind (3.19) holds its big lock across that call,
    // so a sleeping worker would stop every other thread under callgrind
    // (scripts/bench/instr-per-io.sh sets it and counts the other threads only).
    let mut rc = ReactorConfig::default();
    if std::env::var_os("UDM_WC_WORKER_POLL").is_some_and(|v| v == "1") {
        rc.mode = udm_core::CompletionMode::Poll;
    }
    let reactor = match Reactor::new(rc) {
        Ok(r) => r,
        Err(e) => {
            let _ = tx.send(Err(Error::os(
                "writecache: creating the worker's reactor",
                e,
            )));
            return;
        }
    };
    let open = |d: &Arc<dyn udm_core::BlockDevice>| d.clone().open(&reactor);
    let (origin, cache) = match (open(&sh.cfg.origin), open(&sh.cfg.cache)) {
        (Ok(o), Ok(c)) => (o, c),
        (Err(e), _) | (_, Err(e)) => {
            let _ = tx.send(Err(e));
            return;
        }
    };
    let _ = sh.worker.set(reactor.handle());
    // SAFETY: the reactor lives to the end of this function, and the
    // last run_until below returns only once no I/O of the worker is in
    // flight; the worker's Rcs (its poller, closures) die with it or before.
    let w = Rc::new(unsafe { Worker::new(sh.clone(), &reactor, origin, cache) });
    let result: Rc<Cell<Option<Result<(), Error>>>> = Rc::new(Cell::new(None));
    w.load(result.clone());
    let mut loaded = None;
    reactor.run_until(|| {
        if loaded.is_none() {
            loaded = result.take();
        }
        loaded.is_some() && w.inflight.get() == 0
    });
    match loaded {
        Some(Ok(())) => {
            sh.lock().ready = true;
            let _ = tx.send(Ok(()));
        }
        Some(Err(e)) => {
            let _ = tx.send(Err(e));
            return;
        }
        None => return,
    }
    reactor.add_poller(Rc::new(WorkerPoller(w.clone())));
    sh.poke();
    reactor.run_until(|| sh.stop.load(Ordering::Acquire) && w.inflight.get() == 0);
    // Every callback (which dereferences the reactor) has run.
}
