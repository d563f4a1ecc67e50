//! Option negotiation (fixed newstyle) as a state machine over bytes.
//!
//! The connection feeds whatever bytes it has received to
//! [`Handshake::feed`], which consumes complete messages, appends the replies
//! to an output buffer and says how to go on ([`Outcome`]). No I/O happens
//! here, so the same code runs on a reactor and under the fuzzer.
//!
//! Options served: EXPORT_NAME, INFO, GO, LIST, ABORT, STRUCTURED_REPLY,
//! LIST_META_CONTEXT, SET_META_CONTEXT (`base:allocation`) and, when the
//! server has TLS ([`TlsMode`]), STARTTLS. Anything else (STARTTLS too on a
//! server without TLS: the spec's NOTLS mode) gets `NBD_REP_ERR_UNSUP`.
//! Option data above [`MAX_OPTION_DATA`] is skipped without being stored
//! and answered with `NBD_REP_ERR_TOO_BIG`.
//!
//! With [`TlsMode::Require`] (the spec's FORCEDTLS), until STARTTLS every
//! option but STARTTLS and ABORT gets `NBD_REP_ERR_TLS_REQD` and
//! EXPORT_NAME closes: a client learns no export name or size before TLS.
//! With [`TlsMode::On`] TLS is the client's choice. STARTTLS forgets what
//! was negotiated before it (structured replies, the meta context), which
//! a man in the middle could have chosen.

use super::proto::{self, ExportInfo, ProtoError};

/// Largest option data the server buffers; longer options are skipped.
pub const MAX_OPTION_DATA: usize = 16 * 1024;
/// Options one connection may send before the server deems it abusive.
pub const MAX_OPTIONS: u32 = 1024;

/// Whether the server offers TLS, and whether it insists on it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TlsMode {
    /// No TLS: STARTTLS is refused with `NBD_REP_ERR_UNSUP` (NOTLS).
    #[default]
    Off,
    /// TLS at the client's choice (SELECTIVETLS with no TLS-only export).
    On,
    /// Nothing but STARTTLS and ABORT before TLS (FORCEDTLS).
    Require,
}

impl std::str::FromStr for TlsMode {
    type Err = String;
    fn from_str(s: &str) -> Result<TlsMode, String> {
        match s {
            "off" => Ok(TlsMode::Off),
            "on" => Ok(TlsMode::On),
            "require" => Ok(TlsMode::Require),
            _ => Err(format!("--tls '{s}': expected off, on or require")),
        }
    }
}

impl std::fmt::Display for TlsMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TlsMode::Off => "off",
            TlsMode::On => "on",
            TlsMode::Require => "require",
        })
    }
}

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

/// What [`Handshake::feed_admitting`] asks the server before granting it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Transmission on export `i` (its connection cap).
    Export(usize),
    /// TLS (room for its buffers in the in-flight budget).
    Tls,
}

