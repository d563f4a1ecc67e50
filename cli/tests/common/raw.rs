//! A raw NBD client for the protocol tests: it sends exactly the bytes a
//! test asks for and reads replies field by field.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use super::Serve;

pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const OPT_GO: u32 = 7;
pub const REP_ACK: u32 = 1;
pub const REP_INFO: u32 = 3;
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;

/// A raw NBD client.
pub struct Raw {
    pub s: UnixStream,
}

impl Raw {
    /// Connects and reads the greeting; sends client flags.
    pub fn connect(srv: &Serve, client_flags: u32) -> Raw {
        let s = UnixStream::connect(&srv.sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut r = Raw { s };
        let g = r.read(18);
        assert_eq!(&g[..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        assert_eq!(
            u16::from_be_bytes([g[16], g[17]]) & 3,
            3,
            "FIXED_NEWSTYLE|NO_ZEROES"
        );
        r.send(&client_flags.to_be_bytes());
        r
    }

    pub fn send(&mut self, b: &[u8]) {
        self.s.write_all(b).unwrap();
    }

    pub fn read(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0; n];
        self.s.read_exact(&mut v).unwrap();
        v
    }

    /// Whether the server closed the connection (EOF before any byte).
    pub fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.s.read(&mut b), Ok(0) | Err(_))
    }

    pub fn option(&mut self, opt: u32, data: &[u8]) {
        let mut m = IHAVEOPT.to_be_bytes().to_vec();
        m.extend_from_slice(&opt.to_be_bytes());
        m.extend_from_slice(&(data.len() as u32).to_be_bytes());
        m.extend_from_slice(data);
        self.send(&m);
    }

    /// Reads one option reply: (option, type, data).
    pub fn option_reply(&mut self) -> (u32, u32, Vec<u8>) {
        let h = self.read(20);
        assert_eq!(
            u64::from_be_bytes(h[..8].try_into().unwrap()),
            OPT_REPLY_MAGIC
        );
        let opt = u32::from_be_bytes(h[8..12].try_into().unwrap());
        let ty = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
        (opt, ty, self.read(len))
    }

    /// NBD_OPT_GO for `name`; returns the transmission flags.
    pub fn go(&mut self, name: &str) -> u16 {
        self.go_asking(name, &[])
    }

    /// NBD_OPT_GO for `name` asking for the NBD_INFO_* items `infos`
    /// (NBD_INFO_BLOCK_SIZE = 3 promises to respect the block sizes).
    pub fn go_asking(&mut self, name: &str, infos: &[u16]) -> u16 {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
        for i in infos {
            d.extend_from_slice(&i.to_be_bytes());
        }
        self.option(OPT_GO, &d);
        let mut flags = None;
        loop {
            let (opt, ty, data) = self.option_reply();
            assert_eq!(opt, OPT_GO);
            match ty {
                REP_INFO if data[..2] == [0, 0] => {
                    flags = Some(u16::from_be_bytes([data[10], data[11]]));
                }
                REP_INFO => {}
                REP_ACK => return flags.expect("NBD_INFO_EXPORT before ACK"),
                other => panic!("GO failed: {other:#x}"),
            }
        }
    }

    pub fn request(&mut self, flags: u16, cmd: u16, cookie: u64, offset: u64, len: u32) {
        self.send(&request_header(flags, cmd, cookie, offset, len));
    }

    /// Reads a simple reply: (error, cookie).
    pub fn simple_reply(&mut self) -> (u32, u64) {
        let h = self.read(16);
        assert_eq!(&h[..4], &0x6744_6698u32.to_be_bytes(), "simple reply magic");
        (
            u32::from_be_bytes(h[4..8].try_into().unwrap()),
            u64::from_be_bytes(h[8..16].try_into().unwrap()),
        )
    }

    /// Checks the connection still works: a 512-byte read at 0 succeeds.
    pub fn still_serves(&mut self) {
        self.request(0, CMD_READ, 0xfeed, 0, 512);
        assert_eq!(self.simple_reply(), (0, 0xfeed));
        self.read(512);
    }
}

/// A request header's bytes (for several requests sent in one write).
pub fn request_header(flags: u16, cmd: u16, cookie: u64, offset: u64, len: u32) -> Vec<u8> {
    let mut m = 0x2560_9513u32.to_be_bytes().to_vec();
    m.extend_from_slice(&flags.to_be_bytes());
    m.extend_from_slice(&cmd.to_be_bytes());
    m.extend_from_slice(&cookie.to_be_bytes());
    m.extend_from_slice(&offset.to_be_bytes());
    m.extend_from_slice(&len.to_be_bytes());
    m
}
