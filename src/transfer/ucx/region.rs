//! Registered memory (`ucp_mem_map` / `ucp_mem_unmap`) and packed remote keys.
//!
//! A [`MemRegion`] owns the memory it registered, so the memory cannot be freed while UCX
//! may still touch it: dropping the region unregisters first, then frees. A region into
//! which a read was abandoned in flight (a timeout) is *poisoned*: its memory and
//! registration are leaked rather than freed under a transfer that may still land.

use std::mem::ManuallyDrop;

use serde::Serialize;
use sha2::Digest;

use super::context::Context;
use super::error::{Result, UcxError};
use super::sys::{self, UcpMemH};

/// Where the bytes of a region live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MemType {
    Host,
    Cuda,
}

impl MemType {
    /// `host` or `cuda`, as kvx's handshake metadata names a region's memory.
    pub fn as_str(self) -> &'static str {
        match self {
            MemType::Host => "host",
            MemType::Cuda => "cuda",
        }
    }

    fn ucs(self) -> libc::c_int {
        match self {
            MemType::Host => sys::UCS_MEMORY_TYPE_HOST,
            MemType::Cuda => sys::UCS_MEMORY_TYPE_CUDA,
        }
    }
}

impl std::fmt::Display for MemType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MemType::Host => "host",
            MemType::Cuda => "cuda",
        })
    }
}

/// Memory UCX may register.
///
/// # Safety
/// `addr()..addr()+len()` must be one allocation of `mem_type()` memory that stays
/// allocated, at the same address, for as long as the value exists (moving the value
/// must not move the memory), and nothing else may free it meanwhile.
pub unsafe trait Registrable {
    fn addr(&self) -> u64;
    fn len(&self) -> usize;
    fn mem_type(&self) -> MemType;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Memory that UCX allocated itself (`UCP_MEM_MAP_ALLOCATE`, `--ucx-alloc`). Only a
/// [`MemRegion`] can create one, and the memory lives exactly as long as that region.
#[derive(Debug)]
pub struct UcxAllocated {
    addr: u64,
    len: usize,
}

// SAFETY: the address and length come from ucp_mem_query on the region's own mapping,
// which the region unmaps only in its Drop, after which this value is gone too.
unsafe impl Registrable for UcxAllocated {
    fn addr(&self) -> u64 {
        self.addr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn mem_type(&self) -> MemType {
        MemType::Host
    }
}

impl UcxAllocated {
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: host memory of `len` bytes mapped by UCX for the lifetime of `self`.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes this the only Rust view of the bytes.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
    }
}

/// A registered region: memory `M` plus its `ucp_mem_h`.
pub struct MemRegion<M: Registrable> {
    ctx: Context,
    memh: UcpMemH,
    mem: ManuallyDrop<M>,
    addr: u64,
    len: usize,
    mem_type: MemType,
    poisoned: bool,
}

impl<M: Registrable> MemRegion<M> {
    /// Registers `mem` (without `UCP_MEM_MAP_ALLOCATE`: UCX maps the caller's memory).
    pub fn register(ctx: &Context, mem: M) -> Result<Self> {
        if mem.is_empty() {
            return Err(UcxError::Invalid("cannot register an empty region".into()));
        }
        if mem.mem_type() == MemType::Cuda && ctx.cuda_device().is_none() {
            return Err(UcxError::Invalid(
                "registering CUDA memory needs a UCX context created with ContextOptions::cuda_device (the \
                 CUDA context must be current before ucp_init, or UCX falls back to software emulation)"
                    .into(),
            ));
        }
        let mut params: sys::UcpMemMapParams = sys::zeroed();
        params.field_mask = sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
            | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
            | sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
        params.address = mem.addr() as *mut libc::c_void;
        params.length = mem.len();
        params.memory_type = mem.mem_type().ucs();
        let mut memh: UcpMemH = std::ptr::null_mut();
        // SAFETY: live context; `Registrable` guarantees the range is valid memory of the
        // stated type for as long as `mem` lives, and `mem` is moved into the region.
        let st = unsafe { (ctx.ucx().api().ucp_mem_map)(ctx.handle(), &params, &mut memh) };
        ctx.ucx().check("ucp_mem_map", st)?;
        let (addr, len, mem_type) = (mem.addr(), mem.len(), mem.mem_type());
        Ok(Self { ctx: ctx.clone(), memh, mem: ManuallyDrop::new(mem), addr, len, mem_type, poisoned: false })
    }

    /// The registered memory (read-only view).
    pub fn memory(&self) -> Result<&M> {
        if self.poisoned { Err(UcxError::Poisoned) } else { Ok(&self.mem) }
    }