/// How the connection goes on after a call to [`Handshake::feed`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Send the output, and feed more bytes when they come.
    Continue,
    /// Send the output, then enter transmission; bytes after the consumed
    /// ones belong to the transmission phase.
    Transmission(Negotiated),
    /// Send the output (STARTTLS's ACK, the last plaintext), then start
    /// TLS: every byte after the consumed ones, both ways, is TLS. Feed
    /// the decrypted bytes from then on.
    StartTls,
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
    tls: TlsMode,
    /// STARTTLS was acknowledged: the rest is over TLS.
    tls_started: bool,
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
        Handshake::with_tls(TlsMode::Off)
    }

    /// A negotiation on a server whose TLS is `tls`.
    pub fn with_tls(tls: TlsMode) -> Handshake {
        Handshake {
            state: State::ClientFlags,
            no_zeroes: false,
            structured: false,
            meta: None,
            options: 0,
            shutting_down: false,
            tls,
            tls_started: false,
        }
    }

    /// Whether STARTTLS was acknowledged.
    pub fn tls_started(&self) -> bool {
        self.tls_started
    }

    /// The server insists on TLS and the client has not started it.
    fn tls_required(&self) -> bool {
        self.tls == TlsMode::Require && !self.tls_started
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
    /// on export `i` and before starting TLS: when it says no (the export
    /// is at its connection cap, no room for TLS buffers), NBD_OPT_GO and
    /// NBD_OPT_STARTTLS get `NBD_REP_ERR_POLICY` and negotiation goes on,
    /// NBD_OPT_EXPORT_NAME (which has no error reply) closes.
    pub fn feed_admitting(
        &mut self,
        input: &[u8],
        exports: &[ExportInfo],
        admit: &mut dyn FnMut(Admit) -> bool,
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
                    if self.tls_required() && option != proto::OPT_ABORT {
                        put_tls_required(out, option);
                        continue;
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
                    if outcome == Outcome::StartTls {
                        // The state machine keeps its place (the next
                        // option header), fed decrypted bytes from now on.
                        return (used, outcome);
                    }
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
        admit: &mut dyn FnMut(Admit) -> bool,
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
        if self.tls_required() && option != proto::OPT_STARTTLS && option != proto::OPT_ABORT {
            if option == proto::OPT_EXPORT_NAME {
                // The spec: it cannot be answered with an error, so the
                // session ends.
                return Outcome::Close("EXPORT_NAME before STARTTLS; TLS is required".into());
            }
            put_tls_required(out, option);
            return Outcome::Continue;
        }
        match option {
            proto::OPT_STARTTLS => {
                if self.tls == TlsMode::Off {
                    proto::put_option_error(
                        out,
                        option,
                        proto::REP_ERR_UNSUP,
                        "this server has no TLS",
                    );
                    return Outcome::Continue;
                }
                if self.tls_started {
                    proto::put_option_error(
                        out,
                        option,
                        proto::REP_ERR_INVALID,
                        "TLS already started",
                    );
                    return Outcome::Continue;
                }
                if !data.is_empty() {
                    return invalid(out, ProtoError::BadLength);
                }
                if !admit(Admit::Tls) {
                    proto::put_option_error(
                        out,
                        option,
                        proto::REP_ERR_POLICY,
                        "server busy: no room for TLS buffers; try later",
                    );
                    return Outcome::Continue;
                }
                proto::put_option_reply(out, option, proto::REP_ACK, &[]);
                self.tls_started = true;
                self.structured = false;
                self.meta = None;
                Outcome::StartTls
            }
            proto::OPT_EXPORT_NAME => {
                let name = match proto::parse_export_name(data) {
                    Ok(n) => n,
                    Err(e) => return Outcome::Close(format!("EXPORT_NAME: {e}")),
                };
                let Some(i) = find(name) else {
                    return Outcome::Close(format!("EXPORT_NAME: no export '{name}'"));
                };
                if !admit(Admit::Export(i)) {
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
                if option == proto::OPT_GO && !admit(Admit::Export(i)) {
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

fn put_tls_required(out: &mut Vec<u8>, option: u32) {
    proto::put_option_error(
        out,
        option,
        proto::REP_ERR_TLS_REQD,
        "TLS required: send NBD_OPT_STARTTLS first",
    );
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

    /// The option replies in `out`: (option, type, data).
    fn replies(out: &[u8]) -> Vec<(u32, u32, Vec<u8>)> {
        let mut v = Vec::new();
        let mut at = 0;
        while at + 20 <= out.len() {
            let word = |i: usize| u32::from_be_bytes(out[at + i..at + i + 4].try_into().unwrap());
            let len = word(16) as usize;
            v.push((word(8), word(12), out[at + 20..at + 20 + len].to_vec()));
            at += 20 + len;
        }
        v
    }

    #[test]
    fn tls_required_refuses_everything_but_starttls_and_names_no_export() {
        let mut h = Handshake::with_tls(TlsMode::Require);
        let mut input = 1u32.to_be_bytes().to_vec();
        input.extend(opt(OPT_LIST, &[]));
        input.extend(opt(OPT_STRUCTURED_REPLY, &[]));
        let mut info = 3u32.to_be_bytes().to_vec();
        info.extend_from_slice(b"lin");
        info.extend_from_slice(&0u16.to_be_bytes());
        input.extend(opt(OPT_INFO, &info));
        input.extend(opt(OPT_GO, &info));
        input.extend(opt(OPT_INFO, &vec![0u8; MAX_OPTION_DATA + 1]));
        let mut out = Vec::new();
        let (n, o) = h.feed(&input, &exports(), &mut out);
        assert_eq!((n, o), (input.len(), Outcome::Continue));
        let r = replies(&out);
        assert_eq!(r.len(), 5);
        for (_, typ, data) in &r {
            assert_eq!(*typ, REP_ERR_TLS_REQD);
            assert!(!String::from_utf8_lossy(data).contains("lin"));
        }
        // EXPORT_NAME cannot be refused: the session ends.
        let mut out = Vec::new();
        let (_, o) = h.feed(&opt(OPT_EXPORT_NAME, b"lin"), &exports(), &mut out);
        assert!(
            matches!(o, Outcome::Close(ref why) if why.contains("TLS")),
            "{o:?}"
        );
        assert!(out.is_empty());
    }

    #[test]
    fn starttls_is_acknowledged_once_then_negotiation_goes_on() {
        let mut h = Handshake::with_tls(TlsMode::Require);
        let mut input = 1u32.to_be_bytes().to_vec();
        input.extend(opt(OPT_STARTTLS, &[]));
        input.extend_from_slice(b"\x16\x03\x01"); // the ClientHello's start
        let mut out = Vec::new();
        let (n, o) = h.feed(&input, &exports(), &mut out);
        assert_eq!(o, Outcome::StartTls);
        assert_eq!(n, input.len() - 3, "TLS bytes are left unconsumed");
        assert_eq!(replies(&out), vec![(OPT_STARTTLS, REP_ACK, vec![])]);
        // Decrypted from now on: the export is listed, STARTTLS refused.
        let mut input = opt(OPT_LIST, &[]);
        input.extend(opt(OPT_STARTTLS, &[]));
        let mut out = Vec::new();
        let (_, o) = h.feed(&input, &exports(), &mut out);
        assert_eq!(o, Outcome::Continue);
        let r = replies(&out);
        assert_eq!(r[0].1, REP_SERVER);
        assert_eq!(
            r[2],
            (
                OPT_STARTTLS,
                REP_ERR_INVALID,
                b"TLS already started".to_vec()
            )
        );
    }

    #[test]
    fn starttls_forgets_what_was_negotiated_in_plaintext() {
        let mut h = Handshake::with_tls(TlsMode::On);
        let mut input = 1u32.to_be_bytes().to_vec();
        input.extend(opt(OPT_STRUCTURED_REPLY, &[]));
        input.extend(opt(OPT_STARTTLS, &[]));
        let mut out = Vec::new();
        assert_eq!(h.feed(&input, &exports(), &mut out).1, Outcome::StartTls);
        let go = [0u8; 6];
        let (_, o) = h.feed(&opt(OPT_GO, &go), &exports(), &mut out);
        assert!(
            matches!(o, Outcome::Transmission(n) if !n.structured),
            "{o:?}"
        );
    }

    #[test]
    fn without_tls_starttls_is_unsupported_and_with_no_room_refused_by_policy() {
        let mut input = 1u32.to_be_bytes().to_vec();
        input.extend(opt(OPT_STARTTLS, &[]));
        let mut out = Vec::new();
        let (_, o) = Handshake::new().feed(&input, &exports(), &mut out);
        assert_eq!(o, Outcome::Continue);
        assert_eq!(replies(&out)[0].1, REP_ERR_UNSUP);
        let mut out = Vec::new();
        let (_, o) = Handshake::with_tls(TlsMode::Require).feed_admitting(
            &input,
            &exports(),
            &mut |a| a != Admit::Tls,
            &mut out,
        );
        assert_eq!(o, Outcome::Continue);
        assert_eq!(replies(&out)[0].1, REP_ERR_POLICY);
    }
}
