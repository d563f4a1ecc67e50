//! `luks:` device specs: LUKS1 and LUKS2 volumes made by cryptsetup, opened
//! as a crypt table over their device.
//!
//! ```text
//! luks:<device or path>[,key-file=PATH][,keyslot=N][,ro]
//! ```
//!
//! The passphrase is the whole content of the key file (as cryptsetup's
//! `--key-file`), or comes in the create request ([`Passphrase`]: `udm
//! create` reads it from the terminal or stdin); never a command-line
//! word. Opening reads the header,
//! checks it (LUKS2: the SHA-256 checksum of the binary header and JSON
//! area, falling back to the secondary copy), derives the keyslot's key
//! with the keyslot's KDF (PBKDF2 with SHA-1, -256 or -512, or Argon2i /
//! Argon2id, from the RustCrypto `pbkdf2` and `argon2` crates), decrypts
//! the keyslot's key material with udm's own crypt cipher, merges the
//! anti-forensic stripes and checks the result against the digest. The
//! volume key then goes into a crypt target at the data segment's offset
//! and sector size, with the segment's IV tweak (IVs in 512-byte sectors,
//! as cryptsetup's tables for LUKS have them).
//!
//! A wrong passphrase, a damaged header or a cipher udm lacks: one line,
//! and no device. Passphrases, derived keys and the volume key are wiped
//! as soon as they are no longer needed.

use std::cell::Cell;
use std::sync::Arc;

use base64::Engine as _;
use serde_json::Value;
use sha1::Sha1;
use sha2::{Digest, Sha256, Sha512};
use udm_core::{
    AlignedBuf, BioPtr, BlockDevice, Error, Op, Reactor, ReactorConfig, Status, SECTOR_SIZE,
};
use udm_mapper::targets::crypt::cipher::{Cipher, CipherSpec};
use zeroize::{Zeroize, Zeroizing};

/// A parsed `luks:` spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LuksSpec {
    /// The device: a udm device's name or a path.
    pub dev: String,
    /// The file holding the passphrase.
    pub key_file: Option<String>,
    /// Only this keyslot is tried.
    pub keyslot: Option<usize>,
    /// Open the path read-only.
    pub ro: bool,
}

impl LuksSpec {
    /// Parses what follows `luks:`.
    pub fn parse(rest: &str) -> Result<LuksSpec, Error> {
        let mut parts = rest.split(',');
        let dev = parts.next().unwrap_or("").to_string();
        if dev.is_empty() {
            return Err(Error::invalid(
                "luks: missing device (luks:<device or path>[,key-file=PATH][,keyslot=N][,ro])",
            ));
        }
        let mut s = LuksSpec {
            dev,
            key_file: None,
            keyslot: None,
            ro: false,
        };
        for p in parts {
            match p.split_once('=') {
                Some(("key-file", f)) if !f.is_empty() => s.key_file = Some(f.to_string()),
                Some(("keyslot", n)) => {
                    s.keyslot = Some(n.parse().map_err(|_| {
                        Error::invalid(format!("luks: invalid keyslot '{n}': expected a number"))
                    })?)
                }
                None if p == "ro" => s.ro = true,
                _ => {
                    return Err(Error::invalid(format!(
                        "luks: unknown option '{p}' (known: key-file=, keyslot=, ro)"
                    )))
                }
            }
        }
        Ok(s)
    }

    /// The passphrase: the key file's bytes.
    pub fn passphrase(&self) -> Result<Zeroizing<Vec<u8>>, Error> {
        let Some(f) = &self.key_file else {
            return Err(Error::invalid(
                "luks: no passphrase: give key-file=PATH, or let `udm create` ask for it (a passphrase is never taken from the command line)",
            ));
        };
        if f == "-" {
            return Err(Error::invalid(
                "luks: key-file=- (stdin) is read by `udm create`, which sends the passphrase in its request",
            ));
        }
        std::fs::read(f)
            .map(Zeroizing::new)
            .map_err(|e| Error::os(format!("luks: key file '{f}'"), e))
    }
}

/// A passphrase that came with a request (`udm create NAME luks:…` asks
/// for it on the terminal or reads it from stdin and sends it in the
/// create request). Zeroed when dropped; `Debug` does not show it; on the
/// wire it is the bytes in standard base64 (a passphrase need not be
/// UTF-8), and the decoded text is wiped too.
#[derive(Clone, PartialEq, Eq)]
pub struct Passphrase(Zeroizing<Vec<u8>>);

impl Passphrase {
    /// Takes `bytes` (they are zeroed when the passphrase is dropped).
    pub fn new(bytes: Zeroizing<Vec<u8>>) -> Passphrase {
        Passphrase(bytes)
    }

