//! The metadata device as `udm_pdata`'s [`BlockIo`]: blocking reads and
//! writes of 4 KiB blocks, for the pool's worker thread. The I/O runs on a
//! reactor of its own, turned until each I/O completes (the worker waits
//! for its metadata, as dm's worker does).

use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;

use udm_core::{
    AlignedBuf, BioPtr, BlockDevice, Caps, Channel, Error, ErrorKind, Op, Reactor, ReactorConfig,
    Status, SECTOR_SHIFT,
};
use udm_pdata::block::{Block, BlockIo};
use udm_pdata::BLOCK_SIZE;

/// Sectors per metadata block.
const BLOCK_SECTORS: u64 = (BLOCK_SIZE >> SECTOR_SHIFT) as u64;

/// A metadata device opened on its own reactor.
pub(crate) struct MetaIo {
    name: String,
    reactor: Reactor,
    ch: Rc<dyn Channel>,
    nr_blocks: u64,
    flush: bool,
    /// Aligned bounce buffer (the device may want aligned memory).
    buf: AlignedBuf,
}

fn done_io(bio: BioPtr) {
    // SAFETY: private is the Rc<Cell> leaked in `MetaIo::io`, taken back once.
    let done = unsafe { Rc::from_raw(bio.private() as *const Cell<Option<Status>>) };
    done.set(Some(bio.status()));
}

impl MetaIo {
    /// Opens `dev` for the metadata (on the calling thread).
    pub fn open(dev: &Arc<dyn BlockDevice>) -> Result<MetaIo, Error> {
        let reactor = Reactor::new(ReactorConfig::default())
            .map_err(|e| Error::os("thin-pool: creating the metadata reactor", e))?;
        let ch = dev.clone().open(&reactor)?;
        Ok(MetaIo {
            name: dev.name().to_string(),
            reactor,
            ch,
            nr_blocks: dev.limits().sectors / BLOCK_SECTORS,
            flush: dev.caps().contains(Caps::FLUSH),
            buf: AlignedBuf::new(BLOCK_SIZE),
        })
    }

    fn io(&mut self, op: Op, nr: u64) -> Result<(), Error> {
        if op.has_data() && nr >= self.nr_blocks {
            return Err(Error::invalid(format!(
                "metadata device '{}': block {nr} is past its end ({} blocks)",
                self.name, self.nr_blocks
            )));
        }
        let done = Rc::new(Cell::new(None));
        let mut bio = self.reactor.alloc_bio();
        if op.has_data() {
            bio.op = op;
            bio.sector = nr * BLOCK_SECTORS;
            // SAFETY: `buf` is ours and outlives the I/O: this function
            // waits for it to complete before it returns.
            unsafe { bio.add_seg(self.buf.as_mut_ptr(), BLOCK_SIZE) };
        } else {
            bio.set_dataless(op, 0, 0);
        }
        bio.set_end_io(done_io, Rc::into_raw(done.clone()) as *mut ());
        self.ch.submit(bio);
        self.reactor.run_until(|| done.get().is_some());
        match done.get() {
            Some(Status::Ok) => Ok(()),
            s => Err(Error::new(
                ErrorKind::Io,
                format!(
                    "metadata device '{}': {} of block {nr} failed: {}",
                    self.name,
                    op.name(),
                    s.unwrap_or(Status::IoErr)
                ),
            )),
        }
    }
}

impl BlockIo for MetaIo {
    fn read(&mut self, nr: u64, buf: &mut Block) -> Result<(), Error> {
        self.io(Op::Read, nr)?;
        buf.copy_from_slice(&self.buf[..BLOCK_SIZE]);
        Ok(())
    }

    fn write(&mut self, nr: u64, buf: &Block) -> Result<(), Error> {
        self.buf[..BLOCK_SIZE].copy_from_slice(buf);
        self.io(Op::Write, nr)
    }

    fn flush(&mut self) -> Result<(), Error> {
        if self.flush {
            self.io(Op::Flush, 0)
        } else {
            Ok(())
        }
    }

    fn nr_blocks(&self) -> u64 {
        self.nr_blocks
    }
}
