//! The cipher: dm-crypt's `<cipher>-<chainmode>-<ivmode>` string, parsed once
//! at construction, and the per-sector transform it names.
//!
//! XTS runs on `xts_vaes.rs` where the CPU has VAES and AVX-512 (chosen in
//! [`Cipher::new`]). Otherwise AES comes from RustCrypto's `aes` crate,
//! which picks AES-NI at run time (and a constant-time software AES
//! without it); the modes are written here because the field's XTS crate
//! (`xts-mode`) encrypts one 16-byte block per call, 8x slower than handing
//! `aes` 32 blocks at once (its AES-NI path pipelines 8). Measured on this
//! host, one core, AES-256: `xts-mode` 0.6 GB/s; this file 2.9-4.2 GB/s at
//! 512-byte sectors and 3.9-5.4 GB/s at 4 KiB; `xts_vaes.rs` 15-16 and
//! 20-21 GB/s (`openssl speed -evp aes-256-xts`: 4.5-6.5 and 5.5-8.1).
//!
//! What is computed, as dm-crypt and the IEEE 1619 / NIST definitions say:
//! - XTS: the tweak T = E_k2(IV); block j of the sector is
//!   C = E_k1(P xor T_j) xor T_j with T_j = T * alpha^j in GF(2^128)
//!   (little-endian bit order, reduction 0x87). Sectors are whole blocks,
//!   so there is no ciphertext stealing.
//! - CBC: C_0 = E(P_0 xor IV), C_j = E(P_j xor C_{j-1}).
//! - IVs, from the sector number n (already offset and scaled by the
//!   caller): `plain64` = n as 64-bit little-endian then zeroes; `plain` =
//!   the low 32 bits of n, little-endian, then zeroes; `essiv:sha256` =
//!   E_s(plain64) with s = SHA-256(key) as an AES-256 key.

use aes::cipher::consts::U16;
use aes::cipher::{BlockDecrypt, BlockEncrypt, BlockSizeUser, KeyInit};
use aes::{Aes128, Aes192, Aes256, Block};
use sha2::{Digest, Sha256};
use udm_core::Error;
use zeroize::Zeroize;

use super::xts_vaes::XtsVaes;

/// Which way a transform goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    /// Plaintext to ciphertext (a write).
    Encrypt,
    /// Ciphertext to plaintext (a read).
    Decrypt,
}

/// How output goes to memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stores {
    /// Through the caches, as ordinary stores do.
    Cached,
    /// Streamed past the caches where the code can (the VAES path, a
    /// 64-byte aligned output of whole lines): for output nobody reads
    /// soon, whose lines a cached store would first read in from memory.
    Streamed,
}

/// The chaining mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Chain {
    /// XTS (IEEE 1619): two AES keys, the key is twice the AES key.
    Xts,
    /// CBC.
    Cbc,
}

/// How each sector's IV is made from its number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IvMode {
    /// The sector number, 64-bit little-endian.
    Plain64,
    /// The sector number truncated to 32 bits, little-endian.
    Plain,
    /// The `plain64` IV encrypted with AES-256 under SHA-256 of the key.
    EssivSha256,
}

/// A parsed cipher specification (no key yet).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CipherSpec {
    /// The chaining mode.
    pub chain: Chain,
    /// The IV generator.
    pub iv: IvMode,
    /// The string as given, for the table line.
    pub text: String,
}

