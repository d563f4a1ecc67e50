//! Where the daemon's control socket lives.

use std::path::PathBuf;

/// The variable that names the control socket for every command.
pub const CONTROL_ENV: &str = "UDM_CONTROL";

/// The daemon's control socket when not told otherwise: `/run/udm/control`
/// as root, else `$XDG_RUNTIME_DIR/udm/control`, else
/// `<tmp>/udm-<uid>/control`.
pub fn default_socket() -> PathBuf {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    if uid == 0 {
        return PathBuf::from("/run/udm/control");
    }
    match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        Some(d) => PathBuf::from(d).join("udm/control"),
        None => std::env::temp_dir().join(format!("udm-{uid}/control")),
    }
}

/// The control socket a command talks to: `flag` (`--control PATH`), else
/// `$UDM_CONTROL`, else [`default_socket`].
pub fn control_socket(flag: Option<PathBuf>) -> PathBuf {
    flag.or_else(|| {
        std::env::var_os(CONTROL_ENV)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    })
    .unwrap_or_else(default_socket)
}
