//! The verbs on a registry of RAM disks: what each changes and refuses.

use super::*;

fn stack() -> Control {
    Control::build(&["ram0=ram:1M", "ram1=ram:1M", "lin=0 2048 linear ram0 0"]).unwrap()
}

#[test]
fn load_then_resume_swaps_the_table_and_clear_drops_it() {
    let c = stack();
    c.load("lin", "0 2048 linear ram1 0").unwrap();
    let t = c.table(&["lin".into()]).unwrap();
    assert_eq!(t.devices[0].targets[0].table, "0 2048 linear ram0 0");
    assert_eq!(
        t.devices[0].inactive.as_deref(),
        Some(&["0 2048 linear ram1 0".to_string()][..])
    );
    assert!(c.info("lin").unwrap().inactive_table);
    c.resume("lin").unwrap();
    let t = c.table(&["lin".into()]).unwrap();
    assert_eq!(t.devices[0].targets[0].table, "0 2048 linear ram1 0");
    assert_eq!(t.devices[0].inactive, None);
    // ram0 is free now; ram1 is held by the live table.
    c.remove("ram0", RemoveMode::Normal).unwrap();
    assert!(c.remove("ram1", RemoveMode::Normal).is_err());
    c.load("lin", "0 2048 zero").unwrap();
    c.clear("lin").unwrap();
    assert!(!c.info("lin").unwrap().inactive_table);
}

#[test]
fn suspend_holds_io_until_resume() {
    let c = stack();
    c.suspend("lin", true).unwrap();
    assert!(c.info("lin").unwrap().suspended);
    assert!(c.table(&[]).unwrap().to_string().contains(", suspended"));
    let e = c.suspend("lin", true).err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Busy);
    c.resume("lin").unwrap();
    assert!(!c.info("lin").unwrap().suspended);
    assert!(c.suspend("ram0", false).is_err());
}

#[test]
fn reload_keeps_the_table_rules_and_names_the_device() {
    let c = stack();
    c.reload("lin", "0 1024 linear ram0 0; 1024 1024 zero")
        .unwrap();
    let s = c.status(&[]).unwrap().to_string();
    assert_eq!(s, "lin: 0 1024 linear\nlin: 1024 1024 zero");
    let e = c.reload("lin", "0 8 zero").err().unwrap().to_string();
    assert!(
        e.starts_with("reload 'lin': the new table has 8 sectors"),
        "{e}"
    );
    let e = c.reload("lin", "0 2048 frob").err().unwrap().to_string();
    assert!(e.contains("unknown target type 'frob'"), "{e}");
}

#[test]
fn reads_name_unknown_devices_and_list_the_rest() {
    let c = stack();
    let e = c.status(&["nope".into()]).err().unwrap();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    assert_eq!(e.to_string(), "unknown device 'nope'");
    assert_eq!(c.ls().devices.len(), 3);
    assert_eq!(
        c.deps("lin").unwrap().to_string(),
        "1 dependencies\t: (ram0)"
    );
    let t = c.targets();
    assert!(t.targets.iter().any(|t| t.name == "writecache"));
    assert_eq!(c.version().protocol, PROTOCOL_VERSION);
    let e = c.message("lin", 0, &["flush"]).err().unwrap().to_string();
    assert!(e.starts_with("device 'lin': "), "{e}");
}

#[test]
fn build_takes_name_spec_pairs_and_names_the_bad_one() {
    let err = |defs: &[&str]| Control::build(defs).err().unwrap().to_string();
    assert!(err(&["ram0"]).contains("--dev 'ram0': expected NAME=SPEC"));
    assert!(err(&["a=ram:1G", "a=ram:1G"]).contains("device 'a': device 'a' already exists"));
    assert!(err(&["a=disk:1G"]).contains("unknown backend 'disk:'"));
    assert!(err(&["r=ram:4k", "l=0 16 linear r 0"]).starts_with("device 'l': "));
}

