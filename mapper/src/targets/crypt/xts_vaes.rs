//! AES-XTS on VAES and AVX-512: data units of whole blocks, 4 blocks per
//! 512-bit register and 8 registers in flight (32 blocks an iteration, a
//! 512-byte unit).
//!
//! The same function as `cipher.rs`'s portable XTS (IEEE 1619, tweak
//! T_j = E_k2(IV) * alpha^j, no ciphertext stealing: units are whole
//! blocks), for AES-128, AES-192 and AES-256 data keys:
//! - the key schedules (k1's for encryption, k1's inverse one for
//!   decryption, made with `aesimc`, and k2's for the tweak) are expanded
//!   once, when the [`Cipher`](super::cipher::Cipher) holding them is built,
//!   and live where it lives (locked, undumped pages; zeroed on drop);
//! - consecutive units go in one call ([`XtsVaes::units_to`],
//!   [`XtsVaes::units`]): the round keys are broadcast to the four lanes once a call,
//!   and the first tweaks E_k2(IV) of 4 units are encrypted in one register;
//! - a unit's first 16 tweaks are T * x^0..3 in one register (per-lane
//!   shifts, the bits shifted out reduced with one carry-less multiply by
//!   0x87, VPCLMULQDQ), then that times x^4, and those two times x^8 (a
//!   byte shift); the next 16 are those times x^16 (a shift of each
//!   128-bit lane by two bytes, the two bytes shifted out times 0x87), and
//!   so on, each iteration;
//! - round key 0 and the tweak are XORed in one three-way XOR, and the last
//!   round's key is XORed with the tweak first, so that `aesenclast` (or
//!   `aesdeclast`) applies the output tweak too;
//! - a tail of fewer than 32 blocks goes 4 blocks a register, the last one
//!   through masked loads and stores (a unit may be any multiple of 16
//!   bytes);
//! - with [`Stores::Streamed`], output of whole aligned lines goes past the
//!   caches (`vmovntdq`), fenced once a call.
//!
//! It is chosen at run time: [`XtsVaes::new`] gives `None` unless the CPU
//! has VAES, VPCLMULQDQ, AVX-512F and AVX-512BW (and AES-NI, for the key
//! expansion), and the caller then keeps the portable path.

use core::arch::x86_64::*;

use zeroize::Zeroize;

use super::cipher::{Dir, Stores};

/// Round keys of the largest AES (AES-256: 14 rounds, 15 keys).
type Schedule = [[u8; 16]; 15];

/// The expanded keys of one XTS key, for the VAES code.
pub struct XtsVaes {
    /// 10, 12 or 14: the data key's AES rounds.
    rounds: usize,
    /// k1's encryption schedule.
    enc: Schedule,
    /// k1's schedule for the equivalent inverse cipher (`aesdec`):
    /// enc[rounds], aesimc(enc[rounds-1]) .. aesimc(enc[1]), enc[0].
    dec: Schedule,
    /// 10, 12 or 14: the tweak key's AES rounds (the same as `rounds` in
    /// XTS, where both halves of the key have one length).
    tweak_rounds: usize,
    /// k2's encryption schedule.
    tweak: Schedule,
}

impl Drop for XtsVaes {
    fn drop(&mut self) {
        self.enc.zeroize();
        self.dec.zeroize();
        self.tweak.zeroize();
    }
}

/// Whether this CPU runs [`XtsVaes`].
pub fn detected() -> bool {
    is_x86_feature_detected!("aes")
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("vaes")
        && is_x86_feature_detected!("vpclmulqdq")
}

