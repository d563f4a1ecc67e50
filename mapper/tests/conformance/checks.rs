//! The checks of the conformance suite. Each takes a fresh device (in a
//! [`Harness`]) and what it promises (an [`Expect`]), and holds the device
//! to it.

use std::time::Instant;

use udm_backends::AlignedBuf;
use udm_core::{Bio, BioFlags, Caps, CompletionMode, Op, ReactorConfig, Status, SECTOR_SIZE};

use crate::harness::*;

/// Runs every check against fresh devices from `make`, which the suite calls
/// once per check (and once per reactor configuration for the in-flight one).
pub fn conformance(make: impl Fn() -> Fixture, e: Expect) {
    let t0 = Instant::now();
    let fresh = |config: ReactorConfig| Harness::new(e.label, make(), config);
    let dflt = ReactorConfig::default;

    check_limits_and_caps(&fresh(dflt()), &e);
    check_unwritten_reads(&fresh(dflt()), &e);
    check_patterns(&fresh(dflt()), &e);
    check_multi_segment(&fresh(dflt()), &e);
    check_discard_and_write_zeroes(&fresh(dflt()), &e);
    check_flush_fua_preflush(&fresh(dflt()), &e);
    check_invalid(&fresh(dflt()), &e);
    for mode in [
        CompletionMode::Interrupt,
        CompletionMode::Poll,
        CompletionMode::Hybrid,
        CompletionMode::Adaptive,
    ] {
        let config = ReactorConfig { mode, ..dflt() };
        check_in_flight(&fresh(config), &e, 128);
        // A ring much smaller than the batch: the SQ backlog fills and the
        // CQ overflows.
        let small = ReactorConfig {
            mode,
            ring_entries: 16,
            ..dflt()
        };
        check_in_flight(&fresh(small), &e, 256);
    }
    let h = fresh(dflt());
    if h.fixed.is_some() {
        check_fixed_buffer_is_used(&h, &e);
    }
    drop(h);
    let fx = make();
    if fx.power.is_some() {
        crate::durability::check_durability(fx, &e);
    }
    eprintln!("{}: conformance passed in {:?}", e.label, t0.elapsed());
}

pub fn check_limits_and_caps(h: &Harness, e: &Expect) {
    let l = h.dev.limits();
    let label = e.label;
    assert_eq!(l.bytes(), e.bytes, "{label}: size");
    assert_eq!(l.sectors, e.bytes / SECTOR_SIZE, "{label}: sectors");
    let lbs = l.logical_block_size;
    assert!(lbs >= 512 && lbs.is_power_of_two(), "{label}: lbs {lbs}");
    assert!(
        l.physical_block_size >= lbs && l.physical_block_size.is_power_of_two(),
        "{label}: pbs {}",
        l.physical_block_size
    );
    assert!(
        l.max_io_bytes >= lbs && l.max_io_bytes.is_multiple_of(lbs),
        "{label}: max_io_bytes {}",
        l.max_io_bytes
    );
    assert!(l.max_segments >= 1, "{label}: max_segments");
    assert!(l.io_opt.is_multiple_of(lbs), "{label}: io_opt {}", l.io_opt);
    assert!(
        (l.sectors * SECTOR_SIZE).is_multiple_of(lbs as u64),
        "{label}: size not a multiple of the logical block size"
    );

    assert_eq!(lbs, e.lbs, "{label}: logical block size");

    let c = h.dev.caps();
    assert!(c == e.caps, "{label}: caps {c:?}, promised {:?}", e.caps);
    for op in [Op::Read, Op::Write] {
        assert!(c.supports(op), "{label}: does not support {}", op.name());
    }
    for (op, cap) in [
        (Op::Flush, Caps::FLUSH),
        (Op::Discard, Caps::DISCARD),
        (Op::WriteZeroes, Caps::WRITE_ZEROES),
    ] {
        assert_eq!(
            c.supports(op),
            c.contains(cap),
            "{label}: supports({}) disagrees with its caps {c:?}",
            op.name()
        );
    }
    assert!(!h.dev.name().is_empty(), "{label}: no name");
    // The limits are stable.
    assert_eq!(h.dev.limits(), l, "{label}: limits changed");
    assert!(h.dev.caps() == c, "{label}: caps changed");
}

