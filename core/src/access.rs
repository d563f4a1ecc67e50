//! Who may connect to udm's unix sockets (the control socket, vhost-user-blk
//! sockets): udm's own user, root, and the members of one group if one is
//! given (`--socket-group`). Two walls, each enough alone:
//!
//! - **The file**: a socket is created mode 0600 (0660 and the group's with
//!   a group) in a directory that no one but its owner (udm's user or root)
//!   can write, or that is sticky (as `/tmp`), where no one else can remove
//!   or rename udm's socket. Every directory above it is held to the same
//!   rule, as sshd's `StrictModes` does, since whoever can rename one of
//!   them can put another socket in its place. The mode is set on the
//!   socket before `bind` (Linux creates the file with it), so the file is
//!   never open wider than asked, not even for an instant, and no umask is
//!   changed under the process's other threads.
//! - **The peer**: each connection's credentials (`SO_PEERCRED`, and
//!   `SO_PEERGROUPS` for the supplementary groups) are checked against the
//!   same users, so a mode or directory opened by mistake afterwards still
//!   lets no one else in.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

use crate::{Error, ErrorKind};

/// Who may connect: udm's user and root always, and the members of
/// `group` (by gid) if given.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Access {
    /// The group admitted besides udm's user and root (`--socket-group`);
    /// its sockets are mode 0660 and belong to it.
    pub group: Option<u32>,
}

/// The credentials of a connected peer, as the kernel recorded them when
/// it connected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    /// Its process.
    pub pid: i32,
    /// Its effective uid.
    pub uid: u32,
    /// Its effective gid.
    pub gid: u32,
    /// Its supplementary groups (empty where the kernel cannot say).
    pub groups: Vec<u32>,
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "uid {} (pid {})", self.uid, self.pid)
    }
}

/// The process's effective uid.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

impl Access {
    /// Only udm's user and root.
    pub const OWNER: Access = Access { group: None };

    /// The mode its sockets are given.
    pub fn mode(&self) -> u32 {
        if self.group.is_some() {
            0o660
        } else {
            0o600
        }
    }

    /// Whether `peer` may talk to the socket: root, udm's user, or (with a
    /// group) a member of it.
    pub fn admits(&self, peer: &Peer) -> bool {
        peer.uid == 0
            || peer.uid == euid()
            || self
                .group
                .is_some_and(|g| peer.gid == g || peer.groups.contains(&g))
    }

    /// Who is admitted, for a refusal's message.
    pub fn who(&self) -> String {
        let me = euid();
        match (me, self.group) {
            (0, None) => "root only".into(),
            (0, Some(g)) => format!("root and group {g}"),
            (u, None) => format!("uid {u} and root only"),
            (u, Some(g)) => format!("uid {u}, root and group {g}"),
        }
    }

    /// The peer at the other end of `sock` if it is admitted; a one-line
    /// error naming its uid otherwise (also when its credentials cannot be
    /// read).
    pub fn check(&self, sock: &impl AsRawFd) -> Result<Peer, Error> {
        let p = peer(sock).map_err(|e| {
            Error::new(
                ErrorKind::Denied,
                format!("reading the peer's credentials: {e}"),
            )
        })?;
        if self.admits(&p) {
            Ok(p)
        } else {
            Err(Error::new(
                ErrorKind::Denied,
                format!("permission denied: {p} is not admitted ({})", self.who()),
            ))
        }
    }

    /// Creates a listening unix socket at `path` with [`Access::mode`] (and
    /// the group's), after [`check_dir`] on its directory. `path` must not
    /// exist (the caller decides what to do with a stale socket there).
    /// `what` names the socket in errors ("control socket '…'").
    pub fn bind(&self, path: &Path, what: &str) -> Result<UnixListener, Error> {
        check_dir(&dir_of(path)).map_err(|e| e.context(what))?;
        let os = |e: std::io::Error| Error::os(what, e);
        let cpath = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| Error::invalid(format!("{what}: a NUL byte in the path")))?;
        // SAFETY: sockaddr_un is plain old data; all zeroes is valid.
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        let bytes = cpath.as_bytes_with_nul();
        if bytes.len() > addr.sun_path.len() {
            return Err(Error::invalid(format!(
                "{what}: path longer than {} bytes",
                addr.sun_path.len() - 1
            )));
        }
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
            *d = *s as libc::c_char;
        }
        // SAFETY: socket() takes no pointers; the result is checked.
        let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(os(std::io::Error::last_os_error()));
        }
        // SAFETY: fd was just created and is owned only here.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // Linux creates the socket's file with the socket inode's mode
        // (less the umask): 0600 from the first instant. The group's bits
        // are added only once the file belongs to the group.
        // SAFETY: fchmod on our own descriptor.
        if unsafe { libc::fchmod(fd.as_raw_fd(), 0o600) } != 0 {
            return Err(os(std::io::Error::last_os_error()));
        }
        // SAFETY: addr is a live sockaddr_un; the length is its size.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_un).cast(),
                std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(os(std::io::Error::last_os_error()));
        }
        let placed = (|| {
            if let Some(g) = self.group {
                std::os::unix::fs::lchown(path, None, Some(g)).map_err(|e| {
                    Error::os(
                        format!("{what}: giving it to group {g} (is udm's user a member?)"),
                        e,
                    )
                })?;
            }
            // Exactly the mode, whatever the umask took away.
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(self.mode()))
                .map_err(os)?;
            // SAFETY: listen on our own bound socket.
            if unsafe { libc::listen(fd.as_raw_fd(), 128) } != 0 {
                return Err(os(std::io::Error::last_os_error()));
            }
            Ok(())
        })();
        if let Err(e) = placed {
            let _ = std::fs::remove_file(path);
            return Err(e);
        }
        Ok(UnixListener::from(fd))
    }
}

