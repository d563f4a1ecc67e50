//! Durability across a power cut, for devices over powercut wrappers: what
//! a flush covered, what a FUA write carried and what a PREFLUSH write
//! covered survives; on a bare wrapper, what nothing covered is lost.

use udm_core::{BioFlags, Op, Reactor, ReactorConfig, Status};

use crate::harness::*;

/// Writes, flushes, cuts the power, restores what survived (a clean cut:
/// no torn writes), builds the device again and reads it back.
pub fn check_durability(fx: Fixture, e: &Expect) {
    let label = e.label;
    let (h, rig) = Harness::with_rig(label, fx, ReactorConfig::default());
    let rig = rig.expect("a device over powercut wrappers");
    let len = 16 << 10;
    let mut shadow = Shadow::new(e.bytes);
    let (a, b, c, d, x) = (0u64, 64, 128, 192, 256);

    // A: written, then a flush.
    let data = shadow.next(a, len);
    assert_eq!(h.write(a, &data), Status::Ok, "{label}: write A");
    assert_eq!(
        h.dataless(Op::Flush, BioFlags::NONE, 0, 0),
        Status::Ok,
        "{label}: flush"
    );
    // B: a FUA write.
    let data = shadow.next(b, len);
    assert_eq!(
        h.write_flags(b, &data, BioFlags::FUA),
        Status::Ok,
        "{label}: FUA write B"
    );
    // C: written, then covered by the PREFLUSH of write D (D itself need
    // not survive).
    let data = shadow.next(c, len);
    assert_eq!(h.write(c, &data), Status::Ok, "{label}: write C");
    let data_d = pattern(0xD, d * 512, len);
    assert_eq!(
        h.write_flags(d, &data_d, BioFlags::PREFLUSH),
        Status::Ok,
        "{label}: PREFLUSH write D"
    );
    // X: covered by nothing.
    let data_x = pattern(0xE, x * 512, len);
    assert_eq!(h.write(x, &data_x), Status::Ok, "{label}: write X");

    rig.power.cut();
    assert_ne!(
        h.write(x, &data_x),
        Status::Ok,
        "{label}: a write after the power cut succeeded"
    );
    // Dropping the harness drops the device and its reactor: nothing is in
    // flight on the wrappers while they restore.
    drop(h);
    let reactor = Reactor::new(ReactorConfig::default()).expect("reactor");
    for pc in &rig.cuts {
        pc.restore(&reactor, false, &mut || 0)
            .unwrap_or_else(|err| panic!("{label}: restore: {err}"));
    }
    drop(reactor);
    rig.power.on();

    let h = Harness::new(
        label,
        Fixture::plain((rig.reopen)()),
        ReactorConfig::default(),
    );
    for (sector, what) in [
        (a, "a write a flush covered"),
        (b, "a FUA write"),
        (c, "a write a later PREFLUSH write covered"),
    ] {
        verify(
            &h,
            e,
            &shadow,
            sector,
            len,
            &format!("after the power cut: {what}"),
        );
    }
    if rig.loses_unflushed {
        // The clean cut kept only what was durable: X is gone.
        verify(
            &h,
            e,
            &shadow,
            x,
            len,
            "after the power cut: a write nothing covered (must be lost)",
        );
    }
}
