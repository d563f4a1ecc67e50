//! The key: where a crypt target's secret lives, and how a table line gives it.
//!
//! dm-crypt takes the key as hex in the table line, or as
//! `:<key_size>:<key_type>:<key_description>`, the name of a key in the
//! kernel keyring. Both are accepted here. udm runs in user space, so from
//! the keyring it can read a `user` key (`keyctl_read`), but never a `logon`
//! key (the kernel does not let user space read those): that is refused in
//! one line.
//!
//! The bytes, and every AES key schedule made from them, live in a
//! [`Secret`]: a page of their own, locked in memory (`mlock`, so never
//! swapped), left out of core dumps (`MADV_DONTDUMP`) and wiped when
//! dropped. Where locking is not allowed (RLIMIT_MEMLOCK), the secret still
//! works, unlocked; nothing else is best-effort. The text of the table line
//! itself belongs to the caller and is not wiped here.

use std::fmt::Write as _;
use std::mem::{align_of, size_of};
use std::ops::Deref;
use std::ptr::NonNull;

use udm_core::{Error, Mmap};
use zeroize::Zeroize;

/// A value kept on locked pages of its own, left out of core dumps, its
/// bytes zeroed when dropped (after the value's own drop, which for the AES
/// key schedules zeroes them too).
pub struct Secret<T> {
    map: Mmap,
    ptr: NonNull<T>,
    locked: bool,
}

// SAFETY: a Secret owns its T as a Box would; sharing or sending it is
// sound exactly when sharing or sending the T is.
unsafe impl<T: Send> Send for Secret<T> {}
// SAFETY: as above; `&Secret<T>` gives out only `&T`.
unsafe impl<T: Sync> Sync for Secret<T> {}

impl<T> Secret<T> {
    /// Moves `value` onto pages of its own and locks them.
    pub fn new(value: T) -> Result<Secret<T>, Error> {
        const { assert!(align_of::<T>() <= 4096) };
        let map = Mmap::anon(size_of::<T>().max(1))?;
        let ptr = map.as_ptr().cast::<T>();
        // SAFETY: the mapping is fresh, page-aligned (so aligned for T,
        // asserted above) and at least size_of::<T>() bytes; nothing else
        // points into it.
        unsafe { ptr.write(value) };
        // Not in core dumps; a kernel without the advice only loses that.
        let _ = map.advise(libc::MADV_DONTDUMP);
        // SAFETY: mlock takes any range; this is exactly our mapping.
        let locked = unsafe { libc::mlock(map.as_ptr().cast(), map.len()) } == 0;
        Ok(Secret {
            // SAFETY: Mmap's address is never null.
            ptr: unsafe { NonNull::new_unchecked(ptr) },
            map,
            locked,
        })
    }

    /// The value, mutably (the Secret owns it alone).
    pub fn get_mut(&mut self) -> &mut T {
        // SAFETY: `ptr` holds the T written in `new`; `&mut self` makes
        // this the only reference to it.
        unsafe { self.ptr.as_mut() }
    }

    /// Whether the pages are locked in memory (mlock succeeded).
    pub fn is_locked(&self) -> bool {
        self.locked
    }
}

impl<T> Deref for Secret<T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: `ptr` holds the T written in `new`, alive until drop.
        unsafe { self.ptr.as_ref() }
    }
}

impl<T> Drop for Secret<T> {
    fn drop(&mut self) {
        // SAFETY: the T written in `new` is dropped once, here.
        unsafe { std::ptr::drop_in_place(self.ptr.as_ptr()) };
        // SAFETY: the mapping is ours and `len` bytes long; the T in it has
        // been dropped, so nothing refers to these bytes any more.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.map.as_ptr(), self.map.len()) };
        bytes.zeroize();
        if self.locked {
            // SAFETY: the range is our mapping, locked in `new`.
            unsafe { libc::munlock(self.map.as_ptr().cast(), self.map.len()) };
        }
    }
}

/// The longest key accepted, in bytes (dm-crypt's keys for AES-XTS-256
/// are 64).
pub const MAX_KEY: usize = 128;

/// Key bytes (kept inside a [`Secret`]).
pub struct KeyBytes {
    len: usize,
    bytes: [u8; MAX_KEY],
}

impl KeyBytes {
    /// The key.
    pub fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

impl Drop for KeyBytes {
    fn drop(&mut self) {
        self.bytes.zeroize();
    }
}

/// Where the key came from, which decides how the table line shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeySource {
    /// Hex in the table line: a secret, hidden unless keys are shown.
    Hex,
    /// `:<size>:<type>:<description>` in the keyring: a name, not a secret.
    Keyring(String),
}