impl CipherSpec {
    /// Parses dm-crypt's cipher argument: `aes-xts-plain64`,
    /// `aes-cbc-essiv:sha256`, or the crypto-API form `capi:xts(aes)-plain64`.
    /// The error names what is wrong in one line.
    pub fn parse(s: &str) -> Result<CipherSpec, Error> {
        let (cipher, chain, iv) = if let Some(rest) = s.strip_prefix("capi:") {
            // capi:<mode>(<cipher>)-<ivmode>
            let (alg, iv) = rest.rsplit_once('-').ok_or_else(|| {
                Error::invalid(format!(
                    "invalid cipher '{s}': expected capi:<mode>(<cipher>)-<ivmode>"
                ))
            })?;
            let (chain, cipher) = alg
                .strip_suffix(')')
                .and_then(|a| a.split_once('('))
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "invalid cipher '{s}': expected capi:<mode>(<cipher>)-<ivmode>"
                    ))
                })?;
            (cipher, chain, iv)
        } else {
            let mut it = s.splitn(3, '-');
            match (it.next(), it.next(), it.next()) {
                (Some(c), Some(m), Some(iv)) => (c, m, iv),
                _ => {
                    return Err(Error::invalid(format!(
                        "invalid cipher '{s}': expected <cipher>-<chainmode>-<ivmode>, e.g. aes-xts-plain64"
                    )))
                }
            }
        };
        if cipher != "aes" {
            return Err(Error::invalid(format!(
                "unknown cipher '{cipher}' in '{s}': only aes is supported"
            )));
        }
        let chain = match chain {
            "xts" => Chain::Xts,
            "cbc" => Chain::Cbc,
            m => {
                return Err(Error::invalid(format!(
                    "unknown chain mode '{m}' in '{s}': expected xts or cbc"
                )))
            }
        };
        let iv = match iv {
            "plain64" => IvMode::Plain64,
            "plain" => IvMode::Plain,
            "essiv:sha256" => IvMode::EssivSha256,
            m => {
                return Err(Error::invalid(format!(
                    "unknown IV mode '{m}' in '{s}': expected plain64, plain or essiv:sha256"
                )))
            }
        };
        Ok(CipherSpec {
            chain,
            iv,
            text: s.to_string(),
        })
    }

    /// The key lengths (bytes) this cipher takes.
    pub fn key_sizes(&self) -> &'static [usize] {
        match self.chain {
            Chain::Xts => &[32, 48, 64],
            Chain::Cbc => &[16, 24, 32],
        }
    }
}

/// One AES key schedule of any size. The `aes` crate's `zeroize` feature
/// wipes the round keys when it is dropped.
enum Aes {
    A128(Aes128),
    A192(Aes192),
    A256(Aes256),
}

/// Runs `$body` with `$c` bound to the concrete cipher inside `$aes`, so
/// that the hot loops are compiled once per key size and dispatch once per
/// sector, not per block.
macro_rules! with_aes {
    ($aes:expr, $c:ident => $body:expr) => {
        match $aes {
            Aes::A128($c) => $body,
            Aes::A192($c) => $body,
            Aes::A256($c) => $body,
        }
    };
}

impl Aes {
    fn new(key: &[u8]) -> Result<Aes, Error> {
        let bad = |_| Error::invalid("invalid AES key length");
        Ok(match key.len() {
            16 => Aes::A128(Aes128::new_from_slice(key).map_err(bad)?),
            24 => Aes::A192(Aes192::new_from_slice(key).map_err(bad)?),
            32 => Aes::A256(Aes256::new_from_slice(key).map_err(bad)?),
            n => return Err(Error::invalid(format!("invalid AES key length {n}"))),
        })
    }

    fn encrypt_block(&self, b: &mut Block) {
        with_aes!(self, c => c.encrypt_block(b))
    }
}

/// Blocks per batch handed to AES: a 512-byte sector, so that the tweaks
/// of a batch fit in a small array on the stack.
const BATCH: usize = 32;

/// The keyed transform of one `cipher` table argument: AES key schedules
/// (and the ESSIV salt's), built once in the constructor.
pub struct Cipher {
    chain: Chain,
    iv: IvMode,
    /// XTS: the data key k1; CBC: the key.
    k1: Aes,
    /// XTS: the tweak key k2.
    k2: Option<Aes>,
    /// ESSIV: AES-256 under SHA-256 of the key.
    essiv: Option<Aes256>,
    /// XTS on a CPU with VAES and AVX-512: k1 and k2 expanded for
    /// `xts_vaes.rs`, which then does every unit (`k1` and `k2` above
    /// stay for the tests that compare the two).
    vaes: Option<XtsVaes>,
}

