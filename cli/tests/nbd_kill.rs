//! Kill -9 in the suite: a client writes numbered blocks to file-backed
//! stacks through `udm serve`, FUA on some writes and a FLUSH after others,
//! while the server is SIGKILLed at random moments; after each kill the
//! server starts again on the same files and every block must hold its
//! last durable write, or a later write that was acknowledged or in flight,
//! and no block may be torn (4 KiB of one write only).
//!
//! Rounds per stack: `UDM_KILL_ROUNDS` (default 10; the long run is
//! `UDM_KILL_ROUNDS=200 cargo test --release -p udm --test nbd_kill`).
//! Seed: `UDM_KILL_SEED` (default: from the clock, printed on failure).
//!
//! The checker is shown to catch lost writes: a writecache whose cache is
//! a RAM device loses what it held across a kill, and the test asserts the
//! checker reports it.

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::raw::{request_header, CMD_READ, CMD_WRITE};
use common::Serve;

const BS: usize = 4096;
/// Blocks written (a 2 MiB region).
const BLOCKS: u64 = 512;
const CMD_FLUSH: u16 = 3;
const FLAG_FUA: u16 = 1;
/// Requests in flight at once.
const QD: usize = 8;

/// A small PRNG (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The content of write `seq` to block `b`: the tag `seq << 16 | b` in
/// every 8 bytes (seq 0: zeros, the initial content).
fn block(seq: u64, b: u64) -> Vec<u8> {
    if seq == 0 {
        return vec![0; BS];
    }
    let tag = (seq << 16 | b).to_le_bytes();
    tag.iter().copied().cycle().take(BS).collect()
}

/// The write a block's content comes from, or why it is none.
fn decode(data: &[u8], b: u64) -> Result<u64, String> {
    if data.iter().all(|&x| x == 0) {
        return Ok(0);
    }
    let tag = u64::from_le_bytes(data[..8].try_into().unwrap());
    if data.chunks(8).any(|c| c != tag.to_le_bytes()) {
        return Err(format!("block {b} is torn (starts as write {})", tag >> 16));
    }
    if tag & 0xffff != b {
        return Err(format!("block {b} holds block {}'s data", tag & 0xffff));
    }
    Ok(tag >> 16)
}

/// What the client knows of each block.
#[derive(Default, Clone)]
struct Block {
    /// The last write known durable (0: the initial zeros).
    durable: u64,
    /// Writes after it, acknowledged or in flight (any may have landed).
    later: Vec<u64>,
    /// The last acknowledged write.
    acked: u64,
}

/// A raw NBD client on a socket that may die at any moment.
struct Client {
    s: UnixStream,
}

impl Client {
    fn connect(sock: &Path, export: &str) -> std::io::Result<Client> {
        let s = UnixStream::connect(sock)?;
        s.set_read_timeout(Some(Duration::from_secs(20)))?;
        let mut c = Client { s };
        let mut g = [0u8; 18];
        c.s.read_exact(&mut g)?;
        c.s.write_all(&3u32.to_be_bytes())?;
        let mut d = (export.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(export.as_bytes());
        d.extend_from_slice(&0u16.to_be_bytes());
        let mut m = common::raw::IHAVEOPT.to_be_bytes().to_vec();
        m.extend_from_slice(&common::raw::OPT_GO.to_be_bytes());
        m.extend_from_slice(&(d.len() as u32).to_be_bytes());
        m.extend_from_slice(&d);
        c.s.write_all(&m)?;
        loop {
            let mut h = [0u8; 20];
            c.s.read_exact(&mut h)?;
            let ty = u32::from_be_bytes(h[12..16].try_into().unwrap());
            let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
            let mut data = vec![0; len];
            c.s.read_exact(&mut data)?;
            match ty {
                1 => return Ok(c),
                3 => {}
                t => return Err(std::io::Error::other(format!("GO failed: {t:#x}"))),
            }
        }
    }

    fn send(&mut self, flags: u16, cmd: u16, cookie: u64, off: u64, data: &[u8], len: u32) {
        let mut m = request_header(flags, cmd, cookie, off, len);
        m.extend_from_slice(data);
        // A failed send shows as a failed reply.
        let _ = self.s.write_all(&m);
    }

    /// One simple reply: (error, cookie).
    fn reply(&mut self) -> std::io::Result<(u32, u64)> {
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h)?;
        Ok((
            u32::from_be_bytes(h[4..8].try_into().unwrap()),
            u64::from_be_bytes(h[8..16].try_into().unwrap()),
        ))
    }