pub fn check_unwritten_reads(h: &Harness, e: &Expect) {
    let sectors = h.sectors();
    let shadow = Shadow::new(e.bytes);
    for (sector, len) in [
        (0, 4096),
        (1, 512),
        (sectors / 2 + 3, 1 << 20),
        (sectors - 1, 512),
        (sectors - 128, 64 << 10),
        (sectors / 2 + 8, 1 << 20),
        (sectors - 8, 4096),
    ] {
        if e.aligned(sector, len) {
            verify(h, e, &shadow, sector, len, "read of never-written space");
        }
    }
    // Multi-segment reads of never-written space too.
    // 8 KiB in all, from sector 96: aligned to any block size up to 8 KiB.
    let mut bufs: Vec<AlignedBuf> = [512, 4096, 1024, 512, 1536, 512]
        .iter()
        .map(|&n| AlignedBuf::new(n))
        .collect();
    for b in bufs.iter_mut() {
        b.as_mut_slice().fill(POISON);
    }
    let mut segs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    let st = h.rw_segs(Op::Read, BioFlags::NONE, 96, &mut segs);
    assert_eq!(st, e.ok(), "{}: multi-segment read", e.label);
    let got: Vec<u8> = segs.iter().flat_map(|s| s.iter().copied()).collect();
    check_read(
        e,
        &shadow,
        96,
        &got,
        "multi-segment read of never-written space",
    );
}

pub fn check_patterns(h: &Harness, e: &Expect) {
    let sectors = h.sectors();
    let mut shadow = Shadow::new(e.bytes);
    let lens = [512usize, 1024, 1536, 4096, 4608, 8192, 65536 + 512, 1 << 20];
    let starts = [0u64, 1, 7, 8, 9, 63, 127, 1000, 4095, 8191, sectors / 2 + 3];
    let lbs_starts = [16u64, 24, 1024, 8184, sectors / 2 + 8];
    for &len in &lens {
        let n = (len / SECTOR) as u64;
        // Aligned and unaligned starts (those the block size allows), plus
        // one ending exactly at the end.
        for sector in starts
            .iter()
            .chain(&lbs_starts)
            .copied()
            .chain([sectors - n])
        {
            if sector + n > sectors || !e.aligned(sector, len) {
                continue;
            }
            let data = shadow.next(sector, len);
            let st = h.write(sector, &data);
            assert_eq!(st, e.ok(), "{}: write {sector}+{len}", e.label);
            verify(h, e, &shadow, sector, len, "read back");
        }
    }
    // Overlapping rewrites: the newest data wins, the rest stays.
    for (sector, len) in [
        (10u64, 8192usize),
        (14, 512),
        (12, 4096),
        (9, 1024),
        (8, 16384),
        (16, 4096),
        (24, 8192),
    ] {
        if !e.aligned(sector, len) {
            continue;
        }
        let data = shadow.next(sector, len);
        assert_eq!(h.write(sector, &data), e.ok(), "{}: rewrite", e.label);
    }
    verify(h, e, &shadow, 0, 64 << 10, "after overlapping rewrites");
    // Reads at offsets and lengths other than the writes'.
    for (sector, len) in [
        (3u64, 2048usize),
        (62, 1536),
        (8190, 4096),
        (1001, 65536),
        (8, 12288),
        (8184, 65536),
    ] {
        if e.aligned(sector, len) {
            verify(h, e, &shadow, sector, len, "read across writes");
        }
    }
    verify_all(h, e, &shadow, "whole device after pattern writes");
}

