//! The NBD wire format: constants, types and pure parse/encode functions.
//!
//! Names follow `doc/proto.md` without the `NBD_` prefix. Everything here is
//! free of I/O, so the fuzz targets call these functions directly. All
//! integers on the wire are big-endian.

use udm_core::{Alloc, Extent, SECTOR_SHIFT, SECTOR_SIZE};

/// `NBDMAGIC`, the first 8 bytes the server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: newstyle greeting magic and the magic of every option.
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Magic of every option reply.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of every request (`NBD_REQUEST_MAGIC`).
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flag: the server speaks fixed newstyle.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: the server can omit the 124 zero bytes after EXPORT_NAME.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: the client speaks fixed newstyle.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: omit the 124 zero bytes after EXPORT_NAME.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Transmission flag: always set.
pub const FLAG_HAS_FLAGS: u16 = 1 << 0;
/// Transmission flag: the export is read-only.
pub const FLAG_READ_ONLY: u16 = 1 << 1;
/// Transmission flag: FLUSH is supported.
pub const FLAG_SEND_FLUSH: u16 = 1 << 2;
/// Transmission flag: the FUA command flag is supported.
pub const FLAG_SEND_FUA: u16 = 1 << 3;
/// Transmission flag: rotational medium.
pub const FLAG_ROTATIONAL: u16 = 1 << 4;
/// Transmission flag: TRIM is supported.
pub const FLAG_SEND_TRIM: u16 = 1 << 5;
/// Transmission flag: WRITE_ZEROES (and NO_HOLE) is supported.
pub const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// Transmission flag: the DF command flag is supported.
pub const FLAG_SEND_DF: u16 = 1 << 7;
/// Transmission flag: FLUSH and FUA are visible across connections.
pub const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
/// Transmission flag: CACHE is understood.
pub const FLAG_SEND_CACHE: u16 = 1 << 10;
/// Transmission flag: the FAST_ZERO command flag is supported.
pub const FLAG_SEND_FAST_ZERO: u16 = 1 << 11;

/// Option: choose an export and enter transmission (no error reply possible).
pub const OPT_EXPORT_NAME: u32 = 1;
/// Option: end the handshake.
pub const OPT_ABORT: u32 = 2;
/// Option: list exports.
pub const OPT_LIST: u32 = 3;
/// Option: start TLS (not supported: udm speaks NOTLS only).
pub const OPT_STARTTLS: u32 = 5;
/// Option: describe an export.
pub const OPT_INFO: u32 = 6;
/// Option: describe an export and enter transmission.
pub const OPT_GO: u32 = 7;
/// Option: use structured replies.
pub const OPT_STRUCTURED_REPLY: u32 = 8;
/// Option: list metadata contexts.
pub const OPT_LIST_META_CONTEXT: u32 = 9;
/// Option: select metadata contexts.
pub const OPT_SET_META_CONTEXT: u32 = 10;

/// Option reply: success / end of a list.
pub const REP_ACK: u32 = 1;
/// Option reply: one export of a LIST.
pub const REP_SERVER: u32 = 2;
/// Option reply: one piece of information of INFO/GO.
pub const REP_INFO: u32 = 3;
/// Option reply: one metadata context.
pub const REP_META_CONTEXT: u32 = 4;
/// Option error: unknown option.
pub const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
/// Option error: forbidden by policy.
pub const REP_ERR_POLICY: u32 = (1 << 31) + 2;
/// Option error: syntactically or semantically invalid.
pub const REP_ERR_INVALID: u32 = (1 << 31) + 3;
/// Option error: TLS must be initiated (NBD_OPT_STARTTLS) first.
pub const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;
/// Option error: no such export.
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
/// Option error: the server is shutting down.
pub const REP_ERR_SHUTDOWN: u32 = (1 << 31) + 7;
/// Option error: the request or the reply is too large.
pub const REP_ERR_TOO_BIG: u32 = (1 << 31) + 9;

/// Information type: size and transmission flags.
pub const INFO_EXPORT: u16 = 0;
/// Information type: canonical name.
pub const INFO_NAME: u16 = 1;
/// Information type: description.
pub const INFO_DESCRIPTION: u16 = 2;
/// Information type: block sizes.
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Command: read.
pub const CMD_READ: u16 = 0;
/// Command: write (payload follows the request).
pub const CMD_WRITE: u16 = 1;
/// Command: disconnect (no reply).
pub const CMD_DISC: u16 = 2;
/// Command: flush.
pub const CMD_FLUSH: u16 = 3;
/// Command: trim (discard).
pub const CMD_TRIM: u16 = 4;
/// Command: cache (prefetch hint).
pub const CMD_CACHE: u16 = 5;
/// Command: write zeroes.
pub const CMD_WRITE_ZEROES: u16 = 6;
/// Command: block status.
pub const CMD_BLOCK_STATUS: u16 = 7;