#[test]
fn close_waits_for_a_change_in_progress() {
    let c = Arc::new(stack());
    let (tx, rx) = std::sync::mpsc::channel();
    let c2 = c.clone();
    let released = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let r2 = released.clone();
    let t = std::thread::spawn(move || {
        let g = c2.change().unwrap();
        tx.send(()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        r2.store(true, std::sync::atomic::Ordering::SeqCst);
        drop(g);
    });
    rx.recv().unwrap();
    c.close();
    // close returned only after the change was let go, whatever the timing.
    assert!(released.load(std::sync::atomic::Ordering::SeqCst));
    t.join().unwrap();
    assert_eq!(
        c.reload("lin", "0 2048 zero").unwrap_err().kind(),
        ErrorKind::Busy
    );
}

#[test]
fn a_deferred_remove_happens_when_the_last_holder_goes() {
    let c = stack();
    c.remove("ram0", RemoveMode::Deferred).unwrap();
    let i = c.info("ram0").unwrap();
    assert!(i.deferred_remove, "held by lin: only marked");
    assert!(i.to_string().contains("Deferred remove:   pending"));
    let nbd = Holder::Export {
        name: "lin".into(),
        protocol: "nbd".into(),
    };
    c.hold("lin", nbd.clone()).unwrap();
    c.remove("lin", RemoveMode::Deferred).unwrap();
    assert!(c.info("lin").is_ok() && c.info("ram0").is_ok());
    // The export goes: lin goes, then ram0, which only lin held.
    c.release("lin", &nbd).unwrap();
    assert_eq!(c.info("lin").unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(c.info("ram0").unwrap_err().kind(), ErrorKind::NotFound);
    // Nothing holds ram1: a deferred remove is immediate.
    c.remove("ram1", RemoveMode::Deferred).unwrap();
    assert!(c.ls().devices.is_empty());
}

#[test]
fn a_forced_remove_fails_the_holders_io_and_refuses_held_backends() {
    let c = Control::build(&[
        "ram0=ram:1M",
        "lin=0 2048 linear ram0 0",
        "top=0 2048 linear lin 0",
        "ram1=ram:1M",
        "l1=0 2048 linear ram1 0",
    ])
    .unwrap();
    let top = c.get("top").unwrap();
    c.remove("lin", RemoveMode::Force).unwrap();
    assert!(c.info("lin").is_err(), "gone from the registry");
    // top still holds the device, whose table now fails every I/O.
    let top = top.as_any().downcast_ref::<MappedDevice>().unwrap().table();
    let lin = top.devices[0]
        .as_any()
        .downcast_ref::<MappedDevice>()
        .unwrap();
    assert_eq!(lin.table().table_lines(), vec!["0 2048 error".to_string()]);
    // ram0 is free now (the error table uses no device): it just goes.
    c.remove("ram0", RemoveMode::Force).unwrap();
    // A backend held by a table cannot be made to fail: refused.
    let e = c.remove("ram1", RemoveMode::Force).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Busy);
    assert!(
        e.to_string()
            .contains("only a mapped device's I/O can be failed"),
        "{e}"
    );
}

#[test]
fn remove_all_goes_top_down_and_stops_at_a_held_device() {
    let c = stack();
    let nbd = Holder::Export {
        name: "lin".into(),
        protocol: "nbd".into(),
    };
    c.hold("lin", nbd.clone()).unwrap();
    let e = c.remove_all(RemoveMode::Normal).unwrap_err().to_string();
    assert!(e.contains("in use by the nbd export 'lin'"), "{e}");
    c.release("lin", &nbd).unwrap();
    let r = c.remove_all(RemoveMode::Normal).unwrap();
    assert_eq!(r.removed, vec!["lin", "ram1", "ram0"]);
}

#[test]
fn wait_returns_when_a_table_swap_passes_the_event_number() {
    let c = Arc::new(stack());
    assert_eq!(c.info("lin").unwrap().event_nr, 0);
    let e = c
        .wait("lin", 0, Some(Duration::from_millis(50)))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::TimedOut);
    let c2 = c.clone();
    let t = std::thread::spawn(move || c2.wait("lin", 0, Some(Duration::from_secs(10))));
    std::thread::sleep(Duration::from_millis(50));
    c.reload("lin", "0 2048 linear ram1 0").unwrap();
    assert_eq!(t.join().unwrap().unwrap().event_nr, 1);
    // Already past: at once.
    assert_eq!(c.wait("lin", 0, None).unwrap().event_nr, 1);
    // A device removed under a waiter ends the wait with an error.
    let c3 = c.clone();
    let t = std::thread::spawn(move || c3.wait("lin", 5, Some(Duration::from_secs(10))));
    std::thread::sleep(Duration::from_millis(50));
    c.remove("lin", RemoveMode::Normal).unwrap();
    assert_eq!(t.join().unwrap().unwrap_err().kind(), ErrorKind::NotFound);
}

#[test]
fn after_close_changes_are_refused_and_reads_go_on() {
    let c = stack();
    c.suspend("lin", false).unwrap();
    c.close();
    assert!(!c.info("lin").unwrap().suspended, "close resumes");
    let e = c.create("x", "ram:1M").err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Busy);
    assert!(c.status(&[]).is_ok());
}
