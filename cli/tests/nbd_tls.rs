//! NBD over TLS (`udm serve --tls require`): real clients (nbdinfo,
//! nbdcopy, fio's nbd engine, qemu-img, qemu-io) read back what they wrote
//! with x509 client certificates; plaintext, untrusted, expired and
//! unauthorised certificates are refused, each with what the client
//! prints; a stalled or garbage TLS handshake is cut at the handshake
//! deadline while other clients are served; a TCP listener off loopback
//! needs TLS or --insecure; SIGHUP reloads the credentials.
//!
//! The certificates are made here with openssl: a CA and another CA, a
//! server certificate for localhost/127.0.0.1, client certificates (one
//! expired, by `openssl ca -startdate/-enddate`).

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{free_port, run, Serve, TempDir};

const STACK: &[&str] = &[
    "--dev",
    "ram0=ram:32M",
    "--dev",
    "lin=0 65536 linear ram0 0",
    "--export",
    "lin",
];

/// The client certificate's subject, as --tls-authz takes it.
const CLIENT: &str = "CN=client1,O=Example";

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl (installed by scripts/setup.sh)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Certificates for the tests, in directories laid out as the server and
/// each client expect them.
struct Pki {
    d: TempDir,
}

impl Pki {
    fn new() -> Pki {
        let d = TempDir::new("tls");
        let p = Pki { d };
        p.ca("ca");
        p.ca("other-ca");
        let server_ext = "subjectAltName=DNS:localhost,IP:127.0.0.1\n\
                          extendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n";
        let client_ext = "extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n";
        std::fs::write(p.d.path("server.ext"), server_ext).unwrap();
        std::fs::write(p.d.path("client.ext"), client_ext).unwrap();
        // The server's directories: signed by the CA, by the other CA, and
        // an expired one.
        p.leaf("srv", "ca", "/CN=localhost", "server", None);
        p.leaf("srv-other", "other-ca", "/CN=localhost", "server", None);
        p.leaf("srv-expired", "ca", "/CN=localhost", "server", Some(()));
        // The clients'.
        p.leaf("client", "ca", "/O=Example/CN=client1", "client", None);
        p.leaf(
            "client-other-ca",
            "other-ca",
            "/O=Example/CN=client1",
            "client",
            None,
        );
        p.leaf(
            "client-expired",
            "ca",
            "/O=Example/CN=client1",
            "client",
            Some(()),
        );
        p.leaf(
            "client-intruder",
            "ca",
            "/O=Example/CN=intruder",
            "client",
            None,
        );
        p
    }

    fn path(&self, name: &str) -> PathBuf {
        self.d.path(name)
    }

    fn dir(&self, name: &str) -> String {
        self.path(name).to_str().unwrap().to_string()
    }

    /// A CA: `<name>-key.pem`, `<name>-cert.pem`, and an `openssl ca`
    /// database for the expired certificates it signs.
    fn ca(&self, name: &str) {
        let dir = self.d.path("");
        let key = format!("{name}-key.pem");
        let cert = format!("{name}-cert.pem");
        openssl(
            &dir,
            &[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                &key,
                "-out",
                &cert,
                "-days",
                "3650",
                "-subj",
                &format!("/CN=udm test {name}"),
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ],
        );
        let db = self.d.path(&format!("{name}-db"));
        std::fs::create_dir_all(&db).unwrap();
        std::fs::write(db.join("index.txt"), "").unwrap();
        std::fs::write(db.join("serial"), "1000\n").unwrap();
        std::fs::write(
            self.d.path(&format!("{name}.cnf")),
            format!(
                "[ca]\ndefault_ca = d\n[d]\ndatabase = {name}-db/index.txt\n\
                 new_certs_dir = {name}-db\nserial = {name}-db/serial\ndefault_md = sha256\n\
                 policy = p\nunique_subject = no\n[p]\ncommonName = supplied\n\
                 organizationName = optional\n"
            ),
        )
        .unwrap();
    }