/// Command flag: force unit access.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// Command flag: WRITE_ZEROES must not punch a hole.
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// Command flag: do not fragment the read reply.
pub const CMD_FLAG_DF: u16 = 1 << 2;
/// Command flag: one extent only in BLOCK_STATUS.
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
/// Command flag: fail WRITE_ZEROES unless it is fast.
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

/// Structured reply flag: last chunk of the reply.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
/// Structured chunk: no payload.
pub const REPLY_TYPE_NONE: u16 = 0;
/// Structured chunk: offset + data.
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
/// Structured chunk: block status descriptors.
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// Structured chunk: error.
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;

/// Error: operation not permitted (writes to a read-only export).
pub const EPERM: u32 = 1;
/// Error: I/O error.
pub const EIO: u32 = 5;
/// Error: out of memory.
pub const ENOMEM: u32 = 12;
/// Error: invalid argument.
pub const EINVAL: u32 = 22;
/// Error: no space left (writes beyond the end).
pub const ENOSPC: u32 = 28;
/// Error: value too large.
pub const EOVERFLOW: u32 = 75;
/// Error: not supported (FAST_ZERO that would be slow).
pub const ENOTSUP: u32 = 95;
/// Error: the server is shutting down.
pub const ESHUTDOWN: u32 = 108;

/// `base:allocation` flag: the extent is a hole.
pub const STATE_HOLE: u32 = 1 << 0;
/// `base:allocation` flag: the extent reads as zeroes.
pub const STATE_ZERO: u32 = 1 << 1;

/// The one metadata context udm serves.
pub const META_BASE_ALLOCATION: &str = "base:allocation";
/// The id udm gives `base:allocation` when it is selected.
pub const META_BASE_ALLOCATION_ID: u32 = 1;

/// Bytes of the server's greeting.
pub const GREETING_LEN: usize = 18;
/// Bytes of the client's flags.
pub const CLIENT_FLAGS_LEN: usize = 4;
/// Bytes of an option header (magic, option, length).
pub const OPTION_HEADER_LEN: usize = 16;
/// Bytes of a request header.
pub const REQUEST_LEN: usize = 28;
/// Bytes of a simple reply header.
pub const SIMPLE_REPLY_LEN: usize = 16;
/// Bytes of a structured reply chunk header.
pub const STRUCTURED_HEADER_LEN: usize = 20;
/// Longest string the protocol allows (names, messages, queries).
pub const MAX_STRING: usize = 4096;

/// What a client may learn about an export: size, block sizes, flags.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportInfo {
    /// The export's name.
    pub name: String,
    /// A human-readable description (may be empty).
    pub description: String,
    /// Size in bytes.
    pub size: u64,
    /// Transmission flags.
    pub flags: u16,
    /// Minimum block size: offsets and lengths are multiples of it.
    pub min_block: u32,
    /// Preferred block size.
    pub pref_block: u32,
    /// Largest READ/WRITE payload.
    pub max_payload: u32,
}

/// A protocol violation found while parsing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProtoError {
    /// Fewer bytes than the structure needs.
    Short,
    /// A magic number is wrong: the stream cannot be resynchronised.
    BadMagic,
    /// A length field points past the data, or data is left over.
    BadLength,
    /// A string is not UTF-8, contains NUL, or is too long.
    BadString,
}

impl std::fmt::Display for ProtoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ProtoError::Short => "truncated message",
            ProtoError::BadMagic => "bad magic",
            ProtoError::BadLength => "inconsistent length field",
            ProtoError::BadString => "invalid string",
        })
    }
}

/// A cursor over big-endian fields.
struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ProtoError> {
        if self.b.len() < n {
            return Err(ProtoError::Short);
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn u16(&mut self) -> Result<u16, ProtoError> {
        let s = self.take(2)?;
        Ok(u16::from_be_bytes([s[0], s[1]]))
    }
    fn u32(&mut self) -> Result<u32, ProtoError> {
        let s = self.take(4)?;
        Ok(u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self) -> Result<u64, ProtoError> {
        let s = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_be_bytes(a))
    }
    /// A string of `n` bytes, checked as the protocol's strings are.
    fn string(&mut self, n: usize) -> Result<&'a str, ProtoError> {
        if n > MAX_STRING {
            return Err(ProtoError::BadString);
        }
        let s = self.take(n).map_err(|_| ProtoError::BadLength)?;
        check_string(s)
    }
    /// A string preceded by its 32-bit length.
    fn string32(&mut self) -> Result<&'a str, ProtoError> {
        let n = self.u32().map_err(|_| ProtoError::BadLength)? as usize;
        if n > self.b.len() {
            return Err(ProtoError::BadLength);
        }
        self.string(n)
    }
    fn end(&self) -> Result<(), ProtoError> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(ProtoError::BadLength)
        }
    }
}