impl Cipher {
    /// Keys `spec` with `key`, whose length must be one of
    /// [`CipherSpec::key_sizes`].
    pub fn new(spec: &CipherSpec, key: &[u8]) -> Result<Cipher, Error> {
        if !spec.key_sizes().contains(&key.len()) {
            let bits: Vec<String> = spec
                .key_sizes()
                .iter()
                .map(|b| format!("{}", b * 8))
                .collect();
            return Err(Error::invalid(format!(
                "key of {} bits does not fit {}: expected {} bits",
                key.len() * 8,
                spec.text,
                bits.join(", ")
            )));
        }
        let (k1, k2) = match spec.chain {
            Chain::Xts => {
                let (a, b) = key.split_at(key.len() / 2);
                (Aes::new(a)?, Some(Aes::new(b)?))
            }
            Chain::Cbc => (Aes::new(key)?, None),
        };
        let essiv = match spec.iv {
            IvMode::EssivSha256 => {
                let mut salt: [u8; 32] = Sha256::digest(key).into();
                let c = Aes256::new(&salt.into());
                salt.zeroize();
                Some(c)
            }
            _ => None,
        };
        let vaes = match spec.chain {
            Chain::Xts if std::env::var_os("UDM_CRYPT_NO_VAES").is_none() => {
                let (a, b) = key.split_at(key.len() / 2);
                XtsVaes::new(a, b)
            }
            _ => None,
        };
        Ok(Cipher {
            chain: spec.chain,
            iv: spec.iv,
            k1,
            k2,
            essiv,
            vaes,
        })
    }

    /// Whether XTS runs on the VAES code (`xts_vaes.rs`): on a CPU with
    /// VAES, VPCLMULQDQ, AVX-512F and AVX-512BW, unless the environment
    /// variable `UDM_CRYPT_NO_VAES` was set when the cipher was built.
    pub fn uses_vaes(&self) -> bool {
        self.vaes.is_some()
    }

    /// The same cipher on the portable path (the `aes` crate's AES-NI or
    /// software AES), for tests and measurements that compare the two.
    pub fn without_vaes(mut self) -> Cipher {
        self.vaes = None;
        self
    }

    /// The IV of sector number `n` (before XTS's tweak encryption).
    #[inline]
    fn iv(&self, n: u64) -> Block {
        let mut iv = Block::default();
        match self.iv {
            IvMode::Plain64 => iv[..8].copy_from_slice(&n.to_le_bytes()),
            IvMode::Plain => iv[..4].copy_from_slice(&(n as u32).to_le_bytes()),
            IvMode::EssivSha256 => {
                iv[..8].copy_from_slice(&n.to_le_bytes());
                if let Some(e) = &self.essiv {
                    e.encrypt_block(&mut iv);
                }
            }
        }
        iv
    }

    /// Encrypts one sector in place: `data` (a multiple of 16 bytes) is
    /// sector number `n`.
    pub fn encrypt(&self, n: u64, data: &mut [u8]) {
        self.sector(Dir::Encrypt, n, data)
    }

    /// Decrypts one sector in place (see [`Cipher::encrypt`]).
    pub fn decrypt(&self, n: u64, data: &mut [u8]) {
        self.sector(Dir::Decrypt, n, data)
    }

    /// Encrypts or decrypts one sector in place: `data` (a multiple of 16
    /// bytes) is sector number `n`.
    pub fn sector(&self, dir: Dir, n: u64, data: &mut [u8]) {
        let iv = self.iv(n);
        if let Some(v) = &self.vaes {
            let len = data.len() / 16 * 16;
            if len > 0 {
                v.units(dir, len, |_| iv.into(), &mut data[..len]);
            }
            return;
        }
        self.portable(dir, iv, data)
    }

    /// One sector in place on the portable path, with its IV.
    fn portable(&self, dir: Dir, iv: Block, data: &mut [u8]) {
        match (self.chain, &self.k2, dir) {
            (Chain::Xts, Some(k2), Dir::Encrypt) => {
                with_aes!(&self.k1, c => xts::<_, true>(c, k2, iv, data))
            }
            (Chain::Xts, Some(k2), Dir::Decrypt) => {
                with_aes!(&self.k1, c => xts::<_, false>(c, k2, iv, data))
            }
            (_, _, Dir::Encrypt) => with_aes!(&self.k1, c => cbc_encrypt(c, iv, data)),
            (_, _, Dir::Decrypt) => with_aes!(&self.k1, c => cbc_decrypt(c, iv, data)),
        }
    }

    /// Encrypts or decrypts one sector from `src` into `dst` (of the same
    /// length): XTS's copy rides on its first pass over the data instead
    /// of costing a pass of its own.
    pub fn sector_to(&self, dir: Dir, n: u64, src: &[u8], dst: &mut [u8]) {
        debug_assert_eq!(src.len(), dst.len());
        let iv = self.iv(n);
        if let Some(v) = &self.vaes {
            let len = dst.len() / 16 * 16;
            if len > 0 {
                v.units_to(
                    dir,
                    len,
                    |_| iv.into(),
                    &src[..len],
                    &mut dst[..len],
                    Stores::Cached,
                );
            }
            return;
        }
        match (self.chain, &self.k2, dir) {
            (Chain::Xts, Some(k2), Dir::Encrypt) => {
                with_aes!(&self.k1, c => xts_to::<_, true>(c, k2, iv, src, dst))
            }
            (Chain::Xts, Some(k2), Dir::Decrypt) => {
                with_aes!(&self.k1, c => xts_to::<_, false>(c, k2, iv, src, dst))
            }
            _ => {
                dst.copy_from_slice(src);
                self.portable(dir, iv, dst)
            }
        }
    }