    /// The passphrase's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Reads a passphrase from `r` as cryptsetup does for LUKS: up to the
    /// first newline, which is dropped, when `first_line` (a terminal, or
    /// stdin without `key-file=-`); else all of it, newlines included (a
    /// key file). At most [`MAX_PASSPHRASE`] bytes.
    pub fn read(r: &mut impl std::io::Read, first_line: bool) -> Result<Passphrase, Error> {
        let mut buf = Zeroizing::new(Vec::with_capacity(256));
        let mut chunk = Zeroizing::new([0u8; 4096]);
        loop {
            let n = match r.read(&mut chunk[..]) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Error::os("luks: reading the passphrase", e)),
            };
            let got = &chunk[..n];
            let line_end = if first_line {
                got.iter().position(|&b| b == b'\n')
            } else {
                None
            };
            push_wiped(&mut buf, &got[..line_end.unwrap_or(n)]);
            if buf.len() > MAX_PASSPHRASE {
                return Err(Error::invalid(format!(
                    "luks: passphrase longer than {MAX_PASSPHRASE} bytes"
                )));
            }
            if line_end.is_some() {
                break;
            }
        }
        Ok(Passphrase(buf))
    }
}

/// The longest passphrase read (cryptsetup's compiled-in key file limit).
pub const MAX_PASSPHRASE: usize = 8 << 20;

/// Appends `bytes` to `buf`, growing it by hand so that no copy of a
/// secret is left behind in a freed allocation.
pub(crate) fn push_wiped(buf: &mut Zeroizing<Vec<u8>>, bytes: &[u8]) {
    if buf.len() + bytes.len() > buf.capacity() {
        let mut grown = Vec::with_capacity((buf.len() + bytes.len()).max(2 * buf.capacity()));
        grown.extend_from_slice(buf);
        *buf = Zeroizing::new(grown); // the old buffer is zeroed as it drops
    }
    buf.extend_from_slice(bytes);
}

impl std::fmt::Debug for Passphrase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Passphrase(..)")
    }
}

impl serde::Serialize for Passphrase {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let text = Zeroizing::new(base64::engine::general_purpose::STANDARD.encode(&*self.0));
        s.serialize_str(&text)
    }
}

impl<'de> serde::Deserialize<'de> for Passphrase {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Passphrase, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Passphrase;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a passphrase in base64")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Passphrase, E> {
                let mut out = Zeroizing::new(Vec::with_capacity(v.len() / 4 * 3 + 3));
                base64::engine::general_purpose::STANDARD
                    .decode_vec(v, &mut out)
                    .map_err(|_| E::custom("passphrase: expected standard base64"))?;
                Ok(Passphrase(out))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Passphrase, E> {
                let v = Zeroizing::new(v);
                self.visit_str(&v)
            }
        }
        d.deserialize_string(V)
    }
}

/// An unlocked volume: what its crypt table needs.
pub struct Volume {
    /// dm's cipher string, e.g. `aes-xts-plain64`.
    pub cipher: String,
    /// The volume key.
    pub key: Zeroizing<Vec<u8>>,
    /// Where the data starts, in 512-byte sectors.
    pub offset: u64,
    /// Data sectors (512-byte).
    pub sectors: u64,
    /// The encryption unit in bytes.
    pub sector_size: u32,
    /// Added to the sector number for IVs.
    pub iv_offset: u64,
    /// 1 or 2.
    pub version: u16,
}

impl Volume {
    /// The crypt table line's arguments after the key's place, and the
    /// key in hex, kept apart so the caller can wipe it.
    pub fn crypt_args(&self, dev: &str) -> Vec<Zeroizing<String>> {
        let mut hex = Zeroizing::new(String::with_capacity(self.key.len() * 2));
        for b in self.key.iter() {
            hex.push(char::from_digit((b >> 4) as u32, 16).unwrap_or('0'));
            hex.push(char::from_digit((b & 15) as u32, 16).unwrap_or('0'));
        }
        let mut v = vec![
            Zeroizing::new(self.cipher.clone()),
            hex,
            Zeroizing::new(self.iv_offset.to_string()),
            Zeroizing::new(dev.to_string()),
            Zeroizing::new(self.offset.to_string()),
        ];
        if self.sector_size != 512 {
            v.push(Zeroizing::new("1".into()));
            v.push(Zeroizing::new(format!("sector_size:{}", self.sector_size)));
        }
        v
    }
}

fn damaged(m: impl std::fmt::Display) -> Error {
    Error::invalid(format!("luks: damaged header: {m}"))
}

/// Reads bytes of a device synchronously on a reactor of its own (the
/// control thread has none).
pub struct Reader {
    reactor: Reactor,
    ch: std::rc::Rc<dyn udm_core::Channel>,
    bytes: u64,
}