    /// The registered memory, e.g. to fill it or to verify what a read brought.
    pub fn memory_mut(&mut self) -> Result<&mut M> {
        if self.poisoned { Err(UcxError::Poisoned) } else { Ok(&mut self.mem) }
    }

    /// Base address of the registration (what a peer adds its offsets to).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn mem_type(&self) -> MemType {
        self.mem_type
    }

    pub fn is_poisoned(&self) -> bool {
        self.poisoned
    }

    pub(super) fn poison(&mut self) {
        self.poisoned = true;
    }

    pub(super) fn memh(&self) -> UcpMemH {
        self.memh
    }

    /// Unregisters the memory and hands it back: a rank that stops serving UCX but keeps
    /// its cache (to serve it through another transport).
    pub fn deregister(self) -> Result<M> {
        if self.poisoned {
            return Err(UcxError::Poisoned);
        }
        let mut this = ManuallyDrop::new(self);
        // SAFETY: memh came from ucp_mem_map on this live context and is unmapped once;
        // `this` is never dropped, so Drop cannot unmap it again.
        let st = unsafe { (this.ctx.ucx().api().ucp_mem_unmap)(this.ctx.handle(), this.memh) };
        let checked = this.ctx.ucx().check("ucp_mem_unmap", st);
        // SAFETY: `mem` is taken exactly once and `this` is never dropped afterwards.
        let mem = unsafe { ManuallyDrop::take(&mut this.mem) };
        // SAFETY: the context handle is released exactly once here (Drop never runs for `this`).
        unsafe { std::ptr::drop_in_place(&mut this.ctx) };
        checked.map(|()| mem)
    }

    /// Packs the remote key a peer needs to read this region, in kvx's envelope.
    pub fn pack_rkey(&self) -> Result<PackedRkey> {
        let api = self.ctx.ucx().api();
        let mut buf: *mut libc::c_void = std::ptr::null_mut();
        let mut size: usize = 0;
        // SAFETY: live context and memh; valid out pointers.
        let st = unsafe { (api.ucp_rkey_pack)(self.ctx.handle(), self.memh, &mut buf, &mut size) };
        self.ctx.ucx().check("ucp_rkey_pack", st)?;
        let guard = RkeyBuffer { ctx: &self.ctx, buf };
        // SAFETY: UCX returned `size` readable bytes at `buf`, released by `guard` after the copy.
        let raw = unsafe { std::slice::from_raw_parts(guard.buf.cast::<u8>(), size) };
        Ok(PackedRkey::wrap(raw))
    }
}

impl MemRegion<UcxAllocated> {
    /// Lets UCX allocate and register `len` bytes of host memory (`UCP_MEM_MAP_ALLOCATE`).
    /// Shared-memory transports can map such memory directly, so numbers measured on it
    /// flatter what a KV cache in the user's own memory gets.
    pub fn allocate(ctx: &Context, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(UcxError::Invalid("cannot allocate an empty region".into()));
        }
        let api = ctx.ucx().api();
        let mut params: sys::UcpMemMapParams = sys::zeroed();
        params.field_mask = sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH | sys::UCP_MEM_MAP_PARAM_FIELD_FLAGS;
        params.length = len;
        params.flags = sys::UCP_MEM_MAP_ALLOCATE;
        let mut memh: UcpMemH = std::ptr::null_mut();
        // SAFETY: live context; params zeroed with an explicit mask; valid out pointer.
        ctx.ucx()
            .check("ucp_mem_map(ALLOCATE)", unsafe { (api.ucp_mem_map)(ctx.handle(), &params, &mut memh) })?;
        let mut attr: sys::UcpMemAttr = sys::zeroed();
        attr.field_mask = sys::UCP_MEM_ATTR_FIELD_ADDRESS | sys::UCP_MEM_ATTR_FIELD_LENGTH;
        // SAFETY: memh is live; attr zeroed with an explicit mask.
        let st = unsafe { (api.ucp_mem_query)(memh, &mut attr) };
        if let Err(e) = ctx.ucx().check("ucp_mem_query", st) {
            // SAFETY: memh came from ucp_mem_map above and is not used again.
            unsafe { (api.ucp_mem_unmap)(ctx.handle(), memh) };
            return Err(e);
        }
        let mem = UcxAllocated { addr: attr.address as u64, len: attr.length };
        Ok(Self {
            ctx: ctx.clone(),
            memh,
            addr: mem.addr,
            len: mem.len,
            mem: ManuallyDrop::new(mem),
            mem_type: MemType::Host,
            poisoned: false,
        })
    }
}

