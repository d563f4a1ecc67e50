//! The control protocol: newline-delimited JSON, one request per line, one
//! reply line per request, in order.
//!
//! ```text
//! request: {"v":1,"id":7,"op":"status","args":{"names":["wc"]}}
//! reply:   {"v":1,"id":7,"ok":{"devices":[{"name":"wc","lines":["0 32768 writecache 0 …"]}]}}
//!          {"v":1,"id":7,"error":{"code":"not_found","message":"unknown device 'wc'"}}
//! ```
//!
//! `id` is the client's, echoed (`null` when the request had none or could
//! not be read). `args` may be left out when an op takes none.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use udm_core::{Error, ErrorKind};

use crate::registry::RemoveMode;

/// The protocol version requests carry in `v`.
pub const VERSION: u32 = 1;
/// Longest request line, in bytes (without its newline).
pub const MAX_LINE: usize = 64 << 10;

fn yes() -> bool {
    true
}

/// An operation and its arguments.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    tag = "op",
    content = "args",
    rename_all = "snake_case",
    deny_unknown_fields
)]
pub enum Op {
    /// udm's and the protocol's versions.
    Version {},
    /// Every device.
    Ls {},
    /// The target types.
    Targets {},
    /// One device.
    Info {
        /// The device.
        name: String,
    },
    /// Status lines of the mapped devices named (all when empty).
    Status {
        /// The devices.
        #[serde(default)]
        names: Vec<String>,
    },
    /// Tables of the devices named (all when empty).
    Table {
        /// The devices.
        #[serde(default)]
        names: Vec<String>,
        /// Show the keys in crypt table lines (hidden as `-` otherwise).
        #[serde(default)]
        show_keys: bool,
    },
    /// The devices a mapped device's tables use.
    Deps {
        /// The device.
        name: String,
    },
    /// A message to a target.
    Message {
        /// The device.
        name: String,
        /// A sector the target covers.
        #[serde(default)]
        sector: u64,
        /// The message's words.
        argv: Vec<String>,
    },
    /// Creates a device from a backend spec or table text.
    Create {
        /// The new device's name.
        name: String,
        /// `ram:…`, `null:…`, `file:…`, `luks:…` or a table.
        spec: String,
        /// The passphrase of a `luks:` spec without `key-file` (base64 on
        /// the wire; zeroed after use, never printed).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        passphrase: Option<crate::luks::Passphrase>,
    },
    /// Removes a device.
    Remove {
        /// The device.
        name: String,
        /// How.
        #[serde(default)]
        mode: RemoveMode,
    },
    /// Removes every device, top of the stack first.
    RemoveAll {
        /// How.
        #[serde(default)]
        mode: RemoveMode,
    },
    /// Starts serving a device.
    ExportAdd(crate::ExportSpec),
    /// Stops an export.
    ExportRemove {
        /// The export.
        name: String,
        /// Even with clients connected (they are disconnected in order).
        #[serde(default)]
        force: bool,
    },
    /// The exports.
    ExportLs {},
    /// The running state as a configuration (see [`crate::Config`]).
    DumpConfig {
        /// Write crypt keys into the tables (hidden as `-` otherwise, and
        /// such a table does not load again).
        #[serde(default)]
        show_keys: bool,
    },
    /// Waits until a device's event counter passes `event_nr`.
    Wait {
        /// The device.
        name: String,
        /// The counter to pass (default 0: any event).
        #[serde(default)]
        event_nr: u64,
        /// Give up after this many milliseconds (default: wait on).
        #[serde(default)]
        timeout_ms: Option<u64>,
    },
    /// Stages an inactive table.
    Load {
        /// The device.
        name: String,
        /// Table text (lines separated by newlines or `;`).
        table: String,
    },
    /// Holds I/O.
    Suspend {
        /// The device.
        name: String,
        /// Flush the devices below once drained (default true).
        #[serde(default = "yes")]
        flush: bool,
    },
    /// Swaps in the inactive table, if any, and releases I/O.
    Resume {
        /// The device.
        name: String,
    },
    /// Drops the inactive table.
    Clear {
        /// The device.
        name: String,
    },
    /// Load + suspend + resume.
    Reload {
        /// The device.
        name: String,
        /// Table text.
        table: String,
    },
    /// A mapped device's I/O statistics.
    Stats {
        /// The device.
        name: String,
        /// With the latency histograms.
        #[serde(default)]
        histogram: bool,
        /// Start the counts again from zero after this report.
        #[serde(default)]
        clear: bool,
    },
}

/// The ops' names, as requests spell them.
pub const OPS: &[&str] = &[
    "version",
    "ls",
    "targets",
    "info",
    "status",
    "table",
    "deps",
    "message",
    "create",
    "remove",
    "remove_all",
    "wait",
    "export_add",
    "export_remove",
    "export_ls",
    "dump_config",
    "load",
    "suspend",
    "resume",
    "clear",
    "reload",
    "stats",
];

/// A request: an op with the protocol version and the client's id.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// Protocol version: [`VERSION`].
    pub v: u32,
    /// The client's id for the request, echoed in the reply.
    pub id: Option<u64>,
    /// What to do.
    #[serde(flatten)]
    pub op: Op,
}

