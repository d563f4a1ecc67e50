//! Behaviour particular to one backend: ram's allocation on write and
//! preallocation, sizes under a sector, null's untouched buffers, and the
//! file backend's open-time errors, read-only mode and persistence.

use std::sync::Arc;
use std::time::{Duration, Instant};

use udm_backends::{AlignedBuf, FileDevice, FileOpts, NullDevice, RamDevice};
use udm_core::{BioFlags, BlockDevice, Caps, ErrorKind, Op, ReactorConfig, Status};

use crate::harness::*;

#[test]
fn ram_allocates_only_on_write() {
    let dev = Arc::new(RamDevice::new("ram", DEV_BYTES).unwrap());
    let h = Harness::new(
        "ram alloc",
        Fixture::plain(dev.clone()),
        ReactorConfig::default(),
    );
    let (st, got) = h.read(0, 1 << 20);
    assert_eq!(st, Status::Ok);
    assert!(got.iter().all(|&b| b == 0));
    assert_eq!(
        h.dataless(Op::WriteZeroes, BioFlags::NONE, 0, 1 << 20),
        Status::Ok
    );
    assert_eq!(
        h.dataless(Op::Discard, BioFlags::NONE, 0, 1 << 20),
        Status::Ok
    );
    assert_eq!(
        dev.allocated_bytes(),
        0,
        "reads, discards and zeroes allocated memory"
    );
    assert_eq!(h.write(9, &[1u8; 512]), Status::Ok);
    assert_eq!(dev.allocated_bytes(), 4096, "one sector written: one page");
    assert_eq!(h.write(7, &[2u8; 1024]), Status::Ok);
    assert_eq!(
        dev.allocated_bytes(),
        8192,
        "a write across a page boundary: two pages"
    );
}

/// A discard gives back the pages it covers whole (they read zero and count
/// no more); pages it covers in part stay, zeroed there.
#[test]
fn ram_discard_frees_whole_pages() {
    let dev = Arc::new(RamDevice::new("ram", DEV_BYTES).unwrap());
    let h = Harness::new(
        "ram discard",
        Fixture::plain(dev.clone()),
        ReactorConfig::default(),
    );
    assert_eq!(h.write(0, &[5u8; 4 * 4096]), Status::Ok);
    assert_eq!(dev.allocated_bytes(), 4 * 4096);
    // Sectors 4..24: page 0's second half, pages 1 and 2 whole.
    assert_eq!(
        h.dataless(Op::Discard, BioFlags::NONE, 4, 20 * 512),
        Status::Ok
    );
    assert_eq!(dev.allocated_bytes(), 2 * 4096, "pages 1 and 2 freed");
    let (st, got) = h.read(0, 4 * 4096);
    assert_eq!(st, Status::Ok);
    assert!(got[..2048].iter().all(|&b| b == 5));
    assert!(got[2048..3 * 4096].iter().all(|&b| b == 0));
    assert!(got[3 * 4096..].iter().all(|&b| b == 5));
    // Written again, a freed page counts again.
    assert_eq!(h.write(8, &[6u8; 512]), Status::Ok);
    assert_eq!(dev.allocated_bytes(), 3 * 4096);
    assert_eq!(h.read(8, 512), (Status::Ok, vec![6u8; 512]));
}

#[test]
fn ram_prealloc_backs_every_page_and_the_disk_still_reads_zero_first() {
    let dev = Arc::new(RamDevice::new("ram", DEV_BYTES).unwrap());
    dev.prealloc().unwrap();
    assert_eq!(dev.allocated_bytes(), DEV_BYTES, "every page counted");
    let h = Harness::new(
        "ram prealloc",
        Fixture::plain(dev.clone()),
        ReactorConfig::default(),
    );
    let (st, got) = h.read(0, 1 << 20);
    assert_eq!(st, Status::Ok);
    assert!(got.iter().all(|&b| b == 0), "backed pages read as zeroes");
    assert_eq!(h.write(9, &[3u8; 512]), Status::Ok);
    let (st, got) = h.read(8, 1024);
    assert_eq!(st, Status::Ok);
    assert!(got[..512].iter().all(|&b| b == 0) && got[512..].iter().all(|&b| b == 3));
    assert_eq!(
        dev.allocated_bytes(),
        DEV_BYTES,
        "writes allocate nothing more"
    );
}

