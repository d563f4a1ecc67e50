//! A connection's requests: a slab of them, keyed by [`ReqId`], with their
//! buffers recycled so steady state allocates nothing.
//!
//! A request's bytes that the kernel or a device reads or writes while it
//! is in flight (its reply header and its data buffer) live on the heap in
//! [`Bufs`], not in the slab: the slab may grow, and move its entries, while
//! a send or a bio still points at a request's header or data.

use std::ops::{Index, IndexMut};

use slab::Slab;
use udm_core::AlignedBuf;

use crate::front::FrontError;

use super::super::proto::{Command, Refusal, Request};

/// Bytes of a reply header (room for an error chunk with a short message).
pub(super) const HDR_LEN: usize = 96;
/// Bytes of data buffers a connection keeps for reuse once their requests
/// end (beyond them, buffers are freed): idle memory per connection, outside
/// the server's in-flight budget, so it is small. It holds the buffers of
/// 128 KiB requests at QD8.
pub(super) const SPARE_MAX: usize = 1 << 20;

/// A request's key in its connection's [`Reqs`].
pub(super) type ReqId = usize;

/// The heap memory of a request: its encoded reply header and its data.
pub(super) struct Bufs {
    pub hdr: Box<[u8; HDR_LEN]>,
    /// At least the request's length for READ and WRITE (grown, never
    /// shrunk while in use: a shrink-and-grow would zero it per request).
    pub data: AlignedBuf,
}

/// One request, from header to reply.
pub(super) struct Req {
    pub cookie: u64,
    pub cmd: Command,
    pub offset: u64,
    pub len: u32,
    /// WRITE payload bytes received so far.
    pub received: usize,
    pub result: Result<(), FrontError>,
    /// Refused by validation: the reply is this error.
    pub refusal: Option<Refusal>,
    /// Bytes counted against the connection's in-flight budget.
    pub counted: u64,
    pub hdr_len: usize,
    /// Bytes of data the reply carries after the header.
    pub data_len: usize,
    /// BLOCK_STATUS: descriptors encoded in the data buffer for the reply.
    pub descriptors: u32,
    /// The read's data lent by the device (null: it is in `bufs.data`). Set
    /// only from the bio's end_io to the end of its pass over completions;
    /// see `Conn::hold_lent`.
    pub lent: *const u8,
    pub bufs: Bufs,
}

impl Req {
    /// The data buffer, grown to hold `len` bytes.
    pub fn data_for(&mut self, len: usize) -> *mut u8 {
        if self.bufs.data.len() < len {
            self.bufs
                .data
                .resize(len.div_ceil(AlignedBuf::ALIGN) * AlignedBuf::ALIGN);
        }
        self.bufs.data.as_mut_ptr()
    }

    /// The data buffer's start (it holds at least `len` bytes for a READ
    /// or WRITE once `data_for` was called).
    pub fn data(&mut self) -> *mut u8 {
        self.bufs.data.as_mut_ptr()
    }

    /// The reply header's start.
    pub fn hdr(&mut self) -> *mut u8 {
        self.bufs.hdr.as_mut_ptr()
    }
}

/// The requests of one connection.
#[derive(Default)]
pub(super) struct Reqs {
    slab: Slab<Req>,
    /// Buffers of recycled requests, for the next ones.
    spare: Vec<Bufs>,
    /// Bytes of data buffers in `spare` (at most SPARE_MAX).
    spare_bytes: usize,
}

impl Reqs {
    /// A new request for header `h`, which `cmd` validated.
    pub fn alloc(&mut self, h: &Request, cmd: Command) -> ReqId {
        let bufs = match self.spare.pop() {
            Some(b) => {
                self.spare_bytes -= b.data.len();
                b
            }
            None => Bufs {
                hdr: Box::new([0; HDR_LEN]),
                data: AlignedBuf::default(),
            },
        };
        self.slab.insert(Req {
            cookie: h.cookie,
            cmd,
            offset: h.offset,
            len: h.len,
            received: 0,
            result: Ok(()),
            refusal: None,
            counted: 0,
            hdr_len: 0,
            data_len: 0,
            descriptors: 0,
            lent: std::ptr::null(),
            bufs,
        })
    }

    /// Ends request `id` (nothing may refer to its buffers any more) and
    /// returns the bytes it counted against the in-flight budget.
    pub fn recycle(&mut self, id: ReqId) -> u64 {
        let mut r = self.slab.remove(id);
        if self.spare_bytes + r.bufs.data.len() > SPARE_MAX {
            r.bufs.data = AlignedBuf::default();
        }
        self.spare_bytes += r.bufs.data.len();
        self.spare.push(r.bufs);
        r.counted
    }

    /// Requests not yet recycled.
    pub fn active(&self) -> usize {
        self.slab.len()
    }
}

impl Index<ReqId> for Reqs {
    type Output = Req;
    fn index(&self, id: ReqId) -> &Req {
        &self.slab[id]
    }
}

impl IndexMut<ReqId> for Reqs {
    fn index_mut(&mut self, id: ReqId) -> &mut Req {
        &mut self.slab[id]
    }
}