    fn read_block(&mut self, b: u64) -> std::io::Result<Vec<u8>> {
        self.send(0, CMD_READ, b, b * BS as u64, &[], BS as u32);
        let (err, cookie) = self.reply()?;
        assert_eq!((err, cookie), (0, b), "read of block {b}");
        let mut v = vec![0; BS];
        self.s.read_exact(&mut v)?;
        Ok(v)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.send(0, CMD_FLUSH, u64::MAX, 0, &[], 0);
        let (err, _) = self.reply()?;
        assert_eq!(err, 0, "flush");
        Ok(())
    }
}

/// A stack to kill: its `udm serve` arguments and export.
struct Stack {
    name: &'static str,
    args: Vec<String>,
    export: &'static str,
}

fn file_stacks(dir: &Path) -> Vec<Stack> {
    let f = |n: &str| dir.join(n).display().to_string();
    vec![
        Stack {
            name: "linear over a file",
            args: vec![
                "--dev".into(),
                format!("d=file:{},size=4M", f("lin.img")),
                "--dev".into(),
                "lin=0 8192 linear d 0".into(),
                "--export".into(),
                "lin".into(),
            ],
            export: "lin",
        },
        Stack {
            name: "writecache over two files",
            args: wc_args(
                format!("o=file:{},size=8M", f("origin.img")),
                format!("c=file:{},size=2M", f("cache.img")),
            ),
            export: "wc",
        },
    ]
}

/// A writecache (4 KiB blocks, writeback from 60% full) of `cache` over
/// `origin`, short autocommit so that both commit paths run.
fn wc_args(origin: String, cache: String) -> Vec<String> {
    vec![
        "--dev".into(),
        origin,
        "--dev".into(),
        cache,
        "--dev".into(),
        "wc=0 16384 writecache s o c 4096 4 high_watermark 60 autocommit_time 50".into(),
        "--export".into(),
        "wc".into(),
    ]
}