#[test]
fn ram_and_null_refuse_sizes_under_a_sector() {
    assert_eq!(
        RamDevice::new("r", 511).err().unwrap().kind(),
        ErrorKind::Invalid
    );
    assert_eq!(
        NullDevice::new("n", 0, None).err().unwrap().kind(),
        ErrorKind::Invalid
    );
    // Sizes round down to whole sectors.
    assert_eq!(RamDevice::new("r", 1000).unwrap().limits().sectors, 1);
    assert_eq!(
        NullDevice::new("n", 4097, None).unwrap().limits().sectors,
        8
    );
}

#[test]
fn null_reads_leave_buffers_untouched_after_writes() {
    let h = Harness::new(
        "null untouched",
        Fixture::plain(Arc::new(NullDevice::new("null", DEV_BYTES, None).unwrap())),
        ReactorConfig::default(),
    );
    assert_eq!(h.write(0, &pattern(7, 0, 8192)), Status::Ok);
    let mut bufs: Vec<AlignedBuf> = (0..6).map(|_| AlignedBuf::new(1024)).collect();
    for (i, b) in bufs.iter_mut().enumerate() {
        b.as_mut_slice().fill(i as u8 + 1);
    }
    let mut segs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    assert_eq!(
        h.rw_segs(Op::Read, BioFlags::NONE, 0, &mut segs),
        Status::Ok
    );
    for (i, s) in segs.iter().enumerate() {
        assert!(
            s.iter().all(|&b| b == i as u8 + 1),
            "null read changed segment {i}"
        );
    }
}

#[test]
fn file_missing_path_without_size_is_an_error_naming_the_path() {
    let f = TempFile::new("missing");
    for opts in [
        FileOpts::default(),
        FileOpts {
            buffered: true,
            ..FileOpts::default()
        },
    ] {
        let err = FileDevice::open("f", &f.path, opts)
            .err()
            .expect("opening a missing file must fail");
        let msg = err.to_string();
        assert!(msg.contains(&f.path), "error does not name the path: {msg}");
        assert!(
            matches!(err.kind(), ErrorKind::NotFound | ErrorKind::Os),
            "kind {:?}: {msg}",
            err.kind()
        );
        assert!(
            !std::path::Path::new(&f.path).exists(),
            "a file was created without size="
        );
    }
    // A missing directory, even with size=.
    let path = format!("{}-dir/x", f.path);
    let err = FileDevice::open(
        "f",
        &path,
        FileOpts {
            size: Some(1 << 20),
            ..FileOpts::default()
        },
    )
    .err()
    .expect("a file in a missing directory must fail");
    assert!(err.to_string().contains(&path), "{err}");
}

#[test]
fn file_empty_without_size_is_an_error() {
    let f = TempFile::new("empty");
    std::fs::write(&f.path, b"").unwrap();
    let err = FileDevice::open("f", &f.path, FileOpts::default())
        .err()
        .expect("an empty file must fail");
    let msg = err.to_string();
    assert!(msg.contains(&f.path) && msg.contains("size"), "{msg}");
    assert_eq!(err.kind(), ErrorKind::Invalid);
}

#[test]
fn file_iopoll_is_refused_clearly() {
    let f = TempFile::new("iopoll");
    for sqpoll in [false, true] {
        let opts = FileOpts {
            iopoll: true,
            sqpoll,
            size: Some(1 << 20),
            ..FileOpts::default()
        };
        let t = Instant::now();
        let err = FileDevice::open("f", &f.path, opts)
            .err()
            .expect("iopoll on /dev/shm must fail");
        let msg = err.to_string();
        assert!(
            msg.contains("does not support polled I/O"),
            "sqpoll={sqpoll}: {msg}"
        );
        assert!(msg.contains(&f.path), "sqpoll={sqpoll}: {msg}");
        assert_eq!(err.kind(), ErrorKind::Unsupported, "sqpoll={sqpoll}: {msg}");
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the iopoll probe took {:?}",
            t.elapsed()
        );
    }
    // iopoll needs O_DIRECT.
    let err = FileDevice::open(
        "f",
        &f.path,
        FileOpts {
            iopoll: true,
            buffered: true,
            ..FileOpts::default()
        },
    )
    .err()
    .expect("iopoll with buffered must fail");
    assert!(err.to_string().contains("O_DIRECT"), "{err}");
    assert_eq!(err.kind(), ErrorKind::Invalid);
}