impl XtsVaes {
    /// Expands the data key `k1` and the tweak key `k2` (16, 24 or 32 bytes
    /// each); `None` when the CPU lacks the features (see [`detected`]) or
    /// a key has another length.
    pub fn new(k1: &[u8], k2: &[u8]) -> Option<XtsVaes> {
        if !detected() || ![16, 24, 32].contains(&k1.len()) || ![16, 24, 32].contains(&k2.len()) {
            return None;
        }
        let mut x = XtsVaes {
            rounds: 0,
            enc: [[0; 16]; 15],
            dec: [[0; 16]; 15],
            tweak_rounds: 0,
            tweak: [[0; 16]; 15],
        };
        // SAFETY: `detected()` above found AES-NI (and SSE2 is in every
        // x86_64), the features `expand` and `invert` are compiled for.
        unsafe {
            x.rounds = expand(k1, &mut x.enc);
            x.tweak_rounds = expand(k2, &mut x.tweak);
            invert(&x.enc, x.rounds, &mut x.dec);
        }
        Some(x)
    }

    /// Encrypts or decrypts consecutive units of `unit` bytes (a multiple
    /// of 16) from `src` into `dst` (of the same length, a multiple of
    /// `unit`); unit i's IV is `iv(i)`. The tweaks of 4 units are
    /// encrypted at once, in one register. One data unit is `unit ==
    /// src.len()`. [`Stores::Streamed`] encrypts with streaming stores past
    /// the caches where `dst` is 64-byte aligned and `unit` a multiple of
    /// 64.
    pub fn units_to(
        &self,
        dir: Dir,
        unit: usize,
        iv: impl FnMut(usize) -> [u8; 16],
        src: &[u8],
        dst: &mut [u8],
        stores: Stores,
    ) {
        assert_eq!(src.len(), dst.len());
        let (s, d, len) = (src.as_ptr(), dst.as_mut_ptr(), dst.len());
        self.run_units(dir, unit, iv, s, d, len, stores == Stores::Streamed);
    }

    /// [`XtsVaes::units_to`] in place.
    pub fn units(&self, dir: Dir, unit: usize, iv: impl FnMut(usize) -> [u8; 16], data: &mut [u8]) {
        let p = data.as_mut_ptr();
        self.run_units(dir, unit, iv, p, p, data.len(), false);
    }

    /// XTS over `len / unit` units from `src` to `dst`, their tweaks 4 at
    /// a time: `src` and `dst` are either the same pointer or two buffers
    /// that do not overlap, each valid for `len` bytes (the callers above
    /// take them from one `&mut [u8]`, or from a `&[u8]` and a `&mut [u8]`
    /// of that length, which cannot overlap); `unit` is a multiple of 16.
    /// `stream`: encrypt with streaming stores where they can be used.
    #[allow(clippy::too_many_arguments)]
    fn run_units(
        &self,
        dir: Dir,
        unit: usize,
        iv: impl FnMut(usize) -> [u8; 16],
        src: *const u8,
        dst: *mut u8,
        len: usize,
        stream: bool,
    ) {
        // Whole units only, as `chunks_exact` on the portable path: a
        // remainder shorter than a unit is left as it is.
        assert!(unit > 0 && unit.is_multiple_of(16));
        debug_assert!(len.is_multiple_of(unit));
        let units = len / unit;
        // Whole 64-byte lines only: a streaming store needs its line
        // aligned, and a unit's full-register stores are then aligned too.
        let nt = stream
            && matches!(dir, Dir::Encrypt)
            && src != dst.cast_const()
            && (dst as usize).is_multiple_of(64)
            && unit.is_multiple_of(64);
        let (tk, tnr) = (&self.tweak, self.tweak_rounds);
        // The direction and the rounds pick a loop compiled for them: one
        // branch a call, none in the loop.
        macro_rules! go {
            ($enc:literal, $keys:expr) => {
                // SAFETY: an XtsVaes exists only where `detected()` found
                // every feature `xts_units` is compiled for (see `new`);
                // `src` and `dst` are valid for `len` bytes and equal or
                // disjoint (this function's contract, kept by its callers),
                // and `units * unit <= len`.
                unsafe {
                    match self.rounds {
                        10 => xts_units::<$enc, 10>(nt, $keys, tk, tnr, iv, src, dst, unit, units),
                        12 => xts_units::<$enc, 12>(nt, $keys, tk, tnr, iv, src, dst, unit, units),
                        _ => xts_units::<$enc, 14>(nt, $keys, tk, tnr, iv, src, dst, unit, units),
                    }
                }
            };
        }
        match dir {
            Dir::Encrypt => go!(true, &self.enc),
            Dir::Decrypt => go!(false, &self.dec),
        }
        if nt {
            // SAFETY: no operands. Streaming stores are weakly ordered:
            // the fence makes them visible before the caller's next store
            // (the bio's completion), as ordinary stores would be.
            unsafe { _mm_sfence() };
        }
    }
}

