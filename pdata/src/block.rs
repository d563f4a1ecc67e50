//! Metadata blocks by number: the [`BlockIo`] trait a metadata device is
//! read and written through, over a file ([`FileIo`]) or memory ([`MemIo`]),
//! and a small cache of validated blocks ([`BlockCache`]).

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};

use udm_core::Error;

use crate::checksum::{self, BlockKind};
use crate::{corrupt, Result, BLOCK_SIZE};

/// One metadata block's bytes.
pub type Block = [u8; BLOCK_SIZE];

/// A zeroed block on the heap.
pub fn zeroed() -> Box<Block> {
    Box::new([0u8; BLOCK_SIZE])
}

/// A metadata device, read and written in [`BLOCK_SIZE`] blocks.
///
/// Writes need not be durable before [`BlockIo::flush`] returns: the
/// transaction manager flushes between a transaction's blocks and the
/// superblock that points at them, and after the superblock.
pub trait BlockIo {
    /// Reads block `nr` into `buf`.
    fn read(&mut self, nr: u64, buf: &mut Block) -> Result<()>;
    /// Writes `buf` to block `nr`.
    fn write(&mut self, nr: u64, buf: &Block) -> Result<()>;
    /// Makes every completed write durable.
    fn flush(&mut self) -> Result<()>;
    /// The device's size in blocks.
    fn nr_blocks(&self) -> u64;
    /// Looks at the device's size again (it may have grown); returns it.
    fn refresh_size(&mut self) -> Result<u64> {
        Ok(self.nr_blocks())
    }
}

/// A metadata device over a file (or a block device opened as one).
pub struct FileIo {
    file: File,
    nr_blocks: u64,
}

impl FileIo {
    /// Uses `file`, whose size gives the number of blocks (a partial last
    /// block is not used).
    pub fn new(file: File) -> Result<FileIo> {
        let nr_blocks = Self::size(&file)?;
        Ok(FileIo { file, nr_blocks })
    }

    fn size(file: &File) -> Result<u64> {
        let len = file
            .metadata()
            .map_err(|e| Error::os("metadata file size", e))?
            .len();
        // A block device reports 0 as its file length: seek to the end.
        let len = if len == 0 {
            use std::io::{Seek, SeekFrom};
            let mut f = file;
            f.seek(SeekFrom::End(0))
                .map_err(|e| Error::os("metadata device size", e))?
        } else {
            len
        };
        Ok(len / BLOCK_SIZE as u64)
    }
}

impl BlockIo for FileIo {
    fn read(&mut self, nr: u64, buf: &mut Block) -> Result<()> {
        self.file
            .read_exact_at(buf, nr * BLOCK_SIZE as u64)
            .map_err(|e| Error::os(format!("reading metadata block {nr}"), e))
    }
    fn write(&mut self, nr: u64, buf: &Block) -> Result<()> {
        self.file
            .write_all_at(buf, nr * BLOCK_SIZE as u64)
            .map_err(|e| Error::os(format!("writing metadata block {nr}"), e))
    }
    fn flush(&mut self) -> Result<()> {
        self.file
            .sync_data()
            .map_err(|e| Error::os("flushing the metadata device", e))
    }
    fn nr_blocks(&self) -> u64 {
        self.nr_blocks
    }
    fn refresh_size(&mut self) -> Result<u64> {
        self.nr_blocks = Self::size(&self.file)?;
        Ok(self.nr_blocks)
    }
}

/// What a [`MemIo`] holds: the durable blocks, and the writes since the
/// last flush, which a simulated power cut may drop.
#[derive(Default)]
pub struct MemState {
    /// Blocks as they would survive a power cut.
    pub durable: HashMap<u64, Box<Block>>,
    /// Writes not yet flushed, in order.
    pub pending: Vec<(u64, Box<Block>)>,
    /// When set, every I/O fails (the power is off).
    pub failed: bool,
    /// When set, the power goes off on the I/O (write or flush) after this
    /// many more, keeping the unflushed writes `keep_on_cut` selects.
    pub cut_after: Option<u64>,
    /// Which unflushed writes survive an automatic cut: bit `i` keeps the
    /// `i`th (a disk's cache writes back in any order; past 64, none).
    pub keep_on_cut: u64,
    /// Writes and flushes so far (each counts once, as `cut_after` does).
    pub ios: u64,
}

