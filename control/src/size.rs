//! Sizes as people write them: `4096`, `4k`, `1G`, `512MiB`, `8s`.

use udm_core::Error;

/// Parses a size: a number with an optional K, M, G, T suffix (powers of
/// 1024, optionally followed by `iB` or `B`), or `s` for 512-byte sectors.
pub fn parse_size(s: &str) -> Result<u64, Error> {
    let bad = || {
        Error::invalid(format!(
            "invalid size '{s}': expected a number with an optional K/M/G/T or s (sectors) suffix"
        ))
    };
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    if digits == 0 {
        return Err(bad());
    }
    let n: u64 = t[..digits].parse().map_err(|_| bad())?;
    let mult: u64 = match t[digits..].to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "s" => 512,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(bad()),
    };
    n.checked_mul(mult).ok_or_else(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_accept_binary_suffixes_and_sectors() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("8s").unwrap(), 4096);
        for bad in ["", "G", "1X", "-1", "1.5G", "99999999999999999999T"] {
            let e = parse_size(bad).unwrap_err().to_string();
            assert!(e.contains("invalid size"), "{bad}: {e}");
        }
    }
}