fn check_string(s: &[u8]) -> Result<&str, ProtoError> {
    if s.contains(&0) {
        return Err(ProtoError::BadString);
    }
    std::str::from_utf8(s).map_err(|_| ProtoError::BadString)
}

/// The client's flags, after the greeting.
pub fn parse_client_flags(b: &[u8]) -> Result<u32, ProtoError> {
    Reader { b }.u32()
}

/// An option header: which option and how many data bytes follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OptionHeader {
    /// The option code.
    pub option: u32,
    /// Bytes of option data that follow.
    pub len: u32,
}

/// Parses the 16-byte option header.
pub fn parse_option_header(b: &[u8]) -> Result<OptionHeader, ProtoError> {
    let mut r = Reader { b };
    if r.u64()? != IHAVEOPT {
        return Err(ProtoError::BadMagic);
    }
    Ok(OptionHeader {
        option: r.u32()?,
        len: r.u32()?,
    })
}

/// Data of `NBD_OPT_EXPORT_NAME`: the whole data is the name.
pub fn parse_export_name(data: &[u8]) -> Result<&str, ProtoError> {
    if data.len() > MAX_STRING {
        return Err(ProtoError::BadString);
    }
    check_string(data)
}

/// Data of `NBD_OPT_INFO` and `NBD_OPT_GO`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InfoRequest<'a> {
    /// The export's name ("" for the default export).
    pub name: &'a str,
    /// The information types asked for.
    pub infos: Vec<u16>,
}

/// Parses the data of `NBD_OPT_INFO`/`NBD_OPT_GO`.
pub fn parse_info_request(data: &[u8]) -> Result<InfoRequest<'_>, ProtoError> {
    let mut r = Reader { b: data };
    let name = r.string32()?;
    let n = r.u16().map_err(|_| ProtoError::BadLength)? as usize;
    if r.b.len() != n * 2 {
        return Err(ProtoError::BadLength);
    }
    let mut infos = Vec::with_capacity(n);
    for _ in 0..n {
        infos.push(r.u16()?);
    }
    r.end()?;
    Ok(InfoRequest { name, infos })
}

/// Data of `NBD_OPT_LIST_META_CONTEXT` and `NBD_OPT_SET_META_CONTEXT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetaRequest<'a> {
    /// The export's name.
    pub name: &'a str,
    /// The queries, e.g. `base:allocation`.
    pub queries: Vec<&'a str>,
}

/// Parses the data of the metadata-context options.
pub fn parse_meta_request(data: &[u8]) -> Result<MetaRequest<'_>, ProtoError> {
    let mut r = Reader { b: data };
    let name = r.string32()?;
    let n = r.u32().map_err(|_| ProtoError::BadLength)? as usize;
    // Each query takes at least its 4-byte length: bounds the loop by the data.
    if n > r.b.len() / 4 {
        return Err(ProtoError::BadLength);
    }
    let mut queries = Vec::with_capacity(n);
    for _ in 0..n {
        queries.push(r.string32()?);
    }
    r.end()?;
    Ok(MetaRequest { name, queries })
}

/// Appends the server's newstyle greeting.
pub fn put_greeting(out: &mut Vec<u8>) {
    out.extend_from_slice(&NBDMAGIC.to_be_bytes());
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
}