fn rounds() -> usize {
    std::env::var("UDM_KILL_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10)
}

fn seed() -> u64 {
    std::env::var("UDM_KILL_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        })
        | 1
}

fn start(stack: &Stack) -> Serve {
    let a: Vec<&str> = stack.args.iter().map(String::as_str).collect();
    Serve::start(&a)
}

/// Reads every block back and checks it against what the client knows;
/// then flushes, and what was read becomes the durable state. Returns the
/// violations found.
fn check(sock: &Path, stack: &Stack, blocks: &mut [Block]) -> Vec<String> {
    let mut c = Client::connect(sock, stack.export).expect("connect after restart");
    let mut bad = Vec::new();
    for (b, st) in blocks.iter_mut().enumerate() {
        let data = c.read_block(b as u64).expect("read after restart");
        match decode(&data, b as u64) {
            Err(e) => bad.push(e),
            Ok(seq) if seq == st.durable || st.later.contains(&seq) => {
                st.durable = seq;
                st.acked = seq;
                st.later.clear();
            }
            Ok(seq) => bad.push(format!(
                "block {b} holds write {seq}; durable was {}, later {:?}",
                st.durable, st.later
            )),
        }
    }
    c.flush().expect("flush after restart");
    bad
}

/// Writes until the server dies: QD requests in flight, each write to a
/// block with no write in flight, FUA on a quarter of them, a FLUSH after
/// every 16th.
fn write_until_killed(c: &mut Client, blocks: &mut [Block], seq: &mut u64, rng: &mut Rng) {
    // cookie -> (block, seq, fua); u64::MAX - n: flushes.
    let mut inflight: HashMap<u64, (u64, u64, bool)> = HashMap::new();
    let mut flushes: HashMap<u64, Vec<(u64, u64)>> = HashMap::new();
    let mut busy = vec![false; blocks.len()];
    let mut nflush = 0u64;
    let mut writes = 0u64;
    loop {
        while inflight.len() + flushes.len() < QD {
            if writes % 16 == 15 && flushes.is_empty() {
                // Durable once answered: every write acknowledged by now.
                let snap: Vec<(u64, u64)> = blocks
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.acked > s.durable)
                    .map(|(b, s)| (b as u64, s.acked))
                    .collect();
                nflush += 1;
                let cookie = u64::MAX - nflush;
                c.send(0, CMD_FLUSH, cookie, 0, &[], 0);
                flushes.insert(cookie, snap);
                writes += 1;
                continue;
            }
            let b = loop {
                let b = rng.below(blocks.len() as u64);
                if !busy[b as usize] {
                    break b;
                }
            };
            *seq += 1;
            let fua = rng.below(4) == 0;
            let st = &mut blocks[b as usize];
            st.later.push(*seq);
            busy[b as usize] = true;
            inflight.insert(*seq, (b, *seq, fua));
            let flags = if fua { FLAG_FUA } else { 0 };
            c.send(
                flags,
                CMD_WRITE,
                *seq,
                b * BS as u64,
                &block(*seq, b),
                BS as u32,
            );
            writes += 1;
        }
        let Ok((err, cookie)) = c.reply() else {
            return; // killed
        };
        assert_eq!(err, 0, "request {cookie} failed");
        if let Some(snap) = flushes.remove(&cookie) {
            for (b, s) in snap {
                let st = &mut blocks[b as usize];
                if s > st.durable {
                    st.durable = s;
                    st.later.retain(|&x| x > s);
                }
            }
            continue;
        }
        let Some((b, s, fua)) = inflight.remove(&cookie) else {
            panic!("reply to unknown cookie {cookie}");
        };
        busy[b as usize] = false;
        let st = &mut blocks[b as usize];
        st.acked = s;
        if fua {
            st.durable = s;
            st.later.retain(|&x| x > s);
        }
    }
}

/// Runs `rounds` kill rounds on `stack`; returns the violations of the
/// first round that had any (and its number).
fn kill_rounds(stack: &Stack, rounds: usize, rng: &mut Rng) -> Option<(usize, Vec<String>)> {
    let mut blocks = vec![Block::default(); BLOCKS as usize];
    let mut seq = 0u64;
    for round in 0..rounds {
        let mut s = start(stack);
        let bad = check(&s.sock, stack, &mut blocks);
        if !bad.is_empty() {
            return Some((round, bad));
        }
        let mut c = Client::connect(&s.sock, stack.export).expect("connect");
        let mut child = s.child.take().expect("running");
        let delay = Duration::from_millis(20 + rng.below(200));
        let killer = std::thread::spawn(move || {
            std::thread::sleep(delay);
            // SAFETY: signalling our own child.
            unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
            let _ = child.wait();
        });
        write_until_killed(&mut c, &mut blocks, &mut seq, rng);
        killer.join().unwrap();
        drop(s);
    }
    let s = start(stack);
    let bad = check(&s.sock, stack, &mut blocks);
    eprintln!("{}: {rounds} kills, {seq} writes", stack.name);
    (!bad.is_empty()).then_some((rounds, bad))
}

fn dir(tag: &str) -> PathBuf {
    let d =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("kill-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn file_backed_stacks_keep_every_durable_write_across_kill_9() {
    let seed = seed();
    let mut rng = Rng(seed);
    let d = dir("files");
    let t0 = Instant::now();
    for stack in file_stacks(&d) {
        if let Some((round, bad)) = kill_rounds(&stack, rounds(), &mut rng) {
            panic!(
                "{}: after kill {round} (UDM_KILL_SEED={seed}): {} bad blocks, first: {:?}",
                stack.name,
                bad.len(),
                &bad[..bad.len().min(5)]
            );
        }
    }
    eprintln!("{} rounds per stack in {:?}", rounds(), t0.elapsed());
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn the_checker_catches_a_writecache_that_loses_its_ram_cache() {
    let seed = seed();
    let mut rng = Rng(seed);
    let d = dir("ram");
    let stack = Stack {
        name: "writecache with a RAM cache",
        args: wc_args(
            format!("o=file:{},size=8M", d.join("origin.img").display()),
            "c=ram:2M".into(),
        ),
        export: "wc",
    };
    let found = kill_rounds(&stack, rounds(), &mut rng);
    let _ = std::fs::remove_dir_all(&d);
    let (round, bad) = found
        .unwrap_or_else(|| panic!("UDM_KILL_SEED={seed}: no lost write detected with a RAM cache"));
    eprintln!(
        "RAM cache: after kill {round}, {} bad blocks, e.g. {:?}",
        bad.len(),
        bad.first()
    );
    assert!(
        bad.iter().any(|e| e.contains("durable was")),
        "the loss shows as blocks older than their durable write: {bad:?}"
    );
}
