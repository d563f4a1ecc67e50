//! The test guest (`scripts/guest.sh`): scenarios run in one boot, each
//! check reported as a `RESULT name=ok|FAIL` line.

use std::path::Path;
use std::process::Command;

/// Runs `scripts/guest.sh SCENARIO...` with this build's udm and returns
/// its output; panics with that output unless it exited 0 and every
/// check in `checks` printed `RESULT check=ok`.
pub fn run_scenarios<S: AsRef<str>>(scenarios: &[&str], checks: &[S]) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(root.join("scripts/guest.sh"))
        .args(scenarios)
        .env("UDM", env!("CARGO_BIN_EXE_udm"))
        .output()
        .expect("scripts/guest.sh");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "the guest's scenarios {scenarios:?} failed:\n{text}"
    );
    for check in checks {
        let check = check.as_ref();
        assert!(
            text.contains(&format!("RESULT {check}=ok")),
            "{check}:\n{text}"
        );
    }
    text
}
