//! The progress bar of a long message (writecache's `flush`), on a
//! terminal only.

use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Tells the drawer the message is done and waits for it.
pub fn finish_bar(done: &AtomicBool, drawer: Option<JoinHandle<()>>) {
    done.store(true, Ordering::Release);
    if let Some(b) = drawer {
        let _ = b.join();
    }
}

/// Draws `[####    ] pct%  N blocks dirty, M under writeback` on stderr
/// until `done`, from the status line `first_status` returns (`start len
/// type error blocks free writeback …`, a cache's), if the message runs
/// long enough to need one (200 ms).
pub fn progress(done: &AtomicBool, mut first_status: impl FnMut() -> Option<String>) {
    let mut start_used = None;
    let mut bar: Option<ProgressBar> = None;
    let mut waited = 0;
    while !done.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(50));
        waited += 1;
        if waited < 4 {
            continue; // a quick message needs no bar
        }
        let Some(first) = first_status() else { break };
        let f: Vec<u64> = first
            .split_whitespace()
            .skip(3)
            .filter_map(|x| x.parse().ok())
            .collect();
        if f.len() < 4 || f[1] == 0 {
            break;
        }
        let used = f[1].saturating_sub(f[2]);
        let start = *start_used.get_or_insert(used.max(1));
        let gone = start.saturating_sub(used);
        let b = bar.get_or_insert_with(|| {
            let b = ProgressBar::with_draw_target(Some(100), ProgressDrawTarget::stderr());
            if let Ok(s) = ProgressStyle::with_template("[{bar:40}] {percent:>3}%  {msg}") {
                b.set_style(s.progress_chars("## "));
            }
            b
        });
        b.set_message(format!("{used} blocks dirty, {} under writeback", f[3]));
        b.set_position((gone * 100 / start).min(100));
    }
    if let Some(b) = bar {
        b.set_message("done");
        b.set_position(100);
        b.finish();
    }
}
