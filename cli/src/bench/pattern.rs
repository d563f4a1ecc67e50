//! The verify pattern: every 512-byte sector carries its own sector number
//! and the run's generation, then bytes derived from both, so a read that
//! returns another sector's data, stale data or garbage is told apart.

use udm_core::SECTOR_SIZE;

const MAGIC: u64 = 0x7564_6d76_6572_6679; // "udmverfy"

#[inline]
fn fill_word(sector: u64, generation: u64, i: u64) -> u64 {
    let mut x = sector.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ generation ^ (i << 40);
    x ^= x >> 31;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^ (x >> 29)
}

/// Fills `buf` (whole sectors) with the pattern for the sectors from `sector`.
pub fn fill(buf: &mut [u8], sector: u64, generation: u64) {
    for (k, s) in buf.chunks_exact_mut(SECTOR_SIZE as usize).enumerate() {
        let sec = sector + k as u64;
        for (i, w) in s.chunks_exact_mut(8).enumerate() {
            let v = match i {
                0 => MAGIC,
                1 => sec,
                2 => generation,
                _ => fill_word(sec, generation, i as u64),
            };
            w.copy_from_slice(&v.to_le_bytes());
        }
    }
}

/// Checks `buf` against the pattern; the error says what was found instead.
pub fn check(buf: &[u8], sector: u64, generation: u64) -> Result<(), String> {
    for (k, s) in buf.chunks_exact(SECTOR_SIZE as usize).enumerate() {
        let sec = sector + k as u64;
        let word = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&s[i * 8..i * 8 + 8]);
            u64::from_le_bytes(b)
        };
        if word(0) != MAGIC {
            return Err(if s.iter().all(|&b| b == 0) {
                format!("sector {sec}: reads back as zeroes (the write was lost)")
            } else {
                format!("sector {sec}: no verify header (garbage)")
            });
        }
        if word(1) != sec {
            return Err(format!(
                "sector {sec}: holds sector {}'s data (misdirected)",
                word(1)
            ));
        }
        if word(2) != generation {
            return Err(format!(
                "sector {sec}: holds generation {} instead of {generation} (stale)",
                word(2)
            ));
        }
        for i in 3..(SECTOR_SIZE as usize / 8) {
            if word(i) != fill_word(sec, generation, i as u64) {
                return Err(format!("sector {sec}: corrupt at byte {}", i * 8));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filled_buffer_checks_and_each_kind_of_damage_is_named() {
        let mut b = vec![0u8; 4096];
        assert!(check(&b, 8, 1).unwrap_err().contains("zeroes"));
        fill(&mut b, 8, 1);
        assert!(check(&b, 8, 1).is_ok());
        assert!(check(&b, 16, 1).unwrap_err().contains("misdirected"));
        assert!(check(&b, 8, 2).unwrap_err().contains("stale"));
        b[1000] ^= 1;
        assert!(check(&b, 8, 1).unwrap_err().contains("corrupt"));
    }
}