    /// A directory `dir` with the CA's certificate and a key and
    /// certificate for `subj` signed by it: `server-*.pem` or
    /// `client-*.pem` (QEMU's and libnbd's names). `expired`: valid in
    /// 2020 only.
    fn leaf(&self, dir: &str, ca: &str, subj: &str, role: &str, expired: Option<()>) {
        let top = self.d.path("");
        let out = self.d.path(dir);
        std::fs::create_dir_all(&out).unwrap();
        std::fs::copy(
            self.d.path(&format!("{ca}-cert.pem")),
            out.join("ca-cert.pem"),
        )
        .unwrap();
        let key = format!("{dir}/{role}-key.pem");
        let cert = format!("{dir}/{role}-cert.pem");
        let csr = format!("{dir}/{role}.csr");
        openssl(
            &top,
            &[
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                &key,
                "-out",
                &csr,
                "-subj",
                subj,
            ],
        );
        let ext = format!("{role}.ext");
        let ca_cert = format!("{ca}-cert.pem");
        let ca_key = format!("{ca}-key.pem");
        if expired.is_some() {
            openssl(
                &top,
                &[
                    "ca",
                    "-batch",
                    "-config",
                    &format!("{ca}.cnf"),
                    "-cert",
                    &ca_cert,
                    "-keyfile",
                    &ca_key,
                    "-in",
                    &csr,
                    "-out",
                    &cert,
                    "-startdate",
                    "20200101000000Z",
                    "-enddate",
                    "20210101000000Z",
                    "-extfile",
                    &ext,
                    "-notext",
                ],
            );
        } else {
            openssl(
                &top,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &csr,
                    "-CA",
                    &ca_cert,
                    "-CAkey",
                    &ca_key,
                    "-set_serial",
                    &format!("{}", 2 + dir.len() * 7 + role.len()),
                    "-days",
                    "365",
                    "-extfile",
                    &ext,
                    "-out",
                    &cert,
                ],
            );
        }
    }
}

/// `udm serve` on 127.0.0.1:PORT with `extra` flags.
fn serve(extra: &[&str]) -> (Serve, u16) {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut args = STACK.to_vec();
    args.extend(["--listen", &listen]);
    args.extend(extra);
    (Serve::start_as_given(&args), port)
}

fn require(pki: &Pki, extra: &[&str]) -> (Serve, u16) {
    let creds = pki.dir("srv");
    let mut a = vec!["--tls", "require", "--tls-creds", creds.as_str()];
    a.extend(extra);
    serve(&a)
}

fn uri(port: u16, certs: &str) -> String {
    format!("nbds://127.0.0.1:{port}/lin?tls-certificates={certs}")
}

/// Runs a client expected to fail; returns what it printed.
fn fails(cmd: &str, args: &[&str], env: &[(&str, &str)]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e} (installed by scripts/setup.sh)"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{cmd} {args:?} succeeded:\n{text}");
    text
}

/// Whether a client's output says its next write met the server's close
/// (the server refused it after the client's side of the TLS 1.3 handshake
/// had ended): a reset or a broken pipe, as the close's RST or its FIN
/// reached the client first.
fn met_the_close(out: &str) -> bool {
    out.contains("Connection reset by peer") || out.contains("Broken pipe")
}

fn qemu_creds(dir: &str) -> String {
    format!("tls-creds-x509,id=t0,dir={dir},endpoint=client")
}

fn qemu_image(port: u16) -> String {
    format!("driver=nbd,host=127.0.0.1,port={port},export=lin,tls-creds=t0")
}

