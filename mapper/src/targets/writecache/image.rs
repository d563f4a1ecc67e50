//! The metadata image: the entry array as it is to be on disk, in memory,
//! and how a commit writes it without copying it.
//!
//! A commit must write its metadata blocks as they were when it started
//! (its generation's snapshot), while writers go on changing entries. It
//! used to copy its dirty blocks into a staging area under the lock (a
//! megabyte per autocommit at 512-byte blocks). Now it *holds* them
//! instead ([`Image::hold`]) and writes them from the image itself: a
//! writer that changes a held block first copies it aside and writes the
//! copy ([`Image::block_mut`], copy-on-write, one 4 KiB copy at most per
//! held block), and [`Image::release`], once the commit's writes are done,
//! copies such blocks back. A commit holds the lock only to mark its
//! blocks, and a writer pays for a copy only when it races a commit on the
//! same metadata block: new runs are allocated past the blocks a commit
//! holds, so at most the boundary block is copied.
//!
//! The image is aligned ([`AlignedBuf`]), so its blocks go to an O_DIRECT
//! cache device as they are.

use udm_core::AlignedBuf;

use super::meta::{DiskEntry, ENTRIES_PER_MBLOCK, ENTRY_BYTES, MBLOCK_BYTES};

/// Bytes per entry.
pub(crate) const EB: usize = ENTRY_BYTES as usize;

/// A metadata block writers write in place.
const OPEN: u32 = u32::MAX;
/// A metadata block a commit's write reads: writers copy it first.
const HELD: u32 = u32::MAX - 1;

/// Most copies kept for reuse (256 KiB).
const MAX_SPARE: usize = 64;

/// The entry array, [`MBLOCK_BYTES`] per metadata block.
pub(crate) struct Image {
    buf: AlignedBuf,
    /// Per metadata block: [`OPEN`], [`HELD`], or the index in `copies` of
    /// the copy writers use while the commit holds the block.
    cow: Vec<u32>,
    copies: Vec<AlignedBuf>,
    /// Copies handed back by `release`, kept for the next commit's races.
    spare: Vec<AlignedBuf>,
    /// Held blocks, as runs (first, count).
    held: Vec<(u32, u32)>,
}

impl Image {
    /// An image of `mblocks` metadata blocks of free entries (zeroes),
    /// every page written now: the data path must not fault them in under
    /// the lock.
    pub fn new(mblocks: usize) -> Image {
        let mut buf = AlignedBuf::new(mblocks * MBLOCK_BYTES);
        for page in buf.chunks_mut(4096) {
            page[0] = 0;
        }
        std::hint::black_box(&mut buf);
        Image {
            buf,
            cow: vec![OPEN; mblocks],
            copies: Vec::new(),
            spare: Vec::new(),
            held: Vec::new(),
        }
    }

    /// Metadata block `m` as it is now, for reading.
    pub fn block(&self, m: usize) -> &[u8] {
        match self.cow[m] {
            OPEN | HELD => &self.buf[m * MBLOCK_BYTES..(m + 1) * MBLOCK_BYTES],
            i => &self.copies[i as usize],
        }
    }

    /// Metadata block `m`, for writing: the image's own bytes, or, while a
    /// commit holds it, a copy that `release` brings back.
    #[inline]
    pub fn block_mut(&mut self, m: usize) -> &mut [u8] {
        match self.cow[m] {
            OPEN => {
                // Only this block's bytes are borrowed: a commit's write may
                // be reading other (held) blocks of the buffer meanwhile.
                // SAFETY: `m` is a block of the buffer (`cow[m]` exists), so
                // the range lies inside it; it is not held, so no commit
                // reads it, and `&mut self` makes this the only borrow.
                unsafe {
                    std::slice::from_raw_parts_mut(
                        self.buf.as_mut_ptr().add(m * MBLOCK_BYTES),
                        MBLOCK_BYTES,
                    )
                }
            }
            HELD => self.copy_aside(m),
            i => &mut self.copies[i as usize],
        }
    }

    /// A writer races the commit holding block `m`: it gets a copy.
    #[cold]
    fn copy_aside(&mut self, m: usize) -> &mut [u8] {
        let mut c = self
            .spare
            .pop()
            .unwrap_or_else(|| AlignedBuf::new(MBLOCK_BYTES));
        // Reading a held block is fine: the commit's write only reads it.
        c.copy_from_slice(&self.buf[m * MBLOCK_BYTES..(m + 1) * MBLOCK_BYTES]);
        self.cow[m] = self.copies.len() as u32;
        self.copies.push(c);
        let i = self.copies.len() - 1;
        &mut self.copies[i]
    }

    /// Block `b`'s entry.
    pub fn entry(&self, b: usize) -> &[u8] {
        let o = b % ENTRIES_PER_MBLOCK * EB;
        &self.block(b / ENTRIES_PER_MBLOCK)[o..o + EB]
    }

    /// Sets block `b`'s entry.
    #[inline]
    pub fn set(&mut self, b: usize, e: DiskEntry) {
        let o = b % ENTRIES_PER_MBLOCK * EB;
        e.encode(&mut self.block_mut(b / ENTRIES_PER_MBLOCK)[o..o + EB]);
    }

    /// The entries of blocks `b..b + n`, one slice per metadata block they
    /// touch, with the first block's number: for loops that write a run.
    pub fn for_each_run(&mut self, b: usize, n: usize, mut f: impl FnMut(usize, &mut [[u8; EB]])) {
        let (mut b, end) = (b, b + n);
        while b < end {
            let m = b / ENTRIES_PER_MBLOCK;
            let stop = end.min((m + 1) * ENTRIES_PER_MBLOCK);
            let o = b % ENTRIES_PER_MBLOCK * EB;
            let (entries, _) = self.block_mut(m)[o..o + (stop - b) * EB].as_chunks_mut::<EB>();
            f(b, entries);
            b = stop;
        }
    }