/// A parsed key argument: the bytes and where they came from.
pub struct Key {
    bytes: Secret<KeyBytes>,
    source: KeySource,
}

impl Key {
    /// Parses the table line's `<key>` argument: hex digits, or
    /// `:<key_size>:<logon|user>:<description>` read from the keyring.
    /// The error never quotes a hex key.
    pub fn parse(arg: &str) -> Result<Key, Error> {
        if arg.starts_with(':') {
            return Key::from_keyring(arg);
        }
        let digits = arg.as_bytes();
        if !digits.len().is_multiple_of(2) || digits.len() / 2 > MAX_KEY {
            return Err(Error::invalid(format!(
                "invalid key: {} hex digits, expected an even number up to {}",
                digits.len(),
                MAX_KEY * 2
            )));
        }
        let mut kb = Secret::new(KeyBytes {
            len: 0,
            bytes: [0; MAX_KEY],
        })?;
        // Decode straight into the locked page (no copy elsewhere).
        let k = kb.get_mut();
        for (i, pair) in digits.chunks_exact(2).enumerate() {
            let (Some(hi), Some(lo)) = (nibble(pair[0]), nibble(pair[1])) else {
                return Err(Error::invalid(format!(
                    "invalid key: character {} is not a hex digit",
                    i * 2 + if nibble(pair[0]).is_none() { 1 } else { 2 }
                )));
            };
            k.bytes[i] = hi << 4 | lo;
        }
        k.len = digits.len() / 2;
        Ok(Key {
            bytes: kb,
            source: KeySource::Hex,
        })
    }

    /// A key given as bytes (a LUKS volume key), copied onto locked pages.
    pub fn from_bytes(b: &[u8]) -> Result<Key, Error> {
        if b.len() > MAX_KEY {
            return Err(Error::invalid(format!(
                "key of {} bytes is longer than {MAX_KEY}",
                b.len()
            )));
        }
        let mut kb = Secret::new(KeyBytes {
            len: b.len(),
            bytes: [0; MAX_KEY],
        })?;
        kb.get_mut().bytes[..b.len()].copy_from_slice(b);
        Ok(Key {
            bytes: kb,
            source: KeySource::Hex,
        })
    }

    fn from_keyring(arg: &str) -> Result<Key, Error> {
        let bad = || {
            Error::invalid(format!(
                "invalid keyring key '{arg}': expected :<key_size>:<logon|user>:<description>"
            ))
        };
        let mut it = arg[1..].splitn(3, ':');
        let (Some(size), Some(ty), Some(desc)) = (it.next(), it.next(), it.next()) else {
            return Err(bad());
        };
        let size: usize = size.parse().map_err(|_| bad())?;
        if desc.is_empty() || size == 0 || size > MAX_KEY {
            return Err(bad());
        }
        match ty {
            "user" => {}
            "logon" => {
                return Err(Error::invalid(format!(
                    "keyring key '{arg}': a logon key cannot be read from user space; \
                     use a user key or give the key in hex"
                )))
            }
            t => {
                return Err(Error::invalid(format!(
                    "keyring key '{arg}': unknown key type '{t}': expected logon or user"
                )))
            }
        }
        let mut kb = Secret::new(KeyBytes {
            len: size,
            bytes: [0; MAX_KEY],
        })?;
        let buf = &mut kb.get_mut().bytes;
        let got = keyring_read(desc, buf)
            .map_err(|e| Error::invalid(format!("keyring key '{arg}': {e}")))?;
        if got != size {
            return Err(Error::invalid(format!(
                "keyring key '{arg}': the key holds {got} bytes, not {size}"
            )));
        }
        Ok(Key {
            bytes: kb,
            source: KeySource::Keyring(arg.to_string()),
        })
    }

    /// The key bytes.
    pub fn bytes(&self) -> &[u8] {
        self.bytes.as_slice()
    }

    /// Whether the key's pages are locked in memory.
    pub fn is_locked(&self) -> bool {
        self.bytes.is_locked()
    }

    /// Appends the key as a table line shows it: a keyring name as given; a
    /// hex key as hex when `show`, else as `-` (which no constructor
    /// accepts, so a table printed without keys cannot be loaded back by
    /// mistake with a wrong key).
    pub fn write_table(&self, show: bool, out: &mut String) {
        match &self.source {
            KeySource::Keyring(name) => out.push_str(name),
            KeySource::Hex if show => {
                for b in self.bytes() {
                    let _ = write!(out, "{b:02x}");
                }
            }
            KeySource::Hex => out.push('-'),
        }
    }
}