#[test]
fn nbdinfo_nbdcopy_and_fio_read_back_what_they_wrote_over_tls() {
    let pki = Pki::new();
    let (s, port) = require(&pki, &["--tls-verify-peer", "--tls-authz", CLIENT]);
    assert!(
        s.out()
            .contains(&format!("at nbds://127.0.0.1:{port}/lin\n")),
        "{}",
        s.out()
    );
    assert!(s.out().contains("records in userspace"), "{}", s.out());
    let u = uri(port, &pki.dir("client"));

    let info = run("nbdinfo", &[&u]);
    assert!(info.contains("with TLS"), "{info}");
    assert!(info.contains("export-size: 33554432"), "{info}");

    let d = TempDir::new("tls-copy");
    let src = d.path("src");
    common::random_file(&src, 4 << 20, 7);
    run("nbdcopy", &[src.to_str().unwrap(), &u]);
    let back = d.path("back");
    run("nbdcopy", &[&u, back.to_str().unwrap()]);
    let got = std::fs::read(&back).unwrap();
    assert!(
        got[..4 << 20] == std::fs::read(&src).unwrap()[..],
        "read back differs"
    );

    // fio's nbd engine speaks TLS through libnbd's nbds:// URIs; it may not
    // name a certificate directory, so it runs as an unprivileged user
    // whose $HOME/.pki/libnbd holds the client's.
    let home = TempDir::new("tls-home");
    let pki_dir = home.path(".pki/libnbd");
    std::fs::create_dir_all(&pki_dir).unwrap();
    for f in ["ca-cert.pem", "client-cert.pem", "client-key.pem"] {
        std::fs::copy(pki.path("client").join(f), pki_dir.join(f)).unwrap();
    }
    run("chmod", &["-R", "a+rwX", home.path("").to_str().unwrap()]);
    run(
        "chmod",
        &["a+x", home.path("").parent().unwrap().to_str().unwrap()],
    );
    let fio_uri = format!("nbds://127.0.0.1:{port}/lin");
    let home_s = home.path("").to_str().unwrap().to_string();
    let out = run(
        "setpriv",
        &[
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            "--",
            "env",
            &format!("HOME={home_s}"),
            "fio",
            "--name=tls",
            "--ioengine=nbd",
            &format!("--uri={fio_uri}"),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--size=8M",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_state_save=0",
            &format!("--directory={home_s}"),
        ],
    );
    assert!(out.contains("connected to NBD server"), "{out}");
    assert!(!out.contains("verify:") || !out.contains("bad"), "{out}");
    assert!(s.log().contains(&format!("({CLIENT})")), "{}", s.log());
}

#[test]
fn qemu_img_and_qemu_io_write_and_read_back_over_tls() {
    let pki = Pki::new();
    let (_s, port) = require(&pki, &["--tls-verify-peer"]);
    let creds = qemu_creds(&pki.dir("client"));
    let img = qemu_image(port);
    let info = run(
        "qemu-img",
        &["info", "--object", &creds, "--image-opts", &img],
    );
    assert!(info.contains("32 MiB"), "{info}");
    run(
        "qemu-io",
        &[
            "--object",
            &creds,
            "--image-opts",
            &img,
            "-c",
            "write -P 0x5a 1M 2M",
        ],
    );
    // read -P fails ("Pattern verification failed") unless every byte is 0x5a.
    let out = run(
        "qemu-io",
        &[
            "--object",
            &creds,
            "--image-opts",
            &img,
            "-c",
            "read -P 0x5a 1M 2M",
        ],
    );
    assert!(!out.contains("failed"), "{out}");
    let d = TempDir::new("tls-qemu");
    let raw = d.path("copy.raw");
    run(
        "qemu-img",
        &[
            "convert",
            "--object",
            &creds,
            "--image-opts",
            &img,
            "-O",
            "raw",
            raw.to_str().unwrap(),
        ],
    );
    let data = std::fs::read(&raw).unwrap();
    assert!(data[1 << 20..3 << 20].iter().all(|&b| b == 0x5a));
    assert!(data[..1 << 20].iter().all(|&b| b == 0));
}

/// A raw TCP client for the option phase, in plaintext.
struct RawTcp(TcpStream);