/// SubWord of the AES key expansion, constant time: `aesenclast` with a
/// zero round key is SubBytes after ShiftRows, and ShiftRows moves nothing
/// when the four columns are the same word.
#[target_feature(enable = "aes,sse2")]
fn sub_word(w: u32) -> u32 {
    let v = _mm_set1_epi32(w as i32);
    _mm_cvtsi128_si32(_mm_aesenclast_si128(v, _mm_setzero_si128())) as u32
}

/// FIPS-197's key expansion of a 16, 24 or 32-byte `key` into `out`;
/// returns the number of rounds (10, 12, 14).
#[target_feature(enable = "aes,sse2")]
fn expand(key: &[u8], out: &mut Schedule) -> usize {
    let nk = key.len() / 4;
    let nr = nk + 6;
    let mut w = [0u32; 60];
    for (wi, k) in w.iter_mut().zip(key.chunks_exact(4)) {
        *wi = u32::from_le_bytes([k[0], k[1], k[2], k[3]]);
    }
    let mut rcon = 1u32;
    for i in nk..4 * (nr + 1) {
        let mut t = w[i - 1];
        if i % nk == 0 {
            // RotWord of a little-endian word is a right rotation by a byte.
            t = sub_word(t.rotate_right(8)) ^ rcon;
            rcon = (rcon << 1) ^ if rcon & 0x80 != 0 { 0x11b } else { 0 };
        } else if nk > 6 && i % nk == 4 {
            t = sub_word(t);
        }
        w[i] = w[i - nk] ^ t;
    }
    for (r, rk) in out.iter_mut().enumerate().take(nr + 1) {
        for c in 0..4 {
            rk[4 * c..4 * c + 4].copy_from_slice(&w[4 * r + c].to_le_bytes());
        }
    }
    w.zeroize();
    nr
}

/// The decryption schedule of the equivalent inverse cipher from `enc`.
#[target_feature(enable = "aes,sse2")]
fn invert(enc: &Schedule, nr: usize, dec: &mut Schedule) {
    dec[0] = enc[nr];
    for i in 1..nr {
        let k = u128::from_le_bytes(enc[nr - i]);
        let m = _mm_aesimc_si128(from_u128(k));
        dec[i] = to_u128(m).to_le_bytes();
    }
    dec[nr] = enc[0];
}

#[inline]
#[target_feature(enable = "sse2")]
fn from_u128(v: u128) -> __m128i {
    _mm_set_epi64x((v >> 64) as i64, v as i64)
}

#[inline]
#[target_feature(enable = "sse2")]
fn to_u128(v: __m128i) -> u128 {
    let lo = _mm_cvtsi128_si64(v) as u64;
    let hi = _mm_cvtsi128_si64(_mm_unpackhi_epi64(v, v)) as u64;
    (hi as u128) << 64 | lo as u128
}