#[test]
fn file_created_with_size_has_that_size() {
    for (size, sectors) in [(3u64 << 20, 6144u64), (1 << 30, 2 << 20), (1000, 1)] {
        let f = TempFile::new("create");
        let dev = FileDevice::open(
            "f",
            &f.path,
            FileOpts {
                size: Some(size),
                ..FileOpts::default()
            },
        )
        .unwrap();
        assert_eq!(
            std::fs::metadata(&f.path).unwrap().len(),
            size,
            "file length"
        );
        assert_eq!(
            dev.limits().sectors,
            sectors,
            "device sectors for size {size}"
        );
        // Reopening without size= finds the same size.
        drop(dev);
        let dev = FileDevice::open("f", &f.path, FileOpts::default()).unwrap();
        assert_eq!(dev.limits().sectors, sectors, "reopened without size");
    }
    // A size smaller than an existing file uses only that much of it.
    let f = TempFile::new("shrink");
    std::fs::write(&f.path, vec![7u8; 1 << 20]).unwrap();
    let dev = FileDevice::open(
        "f",
        &f.path,
        FileOpts {
            size: Some(64 << 10),
            ..FileOpts::default()
        },
    )
    .unwrap();
    assert_eq!(dev.limits().bytes(), 64 << 10);
    assert_eq!(
        std::fs::metadata(&f.path).unwrap().len(),
        1 << 20,
        "file truncated"
    );
}

#[test]
fn file_read_only_refuses_writes_and_reads_data() {
    let f = TempFile::new("ro");
    let data = pattern(42, 0, 64 << 10);
    std::fs::write(&f.path, &data).unwrap();
    let dev = FileDevice::open(
        "ro",
        &f.path,
        FileOpts {
            read_only: true,
            ..FileOpts::default()
        },
    )
    .unwrap();
    assert!(dev.caps().contains(Caps::READ_ONLY));
    let h = Harness::new(
        "file,ro",
        Fixture::plain(Arc::new(dev)),
        ReactorConfig::default(),
    );
    let (st, got) = h.read(0, 64 << 10);
    assert_eq!(st, Status::Ok);
    assert_same("file,ro", "read", 0, &got, &data);
    assert_eq!(
        h.write(0, &[0u8; 512]),
        Status::Inval,
        "write to a read-only file"
    );
    assert_eq!(
        h.dataless(Op::Discard, BioFlags::NONE, 0, 512),
        Status::Inval
    );
    assert_eq!(
        h.dataless(Op::WriteZeroes, BioFlags::NONE, 0, 512),
        Status::Inval
    );
    assert_eq!(
        h.dataless(Op::Flush, BioFlags::NONE, 0, 0),
        Status::Ok,
        "flush of a read-only file"
    );
    assert_eq!(std::fs::read(&f.path).unwrap(), data, "the file changed");
}

#[test]
fn file_data_persists_across_reopen() {
    let f = TempFile::new("persist");
    let opts = FileOpts {
        size: Some(1 << 20),
        ..FileOpts::default()
    };
    let data = pattern(9, 4096, 8192);
    {
        let h = Harness::new(
            "persist",
            Fixture::plain(Arc::new(
                FileDevice::open("p", &f.path, opts.clone()).unwrap(),
            )),
            ReactorConfig::default(),
        );
        assert_eq!(h.write_flags(8, &data, BioFlags::FUA), Status::Ok);
    }
    let h = Harness::new(
        "persist",
        Fixture::plain(Arc::new(FileDevice::open("p", &f.path, opts).unwrap())),
        ReactorConfig::default(),
    );
    let (st, got) = h.read(8, 8192);
    assert_eq!(st, Status::Ok);
    assert_same("persist", "after reopen", 4096, &got, &data);
}
