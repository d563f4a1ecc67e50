//! Property tests: a mapped device behaves exactly like a flat model.
//!
//! A random valid table (a mix of linear, striped, zero and error segments
//! over three ram devices of random sizes) is built, and so is its model:
//! for every sector of the mapped device, which (device, sector) backs it,
//! or that it reads as zeroes, or that it fails. Random streams of reads,
//! writes, discards, write-zeroes and flushes (random aligned offsets and
//! lengths, many crossing target and chunk boundaries, a few out of range,
//! split into several segments, some flagged PREFLUSH/FUA) go to the device
//! and to the model; every status and every byte read must match the model,
//! and at the end so must every byte of every ram device.
//!
//! Failing cases are persisted by proptest in `model.proptest-regressions`.

mod common;

use std::sync::Arc;

use common::{as_dev, assert_sectors_eq, pattern, Devices, Done, InFlight, Req, Tester, SECTOR};
use proptest::prelude::*;
use udm_core::{BioFlags, BlockDevice, Op, Status};

/// Ram devices per case.
const NDEVS: usize = 3;

/// One segment of a random table, before it is laid out on the devices.
#[derive(Clone, Debug)]
enum SegSpec {
    /// `len` sectors on device `dev`, `gap` sectors after the previous area there.
    Linear { dev: usize, gap: u64, len: u64 },
    /// One (device, gap) per stripe; `rows` chunks per stripe.
    Striped {
        stripes: Vec<(usize, u64)>,
        chunk: u64,
        rows: u64,
    },
    /// Reads zeroes, drops writes.
    Zero { len: u64 },
    /// Fails every I/O.
    Error { len: u64 },
}

/// What backs one sector of the mapped device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Back {
    Dev(usize, u64),
    Zero,
    Error,
}

/// A table spec laid out: its text, the device sizes it needs, and the model
/// of which sector is backed by what.
#[derive(Debug)]
struct Layout {
    text: String,
    dev_sectors: [u64; NDEVS],
    map: Vec<Back>,
}

/// Lays the segments out one after another in the mapped device, and each
/// device area after the previous one on its device (plus its gap), so that
/// no two mapped sectors share a device sector. Each device gets `slack`
/// unused sectors at its end.
fn layout(segs: &[SegSpec], slack: [u64; NDEVS]) -> Layout {
    let mut next = [0u64; NDEVS];
    let mut lines = Vec::new();
    let mut map = Vec::new();
    for seg in segs {
        let start = map.len() as u64;
        match seg {
            SegSpec::Linear { dev, gap, len } => {
                let off = next[*dev] + gap;
                next[*dev] = off + len;
                lines.push(format!("{start} {len} linear d{dev} {off}"));
                map.extend((0..*len).map(|i| Back::Dev(*dev, off + i)));
            }
            SegSpec::Striped {
                stripes,
                chunk,
                rows,
            } => {
                let n = stripes.len() as u64;
                let width = chunk * rows;
                let mut dests = Vec::new();
                let mut offs = Vec::new();
                for (dev, gap) in stripes {
                    let off = next[*dev] + gap;
                    next[*dev] = off + width;
                    dests.push(format!("d{dev} {off}"));
                    offs.push(off);
                }
                lines.push(format!(
                    "{start} {} striped {n} {chunk} {}",
                    n * width,
                    dests.join(" ")
                ));
                // dm's rule: chunk c on stripe c % n, row c / n.
                map.extend((0..n * width).map(|rel| {
                    let c = rel / chunk;
                    let stripe = (c % n) as usize;
                    Back::Dev(
                        stripes[stripe].0,
                        offs[stripe] + (c / n) * chunk + rel % chunk,
                    )
                }));
            }
            SegSpec::Zero { len } => {
                lines.push(format!("{start} {len} zero"));
                map.extend((0..*len).map(|_| Back::Zero));
            }
            SegSpec::Error { len } => {
                lines.push(format!("{start} {len} error"));
                map.extend((0..*len).map(|_| Back::Error));
            }
        }
    }
    let mut dev_sectors = [0; NDEVS];
    for d in 0..NDEVS {
        dev_sectors[d] = (next[d] + slack[d]).max(1);
    }
    Layout {
        text: lines.join("\n"),
        dev_sectors,
        map,
    }
}

fn seg_strategy() -> impl Strategy<Value = SegSpec> {
    let dev = 0..NDEVS;
    prop_oneof![
        4 => (dev.clone(), 0u64..6, 1u64..=40)
            .prop_map(|(dev, gap, len)| SegSpec::Linear { dev, gap, len }),
        4 => (
            prop::collection::vec((dev, 0u64..4), 1..=3),
            prop::sample::select(vec![1u64, 2, 3, 4, 5, 6, 8, 16]),
            1u64..=4,
        )
            .prop_map(|(stripes, chunk, rows)| SegSpec::Striped { stripes, chunk, rows }),
        1 => (1u64..=16).prop_map(|len| SegSpec::Zero { len }),
        1 => (1u64..=16).prop_map(|len| SegSpec::Error { len }),
    ]
}