/// Four blocks encrypted with `ks` (`nr` rounds) in one register: the
/// first tweaks of four units.
#[target_feature(enable = "avx512f,vaes")]
fn encrypt4(ks: &Schedule, nr: usize, blocks: &[[u8; 16]; 4]) -> [u128; 4] {
    let key = |i: usize| _mm512_broadcast_i32x4(from_u128(u128::from_le_bytes(ks[i])));
    // SAFETY: `blocks` is 64 bytes, read as one unaligned vector.
    let mut x = unsafe { _mm512_loadu_si512(blocks.as_ptr().cast::<__m512i>()) };
    x = _mm512_xor_si512(x, key(0));
    for i in 1..nr {
        x = _mm512_aesenc_epi128(x, key(i));
    }
    x = _mm512_aesenclast_epi128(x, key(nr));
    let mut out = [0u128; 4];
    // SAFETY: `out` is 64 bytes, written as one unaligned vector; a u128's
    // bytes on x86_64 are little-endian, as the tweak's.
    unsafe { _mm512_storeu_si512(out.as_mut_ptr().cast::<__m512i>(), x) };
    out
}

/// Multiplies each 128-bit lane (a tweak) by x^8 in GF(2^128): shifted
/// left a byte, the byte shifted out times 0x87 (at most 15 bits) XORed
/// back in at the bottom.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,vpclmulqdq")]
fn mul_x8(t: __m512i, poly: __m512i) -> __m512i {
    let carry = _mm512_bsrli_epi128::<15>(t);
    let red = _mm512_clmulepi64_epi128::<0x00>(carry, poly);
    _mm512_xor_si512(_mm512_bslli_epi128::<1>(t), red)
}

/// Multiplies each 128-bit lane (a tweak) by x^16 in GF(2^128): shifted
/// left two bytes, the two bytes shifted out times 0x87 (at most 23 bits,
/// so no further reduction) XORed back in at the bottom.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,vpclmulqdq")]
fn mul_x16(t: __m512i, poly: __m512i) -> __m512i {
    let carry = _mm512_bsrli_epi128::<14>(t);
    let red = _mm512_clmulepi64_epi128::<0x00>(carry, poly);
    _mm512_xor_si512(_mm512_bslli_epi128::<2>(t), red)
}

/// Multiplies each 128-bit lane of `t` by x^k in GF(2^128), k (below 56)
/// given in both 64-bit halves of the lane in `k` (`poly` is 0x87 in
/// every 64-bit half): each half shifted left
/// k bits, the bits out of the low half carried into the high one, those
/// out of the high half (at most 55) times 0x87 XORed into the low one.
#[inline]
#[target_feature(enable = "avx512f,vpclmulqdq")]
fn mul_xk(t: __m512i, k: __m512i, poly: __m512i) -> __m512i {
    let shifted = _mm512_sllv_epi64(t, k);
    // The top k bits of each half (none for k = 0: a shift by 64 gives 0).
    let out = _mm512_srlv_epi64(t, _mm512_sub_epi64(_mm512_set1_epi64(64), k));
    // Halves swapped: the low half's bits now in the high half, the high
    // half's overflow in the low one.
    let swapped = _mm512_shuffle_epi32::<0x4e>(out);
    let carry = _mm512_maskz_mov_epi64(0xaa, swapped);
    let red = _mm512_clmulepi64_epi128::<0x00>(swapped, poly);
    _mm512_ternarylogic_epi64::<0x96>(shifted, carry, red)
}

/// Stores a register of output: streamed past the caches (`nt`) or
/// through them.
///
/// # Safety
/// `d` is valid for a 64-byte write, and 64-byte aligned when `nt`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn put(nt: bool, d: *mut __m512i, x: __m512i) {
    // SAFETY: per this function's contract.
    unsafe {
        if nt {
            _mm512_stream_si512(d.cast(), x)
        } else {
            _mm512_storeu_si512(d, x)
        }
    }
}