impl RawTcp {
    fn connect(port: u16) -> RawTcp {
        let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut r = RawTcp(s);
        let mut g = [0u8; 18];
        r.0.read_exact(&mut g).unwrap();
        assert_eq!(&g[..16], b"NBDMAGICIHAVEOPT");
        r.0.write_all(&1u32.to_be_bytes()).unwrap(); // FIXED_NEWSTYLE
        r
    }

    fn option(&mut self, opt: u32, data: &[u8]) {
        let mut m = 0x4948_4156_454F_5054u64.to_be_bytes().to_vec();
        m.extend_from_slice(&opt.to_be_bytes());
        m.extend_from_slice(&(data.len() as u32).to_be_bytes());
        m.extend_from_slice(data);
        self.0.write_all(&m).unwrap();
    }

    /// One option reply: (type, data).
    fn reply(&mut self) -> (u32, Vec<u8>) {
        let mut h = [0u8; 20];
        self.0.read_exact(&mut h).unwrap();
        let typ = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
        let mut d = vec![0u8; len as usize];
        self.0.read_exact(&mut d).unwrap();
        (typ, d)
    }

    /// Whether the server closed the connection (EOF, or reset).
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 4096];
        loop {
            match self.0.read(&mut b) {
                Ok(0) | Err(_) => return true,
                Ok(_) => continue, // an alert, then EOF
            }
        }
    }
}

const OPT_EXPORT_NAME: u32 = 1;
const OPT_ABORT: u32 = 2;
const OPT_LIST: u32 = 3;
const OPT_STARTTLS: u32 = 5;
const OPT_INFO: u32 = 6;
const OPT_GO: u32 = 7;
const OPT_STRUCTURED_REPLY: u32 = 8;
const REP_ACK: u32 = 1;
const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;

#[test]
fn plaintext_on_a_require_listener_is_refused_and_learns_no_export() {
    let pki = Pki::new();
    let (s, port) = require(&pki, &[]);
    let plain = format!("nbd://127.0.0.1:{port}/lin");
    let out = fails("nbdinfo", &[&plain], &[("LIBNBD_DEBUG", "1")]);
    assert!(
        out.contains("server replied with error to opt_go request"),
        "{out}"
    );
    assert!(
        out.contains("TLS required: send NBD_OPT_STARTTLS first"),
        "{out}"
    );
    let out = fails("nbdinfo", &["--list", &plain], &[]);
    assert!(
        out.contains("server replied with error to list request"),
        "{out}"
    );
    let out = fails(
        "qemu-img",
        &[
            "info",
            "--image-opts",
            &format!("driver=nbd,host=127.0.0.1,port={port},export=lin"),
        ],
        &[],
    );
    assert!(out.contains("TLS"), "{out}");

    // Byte by byte: every option but STARTTLS and ABORT gets TLS_REQD, and
    // no reply names the export or its size.
    let mut r = RawTcp::connect(port);
    let mut info = 3u32.to_be_bytes().to_vec();
    info.extend_from_slice(b"lin");
    info.extend_from_slice(&0u16.to_be_bytes());
    for (opt, data) in [
        (OPT_LIST, &[][..]),
        (OPT_STRUCTURED_REPLY, &[][..]),
        (OPT_INFO, &info[..]),
        (OPT_GO, &info[..]),
    ] {
        r.option(opt, data);
        let (typ, d) = r.reply();
        assert_eq!(typ, REP_ERR_TLS_REQD, "option {opt}");
        assert!(
            !String::from_utf8_lossy(&d).contains("lin"),
            "option {opt}: {d:?}"
        );
    }
    r.option(OPT_ABORT, &[]);
    assert_eq!(r.reply().0, REP_ACK);
    // EXPORT_NAME cannot be refused: the server closes.
    let mut r = RawTcp::connect(port);
    r.option(OPT_EXPORT_NAME, b"lin");
    assert!(r.closed());
    s.wait_log("EXPORT_NAME before STARTTLS; TLS is required", 1);
}

