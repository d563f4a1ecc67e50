//! The target contract as data and the per-reactor hooks: a target is
//! told on each reactor when a table holding it opens there and when it
//! closes, on that reactor's thread, once each; the core checks argument
//! counts before a constructor runs; the registry lists its types.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;

use common::{pattern, wait_for, Devices, ReactorThread};
use udm_core::{BioPtr, BlockDevice, Error, Reactor};
use udm_mapper::{
    CtrCtx, DevArea, Map, MapCtx, MappedDevice, Registry, StatusType, Table, Target, TargetType,
};

/// One hook call: the table's tag, the reactor's id, the thread it ran on.
type Call = (String, usize, ThreadId);

/// Every hook call of the `counting` targets, in order.
#[derive(Default)]
struct Log {
    opens: Vec<Call>,
    closes: Vec<Call>,
}

static LOG: Mutex<Option<Log>> = Mutex::new(None);

fn log() -> std::sync::MutexGuard<'static, Option<Log>> {
    LOG.lock().unwrap_or_else(|p| p.into_inner())
}

/// A linear remap at offset 0 that records its hook calls under its tag.
struct Counting {
    devs: [DevArea; 1],
    tag: String,
}

const COUNTING: TargetType = TargetType {
    name: "counting",
    version: [1, 0, 0],
    summary: "maps onto a device and records its reactor hooks",
    usage: "<dev> <tag>",
    min_args: 2,
    max_args: Some(2),
    splits: false,
    exclusive_args: &[],
    ctr: counting_ctr,
};

fn counting_ctr(ctx: &CtrCtx<'_>, argv: &[&str]) -> Result<Box<dyn Target>, Error> {
    Ok(Box::new(Counting {
        devs: [DevArea {
            dev: ctx.get_device(argv[0])?,
            start: 0,
            len: ctx.len,
        }],
        tag: argv[1].to_string(),
    }))
}

impl Target for Counting {
    fn map(&self, bio: BioPtr, _ctx: &MapCtx<'_>) -> Map {
        Map::Remapped(bio, 0)
    }
    fn devices(&self) -> &[DevArea] {
        &self.devs
    }
    fn status(&self, _ty: StatusType, _out: &mut String) {}
    fn no_clone(&self) -> bool {
        true
    }
    fn reactor_open(&self, reactor: &Reactor) {
        let call = (self.tag.clone(), reactor.id(), std::thread::current().id());
        log().get_or_insert_with(Log::default).opens.push(call);
    }
    fn reactor_close(&self, reactor_id: usize) {
        let call = (self.tag.clone(), reactor_id, std::thread::current().id());
        log().get_or_insert_with(Log::default).closes.push(call);
    }
}

/// The calls of table `tag`, by reactor id: (opens, closes) each with the
/// thread it ran on.
fn calls(tag: &str) -> HashMap<usize, (Vec<ThreadId>, Vec<ThreadId>)> {
    let mut out: HashMap<usize, (Vec<ThreadId>, Vec<ThreadId>)> = HashMap::new();
    let g = log();
    let Some(l) = g.as_ref() else { return out };
    for (t, id, th) in &l.opens {
        if t == tag {
            out.entry(*id).or_default().0.push(*th);
        }
    }
    for (t, id, th) in &l.closes {
        if t == tag {
            out.entry(*id).or_default().1.push(*th);
        }
    }
    out
}

fn closes(tag: &str) -> usize {
    calls(tag).values().map(|c| c.1.len()).sum()
}

