//! Block status (what a range holds: data, zeroes, holes) through the
//! mapper: a RAM disk's never-written pages are holes, `zero` is a hole,
//! `error` is data, linear and striped pass their devices' answers through
//! (striped chunk by chunk), and the mapped device merges neighbours of one
//! kind across target boundaries and bounds the work of one call.

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

mod common;

use std::any::Any;
use std::rc::Rc;
use std::sync::Arc;

use common::{as_dev, pattern, Devices, Tester};
use udm_core::{
    push_extent, Alloc, BlockDevice, Caps, Channel, Error, Extent, Limits, Reactor,
    BLOCK_STATUS_MAX_EXTENTS,
};

use Alloc::{Data, Hole, Zero};

/// The extents `dev` reports for the whole of `sector..sector + sectors`,
/// asking again from where each answer stopped (as an NBD client does),
/// merged: (sectors, kind) pairs.
fn map(dev: &Arc<dyn BlockDevice>, sector: u64, sectors: u64) -> Vec<(u64, Alloc)> {
    let mut all = Vec::new();
    let mut pos = sector;
    let end = sector + sectors;
    while pos < end {
        let mut out = Vec::new();
        dev.block_status(pos, end - pos, &mut out).unwrap();
        let got: u64 = out.iter().map(|e| e.sectors).sum();
        assert!(got > 0, "an answer covers a non-empty prefix (at {pos})");
        assert!(got <= end - pos, "an answer stays inside the range");
        assert!(out.len() <= 2 * BLOCK_STATUS_MAX_EXTENTS, "bounded reply");
        for e in out {
            push_extent(&mut all, e);
        }
        pos += got;
    }
    all.iter().map(|e| (e.sectors, e.alloc)).collect()
}

/// A device that reports a fixed pattern: `kinds[i]` for sectors
/// `i * unit..(i + 1) * unit`, repeated over its size.
struct Scripted {
    name: String,
    sectors: u64,
    unit: u64,
    kinds: Vec<Alloc>,
}