/// One register of 4 blocks through the cipher, with its 4 tweaks: `first`
/// is round key 0, `last` the last round key XOR the tweaks.
#[inline]
#[target_feature(enable = "avx512f,vaes")]
fn one<const ENC: bool, const NR: usize>(x: __m512i, tw: __m512i, rk: &[__m512i; 15]) -> __m512i {
    // 0x96: a ^ b ^ c.
    let mut x = _mm512_ternarylogic_epi64::<0x96>(x, tw, rk[0]);
    let last = _mm512_xor_si512(rk[NR], tw);
    for k in &rk[1..NR] {
        x = if ENC {
            _mm512_aesenc_epi128(x, *k)
        } else {
            _mm512_aesdec_epi128(x, *k)
        };
    }
    if ENC {
        _mm512_aesenclast_epi128(x, last)
    } else {
        _mm512_aesdeclast_epi128(x, last)
    }
}

/// XTS over `units` consecutive units of `unit` bytes from `src` to `dst`
/// with the schedule `ks` (`enc` to encrypt, `dec` to decrypt) and the
/// tweak key's `tk` (`tnr` rounds); unit i's IV is `iv(i)`. The round keys
/// are broadcast once a call, the tweaks encrypted 4 units at a time.
///
/// # Safety
/// The CPU has AVX-512F, AVX-512BW, VAES and VPCLMULQDQ; `unit` is a
/// multiple of 16; `src` is valid for reads and `dst` for writes of `units
/// * unit` bytes, and they are the same pointer or do not overlap; with
/// `nt`, `dst` is 64-byte aligned and `unit` a multiple of 64.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,vaes,vpclmulqdq")]
unsafe fn xts_units<const ENC: bool, const NR: usize>(
    nt: bool,
    ks: &Schedule,
    tk: &Schedule,
    tnr: usize,
    mut iv: impl FnMut(usize) -> [u8; 16],
    src: *const u8,
    dst: *mut u8,
    unit: usize,
    units: usize,
) {
    let mut rk = [_mm512_setzero_si512(); 15];
    for (r, k) in rk.iter_mut().zip(ks.iter()).take(NR + 1) {
        *r = _mm512_broadcast_i32x4(from_u128(u128::from_le_bytes(*k)));
    }
    // The first tweaks of the next 4 units are encrypted before this
    // group's data: their 14 dependent rounds then run beside the data's
    // instead of stalling every fourth unit (512-byte units: 12-17% more
    // per CPU-second).
    let mut group = |u: usize| {
        let mut ivs = [[0u8; 16]; 4];
        for (j, v) in ivs.iter_mut().enumerate().take((units - u).min(4)) {
            *v = iv(u + j);
        }
        encrypt4(tk, tnr, &ivs)
    };
    let mut u = 0;
    let mut next = if units > 0 { group(0) } else { [0; 4] };
    while u < units {
        let n = (units - u).min(4);
        let tw = next;
        if u + n < units {
            next = group(u + n);
        }
        for (j, &t) in tw.iter().enumerate().take(n) {
            let off = (u + j) * unit;
            // SAFETY: the features are this function's; unit u + j is
            // bytes off..off + unit, inside the `units * unit` bytes `src`
            // and `dst` are valid for, and the two are equal or disjoint.
            unsafe { xts::<ENC, NR>(nt, &rk, t, src.add(off), dst.add(off), unit / 16) };
            // (With `nt`, `off` is a multiple of `unit`, itself of 64.)
        }
        u += n;
    }
}