/// An error as the protocol carries it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The kind: see [`code`].
    pub code: String,
    /// One line for a person.
    pub message: String,
}

/// A reply: `ok` with the op's result, or `error`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Reply {
    /// Protocol version.
    pub v: u32,
    /// The request's id.
    pub id: Option<u64>,
    /// The result, on success.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ok: Option<Value>,
    /// The error, on failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
}

/// The protocol's code for an error kind.
pub fn code(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::Invalid => "invalid",
        ErrorKind::NotFound => "not_found",
        ErrorKind::Unsupported => "unsupported",
        ErrorKind::Busy => "busy",
        ErrorKind::Os => "os",
        ErrorKind::Io => "io",
        ErrorKind::TimedOut => "timed_out",
        ErrorKind::Denied => "denied",
    }
}

/// The error kind of a protocol code (unknown codes read as `Io`).
pub fn kind(code: &str) -> ErrorKind {
    match code {
        "invalid" => ErrorKind::Invalid,
        "not_found" => ErrorKind::NotFound,
        "unsupported" => ErrorKind::Unsupported,
        "busy" => ErrorKind::Busy,
        "os" => ErrorKind::Os,
        "timed_out" => ErrorKind::TimedOut,
        "denied" => ErrorKind::Denied,
        _ => ErrorKind::Io,
    }
}

impl Reply {
    /// A reply to request `id` from an op's outcome.
    pub fn from_result(id: Option<u64>, r: Result<Value, Error>) -> Reply {
        match r {
            Ok(v) => Reply {
                v: VERSION,
                id,
                ok: Some(v),
                error: None,
            },
            Err(e) => Reply {
                v: VERSION,
                id,
                ok: None,
                error: Some(ErrorBody {
                    code: code(e.kind()).to_string(),
                    message: e.to_string().replace(['\n', '\r'], " "),
                }),
            },
        }
    }

    /// The reply as one line, with its newline.
    pub fn to_line(&self) -> String {
        // A Value always encodes; the fallback is for form's sake.
        let mut s = serde_json::to_string(self).unwrap_or_else(|e| {
            serde_json::json!({
                "v": VERSION,
                "id": self.id,
                "error": {"code": "io", "message": format!("encoding the reply: {e}")},
            })
            .to_string()
        });
        s.push('\n');
        s
    }

    /// The result, or the error as an [`Error`].
    pub fn into_result(self) -> Result<Value, Error> {
        match (self.ok, self.error) {
            (_, Some(e)) => Err(Error::new(kind(&e.code), e.message)),
            (Some(v), None) => Ok(v),
            (None, None) => Err(Error::new(
                ErrorKind::Io,
                "a reply with neither ok nor error",
            )),
        }
    }
}

impl Request {
    /// Request `id` for `op`.
    pub fn new(id: u64, op: Op) -> Request {
        Request {
            v: VERSION,
            id: Some(id),
            op,
        }
    }

    /// The request as one line, with its newline.
    pub fn to_line(&self) -> Result<String, Error> {
        let mut s = serde_json::to_string(self)
            .map_err(|e| Error::invalid(format!("encoding the request: {e}")))?;
        s.push('\n');
        Ok(s)
    }
}