fn read_done(bio: BioPtr) {
    // SAFETY: `read` points private at a Cell on its stack and turns the
    // reactor until this has run.
    let cell = unsafe { &*(bio.private() as *const Cell<Option<Status>>) };
    cell.set(Some(bio.status()));
}

impl Reader {
    /// A reader of `dev`.
    pub fn new(dev: &Arc<dyn BlockDevice>) -> Result<Reader, Error> {
        let reactor = Reactor::new(ReactorConfig::default())
            .map_err(|e| Error::os("luks: creating a reactor", e))?;
        let ch = dev.clone().open(&reactor)?;
        Ok(Reader {
            reactor,
            ch,
            bytes: dev.limits().bytes(),
        })
    }

    /// `len` bytes from byte `off` (both rounded out to 4 KiB for any
    /// device's alignment).
    pub fn read(&self, off: u64, len: usize) -> Result<Vec<u8>, Error> {
        let a = 4096u64;
        let past = || {
            damaged(format!(
                "it points past the device's end ({len} bytes at {off}, device {} bytes)",
                self.bytes
            ))
        };
        let last = off.checked_add(len as u64).ok_or_else(past)?;
        if last > self.bytes || len > MAX_READ {
            return Err(past());
        }
        let start = off / a * a;
        let end = last.div_ceil(a).saturating_mul(a).min(self.bytes);
        let mut buf = AlignedBuf::new((end - start) as usize);
        let cell: Cell<Option<Status>> = Cell::new(None);
        let mut bio = self.reactor.alloc_bio();
        bio.op = Op::Read;
        bio.sector = start / SECTOR_SIZE;
        // SAFETY: `buf` outlives the I/O: this function turns the reactor
        // until the bio's completion has run.
        unsafe { bio.add_seg(buf.as_mut_ptr(), buf.len()) };
        bio.set_end_io(
            read_done,
            (&cell as *const Cell<Option<Status>>).cast_mut().cast(),
        );
        self.ch.submit(bio);
        self.reactor.run_until(|| cell.get().is_some());
        match cell.get() {
            Some(Status::Ok) => {}
            s => {
                return Err(Error::new(
                    udm_core::ErrorKind::Io,
                    format!("luks: reading {len} bytes at {off}: {s:?}"),
                ))
            }
        }
        let from = (off - start) as usize;
        Ok(buf[from..from + len].to_vec())
    }

    /// The device's size in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// The most one read of header or keyslot may ask for (a LUKS2 header is
/// at most 4 MiB, a keyslot's material 128 bytes x 100 000 stripes).
const MAX_READ: usize = 16 << 20;

/// Argon2's memory cost, at most (cryptsetup's own limit, 4 GiB, in KiB):
/// a hostile header must not make udm allocate more.
const MAX_ARGON2_KIB: u64 = 4 << 20;

const MAGIC1: &[u8; 6] = b"LUKS\xba\xbe";
const MAGIC2: &[u8; 6] = b"SKUL\xba\xbe";

/// Unlocks the volume on `r` with `pass` (trying `keyslot` only, if given).
pub fn unlock(r: &Reader, pass: &[u8], keyslot: Option<usize>) -> Result<Volume, Error> {
    let hdr = r.read(0, 4096)?;
    if &hdr[..6] != MAGIC1 {
        // LUKS2 keeps a second header; LUKS1 has none.
        return unlock2_secondary(r, pass, keyslot).map_err(|e| {
            if hdr.iter().all(|&b| b == 0) || &hdr[..4] != b"LUKS" {
                damaged("no LUKS magic at the start of the device (not a LUKS volume?)")
            } else {
                e
            }
        });
    }
    match u16::from_be_bytes([hdr[6], hdr[7]]) {
        1 => unlock1(r, &hdr, pass, keyslot),
        2 => match unlock2_at(r, 0, pass, keyslot) {
            Err(e) if e.to_string().contains("damaged header") => {
                unlock2_secondary(r, pass, keyslot).map_err(|_| e)
            }
            v => v,
        },
        v => Err(damaged(format!("unknown LUKS version {v}"))),
    }
}

// ---------------------------------------------------------------------------
// Shared: hashes, PBKDF2, the anti-forensic merge, keyslot material.

#[derive(Clone, Copy)]
enum Hash {
    Sha1,
    Sha256,
    Sha512,
}

impl Hash {
    fn parse(s: &str) -> Result<Hash, Error> {
        match s.trim_end_matches('\0') {
            "sha1" => Ok(Hash::Sha1),
            "sha256" => Ok(Hash::Sha256),
            "sha512" => Ok(Hash::Sha512),
            h => Err(Error::invalid(format!(
                "luks: unsupported hash '{h}' (supported: sha1, sha256, sha512)"
            ))),
        }
    }