impl BlockDevice for Scripted {
    fn name(&self) -> &str {
        &self.name
    }
    fn limits(&self) -> Limits {
        Limits::new(self.sectors)
    }
    fn caps(&self) -> Caps {
        Caps::NONE
    }
    fn open(self: Arc<Self>, _r: &Reactor) -> Result<Rc<dyn Channel>, Error> {
        Err(Error::invalid("scripted: no I/O"))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn block_status(&self, sector: u64, sectors: u64, out: &mut Vec<Extent>) -> Result<(), Error> {
        assert!(sector + sectors <= self.sectors, "asked inside the device");
        let mut pos = sector;
        while pos < sector + sectors {
            let unit_end = (pos / self.unit + 1) * self.unit;
            let n = unit_end.min(sector + sectors) - pos;
            let alloc = self.kinds[(pos / self.unit) as usize % self.kinds.len()];
            push_extent(out, Extent { sectors: n, alloc });
            pos += n;
        }
        Ok(())
    }
}

fn scripted(devs: &mut Devices, name: &str, sectors: u64, unit: u64, kinds: &[Alloc]) {
    devs.add(Arc::new(Scripted {
        name: name.into(),
        sectors,
        unit,
        kinds: kinds.to_vec(),
    }));
}

/// A RAM disk reports pages it never wrote as holes and written pages as
/// data, at page (8-sector) granularity: a one-sector write makes its page
/// data; a discard makes the pages it covers whole holes again (their
/// memory goes back to the kernel) and leaves partial pages data, zeroed;
/// write-zeroes keeps pages data.
#[test]
fn ram_reports_never_written_pages_as_holes() {
    let mut devs = Devices::new();
    let ram = devs.ram("ram0", 1024);
    let t = Tester::new();
    assert_eq!(map(&ram, 0, 1024), vec![(1024, Hole)]);

    t.write(&ram, 16, pattern(1, 16, 16)); // pages 2 and 3
    t.write(&ram, 100, pattern(2, 100, 1)); // page 12 only
    t.write(&ram, 1016, pattern(3, 1016, 8)); // the last page
    assert_eq!(
        map(&ram, 0, 1024),
        vec![
            (16, Hole),
            (16, Data),
            (64, Hole),
            (8, Data),
            (912, Hole),
            (8, Data)
        ]
    );
    // A range starting and ending inside pages is cut to it.
    assert_eq!(map(&ram, 20, 84), vec![(12, Data), (64, Hole), (8, Data)]);
    assert_eq!(map(&ram, 101, 2), vec![(2, Data)]);
    let ok = |r: common::Req| assert_eq!(t.run(&ram, r).status, udm_core::Status::Ok);
    // Sectors 20..32: page 2 in part (stays data), page 3 whole (a hole).
    ok(common::Req::discard(20, 12));
    assert_eq!(map(&ram, 0, 40), vec![(16, Hole), (8, Data), (16, Hole)]);
    assert!(t.read(&ram, 16, 16)[..4 * 512] == pattern(1, 16, 4)[..]);
    assert!(t.read(&ram, 20, 12).iter().all(|&b| b == 0));
    ok(common::Req::write_zeroes(96, 8));
    assert_eq!(
        map(&ram, 96, 8),
        vec![(8, Data)],
        "write-zeroes keeps page 12"
    );
    // The whole device: every page a hole again.
    ok(common::Req::discard(0, 1024));
    assert_eq!(map(&ram, 0, 1024), vec![(1024, Hole)]);
    assert!(t.read(&ram, 0, 1024).iter().all(|&b| b == 0));
}

/// A RAM disk of alternating written and unwritten pages answers at most
/// BLOCK_STATUS_MAX_EXTENTS extents a call; asking again gets the rest.
#[test]
fn ram_bounds_the_extents_of_one_answer() {
    let mut devs = Devices::new();
    let pages = 3 * BLOCK_STATUS_MAX_EXTENTS as u64;
    let ram = devs.ram("ram0", pages * 8);
    let t = Tester::new();
    for p in (0..pages).step_by(2) {
        t.write(&ram, p * 8, pattern(p, p * 8, 1));
    }
    let mut out = Vec::new();
    ram.block_status(0, pages * 8, &mut out).unwrap();
    assert_eq!(out.len(), BLOCK_STATUS_MAX_EXTENTS);
    assert_eq!(
        out.iter().map(|e| e.sectors).sum::<u64>(),
        out.len() as u64 * 8
    );
    let all = map(&ram, 0, pages * 8);
    assert_eq!(all.len(), pages as usize);
    assert!(all
        .iter()
        .enumerate()
        .all(|(i, &e)| e == (8, if i % 2 == 0 { Data } else { Hole })));
}

/// `zero` is a hole, `error` is data (its reads fail: a client must not
/// skip it as zeroes), and a range outside the device is an error.
#[test]
fn zero_is_a_hole_and_error_is_data() {
    let devs = Devices::new();
    let dev = as_dev(&devs.mapped("m", "0 64 zero; 64 32 error; 96 64 zero"));
    assert_eq!(map(&dev, 0, 160), vec![(64, Hole), (32, Data), (64, Hole)]);
    assert_eq!(map(&dev, 70, 40), vec![(26, Data), (14, Hole)]);
    let mut out = Vec::new();
    assert!(dev.block_status(100, 61, &mut out).is_err(), "past the end");
    assert!(dev.block_status(u64::MAX, 2, &mut out).is_err(), "overflow");
    assert!(dev.block_status(0, 0, &mut out).is_err(), "empty range");
    assert!(out.is_empty());
}

/// Linear passes its device's answer through at its offset; extents of one
/// kind merge across target boundaries (a hole in ram0 next to `zero`).
#[test]
fn linear_passes_through_and_neighbours_merge() {
    let mut devs = Devices::new();
    let ram = devs.ram("ram0", 256);
    let t = Tester::new();
    t.write(&ram, 64, pattern(1, 64, 32)); // ram0 64..96 data
    let dev = as_dev(&devs.mapped("m", "0 32 zero; 32 100 linear ram0 40; 132 8 zero"));
    // linear's 0..24 is ram0 40..64 (hole), merged with the zero before it.
    assert_eq!(map(&dev, 0, 140), vec![(56, Hole), (32, Data), (52, Hole)]);
}

/// Striped asks each chunk of its device and stripe; chunks of one kind
/// merge. Stripe 0 is all data, stripe 1 alternates zero and hole per
/// 8-sector unit; the chunk is 16 sectors, so the target reads data (16),
/// zero (8), hole (8), data (16), ... and a range can start mid-chunk.
#[test]
fn striped_reports_chunk_by_chunk() {
    let mut devs = Devices::new();
    scripted(&mut devs, "s0", 1024, 8, &[Data]);
    scripted(&mut devs, "s1", 1024, 8, &[Zero, Hole]);
    let dev = as_dev(&devs.mapped("m", "0 256 striped 2 16 s0 0 s1 0"));
    let want: Vec<(u64, Alloc)> = (0..8)
        .flat_map(|_| [(16, Data), (8, Zero), (8, Hole)])
        .collect();
    assert_eq!(map(&dev, 0, 256), want);
    assert_eq!(
        map(&dev, 20, 30),
        vec![(4, Zero), (8, Hole), (16, Data), (2, Zero)]
    );
}

/// A device answering a prefix stops the table's walk there: later targets
/// are not asked, and the caller asks again.
#[test]
fn a_prefix_from_a_target_ends_the_answer() {
    let mut devs = Devices::new();
    let pages = 2 * BLOCK_STATUS_MAX_EXTENTS as u64;
    let ram = devs.ram("ram0", pages * 8);
    let t = Tester::new();
    for p in (0..pages).step_by(2) {
        t.write(&ram, p * 8, pattern(p, p * 8, 1));
    }
    let dev = as_dev(&devs.mapped(
        "m",
        &format!("0 {} linear ram0 0; {} 8 zero", pages * 8, pages * 8),
    ));
    let mut out = Vec::new();
    dev.block_status(0, pages * 8 + 8, &mut out).unwrap();
    let got: u64 = out.iter().map(|e| e.sectors).sum();
    assert_eq!(
        got,
        BLOCK_STATUS_MAX_EXTENTS as u64 * 8,
        "ram0's prefix only"
    );
    let all = map(&dev, 0, pages * 8 + 8);
    assert_eq!(
        all.last(),
        Some(&(16, Hole)),
        "the last hole page merges with zero"
    );
}
