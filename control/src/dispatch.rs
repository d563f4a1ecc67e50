//! Runs a protocol [`Op`] on a [`Control`]: the server's side of a request,
//! and the in-process form of every verb (so both print the same).

use serde::Serialize;
use serde_json::Value;
use udm_core::Error;

use crate::config::Config;
use crate::proto::Op;
use crate::verbs::Control;

fn value<T: Serialize>(r: Result<T, Error>) -> Result<Value, Error> {
    serde_json::to_value(r?).map_err(|e| Error::invalid(format!("encoding the result: {e}")))
}

/// Runs `op` on `ctl`; the result as the protocol's `ok` value.
pub fn execute(ctl: &Control, op: Op) -> Result<Value, Error> {
    match op {
        Op::Version {} => value(Ok(ctl.version())),
        Op::Ls {} => value(Ok(ctl.ls())),
        Op::Targets {} => value(Ok(ctl.targets())),
        Op::Info { name } => value(ctl.info(&name)),
        Op::Status { names } => value(ctl.status(&names)),
        Op::Table { names, show_keys } => value(ctl.table_shown(&names, show_keys)),
        Op::Deps { name } => value(ctl.deps(&name)),
        Op::Message { name, sector, argv } => {
            if argv.is_empty() {
                return Err(Error::invalid("message: expected at least one word"));
            }
            let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
            value(ctl.message(&name, sector, &argv))
        }
        Op::Create {
            name,
            spec,
            passphrase,
        } => value(ctl.create_with(&name, &spec, passphrase.as_ref())),
        Op::Remove { name, mode } => value(ctl.remove(&name, mode)),
        Op::RemoveAll { mode } => value(ctl.remove_all(mode)),
        Op::ExportAdd(spec) => value(ctl.export_add(spec)),
        Op::ExportRemove { name, force } => value(ctl.export_remove(&name, force)),
        Op::ExportLs {} => value(ctl.export_ls()),
        Op::DumpConfig { show_keys } => value(Config::dump_shown(ctl, show_keys)),
        Op::Wait {
            name,
            event_nr,
            timeout_ms,
        } => value(ctl.wait(
            &name,
            event_nr,
            timeout_ms.map(std::time::Duration::from_millis),
        )),
        Op::Load { name, table } => value(ctl.load(&name, &table)),
        Op::Suspend { name, flush } => value(ctl.suspend(&name, flush)),
        Op::Resume { name } => value(ctl.resume(&name)),
        Op::Clear { name } => value(ctl.clear(&name)),
        Op::Reload { name, table } => value(ctl.reload(&name, &table)),
        Op::Stats {
            name,
            histogram,
            clear,
        } => value(ctl.stats(&name, histogram, clear)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Status;

    #[test]
    fn ops_run_on_the_registry_and_return_typed_results() {
        let c = Control::default();
        execute(
            &c,
            Op::Create {
                name: "r".into(),
                spec: "ram:1M".into(),
                passphrase: None,
            },
        )
        .unwrap();
        execute(
            &c,
            Op::Create {
                name: "l".into(),
                spec: "0 2048 linear r 0".into(),
                passphrase: None,
            },
        )
        .unwrap();
        let v = execute(&c, Op::Status { names: vec![] }).unwrap();
        let s: Status = serde_json::from_value(v).unwrap();
        assert_eq!(s.to_string(), "l: 0 2048 linear");
        let e = execute(
            &c,
            Op::Message {
                name: "l".into(),
                sector: 0,
                argv: vec![],
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("at least one word"));
    }
}
