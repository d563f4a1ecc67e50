//! Prometheus metrics over HTTP: every mapped device's I/O statistics in
//! the text exposition format (version 0.0.4), at `GET /metrics` (and `/`).
//!
//! A minimal HTTP/1.1 responder on a std `TcpListener`, on its own thread:
//! a scrape is one small GET, answered and closed, so a server crate would
//! bring more code than it saves. Requests are served one at a time, each
//! with a 2 s read timeout; a request head longer than 8 KiB gets 431.
//!
//! Counters are totals since each device was created (`udm stats --clear`
//! does not reset them, so they only grow, as Prometheus expects).

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use udm_core::{Error, Op};
use udm_mapper::stats::{bucket_upper_ns, BUCKETS};

use crate::stats::{as_mapped, OP_NAMES};
use crate::verbs::Control;

/// Longest request head read, in bytes.
const MAX_HEAD: usize = 8 << 10;

/// The metrics endpoint; stops (and joins its thread) on drop or
/// [`MetricsServer::shutdown`].
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// The address of `--metrics ADDR`: `PORT` or `:PORT` is loopback
/// (127.0.0.1), so that no other host reaches the metrics unless an address
/// is written out (`HOST:PORT`, `0.0.0.0:PORT`, `[::]:PORT`).
pub fn parse_addr(s: &str) -> Result<SocketAddr, Error> {
    let port = s.strip_prefix(':').unwrap_or(s);
    if let Ok(p) = port.parse::<u16>() {
        return Ok(SocketAddr::from(([127, 0, 0, 1], p)));
    }
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    use std::net::ToSocketAddrs;
    match s.to_socket_addrs().map(|mut a| a.next()) {
        Ok(Some(a)) => Ok(a),
        _ => Err(Error::invalid(format!(
            "--metrics '{s}': expected PORT, :PORT (both on 127.0.0.1) or HOST:PORT"
        ))),
    }
}

/// Serves `control`'s devices' metrics at `addr` (port 0: any free port;
/// see [`MetricsServer::local_addr`]).
pub fn serve_metrics(addr: SocketAddr, control: Arc<Control>) -> Result<MetricsServer, Error> {
    let l = TcpListener::bind(addr).map_err(|e| Error::os(format!("metrics address {addr}"), e))?;
    let addr = l
        .local_addr()
        .map_err(|e| Error::os(format!("metrics address {addr}"), e))?;
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let thread = std::thread::Builder::new()
        .name("udm-metrics".into())
        .spawn(move || accept_loop(l, control, s))
        .map_err(|e| Error::os("spawning the metrics thread", e))?;
    Ok(MetricsServer {
        addr,
        stop,
        thread: Some(thread),
    })
}