    fn len(self) -> usize {
        match self {
            Hash::Sha1 => 20,
            Hash::Sha256 => 32,
            Hash::Sha512 => 64,
        }
    }

    fn digest(self, parts: &[&[u8]], out: &mut [u8]) {
        fn run<D: Digest>(parts: &[&[u8]], out: &mut [u8]) {
            let mut d = D::new();
            for p in parts {
                d.update(p);
            }
            let mut h = d.finalize();
            let n = out.len().min(h.len());
            out[..n].copy_from_slice(&h[..n]);
            h.as_mut_slice().zeroize();
        }
        match self {
            Hash::Sha1 => run::<Sha1>(parts, out),
            Hash::Sha256 => run::<Sha256>(parts, out),
            Hash::Sha512 => run::<Sha512>(parts, out),
        }
    }

    fn pbkdf2(self, pass: &[u8], salt: &[u8], iters: u32, out: &mut [u8]) {
        // A header's 0 means what 1 does (one round): never no KDF at all.
        let iters = iters.max(1);
        match self {
            Hash::Sha1 => pbkdf2::pbkdf2_hmac::<Sha1>(pass, salt, iters, out),
            Hash::Sha256 => pbkdf2::pbkdf2_hmac::<Sha256>(pass, salt, iters, out),
            Hash::Sha512 => pbkdf2::pbkdf2_hmac::<Sha512>(pass, salt, iters, out),
        }
    }
}

/// LUKS's anti-forensic merge: `stripes` stripes of `key_len` bytes
/// become the key (each but the last XORed in, then diffused by the hash).
fn af_merge(material: &[u8], key_len: usize, stripes: usize, h: Hash) -> Zeroizing<Vec<u8>> {
    let mut d = Zeroizing::new(vec![0u8; key_len]);
    let mut tmp = Zeroizing::new(vec![0u8; key_len]);
    for i in 0..stripes {
        let s = &material[i * key_len..(i + 1) * key_len];
        for (x, y) in d.iter_mut().zip(s) {
            *x ^= y;
        }
        if i + 1 == stripes {
            break;
        }
        // Diffuse: hash block j (with j as a big-endian u32 in front).
        let hl = h.len();
        for (j, (block, out)) in d.chunks(hl).zip(tmp.chunks_mut(hl)).enumerate() {
            h.digest(&[&(j as u32).to_be_bytes(), block], out);
        }
        d.copy_from_slice(&tmp);
    }
    d
}

/// Decrypts a keyslot's key material (`len` bytes from byte `off`) with
/// the key derived from the passphrase, in 512-byte sectors numbered from
/// the area's start.
fn keyslot_material(
    r: &Reader,
    off: u64,
    len: usize,
    cipher: &str,
    key: &[u8],
) -> Result<Zeroizing<Vec<u8>>, Error> {
    let spec =
        CipherSpec::parse(cipher).map_err(|e| Error::invalid(format!("luks: keyslot: {e}")))?;
    let c = Cipher::new(&spec, key).map_err(|e| Error::invalid(format!("luks: keyslot: {e}")))?;
    let mut m = Zeroizing::new(r.read(off, len.div_ceil(512) * 512)?);
    for (i, s) in m.chunks_exact_mut(512).enumerate() {
        c.decrypt(i as u64, s);
    }
    m.truncate(len);
    Ok(m)
}

fn wrong_passphrase(keyslot: Option<usize>) -> Error {
    Error::invalid(match keyslot {
        Some(k) => format!("luks: wrong passphrase for keyslot {k}"),
        None => "luks: wrong passphrase (no keyslot opens with it)".into(),
    })
}

/// Checks a cipher string names one udm's crypt target has.
fn data_cipher(c: &str) -> Result<String, Error> {
    CipherSpec::parse(c).map_err(|e| Error::invalid(format!("luks: {e}")))?;
    Ok(c.to_string())
}

// ---------------------------------------------------------------------------
// LUKS1: a 592-byte big-endian header and eight keyslots.

fn cstr(b: &[u8]) -> String {
    let n = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..n]).into_owned()
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn unlock1(r: &Reader, h: &[u8], pass: &[u8], want: Option<usize>) -> Result<Volume, Error> {
    let cipher = data_cipher(&format!("{}-{}", cstr(&h[8..40]), cstr(&h[40..72])))?;
    let hash = Hash::parse(&cstr(&h[72..104]))?;
    let payload = be32(h, 104) as u64;
    let key_len = be32(h, 108) as usize;
    let mk_digest = &h[112..132];
    let mk_salt = &h[132..164];
    let mk_iters = be32(h, 164);
    if key_len == 0 || key_len > 128 {
        return Err(damaged(format!("key size {key_len}")));
    }
    if payload * 512 >= r.bytes() {
        return Err(damaged(format!(
            "payload offset {payload} is past the device's end"
        )));
    }
    let mut key = Zeroizing::new(vec![0u8; key_len]);
    for slot in 0..8 {
        if want.is_some_and(|w| w != slot) {
            continue;
        }
        let k = &h[208 + slot * 48..208 + (slot + 1) * 48];
        if be32(k, 0) != 0x00AC_71F3 {
            continue; // disabled
        }
        let (iters, salt, km_off, stripes) = (
            be32(k, 4),
            &k[8..40],
            be32(k, 40) as u64,
            be32(k, 44) as usize,
        );
        if stripes == 0 || stripes > 100_000 {
            return Err(damaged(format!("keyslot {slot} has {stripes} stripes")));
        }
        hash.pbkdf2(pass, salt, iters, &mut key);
        let m = keyslot_material(r, km_off * 512, key_len * stripes, &cipher, &key)?;
        let mk = af_merge(&m, key_len, stripes, hash);
        let mut d = [0u8; 20];
        hash.pbkdf2(&mk, mk_salt, mk_iters, &mut d);
        if d == mk_digest {
            return Ok(Volume {
                cipher,
                key: mk,
                offset: payload,
                sectors: r.bytes() / 512 - payload,
                sector_size: 512,
                iv_offset: 0,
                version: 1,
            });
        }
    }
    if let Some(w) = want {
        if w >= 8 || be32(h, 208 + w * 48) != 0x00AC_71F3 {
            return Err(Error::invalid(format!("luks: keyslot {w} is not in use")));
        }
    }
    Err(wrong_passphrase(want))
}

