//! The control socket served by `ControlServer` and spoken by `Client`:
//! verbs over the socket, the socket's file rules and its limits.

#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use udm_control::report::{Info, Status, Tables};
use udm_control::{bind, Client, Control, ControlServer, Op, RemoveMode, MAX_CONNS};
use udm_core::access::Access;
use udm_core::ErrorKind;

fn sock(tag: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("udm-ctl-test-{}-{tag}.sock", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

fn start(tag: &str) -> (ControlServer, Arc<Control>, PathBuf) {
    let p = sock(tag);
    let ctl = Arc::new(Control::default());
    let l = bind(&p, Access::OWNER).unwrap();
    let s = ControlServer::start(l, p.clone(), ctl.clone(), Access::OWNER).unwrap();
    (s, ctl, p)
}

#[test]
fn every_verb_runs_over_the_socket() {
    let (srv, ctl, p) = start("verbs");
    assert_eq!(
        std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let mut c = Client::connect(&p).unwrap();
    let op = |name: &str, spec: &str| Op::Create {
        name: name.into(),
        spec: spec.into(),
        passphrase: None,
    };
    let i: Info = c.call_as(op("a", "ram:1M")).unwrap();
    assert_eq!((i.kind.as_str(), i.sectors), ("ram", 2048));
    c.call(op("b", "null:1M")).unwrap();
    c.call(op("l", "0 2048 linear a 0")).unwrap();
    let e = c.call(op("l", "ram:1M")).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Busy);
    c.call(Op::Load {
        name: "l".into(),
        table: "0 1024 linear b 0; 1024 1024 zero".into(),
    })
    .unwrap();
    let t: Tables = c
        .call_as(Op::Table {
            names: vec!["l".into()],
            show_keys: false,
        })
        .unwrap();
    assert_eq!(t.devices[0].inactive.as_ref().unwrap().len(), 2);
    c.call(Op::Suspend {
        name: "l".into(),
        flush: true,
    })
    .unwrap();
    c.call(Op::Resume { name: "l".into() }).unwrap();
    let s: Status = c.call_as(Op::Status { names: vec![] }).unwrap();
    assert_eq!(s.to_string(), "l: 0 1024 linear\nl: 1024 1024 zero");
    // The in-process Control sees what the socket did.
    assert_eq!(ctl.registry().holders("a"), vec![]);
    c.call(Op::Remove {
        name: "a".into(),
        mode: RemoveMode::Normal,
    })
    .unwrap();
    let e = c
        .call(Op::Remove {
            name: "b".into(),
            mode: RemoveMode::Normal,
        })
        .unwrap_err();
    assert_eq!(e.to_string(), "device 'b' is in use by the table of 'l'");
    assert_eq!(ctl.ls().devices.len(), 2);
    srv.shutdown();
    assert!(!p.exists(), "socket file removed");
    // Closed: changes are refused from now on.
    assert_eq!(
        ctl.create("x", "ram:1M").unwrap_err().kind(),
        ErrorKind::Busy
    );
}

#[test]
fn a_live_socket_is_refused_and_a_stale_one_reclaimed() {
    let (srv, _ctl, p) = start("live");
    let e = bind(&p, Access::OWNER).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Busy);
    assert!(
        e.to_string().contains("another server is listening on it"),
        "{e}"
    );
    srv.shutdown();
    drop(std::os::unix::net::UnixListener::bind(&p).unwrap());
    assert!(p.exists());
    drop(bind(&p, Access::OWNER).unwrap()); // stale: replaced
    std::fs::remove_file(&p).unwrap();
    std::fs::write(&p, b"not a socket").unwrap();
    assert!(bind(&p, Access::OWNER)
        .unwrap_err()
        .to_string()
        .contains("not a socket"));
    std::fs::remove_file(&p).unwrap();
}

#[test]
fn connections_past_the_limit_get_one_busy_reply() {
    let (srv, _ctl, p) = start("limit");
    let held: Vec<Client> = (0..MAX_CONNS)
        .map(|_| {
            let mut c = Client::connect(&p).unwrap();
            c.call(Op::Version {}).unwrap(); // its thread runs
            c
        })
        .collect();
    let extra = UnixStream::connect(&p).unwrap();
    extra
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut l = String::new();
    BufReader::new(&extra).read_line(&mut l).unwrap();
    assert!(
        l.contains(r#""code":"busy","message":"too many control connections (at most 32)""#),
        "{l}"
    );
    drop(held);
    // Their threads let go: a new client is served again.
    let t0 = std::time::Instant::now();
    loop {
        let mut c = Client::connect(&p).unwrap();
        if c.call(Op::Version {}).is_ok() {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = (&extra).write_all(b"{}\n");
    srv.shutdown();
}