impl MetricsServer {
    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops serving: the request being answered finishes, then the
    /// thread exits and the socket closes.
    pub fn shutdown(&mut self) {
        let Some(t) = self.thread.take() else {
            return;
        };
        self.stop.store(true, Ordering::Release);
        // Wakes the blocking accept; it sees the flag and returns.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        let _ = t.join();
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(l: TcpListener, control: Arc<Control>, stop: Arc<AtomicBool>) {
    for conn in l.incoming() {
        if stop.load(Ordering::Acquire) {
            return;
        }
        match conn {
            Ok(s) => {
                if let Err(e) = answer(s, &control) {
                    tracing::debug!("metrics: {e}");
                }
            }
            Err(e) => {
                tracing::warn!("metrics: accept: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// Reads one request head and answers it.
fn answer(mut s: TcpStream, control: &Control) -> std::io::Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        if head.len() > MAX_HEAD {
            return respond(
                &mut s,
                "431 Request Header Fields Too Large",
                "text/plain",
                "request head too long\n",
            );
        }
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = head.split(|&b| b == b'\n').next().unwrap_or(&[]);
    let line = String::from_utf8_lossy(line);
    let mut w = line.split_whitespace();
    match (w.next(), w.next()) {
        (Some("GET"), Some("/metrics" | "/")) => respond(
            &mut s,
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            &render(control),
        ),
        (Some("GET"), Some(_)) => respond(&mut s, "404 Not Found", "text/plain", "try /metrics\n"),
        (Some(_), Some(_)) => respond(&mut s, "405 Method Not Allowed", "text/plain", "GET only\n"),
        _ => respond(
            &mut s,
            "400 Bad Request",
            "text/plain",
            "malformed request\n",
        ),
    }
}

fn respond(s: &mut TcpStream, status: &str, ctype: &str, body: &str) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body.as_bytes())?;
    s.flush()
}

/// A label value, escaped as the exposition format wants.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Every mapped device's metrics, in the text exposition format.
pub fn render(control: &Control) -> String {
    struct Dev {
        name: String,
        snap: udm_mapper::stats::Snapshot,
        inflight: Option<u64>,
        timed: bool,
    }
    let devs: Vec<Dev> = control
        .devices()
        .iter()
        .filter_map(|d| {
            let m = as_mapped(&**d)?;
            Some(Dev {
                name: label(d.name()),
                snap: m.stats().total(),
                inflight: m.inflight().ok(),
                timed: m.stats().histogram(),
            })
        })
        .collect();
    let mut o = String::new();
    type Counter = (&'static str, &'static str, fn(&Dev) -> u64);
    let counters: [Counter; 10] = [
        ("udm_reads_total", "Completed reads.", |d| {
            d.snap.ios[Op::Read as usize]
        }),
        ("udm_read_bytes_total", "Bytes read.", |d| {
            d.snap.bytes[Op::Read as usize]
        }),
        ("udm_writes_total", "Completed writes.", |d| {
            d.snap.ios[Op::Write as usize]
        }),
        ("udm_write_bytes_total", "Bytes written.", |d| {
            d.snap.bytes[Op::Write as usize]
        }),
        ("udm_discards_total", "Completed discards.", |d| {
            d.snap.ios[Op::Discard as usize]
        }),
        ("udm_discard_bytes_total", "Bytes discarded.", |d| {
            d.snap.bytes[Op::Discard as usize]
        }),
        ("udm_write_zeroes_total", "Completed write-zeroes.", |d| {
            d.snap.ios[Op::WriteZeroes as usize]
        }),
        ("udm_write_zeroes_bytes_total", "Bytes zeroed.", |d| {
            d.snap.bytes[Op::WriteZeroes as usize]
        }),
        ("udm_flushes_total", "Completed flushes.", |d| {
            d.snap.ios[Op::Flush as usize]
        }),
        ("udm_errors_total", "Completions with an error.", |d| {
            d.snap.errors
        }),
    ];
    for (name, help, get) in counters {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter");
        for d in &devs {
            let _ = writeln!(o, "{name}{{device=\"{}\"}} {}", d.name, get(d));
        }
    }
    let _ = writeln!(
        o,
        "# HELP udm_inflight I/Os in flight.\n# TYPE udm_inflight gauge"
    );
    for d in &devs {
        if let Some(n) = d.inflight {
            let _ = writeln!(o, "udm_inflight{{device=\"{}\"}} {n}", d.name);
        }
    }
    let _ = writeln!(
        o,
        "# HELP udm_latency_seconds I/O latency, submit to completion (devices with timing on).\n# TYPE udm_latency_seconds histogram"
    );
    for d in devs.iter().filter(|d| d.timed) {
        for (op, opname) in OP_NAMES.iter().enumerate() {
            let h = &d.snap.hist[op];
            let mut cum = 0u64;
            for (b, &n) in h.iter().enumerate().take(BUCKETS) {
                cum += n;
                let le = match bucket_upper_ns(b) {
                    Some(ns) => format!("{}", ns as f64 / 1e9),
                    None => "+Inf".to_string(),
                };
                let _ = writeln!(
                    o,
                    "udm_latency_seconds_bucket{{device=\"{}\",op=\"{opname}\",le=\"{le}\"}} {cum}",
                    d.name
                );
            }
            let _ = writeln!(
                o,
                "udm_latency_seconds_sum{{device=\"{}\",op=\"{opname}\"}} {}",
                d.name,
                d.snap.sum_ns[op] as f64 / 1e9
            );
            let _ = writeln!(
                o,
                "udm_latency_seconds_count{{device=\"{}\",op=\"{opname}\"}} {cum}",
                d.name
            );
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(addr: SocketAddr, req: &str) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(req.as_bytes()).unwrap();
        let mut r = String::new();
        s.read_to_string(&mut r).unwrap();
        r
    }

    #[test]
    fn a_bare_port_is_loopback_and_other_addresses_are_written_out() {
        let lo = |p| SocketAddr::from(([127, 0, 0, 1], p));
        assert_eq!(parse_addr("9100").unwrap(), lo(9100));
        assert_eq!(parse_addr(":9100").unwrap(), lo(9100));
        assert_eq!(
            parse_addr("0.0.0.0:9100").unwrap(),
            "0.0.0.0:9100".parse().unwrap()
        );
        assert_eq!(
            parse_addr("[::]:9100").unwrap(),
            "[::]:9100".parse().unwrap()
        );
        let e = parse_addr("nope").unwrap_err().to_string();
        assert_eq!(
            e,
            "--metrics 'nope': expected PORT, :PORT (both on 127.0.0.1) or HOST:PORT"
        );
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn metrics_are_served_over_http_and_the_server_stops_on_drop() {
        let c = Arc::new(Control::default());
        c.create("r", "ram:1M").unwrap();
        c.create("lin", "0 2048 linear r 0").unwrap();
        c.message("lin", 0, &["stats", "histogram", "on"]).unwrap();
        let m = serve_metrics("127.0.0.1:0".parse().unwrap(), c.clone()).unwrap();
        let addr = m.local_addr();
        let r = get(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
        assert!(r.contains("# TYPE udm_reads_total counter\n"), "{r}");
        assert!(r.contains("udm_reads_total{device=\"lin\"} 0\n"), "{r}");
        assert!(
            r.contains("udm_latency_seconds_bucket{device=\"lin\",op=\"read\",le=\"+Inf\"} 0\n"),
            "{r}"
        );
        // Backends have no statistics (yet): only the mapped device.
        assert!(!r.contains("device=\"r\""), "{r}");
        assert!(get(addr, "GET /nope HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
        assert!(get(addr, "POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
        assert!(get(addr, "garbage\r\n\r\n").starts_with("HTTP/1.1 400"));
        drop(m);
        assert!(
            TcpStream::connect(addr).is_err(),
            "still listening after drop"
        );
    }
}
