//! The CUDA driver calls every other file of the cuda-batch transport shares: a driver error
//! as [`CudaBatchError`], the driver's version, and the batch entry points looked up by name
//! (cudarc panics on a missing symbol; these exist only in some drivers).
#![allow(unsafe_code, reason = "CUDA driver symbol lookup and version query of the cuda-batch transport")]

use cudarc::driver::{result, sys};

use super::error::CudaBatchError;

pub(super) fn call<T>(op: &'static str, r: Result<T, result::DriverError>) -> Result<T, CudaBatchError> {
    r.map_err(|e| CudaBatchError::Call { op, reason: e.to_string() })
}

/// `cuMemcpyBatchAsync_v2` (cuda.h of CUDA 13.0).
pub(super) type BatchV2 = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    sys::CUstream,
) -> sys::CUresult;
/// `cuMemcpyBatchAsync` (cuda.h of CUDA 12.8: with `failIdx` before the stream).
pub(super) type BatchV1 = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    *mut usize,
    sys::CUstream,
) -> sys::CUresult;

/// A driver entry point looked up by name, `None` when this libcuda lacks it. cudarc's own
/// wrappers panic on a missing symbol, so version-specific functions are resolved here.
pub(super) fn lookup<F: Copy>(name: &[u8]) -> Option<F> {
    // SAFETY: callers hold an open `CudaDevice`, so libcuda is loaded (culib() does not
    // panic); `F` is the function type of the C declaration of `name` (the aliases above,
    // copied from cuda.h), and the library stays loaded for the life of the process.
    unsafe { sys::culib().get::<F>(name).ok().map(|sym| *sym) }
}

pub(super) fn driver_version() -> Result<i32, CudaBatchError> {
    let mut v: std::ffi::c_int = 0;
    // SAFETY: the driver is loaded and initialised (a device was opened); valid out pointer.
    call("cuDriverGetVersion", unsafe { sys::cuDriverGetVersion(&mut v).result() })?;
    Ok(v)
}