/// Appends one option reply.
pub fn put_option_reply(out: &mut Vec<u8>, option: u32, reply: u32, data: &[u8]) {
    out.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

/// Appends an error reply with a message for humans.
pub fn put_option_error(out: &mut Vec<u8>, option: u32, reply: u32, msg: &str) {
    put_option_reply(out, option, reply, msg.as_bytes());
}

/// Appends `NBD_REP_SERVER` for one export.
pub fn put_rep_server(out: &mut Vec<u8>, option: u32, name: &str) {
    let mut d = Vec::with_capacity(4 + name.len());
    d.extend_from_slice(&(name.len() as u32).to_be_bytes());
    d.extend_from_slice(name.as_bytes());
    put_option_reply(out, option, REP_SERVER, &d);
}

/// Appends the `NBD_REP_INFO` replies for `e`: always EXPORT and BLOCK_SIZE
/// (the server enforces its block sizes), NAME and DESCRIPTION when asked.
pub fn put_info(out: &mut Vec<u8>, option: u32, e: &ExportInfo, asked: &[u16]) {
    let mut d = Vec::with_capacity(14);
    d.extend_from_slice(&INFO_EXPORT.to_be_bytes());
    d.extend_from_slice(&e.size.to_be_bytes());
    d.extend_from_slice(&e.flags.to_be_bytes());
    put_option_reply(out, option, REP_INFO, &d);
    d.clear();
    d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    d.extend_from_slice(&e.min_block.to_be_bytes());
    d.extend_from_slice(&e.pref_block.to_be_bytes());
    d.extend_from_slice(&e.max_payload.to_be_bytes());
    put_option_reply(out, option, REP_INFO, &d);
    if asked.contains(&INFO_NAME) {
        d.clear();
        d.extend_from_slice(&INFO_NAME.to_be_bytes());
        d.extend_from_slice(e.name.as_bytes());
        put_option_reply(out, option, REP_INFO, &d);
    }
    if asked.contains(&INFO_DESCRIPTION) && !e.description.is_empty() {
        d.clear();
        d.extend_from_slice(&INFO_DESCRIPTION.to_be_bytes());
        d.extend_from_slice(e.description.as_bytes());
        put_option_reply(out, option, REP_INFO, &d);
    }
}

/// Appends `NBD_REP_META_CONTEXT`.
pub fn put_meta_context(out: &mut Vec<u8>, option: u32, id: u32, name: &str) {
    let mut d = Vec::with_capacity(4 + name.len());
    d.extend_from_slice(&id.to_be_bytes());
    d.extend_from_slice(name.as_bytes());
    put_option_reply(out, option, REP_META_CONTEXT, &d);
}

/// Appends the reply to `NBD_OPT_EXPORT_NAME`: size, flags and (unless the
/// client negotiated NO_ZEROES) 124 zero bytes.
pub fn put_export_name_reply(out: &mut Vec<u8>, e: &ExportInfo, no_zeroes: bool) {
    out.extend_from_slice(&e.size.to_be_bytes());
    out.extend_from_slice(&e.flags.to_be_bytes());
    if !no_zeroes {
        out.extend_from_slice(&[0u8; 124]);
    }
}

/// A request header as sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// Command flags.
    pub flags: u16,
    /// Command type.
    pub cmd: u16,
    /// The client's opaque cookie, echoed in the reply.
    pub cookie: u64,
    /// Byte offset.
    pub offset: u64,
    /// Byte length.
    pub len: u32,
}

impl Request {
    /// Bytes of payload that follow the header on the wire (a WRITE's
    /// data), whether or not the request is valid: the server must read
    /// them to stay in step with the client.
    pub fn payload_len(&self) -> u32 {
        if self.cmd == CMD_WRITE {
            self.len
        } else {
            0
        }
    }
}

/// Parses the 28-byte request header. A bad magic means the stream is lost.
pub fn parse_request(b: &[u8]) -> Result<Request, ProtoError> {
    let mut r = Reader { b };
    if r.u32()? != REQUEST_MAGIC {
        return Err(ProtoError::BadMagic);
    }
    Ok(Request {
        flags: r.u16()?,
        cmd: r.u16()?,
        cookie: r.u64()?,
        offset: r.u64()?,
        len: r.u32()?,
    })
}

/// A request that passed [`validate`]: what the server must do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    /// Read `len` bytes at `offset`.
    Read,
    /// Write the payload at `offset`.
    Write {
        /// Durable before the reply.
        fua: bool,
    },
    /// Make completed writes durable.
    Flush,
    /// Discard the range.
    Trim {
        /// Durable before the reply.
        fua: bool,
    },
    /// Zero the range.
    WriteZeroes {
        /// Durable before the reply.
        fua: bool,
        /// Fail with ENOTSUP rather than be slow.
        fast: bool,
    },
    /// Prefetch hint.
    Cache,
    /// Report `base:allocation` for the range.
    BlockStatus {
        /// One extent only.
        req_one: bool,
    },
    /// Disconnect after in-flight requests.
    Disc,
}

/// Why a request is refused: the NBD error and a message for humans.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The NBD error value.
    pub error: u32,
    /// A short explanation (sent in structured error chunks, and logged).
    pub msg: &'static str,
}

