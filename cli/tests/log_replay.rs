//! `udm log-replay` end to end: `udm serve` exports a log-writes device
//! over files, qemu-io writes and flushes through NBD, `udm message` sets
//! marks, and the binary replays the log to each mark, running a check
//! command at every flush point.

mod common;

use common::{run, udm, Serve, TempDir};

const KIB: usize = 1024;
const DATA: usize = 8 << 20;

/// What a replay target holds: `fills` of (offset, len, byte) over zeroes.
fn image(fills: &[(usize, usize, u8)]) -> Vec<u8> {
    let mut v = vec![0u8; DATA];
    for &(off, len, b) in fills {
        v[off..off + len].fill(b);
    }
    v
}

#[test]
fn log_replay_replays_a_log_written_over_nbd_to_each_mark() {
    let dir = TempDir::new("log-replay");
    let data = dir.path("data.img");
    let log = dir.path("log.img");
    let sectors = DATA / 512;
    let mut srv = Serve::start(&[
        "--dev",
        &format!("d=file:{},size=8M,buffered", data.display()),
        "--dev",
        &format!("l=file:{},size=64M,buffered", log.display()),
        "--dev",
        &format!("lw=0 {sectors} log-writes d l"),
        "--export",
        "lw",
    ]);
    let uri = srv.uri("lw");
    let ctl = srv.ctl();
    let ctl = ctl.to_str().expect("utf-8 path");
    let io = |cmds: &[&str]| {
        let mut a = vec!["-f", "raw"];
        for c in cmds {
            a.push("-c");
            a.push(c);
        }
        a.push(&uri);
        run("qemu-io", &a);
    };
    let mark = |name: &str| {
        let (code, out, err) = udm(&["message", "--control", ctl, "lw", "0", "mark", name]);
        assert_eq!(code, 0, "mark {name}: {out}{err}");
    };
    io(&["write -P 0x11 0 64k", "flush"]);
    mark("one");
    io(&["write -P 0x22 32k 64k", "write -P 0x33 1M 4k", "flush"]);
    mark("two");
    io(&["write -P 0x44 0 4k"]);
    let (_, status, _) = udm(&["status", "--control", ctl, "lw"]);
    assert!(status.contains("log-writes"), "{status}");
    assert!(srv.stop().success(), "{}", srv.log());

    let target = dir.path("replay.img");
    let checks = dir.path("checks.txt");
    let replay = |extra: &[&str]| {
        std::fs::write(&target, vec![0u8; DATA]).expect("target");
        let _ = std::fs::remove_file(&checks);
        let check = format!(
            "echo \"$UDM_REPLAY_ENTRY $UDM_REPLAY_MARK\" >> {}",
            checks.display()
        );
        let mut a = vec![
            "log-replay",
            "--log",
            log.to_str().expect("utf-8"),
            "--replay",
            target.to_str().expect("utf-8"),
            "--check",
            &check,
        ];
        a.extend_from_slice(extra);
        let (code, out, err) = udm(&a);
        assert_eq!(code, 0, "log-replay {extra:?}: {out}{err}");
        let got = std::fs::read(&target).expect("read target");
        let ran = std::fs::read_to_string(&checks).unwrap_or_default();
        (out, got, ran)
    };

    let (out, got, ran) = replay(&["--end-mark", "one"]);
    assert!(got == image(&[(0, 64 * KIB, 0x11)]), "replay to 'one'");
    // qemu-io's flush, and the one it sends as it closes.
    assert!(ran.lines().count() >= 1, "flushes before 'one': {ran}");
    assert!(
        ran.lines().all(|l| !l.contains("one")),
        "no mark yet: {ran}"
    );
    assert!(out.contains("1 marks"), "{out}");

    let (_, got, ran) = replay(&["--end-mark", "two"]);
    let two = image(&[
        (0, 32 * KIB, 0x11),
        (32 * KIB, 64 * KIB, 0x22),
        (1024 * KIB, 4 * KIB, 0x33),
    ]);
    assert!(got == two, "replay to 'two'");
    let lines: Vec<&str> = ran.lines().collect();
    assert!(lines.len() >= 2, "{ran}");
    assert!(
        lines.last().is_some_and(|l| l.ends_with(" one")),
        "the flushes after 'one' see it as the last mark: {ran}"
    );

    // The whole log (the unflushed write is logged when the target goes)
    // gives what the device holds.
    let (out, got, _) = replay(&[]);
    assert!(
        got == std::fs::read(&data).expect("data"),
        "full replay equals the device: {out}"
    );

    // A failing check stops the replay with status 1.
    std::fs::write(&target, vec![0u8; DATA]).expect("target");
    let (code, _, err) = udm(&[
        "log-replay",
        "--log",
        log.to_str().expect("utf-8"),
        "--replay",
        target.to_str().expect("utf-8"),
        "--check",
        "exit 3",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("check 'exit 3' failed after entry"), "{err}");

    // A file that is no log, and a mark that is not there: one line, status 2.
    let (code, _, err) = udm(&[
        "log-replay",
        "--log",
        target.to_str().expect("utf-8"),
        "--replay",
        "ram:8M",
    ]);
    assert_eq!(code, 2);
    assert!(
        err.contains("not a dm-log-writes log") && err.lines().count() == 1,
        "{err}"
    );
    let (code, _, err) = udm(&[
        "log-replay",
        "--log",
        log.to_str().expect("utf-8"),
        "--replay",
        "ram:8M",
        "--end-mark",
        "three",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("mark 'three' not found"), "{err}");
}
