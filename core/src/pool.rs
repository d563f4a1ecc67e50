//! A pool of reactor threads: one [`Reactor`] per thread, each optionally
//! pinned to a CPU, reachable through its [`ReactorHandle`], stopped and
//! joined together. Every program of udm that runs reactors (`udm bench`,
//! `udm serve`, the exports) starts them here.
//!
//! Each thread runs a `main` given by the caller on its own reactor: the
//! default ([`ReactorPool::start_running`]) turns the reactor until the pool
//! is stopped and does the rest through messages; a caller with its own
//! loop (a bench job, an export's worker) passes its own `main` and checks
//! the pool's [`StopToken`] where it wants to.

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use crate::affinity;
use crate::error::{Error, ErrorKind};
use crate::reactor::{Reactor, ReactorConfig, ReactorHandle};

/// How to start a pool.
#[derive(Clone, Debug)]
pub struct PoolConfig {
    /// Reactor threads (at least one is started).
    pub threads: usize,
    /// CPUs to pin to: thread `i` runs on `cpus[i % cpus.len()]` only.
    /// Empty: threads run wherever the caller's affinity lets them.
    pub cpus: Vec<usize>,
    /// How each reactor is built.
    pub reactor: ReactorConfig,
    /// Thread `i` is named `<name><i>` (e.g. `udm-nbd-` gives `udm-nbd-0`).
    pub name: String,
}

impl PoolConfig {
    /// `threads` unpinned reactors built with `reactor`, named `<name><i>`.
    pub fn new(name: &str, threads: usize, reactor: ReactorConfig) -> PoolConfig {
        PoolConfig {
            threads,
            cpus: Vec::new(),
            reactor,
            name: name.to_string(),
        }
    }

    /// The CPU thread `i` is pinned to, if any.
    pub fn cpu_of(&self, i: usize) -> Option<usize> {
        (!self.cpus.is_empty()).then(|| self.cpus[i % self.cpus.len()])
    }
}

/// Whether the pool was asked to stop; given to each thread's `main`.
#[derive(Clone, Debug)]
pub struct StopToken(Arc<AtomicBool>);

impl StopToken {
    /// True once [`ReactorPool::stop`] was called (or the pool dropped).
    #[inline]
    pub fn is_stopped(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

struct Member<R> {
    /// `None` when the thread ended before running `main`.
    thread: JoinHandle<Option<R>>,
}

/// Reactor threads started together; see the module docs. Dropping the pool
/// stops it and joins its threads.
pub struct ReactorPool<R: Send + 'static = ()> {
    members: Vec<Member<R>>,
    handles: Vec<ReactorHandle>,
    stop: StopToken,
    name: String,
}

impl ReactorPool<()> {
    /// Starts reactors that only turn (running what is sent to them through
    /// their handles) until [`ReactorPool::stop`].
    pub fn start_running(cfg: &PoolConfig) -> Result<ReactorPool<()>, Error> {
        ReactorPool::start(cfg, |_, r: &Reactor, stop: &StopToken| {
            r.run_until(|| stop.is_stopped());
        })
    }
}

impl<R: Send + 'static> ReactorPool<R> {
    /// Starts `cfg.threads` threads. Each pins itself (when `cfg.cpus` says
    /// so) and builds its reactor; once every reactor exists, each thread
    /// runs `main(i, &reactor, &stop)`. If one cannot be set up, no `main`
    /// runs: the threads end and the error is returned. When `main`
    /// returns, the reactor is dropped (finishing what is in flight) and
    /// then `main`'s result is handed to [`ReactorPool::join`], so a result
    /// may own memory registered with the reactor.
    pub fn start<F>(cfg: &PoolConfig, main: F) -> Result<ReactorPool<R>, Error>
    where
        F: Fn(usize, &Reactor, &StopToken) -> R + Send + Sync + 'static,
    {
        let main = Arc::new(main);
        let stop = StopToken(Arc::new(AtomicBool::new(false)));
        let mut pool = ReactorPool {
            members: Vec::new(),
            handles: Vec::new(),
            stop: stop.clone(),
            name: cfg.name.clone(),
        };
        // Dropping a sender without sending tells its thread not to run main.
        let mut go = Vec::new();
        for i in 0..cfg.threads.max(1) {
            let (tx, rx) = mpsc::channel::<Result<ReactorHandle, Error>>();
            let (go_tx, go_rx) = mpsc::channel::<()>();
            let main = main.clone();
            let stop = stop.clone();
            let cpu = cfg.cpu_of(i);
            let rcfg = cfg.reactor;
            let spawned = std::thread::Builder::new()
                .name(format!("{}{i}", cfg.name))
                .spawn(move || -> Option<R> {
                    let reactor = match setup(cpu, rcfg) {
                        Ok(r) => r,
                        Err(e) => {
                            let _ = tx.send(Err(e));
                            return None;
                        }
                    };
                    if tx.send(Ok(reactor.handle())).is_err() {
                        return None;
                    }
                    drop(tx);
                    go_rx.recv().ok()?;
                    let r = main(i, &reactor, &stop);
                    drop(reactor);
                    Some(r)
                });
            let thread = match spawned {
                Ok(t) => t,
                Err(e) => {
                    drop(go);
                    pool.abort();
                    return Err(Error::os(format!("spawning {}{i}", cfg.name), e));
                }
            };
            let ready = rx.recv();
            pool.members.push(Member { thread });
            match ready {
                Ok(Ok(h)) => {
                    pool.handles.push(h);
                    go.push(go_tx);
                }
                Ok(Err(e)) => {
                    drop(go);
                    pool.abort();
                    return Err(e.context(format!("{}{i}", cfg.name)));
                }
                Err(_) => {
                    drop(go);
                    let why = match pool.members.pop().map(|m| m.thread.join()) {
                        Some(Err(p)) => panic_message(&*p),
                        _ => "no reason given".into(),
                    };
                    pool.abort();
                    return Err(Error::new(
                        ErrorKind::Io,
                        format!("{}{i} died during setup: {why}", cfg.name),
                    ));
                }
            }
        }
        for g in go {
            let _ = g.send(());
        }
        Ok(pool)
    }