// ---------------------------------------------------------------------------
// LUKS2: a 4 KiB binary header, a JSON area, and a second copy of both.

/// Where cryptsetup may put the secondary header (the primary's size).
const SECONDARY_OFFSETS: [u64; 9] = [
    0x4000, 0x8000, 0x10000, 0x20000, 0x40000, 0x80000, 0x100000, 0x200000, 0x400000,
];

fn unlock2_secondary(r: &Reader, pass: &[u8], keyslot: Option<usize>) -> Result<Volume, Error> {
    for off in SECONDARY_OFFSETS {
        if off + 4096 > r.bytes() {
            break;
        }
        let h = r.read(off, 8)?;
        if &h[..6] == MAGIC2 {
            return unlock2_at(r, off, pass, keyslot);
        }
    }
    Err(damaged("no valid LUKS2 header (primary or secondary)"))
}

fn json_u64(v: &Value, what: &str) -> Result<u64, Error> {
    match v {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_u64(),
        _ => None,
    }
    .ok_or_else(|| damaged(format!("{what} is not a number")))
}

fn json_b64(v: &Value, what: &str) -> Result<Vec<u8>, Error> {
    v.as_str()
        .and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok())
        .ok_or_else(|| damaged(format!("{what} is not base64")))
}

fn unlock2_at(r: &Reader, at: u64, pass: &[u8], want: Option<usize>) -> Result<Volume, Error> {
    let bin = r.read(at, 4096)?;
    let hdr_size = u64::from_be_bytes(bin[8..16].try_into().unwrap_or_default());
    if !(16384..=(4 << 20)).contains(&hdr_size) || !hdr_size.is_power_of_two() {
        return Err(damaged(format!("header size {hdr_size}")));
    }
    let mut all = r.read(at, hdr_size as usize)?;
    let csum_alg = cstr(&bin[72..104]);
    if csum_alg != "sha256" {
        return Err(damaged(format!("unsupported checksum '{csum_alg}'")));
    }
    let stored: [u8; 32] = bin[448..480].try_into().unwrap_or_default();
    all[448..512].fill(0);
    let got: [u8; 32] = Sha256::digest(&all).into();
    if got != stored {
        return Err(damaged(format!("checksum mismatch in the header at {at}")));
    }
    let json_end = all[4096..]
        .iter()
        .position(|&b| b == 0)
        .map_or(all.len(), |p| p + 4096);
    let j: Value = serde_json::from_slice(&all[4096..json_end])
        .map_err(|e| damaged(format!("JSON area: {e}")))?;

    // The data segment: one crypt segment (reencryption's several are not
    // supported).
    let segs = j["segments"]
        .as_object()
        .ok_or_else(|| damaged("no segments"))?;
    let (seg_id, seg) = match segs.iter().collect::<Vec<_>>()[..] {
        [(id, s)] => (id.clone(), s),
        _ => {
            return Err(Error::invalid(format!(
                "luks: {} data segments (a reencryption in progress?): only one is supported",
                segs.len()
            )))
        }
    };
    if seg["type"] != "crypt" {
        return Err(Error::invalid(format!(
            "luks: segment type {} is not supported",
            seg["type"]
        )));
    }
    if seg.get("integrity").is_some() {
        return Err(Error::invalid(
            "luks: authenticated encryption (integrity) is not supported",
        ));
    }
    let cipher = data_cipher(seg["encryption"].as_str().unwrap_or(""))?;
    let offset = json_u64(&seg["offset"], "segment offset")?;
    let sector_size = json_u64(&seg["sector_size"], "sector_size")?;
    if !sector_size.is_power_of_two() || !(512..=4096).contains(&sector_size) {
        return Err(damaged(format!("sector_size {sector_size}")));
    }
    let sector_size = sector_size as u32;
    let iv_offset = json_u64(&seg["iv_tweak"], "iv_tweak")?;
    let size = match &seg["size"] {
        Value::String(s) if s == "dynamic" => r.bytes().checked_sub(offset),
        v => Some(json_u64(v, "segment size")?),
    }
    .filter(|s| *s > 0 && offset.checked_add(*s).is_some_and(|e| e <= r.bytes()))
    .ok_or_else(|| damaged("the data segment lies past the device's end"))?;
    if offset % 512 != 0 || size % sector_size as u64 != 0 {
        return Err(damaged(
            "the data segment is not aligned to its sector size",
        ));
    }

    let digests: Vec<&Value> = j["digests"]
        .as_object()
        .ok_or_else(|| damaged("no digests"))?
        .values()
        .filter(|d| {
            d["segments"]
                .as_array()
                .is_some_and(|s| s.iter().any(|x| x == seg_id.as_str()))
        })
        .collect();
    let slots = j["keyslots"]
        .as_object()
        .ok_or_else(|| damaged("no keyslots"))?;
    if let Some(w) = want {
        if !slots.contains_key(&w.to_string()) {
            return Err(Error::invalid(format!("luks: keyslot {w} is not in use")));
        }
    }
    for (id, ks) in slots {
        if want.is_some_and(|w| w.to_string() != *id) {
            continue;
        }
        let Some(dig) = digests.iter().find(|d| {
            d["keyslots"]
                .as_array()
                .is_some_and(|k| k.iter().any(|x| x == id.as_str()))
        }) else {
            continue; // not bound to the data segment
        };
        let mk = open_keyslot2(r, ks, pass).map_err(|e| e.context(format!("keyslot {id}")))?;
        let Some(mk) = mk else { continue };
        if digest2_matches(dig, &mk)? {
            return Ok(Volume {
                cipher,
                key: mk,
                offset: offset / 512,
                sectors: size / 512,
                sector_size,
                iv_offset,
                version: 2,
            });
        }
    }
    Err(wrong_passphrase(want))
}

