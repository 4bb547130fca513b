//! kvx's gather-copy kernel in a copier's context: `gather.ptx` JIT-compiled and loaded
//! ([`Gather::load`]), one descriptor array per batch in flight ([`Slot`]: pinned on the host,
//! and on the device), and one launch of the kernel ([`launch_gather`]).
#![allow(unsafe_code, reason = "CUDA module loading and kernel launches of the cuda-batch gather kernel")]

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{result, sys};

use super::driver::call;
use super::error::CudaBatchError;
use crate::transfer::cuda::{CudaBuffer, CudaDevice};

/// The gather-copy kernel's PTX, NUL-terminated for `cuModuleLoadData`.
const GATHER_PTX: &str = concat!(include_str!("../gather.ptx"), "\0");
/// Threads per block of the gather kernel: one block copies one piece (at most
/// [`GATHER_PIECE`](super::GATHER_PIECE) bytes), each thread four 16-byte units per step, so an 8 KiB piece is
/// one step with all its loads in flight before its stores. 256 threads doing one unit per
/// step read P8->D2 8 KiB blocks at 0.27x of an H200's device copy (results/gpu-nvidia-h200-2026-11-27.json).
const GATHER_THREADS: u32 = 128;
/// Most blocks one launch starts; the kernel's blocks loop over the pieces beyond.
pub(super) const GATHER_MAX_BLOCKS: usize = 1 << 20;
/// Threads per block of `kvx_grid_expand` (one descriptor each, then the grid's stride).
pub(super) const EXPAND_THREADS: u32 = 256;

/// One launch of `kvx_gather_copy(u64 descs, u64 count)` on `stream`: `count` descriptors
/// of three u64 from device address `descs`, one thread block per descriptor (the grid
/// loops beyond [`GATHER_MAX_BLOCKS`]).
///
/// # Safety
/// `func` is the gather kernel of the current context and `stream` one of its streams;
/// `descs` holds `count` descriptors by the time the launch runs in stream order, each
/// inside memory this context may read (source) and write (destination).
pub(super) unsafe fn launch_gather(
    func: sys::CUfunction,
    stream: sys::CUstream,
    descs: u64,
    count: usize,
) -> Result<(), CudaBatchError> {
    let (mut p_descs, mut p_count) = (descs, count as u64);
    let mut params = [(&raw mut p_descs).cast::<c_void>(), (&raw mut p_count).cast::<c_void>()];
    let blocks = count.clamp(1, GATHER_MAX_BLOCKS) as u32;
    // SAFETY: the kernel takes the two u64 `params` point to (read during the call); the
    // rest is the caller's promise.
    call("cuLaunchKernel", unsafe {
        result::launch_kernel(func, (blocks, 1, 1), (GATHER_THREADS, 1, 1), 0, stream, &mut params)
    })
}

/// kvx's gather-copy kernel, loaded into a copier's context, and one descriptor array per
/// batch that may be in flight at once.
pub(super) struct Gather {
    /// Unloaded once, in the copier's Drop.
    pub(super) module: sys::CUmodule,
    pub(super) func: sys::CUfunction,
    /// `kvx_grid_expand`: a grid batch's descriptors made on the device.
    pub(super) expand: sys::CUfunction,
    /// Slot `i` serves the `i`-th batch posted since the copier last waited, so a batch
    /// never writes descriptors that an earlier one's upload or kernel still reads.
    slots: Vec<Slot>,
}

/// One batch's descriptor array: pinned on the host (the upload is truly asynchronous, so
/// the host posts the next batch while this one copies) and in device memory.
pub(super) struct Slot {
    pub(super) host: crate::transfer::cuda::Pinned,
    pub(super) descs: CudaBuffer,
}

impl Slot {
    /// Room for `words` u64 on both sides; a context must be current.
    fn new(dev: &Arc<CudaDevice>, words: usize) -> Result<Slot, CudaBatchError> {
        let bytes = (words * 8).next_power_of_two().max(4096);
        Ok(Slot { host: crate::transfer::cuda::Pinned::alloc(bytes)?, descs: CudaBuffer::alloc(dev, bytes)? })
    }

    fn words(&self) -> usize {
        self.descs.len() / 8
    }
}

impl Gather {
    /// Slot `i` with room for `words` u64 (made or grown here). Slot `i` is free when the
    /// copier posts its `i`-th batch of a round: the batches before it use lower slots,
    /// and every earlier round has completed.
    pub(super) fn slot(
        &mut self,
        dev: &Arc<CudaDevice>,
        i: usize,
        words: usize,
    ) -> Result<&mut Slot, CudaBatchError> {
        if self.slots.len() <= i {
            self.slots.push(Slot::new(dev, words)?);
        } else if self.slots[i].words() < words {
            self.slots[i] = Slot::new(dev, words)?;
        }
        Ok(&mut self.slots[i])
    }

    /// JIT-compiles `gather.ptx` for this device (the current context's).
    pub(super) fn load() -> Result<Gather, CudaBatchError> {
        // SAFETY: a NUL-terminated PTX image that outlives the call; the module belongs to
        // the current context and is unloaded once, in the copier's Drop.
        let module =
            call("cuModuleLoadData", unsafe { result::module::load_data(GATHER_PTX.as_ptr().cast()) })?;
        // SAFETY: `module` was just loaded and is not unloaded before this returns.
        let funcs = unsafe { result::module::get_function(module, c"kvx_gather_copy".to_owned()) }.and_then(
            // SAFETY: as above.
            |func| {
                unsafe { result::module::get_function(module, c"kvx_grid_expand".to_owned()) }
                    .map(|e| (func, e))
            },
        );
        match funcs {
            Ok((func, expand)) => Ok(Gather { module, func, expand, slots: Vec::new() }),
            Err(e) => {
                // SAFETY: nothing uses the module: a function of it was not found.
                let _ = unsafe { result::module::unload(module) };
                Err(CudaBatchError::Call { op: "cuModuleGetFunction", reason: e.to_string() })
            }
        }
    }
}