/// Reads the credentials of the peer of a connected unix socket.
pub fn peer(sock: &impl AsRawFd) -> std::io::Result<Peer> {
    let fd = sock.as_raw_fd();
    let mut cred = libc::ucred {
        pid: 0,
        uid: u32::MAX,
        gid: u32::MAX,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred is a live ucred and len its size; the kernel writes at most len bytes.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut groups = vec![0u32; 64];
    loop {
        let mut len = (groups.len() * 4) as libc::socklen_t;
        // SAFETY: groups is a live buffer of len bytes; the kernel writes at most len.
        let r = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        if r == 0 {
            groups.truncate(len as usize / 4);
            break;
        }
        let e = std::io::Error::last_os_error();
        // ERANGE says how much room the list needs.
        if e.raw_os_error() == Some(libc::ERANGE) && (len as usize / 4) > groups.len() {
            groups.resize(len as usize / 4, 0);
            continue;
        }
        // A kernel without SO_PEERGROUPS: the primary group still counts.
        groups.clear();
        break;
    }
    Ok(Peer {
        pid: cred.pid,
        uid: cred.uid,
        gid: cred.gid,
        groups,
    })
}

/// Checks that `dir` and every directory above it belong to udm's user or
/// root and that no one else can write them, unless sticky (as `/tmp`):
/// else another user could put a socket of theirs in place of udm's. One
/// line naming the directory and its mode otherwise.
pub fn check_dir(dir: &Path) -> Result<(), Error> {
    let full = std::fs::canonicalize(dir)
        .map_err(|e| Error::os(format!("socket directory '{}'", dir.display()), e))?;
    let me = euid();
    let mut at: Option<&Path> = Some(&full);
    while let Some(d) = at {
        let m = std::fs::metadata(d)
            .map_err(|e| Error::os(format!("socket directory '{}'", d.display()), e))?;
        let mode = m.mode() & 0o7777;
        if m.uid() != me && m.uid() != 0 {
            return Err(Error::new(
                ErrorKind::Denied,
                format!(
                    "socket directory '{}' belongs to uid {}, not to udm's user (uid {me}) or root: that user could replace the socket",
                    d.display(),
                    m.uid()
                ),
            ));
        }
        if mode & 0o022 != 0 && mode & 0o1000 == 0 {
            return Err(Error::new(
                ErrorKind::Denied,
                format!(
                    "socket directory '{}' (mode {mode:04o}) can be written by others and is not sticky: they could replace the socket (chmod go-w it, or pick another directory)",
                    d.display()
                ),
            ));
        }
        at = d.parent();
    }
    Ok(())
}

/// Creates `dir` (and the directories above it that are missing) mode
/// 0700 from the start; with a group, `dir` itself is then given to the
/// group, mode 0750, so that its members reach the sockets in it. An
/// existing directory is left as it is.
pub fn make_private_dir(dir: &Path, access: Access) -> Result<(), Error> {
    use std::os::unix::fs::DirBuilderExt;
    if dir.as_os_str().is_empty() || dir.is_dir() {
        return Ok(());
    }
    let what = || format!("socket directory '{}'", dir.display());
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| Error::os(what(), e))?;
    if let Some(g) = access.group {
        std::os::unix::fs::lchown(dir, None, Some(g)).map_err(|e| Error::os(what(), e))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o750))
            .map_err(|e| Error::os(what(), e))?;
    }
    Ok(())
}