    /// Reactors in the pool.
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    /// Whether the pool has no reactor (never: `start` starts at least one).
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// The handles of the pool's reactors, by thread index.
    pub fn handles(&self) -> &[ReactorHandle] {
        &self.handles
    }

    /// Runs `f` on every reactor at its next turn. Returns how many
    /// reactors took it (a reactor that has stopped does not).
    pub fn broadcast(&self, f: impl Fn(&Reactor) + Send + Sync + 'static) -> usize {
        let f = Arc::new(f);
        self.handles
            .iter()
            .filter(|h| {
                let f = f.clone();
                h.send(move |r: &Reactor| f(r))
            })
            .count()
    }

    /// The pool's stop token (what each `main` is given).
    pub fn stop_token(&self) -> StopToken {
        self.stop.clone()
    }

    /// Asks every thread to stop: sets the [`StopToken`] and wakes every
    /// reactor so that a sleeping one sees it. Does not wait.
    pub fn stop(&self) {
        self.stop.0.store(true, Ordering::Release);
        for h in &self.handles {
            h.wake();
        }
    }

    /// Whether every thread has ended.
    pub fn is_finished(&self) -> bool {
        self.members.iter().all(|m| m.thread.is_finished())
    }

    /// Waits for every thread to end (it does not stop them: see
    /// [`ReactorPool::stop`]) and returns each one's result, by thread
    /// index. A thread that panicked gives an error naming it and the
    /// panic's message.
    pub fn join(mut self) -> Vec<Result<R, Error>> {
        let members = std::mem::take(&mut self.members);
        members
            .into_iter()
            .enumerate()
            .map(|(i, m)| match m.thread.join() {
                Ok(Some(r)) => Ok(r),
                Ok(None) => Err(Error::new(
                    ErrorKind::Io,
                    format!("{}{i} ended before running", self.name),
                )),
                Err(p) => Err(Error::new(
                    ErrorKind::Io,
                    format!("{}{i} panicked: {}", self.name, panic_message(&*p)),
                )),
            })
            .collect()
    }

    /// Stops and joins what was started (a failed start).
    fn abort(&mut self) {
        self.stop();
        for m in self.members.drain(..) {
            let _ = m.thread.join();
        }
    }
}

impl<R: Send + 'static> Drop for ReactorPool<R> {
    fn drop(&mut self) {
        self.abort();
    }
}

/// Pins the calling thread (when asked) and builds its reactor.
fn setup(cpu: Option<usize>, cfg: ReactorConfig) -> Result<Reactor, Error> {
    if let Some(c) = cpu {
        affinity::set_allowed_cpus(&[c])
            .map_err(|e| Error::os(format!("pinning to CPU {c}"), e))?;
    }
    Reactor::new(cfg).map_err(|e| Error::os("reactor setup", e))
}

