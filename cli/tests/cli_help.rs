//! The command line itself: help for every verb, completions, `targets`
//! and `version`, and one-line errors for bad arguments.

#![allow(clippy::unwrap_used)]

mod common;

use common::udm;

const VERBS: [&str; 24] = [
    "bench",
    "serve",
    "daemon",
    "create",
    "remove",
    "load",
    "suspend",
    "resume",
    "reload",
    "clear",
    "ls",
    "info",
    "deps",
    "wait",
    "table",
    "status",
    "message",
    "export",
    "dump-config",
    "targets",
    "version",
    "log-replay",
    "stats",
    "completions",
];

#[test]
fn every_verb_has_help() {
    let (code, out, _) = udm(&["--help"]);
    assert_eq!(code, 0);
    for v in VERBS {
        assert!(out.contains(&format!("  {v} ")), "{v} missing from:\n{out}");
        let (code, out, err) = udm(&[v, "--help"]);
        assert_eq!(code, 0, "{v}: {err}");
        assert!(out.contains(&format!("Usage: udm {v}")), "{v}: {out}");
    }
    let (_, out, _) = udm(&["bench", "--help"]);
    assert!(out.contains("--iodepth <N>"), "{out}");
}

#[test]
fn completions_are_printed_for_each_shell() {
    for sh in ["bash", "zsh", "fish"] {
        let (code, out, err) = udm(&["completions", sh]);
        assert_eq!(code, 0, "{sh}: {err}");
        assert!(out.contains("reload"), "{sh}: {out}");
    }
    let (code, _, err) = udm(&["completions", "tcsh"]);
    assert_eq!(code, 2);
    assert_eq!(err.lines().count(), 1, "{err}");
}

#[test]
fn targets_and_version_print_text_or_json() {
    let (code, out, _) = udm(&["targets"]);
    assert_eq!(code, 0);
    for t in [
        "linear",
        "striped",
        "zero",
        "error",
        "writecache",
        "flakey",
        "delay",
        "dust",
        "log-writes",
        "crypt",
        "thin-pool",
        "thin",
        "raid",
    ] {
        assert!(out.lines().any(|l| l.starts_with(t)), "{t}: {out}");
    }
    let (_, out, _) = udm(&["targets", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let types = v["targets"].as_array().unwrap();
    let names: Vec<&str> = types.iter().filter_map(|t| t["name"].as_str()).collect();
    assert_eq!(
        names,
        [
            "crypt",
            "delay",
            "dust",
            "error",
            "flakey",
            "linear",
            "log-writes",
            "raid",
            "striped",
            "thin",
            "thin-pool",
            "writecache",
            "zero"
        ]
    );
    let linear = &types[5];
    assert_eq!(linear["version"].as_array().unwrap().len(), 3);
    assert_eq!(linear["usage"], "<dev> <offset>");
    assert_eq!(
        (linear["min_args"].as_u64(), linear["max_args"].as_u64()),
        (Some(2), Some(2))
    );
    assert_eq!(types[11]["exclusive_args"], serde_json::json!([2]));
    assert_eq!(types[10]["exclusive_args"], serde_json::json!([0, 1]));
    assert_eq!(types[6]["exclusive_args"], serde_json::json!([1]));
    let (_, out, _) = udm(&["version", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["protocol"], 1);
    assert_eq!(v["udm"], env!("CARGO_PKG_VERSION"));
}

#[test]
fn argument_errors_are_one_line_with_exit_code_2() {
    for (args, want) in [
        (
            &["status", "--frob"][..],
            "unknown option '--frob' (see 'udm status --help')",
        ),
        (
            &["message"][..],
            "required arguments were not provided: <DEVICE>",
        ),
        (
            &["bench", "--iodepth", "x"][..],
            "invalid value 'x' for '--iodepth <N>'",
        ),
        (&["reload"][..], "<NAME>"),
        (
            &["remove", "--force", "--deferred", "x"][..],
            "cannot be used with",
        ),
        (&["export", "add", "lin"][..], "--nbd <ADDR>"),
        (&["wait", "lin", "x"][..], "invalid value 'x'"),
    ] {
        let (code, _, err) = udm(args);
        assert_eq!(code, 2, "{args:?}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(
            err.starts_with("udm: ") && err.contains(want),
            "{args:?}: {err}"
        );
    }
}