fn layout_strategy() -> impl Strategy<Value = Layout> {
    (
        prop::collection::vec(seg_strategy(), 1..=6),
        [0u64..16, 0u64..16, 0u64..16],
    )
        .prop_map(|(segs, slack)| layout(&segs, slack))
}

/// One random I/O, relative to a device size not known yet.
#[derive(Clone, Debug)]
struct IoSpec {
    op: Op,
    /// Start = this modulo the device size.
    start: u64,
    /// Sectors (clamped to the device's end unless `oob`).
    len: u64,
    /// Whether the I/O may run past the end (then it is invalid).
    oob: bool,
    flags: BioFlags,
    segs: usize,
    tag: u64,
}

fn io_strategy() -> impl Strategy<Value = IoSpec> {
    let op = prop_oneof![
        4 => Just(Op::Read),
        4 => Just(Op::Write),
        1 => Just(Op::Discard),
        1 => Just(Op::WriteZeroes),
        1 => Just(Op::Flush),
    ];
    let flags = prop_oneof![
        6 => Just(BioFlags::NONE),
        1 => Just(BioFlags::FUA),
        1 => Just(BioFlags::PREFLUSH),
        1 => Just(BioFlags::PREFLUSH | BioFlags::FUA),
    ];
    let len = prop_oneof![3 => 1u64..=8, 2 => 1u64..=40];
    (
        op,
        any::<u64>(),
        len,
        prop::bool::weighted(0.05),
        flags,
        1usize..=4,
        any::<u64>(),
    )
        .prop_map(|(op, start, len, oob, flags, segs, tag)| IoSpec {
            op,
            start,
            len,
            oob,
            flags,
            segs,
            tag: tag | 1,
        })
}

impl IoSpec {
    /// The request for a device of `size` sectors.
    fn req(&self, size: u64) -> Req {
        let start = self.start % size;
        let len = if self.oob {
            self.len
        } else {
            self.len.min(size - start)
        };
        let req = match self.op {
            Op::Read => Req::read(start, len),
            Op::Write => Req::write(start, pattern(self.tag, start, len)).flags(self.flags),
            Op::Discard => Req::discard(start, len),
            Op::WriteZeroes => Req::write_zeroes(start, len),
            Op::Flush => Req::flush(),
        };
        req.segs(self.segs)
    }
}

/// The model: the mapping and the content of every ram device.
struct Model {
    map: Vec<Back>,
    devs: Vec<Vec<u8>>,
}

impl Model {
    fn new(l: &Layout) -> Model {
        Model {
            map: l.map.clone(),
            devs: l
                .dev_sectors
                .iter()
                .map(|&n| vec![0; n as usize * SECTOR])
                .collect(),
        }
    }

    fn size(&self) -> u64 {
        self.map.len() as u64
    }

    /// The sectors `req` covers, or None when it is out of range.
    fn range(&self, req: &Req) -> Option<std::ops::Range<u64>> {
        let end = req.sector.checked_add(req.sectors())?;
        (req.len > 0 && end <= self.size()).then_some(req.sector..end)
    }

    /// The status `req` must complete with.
    fn status(&self, req: &Req) -> Status {
        if req.op == Op::Flush {
            return Status::Ok;
        }
        match self.range(req) {
            None => Status::Inval,
            Some(r) if r.clone().any(|s| self.map[s as usize] == Back::Error) => Status::IoErr,
            Some(_) => Status::Ok,
        }
    }

    /// Applies what `req` does to the devices: every piece not on an error
    /// target is carried out, even when another piece fails.
    fn apply(&mut self, req: &Req) {
        if !req.op.is_write() {
            return;
        }
        let Some(r) = self.range(req) else { return };
        for (i, s) in r.enumerate() {
            if let Back::Dev(d, ds) = self.map[s as usize] {
                let at = ds as usize * SECTOR;
                let dst = &mut self.devs[d][at..at + SECTOR];
                match req.op {
                    Op::Write => dst.copy_from_slice(&req.data[i * SECTOR..(i + 1) * SECTOR]),
                    _ => dst.fill(0),
                }
            }
        }
    }

    /// What reading `r` returns.
    fn read(&self, r: std::ops::Range<u64>) -> Vec<u8> {
        let mut out = Vec::with_capacity((r.end - r.start) as usize * SECTOR);
        for s in r {
            match self.map[s as usize] {
                Back::Dev(d, ds) => {
                    let at = ds as usize * SECTOR;
                    out.extend_from_slice(&self.devs[d][at..at + SECTOR]);
                }
                _ => out.extend_from_slice(&[0; SECTOR]),
            }
        }
        out
    }

    /// Checks one completed request against the model (before applying it).
    fn check(&self, d: &Done) {
        d.assert_returned_intact();
        let want = self.status(&d.req);
        assert_eq!(
            d.status,
            want,
            "status of {:?} at {} (+{} sectors)",
            d.req.op,
            d.req.sector,
            d.req.sectors()
        );
        if d.req.op == Op::Read && want == Status::Ok {
            let r = self.range(&d.req).expect("in range");
            let what = format!("read of {} sectors at {}", d.req.sectors(), d.req.sector);
            assert_sectors_eq(&d.data, &self.read(r), &what);
        }
    }
}