pub fn check_multi_segment(h: &Harness, e: &Expect) {
    let mut shadow = Shadow::new(e.bytes);
    // Segment lengths in sectors: up to and past the inline capacity (4),
    // so the descriptor's segment vector spills to the heap.
    let layouts: [&[usize]; 8] = [
        &[1, 1],
        &[1, 2, 3],
        &[8, 8, 8, 8],
        &[1, 1, 1, 1, 1],
        &[8, 1, 2, 16, 1, 4],
        &[8, 1, 2, 16, 1, 4, 8, 3],
        &[1, 3, 1, 5, 1, 7, 1, 9, 1, 2, 1, 4, 1, 6, 1, 8, 2],
        &[128, 64, 32, 16, 8, 4, 2, 1, 1, 2, 4, 8, 16, 32, 64, 128],
    ];
    let lbs_sectors = e.lbs_sectors() as usize;
    let mut sector = 64u64;
    for (li, layout) in layouts.iter().enumerate() {
        // On a device with bigger blocks, a last segment rounds the bio up
        // to a whole block.
        let mut layout = layout.to_vec();
        let rem = layout.iter().sum::<usize>() % lbs_sectors;
        if rem != 0 {
            layout.push(lbs_sectors - rem);
        }
        let total: usize = layout.iter().sum::<usize>() * SECTOR;
        let data = shadow.next(sector, total);

        // Multi-segment write, each segment its own allocation.
        let mut bufs: Vec<AlignedBuf> = layout
            .iter()
            .map(|&n| AlignedBuf::new(n * SECTOR))
            .collect();
        let mut pos = 0;
        for b in bufs.iter_mut() {
            let n = b.as_slice().len();
            b.as_mut_slice().copy_from_slice(&data[pos..pos + n]);
            pos += n;
        }
        let mut segs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
        let st = h.rw_segs(Op::Write, BioFlags::NONE, sector, &mut segs);
        assert_eq!(st, e.ok(), "{}: {}-segment write", e.label, layout.len());
        // Read back as one segment.
        verify(
            h,
            e,
            &shadow,
            sector,
            total,
            "single-segment read of a multi-segment write",
        );

        // Read back through a different multi-segment layout.
        let other = layouts[(li + 3) % layouts.len()];
        let mut rbufs = Vec::new();
        let mut left = total / SECTOR;
        for &n in other.iter().cycle() {
            if left == 0 {
                break;
            }
            let n = n.min(left);
            let mut b = AlignedBuf::new(n * SECTOR);
            b.as_mut_slice().fill(POISON);
            rbufs.push(b);
            left -= n;
        }
        let mut rsegs: Vec<&mut [u8]> = rbufs.iter_mut().map(|b| b.as_mut_slice()).collect();
        let st = h.rw_segs(Op::Read, BioFlags::NONE, sector, &mut rsegs);
        assert_eq!(st, e.ok(), "{}: {}-segment read", e.label, rsegs.len());
        let got: Vec<u8> = rsegs.iter().flat_map(|s| s.iter().copied()).collect();
        check_read(
            e,
            &shadow,
            sector,
            &got,
            &format!(
                "{}-segment read of a {}-segment write",
                rsegs.len(),
                layout.len()
            ),
        );
        sector += ((total / SECTOR) as u64 + 5).next_multiple_of(lbs_sectors as u64);
    }

    // As many segments as the device allows in one bio.
    let max = (h.dev.limits().max_segments as usize).min(1024);
    let max = max - max % lbs_sectors;
    assert!(
        max > 0,
        "{}: fewer segments than sectors in a block",
        e.label
    );
    let sector = h.sectors() / 2;
    let data = shadow.next(sector, max * SECTOR);
    let mut big = AlignedBuf::new(max * SECTOR * 2);
    // Every other sector of `big`: segments that are not contiguous.
    for (i, chunk) in data.chunks(SECTOR).enumerate() {
        big.as_mut_slice()[2 * i * SECTOR..(2 * i + 1) * SECTOR].copy_from_slice(chunk);
    }
    let mut segs: Vec<&mut [u8]> = big.as_mut_slice().chunks_mut(SECTOR).step_by(2).collect();
    assert_eq!(segs.len(), max);
    let st = h.rw_segs(Op::Write, BioFlags::NONE, sector, &mut segs);
    assert_eq!(
        st,
        e.ok(),
        "{}: write of max_segments ({max}) segments",
        e.label
    );
    verify(
        h,
        e,
        &shadow,
        sector,
        max * SECTOR,
        "read of a max_segments write",
    );
    verify_all(h, e, &shadow, "whole device after multi-segment writes");
}