#[test]
fn certificates_that_do_not_check_out_are_refused() {
    let pki = Pki::new();
    // The client trusts another CA: it refuses the server's certificate.
    let (_s, port) = require(&pki, &[]);
    let out = fails("nbdinfo", &[&uri(port, &pki.dir("client-other-ca"))], &[]);
    assert!(
        out.contains("gnutls_handshake: Error in the certificate verification"),
        "{out}"
    );
    let out = fails(
        "qemu-img",
        &[
            "info",
            "--object",
            &qemu_creds(&pki.dir("client-other-ca")),
            "--image-opts",
            &qemu_image(port),
        ],
        &[],
    );
    assert!(
        out.contains("known issuer") || out.contains("not trusted"),
        "{out}"
    );

    // An expired server certificate (the same CA and subject as the good
    // one: only its dates differ, as openssl confirms). gnutls says no more
    // than that verification failed.
    let v = fails(
        "openssl",
        &[
            "verify",
            "-CAfile",
            &format!("{}/ca-cert.pem", pki.dir("srv-expired")),
            &format!("{}/server-cert.pem", pki.dir("srv-expired")),
        ],
        &[],
    );
    assert!(v.contains("certificate has expired"), "{v}");
    let creds = pki.dir("srv-expired");
    let (_s, port) = serve(&["--tls", "require", "--tls-creds", &creds]);
    let out = fails("nbdinfo", &[&uri(port, &pki.dir("client"))], &[]);
    assert!(
        out.contains("gnutls_handshake: Error in the certificate verification"),
        "{out}"
    );
    let out = fails(
        "qemu-img",
        &[
            "info",
            "--object",
            &qemu_creds(&pki.dir("client")),
            "--image-opts",
            &qemu_image(port),
        ],
        &[],
    );
    assert!(out.contains("The certificate is not trusted"), "{out}");

    // With --tls-verify-peer: no client certificate, one signed by another
    // CA, an expired one; with --tls-authz, one whose subject is not listed.
    let (s, port) = require(&pki, &["--tls-verify-peer", "--tls-authz", CLIENT]);
    let cases = [
        // gnutls offers no certificate the server's CA did not sign.
        ("client-foreign", "TLS: peer sent no certificates"),
        (
            "client-expired",
            "TLS: invalid peer certificate: certificate expired",
        ),
        (
            "client-intruder",
            "'CN=intruder,O=Example' is not in --tls-authz",
        ),
    ];
    for (dir, logged) in cases {
        let out = fails("nbdinfo", &[&uri(port, &pki.dir(dir))], &[]);
        // rustls's alert, as gnutls reports it; or, where the server's
        // close beats the client's next write, that close. The server's
        // log says why it refused.
        assert!(
            out.contains("A TLS fatal alert has been received") || met_the_close(&out),
            "{dir}: {out}"
        );
        s.wait_log(logged, 1);
    }
    let out = fails(
        "qemu-img",
        &[
            "info",
            "--object",
            &qemu_creds(&pki.dir("client-intruder")),
            "--image-opts",
            &qemu_image(port),
        ],
        &[],
    );
    // As nbdinfo: the alert, or the close on qemu-img's next write. The
    // server refused it for the name.
    assert!(out.contains("TLS") || met_the_close(&out), "{out}");
    s.wait_log("'CN=intruder,O=Example' is not in --tls-authz", 2);
    // nbdinfo without certificates of its own (system CAs, no client cert).
    let out = fails(
        "nbdinfo",
        &[&format!("nbds://127.0.0.1:{port}/lin")],
        &[("HOME", "/nonexistent")],
    );
    assert!(out.contains("gnutls"), "{out}");
    // The right one still gets in.
    run("nbdinfo", &[&uri(port, &pki.dir("client"))]);
}