const fn refuse(error: u32, msg: &'static str) -> Refusal {
    Refusal { error, msg }
}

/// What the transmission phase was negotiated with, for [`validate`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TxParams {
    /// Export size in bytes.
    pub size: u64,
    /// Transmission flags advertised.
    pub flags: u16,
    /// Minimum block size.
    pub min_block: u32,
    /// Largest READ/WRITE payload.
    pub max_payload: u32,
    /// Whether `base:allocation` was selected (BLOCK_STATUS allowed).
    pub block_status: bool,
}

/// Checks a request against the negotiated parameters, in the spec's order
/// of concerns: command, flags, read-only, length, range, alignment.
pub fn validate(req: &Request, p: &TxParams) -> Result<Command, Refusal> {
    let ro = p.flags & FLAG_READ_ONLY != 0;
    let has = |f: u16| p.flags & f != 0;
    // Flags each command accepts (FUA is valid on every command when advertised).
    let allowed = match req.cmd {
        CMD_WRITE_ZEROES => {
            CMD_FLAG_NO_HOLE
                | if has(FLAG_SEND_FAST_ZERO) {
                    CMD_FLAG_FAST_ZERO
                } else {
                    0
                }
        }
        CMD_BLOCK_STATUS => CMD_FLAG_REQ_ONE,
        CMD_READ | CMD_WRITE | CMD_DISC | CMD_FLUSH | CMD_TRIM | CMD_CACHE => 0,
        _ => return Err(refuse(EINVAL, "unknown command")),
    } | if has(FLAG_SEND_FUA) { CMD_FLAG_FUA } else { 0 };
    if req.flags & !allowed != 0 {
        return Err(refuse(EINVAL, "command flag not valid for this command"));
    }
    let fua = req.flags & CMD_FLAG_FUA != 0;
    let cmd = match req.cmd {
        CMD_READ => Command::Read,
        CMD_WRITE => Command::Write { fua },
        CMD_DISC => return Ok(Command::Disc),
        CMD_FLUSH => {
            if !has(FLAG_SEND_FLUSH) {
                return Err(refuse(EINVAL, "flush not supported"));
            }
            if req.offset != 0 || req.len != 0 {
                return Err(refuse(EINVAL, "flush with nonzero offset or length"));
            }
            return Ok(Command::Flush);
        }
        CMD_TRIM => Command::Trim { fua },
        CMD_CACHE => Command::Cache,
        CMD_WRITE_ZEROES => Command::WriteZeroes {
            fua,
            fast: req.flags & CMD_FLAG_FAST_ZERO != 0,
        },
        CMD_BLOCK_STATUS => Command::BlockStatus {
            req_one: req.flags & CMD_FLAG_REQ_ONE != 0,
        },
        _ => return Err(refuse(EINVAL, "unknown command")),
    };
    let writes = matches!(
        cmd,
        Command::Write { .. } | Command::Trim { .. } | Command::WriteZeroes { .. }
    );
    if writes && ro {
        return Err(refuse(EPERM, "export is read-only"));
    }
    match cmd {
        Command::Trim { .. } if !has(FLAG_SEND_TRIM) => {
            return Err(refuse(EINVAL, "trim not supported"))
        }
        Command::WriteZeroes { .. } if !has(FLAG_SEND_WRITE_ZEROES) => {
            return Err(refuse(EINVAL, "write-zeroes not supported"))
        }
        Command::BlockStatus { .. } if !p.block_status => {
            return Err(refuse(EINVAL, "no metadata context selected"))
        }
        Command::Read | Command::Write { .. } if req.len > p.max_payload => {
            return Err(refuse(EINVAL, "length above the maximum payload"))
        }
        _ => {}
    }
    let end = req.offset.checked_add(req.len as u64);
    if end.is_none_or(|e| e > p.size) {
        let e = if matches!(cmd, Command::Write { .. } | Command::WriteZeroes { .. }) {
            ENOSPC
        } else {
            EINVAL
        };
        return Err(refuse(e, "range beyond the end of the export"));
    }
    let mb = p.min_block.max(1) as u64;
    if !req.offset.is_multiple_of(mb) || !(req.len as u64).is_multiple_of(mb) {
        return Err(refuse(
            EINVAL,
            "offset or length not aligned to the minimum block size",
        ));
    }
    Ok(cmd)
}