pub fn check_discard_and_write_zeroes(h: &Harness, e: &Expect) {
    let sectors = h.sectors();
    let mut shadow = Shadow::new(e.bytes);
    // Fill the first 2 MiB and the last 256 KiB with data.
    for (sector, len) in [(0u64, 2usize << 20), (sectors - 512, 256 << 10)] {
        let data = shadow.next(sector, len);
        assert_eq!(h.write(sector, &data), e.ok(), "{}: fill", e.label);
    }
    let cases: [(Op, u64, u32); 12] = [
        (Op::Discard, 8, 4096),               // page-aligned
        (Op::Discard, 3, 5 * 512),            // sector-granular, unaligned
        (Op::Discard, 1024, 256 << 10),       // large
        (Op::WriteZeroes, 40, 4096),          // page-aligned
        (Op::WriteZeroes, 51, 3 * 512),       // sector-granular, unaligned
        (Op::WriteZeroes, 2048, 512 << 10),   // large
        (Op::WriteZeroes, sectors - 1, 512),  // the last sector
        (Op::Discard, sectors - 20, 8 * 512), // near the end
        (Op::WriteZeroes, 8192, 4 << 20),     // never written
        (Op::Discard, 20000, 1 << 20),        // never written
        (Op::WriteZeroes, sectors - 8, 4096), // the last 4 KiB
        (Op::Discard, sectors - 32, 8192),    // near the end, 4 KiB-aligned
    ];
    for (op, sector, len) in cases {
        if !e.aligned(sector, len as usize) {
            continue;
        }
        let st = h.dataless(op, BioFlags::NONE, sector, len);
        let want = e.status_of(op);
        assert_eq!(st, want, "{}: {} {sector}+{len}", e.label, op.name());
        // An op the device does not support changes nothing; one it does
        // leaves zeroes where it promises them.
        if want.is_ok() && (op == Op::WriteZeroes || e.discard_zeroes) {
            shadow.zero(sector, len as usize);
        }
        if want.is_ok() && op == Op::Discard && !e.discard_zeroes {
            // What such a discard leaves is unspecified (thin passes part
            // of a block down to its data device): the range is written
            // again, so that the later cases' reads know what it holds.
            let data = shadow.next(sector, len as usize);
            let st = h.write(sector, &data);
            assert_eq!(
                st,
                e.ok(),
                "{}: write after discard {sector}+{len}",
                e.label
            );
            continue;
        }
        // The range reads as the shadow says, and its neighbours are intact.
        let from = sector.saturating_sub(16);
        let to = (sector + len as u64 / SECTOR_SIZE + 16).min(sectors);
        verify(
            h,
            e,
            &shadow,
            from,
            ((to - from) * SECTOR_SIZE) as usize,
            &format!("read after {} {sector}+{len}", op.name()),
        );
    }
    // A zeroed or discarded range takes new data again.
    for sector in [8u64, 3, 40] {
        if !e.aligned(sector, 4096) {
            continue;
        }
        let data = shadow.next(sector, 4096);
        assert_eq!(h.write(sector, &data), e.ok(), "{}: rewrite", e.label);
        verify(h, e, &shadow, sector, 4096, "rewrite after discard/zeroes");
    }
    if e.discard_zeroes {
        verify_all(h, e, &shadow, "whole device after discard and write-zeroes");
    }
}