/// The message a panic carried, when it is a string.
fn panic_message(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "(not a string)".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn cfg(threads: usize) -> PoolConfig {
        PoolConfig::new("udm-test-", threads, ReactorConfig::default())
    }

    #[test]
    fn each_reactor_runs_what_is_sent_to_it_on_its_own_thread() {
        let pool = ReactorPool::start_running(&cfg(3)).unwrap();
        assert_eq!(pool.len(), 3);
        let (tx, rx) = mpsc::channel();
        for (i, h) in pool.handles().iter().enumerate() {
            let tx = tx.clone();
            assert!(h.send(move |r: &Reactor| {
                let name = std::thread::current().name().map(str::to_string);
                tx.send((i, r.id(), name)).unwrap();
            }));
        }
        let mut got: Vec<_> = (0..3).map(|_| rx.recv().unwrap()).collect();
        got.sort();
        for (i, (j, id, name)) in got.iter().enumerate() {
            assert_eq!(*j, i);
            assert_eq!(*id, pool.handles()[i].id());
            assert_eq!(name.as_deref(), Some(format!("udm-test-{i}").as_str()));
        }
        assert_eq!(pool.broadcast(move |_| {}), 3);
        pool.stop();
        assert!(pool.join().iter().all(Result::is_ok));
    }

    #[test]
    fn threads_run_on_the_cpus_they_are_pinned_to() {
        let allowed = affinity::allowed_cpus().unwrap();
        let mut c = cfg(allowed.len().min(4));
        c.cpus = allowed.iter().rev().copied().collect();
        let pool = ReactorPool::start(&c, |_, _, _| {
            // SAFETY: sched_getcpu takes no arguments.
            let cpu = unsafe { libc::sched_getcpu() };
            (cpu, affinity::allowed_cpus().unwrap())
        })
        .unwrap();
        for (i, r) in pool.join().into_iter().enumerate() {
            let (cpu, set) = r.unwrap();
            let want = c.cpu_of(i).unwrap();
            assert_eq!(cpu, want as i32);
            assert_eq!(set, vec![want]);
        }
    }

    #[test]
    fn no_main_runs_when_one_reactor_cannot_be_set_up() {
        let mut c = cfg(3);
        c.cpus = vec![affinity::allowed_cpus().unwrap()[0], affinity::MAX_CPUS - 1];
        let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let r = ran.clone();
        let e = ReactorPool::start(&c, move |_, _, _| {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .err()
        .unwrap();
        assert!(e.to_string().contains("udm-test-1: pinning to CPU"), "{e}");
        assert_eq!(ran.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn stop_ends_sleeping_reactors_promptly() {
        let pool = ReactorPool::start_running(&cfg(2)).unwrap();
        std::thread::sleep(Duration::from_millis(50)); // let them fall asleep
        let t0 = Instant::now();
        pool.stop();
        let rs = pool.join();
        // A sleeping reactor waits on its eventfd with no timeout: a lost
        // wake-up would never end, so this bound detects a hang, not a
        // speed (2.4 s once in CI, the lib's other tests spinning on both
        // cores while the woken threads waited for one).
        assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
        assert_eq!(rs.len(), 2);
        assert!(rs.iter().all(Result::is_ok));
    }

    #[test]
    fn a_panicking_reactor_is_reported_and_the_others_still_stop() {
        let pool = ReactorPool::start_running(&cfg(2)).unwrap();
        pool.handles()[0].send(|_: &Reactor| panic!("boom on purpose"));
        let t0 = Instant::now();
        // A hang, not a time: unwinding prints the panic's backtrace, whose
        // symbols take seconds to resolve on a loaded machine.
        while !pool.handles()[0].is_closed() {
            assert!(t0.elapsed() < Duration::from_secs(60), "the panic hung");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!pool.handles()[0].send(|_: &Reactor| {}));
        pool.stop();
        let rs = pool.join();
        let e = rs[0].as_ref().err().unwrap().to_string();
        assert!(e.contains("udm-test-0 panicked: boom on purpose"), "{e}");
        assert!(rs[1].is_ok());
    }

    #[test]
    fn a_main_that_ends_by_itself_is_joined_without_stop() {
        let mut c = cfg(2);
        c.reactor.mode = crate::CompletionMode::Poll; // idle turns do not sleep
        let pool = ReactorPool::start(&c, |i, r, _| {
            let mut turns = 0;
            r.run_until(|| {
                turns += 1;
                turns > 3
            });
            i * 10
        })
        .unwrap();
        let t0 = Instant::now();
        while !pool.is_finished() {
            assert!(t0.elapsed() < Duration::from_secs(5));
            std::thread::sleep(Duration::from_millis(1));
        }
        let rs: Vec<usize> = pool.join().into_iter().map(Result::unwrap).collect();
        assert_eq!(rs, vec![0, 10]);
    }
}