    /// Encrypts or decrypts consecutive units of `unit` bytes from `src`
    /// into `dst` (of the same length, a multiple of `unit`): unit i is
    /// sector number `n(i)`. The VAES code encrypts 4 units' tweaks at
    /// once, and with [`Stores::Streamed`] writes `dst` past the caches
    /// where it can (`XtsVaes::units_to`); the bytes are the same.
    pub fn units_to(
        &self,
        dir: Dir,
        unit: usize,
        n: impl Fn(usize) -> u64,
        src: &[u8],
        dst: &mut [u8],
        stores: Stores,
    ) {
        if let Some(v) = &self.vaes {
            return v.units_to(dir, unit, |i| self.iv(n(i)).into(), src, dst, stores);
        }
        for (i, (s, d)) in src
            .chunks_exact(unit)
            .zip(dst.chunks_exact_mut(unit))
            .enumerate()
        {
            self.sector_to(dir, n(i), s, d);
        }
    }

    /// [`Cipher::units_to`] in place.
    pub fn units(&self, dir: Dir, unit: usize, n: impl Fn(usize) -> u64, data: &mut [u8]) {
        if let Some(v) = &self.vaes {
            return v.units(dir, unit, |i| self.iv(n(i)).into(), data);
        }
        for (i, d) in data.chunks_exact_mut(unit).enumerate() {
            self.sector(dir, n(i), d);
        }
    }
}

/// Multiplies an XTS tweak by alpha (x) in GF(2^128), little-endian.
#[inline(always)]
fn mul_alpha(t: u128) -> u128 {
    (t << 1) ^ ((t >> 127) * 0x87)
}

/// Views 16-byte-multiple bytes as AES blocks.
#[inline(always)]
fn as_blocks(data: &mut [u8]) -> &mut [Block] {
    debug_assert!(data.len().is_multiple_of(16));
    // SAFETY: `Block` is `GenericArray<u8, U16>`, 16 bytes with alignment 1
    // and no invalid bit patterns; the slice covers exactly len/16 of them
    // inside `data`, which the returned borrow keeps exclusively borrowed.
    unsafe { std::slice::from_raw_parts_mut(data.as_mut_ptr().cast::<Block>(), data.len() / 16) }
}

#[inline(always)]
fn load(b: &Block) -> u128 {
    u128::from_le_bytes((*b).into())
}

#[inline(always)]
fn store(b: &mut Block, v: u128) {
    *b = v.to_le_bytes().into();
}

/// XTS over one sector, in place: encrypt when `ENC`, else decrypt.
fn xts<C: BlockEncrypt + BlockDecrypt + BlockSizeUser<BlockSize = U16>, const ENC: bool>(
    k1: &C,
    k2: &Aes,
    iv: Block,
    data: &mut [u8],
) {
    let mut t = iv;
    k2.encrypt_block(&mut t);
    let mut tw = load(&t);
    let mut tweaks = [0u128; BATCH];
    for batch in as_blocks(data).chunks_mut(BATCH) {
        for (b, slot) in batch.iter_mut().zip(tweaks.iter_mut()) {
            *slot = tw;
            store(b, load(b) ^ tw);
            tw = mul_alpha(tw);
        }
        if ENC {
            k1.encrypt_blocks(batch);
        } else {
            k1.decrypt_blocks(batch);
        }
        for (b, &tw) in batch.iter_mut().zip(tweaks.iter()) {
            store(b, load(b) ^ tw);
        }
    }
}