impl<M: Registrable> Drop for MemRegion<M> {
    fn drop(&mut self) {
        if self.poisoned {
            tracing::warn!(
                addr = self.addr,
                len = self.len,
                "leaking a registered region that an abandoned read may still write into"
            );
            // Keep the context alive too: cleaning it up with this registration in use aborts.
            std::mem::forget(self.ctx.clone());
            return;
        }
        // SAFETY: memh came from ucp_mem_map on this live context and is unmapped once.
        let st = unsafe { (self.ctx.ucx().api().ucp_mem_unmap)(self.ctx.handle(), self.memh) };
        if let Err(e) = self.ctx.ucx().check("ucp_mem_unmap", st) {
            tracing::warn!("{e}");
        }
        // SAFETY: `mem` is dropped exactly once, here, after UCX stopped referring to it.
        unsafe { ManuallyDrop::drop(&mut self.mem) };
    }
}

struct RkeyBuffer<'a> {
    ctx: &'a Context,
    buf: *mut libc::c_void,
}

impl Drop for RkeyBuffer<'_> {
    fn drop(&mut self) {
        // SAFETY: `buf` came from ucp_rkey_pack and is released once.
        unsafe { (self.ctx.ucx().api().ucp_rkey_buffer_release)(self.buf) };
    }
}

/// A packed remote key in kvx's envelope: `b"KVXR"`, `u32` LE length, the first 8 bytes
/// of SHA-256 of the UCX bytes, then the UCX bytes. UCX trusts its rkey bytes blindly
/// (garbage can crash `ucp_ep_rkey_unpack`), so the envelope rejects anything that was
/// not produced by [`MemRegion::pack_rkey`] before it reaches UCX.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedRkey {
    bytes: Vec<u8>,
}

const RKEY_MAGIC: &[u8; 4] = b"KVXR";
const RKEY_HEADER: usize = 4 + 4 + 8;
/// Largest UCX rkey kvx accepts (UCX's are tens to a few hundred bytes).
const RKEY_MAX: usize = 64 * 1024;

impl PackedRkey {
    fn wrap(raw: &[u8]) -> Self {
        let mut bytes = Vec::with_capacity(RKEY_HEADER + raw.len());
        bytes.extend_from_slice(RKEY_MAGIC);
        bytes.extend_from_slice(&(raw.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&sha2::Sha256::digest(raw)[..8]);
        bytes.extend_from_slice(raw);
        Self { bytes }
    }

    /// Checks an envelope received from a peer.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        if bytes.len() < RKEY_HEADER {
            return Err(UcxError::BadRkey(format!(
                "{} bytes is shorter than the {RKEY_HEADER}-byte header",
                bytes.len()
            )));
        }
        if &bytes[..4] != RKEY_MAGIC {
            return Err(UcxError::BadRkey("missing the KVXR magic".into()));
        }
        let len = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]) as usize;
        if len == 0 || len > RKEY_MAX || bytes.len() != RKEY_HEADER + len {
            return Err(UcxError::BadRkey(format!(
                "declared length {len} does not match the {} bytes received",
                bytes.len().saturating_sub(RKEY_HEADER)
            )));
        }
        let raw = &bytes[RKEY_HEADER..];
        if sha2::Sha256::digest(raw)[..8] != bytes[8..16] {
            return Err(UcxError::BadRkey("checksum mismatch (corrupted or not a kvx rkey)".into()));
        }
        Ok(Self { bytes: bytes.to_vec() })
    }

    /// The envelope, as sent to a peer.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }

    /// The UCX bytes inside the envelope.
    pub(super) fn raw(&self) -> &[u8] {
        &self.bytes[RKEY_HEADER..]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rkey_envelope_round_trips_and_rejects_damage() {
        let raw: Vec<u8> = (0u8..40).collect();
        let p = PackedRkey::wrap(&raw);
        assert_eq!(PackedRkey::from_bytes(p.as_bytes()).expect("valid").raw(), &raw[..]);
        let mut flipped = p.as_bytes().to_vec();
        *flipped.last_mut().expect("non-empty") ^= 1;
        assert!(
            matches!(PackedRkey::from_bytes(&flipped), Err(UcxError::BadRkey(m)) if m.contains("checksum"))
        );
        assert!(PackedRkey::from_bytes(&p.as_bytes()[..20]).is_err());
        assert!(PackedRkey::from_bytes(b"garbage garbage garbage").is_err());
        assert!(PackedRkey::from_bytes(&[]).is_err());
        let mut long = p.as_bytes().to_vec();
        long.push(0);
        assert!(PackedRkey::from_bytes(&long).is_err());
    }
}