pub fn check_flush_fua_preflush(h: &Harness, e: &Expect) {
    let mut shadow = Shadow::new(e.bytes);
    assert_eq!(
        h.dataless(Op::Flush, BioFlags::NONE, 0, 0),
        e.status_of(Op::Flush),
        "{}: flush of an idle device",
        e.label
    );
    let data = shadow.next(0, 8192);
    assert_eq!(h.write(0, &data), e.ok());
    assert_eq!(
        h.dataless(Op::Flush, BioFlags::NONE, 0, 0),
        e.status_of(Op::Flush),
        "{}: flush",
        e.label
    );
    assert_eq!(
        h.dataless(Op::Flush, BioFlags::PREFLUSH, 0, 0),
        e.status_of(Op::Flush),
        "{}: flush with PREFLUSH",
        e.label
    );
    for (i, flags) in [
        BioFlags::FUA,
        BioFlags::PREFLUSH,
        BioFlags::PREFLUSH | BioFlags::FUA,
    ]
    .into_iter()
    .enumerate()
    {
        let sector = 96 + 64 * i as u64;
        let data = shadow.next(sector, 16 << 10);
        let st = h.write_flags(sector, &data, flags);
        assert_eq!(st, e.ok(), "{}: write with {flags:?}", e.label);
        verify(
            h,
            e,
            &shadow,
            sector,
            16 << 10,
            &format!("read after a {flags:?} write"),
        );
        // The same flags on a multi-segment write.
        let sector = sector + 40;
        // 6 KiB, or 8 KiB where blocks are bigger than 2 KiB.
        let nsegs = if e.aligned(0, 6 * 1024) { 6 } else { 8 };
        let data = shadow.next(sector, nsegs * 1024);
        let mut bufs: Vec<AlignedBuf> = (0..nsegs).map(|_| AlignedBuf::new(1024)).collect();
        for (b, d) in bufs.iter_mut().zip(data.chunks(1024)) {
            b.as_mut_slice().copy_from_slice(d);
        }
        let mut segs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
        let st = h.rw_segs(Op::Write, flags, sector, &mut segs);
        assert_eq!(
            st,
            e.ok(),
            "{}: {nsegs}-segment write with {flags:?}",
            e.label
        );
        verify(
            h,
            e,
            &shadow,
            sector,
            nsegs * 1024,
            &format!("read after a {nsegs}-segment {flags:?} write"),
        );
    }

    // Many flushes and flagged writes in flight together.
    let n = 32;
    let mut bufs = AlignedBuf::new(n * 4096);
    let mut datas = Vec::new();
    for i in 0..n {
        let sector = 1000 + 8 * i as u64;
        let d = shadow.next(sector, 4096);
        bufs.as_mut_slice()[i * 4096..(i + 1) * 4096].copy_from_slice(&d);
        datas.push(sector);
    }
    let dones = done_slots(2 * n);
    let base = bufs.as_mut_ptr();
    for (i, &sector) in datas.iter().enumerate() {
        let flags = match i % 3 {
            0 => BioFlags::FUA,
            1 => BioFlags::PREFLUSH,
            _ => BioFlags::PREFLUSH | BioFlags::FUA,
        };
        let mut bio = h.bio(Op::Write, flags, sector);
        // SAFETY: a distinct 4 KiB slice of `bufs`, which lives until the
        // wait below has seen every bio complete.
        unsafe { bio.add_seg(base.add(i * 4096), 4096) };
        h.submit(bio, &dones[2 * i]);
        let mut f = h.bio(Op::Flush, BioFlags::NONE, 0);
        f.set_dataless(Op::Flush, 0, 0);
        h.submit(f, &dones[2 * i + 1]);
    }
    h.wait(&dones);
    for (i, d) in dones.iter().enumerate() {
        let want = if i % 2 == 0 {
            e.ok()
        } else {
            e.status_of(Op::Flush)
        };
        assert_eq!(d.status(), want, "{}: in-flight write/flush {i}", e.label);
    }
    verify(
        h,
        e,
        &shadow,
        1000,
        n * 4096,
        "read after flagged writes in flight",
    );
}