/// The volume key a LUKS2 keyslot yields with `pass` (`None` for a keyslot
/// type udm does not open).
fn open_keyslot2(r: &Reader, ks: &Value, pass: &[u8]) -> Result<Option<Zeroizing<Vec<u8>>>, Error> {
    if ks["type"] != "luks2" {
        return Ok(None);
    }
    let key_len = json_u64(&ks["key_size"], "key_size")? as usize;
    let area = &ks["area"];
    let af = &ks["af"];
    let kdf = &ks["kdf"];
    if area["type"] != "raw" || af["type"] != "luks1" {
        return Ok(None);
    }
    let area_key_len = json_u64(&area["key_size"], "area key_size")? as usize;
    let stripes = json_u64(&af["stripes"], "stripes")? as usize;
    if key_len == 0 || key_len > 128 || area_key_len > 128 || stripes == 0 || stripes > 100_000 {
        return Err(damaged("keyslot sizes out of range"));
    }
    let hash = Hash::parse(af["hash"].as_str().unwrap_or(""))?;
    let salt = json_b64(&kdf["salt"], "kdf salt")?;
    let mut pk = Zeroizing::new(vec![0u8; area_key_len]);
    match kdf["type"].as_str().unwrap_or("") {
        "pbkdf2" => {
            let h = Hash::parse(kdf["hash"].as_str().unwrap_or(""))?;
            let it = u32::try_from(json_u64(&kdf["iterations"], "iterations")?)
                .map_err(|_| damaged("pbkdf2 iterations out of range"))?;
            h.pbkdf2(pass, &salt, it, &mut pk);
        }
        t @ ("argon2i" | "argon2id") => {
            let alg = if t == "argon2i" {
                argon2::Algorithm::Argon2i
            } else {
                argon2::Algorithm::Argon2id
            };
            let (mem, time, cpus) = (
                json_u64(&kdf["memory"], "memory")?,
                json_u64(&kdf["time"], "time")?,
                json_u64(&kdf["cpus"], "cpus")?,
            );
            if mem > MAX_ARGON2_KIB || time > u32::MAX as u64 || cpus > 64 {
                return Err(damaged(format!(
                    "argon2 costs out of range (memory {mem} KiB, time {time}, cpus {cpus})"
                )));
            }
            let p = argon2::Params::new(mem as u32, time as u32, cpus as u32, Some(area_key_len))
                .map_err(|e| damaged(format!("argon2 parameters: {e}")))?;
            argon2::Argon2::new(alg, argon2::Version::V0x13, p)
                .hash_password_into(pass, &salt, &mut pk)
                .map_err(|e| Error::invalid(format!("luks: argon2: {e}")))?;
        }
        t => {
            return Err(Error::invalid(format!("luks: unsupported KDF '{t}'")));
        }
    }
    let cipher = area["encryption"].as_str().unwrap_or("");
    let off = json_u64(&area["offset"], "area offset")?;
    let m = keyslot_material(r, off, key_len * stripes, cipher, &pk)?;
    Ok(Some(af_merge(&m, key_len, stripes, hash)))
}

