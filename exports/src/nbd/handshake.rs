//! Option negotiation (fixed newstyle) as a state machine over bytes.
//!
//! The connection feeds whatever bytes it has received to
//! [`Handshake::feed`], which consumes complete messages, appends the replies
//! to an output buffer and says how to go on ([`Outcome`]). No I/O happens
//! here, so the same code runs on a reactor and under the fuzzer.
//!
//! Options served: EXPORT_NAME, INFO, GO, LIST, ABORT, STRUCTURED_REPLY,
//! LIST_META_CONTEXT and SET_META_CONTEXT (`base:allocation`). Anything else
//! (STARTTLS included: udm runs NOTLS) gets `NBD_REP_ERR_UNSUP`. Option data
//! above [`MAX_OPTION_DATA`] is skipped without being stored and answered
//! with `NBD_REP_ERR_TOO_BIG`.

use super::proto::{self, ExportInfo, ProtoError};

/// Largest option data the server buffers; longer options are skipped.
pub const MAX_OPTION_DATA: usize = 16 * 1024;
/// Options one connection may send before the server deems it abusive.
pub const MAX_OPTIONS: u32 = 1024;

/// What the transmission phase needs from the handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Negotiated {
    /// Index of the export in the table given to [`Handshake::feed`].
    pub export: usize,
    /// Structured replies were negotiated.
    pub structured: bool,
    /// `base:allocation` was selected for this export.
    pub block_status: bool,
    /// The client asked for NBD_INFO_BLOCK_SIZE in its NBD_OPT_GO, and so
    /// promised to respect the block sizes. A client that did not may send
    /// requests at any byte offset and length.
    pub block_sizes: bool,
}

/// How the connection goes on after a call to [`Handshake::feed`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Send the output, and feed more bytes when they come.
    Continue,
    /// Send the output, then enter transmission; bytes after the consumed
    /// ones belong to the transmission phase.
    Transmission(Negotiated),
    /// Send the output, then close the connection, for this reason.
    Close(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    ClientFlags,
    OptionHeader,
    OptionData { option: u32, len: usize },
    Skip { option: u32, left: usize },
    Done,
}

/// One connection's negotiation.
#[derive(Debug)]
pub struct Handshake {
    state: State,
    no_zeroes: bool,
    structured: bool,
    /// The export `base:allocation` was last selected for.
    meta: Option<String>,
    options: u32,
    shutting_down: bool,
}

impl Default for Handshake {
    fn default() -> Self {
        Handshake::new()
    }
}

impl Handshake {
    /// A negotiation waiting for the client's flags (the greeting is sent
    /// with [`proto::put_greeting`]).
    pub fn new() -> Handshake {
        Handshake {
            state: State::ClientFlags,
            no_zeroes: false,
            structured: false,
            meta: None,
            options: 0,
            shutting_down: false,
        }
    }

    /// From now on, refuse options other than ABORT with `ERR_SHUTDOWN`.
    pub fn shutdown(&mut self) {
        self.shutting_down = true;
    }

    /// Consumes complete messages from `input`, appending replies to `out`.
    /// Returns how many bytes were consumed and how to go on. With
    /// `Continue`, a return of fewer bytes than given means the rest is an
    /// incomplete message: call again with it and more.
    pub fn feed(
        &mut self,
        input: &[u8],
        exports: &[ExportInfo],
        out: &mut Vec<u8>,
    ) -> (usize, Outcome) {
        self.feed_admitting(input, exports, &mut |_| true, out)
    }