/// Opens and closes of a table across two reactors and a live reload: one
/// open per reactor when the device's channel opens there, one per reactor
/// for the new table when it is swapped in, one close per reactor for the
/// old table once it is out of use there, and one for the new one when the
/// reactors end; each on its reactor's own thread.
#[test]
fn targets_hear_of_each_reactor_a_table_opens_and_closes_on() {
    let mut devs = Devices::new();
    devs.ram("ram0", 256);
    let mut reg = Registry::builtin();
    reg.register(COUNTING);
    let resolve = |name: &str| Ok(devs.get(name));
    let table = |tag: &str| {
        Table::from_text(&format!("0 256 counting ram0 {tag}"), &reg, &resolve).expect("table")
    };
    let md = MappedDevice::new("hooks", table("old"));
    let dev: Arc<dyn BlockDevice> = md.clone();
    let (r1, r2) = (
        ReactorThread::spawn("hooks-1"),
        ReactorThread::spawn("hooks-2"),
    );
    assert!(calls("old").is_empty(), "no reactor has the table open yet");

    r1.write(&dev, 0, pattern(1, 0, 8));
    assert_eq!(r2.read(&dev, 0, 8), pattern(1, 0, 8));
    let old = calls("old");
    assert_eq!(old.len(), 2, "opened on two reactors: {:?}", old.keys());
    for (id, (o, c)) in &old {
        assert_eq!(
            (o.len(), c.len()),
            (1, 0),
            "reactor {id}: one open, no close"
        );
    }

    // A second I/O on the same reactor reuses the open table.
    r1.read(&dev, 0, 8);
    assert_eq!(calls("old")[&r1_id(&old, &r1)].0.len(), 1);

    md.replace(table("new")).expect("replace");
    let new = calls("new");
    assert_eq!(new.len(), 2, "the new table opened on both reactors");
    assert!(new.keys().all(|id| old.contains_key(id)), "on the same two");
    // The old one closes on each reactor once nothing runs on it there.
    wait_for("the old table to close on both reactors", || {
        closes("old") == 2
    });
    r2.write(&dev, 8, pattern(2, 8, 8));
    assert_eq!(r1.read(&dev, 8, 8), pattern(2, 8, 8));
    assert_eq!(closes("new"), 0, "the new table is still open");

    drop((r1, r2));
    assert_eq!(closes("new"), 2, "closed on both reactors as they ended");
    for tag in ["old", "new"] {
        for (id, (o, c)) in calls(tag) {
            assert_eq!((o.len(), c.len()), (1, 1), "'{tag}' on reactor {id}");
            assert_eq!(
                o, c,
                "'{tag}' on reactor {id}: closed on the thread it opened on"
            );
        }
    }
}

/// The id of the reactor of `rt`, among those in `seen`.
fn r1_id(seen: &HashMap<usize, (Vec<ThreadId>, Vec<ThreadId>)>, rt: &ReactorThread) -> usize {
    let (tx, rx) = std::sync::mpsc::channel();
    rt.exec(move |r| tx.send(r.id()).expect("send id"));
    let id = rx.recv().expect("reactor id");
    assert!(seen.contains_key(&id), "reactor {id} had opened the table");
    id
}

/// The core checks a line's argument count against its type before the
/// constructor runs, in one line naming the target and what it takes.
#[test]
fn argument_counts_are_checked_from_the_type() {
    let mut devs = Devices::new();
    devs.ram("ram0", 64);
    let cases = [
        (
            "0 8 linear ram0",
            "linear: not enough arguments (1): expected 2 (<dev> <offset>)",
        ),
        (
            "0 8 linear ram0 0 9",
            "linear: too many arguments (3): expected 2 (<dev> <offset>)",
        ),
        (
            "0 8 zero 1",
            "zero: too many arguments (1): expected no arguments",
        ),
        (
            "0 8 error x y",
            "error: too many arguments (2): expected no arguments",
        ),
        (
            "0 8 striped 1",
            "striped: not enough arguments (1): expected at least 2",
        ),
        (
            "0 8 writecache s ram0",
            "writecache: not enough arguments (2): expected at least 5",
        ),
    ];
    for (text, want) in cases {
        let e = devs.table_err(text);
        assert!(e.contains("table line 1"), "'{text}': {e}");
        assert!(e.contains(want), "'{text}': expected '{want}' in: {e}");
        assert!(!e.contains('\n'), "'{text}': one line: {e}");
    }
}

/// Every built-in type describes itself, and the registry lists them by
/// name.
#[test]
fn the_registry_lists_every_type_described() {
    let reg = Registry::builtin();
    let types = reg.types();
    let names: Vec<&str> = types.iter().map(|t| t.name).collect();
    assert_eq!(
        names,
        [
            "crypt",
            "delay",
            "dust",
            "error",
            "flakey",
            "linear",
            "log-writes",
            "raid",
            "striped",
            "thin",
            "thin-pool",
            "writecache",
            "zero"
        ]
    );
    let mut sorted = reg.names();
    sorted.sort();
    assert_eq!(sorted, names, "names() and types() agree");
    for t in &types {
        assert!(
            !t.summary.is_empty() && !t.summary.contains('\n'),
            "{}",
            t.name
        );
        assert!(t.max_args.is_none_or(|m| m >= t.min_args), "{}", t.name);
        let usage_args = t.usage.split_whitespace().count();
        assert!(
            usage_args >= t.min_args,
            "{}: usage names the required arguments",
            t.name
        );
        for &i in t.exclusive_args {
            assert!(t.max_args.is_none_or(|m| i < m), "{}: arg {i}", t.name);
        }
    }
    let by = |n: &str| types.iter().find(|t| t.name == n).expect("type");
    assert!(by("striped").splits, "striped splits at its chunks");
    assert!(!by("linear").splits);
    assert_eq!(by("writecache").exclusive_args, &[2], "its cache device");
    assert_eq!(by("linear").usage, "<dev> <offset>");
}