/// The gid of `--socket-group GROUP`: a group name, or a number.
pub fn parse_group(s: &str) -> Result<u32, Error> {
    if let Ok(g) = s.parse::<u32>() {
        return Ok(g);
    }
    let name = CString::new(s)
        .map_err(|_| Error::invalid(format!("--socket-group '{s}': a NUL byte in the name")))?;
    // SAFETY: group is plain old data; getgrnam_r fills it.
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; 4096];
    loop {
        let mut out: *mut libc::group = std::ptr::null_mut();
        // SAFETY: every pointer is live for the call; buf's length is passed.
        let r = unsafe {
            libc::getgrnam_r(
                name.as_ptr(),
                &mut grp,
                buf.as_mut_ptr(),
                buf.len(),
                &mut out,
            )
        };
        if r == libc::ERANGE && buf.len() < 1 << 20 {
            buf.resize(buf.len() * 4, 0);
            continue;
        }
        if r != 0 {
            return Err(Error::os(
                format!("--socket-group '{s}'"),
                std::io::Error::from_raw_os_error(r),
            ));
        }
        if out.is_null() {
            return Err(Error::new(
                ErrorKind::NotFound,
                format!("--socket-group '{s}': no such group"),
            ));
        }
        return Ok(grp.gr_gid);
    }
}

/// A path's directory for error messages and checks ("." for a bare name).
pub fn dir_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::TempDir;
    use std::os::unix::net::UnixStream;

    #[test]
    fn sockets_are_made_0600_or_0660_with_a_group() {
        let d = TempDir::new("access");
        let p = d.path("s");
        let _l = Access::OWNER.bind(&p, "test socket").unwrap();
        let m = std::fs::metadata(&p).unwrap();
        assert_eq!(m.mode() & 0o7777, 0o600);
        let p2 = d.path("g");
        // SAFETY: getegid has no preconditions.
        let my_gid = unsafe { libc::getegid() };
        let a = Access {
            group: Some(my_gid),
        };
        let _l2 = a.bind(&p2, "test socket").unwrap();
        let m = std::fs::metadata(&p2).unwrap();
        assert_eq!((m.mode() & 0o7777, m.gid()), (0o660, my_gid));
    }

    #[test]
    fn the_peer_is_read_from_the_kernel() {
        let (a, _b) = UnixStream::pair().unwrap();
        let p = peer(&a).unwrap();
        assert_eq!(p.uid, euid());
        assert_eq!(p.pid, std::process::id() as i32);
        assert!(Access::OWNER.check(&a).is_ok());
    }

    #[test]
    fn only_the_owner_root_and_the_group_are_admitted() {
        let me = euid();
        let p = |uid, gid, groups: &[u32]| Peer {
            pid: 1,
            uid,
            gid,
            groups: groups.to_vec(),
        };
        let stranger = if me == 65534 { 65533 } else { 65534 };
        assert!(Access::OWNER.admits(&p(0, 0, &[])));
        assert!(Access::OWNER.admits(&p(me, 5, &[])));
        assert!(!Access::OWNER.admits(&p(stranger, 7, &[7])));
        let g = Access { group: Some(7) };
        assert!(g.admits(&p(stranger, 7, &[])));
        assert!(g.admits(&p(stranger, 9, &[3, 7])));
        assert!(!g.admits(&p(stranger, 9, &[3])));
        assert_eq!(g.mode(), 0o660);
    }

    #[test]
    fn directories_others_can_write_are_refused_unless_sticky() {
        let d = TempDir::new("access-dir");
        let open = d.path("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = check_dir(&open).unwrap_err().to_string();
        assert!(e.contains("mode 0777") && e.contains("not sticky"), "{e}");
        let e = Access::OWNER
            .bind(&open.join("s"), "test socket")
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Denied);
        assert!(!open.join("s").exists());
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        check_dir(&open).unwrap();
        // A directory below an open one is refused for its parent.
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let below = open.join("below");
        make_private_dir(&below, Access::OWNER).unwrap();
        assert_eq!(std::fs::metadata(&below).unwrap().mode() & 0o7777, 0o700);
        let e = check_dir(&below).unwrap_err().to_string();
        assert!(e.contains(&format!("'{}'", open.display())), "{e}");
        // SAFETY: getegid has no preconditions.
        let g = unsafe { libc::getegid() };
        let grouped = d.path("grouped");
        make_private_dir(&grouped, Access { group: Some(g) }).unwrap();
        let m = std::fs::metadata(&grouped).unwrap();
        assert_eq!((m.mode() & 0o7777, m.gid()), (0o750, g));
        check_dir(&grouped).unwrap();
    }

    #[test]
    fn groups_are_named_or_numbered() {
        assert_eq!(parse_group("0").unwrap(), 0);
        assert_eq!(parse_group("root").unwrap(), 0);
        let e = parse_group("no-such-group-udm").unwrap_err();
        assert_eq!(
            e.to_string(),
            "--socket-group 'no-such-group-udm': no such group"
        );
    }
}