fn digest2_matches(d: &Value, mk: &[u8]) -> Result<bool, Error> {
    if d["type"] != "pbkdf2" {
        return Err(Error::invalid(format!(
            "luks: unsupported digest type {}",
            d["type"]
        )));
    }
    let h = Hash::parse(d["hash"].as_str().unwrap_or(""))?;
    let salt = json_b64(&d["salt"], "digest salt")?;
    let want = json_b64(&d["digest"], "digest")?;
    let it = u32::try_from(json_u64(&d["iterations"], "digest iterations")?)
        .map_err(|_| damaged("digest iterations out of range"))?;
    let mut got = Zeroizing::new(vec![0u8; want.len()]);
    h.pbkdf2(mk, &salt, it, &mut got);
    Ok(*got == want)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_name_the_device_and_options() {
        let s = LuksSpec::parse("/dev/vdb,key-file=/k,keyslot=2,ro").unwrap();
        assert_eq!(
            s,
            LuksSpec {
                dev: "/dev/vdb".into(),
                key_file: Some("/k".into()),
                keyslot: Some(2),
                ro: true
            }
        );
        let e = |r: &str| LuksSpec::parse(r).err().unwrap().to_string();
        assert!(e("").contains("missing device"));
        assert!(e("d,keyslot=x").contains("invalid keyslot 'x'"));
        assert!(e("d,passphrase=x").contains("unknown option 'passphrase=x'"));
        assert!(LuksSpec::parse("d").unwrap().passphrase().is_err());
    }

    /// As cryptsetup: a terminal or stdin gives its first line without the
    /// newline, a key file all of itself.
    #[test]
    fn passphrases_are_read_as_cryptsetup_reads_them() {
        let read = |b: &[u8], first| Passphrase::read(&mut &b[..], first).unwrap();
        assert_eq!(
            read(b"pass phrase\nmore\n", true).as_bytes(),
            b"pass phrase"
        );
        assert_eq!(read(b"pass phrase", true).as_bytes(), b"pass phrase");
        assert_eq!(read(b"pass\nphrase\n", false).as_bytes(), b"pass\nphrase\n");
        let big = vec![b'x'; 10_000];
        assert_eq!(read(&big, false).as_bytes(), &big[..]);
    }

    /// On the wire a passphrase is base64 (any bytes); `Debug` hides it.
    #[test]
    fn passphrases_travel_in_base64_and_never_print() {
        let p = Passphrase::new(Zeroizing::new(b"s\xffcret\n".to_vec()));
        let j = serde_json::to_string(&p).unwrap();
        assert_eq!(j, "\"c/9jcmV0Cg==\"");
        assert_eq!(serde_json::from_str::<Passphrase>(&j).unwrap(), p);
        assert_eq!(format!("{p:?}"), "Passphrase(..)");
        let e = serde_json::from_str::<Passphrase>("\"not base64!\"").unwrap_err();
        assert!(e.to_string().contains("expected standard base64"), "{e}");
    }

    /// With one stripe the merge is the identity; with two, the first
    /// stripe is diffused (hash of index || block) before the second is
    /// XORed in.
    #[test]
    fn af_merge_diffuses_every_stripe_but_the_last() {
        let key = [7u8; 32];
        assert_eq!(&af_merge(&key, 32, 1, Hash::Sha256)[..], &key[..]);
        let s0 = [1u8; 32];
        let mut m = s0.to_vec();
        m.extend_from_slice(&[0u8; 32]);
        let mut want = [0u8; 32];
        Hash::Sha256.digest(&[&0u32.to_be_bytes(), &s0], &mut want);
        assert_eq!(&af_merge(&m, 32, 2, Hash::Sha256)[..], &want[..]);
    }
}