impl MemState {
    /// The power goes off: unflushed writes are lost but those `keep`
    /// selects (bit `i` for the `i`th, as a disk may have written any of
    /// its cache), and every later I/O fails until [`MemState::restore`].
    pub fn cut(&mut self, keep: u64) {
        let pending = std::mem::take(&mut self.pending);
        for (i, (nr, b)) in pending.into_iter().enumerate().take(64) {
            if keep >> i & 1 != 0 {
                self.durable.insert(nr, b);
            }
        }
        self.failed = true;
        self.cut_after = None;
    }
    /// Counts an I/O against [`MemState::cut_after`]; errs if the power is
    /// (or just went) off.
    fn tick(&mut self) -> Result<()> {
        self.ios += 1;
        if let Some(n) = self.cut_after {
            if n == 0 {
                let keep = self.keep_on_cut;
                self.cut(keep);
            } else {
                self.cut_after = Some(n - 1);
            }
        }
        if self.failed {
            return Err(power_off());
        }
        Ok(())
    }
    /// The power comes back.
    pub fn restore(&mut self) {
        self.failed = false;
    }
}

/// An in-memory metadata device for tests, with power cuts: clones share
/// the same blocks, so a test keeps one to cut the power under another.
#[derive(Clone)]
pub struct MemIo {
    state: Arc<Mutex<MemState>>,
    nr_blocks: u64,
}

impl MemIo {
    /// A zeroed device of `nr_blocks` blocks.
    pub fn new(nr_blocks: u64) -> MemIo {
        MemIo {
            state: Arc::new(Mutex::new(MemState::default())),
            nr_blocks,
        }
    }
    /// The same blocks, seen as a device of `nr_blocks` (a grown device).
    pub fn resized(&self, nr_blocks: u64) -> MemIo {
        MemIo {
            state: self.state.clone(),
            nr_blocks,
        }
    }
    /// The shared state, to cut the power or look at the blocks.
    pub fn state(&self) -> std::sync::MutexGuard<'_, MemState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
    /// The device's current contents (durable and pending writes) as one
    /// image, for handing to external tools.
    pub fn image(&self) -> Vec<u8> {
        let st = self.state();
        let mut out = vec![0u8; self.nr_blocks as usize * BLOCK_SIZE];
        let blocks = st
            .durable
            .iter()
            .chain(st.pending.iter().map(|(n, b)| (n, b)));
        for (nr, b) in blocks {
            let off = *nr as usize * BLOCK_SIZE;
            if off < out.len() {
                out[off..off + BLOCK_SIZE].copy_from_slice(&b[..]);
            }
        }
        out
    }
}

/// The device of a cache whose device was taken away.
struct Detached;

impl BlockIo for Detached {
    fn read(&mut self, _: u64, _: &mut Block) -> Result<()> {
        Err(detached())
    }
    fn write(&mut self, _: u64, _: &Block) -> Result<()> {
        Err(detached())
    }
    fn flush(&mut self) -> Result<()> {
        Err(detached())
    }
    fn nr_blocks(&self) -> u64 {
        0
    }
}

fn detached() -> Error {
    Error::new(
        udm_core::ErrorKind::Io,
        "metadata device: closed after a failed reopen",
    )
}

fn power_off() -> Error {
    Error::new(udm_core::ErrorKind::Io, "metadata device: power is off")
}