/// Encodes a simple reply header into `out` (16 bytes).
pub fn encode_simple_reply(out: &mut [u8], error: u32, cookie: u64) -> usize {
    out[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out[4..8].copy_from_slice(&error.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    SIMPLE_REPLY_LEN
}

/// Encodes a structured chunk header into `out` (20 bytes).
pub fn encode_chunk_header(out: &mut [u8], flags: u16, ty: u16, cookie: u64, len: u32) -> usize {
    out[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&flags.to_be_bytes());
    out[6..8].copy_from_slice(&ty.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    out[16..20].copy_from_slice(&len.to_be_bytes());
    STRUCTURED_HEADER_LEN
}

/// Encodes the header of a final `OFFSET_DATA` chunk carrying `len` bytes
/// read at `offset` (the data follows as its own iovec). 28 bytes.
pub fn encode_read_chunk(out: &mut [u8], cookie: u64, offset: u64, len: u32) -> usize {
    let n = encode_chunk_header(
        out,
        REPLY_FLAG_DONE,
        REPLY_TYPE_OFFSET_DATA,
        cookie,
        len + 8,
    );
    out[n..n + 8].copy_from_slice(&offset.to_be_bytes());
    n + 8
}

/// Encodes a final `NONE` chunk (a successful reply with no payload).
pub fn encode_none_chunk(out: &mut [u8], cookie: u64) -> usize {
    encode_chunk_header(out, REPLY_FLAG_DONE, REPLY_TYPE_NONE, cookie, 0)
}

/// Encodes a final `ERROR` chunk with as much of `msg` as fits in `out`.
pub fn encode_error_chunk(out: &mut [u8], cookie: u64, error: u32, msg: &str) -> usize {
    let room = out.len().saturating_sub(STRUCTURED_HEADER_LEN + 6);
    let m = &msg.as_bytes()[..msg.len().min(room)];
    let n = encode_chunk_header(
        out,
        REPLY_FLAG_DONE,
        REPLY_TYPE_ERROR,
        cookie,
        6 + m.len() as u32,
    );
    out[n..n + 4].copy_from_slice(&error.to_be_bytes());
    out[n + 4..n + 6].copy_from_slice(&(m.len() as u16).to_be_bytes());
    out[n + 6..n + 6 + m.len()].copy_from_slice(m);
    n + 6 + m.len()
}

/// Bytes of one `BLOCK_STATUS` descriptor (length, status flags).
pub const DESCRIPTOR_LEN: usize = 8;

/// Encodes the header of a final `BLOCK_STATUS` chunk for context `ctx`
/// with `n` descriptors, which follow as their own iovec
/// ([`put_descriptor`] each). 24 bytes.
pub fn encode_block_status_header(out: &mut [u8], cookie: u64, ctx: u32, n: u32) -> usize {
    let len = 4 + n * DESCRIPTOR_LEN as u32;
    let h = encode_chunk_header(out, REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, cookie, len);
    out[h..h + 4].copy_from_slice(&ctx.to_be_bytes());
    h + 4
}

/// Writes one `BLOCK_STATUS` descriptor into `out` (8 bytes).
pub fn put_descriptor(out: &mut [u8], len: u32, flags: u32) {
    out[0..4].copy_from_slice(&len.to_be_bytes());
    out[4..8].copy_from_slice(&flags.to_be_bytes());
}

/// The `base:allocation` status flags of what an extent holds: a hole
/// reads as zeroes too.
pub fn allocation_flags(a: Alloc) -> u32 {
    match a {
        Alloc::Data => 0,
        Alloc::Zero => STATE_ZERO,
        Alloc::Hole => STATE_HOLE | STATE_ZERO,
    }
}

/// The `base:allocation` descriptors (length in bytes, flags) of the `len`
/// bytes at `offset`, from `extents`, which a device reported for its
/// sectors from `offset`'s on (`offset / 512`). The spec's rules: the
/// lengths follow each other from `offset`, none is 0, their sum is at
/// most `len` (a prefix when the extents cover less, or when `max`
/// descriptors are reached: the client asks again for the rest), and at
/// least one is sent: with no extents at all, the whole range is data
/// (status 0 is always true). An unaligned range's first and last
/// descriptors are cut at `offset` and `offset + len`; neighbours of one
/// status merge.
pub fn allocation_descriptors(
    offset: u64,
    len: u32,
    extents: &[Extent],
    max: usize,
    out: &mut Vec<(u32, u32)>,
) {
    out.clear();
    let end = offset.saturating_add(len as u64);
    let mut pos = offset;
    let mut sector_end = offset >> SECTOR_SHIFT;
    for e in extents {
        sector_end = sector_end.saturating_add(e.sectors);
        let stop = sector_end.saturating_mul(SECTOR_SIZE).min(end);
        if stop <= pos {
            continue;
        }
        // stop - pos <= len: fits.
        let n = (stop - pos) as u32;
        let flags = allocation_flags(e.alloc);
        let full = out.len() >= max;
        match out.last_mut() {
            Some(last) if last.1 == flags => last.0 += n,
            _ if full => break,
            _ => out.push((n, flags)),
        }
        pos = stop;
        if pos >= end {
            break;
        }
    }
    if out.is_empty() && len > 0 {
        out.push((len, 0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> TxParams {
        TxParams {
            size: 1 << 20,
            flags: FLAG_HAS_FLAGS
                | FLAG_SEND_FLUSH
                | FLAG_SEND_FUA
                | FLAG_SEND_TRIM
                | FLAG_SEND_WRITE_ZEROES
                | FLAG_SEND_FAST_ZERO,
            min_block: 512,
            max_payload: 1 << 25,
            block_status: false,
        }
    }

    fn req(cmd: u16, flags: u16, offset: u64, len: u32) -> Request {
        Request {
            flags,
            cmd,
            cookie: 7,
            offset,
            len,
        }
    }

    #[test]
    fn request_header_round_trips_and_bad_magic_is_fatal() {
        let mut b = [0u8; REQUEST_LEN];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&CMD_FLAG_FUA.to_be_bytes());
        b[6..8].copy_from_slice(&CMD_WRITE.to_be_bytes());
        b[8..16].copy_from_slice(&42u64.to_be_bytes());
        b[16..24].copy_from_slice(&4096u64.to_be_bytes());
        b[24..28].copy_from_slice(&512u32.to_be_bytes());
        let r = parse_request(&b).unwrap();
        assert_eq!(r, req(CMD_WRITE, CMD_FLAG_FUA, 4096, 512).with_cookie(42));
        assert_eq!(r.payload_len(), 512);
        assert_eq!(parse_request(&b[..10]), Err(ProtoError::Short));
        b[0] ^= 1;
        assert_eq!(parse_request(&b), Err(ProtoError::BadMagic));
    }

    impl Request {
        fn with_cookie(mut self, c: u64) -> Request {
            self.cookie = c;
            self
        }
    }

    #[test]
    fn validation_follows_the_spec_error_values() {
        let p = params();
        assert_eq!(validate(&req(CMD_READ, 0, 0, 4096), &p), Ok(Command::Read));
        let e = |r: Request| validate(&r, &p).unwrap_err().error;
        assert_eq!(e(req(99, 0, 0, 0)), EINVAL);
        assert_eq!(e(req(CMD_READ, CMD_FLAG_DF, 0, 512)), EINVAL);
        assert_eq!(e(req(CMD_READ, 1 << 9, 0, 512)), EINVAL);
        assert_eq!(e(req(CMD_READ, 0, 1 << 20, 512)), EINVAL);
        assert_eq!(e(req(CMD_WRITE, 0, 1 << 20, 512)), ENOSPC);
        assert_eq!(e(req(CMD_WRITE, 0, u64::MAX - 10, 512)), ENOSPC);
        assert_eq!(e(req(CMD_READ, 0, 1, 512)), EINVAL);
        assert_eq!(e(req(CMD_READ, 0, 0, (1 << 25) + 512)), EINVAL);
        assert_eq!(e(req(CMD_BLOCK_STATUS, 0, 0, 512)), EINVAL);
        assert_eq!(e(req(CMD_FLUSH, 0, 0, 512)), EINVAL);
        let mut ro = p;
        ro.flags |= FLAG_READ_ONLY;
        assert_eq!(
            validate(&req(CMD_WRITE, 0, 0, 512), &ro).unwrap_err().error,
            EPERM
        );
        assert_eq!(
            validate(&req(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 0, 512), &p),
            Ok(Command::WriteZeroes {
                fua: false,
                fast: true
            })
        );
    }

    #[test]
    fn info_and_meta_requests_reject_lengths_past_the_data() {
        let mut d = Vec::new();
        d.extend_from_slice(&3u32.to_be_bytes());
        d.extend_from_slice(b"lin");
        d.extend_from_slice(&1u16.to_be_bytes());
        d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        let r = parse_info_request(&d).unwrap();
        assert_eq!((r.name, r.infos), ("lin", vec![INFO_BLOCK_SIZE]));
        d[3] = 200;
        assert_eq!(parse_info_request(&d), Err(ProtoError::BadLength));
        let mut m = Vec::new();
        m.extend_from_slice(&0u32.to_be_bytes());
        m.extend_from_slice(&1_000_000u32.to_be_bytes());
        assert_eq!(parse_meta_request(&m), Err(ProtoError::BadLength));
    }

    fn ext(sectors: u64, alloc: Alloc) -> Extent {
        Extent { sectors, alloc }
    }

    fn descriptors(offset: u64, len: u32, extents: &[Extent], max: usize) -> Vec<(u32, u32)> {
        let mut out = vec![(9, 9)]; // cleared first
        allocation_descriptors(offset, len, extents, max, &mut out);
        out
    }

    const HOLE: u32 = STATE_HOLE | STATE_ZERO;

    #[test]
    fn descriptors_carry_each_extent_in_bytes_with_its_flags() {
        let e = [
            ext(8, Alloc::Data),
            ext(16, Alloc::Hole),
            ext(8, Alloc::Zero),
        ];
        assert_eq!(
            descriptors(4096, 16384, &e, 1024),
            vec![(4096, 0), (8192, HOLE), (4096, STATE_ZERO)]
        );
        // REQ_ONE (max 1): the first only.
        assert_eq!(descriptors(4096, 16384, &e, 1), vec![(4096, 0)]);
        // Fewer extents than the range: a prefix, which the spec allows.
        assert_eq!(
            descriptors(0, 1 << 20, &e[..2], 1024),
            vec![(4096, 0), (8192, HOLE)]
        );
        // Extents of one status merge; descriptors beyond max are left out.
        let same = [
            ext(8, Alloc::Hole),
            ext(8, Alloc::Zero),
            ext(8, Alloc::Zero),
        ];
        assert_eq!(
            descriptors(0, 12288, &same, 2),
            vec![(4096, HOLE), (8192, STATE_ZERO)]
        );
        let alt = [
            ext(1, Alloc::Data),
            ext(1, Alloc::Hole),
            ext(1, Alloc::Data),
        ];
        assert_eq!(descriptors(0, 1536, &alt, 2), vec![(512, 0), (512, HOLE)]);
    }

    #[test]
    fn an_unaligned_range_is_cut_at_its_ends_and_never_exceeded() {
        // Bytes 100..1300 lie in sectors 0..3; the device answered for them
        // (and more than asked: it is cut at the end).
        let e = [
            ext(1, Alloc::Hole),
            ext(1, Alloc::Data),
            ext(9, Alloc::Hole),
        ];
        assert_eq!(
            descriptors(100, 1200, &e, 1024),
            vec![(412, HOLE), (512, 0), (276, HOLE)]
        );
        // One byte of sector 1: the device's extents start at sector 1.
        assert_eq!(descriptors(700, 1, &e[1..], 1024), vec![(1, 0)]);
    }

    #[test]
    fn with_no_extents_the_range_is_data_and_at_least_one_descriptor_is_sent() {
        assert_eq!(descriptors(0, 4096, &[], 1024), vec![(4096, 0)]);
        let zero_len = [ext(0, Alloc::Hole)];
        assert_eq!(descriptors(512, 512, &zero_len, 1024), vec![(512, 0)]);
        // A u32::MAX request at the end of a huge device neither overflows
        // nor exceeds the length.
        let big = [ext(u64::MAX / 1024, Alloc::Hole)];
        assert_eq!(
            descriptors(u64::MAX - u32::MAX as u64, u32::MAX, &big, 1024),
            vec![(u32::MAX, HOLE)]
        );
    }

    #[test]
    fn a_block_status_chunk_header_counts_its_descriptors() {
        let mut out = [0u8; 24];
        assert_eq!(encode_block_status_header(&mut out, 7, 1, 3), 24);
        assert_eq!(&out[0..4], &STRUCTURED_REPLY_MAGIC.to_be_bytes());
        assert_eq!(&out[4..6], &REPLY_FLAG_DONE.to_be_bytes());
        assert_eq!(&out[6..8], &REPLY_TYPE_BLOCK_STATUS.to_be_bytes());
        assert_eq!(&out[8..16], &7u64.to_be_bytes());
        assert_eq!(
            &out[16..20],
            &(4u32 + 3 * 8).to_be_bytes(),
            "context id + 3 descriptors"
        );
        assert_eq!(&out[20..24], &1u32.to_be_bytes());
        let mut d = [0u8; 8];
        put_descriptor(&mut d, 4096, HOLE);
        assert_eq!(d, [0, 0, 16, 0, 0, 0, 0, 3]);
    }
}