    /// As [`Handshake::feed`], asking `admit` before entering transmission
    /// on export `i`: when it says no (the export is at its connection
    /// cap), NBD_OPT_GO gets `NBD_REP_ERR_POLICY` and negotiation goes on,
    /// NBD_OPT_EXPORT_NAME (which has no error reply) closes.
    pub fn feed_admitting(
        &mut self,
        input: &[u8],
        exports: &[ExportInfo],
        admit: &mut dyn FnMut(usize) -> bool,
        out: &mut Vec<u8>,
    ) -> (usize, Outcome) {
        let mut used = 0;
        loop {
            let rest = &input[used..];
            match self.state {
                State::Done => return (used, Outcome::Close("handshake already over".into())),
                State::ClientFlags => {
                    if rest.len() < proto::CLIENT_FLAGS_LEN {
                        return (used, Outcome::Continue);
                    }
                    used += proto::CLIENT_FLAGS_LEN;
                    let flags = match proto::parse_client_flags(rest) {
                        Ok(f) => f,
                        Err(e) => return (used, self.close(format!("client flags: {e}"))),
                    };
                    let known = proto::FLAG_C_FIXED_NEWSTYLE | proto::FLAG_C_NO_ZEROES;
                    if flags & !known != 0 {
                        // The spec: the server MUST close on unknown client flags.
                        return (used, self.close(format!("unknown client flags {flags:#x}")));
                    }
                    self.no_zeroes = flags & proto::FLAG_C_NO_ZEROES != 0;
                    self.state = State::OptionHeader;
                }
                State::OptionHeader => {
                    if rest.len() < proto::OPTION_HEADER_LEN {
                        return (used, Outcome::Continue);
                    }
                    let h = match proto::parse_option_header(rest) {
                        Ok(h) => h,
                        Err(e) => return (used, self.close(format!("option header: {e}"))),
                    };
                    used += proto::OPTION_HEADER_LEN;
                    self.options += 1;
                    if self.options > MAX_OPTIONS {
                        return (used, self.close(format!("more than {MAX_OPTIONS} options")));
                    }
                    let len = h.len as usize;
                    self.state = if len > MAX_OPTION_DATA {
                        State::Skip {
                            option: h.option,
                            left: len,
                        }
                    } else {
                        State::OptionData {
                            option: h.option,
                            len,
                        }
                    };
                }
                State::Skip { option, left } => {
                    let n = left.min(rest.len());
                    used += n;
                    if n < left {
                        self.state = State::Skip {
                            option,
                            left: left - n,
                        };
                        return (used, Outcome::Continue);
                    }
                    self.state = State::OptionHeader;
                    if option == proto::OPT_EXPORT_NAME {
                        // EXPORT_NAME cannot be answered with an error.
                        return (used, self.close("EXPORT_NAME too long".into()));
                    }
                    proto::put_option_error(
                        out,
                        option,
                        proto::REP_ERR_TOO_BIG,
                        "option data too large",
                    );
                }
                State::OptionData { option, len } => {
                    if rest.len() < len {
                        return (used, Outcome::Continue);
                    }
                    used += len;
                    self.state = State::OptionHeader;
                    let outcome = self.option(option, &rest[..len], exports, admit, out);
                    if outcome != Outcome::Continue {
                        self.state = State::Done;
                        return (used, outcome);
                    }
                }
            }
        }
    }

    fn close(&mut self, why: String) -> Outcome {
        self.state = State::Done;
        Outcome::Close(why)
    }