/// Reads one request line (without its newline). On failure, also gives
/// the request's id when it could be read, so the error reply carries it.
pub fn decode(line: &[u8]) -> Result<Request, (Option<u64>, Error)> {
    let bad = |id, m: String| Err((id, Error::invalid(m)));
    let text = match std::str::from_utf8(line) {
        Ok(t) => t.trim(),
        Err(_) => return bad(None, "request is not UTF-8".into()),
    };
    if text.is_empty() {
        return bad(None, "empty request".into());
    }
    let mut obj = match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(o)) => o,
        Ok(_) => return bad(None, "request is not a JSON object".into()),
        Err(e) => return bad(None, format!("request is not JSON: {e}")),
    };
    let id = match obj.get("id") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(n) => Some(n),
            None => return bad(None, "\"id\": expected a non-negative integer".into()),
        },
    };
    match obj.get("v").map(Value::as_u64) {
        Some(Some(v)) if v == VERSION as u64 => {}
        Some(Some(v)) => {
            return Err((
                id,
                Error::new(
                    ErrorKind::Unsupported,
                    format!("protocol version {v} is not supported (this server speaks {VERSION})"),
                ),
            ))
        }
        _ => return bad(id, "\"v\": expected the protocol version, 1".into()),
    }
    let op = match obj.get("op") {
        Some(Value::String(s)) => s.clone(),
        _ => return bad(id, "\"op\": expected an operation name".into()),
    };
    if !OPS.contains(&op.as_str()) {
        let shown: String = op.chars().take(40).collect();
        return bad(
            id,
            format!("unknown op '{shown}' (known: {})", OPS.join(", ")),
        );
    }
    for k in obj.keys() {
        if !matches!(k.as_str(), "v" | "id" | "op" | "args") {
            let shown: String = k.chars().take(40).collect();
            return bad(id, format!("unknown field '{shown}' in the request"));
        }
    }
    let args = obj
        .remove("args")
        .unwrap_or(Value::Object(Default::default()));
    let tagged = serde_json::json!({ "op": op, "args": args });
    match serde_json::from_value::<Op>(tagged) {
        Ok(op) => Ok(Request { v: VERSION, id, op }),
        Err(e) => bad(id, format!("{op}: invalid arguments: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_args_may_be_left_out() {
        let r = Request::new(
            3,
            Op::Message {
                name: "wc".into(),
                sector: 0,
                argv: vec!["flush".into()],
            },
        );
        let line = r.to_line().unwrap();
        assert_eq!(
            line,
            "{\"v\":1,\"id\":3,\"op\":\"message\",\"args\":{\"name\":\"wc\",\"sector\":0,\"argv\":[\"flush\"]}}\n"
        );
        assert_eq!(decode(line.trim_end().as_bytes()).unwrap(), r);
        let v = decode(br#"{"v":1,"id":1,"op":"version"}"#).unwrap();
        assert_eq!(v.op, Op::Version {});
        let s = decode(br#"{"v":1,"op":"status"}"#).unwrap();
        assert_eq!(s.op, Op::Status { names: vec![] });
        assert_eq!(s.id, None);
        let s = decode(br#"{"v":1,"id":2,"op":"suspend","args":{"name":"l"}}"#).unwrap();
        assert_eq!(
            s.op,
            Op::Suspend {
                name: "l".into(),
                flush: true
            }
        );
    }

    #[test]
    fn a_create_request_carries_a_passphrase_that_debug_output_hides() {
        let line = br#"{"v":1,"id":5,"op":"create","args":{"name":"v","spec":"luks:/d","passphrase":"c2VjcmV0"}}"#;
        let r = decode(line).unwrap();
        let Op::Create { passphrase, .. } = &r.op else {
            panic!("{:?}", r.op)
        };
        assert_eq!(passphrase.as_ref().unwrap().as_bytes(), b"secret");
        assert!(!format!("{r:?}").contains("secret"));
        assert_eq!(r.to_line().unwrap().trim_end().as_bytes(), &line[..]);
        let plain = decode(br#"{"v":1,"op":"create","args":{"name":"r","spec":"ram:1M"}}"#);
        assert!(matches!(
            plain.unwrap().op,
            Op::Create {
                passphrase: None,
                ..
            }
        ));
    }

    #[test]
    fn bad_requests_are_errors_that_keep_the_id_when_there_is_one() {
        let err = |b: &[u8]| {
            let (id, e) = decode(b).err().unwrap();
            (id, e.kind(), e.to_string())
        };
        let (id, k, m) = err(br#"{"v":1,"id":9,"op":"frob"}"#);
        assert_eq!((id, k), (Some(9), ErrorKind::Invalid));
        assert!(m.starts_with("unknown op 'frob' (known: version, "), "{m}");
        let (id, _, m) = err(br#"{"v":1,"id":4,"op":"info"}"#);
        assert_eq!(id, Some(4));
        assert!(
            m.contains("info: invalid arguments: missing field `name`"),
            "{m}"
        );
        let (_, _, m) = err(br#"{"v":1,"id":4,"op":"info","args":{"name":"a","x":1}}"#);
        assert!(m.contains("unknown field `x`"), "{m}");
        let (_, k, _) = err(br#"{"v":2,"id":4,"op":"ls"}"#);
        assert_eq!(k, ErrorKind::Unsupported);
        assert!(err(b"status wc").2.starts_with("request is not JSON"));
        assert!(err(b"[1]").2.contains("not a JSON object"));
        assert!(err(b"\xff\xfe").2.contains("not UTF-8"));
        assert!(err(b"  ").2.contains("empty request"));
        assert!(err(br#"{"v":1,"id":-1,"op":"ls"}"#).2.contains("\"id\""));
        assert!(err(br#"{"id":1,"op":"ls"}"#).2.contains("\"v\""));
        assert!(err(br#"{"v":1,"id":1,"op":"ls","extra":0}"#)
            .2
            .contains("unknown field 'extra'"));
    }

    #[test]
    fn replies_carry_a_result_or_a_coded_error() {
        let ok = Reply::from_result(Some(1), Ok(serde_json::json!({"reply": ""})));
        assert_eq!(ok.to_line(), "{\"v\":1,\"id\":1,\"ok\":{\"reply\":\"\"}}\n");
        let e = Reply::from_result(
            None,
            Err(Error::new(ErrorKind::Busy, "device 'a' is in use\nby x")),
        );
        assert_eq!(
            e.to_line(),
            "{\"v\":1,\"id\":null,\"error\":{\"code\":\"busy\",\"message\":\"device 'a' is in use by x\"}}\n"
        );
        let back: Reply = serde_json::from_str(e.to_line().trim_end()).unwrap();
        let err = back.into_result().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Busy);
        for k in [
            ErrorKind::Invalid,
            ErrorKind::NotFound,
            ErrorKind::Unsupported,
            ErrorKind::Busy,
            ErrorKind::Os,
            ErrorKind::Io,
        ] {
            assert_eq!(kind(code(k)), k);
        }
    }
}