impl BlockIo for MemIo {
    fn read(&mut self, nr: u64, buf: &mut Block) -> Result<()> {
        if nr >= self.nr_blocks {
            return Err(Error::new(
                udm_core::ErrorKind::Io,
                format!("metadata block {nr} is beyond the device"),
            ));
        }
        let st = self.state();
        if st.failed {
            return Err(power_off());
        }
        let found = st
            .pending
            .iter()
            .rev()
            .find(|(n, _)| *n == nr)
            .map(|(_, b)| b);
        match found.or_else(|| st.durable.get(&nr)) {
            Some(b) => buf.copy_from_slice(&b[..]),
            None => buf.fill(0),
        }
        Ok(())
    }
    fn write(&mut self, nr: u64, buf: &Block) -> Result<()> {
        if nr >= self.nr_blocks {
            return Err(Error::new(
                udm_core::ErrorKind::Io,
                format!("metadata block {nr} is beyond the device"),
            ));
        }
        let mut st = self.state();
        st.tick()?;
        st.pending.push((nr, Box::new(*buf)));
        Ok(())
    }
    fn flush(&mut self) -> Result<()> {
        let mut st = self.state();
        st.tick()?;
        let pending = std::mem::take(&mut st.pending);
        for (nr, b) in pending {
            st.durable.insert(nr, b);
        }
        Ok(())
    }
    fn nr_blocks(&self) -> u64 {
        self.nr_blocks
    }
}

/// Validated blocks by number, shared without copying. When full, a
/// CLOCK sweep evicts a block not used since the hand last passed it, so
/// the upper levels of the trees, read on every lookup, stay.
pub struct BlockCache {
    io: Box<dyn BlockIo>,
    blocks: Clock,
}

/// The cache's slots and their CLOCK state.
struct Clock {
    index: HashMap<u64, usize>,
    /// (block number, block, used since the hand passed).
    slots: Vec<(u64, Arc<Block>, bool)>,
    hand: usize,
    capacity: usize,
}

impl Clock {
    fn get(&mut self, nr: u64) -> Option<&Arc<Block>> {
        let &i = self.index.get(&nr)?;
        let slot = &mut self.slots[i];
        slot.2 = true;
        Some(&slot.1)
    }

    fn insert(&mut self, nr: u64, b: Arc<Block>) {
        if let Some(&i) = self.index.get(&nr) {
            self.slots[i] = (nr, b, true);
            return;
        }
        if self.slots.len() < self.capacity {
            self.index.insert(nr, self.slots.len());
            self.slots.push((nr, b, false));
            return;
        }
        loop {
            let i = self.hand;
            self.hand = (self.hand + 1) % self.slots.len();
            let slot = &mut self.slots[i];
            if std::mem::take(&mut slot.2) {
                continue;
            }
            self.index.remove(&slot.0);
            *slot = (nr, b, false);
            self.index.insert(nr, i);
            return;
        }
    }

    fn clear(&mut self) {
        self.index.clear();
        self.slots.clear();
        self.hand = 0;
    }
}

impl BlockCache {
    /// A cache of up to `capacity` blocks over `io`.
    pub fn new(io: Box<dyn BlockIo>, capacity: usize) -> BlockCache {
        BlockCache {
            io,
            blocks: Clock {
                index: HashMap::new(),
                slots: Vec::new(),
                hand: 0,
                capacity: capacity.max(1),
            },
        }
    }

    /// Block `nr`, checked to be a `kind` block that knows it lives at
    /// `nr` (dm's validators: checksum, then location).
    pub fn read(&mut self, nr: u64, kind: BlockKind) -> Result<Arc<Block>> {
        if let Some(b) = self.blocks.get(nr) {
            return Ok(b.clone());
        }
        if nr >= self.io.nr_blocks() {
            return Err(corrupt(nr, "beyond the end of the metadata device"));
        }
        let mut buf = zeroed();
        self.io.read(nr, &mut buf)?;
        if !checksum::verify(&buf, kind) {
            return Err(corrupt(nr, format!("bad {kind:?} checksum")));
        }
        let at = u64::from_le_bytes(buf[8..16].try_into().unwrap_or_default());
        if at != nr {
            return Err(corrupt(nr, format!("{kind:?} says it is block {at}")));
        }
        let b: Arc<Block> = Arc::from(buf);
        self.blocks.insert(nr, b.clone());
        Ok(b)
    }

    /// Block `nr` as it is on the device, unchecked (the superblock of a
    /// device that may be blank).
    pub fn read_raw(&mut self, nr: u64) -> Result<Box<Block>> {
        let mut buf = zeroed();
        self.io.read(nr, &mut buf)?;
        Ok(buf)
    }

