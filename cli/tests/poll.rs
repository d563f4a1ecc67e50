//! Seed 003 in a real kernel: the file backend's `iopoll` on devices with
//! poll queues, through udm's stacks, in the test guest
//! (`scripts/guest.sh poll`: QEMU/TCG, the Debian 6.12 kernel, a QEMU NVMe
//! disk and null_blk, each with poll queues).

#![allow(clippy::unwrap_used)]

mod common;

/// In one boot: `iopoll` refused on the NVMe disk without poll queues (one
/// line, exit 2); with them, a written pattern reads back intact through
/// the raw NVMe and null_blk devices, linear over NVMe, striped over both
/// (each 128 KiB I/O split into a child per device) and a stripe of a
/// polled and an unpolled device, in each completion mode; and the polling
/// is real: the NVMe's I/O queues raise no interrupt during the polled
/// runs, and do during the same I/O unpolled.
#[test]
fn in_the_guest_iopoll_devices_poll_through_linear_and_striped_in_every_completion_mode() {
    let mut checks = vec![
        "poll_refused_without_poll_queues".to_string(),
        "poll_mixed_striped".to_string(),
        "poll_polled_runs_raise_no_nvme_interrupt".to_string(),
        "poll_unpolled_run_raises_nvme_interrupts".to_string(),
    ];
    for mode in ["interrupt", "poll", "hybrid", "adaptive"] {
        for stack in ["nvme", "nullb", "linear", "striped"] {
            checks.push(format!("poll_{mode}_{stack}"));
        }
    }
    let text = common::guest::run_scenarios(&["poll"], &checks);
    assert!(!text.contains("=FAIL"), "{text}");
}