/// A mapped device built from `l` over fresh ram devices, with the fast path
/// on or off, the rams, and a tester.
fn setup(l: &Layout, fast: bool) -> (Arc<dyn BlockDevice>, Vec<Arc<dyn BlockDevice>>, Tester) {
    let mut devs = Devices::new();
    let rams = (0..NDEVS)
        .map(|d| devs.ram(&format!("d{d}"), l.dev_sectors[d]))
        .collect();
    let md = devs.mapped("model", &l.text);
    // Before the tester opens a channel, so no reactor needs to answer.
    md.set_fast_path(fast).expect("set_fast_path");
    assert_eq!(
        md.limits().sectors,
        l.map.len() as u64,
        "device size is the table's"
    );
    (as_dev(&md), rams, Tester::new())
}

/// Every byte of every ram device matches the model.
fn check_devices(t: &Tester, rams: &[Arc<dyn BlockDevice>], m: &Model) {
    for (d, ram) in rams.iter().enumerate() {
        assert_sectors_eq(&t.read_all(ram), &m.devs[d], &format!("ram device d{d}"));
    }
}

/// Whether two requests' data ranges overlap (flushes overlap nothing).
fn overlaps(a: &Req, b: &Req) -> bool {
    if a.op == Op::Flush || b.op == Op::Flush {
        return false;
    }
    let (a0, a1) = (a.sector, a.sector.saturating_add(a.sectors().max(1)));
    let (b0, b1) = (b.sector, b.sector.saturating_add(b.sectors().max(1)));
    a0 < b1 && b0 < a1
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// At queue depth 1 (each I/O completes before the next is submitted),
    /// every status and every read matches the model, on the fast path and
    /// on the clone path, and afterwards every ram device holds exactly the
    /// model's content and every descriptor has been returned.
    #[test]
    fn qd1_stream_matches_the_model(
        l in layout_strategy(),
        ios in prop::collection::vec(io_strategy(), 1..48),
        fast in any::<bool>(),
    ) {
        let (dev, rams, t) = setup(&l, fast);
        let mut m = Model::new(&l);
        for io in &ios {
            let d = t.run(&dev, io.req(m.size()));
            m.check(&d);
            m.apply(&d.req);
            prop_assert_eq!(t.reactor.outstanding(), 0, "descriptors leaked");
        }
        check_devices(&t, &rams, &m);
    }

    /// With a batch of non-overlapping I/Os in flight at once, each
    /// completes exactly once with the model's status and data, and the
    /// devices end up as the model says.
    #[test]
    fn batches_in_flight_match_the_model(
        l in layout_strategy(),
        batches in prop::collection::vec(prop::collection::vec(io_strategy(), 1..16), 1..6),
        fast in any::<bool>(),
    ) {
        let (dev, rams, t) = setup(&l, fast);
        let ch = t.open(&dev);
        let mut m = Model::new(&l);
        for batch in &batches {
            let mut reqs: Vec<Req> = Vec::new();
            for io in batch {
                let r = io.req(m.size());
                if !reqs.iter().any(|x| overlaps(x, &r)) {
                    reqs.push(r);
                }
            }
            let inflight: Vec<InFlight> = reqs
                .into_iter()
                .map(|r| common::submit(&t.reactor, &*ch, r))
                .collect();
            t.wait_all(&inflight);
            let done: Vec<Done> = inflight.into_iter().map(InFlight::finish).collect();
            // No two overlap, so each sees the state before the batch.
            for d in &done {
                m.check(d);
            }
            for d in &done {
                m.apply(&d.req);
            }
            prop_assert_eq!(t.reactor.outstanding(), 0, "descriptors leaked");
        }
        check_devices(&t, &rams, &m);
    }
}

/// The model's own layout is sane: areas on a device never overlap, and
/// every area lies inside its device (so every generated table is valid).
#[test]
fn layouts_never_share_device_sectors() {
    let segs = [
        SegSpec::Linear {
            dev: 0,
            gap: 2,
            len: 5,
        },
        SegSpec::Striped {
            stripes: vec![(0, 1), (1, 0), (0, 0)],
            chunk: 3,
            rows: 2,
        },
        SegSpec::Zero { len: 4 },
        SegSpec::Error { len: 2 },
        SegSpec::Linear {
            dev: 1,
            gap: 0,
            len: 3,
        },
    ];
    let l = layout(&segs, [0, 1, 2]);
    assert_eq!(
        l.text,
        "0 5 linear d0 2\n5 18 striped 3 3 d0 8 d1 0 d0 14\n23 4 zero\n27 2 error\n29 3 linear d1 6"
    );
    let mut seen = std::collections::HashSet::new();
    for b in &l.map {
        if let Back::Dev(d, s) = b {
            assert!(seen.insert((*d, *s)), "{d}:{s} backs two sectors");
            assert!(*s < l.dev_sectors[*d]);
        }
    }
    assert_eq!(l.dev_sectors, [20, 10, 2]);
}