pub fn check_invalid(h: &Harness, e: &Expect) {
    let sectors = h.sectors();
    let l = h.dev.limits();
    let lbs = l.logical_block_size as usize;
    let shadow = Shadow::new(e.bytes);
    let label = e.label;
    let inval = |st: Status, what: &str| {
        assert_eq!(
            st,
            Status::Inval,
            "{label}: {what} must complete with Inval"
        );
    };
    let mut buf = AlignedBuf::new(64 << 10);
    buf.as_mut_slice().fill(0x3C);
    let b = buf.as_mut_slice();

    for op in [Op::Read, Op::Write] {
        let name = op.name();
        // Out of range.
        inval(
            h.rw_segs(op, BioFlags::NONE, sectors, &mut [&mut b[..512]]),
            &format!("{name} at the end"),
        );
        inval(
            h.rw_segs(op, BioFlags::NONE, sectors - 1, &mut [&mut b[..1024]]),
            &format!("{name} straddling the end"),
        );
        {
            let (x, y) = b.split_at_mut(4096);
            inval(
                h.rw_segs(
                    op,
                    BioFlags::NONE,
                    sectors - 8,
                    &mut [&mut x[..2048], &mut y[..4096]],
                ),
                &format!("multi-segment {name} straddling the end"),
            );
        }
        inval(
            h.rw_segs(
                op,
                BioFlags::NONE,
                sectors - e.lbs_sectors(),
                &mut [&mut b[..2 * lbs]],
            ),
            &format!("{name} of two blocks straddling the end"),
        );
        for far in [sectors + 1000, u64::MAX >> 9, u64::MAX - 1, u64::MAX] {
            inval(
                h.rw_segs(op, BioFlags::NONE, far, &mut [&mut b[..512]]),
                &format!("{name} at sector {far}"),
            );
        }
        // Misaligned lengths.
        inval(
            h.rw_segs(op, BioFlags::NONE, 0, &mut [&mut b[..100]]),
            &format!("100-byte {name}"),
        );
        inval(
            h.rw_segs(op, BioFlags::NONE, 0, &mut [&mut b[..lbs + 1]]),
            &format!("lbs+1-byte {name}"),
        );
        {
            let (x, y) = b.split_at_mut(1024);
            inval(
                h.rw_segs(op, BioFlags::NONE, 0, &mut [&mut x[..512], &mut y[..100]]),
                &format!("multi-segment {name} of 612 bytes"),
            );
        }
        // Zero length.
        inval(
            h.exec(h.bio(op, BioFlags::NONE, 0)),
            &format!("zero-length {name}"),
        );
        inval(
            h.exec(h.bio(op, BioFlags::FUA, 8)),
            &format!("zero-length FUA {name}"),
        );
        // Misaligned start, when the logical block is bigger than a sector.
        if lbs > SECTOR {
            inval(
                h.rw_segs(op, BioFlags::NONE, 1, &mut [&mut b[..lbs]]),
                &format!("{name} at a misaligned sector"),
            );
        }
    }
    // Flagged writes are checked the same way.
    inval(
        h.rw_segs(Op::Write, BioFlags::PREFLUSH, sectors, &mut [&mut b[..512]]),
        "PREFLUSH write past the end",
    );
    inval(
        h.rw_segs(Op::Write, BioFlags::FUA, sectors - 1, &mut [&mut b[..4096]]),
        "FUA write straddling the end",
    );
    for op in [Op::Discard, Op::WriteZeroes] {
        let name = op.name();
        inval(
            h.dataless(op, BioFlags::NONE, 0, 0),
            &format!("zero-length {name}"),
        );
        inval(
            h.dataless(op, BioFlags::NONE, 0, 100),
            &format!("100-byte {name}"),
        );
        inval(
            h.dataless(op, BioFlags::NONE, sectors, 512),
            &format!("{name} at the end"),
        );
        inval(
            h.dataless(op, BioFlags::NONE, sectors - 1, 1024),
            &format!("{name} straddling the end"),
        );
        inval(
            h.dataless(op, BioFlags::NONE, u64::MAX, 512),
            &format!("{name} at sector u64::MAX"),
        );
    }
    // Too long for the device's limits, and too many segments.
    let max_io = l.max_io_bytes as u64;
    if max_io + lbs as u64 <= e.bytes {
        let mut big = AlignedBuf::new(max_io as usize + lbs);
        inval(
            h.rw_segs(Op::Write, BioFlags::NONE, 0, &mut [big.as_mut_slice()]),
            "write longer than max_io_bytes",
        );
        let st = h.rw_segs(
            Op::Read,
            BioFlags::NONE,
            0,
            &mut [&mut big.as_mut_slice()[..max_io as usize]],
        );
        assert_eq!(st, e.ok(), "{label}: read of exactly max_io_bytes");
    }
    let max_segs = l.max_segments as usize;
    if max_segs < 4096 && (max_segs as u64 + 1) * lbs as u64 <= e.bytes.min(max_io) {
        // Each segment a whole block, so only their number is wrong.
        let mut many = AlignedBuf::new((max_segs + 1) * lbs);
        let mut segs: Vec<&mut [u8]> = many.as_mut_slice().chunks_mut(lbs).collect();
        inval(
            h.rw_segs(Op::Write, BioFlags::NONE, 0, &mut segs),
            "write of max_segments + 1 segments",
        );
    }
    // A refused write must not have written anything: the device still reads
    // as never written (the buffer held 0x3C bytes).
    verify(
        h,
        e,
        &shadow,
        0,
        64 << 10,
        "start of the device after refused writes",
    );
    verify(
        h,
        e,
        &shadow,
        sectors - 64,
        32 << 10,
        "end of the device after refused writes",
    );
}

