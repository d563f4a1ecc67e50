//! The built-in targets, one file (or folder) each.

pub mod crypt;
pub mod delay;
pub mod dust;
pub mod error;
pub mod flakey;
pub mod linear;
pub mod log_writes;
pub mod raid;
pub mod striped;
pub mod thin;
pub mod writecache;
pub mod zero;

/// Starts a target's worker thread, named `thread`, running `run`, which
/// sends once whether it loaded (its metadata read or formatted); returns
/// once it has, with the thread, or with the error that stopped it (the
/// thread joined). `what` names the target in errors.
pub(crate) fn start_worker(
    thread: &str,
    what: &str,
    run: impl FnOnce(std::sync::mpsc::Sender<Result<(), udm_core::Error>>) + Send + 'static,
) -> Result<std::thread::JoinHandle<()>, udm_core::Error> {
    use udm_core::{Error, ErrorKind};
    let (tx, rx) = std::sync::mpsc::channel();
    let join = std::thread::Builder::new()
        .name(thread.into())
        .spawn(move || run(tx))
        .map_err(|e| Error::os(format!("{what}: spawning the worker thread"), e))?;
    match rx.recv() {
        Ok(Ok(())) => Ok(join),
        loaded => {
            let _ = join.join();
            Err(match loaded {
                Ok(Err(e)) => e,
                _ => Error::new(
                    ErrorKind::Io,
                    format!("{what}: the worker thread died while loading"),
                ),
            })
        }
    }
}