    /// Holds metadata blocks `m0..m1` for a commit's write, and returns
    /// their bytes' address: valid, and unchanged by anyone, until
    /// [`Image::release`]. Blocks already copied aside are not held (one
    /// commit at a time releases before the next holds).
    pub fn hold(&mut self, m0: usize, m1: usize) -> *const u8 {
        // A block held twice, or held while a copy of it is in use, would
        // lose the copy's changes at `release`: checked always (it is a
        // few bytes under the lock, once per commit).
        assert!(
            self.cow[m0..m1].iter().all(|&c| c == OPEN),
            "writecache: a metadata block held twice"
        );
        self.cow[m0..m1].fill(HELD);
        self.held.push((m0 as u32, (m1 - m0) as u32));
        // SAFETY: `m0..m1` are blocks of the buffer (`cow` has one entry
        // per block, indexed above), so the offset is inside it.
        unsafe { self.buf.as_ptr().add(m0 * MBLOCK_BYTES) }
    }

    /// The commit's writes are done: held blocks open again, and blocks
    /// written meanwhile come back from their copies.
    pub fn release(&mut self) {
        for (m0, n) in std::mem::take(&mut self.held) {
            for m in m0 as usize..(m0 + n) as usize {
                let c = std::mem::replace(&mut self.cow[m], OPEN);
                if c != HELD {
                    let i = c as usize;
                    // Open again: `block_mut` gives the image's own bytes.
                    let copy = std::mem::take(&mut self.copies[i]);
                    self.block_mut(m).copy_from_slice(&copy);
                    self.copies[i] = copy;
                }
            }
        }
        // Kept for the next commit's races, up to a bound: random writes
        // racing a large commit can copy many blocks once.
        self.copies
            .truncate(MAX_SPARE.saturating_sub(self.spare.len()));
        self.spare.append(&mut self.copies);
    }

    /// Whether a commit holds blocks now.
    #[cfg(test)]
    pub fn is_held(&self) -> bool {
        !self.held.is_empty()
    }
}

impl Drop for Image {
    /// Memory a commit's write may still read is never freed: the worker
    /// drains its I/O before the state goes, so this is a last resort.
    fn drop(&mut self) {
        if !self.held.is_empty() {
            std::mem::forget(std::mem::take(&mut self.buf));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(sector: u64, seq: u64) -> DiskEntry {
        DiskEntry { sector, seq }
    }

    #[test]
    fn a_commit_writes_the_blocks_as_they_were_when_it_held_them() {
        let mut im = Image::new(4);
        im.set(3, e(8, 1));
        im.set(ENTRIES_PER_MBLOCK + 1, e(16, 1));
        let p = im.hold(0, 2);
        assert_eq!(p as usize % AlignedBuf::ALIGN, 0, "aligned for O_DIRECT");
        // Writers change held blocks and an open one meanwhile.
        im.set(3, e(24, 2));
        im.for_each_run(5, ENTRIES_PER_MBLOCK, |_, out| out.fill([0xee; EB]));
        im.set(ENTRIES_PER_MBLOCK + 1, DiskEntry::FREE);
        im.set(2 * ENTRIES_PER_MBLOCK, e(32, 2));
        // SAFETY: held blocks 0..2 stay valid and unchanged until release.
        let written = unsafe { std::slice::from_raw_parts(p, 2 * MBLOCK_BYTES) };
        assert_eq!(DiskEntry::decode(&written[3 * EB..]), e(8, 1));
        assert_eq!(
            DiskEntry::decode(&written[(ENTRIES_PER_MBLOCK + 1) * EB..]),
            e(16, 1)
        );
        assert_eq!(written[5 * EB], 0);
        // Readers see the new entries at once...
        assert_eq!(DiskEntry::decode(im.entry(3)), e(24, 2));
        assert_eq!(im.entry(6), &[0xee; EB]);
        // ...and so does the image once the commit is done.
        im.release();
        assert!(!im.is_held());
        assert_eq!(DiskEntry::decode(im.entry(3)), e(24, 2));
        assert_eq!(
            DiskEntry::decode(im.entry(ENTRIES_PER_MBLOCK + 1)),
            DiskEntry::FREE
        );
        assert_eq!(im.entry(ENTRIES_PER_MBLOCK + 4), &[0xee; EB]);
        assert_eq!(im.entry(ENTRIES_PER_MBLOCK + 5), &[0; EB]);
        assert_eq!(
            DiskEntry::decode(im.entry(2 * ENTRIES_PER_MBLOCK)),
            e(32, 2)
        );
        // The copies are kept for the next race; blocks hold again.
        assert_eq!(im.spare.len(), 2);
        im.hold(0, 4);
        im.set(0, e(40, 3));
        assert_eq!(im.spare.len(), 1);
        im.release();
        assert_eq!(DiskEntry::decode(im.entry(0)), e(40, 3));
    }

    #[test]
    fn runs_are_split_at_metadata_block_boundaries() {
        let mut im = Image::new(3);
        let mut seen = Vec::new();
        im.for_each_run(ENTRIES_PER_MBLOCK - 2, ENTRIES_PER_MBLOCK + 4, |b, out| {
            seen.push((b, out.len()))
        });
        assert_eq!(
            seen,
            [
                (ENTRIES_PER_MBLOCK - 2, 2),
                (ENTRIES_PER_MBLOCK, ENTRIES_PER_MBLOCK),
                (2 * ENTRIES_PER_MBLOCK, 2)
            ]
        );
    }
}