/// `n` writes in flight at once, then `n` reads, then a mix of both with
/// flushes; all complete exactly once, and the reads see the writes.
pub fn check_in_flight(h: &Harness, e: &Expect, n: usize) {
    const BS: usize = 4096;
    let label = e.label;
    let mode = h.reactor.config().mode;
    let mut shadow = Shadow::new(e.bytes);
    let mut own = AlignedBuf::new(2 * n * BS);
    let (base, index) = match &h.fixed {
        Some(f) => {
            assert!(2 * n * BS <= FIXED_BYTES);
            (f.ptr, f.index)
        }
        None => (own.as_mut_ptr(), Bio::NO_BUF),
    };
    // Block i lives at sector i * 24: spread out, with gaps.
    let sector_of = |i: usize| (i * 24) as u64;
    assert!(sector_of(n) < h.sectors());
    // SAFETY: `base` points at 2 * n * BS bytes owned by `own` or by the
    // harness's registered buffer, live for this whole function; no I/O is
    // in flight between the phases below, where these slices are used.
    let region = |k: usize| unsafe { std::slice::from_raw_parts_mut(base.add(k * BS), BS) };
    let submit_block = |op: Op, i: usize, k: usize, done: &Done| {
        let mut bio = h.bio(op, BioFlags::NONE, sector_of(i));
        // SAFETY: slot k of the region above; the caller waits for the bio
        // before the region is touched again or released.
        unsafe { bio.add_seg(base.add(k * BS), BS) };
        bio.buf_index = index;
        h.submit(bio, done);
    };
    let check_latency = |dones: &[Done], t: Instant| {
        if let Some(min) = e.min_latency {
            for d in dones {
                let took = d.at.get().unwrap() - t;
                assert!(
                    took >= min,
                    "{label}: an I/O took {took:?}, less than the delay {min:?}"
                );
            }
        }
    };

    // n writes at once.
    for i in 0..n {
        let d = shadow.next(sector_of(i), BS);
        region(i).copy_from_slice(&d);
    }
    let dones = done_slots(n);
    let t = Instant::now();
    for (i, d) in dones.iter().enumerate() {
        submit_block(Op::Write, i, i, d);
    }
    assert!(
        dones.iter().all(|d| d.calls.get() == 0),
        "{label}: completions ran before the reactor turned"
    );
    h.wait(&dones);
    check_latency(&dones, t);
    for (i, d) in dones.iter().enumerate() {
        assert_eq!(
            d.status(),
            e.ok(),
            "{label} ({mode:?}, {n} in flight): write {i}"
        );
    }

    // n reads at once, into the other half.
    for i in 0..n {
        region(n + i).fill(POISON);
    }
    let dones = done_slots(n);
    let t = Instant::now();
    for (i, d) in dones.iter().enumerate() {
        submit_block(Op::Read, i, n + i, d);
    }
    h.wait(&dones);
    check_latency(&dones, t);
    for (i, d) in dones.iter().enumerate() {
        assert_eq!(
            d.status(),
            e.ok(),
            "{label} ({mode:?}, {n} in flight): read {i}"
        );
        check_read(e, &shadow, sector_of(i), region(n + i), "in-flight read");
    }

    // n overlapping reads at once: two of every 4 KiB block from the start,
    // across written blocks and the gaps between them.
    for i in 0..n {
        region(n + i).fill(POISON);
    }
    let read_sector = |i: usize| (8 * (i / 2)) as u64;
    let dones = done_slots(n);
    for (i, d) in dones.iter().enumerate() {
        let mut bio = h.bio(Op::Read, BioFlags::NONE, read_sector(i));
        // SAFETY: slot n + i of the region above; waited for below.
        unsafe { bio.add_seg(base.add((n + i) * BS), BS) };
        bio.buf_index = index;
        h.submit(bio, d);
    }
    h.wait(&dones);
    for (i, d) in dones.iter().enumerate() {
        assert_eq!(
            d.status(),
            e.ok(),
            "{label} ({mode:?}): overlapping read {i}"
        );
        check_read(
            e,
            &shadow,
            read_sector(i),
            region(n + i),
            "overlapping in-flight read",
        );
    }

    // Reads of the first half and writes of the second half together, with
    // a flush every 16.
    let half = n / 2;
    for i in half..n {
        let d = shadow.next(sector_of(i), BS);
        region(i).copy_from_slice(&d);
    }
    for i in 0..half {
        region(n + i).fill(POISON);
    }
    let flushes = n.div_ceil(16);
    let dones = done_slots(n + flushes);
    for i in 0..n {
        if i < half {
            submit_block(Op::Read, i, n + i, &dones[i]);
        } else {
            submit_block(Op::Write, i, i, &dones[i]);
        }
        if i % 16 == 0 {
            let mut f = h.bio(Op::Flush, BioFlags::NONE, 0);
            f.set_dataless(Op::Flush, 0, 0);
            h.submit(f, &dones[n + i / 16]);
        }
    }
    h.wait(&dones);
    for (i, d) in dones.iter().enumerate() {
        let want = if i < n {
            e.ok()
        } else {
            e.status_of(Op::Flush)
        };
        assert_eq!(d.status(), want, "{label} ({mode:?}): mixed I/O {i}");
    }
    for i in 0..half {
        check_read(e, &shadow, sector_of(i), region(n + i), "mixed read");
    }
    for i in half..n {
        verify(
            h,
            e,
            &shadow,
            sector_of(i),
            BS,
            "read after mixed in-flight writes",
        );
    }
    assert!(!h.reactor.busy(), "{label}: reactor still busy");
    drop(own);
}

/// A bio that claims the registered buffer but whose segment lies outside
/// it must fail: proof that fixed-buffer I/O is really used.
pub fn check_fixed_buffer_is_used(h: &Harness, e: &Expect) {
    let f = h.fixed.as_ref().unwrap();
    let mut outside = AlignedBuf::new(4096);
    for op in [Op::Write, Op::Read] {
        let mut bio = h.bio(op, BioFlags::NONE, 0);
        // SAFETY: `outside` lives until exec has waited for the bio.
        unsafe { bio.add_seg(outside.as_mut_ptr(), 4096) };
        bio.buf_index = f.index;
        let st = h.exec(bio);
        assert_ne!(
            st,
            Status::Ok,
            "{}: a {} claiming registered buffer {} from outside it succeeded: fixed buffers are not used",
            e.label,
            op.name(),
            f.index
        );
    }
}