#[test]
fn a_stalled_or_garbage_tls_handshake_is_cut_while_others_are_served() {
    let pki = Pki::new();
    let (s, port) = require(&pki, &["--handshake-timeout", "2"]);
    // Garbage where the ClientHello should be: an alert, then the close.
    let mut g = RawTcp::connect(port);
    g.option(OPT_STARTTLS, &[]);
    assert_eq!(g.reply().0, REP_ACK);
    g.0.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    assert!(g.closed());
    s.wait_log("TLS: ", 1);
    // A client that acknowledges nothing after STARTTLS (and one that
    // stops halfway through its ClientHello) holds nothing but its slot
    // until the deadline.
    let t0 = Instant::now();
    let mut stall = RawTcp::connect(port);
    stall.option(OPT_STARTTLS, &[]);
    assert_eq!(stall.reply().0, REP_ACK);
    let mut half = RawTcp::connect(port);
    half.option(OPT_STARTTLS, &[]);
    assert_eq!(half.reply().0, REP_ACK);
    half.0
        .write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01])
        .unwrap();
    // Meanwhile another client is served.
    run("nbdinfo", &[&uri(port, &pki.dir("client"))]);
    assert!(stall.closed() && half.closed());
    // The deadline is 2 s; the bound only detects a hang.
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
    s.wait_log("handshake not finished within 2s", 2);
    run("nbdinfo", &[&uri(port, &pki.dir("client"))]);
}

#[test]
fn a_listener_off_loopback_needs_tls_or_insecure() {
    let pki = Pki::new();
    let creds = pki.dir("srv");
    for extra in [&[][..], &["--tls", "on", "--tls-creds", &creds][..]] {
        let mut a = vec!["serve", "--listen", "0.0.0.0:0"];
        a.extend(extra);
        let (code, _, err) = common::udm(&a);
        assert_eq!(code, 2, "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.contains("not loopback") && err.contains("TLS") && err.contains("--insecure"),
            "{err}"
        );
    }
    // Written out, or with TLS required, it starts; loopback and unix
    // sockets need neither (the other NBD tests).
    let mut s = Serve::start_as_given(&["--listen", "0.0.0.0:0", "--insecure"]);
    assert!(s.stop().success());
    let mut s = Serve::start_as_given(&[
        "--listen",
        "0.0.0.0:0",
        "--tls",
        "require",
        "--tls-creds",
        &creds,
    ]);
    assert!(s.stop().success());
    // Bad TLS flags are one line each.
    for (args, want) in [
        (&["--tls", "require"][..], "give --tls-creds DIR"),
        (&["--tls-creds", "/nonexistent"][..], "give --tls require"),
        (
            &["--tls", "require", "--tls-creds", "/nonexistent"][..],
            "not a directory",
        ),
        (&["--tls-verify-peer"][..], "need --tls on or --tls require"),
    ] {
        let mut a = vec!["serve"];
        a.extend(args);
        let (code, _, err) = common::udm(&a);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(
            err.contains(want) && err.lines().count() == 1,
            "{args:?}: {err}"
        );
    }
}

#[test]
fn sighup_reloads_the_credentials_for_new_connections() {
    let pki = Pki::new();
    let live = TempDir::new("tls-live");
    let put = |from: &str| {
        for f in ["ca-cert.pem", "server-cert.pem", "server-key.pem"] {
            std::fs::copy(pki.path(from).join(f), live.path(f)).unwrap();
        }
    };
    put("srv");
    let creds = live.path("").to_str().unwrap().to_string();
    let (s, port) = serve(&["--tls", "require", "--tls-creds", &creds]);
    run("nbdinfo", &[&uri(port, &pki.dir("client"))]);
    fails("nbdinfo", &[&uri(port, &pki.dir("client-other-ca"))], &[]);

    let pid = s.child.as_ref().unwrap().id() as i32;
    put("srv-other");
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid, libc::SIGHUP) };
    s.wait_log("TLS credentials reloaded", 1);
    run("nbdinfo", &[&uri(port, &pki.dir("client-other-ca"))]);
    fails("nbdinfo", &[&uri(port, &pki.dir("client"))], &[]);

    // A broken file: the credentials in force stay.
    std::fs::write(live.path("server-cert.pem"), "not a certificate\n").unwrap();
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGHUP) };
    s.wait_log("TLS credentials not reloaded", 1);
    run("nbdinfo", &[&uri(port, &pki.dir("client-other-ca"))]);
}