    /// Writes `block` to `nr` after setting its location and checksum for
    /// `kind`, and keeps it cached.
    pub fn write(&mut self, nr: u64, kind: BlockKind, block: &Block) -> Result<()> {
        let mut b = Box::new(*block);
        b[8..16].copy_from_slice(&nr.to_le_bytes());
        checksum::seal(&mut b, kind);
        self.io.write(nr, &b)?;
        self.blocks.insert(nr, Arc::from(b));
        Ok(())
    }

    /// Flushes the device.
    pub fn flush(&mut self) -> Result<()> {
        self.io.flush()
    }

    /// Forgets every cached block (after an abort, or an error mid-commit).
    pub fn clear(&mut self) {
        self.blocks.clear();
    }

    /// The device's size in blocks.
    pub fn nr_blocks(&self) -> u64 {
        self.io.nr_blocks()
    }

    /// Looks at the device's size again; returns it.
    pub fn refresh_size(&mut self) -> Result<u64> {
        self.io.refresh_size()
    }

    /// Gives back the device.
    pub fn into_io(self) -> Box<dyn BlockIo> {
        self.io
    }

    /// Takes the device out, leaving one whose every I/O fails (to reopen
    /// the device from its last commit).
    pub fn take_io(&mut self) -> Box<dyn BlockIo> {
        self.blocks.clear();
        std::mem::replace(&mut self.io, Box::new(Detached))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_io_loses_unflushed_writes_at_a_cut() {
        let mut io = MemIo::new(4);
        let one = [1u8; BLOCK_SIZE];
        let two = [2u8; BLOCK_SIZE];
        io.write(1, &one).unwrap();
        io.flush().unwrap();
        io.write(2, &two).unwrap();
        io.state().cut(0);
        assert!(io.read(1, &mut [0; BLOCK_SIZE]).is_err());
        io.state().restore();
        let mut b = [9u8; BLOCK_SIZE];
        io.read(1, &mut b).unwrap();
        assert_eq!(b, one);
        io.read(2, &mut b).unwrap();
        assert_eq!(b, [0; BLOCK_SIZE]);
    }

    #[test]
    fn the_cache_refuses_a_block_that_fails_its_checksum_or_location() {
        let io = MemIo::new(4);
        let mut c = BlockCache::new(Box::new(io.clone()), 8);
        c.write(2, BlockKind::Node, &[5u8; BLOCK_SIZE]).unwrap();
        c.clear();
        assert!(c.read(2, BlockKind::Node).is_ok());
        c.clear();
        assert!(c.read(2, BlockKind::Bitmap).is_err());
        // A valid node copied to another place fails its location check.
        let mut raw = c.read_raw(2).unwrap();
        let mut io2 = io.clone();
        io2.write(3, &raw).unwrap();
        assert!(c
            .read(3, BlockKind::Node)
            .unwrap_err()
            .to_string()
            .contains("says it is block 2"));
        raw[50] ^= 1;
        io2.write(3, &raw).unwrap();
        c.clear();
        assert!(c
            .read(3, BlockKind::Node)
            .unwrap_err()
            .to_string()
            .contains("checksum"));
    }

    #[test]
    fn the_cache_evicts_a_block_unused_since_the_clock_hand_passed() {
        let mut io = MemIo::new(4);
        let mut c = BlockCache::new(Box::new(io.clone()), 2);
        for nr in 1..4 {
            c.write(nr, BlockKind::Node, &[nr as u8; BLOCK_SIZE])
                .unwrap();
        }
        c.clear();
        c.read(1, BlockKind::Node).unwrap();
        c.read(2, BlockKind::Node).unwrap();
        // 1 is used again, so 3 evicts 2.
        c.read(1, BlockKind::Node).unwrap();
        c.read(3, BlockKind::Node).unwrap();
        // Blank the device: what is still cached reads, what was evicted fails.
        for nr in 1..4 {
            io.write(nr, &[0; BLOCK_SIZE]).unwrap();
        }
        assert!(c.read(1, BlockKind::Node).is_ok());
        assert!(c.read(3, BlockKind::Node).is_ok());
        assert!(c.read(2, BlockKind::Node).is_err());
    }
}