/// XTS from `src` into `dst`: encrypt when `ENC`, else decrypt (see
/// [`xts`]).
fn xts_to<C: BlockEncrypt + BlockDecrypt + BlockSizeUser<BlockSize = U16>, const ENC: bool>(
    k1: &C,
    k2: &Aes,
    iv: Block,
    src: &[u8],
    dst: &mut [u8],
) {
    let mut t = iv;
    k2.encrypt_block(&mut t);
    let mut tw = load(&t);
    let mut tweaks = [0u128; BATCH];
    for (batch, sb) in as_blocks(dst).chunks_mut(BATCH).zip(src.chunks(BATCH * 16)) {
        for ((b, s), slot) in batch
            .iter_mut()
            .zip(sb.chunks_exact(16))
            .zip(tweaks.iter_mut())
        {
            *slot = tw;
            let v = u128::from_le_bytes(s.try_into().unwrap_or([0; 16]));
            store(b, v ^ tw);
            tw = mul_alpha(tw);
        }
        if ENC {
            k1.encrypt_blocks(batch);
        } else {
            k1.decrypt_blocks(batch);
        }
        for (b, &tw) in batch.iter_mut().zip(tweaks.iter()) {
            store(b, load(b) ^ tw);
        }
    }
}

fn cbc_encrypt<C: BlockEncrypt + BlockSizeUser<BlockSize = U16>>(
    k: &C,
    iv: Block,
    data: &mut [u8],
) {
    let mut prev = load(&iv);
    for b in as_blocks(data) {
        store(b, load(b) ^ prev);
        k.encrypt_block(b);
        prev = load(b);
    }
}