    /// Answers one complete option.
    fn option(
        &mut self,
        option: u32,
        data: &[u8],
        exports: &[ExportInfo],
        admit: &mut dyn FnMut(usize) -> bool,
        out: &mut Vec<u8>,
    ) -> Outcome {
        let find = |name: &str| -> Option<usize> {
            if name.is_empty() && !exports.is_empty() {
                Some(0)
            } else {
                exports.iter().position(|e| e.name == name)
            }
        };
        let invalid = |out: &mut Vec<u8>, e: ProtoError| {
            proto::put_option_error(out, option, proto::REP_ERR_INVALID, &e.to_string());
            Outcome::Continue
        };
        let unknown = |out: &mut Vec<u8>, name: &str| {
            let msg = format!("no export '{name}'");
            proto::put_option_error(out, option, proto::REP_ERR_UNKNOWN, &msg);
            Outcome::Continue
        };
        if self.shutting_down && option != proto::OPT_ABORT {
            if option == proto::OPT_EXPORT_NAME {
                return Outcome::Close("server shutting down".into());
            }
            proto::put_option_error(out, option, proto::REP_ERR_SHUTDOWN, "server shutting down");
            return Outcome::Continue;
        }
        match option {
            proto::OPT_EXPORT_NAME => {
                let name = match proto::parse_export_name(data) {
                    Ok(n) => n,
                    Err(e) => return Outcome::Close(format!("EXPORT_NAME: {e}")),
                };
                let Some(i) = find(name) else {
                    return Outcome::Close(format!("EXPORT_NAME: no export '{name}'"));
                };
                if !admit(i) {
                    return Outcome::Close(format!(
                        "EXPORT_NAME: export '{}' is at its connection cap",
                        exports[i].name
                    ));
                }
                proto::put_export_name_reply(out, &exports[i], self.no_zeroes);
                Outcome::Transmission(self.negotiated(i, &exports[i], false))
            }
            proto::OPT_ABORT => {
                proto::put_option_reply(out, option, proto::REP_ACK, &[]);
                Outcome::Close("client aborted the handshake".into())
            }
            proto::OPT_LIST => {
                if !data.is_empty() {
                    return invalid(out, ProtoError::BadLength);
                }
                for e in exports {
                    proto::put_rep_server(out, option, &e.name);
                }
                proto::put_option_reply(out, option, proto::REP_ACK, &[]);
                Outcome::Continue
            }
            proto::OPT_INFO | proto::OPT_GO => {
                let r = match proto::parse_info_request(data) {
                    Ok(r) => r,
                    Err(e) => return invalid(out, e),
                };
                let Some(i) = find(r.name) else {
                    return unknown(out, r.name);
                };
                if option == proto::OPT_GO && !admit(i) {
                    proto::put_option_error(
                        out,
                        option,
                        proto::REP_ERR_POLICY,
                        "export at its connection cap; try later",
                    );
                    return Outcome::Continue;
                }
                proto::put_info(out, option, &exports[i], &r.infos);
                proto::put_option_reply(out, option, proto::REP_ACK, &[]);
                if option == proto::OPT_GO {
                    let sizes = r.infos.contains(&proto::INFO_BLOCK_SIZE);
                    Outcome::Transmission(self.negotiated(i, &exports[i], sizes))
                } else {
                    Outcome::Continue
                }
            }
            proto::OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    return invalid(out, ProtoError::BadLength);
                }
                self.structured = true;
                proto::put_option_reply(out, option, proto::REP_ACK, &[]);
                Outcome::Continue
            }
            proto::OPT_LIST_META_CONTEXT | proto::OPT_SET_META_CONTEXT => {
                let set = option == proto::OPT_SET_META_CONTEXT;
                if set {
                    // Replaces the selection, even when it fails.
                    self.meta = None;
                }
                if !self.structured {
                    proto::put_option_error(
                        out,
                        option,
                        proto::REP_ERR_INVALID,
                        "negotiate structured replies first",
                    );
                    return Outcome::Continue;
                }
                let r = match proto::parse_meta_request(data) {
                    Ok(r) => r,
                    Err(e) => return invalid(out, e),
                };
                if find(r.name).is_none() {
                    return unknown(out, r.name);
                }
                // LIST with no query lists everything; `base:` is the
                // namespace wildcard for LIST only; other namespaces and
                // unknown leaves are ignored, as the spec requires.
                let matches = if set {
                    r.queries.contains(&proto::META_BASE_ALLOCATION)
                } else {
                    r.queries.is_empty()
                        || r.queries
                            .iter()
                            .any(|q| *q == "base:" || *q == proto::META_BASE_ALLOCATION)
                };
                if matches {
                    let id = if set {
                        proto::META_BASE_ALLOCATION_ID
                    } else {
                        0
                    };
                    proto::put_meta_context(out, option, id, proto::META_BASE_ALLOCATION);
                    if set {
                        self.meta = Some(r.name.to_string());
                    }
                }
                proto::put_option_reply(out, option, proto::REP_ACK, &[]);
                Outcome::Continue
            }
            _ => {
                proto::put_option_error(out, option, proto::REP_ERR_UNSUP, "unsupported option");
                Outcome::Continue
            }
        }
    }

    fn negotiated(&self, i: usize, e: &ExportInfo, block_sizes: bool) -> Negotiated {
        // BLOCK_STATUS is allowed when the last SET_META_CONTEXT named this
        // export (by its name, or "" for the default one).
        let block_status = self.structured
            && self
                .meta
                .as_deref()
                .is_some_and(|m| m == e.name || (m.is_empty() && i == 0));
        Negotiated {
            export: i,
            structured: self.structured,
            block_status,
            block_sizes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nbd::proto::*;

    fn exports() -> Vec<ExportInfo> {
        vec![ExportInfo {
            name: "lin".into(),
            description: String::new(),
            size: 1 << 20,
            flags: FLAG_HAS_FLAGS,
            min_block: 512,
            pref_block: 4096,
            max_payload: 1 << 25,
        }]
    }

    fn opt(option: u32, data: &[u8]) -> Vec<u8> {
        let mut v = IHAVEOPT.to_be_bytes().to_vec();
        v.extend_from_slice(&option.to_be_bytes());
        v.extend_from_slice(&(data.len() as u32).to_be_bytes());
        v.extend_from_slice(data);
        v
    }

    #[test]
    fn go_after_structured_reply_and_meta_context_enables_block_status() {
        let mut h = Handshake::new();
        let mut input = 1u32.to_be_bytes().to_vec();
        input.extend(opt(OPT_STRUCTURED_REPLY, &[]));
        let mut meta = 3u32.to_be_bytes().to_vec();
        meta.extend_from_slice(b"lin");
        meta.extend_from_slice(&1u32.to_be_bytes());
        meta.extend_from_slice(&15u32.to_be_bytes());
        meta.extend_from_slice(b"base:allocation");
        input.extend(opt(OPT_SET_META_CONTEXT, &meta));
        let mut go = 0u32.to_be_bytes().to_vec();
        go.extend_from_slice(&0u16.to_be_bytes());
        input.extend(opt(OPT_GO, &go));
        input.extend_from_slice(b"tail");
        let mut out = Vec::new();
        let (n, o) = h.feed(&input, &exports(), &mut out);
        assert_eq!(n, input.len() - 4, "transmission bytes are left unconsumed");
        assert_eq!(
            o,
            Outcome::Transmission(Negotiated {
                export: 0,
                structured: true,
                block_status: true,
                block_sizes: false,
            })
        );
    }

    #[test]
    fn go_that_asks_for_block_sizes_promises_to_respect_them() {
        let mut h = Handshake::new();
        let mut input = 1u32.to_be_bytes().to_vec();
        let mut go = 0u32.to_be_bytes().to_vec();
        go.extend_from_slice(&1u16.to_be_bytes());
        go.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        input.extend(opt(OPT_GO, &go));
        let mut out = Vec::new();
        let (_, o) = h.feed(&input, &exports(), &mut out);
        assert!(
            matches!(o, Outcome::Transmission(n) if n.block_sizes),
            "{o:?}"
        );
    }

    #[test]
    fn bytes_may_arrive_one_at_a_time() {
        let mut h = Handshake::new();
        let mut input = 0u32.to_be_bytes().to_vec();
        input.extend(opt(OPT_LIST, &[]));
        input.extend(opt(OPT_EXPORT_NAME, b"lin"));
        let mut out = Vec::new();
        let mut pending = Vec::new();
        let mut outcome = Outcome::Continue;
        for b in input {
            pending.push(b);
            let (n, o) = h.feed(&pending, &exports(), &mut out);
            pending.drain(..n);
            outcome = o;
        }
        assert!(matches!(outcome, Outcome::Transmission(_)));
        assert!(
            out.ends_with(&[0u8; 124]),
            "EXPORT_NAME without NO_ZEROES pads"
        );
    }

    #[test]
    fn oversized_options_are_skipped_and_refused_with_too_big() {
        let mut h = Handshake::new();
        let mut input = 1u32.to_be_bytes().to_vec();
        input.extend(opt(OPT_INFO, &vec![0u8; MAX_OPTION_DATA + 1]));
        let mut out = Vec::new();
        let (n, o) = h.feed(&input, &exports(), &mut out);
        assert_eq!((n, o), (input.len(), Outcome::Continue));
        assert_eq!(&out[12..16], &REP_ERR_TOO_BIG.to_be_bytes());
    }
}