#[test]
fn daemon_exports_take_tls_from_export_add_and_the_config_file() {
    use common::daemon::Daemon;
    let pki = Pki::new();
    let creds = pki.dir("srv");
    let port = free_port();
    let dir = TempDir::new("tls-daemon");
    let cfg = dir.path("udm.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[device]]\nname = \"ram0\"\nspec = \"ram:32M\"\n\n\
             [[device]]\nname = \"lin\"\ntable = \"0 65536 linear ram0 0\"\n\n\
             [[export]]\ndevice = \"lin\"\nnbd = \"127.0.0.1:{port}\"\ntls = \"require\"\n\
             tls_creds = \"{creds}\"\ntls_verify_peer = true\ntls_authz = [\"{CLIENT}\"]\n"
        ),
    )
    .unwrap();
    let d = Daemon::start(&["--config", cfg.to_str().unwrap()]);
    let ls = d.ok(&["export", "ls"]);
    assert!(ls.contains(&format!("nbds://127.0.0.1:{port}/lin")), "{ls}");
    // export ls says what clients are asked for and where records are made
    // (this host's kernel has no TLS; the guest's ktls scenario has it).
    assert!(
        ls.contains("TLS require") && ls.contains("subjects CN=client1,O=Example"),
        "{ls}"
    );
    assert!(
        ls.contains("records in the kernel (kTLS") || ls.contains("records in userspace (rustls"),
        "{ls}"
    );
    run("nbdinfo", &[&uri(port, &pki.dir("client"))]);
    let out = fails("nbdinfo", &[&format!("nbd://127.0.0.1:{port}/lin")], &[]);
    assert!(out.contains("Operation not supported"), "{out}");
    fails("nbdinfo", &[&uri(port, &pki.dir("client-intruder"))], &[]);
    // dump-config keeps it.
    let dump = d.ok(&["dump-config"]);
    assert!(
        dump.contains("tls = \"require\"") && dump.contains(CLIENT),
        "{dump}"
    );

    // export add: off loopback without TLS is refused, with it served.
    let e = d.fails(&[
        "export",
        "add",
        "--nbd",
        "0.0.0.0:0",
        "--export-name",
        "x",
        "lin",
    ]);
    assert!(
        e.contains("not loopback") && e.contains("--insecure"),
        "{e}"
    );
    let port2 = free_port();
    let addr = format!("127.0.0.1:{port2}");
    d.ok(&[
        "export",
        "add",
        "--nbd",
        &addr,
        "--export-name",
        "lin2",
        "--tls",
        "require",
        "--tls-creds",
        &creds,
        "lin",
    ]);
    run(
        "nbdinfo",
        &[&format!(
            "nbds://{addr}/lin2?tls-certificates={}",
            pki.dir("client")
        )],
    );
    let e = d.fails(&[
        "export",
        "add",
        "--nbd",
        "127.0.0.1:0",
        "--tls",
        "require",
        "--tls-creds",
        "rel/dir",
        "--export-name",
        "rel",
        "lin",
    ]);
    assert!(e.contains("absolute path"), "{e}");
    let e = d.fails(&[
        "export",
        "add",
        "--vhost-user-blk",
        &dir.path("v.sock").to_string_lossy(),
        "--tls",
        "require",
        "--export-name",
        "v",
        "lin",
    ]);
    assert!(e.contains("--tls"), "{e}");
    // SIGHUP reloads every export's credentials.
    // SAFETY: signalling our own child.
    unsafe { libc::kill(d.pid() as i32, libc::SIGHUP) };
    let t0 = Instant::now();
    while d.log().matches("TLS credentials reloaded").count() < 2 {
        assert!(t0.elapsed() < Duration::from_secs(10), "{}", d.log());
        std::thread::sleep(Duration::from_millis(10));
    }
}