fn cbc_decrypt<C: BlockDecrypt + BlockSizeUser<BlockSize = U16>>(
    k: &C,
    iv: Block,
    data: &mut [u8],
) {
    // Decrypt batches at once (AES-NI pipelines them), keeping each
    // batch's ciphertext to XOR in afterwards.
    let mut prev = load(&iv);
    let mut saved = [0u128; BATCH];
    for batch in as_blocks(data).chunks_mut(BATCH) {
        for (b, s) in batch.iter().zip(saved.iter_mut()) {
            *s = load(b);
        }
        k.decrypt_blocks(batch);
        for (b, &c) in batch.iter_mut().zip(saved.iter()) {
            store(b, load(b) ^ prev);
            prev = c;
        }
    }
    saved.zeroize();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn xts_plain64(key: &str) -> Cipher {
        Cipher::new(&CipherSpec::parse("aes-xts-plain64").unwrap(), &hex(key)).unwrap()
    }

    /// The cipher as built (the VAES code where the CPU has it) and the
    /// same on the portable path: every vector goes through both.
    fn both_paths(key: &str) -> [Cipher; 2] {
        let c = xts_plain64(key);
        assert_eq!(c.uses_vaes(), vaes_expected());
        [c, xts_plain64(key).without_vaes()]
    }

    /// Whether this CPU should run the VAES code (unless the tests were
    /// told to keep it off).
    fn vaes_expected() -> bool {
        #[cfg(target_arch = "x86_64")]
        let d = super::super::xts_vaes::detected();
        #[cfg(not(target_arch = "x86_64"))]
        let d = false;
        d && std::env::var_os("UDM_CRYPT_NO_VAES").is_none()
    }

    /// IEEE 1619-2007 Annex B, vector 1: AES-128, all-zero keys, data unit
    /// (sector) 0, 32 zero bytes.
    #[test]
    fn ieee1619_vector_1() {
        for c in both_paths(&"00".repeat(32)) {
            let mut d = vec![0u8; 32];
            c.encrypt(0, &mut d);
            assert_eq!(
                d,
                hex("917cf69ebd68b2ec9b9fe9a3eadda692cd43d2f59598ed858c02c2652fbf922e")
            );
            c.decrypt(0, &mut d);
            assert_eq!(d, vec![0u8; 32]);
        }
    }

    /// IEEE 1619-2007 vector 2: AES-128, sector 0x3333333333.
    #[test]
    fn ieee1619_vector_2() {
        for c in both_paths(&format!("{}{}", "11".repeat(16), "22".repeat(16))) {
            let mut d = hex(&"44".repeat(32));
            c.encrypt(0x33_3333_3333, &mut d);
            assert_eq!(
                d,
                hex("c454185e6a16936e39334038acef838bfb186fff7480adc4289382ecd6d394f0")
            );
            c.decrypt(0x33_3333_3333, &mut d);
            assert_eq!(d, hex(&"44".repeat(32)));
        }
    }

    /// IEEE 1619-2007 vector 4: AES-128, a 512-byte sector of bytes 0..255
    /// twice, sector 0.
    #[test]
    fn ieee1619_vector_4() {
        for c in both_paths("27182818284590452353602874713526 31415926535897932384626433832795") {
            let mut d: Vec<u8> = (0..512).map(|i| i as u8).collect();
            c.encrypt(0, &mut d);
            assert_eq!(
                &d[..32],
                &hex("27a7479befa1d476489f308cd4cfa6e2a96e4bbe3208ff25287dd3819616e89c")[..]
            );
            assert_eq!(
                &d[512 - 32..],
                &hex("eb4a427d1923ce3ff262735779a418f20a282df920147beabe421ee5319d0568")[..]
            );
            c.decrypt(0, &mut d);
            assert!(d.iter().enumerate().all(|(i, &b)| b == i as u8));
        }
    }

    /// IEEE 1619-2007 vector 10: AES-256, sector 0xff, 512 bytes.
    #[test]
    fn ieee1619_vector_10_aes256() {
        for c in both_paths(
            "2718281828459045235360287471352662497757247093699959574966967627
             3141592653589793238462643383279502884197169399375105820974944592",
        ) {
            let mut d: Vec<u8> = (0..512).map(|i| i as u8).collect();
            c.encrypt(0xff, &mut d);
            assert_eq!(
                &d[..32],
                &hex("1c3b3a102f770386e4836c99e370cf9bea00803f5e482357a4ae12d414a3e63b")[..]
            );
            assert_eq!(&d[512 - 16..], &hex("c4f36ffda9fcea70b9c6e693e148c151")[..]);
            c.decrypt(0xff, &mut d);
            assert!(d.iter().enumerate().all(|(i, &b)| b == i as u8));
        }
    }

    #[test]
    fn cipher_strings_parse_as_dm_crypt_reads_them() {
        let p = |s: &str| CipherSpec::parse(s).map(|c| (c.chain, c.iv));
        assert_eq!(p("aes-xts-plain64").unwrap(), (Chain::Xts, IvMode::Plain64));
        assert_eq!(p("aes-xts-plain").unwrap(), (Chain::Xts, IvMode::Plain));
        assert_eq!(
            p("aes-cbc-essiv:sha256").unwrap(),
            (Chain::Cbc, IvMode::EssivSha256)
        );
        assert_eq!(
            p("capi:xts(aes)-plain64").unwrap(),
            (Chain::Xts, IvMode::Plain64)
        );
        let e = |s: &str| CipherSpec::parse(s).unwrap_err().to_string();
        assert!(e("twofish-xts-plain64").contains("unknown cipher 'twofish'"));
        assert!(e("aes-ecb-plain64").contains("unknown chain mode 'ecb'"));
        assert!(e("aes-xts-benbi").contains("unknown IV mode 'benbi'"));
        assert!(e("aes-xts").contains("expected <cipher>-<chainmode>-<ivmode>"));
        assert!(e("capi:xts-plain64").contains("capi:<mode>(<cipher>)-<ivmode>"));
    }

    #[test]
    fn a_key_of_the_wrong_length_is_refused_naming_the_lengths() {
        let s = CipherSpec::parse("aes-xts-plain64").unwrap();
        let e = Cipher::new(&s, &[0; 20]).err().unwrap().to_string();
        assert!(
            e.contains("key of 160 bits does not fit aes-xts-plain64: expected 256, 384, 512 bits"),
            "{e}"
        );
    }

    /// CBC round-trips and chains: changing the first plaintext block
    /// changes every ciphertext block after it.
    #[test]
    fn cbc_chains_and_round_trips() {
        let s = CipherSpec::parse("aes-cbc-essiv:sha256").unwrap();
        let c = Cipher::new(&s, &[7; 32]).unwrap();
        let plain: Vec<u8> = (0..4096).map(|i| (i * 7) as u8).collect();
        let mut a = plain.clone();
        c.encrypt(9, &mut a);
        let mut b = plain.clone();
        b[0] ^= 1;
        c.encrypt(9, &mut b);
        assert!(a.chunks(16).zip(b.chunks(16)).all(|(x, y)| x != y));
        c.decrypt(9, &mut a);
        assert_eq!(a, plain);
        let mut out = vec![0u8; 4096];
        c.sector_to(Dir::Encrypt, 9, &plain, &mut out);
        let mut back = vec![0u8; 4096];
        c.sector_to(Dir::Decrypt, 9, &out, &mut back);
        assert_eq!(back, plain);
    }

    /// Encrypting into another buffer gives what encrypting in place does.
    #[test]
    fn xts_into_another_buffer_matches_in_place() {
        let c = xts_plain64(&format!("{}{}", "5a".repeat(32), "17".repeat(32)));
        let plain: Vec<u8> = (0..4096).map(|i| (i * 13) as u8).collect();
        let mut a = plain.clone();
        c.encrypt(77, &mut a);
        let mut b = vec![0u8; 4096];
        c.sector_to(Dir::Encrypt, 77, &plain, &mut b);
        assert_eq!(a, b);
        let mut d = vec![0u8; 4096];
        c.sector_to(Dir::Decrypt, 77, &b, &mut d);
        assert_eq!(d, plain);
    }

    /// A small xorshift generator: the comparison below wants many keys,
    /// units and sector numbers, not cryptographic randomness.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn fill(&mut self, b: &mut [u8]) {
            for c in b.chunks_mut(8) {
                let v = self.next().to_le_bytes();
                c.copy_from_slice(&v[..c.len()]);
            }
        }
    }

    /// The VAES code and the portable path give the same bytes, both
    /// directions, in place and into another buffer, for every XTS key
    /// size (AES-128, -192, -256), IV mode, and units of 1 to 256 blocks
    /// (the 16-block loop, its tail of 1 to 15 blocks, both), on random
    /// keys, data and sector numbers.
    #[test]
    fn xts_vaes_matches_the_portable_path() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ u64::from(std::process::id()));
        let lens: Vec<usize> = (1..=40)
            .chain([47, 48, 63, 64, 65, 255, 256])
            .map(|b| b * 16)
            .collect();
        for spec in ["aes-xts-plain64", "aes-xts-plain", "aes-xts-essiv:sha256"] {
            let spec = CipherSpec::parse(spec).unwrap();
            for &klen in spec.key_sizes() {
                for _ in 0..4 {
                    let mut key = vec![0u8; klen];
                    rng.fill(&mut key);
                    let fast = Cipher::new(&spec, &key).unwrap();
                    assert_eq!(fast.uses_vaes(), vaes_expected());
                    let slow = Cipher::new(&spec, &key).unwrap().without_vaes();
                    assert!(!slow.uses_vaes());
                    for &len in &lens {
                        let n = match rng.next() % 3 {
                            0 => rng.next(),
                            1 => rng.next() % 1024,
                            _ => u64::MAX - rng.next() % 4,
                        };
                        let mut plain = vec![0u8; len];
                        rng.fill(&mut plain);
                        let mut a = plain.clone();
                        fast.encrypt(n, &mut a);
                        let mut b = plain.clone();
                        slow.encrypt(n, &mut b);
                        assert_eq!(a, b, "encrypt, key {klen} bytes, {len} bytes, sector {n}");
                        let mut to = vec![0u8; len];
                        fast.sector_to(Dir::Encrypt, n, &plain, &mut to);
                        assert_eq!(to, b, "sector_to encrypt, key {klen}, {len} bytes");
                        // Decrypting random bytes, not only what was
                        // encrypted: the two paths agree on any input.
                        let mut c = plain.clone();
                        fast.decrypt(n, &mut c);
                        let mut d = plain.clone();
                        slow.decrypt(n, &mut d);
                        assert_eq!(c, d, "decrypt, key {klen} bytes, {len} bytes, sector {n}");
                        fast.sector_to(Dir::Decrypt, n, &plain, &mut to);
                        assert_eq!(to, d, "sector_to decrypt, key {klen}, {len} bytes");
                        fast.decrypt(n, &mut a);
                        assert_eq!(a, plain);
                    }
                }
            }
        }
    }

    /// The multi-unit calls give what unit-by-unit calls on the portable
    /// path give, for 1 to 9 units (groups of 4 tweaks and the rest), each
    /// key size, in both directions.
    #[test]
    fn xts_units_match_unit_by_unit() {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d ^ u64::from(std::process::id()));
        let spec = CipherSpec::parse("aes-xts-plain64").unwrap();
        for &klen in spec.key_sizes() {
            let mut key = vec![0u8; klen];
            rng.fill(&mut key);
            let fast = Cipher::new(&spec, &key).unwrap();
            let slow = Cipher::new(&spec, &key).unwrap().without_vaes();
            for c in [&fast, &slow] {
                // 320 and 1040 bytes: tails of 20 blocks and of 1 after 64.
                for unit in [16, 320, 512, 1040, 4096] {
                    for units in 1..=9 {
                        let base = rng.next() >> 8;
                        let n = |i: usize| base + 8 * i as u64;
                        let mut plain = vec![0u8; unit * units];
                        rng.fill(&mut plain);
                        let mut want = plain.clone();
                        for (i, d) in want.chunks_exact_mut(unit).enumerate() {
                            slow.encrypt(n(i), d);
                        }
                        let mut got = vec![0u8; plain.len()];
                        c.units_to(Dir::Encrypt, unit, n, &plain, &mut got, Stores::Cached);
                        assert_eq!(got, want, "encrypt, key {klen}, {units} x {unit}");
                        // Streamed, into a 64-byte aligned buffer (streaming
                        // stores where the unit is whole lines) and into one
                        // 16 bytes off (ordinary stores): the same bytes.
                        let mut wide = vec![0u8; plain.len() + 128];
                        let a = wide.as_ptr().align_offset(64);
                        for at in [a, a + 16] {
                            let d = &mut wide[at..at + plain.len()];
                            c.units_to(Dir::Encrypt, unit, n, &plain, d, Stores::Streamed);
                            assert_eq!(
                                d,
                                &want[..],
                                "streamed at +{}, key {klen}, {units} x {unit}",
                                at - a
                            );
                        }
                        let mut back = vec![0u8; plain.len()];
                        c.units_to(Dir::Decrypt, unit, n, &got, &mut back, Stores::Cached);
                        assert_eq!(
                            back, plain,
                            "units_to decrypt, key {klen}, {units} x {unit}"
                        );
                        c.units(Dir::Decrypt, unit, n, &mut got);
                        assert_eq!(got, plain, "decrypt, key {klen}, {units} x {unit}");
                    }
                }
            }
        }
    }

    /// This thread's CPU time in seconds: rates per CPU-second hold on a
    /// loaded host, where wall-clock ones move with the other load.
    fn cpu_now() -> f64 {
        let (user, system) = udm_core::cputime::thread_cpu();
        (user + system).as_secs_f64()
    }

    /// GB/s of XTS per CPU-second of one thread, both paths, 512 B and 4 KiB units, 1 MiB
    /// in a loop (`cargo test --release -p udm-mapper --lib xts_throughput
    /// -- --ignored --nocapture`).
    #[test]
    #[ignore = "a measurement; run it in release"]
    fn xts_throughput() {
        let mut buf = vec![0x5au8; 1 << 20];
        let mut out = vec![0u8; 1 << 20];
        for klen in [32, 64] {
            let key = vec![7u8; klen];
            let spec = CipherSpec::parse("aes-xts-plain64").unwrap();
            for (name, c) in [
                ("vaes", Cipher::new(&spec, &key).unwrap()),
                ("portable", Cipher::new(&spec, &key).unwrap().without_vaes()),
            ] {
                if name == "vaes" && !c.uses_vaes() {
                    continue;
                }
                for (unit, io) in [
                    (512usize, 128 << 10),
                    (512, 4096),
                    (4096, 128 << 10),
                    (4096, 4096),
                ] {
                    for (name_dir, dir) in [
                        ("units_to encrypt", Dir::Encrypt),
                        ("units decrypt", Dir::Decrypt),
                    ] {
                        let mut best = 0f64;
                        for _ in 0..5 {
                            let t = cpu_now();
                            let mut bytes = 0usize;
                            while cpu_now() - t < 0.2 {
                                // `io` bytes a call, as an I/O of that size.
                                for (k, (s, d)) in buf
                                    .chunks_exact_mut(io)
                                    .zip(out.chunks_exact_mut(io))
                                    .enumerate()
                                {
                                    let first = (k * io / unit) as u64;
                                    let n = |i: usize| first + i as u64;
                                    match dir {
                                        Dir::Encrypt => {
                                            c.units_to(dir, unit, n, s, d, Stores::Cached)
                                        }
                                        Dir::Decrypt => c.units(dir, unit, n, s),
                                    }
                                }
                                bytes += buf.len();
                            }
                            best = best.max(bytes as f64 / (cpu_now() - t) / 1e9);
                        }
                        println!(
                            "AES-{} {name:8} {unit:4} B units, {:3} KiB calls, {name_dir:16} {best:.2} GB/s",
                            klen * 4,
                            io >> 10
                        );
                    }
                }
            }
        }
    }
}