#[cfg(test)]
mod hostile {
    //! Headers written to attack the parser: each is refused with an error,
    //! none panics or makes udm allocate what the header asks for.

    use super::*;
    use udm_backends::{FileDevice, FileOpts};

    /// A LUKS2 image of 32 MiB whose primary header carries `json` with a
    /// valid checksum (no secondary header).
    fn image(json: &str) -> Vec<u8> {
        let mut img = vec![0u8; 32 << 20];
        let hdr = &mut img[..16384];
        hdr[..6].copy_from_slice(MAGIC1);
        hdr[6..8].copy_from_slice(&2u16.to_be_bytes());
        hdr[8..16].copy_from_slice(&16384u64.to_be_bytes());
        hdr[72..78].copy_from_slice(b"sha256");
        hdr[4096..4096 + json.len()].copy_from_slice(json.as_bytes());
        let sum: [u8; 32] = Sha256::digest(&*hdr).into();
        hdr[448..480].copy_from_slice(&sum);
        img
    }

    fn open(json: &str) -> String {
        let path = format!("/dev/shm/udm-luks-hostile-{}", std::process::id());
        std::fs::write(&path, image(json)).unwrap();
        let dev: Arc<dyn BlockDevice> =
            Arc::new(FileDevice::open("h", &path, FileOpts::default()).unwrap());
        let r = Reader::new(&dev).unwrap();
        let e = unlock(&r, b"pass", None).err().unwrap().to_string();
        drop(r);
        let _ = std::fs::remove_file(&path);
        e
    }

    const SEG: &str = r#""segments":{"0":{"type":"crypt","offset":"16777216","size":"dynamic","iv_tweak":"0","encryption":"aes-xts-plain64","sector_size":512}}"#;
    const DIG: &str = r#""digests":{"0":{"type":"pbkdf2","keyslots":["0"],"segments":["0"],"hash":"sha256","iterations":1,"salt":"AAAA","digest":"AAAA"}}"#;

    fn slot(kdf: &str, area: &str) -> String {
        format!(
            r#"{{"keyslots":{{"0":{{"type":"luks2","key_size":64,"af":{{"type":"luks1","stripes":4000,"hash":"sha256"}},"area":{area},"kdf":{kdf}}}}},{SEG},{DIG}}}"#
        )
    }

    const AREA: &str = r#"{"type":"raw","offset":"32768","size":"258048","encryption":"aes-xts-plain64","key_size":64}"#;

    #[test]
    fn hostile_headers_are_refused_without_panics() {
        let e = open("{not json");
        assert!(e.contains("JSON area"), "{e}");
        let e = open(r#"{"keyslots":{}}"#);
        assert!(e.contains("no segments"), "{e}");
        // Argon2 asking for 1 TiB of memory.
        let e = open(&slot(
            r#"{"type":"argon2id","time":1,"memory":1073741824,"cpus":1,"salt":"AAAAAAAAAAAAAAAAAAAAAA=="}"#,
            AREA,
        ));
        assert!(e.contains("argon2 costs out of range"), "{e}");
        // Key material past the device's end, and at an offset that would
        // overflow.
        let far = AREA.replace("32768", "18446744073709551000");
        let e = open(&slot(
            r#"{"type":"pbkdf2","hash":"sha256","iterations":1,"salt":"AAAA"}"#,
            &far,
        ));
        assert!(e.contains("past the device's end"), "{e}");
        // A data segment past the end, and a bad sector size.
        let e = open(&format!(
            "{{{},{DIG},\"keyslots\":{{}}}}",
            SEG.replace("\"dynamic\"", "\"18446744073709551000\"")
        ));
        assert!(e.contains("past the device's end"), "{e}");
        let e = open(&format!(
            "{{{},{DIG},\"keyslots\":{{}}}}",
            SEG.replace("512}", "3000}")
        ));
        assert!(e.contains("sector_size 3000"), "{e}");
        // Well-formed, but no keyslot opens: the passphrase is wrong.
        let e = open(&slot(
            r#"{"type":"pbkdf2","hash":"sha256","iterations":0,"salt":"AAAA"}"#,
            AREA,
        ));
        assert!(e.contains("wrong passphrase"), "{e}");
        // An unknown data cipher.
        let e = open(&format!(
            "{{{},{DIG},\"keyslots\":{{}}}}",
            SEG.replace("aes-xts", "serpent-xts")
        ));
        assert!(e.contains("unknown cipher 'serpent'"), "{e}");
    }
}