/// XTS over `blocks` 16-byte blocks from `src` to `dst` with the round
/// keys `rk` (broadcast to every lane) and first tweak `t`.
///
/// # Safety
/// The CPU has AVX-512F, AVX-512BW, VAES and VPCLMULQDQ; `src` is valid
/// for reads and `dst` for writes of `blocks * 16` bytes, and they are the
/// same pointer or do not overlap; with `nt`, `dst` is 64-byte aligned and
/// `blocks` a multiple of 4 (whole 64-byte lines).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,vaes,vpclmulqdq")]
unsafe fn xts<const ENC: bool, const NR: usize>(
    nt: bool,
    rk: &[__m512i; 15],
    t: u128,
    src: *const u8,
    dst: *mut u8,
    blocks: usize,
) {
    // The first 16 tweaks: T * x^0..3 in one register, then that times
    // x^4, x^8, x^12; after that x^16 a register per iteration.
    let poly = _mm512_set1_epi64(0x87);
    let t = _mm512_broadcast_i32x4(from_u128(t));
    let tw0 = mul_xk(t, _mm512_set_epi64(3, 3, 2, 2, 1, 1, 0, 0), poly);
    // x^8 is a byte shift, cheaper than a shift by any k.
    let tw1 = mul_xk(tw0, _mm512_set1_epi64(4), poly);
    let mut tws = [tw0, tw1, mul_x8(tw0, poly), mul_x8(tw1, poly)];
    let mut i = 0;
    // 32 blocks an iteration, 8 registers: 8 chains of dependent rounds in
    // flight, so the AES units never wait on one chain's latency (a
    // 512-byte unit is one iteration).
    while i + 32 <= blocks {
        let hi = [
            mul_x16(tws[0], poly),
            mul_x16(tws[1], poly),
            mul_x16(tws[2], poly),
            mul_x16(tws[3], poly),
        ];
        // SAFETY: blocks i..i+32 are inside the `blocks * 16` bytes `src`
        // and `dst` are valid for (loop condition); each is read before the
        // same bytes are written, so `src == dst` works in place; with
        // `nt` each register's 64 bytes are a line of the aligned `dst`.
        unsafe {
            let s = src.add(i * 16).cast::<__m512i>();
            let d = dst.add(i * 16).cast::<__m512i>();
            let x0 = one::<ENC, NR>(_mm512_loadu_si512(s), tws[0], rk);
            let x1 = one::<ENC, NR>(_mm512_loadu_si512(s.add(1)), tws[1], rk);
            let x2 = one::<ENC, NR>(_mm512_loadu_si512(s.add(2)), tws[2], rk);
            let x3 = one::<ENC, NR>(_mm512_loadu_si512(s.add(3)), tws[3], rk);
            let x4 = one::<ENC, NR>(_mm512_loadu_si512(s.add(4)), hi[0], rk);
            let x5 = one::<ENC, NR>(_mm512_loadu_si512(s.add(5)), hi[1], rk);
            let x6 = one::<ENC, NR>(_mm512_loadu_si512(s.add(6)), hi[2], rk);
            let x7 = one::<ENC, NR>(_mm512_loadu_si512(s.add(7)), hi[3], rk);
            put(nt, d, x0);
            put(nt, d.add(1), x1);
            put(nt, d.add(2), x2);
            put(nt, d.add(3), x3);
            put(nt, d.add(4), x4);
            put(nt, d.add(5), x5);
            put(nt, d.add(6), x6);
            put(nt, d.add(7), x7);
        }
        for (t, h) in tws.iter_mut().zip(hi) {
            *t = mul_x16(h, poly);
        }
        i += 32;
    }
    // Fewer than 32 blocks left (none for units of 512 bytes to 4 KiB):
    // the tweak registers and those times x^16 hold theirs in order, 4 a
    // register, one register at a time.
    let hi = tws.map(|t| mul_x16(t, poly));
    for tw in tws.into_iter().chain(hi) {
        if i >= blocks {
            break;
        }
        let n = (blocks - i).min(4);
        // 4 dwords a block; n = 4 is all 16 lanes.
        let mask: __mmask16 = ((1u32 << (4 * n)) - 1) as __mmask16;
        // SAFETY: the mask covers the n blocks i..i+n, inside the `blocks
        // * 16` bytes `src` and `dst` are valid for; masked-off lanes are
        // neither read nor written (and cannot fault). In place, the load
        // precedes the store.
        unsafe {
            let x = _mm512_maskz_loadu_epi32(mask, src.add(i * 16).cast::<i32>());
            let x = one::<ENC, NR>(x, tw, rk);
            _mm512_mask_storeu_epi32(dst.add(i * 16).cast::<i32>(), mask, x);
        }
        i += n;
    }
}
