//! Replaying a dm-log-writes log onto a device, as xfstests' `replay-log`
//! does: entries in order, each write's data at its sector, discards as
//! zeroes (so a replay is deterministic whatever the device does with a
//! discard), up to a count or a mark, with a hook at every flush.
//!
//! The I/O runs on a reactor of the calling thread, one request at a time:
//! replay is a tool, not a data path.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;

use udm_core::{
    AlignedBuf, BioPtr, BlockDevice, Caps, Channel, Error, ErrorKind, Op, Reactor, ReactorConfig,
    Status, SECTOR_SHIFT,
};

use super::format::{self, Entry, Super};

/// Where to stop.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Stop {
    /// At the end of the log (the super block's entry count).
    #[default]
    End,
    /// After this many entries.
    Limit(u64),
    /// After the mark entry with this name (an error if there is none).
    Mark(String),
}

/// A point the replay reached, as the check hook sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Point {
    /// Index of the entry just replayed (from 0).
    pub entry: u64,
    /// Its flags ([`format::FLUSH`], ...).
    pub flags: u64,
    /// The last mark replayed so far, if any.
    pub last_mark: Option<String>,
}

/// What a replay did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Entries replayed.
    pub entries: u64,
    /// Of which writes (with data).
    pub writes: u64,
    /// Of which discards.
    pub discards: u64,
    /// Of which flushes (entries with the flush flag).
    pub flushes: u64,
    /// Of which marks.
    pub marks: u64,
    /// The check hook's runs.
    pub checks: u64,
}

/// Reads a log's super block.
pub fn read_super(log: &Arc<dyn BlockDevice>) -> Result<Super, Error> {
    let io = SyncIo::new(log.clone(), None)?;
    let mut b = AlignedBuf::new(512.max(log.limits().logical_block_size as usize));
    io.rw(0, Op::Read, 0, &mut b)?;
    Super::decode(&b)
}

/// Replays `log` onto `target` until `stop`. After every entry with the
/// flush flag, the target is flushed and `check` runs; an error from it
/// ends the replay with that error.
pub fn replay(
    log: Arc<dyn BlockDevice>,
    target: Arc<dyn BlockDevice>,
    stop: &Stop,
    mut check: impl FnMut(&Point) -> Result<(), Error>,
) -> Result<Summary, Error> {
    let io = SyncIo::new(log.clone(), Some(target.clone()))?;
    let lbs = log.limits().logical_block_size.max(512) as usize;
    let mut sb = AlignedBuf::new(lbs);
    io.rw(0, Op::Read, 0, &mut sb)?;
    let sup = Super::decode(&sb)?;
    let bs = sup.sectorsize as u64;
    if (target.limits().logical_block_size as u64) > bs {
        return Err(Error::invalid(format!(
            "replay target '{}' has {}-byte blocks, larger than the log's {bs}",
            target.name(),
            target.limits().logical_block_size
        )));
    }
    let per = bs >> SECTOR_SHIFT;
    let log_sectors = log.limits().sectors;
    let tgt_blocks = target.limits().sectors / per;
    let mut pos = per; // entry 0 follows the super block
    let mut s = Summary::default();
    let mut last_mark: Option<String> = None;
    let mut head = AlignedBuf::new(bs as usize);
    let mut data = AlignedBuf::default();
    // Data is moved in chunks of at most this much.
    const CHUNK: u64 = 1 << 20;
    for i in 0..sup.nr_entries {
        if matches!(stop, Stop::Limit(n) if i >= *n) {
            return Ok(s);
        }
        let epos = pos;
        let at = |what: &str| format!("log entry {i} (log sector {epos}): {what}");
        if pos + per > log_sectors {
            return Err(corrupt(at("past the end of the log device")));
        }
        io.rw(0, Op::Read, pos, &mut head)?;
        let e = Entry::decode(&head);
        pos += per;
        if e.flags & format::MARK != 0 {
            let n = (e.data_len as usize).min(bs as usize - format::ENTRY_BYTES);
            let name = &head[format::ENTRY_BYTES..format::ENTRY_BYTES + n];
            let name = String::from_utf8_lossy(name).into_owned();
            s.marks += 1;
            s.entries += 1;
            let hit = matches!(stop, Stop::Mark(m) if *m == name);
            last_mark = Some(name);
            if hit {
                return Ok(s);
            }
            continue;
        }
        if e.sector
            .checked_add(e.nr_sectors)
            .is_none_or(|end| end > tgt_blocks)
        {
            return Err(corrupt(at(&format!(
                "blocks {}+{} lie outside the replay target ({tgt_blocks} blocks)",
                e.sector, e.nr_sectors
            ))));
        }
        // Data (or zeroes for a discard), in chunks.
        let mut done = 0;
        while done < e.nr_sectors {
            let n = (e.nr_sectors - done).min(CHUNK / bs);
            data.resize((n * bs) as usize);
            if e.flags & format::DISCARD != 0 {
                data.as_mut_slice().fill(0);
            } else {
                if pos + n * per > log_sectors {
                    return Err(corrupt(at("data past the end of the log device")));
                }
                io.rw(0, Op::Read, pos, &mut data)?;
                pos += n * per;
            }
            io.rw(1, Op::Write, (e.sector + done) * per, &mut data)?;
            done += n;
        }
        if e.nr_sectors > 0 {
            if e.flags & format::DISCARD != 0 {
                s.discards += 1;
            } else {
                s.writes += 1;
            }
        }
        s.entries += 1;
        if e.flags & format::FLUSH != 0 {
            s.flushes += 1;
            io.flush(1)?;
            check(&Point {
                entry: i,
                flags: e.flags,
                last_mark: last_mark.clone(),
            })?;
            s.checks += 1;
        }
    }
    if let Stop::Mark(m) = stop {
        return Err(Error::new(
            ErrorKind::NotFound,
            format!(
                "mark '{m}' not found in the log ({} entries)",
                sup.nr_entries
            ),
        ));
    }
    io.flush(1)?;
    Ok(s)
}

