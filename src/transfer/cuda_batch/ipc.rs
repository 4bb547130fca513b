//! CUDA IPC of the cuda-batch transport: a prefill rank's pool exported ([`export`]) and a
//! peer's export mapped into this process ([`PeerMapping`], closed on drop), after
//! [`check_export`]'s refusals.
#![allow(unsafe_code, reason = "CUDA IPC export, open and close of the cuda-batch transport")]

use std::ffi::c_char;
use std::sync::Arc;

use cudarc::driver::sys;

use super::driver::call;
use super::error::CudaBatchError;
use super::pack::Span;
use super::peer::{IPC_HANDLE_BYTES, check_export, machine_id};
use crate::transfer::cuda::{CudaBuffer, CudaDevice};
use crate::transfer::handshake::meta::CudaIpcExport;
use crate::transfer::ucx::Registrable as _;

/// Exports `buf` (a whole `cuMemAlloc` allocation) for CUDA IPC.
pub fn export(buf: &CudaBuffer) -> Result<CudaIpcExport, CudaBatchError> {
    let _cur = buf.cuda_device().scoped()?;
    let mut handle = sys::CUipcMemHandle { reserved: [0; IPC_HANDLE_BYTES] };
    // SAFETY: `buf.addr()` is the base of a live cuMemAlloc allocation of the current
    // context (`CudaBuffer` owns it until Drop); `handle` is a valid out pointer.
    call("cuIpcGetMemHandle", unsafe { sys::cuIpcGetMemHandle(&mut handle, buf.addr()).result() })?;
    Ok(CudaIpcExport {
        handle: handle.reserved.iter().map(|&c| c as u8).collect(),
        base_addr: buf.addr(),
        len: buf.len() as u64,
        device: buf.device(),
        machine_id: machine_id(),
        pid: std::process::id(),
    })
}

/// A peer's exported pool, mapped into this process with `cuIpcOpenMemHandle` (lazy peer
/// access, so it works across devices that can reach each other) and closed on drop.
pub struct PeerMapping {
    ptr: sys::CUdeviceptr,
    len: u64,
    peer: String,
    // Closed while its device is still held.
    dev: Arc<CudaDevice>,
}

impl std::fmt::Debug for PeerMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerMapping")
            .field("peer", &self.peer)
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl PeerMapping {
    /// Opens `peer`'s export on `dev`, after [`check_export`]'s refusals (none
    /// advertised, another machine, this process). The mapping's length is what CUDA
    /// says the allocation spans, never more than advertised: a copy past it would fault
    /// the GPU context, which no error recovers from.
    pub fn open(
        dev: &Arc<CudaDevice>,
        peer: &str,
        export: Option<&CudaIpcExport>,
    ) -> Result<Arc<PeerMapping>, CudaBatchError> {
        let e = check_export(peer, export)?;
        let _cur = dev.scoped()?;
        let mut handle = sys::CUipcMemHandle { reserved: [0; IPC_HANDLE_BYTES] };
        for (d, &b) in handle.reserved.iter_mut().zip(&e.handle) {
            *d = b as c_char;
        }
        let mut ptr: sys::CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint;
        // SAFETY: `handle` holds 64 bytes of a peer's cuIpcGetMemHandle (length checked);
        // the driver validates it and fails cleanly on a stale or foreign one; `ptr` is a
        // valid out pointer; this device's context is current.
        unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, handle, flags).result() }
            .map_err(|err| CudaBatchError::Open { peer: peer.to_string(), reason: err.to_string() })?;
        // From here the mapping is owned: closed on every path below by Drop.
        let mut mapping = PeerMapping { ptr, len: 0, peer: peer.to_string(), dev: Arc::clone(dev) };
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: `ptr` was just mapped in the current context; valid out pointers.
        call("cuMemGetAddressRange", unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr).result()
        })?;
        let mapped = (base + size as u64).saturating_sub(ptr);
        if mapped < e.len {
            tracing::warn!(
                "{peer} advertises a {}-byte pool but CUDA maps {mapped} bytes of it; using {mapped}",
                e.len
            );
        }
        mapping.len = e.len.min(mapped);
        Ok(Arc::new(mapping))
    }

    /// The mapped pool as the packer sees it.
    pub fn span(&self) -> Span {
        Span { base: self.ptr, len: self.len }
    }
}

impl Drop for PeerMapping {
    fn drop(&mut self) {
        let cur = self.dev.scoped();
        if let Err(e) = &cur {
            tracing::warn!("closing {}'s CUDA IPC mapping without its context current: {e}", self.peer);
        }
        // SAFETY: `ptr` came from cuIpcOpenMemHandle and is closed once; copies that read
        // it hold this mapping (`BatchCopier::in_flight`) until their stream drained.
        if let Err(e) = unsafe { sys::cuIpcCloseMemHandle(self.ptr).result() } {
            tracing::warn!("cuIpcCloseMemHandle of {}'s pool failed: {e}", self.peer);
        }
        drop(cur);
    }
}