fn nibble(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Finds the `user` key `desc` in the caller's keyrings (`request_key(2)`)
/// and reads it into `buf` (`keyctl(KEYCTL_READ)`); returns its length.
fn keyring_read(desc: &str, buf: &mut [u8]) -> Result<usize, String> {
    let c_desc = std::ffi::CString::new(desc).map_err(|_| "description has a NUL byte")?;
    // SAFETY: both strings are NUL-terminated and live across the call;
    // the callout info is null (no upcall) and the destination keyring 0.
    let id = unsafe {
        libc::syscall(
            libc::SYS_request_key,
            c"user".as_ptr(),
            c_desc.as_ptr(),
            std::ptr::null::<libc::c_char>(),
            0,
        )
    };
    if id < 0 {
        let e = std::io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::ENOSYS) => "this kernel has no keyring (request_key: ENOSYS)".into(),
            Some(libc::ENOKEY) => "no such user key in the keyring".into(),
            _ => format!("request_key: {e}"),
        });
    }
    const KEYCTL_READ: libc::c_long = 11;
    // SAFETY: `buf` is writable for `buf.len()` bytes across the call.
    let n = unsafe {
        libc::syscall(
            libc::SYS_keyctl,
            KEYCTL_READ,
            id,
            buf.as_mut_ptr(),
            buf.len(),
        )
    };
    if n < 0 {
        return Err(format!("keyctl read: {}", std::io::Error::last_os_error()));
    }
    Ok(n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_keys_parse_and_print_only_when_shown() {
        let k = Key::parse("00112233445566778899aAbBcCdDeEfF").unwrap();
        assert_eq!(k.bytes()[..4], [0x00, 0x11, 0x22, 0x33]);
        assert_eq!(k.bytes().len(), 16);
        let mut s = String::new();
        k.write_table(false, &mut s);
        assert_eq!(s, "-");
        s.clear();
        k.write_table(true, &mut s);
        assert_eq!(s, "00112233445566778899aabbccddeeff");
    }

    #[test]
    fn bad_keys_are_refused_without_quoting_them() {
        let e = |a: &str| Key::parse(a).err().unwrap().to_string();
        assert_eq!(
            e("abc"),
            "invalid key: 3 hex digits, expected an even number up to 256"
        );
        let m = e("00g1");
        assert_eq!(m, "invalid key: character 3 is not a hex digit");
        assert!(e(":32:logon:cryptsetup:x").contains("logon key cannot be read"));
        assert!(e(":32:big:x").contains("unknown key type 'big'"));
        assert!(e(":x:user:x").contains("expected :<key_size>:<logon|user>:<description>"));
    }

    /// A `user` key added to the session keyring is read back by name; on
    /// a kernel without keyrings the error says so in one line.
    #[test]
    fn user_keys_come_from_the_keyring() {
        let desc = format!("udm-test-{}", std::process::id());
        let key = [0x5au8; 32];
        const KEY_SPEC_PROCESS_KEYRING: libc::c_long = -2;
        let c_desc = std::ffi::CString::new(desc.clone()).unwrap();
        // SAFETY: valid NUL-terminated strings and a 32-byte payload.
        let id = unsafe {
            libc::syscall(
                libc::SYS_add_key,
                c"user".as_ptr(),
                c_desc.as_ptr(),
                key.as_ptr(),
                key.len(),
                KEY_SPEC_PROCESS_KEYRING,
            )
        };
        let arg = format!(":32:user:{desc}");
        if id < 0 {
            let e = Key::parse(&arg).err().unwrap().to_string();
            assert!(e.starts_with(&format!("keyring key '{arg}': ")), "{e}");
            return;
        }
        let k = Key::parse(&arg).unwrap();
        assert_eq!(k.bytes(), &key);
        let mut s = String::new();
        k.write_table(false, &mut s);
        assert_eq!(s, arg);
        let e = Key::parse(&format!(":16:user:{desc}"))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("holds 32 bytes, not 16"), "{e}");
    }

    #[test]
    fn secrets_are_locked_where_the_limit_allows() {
        let s = Secret::new([1u8; 64]).unwrap();
        assert_eq!(s[63], 1);
        // root or a memlock limit of at least a page: locked.
        let lim = udm_core::memlock::soft_limit().unwrap();
        if lim.is_none_or(|l| l >= 4096) {
            assert!(s.is_locked());
        }
    }
}