fn corrupt(m: String) -> Error {
    Error::new(ErrorKind::Invalid, m)
}

/// Synchronous I/O on up to two devices, through a reactor of this thread.
struct SyncIo {
    // Channels before the reactor: dropped first.
    chans: Vec<Rc<dyn Channel>>,
    /// Per device, whether it takes flushes.
    flushable: Vec<bool>,
    reactor: Reactor,
}

fn sync_done(bio: BioPtr) {
    // SAFETY: `rw` set private to a Cell on its stack and waits until this
    // end_io has run before that frame ends.
    let cell = unsafe { &*(bio.private() as *const Cell<Option<Status>>) };
    cell.set(Some(bio.status()));
}

impl SyncIo {
    fn new(a: Arc<dyn BlockDevice>, b: Option<Arc<dyn BlockDevice>>) -> Result<SyncIo, Error> {
        let reactor = Reactor::new(ReactorConfig::default())
            .map_err(|e| Error::os("replay: creating a reactor", e))?;
        let mut flushable = vec![a.caps().contains(Caps::FLUSH)];
        let mut chans = vec![a.open(&reactor)?];
        if let Some(b) = b {
            flushable.push(b.caps().contains(Caps::FLUSH));
            chans.push(b.open(&reactor)?);
        }
        Ok(SyncIo {
            chans,
            flushable,
            reactor,
        })
    }

    fn exec(&self, dev: usize, bio: BioPtr, cell: &Cell<Option<Status>>) -> Result<(), Error> {
        self.chans[dev].submit(bio);
        self.reactor.run_until(|| cell.get().is_some());
        match cell.get() {
            Some(Status::Ok) => Ok(()),
            s => Err(Error::new(
                ErrorKind::Io,
                format!("replay: I/O failed: {s:?}"),
            )),
        }
    }

    /// Reads or writes `buf` at `sector` of device `dev`.
    fn rw(&self, dev: usize, op: Op, sector: u64, buf: &mut AlignedBuf) -> Result<(), Error> {
        let cell: Cell<Option<Status>> = Cell::new(None);
        let mut bio = self.reactor.alloc_bio();
        bio.op = op;
        bio.sector = sector;
        // SAFETY: `buf` is borrowed mutably for this call, which waits for
        // the I/O to complete before returning.
        unsafe { bio.add_seg(buf.as_mut_ptr(), buf.len()) };
        bio.set_end_io(
            sync_done,
            (&cell as *const Cell<Option<Status>>).cast_mut().cast(),
        );
        self.exec(dev, bio, &cell).map_err(|e| {
            e.context(format!(
                "{} of {} bytes at sector {sector}",
                op.name(),
                buf.len()
            ))
        })
    }

    fn flush(&self, dev: usize) -> Result<(), Error> {
        if !self.flushable[dev] {
            return Ok(());
        }
        let cell: Cell<Option<Status>> = Cell::new(None);
        let mut bio = self.reactor.alloc_bio();
        bio.set_dataless(Op::Flush, 0, 0);
        bio.set_end_io(
            sync_done,
            (&cell as *const Cell<Option<Status>>).cast_mut().cast(),
        );
        self.exec(dev, bio, &cell).map_err(|e| e.context("flush"))
    }
}
