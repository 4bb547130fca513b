//! CUDA for kvx: a device's primary context, retained once per process and made current
//! before UCX starts; device memory that CUDA IPC can export; staged copies of byte ranges
//! between host and device; the device-to-device copy that is `kvx xfer`'s ceiling for
//! device memory and, at a fixed size, the device's bandwidth; and what the driver (and NVML) say about the devices, for `kvx doctor`.
//!
//! Owns: every CUDA driver and NVML call in kvx but those of the cuda-batch transport (IPC
//! export and mapping, batched copies: `cuda_batch`, which borrows this module's devices and
//! buffers). Must not call UCX: the UCX context holds
//! an `Arc<CudaDevice>` (see `ucx::ContextOptions::cuda_device`) so that the CUDA context
//! is current before `ucp_init` and outlives `ucp_cleanup`.
//!
//! Why these choices (measured on an H100 with UCX 1.22, see the project's GPU notes):
//! - Allocation is a plain `cuMemAlloc`. Memory from the stream-ordered pool
//!   (`cuMemAllocAsync`, what cudarc's `alloc_zeros` uses on Hopper) cannot be exported by
//!   legacy CUDA IPC, and UCX then moves it by software emulation. `cuMemCreate` with
//!   exportable handles would also work, but needs granularity rounding and explicit
//!   mapping and access calls for no gain here: UCX's cuda_ipc exports `cuMemAlloc` memory
//!   with `cuIpcGetMemHandle` directly.
//! - The primary context (not a private one) is used, because UCX looks up the context of
//!   a pointer and the current context; a process-wide registry hands out one
//!   `Arc<CudaDevice>` per device, so every buffer and every UCX context share it, and
//!   keeps it for the life of the process (released and retained again while UCX still
//!   caches handles from the first one, it gave IO errors or wrong bytes).
//!
//! cudarc loads libcuda at run time and panics when it is absent, so every entry point
//! checks `is_culib_present` first. Built without the `cuda` feature the same API exists
//! and every entry point returns [`CudaError::NotBuilt`].
#![allow(unsafe_code, reason = "CUDA driver and NVML calls: device memory kvx registers with UCX")]

#[cfg(any(feature = "cuda", test))]
use std::ops::Range;

use serde::Serialize;

/// What can go wrong with CUDA, each naming what is missing and how to get it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    #[error(
        "--mem cuda needs CUDA support, but this kvx was built without the `cuda` feature: rebuild with \
         `cargo build --release` (cuda is a default feature) or `--features cuda`"
    )]
    NotBuilt,
    #[error(
        "--mem cuda needs the NVIDIA driver, but libcuda.so could not be loaded on this host: install the \
         driver (or run on a GPU host); --mem host works without it"
    )]
    NoDriver,
    #[error("--device {device} does not exist: this host has {count} CUDA device(s); pick one below {count}")]
    NoDevice { device: u32, count: u32 },
    #[error("--mem cuda needs a CUDA device, but the driver reports none on this host")]
    NoDevices,
    #[error("cannot allocate an empty device buffer (change --working-set or the region size)")]
    Empty,
    #[error("byte range {start}..{end} is outside the {len}-byte device buffer")]
    Range { start: u64, end: u64, len: usize },
    #[error("CUDA {op} failed: {reason}")]
    Call { op: &'static str, reason: String },
}

/// The driver and its devices, as `kvx doctor` reports them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DriverInfo {
    /// `cuDriverGetVersion`, e.g. 13000 for CUDA 13.0.
    pub version: i32,
    pub devices: Vec<DeviceInfo>,
    /// Ordered pairs `(a, b)` where device `a` can access device `b` directly
    /// (`cuDeviceCanAccessPeer`: NVLink or PCIe peer-to-peer).
    pub peer_access: Vec<(u32, u32)>,
}

impl DriverInfo {
    /// `13.0` from 13000.
    pub fn version_string(&self) -> String {
        format!("{}.{}", self.version / 1000, (self.version % 1000) / 10)
    }
}

/// One CUDA device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceInfo {
    pub ordinal: u32,
    pub name: String,
    pub total_mem_bytes: u64,
}

/// Checks a list of byte ranges against a buffer of `len` bytes.
#[cfg(any(feature = "cuda", test))]
fn check_ranges(ranges: &[Range<u64>], len: usize) -> Result<(), CudaError> {
    match ranges.iter().find(|r| r.start > r.end || r.end > len as u64) {
        Some(r) => Err(CudaError::Range { start: r.start, end: r.end, len }),
        None => Ok(()),
    }
}

/// Splits `ranges` into consecutive groups whose bytes add up to at most `cap` (a range
/// larger than `cap` is a group of its own): one staging buffer's worth per group.
#[cfg(any(feature = "cuda", test))]
fn staging_groups(ranges: &[Range<u64>], cap: u64) -> Vec<Range<usize>> {
    let mut groups = Vec::new();
    let (mut start, mut bytes) = (0usize, 0u64);
    for (i, r) in ranges.iter().enumerate() {
        let n = r.end - r.start;
        if i > start && bytes + n > cap {
            groups.push(start..i);
            start = i;
            bytes = 0;
        }
        bytes += n;
    }
    if start < ranges.len() {
        groups.push(start..ranges.len());
    }
    groups
}

/// One copy between device memory and packed staging: `len` bytes at device offset `dev`
/// and staging offset `staged`.
#[cfg(any(feature = "cuda", test))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CopyRun {
    dev: u64,
    staged: usize,
    len: usize,
}

/// The copies that move `ranges` (packed one after another in staging): ranges that follow
/// each other in device memory too are one copy, so a pool's blocks cost one
/// `cuMemcpy*Async` per contiguous run (each call costs microseconds), not one per block.
#[cfg(any(feature = "cuda", test))]
fn copy_runs(ranges: &[Range<u64>]) -> Vec<CopyRun> {
    let mut runs: Vec<CopyRun> = Vec::new();
    let mut staged = 0usize;
    for r in ranges {
        let len = (r.end - r.start) as usize;
        match runs.last_mut() {
            Some(last) if last.dev + last.len as u64 == r.start => last.len += len,
            _ => runs.push(CopyRun { dev: r.start, staged, len }),
        }
        staged += len;
    }
    runs.retain(|c| c.len > 0);
    runs
}

/// Each range of `group` (indices into `ranges`) with the place of its bytes in staging,
/// where the group's ranges lie packed one after another (as [`copy_runs`] moves them).
#[cfg(any(feature = "cuda", test))]
fn packed(ranges: &[Range<u64>], group: Range<usize>) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
    let mut off = 0usize;
    group.map(move |i| {
        let n = (ranges[i].end - ranges[i].start) as usize;
        off += n;
        (i, off - n..off)
    })
}

/// Most pinned host memory one buffer keeps for staging its range copies.
pub const STAGING_BYTES: u64 = 64 << 20;

#[cfg(feature = "cuda")]
pub use imp::Pinned;
pub use imp::{CudaBuffer, CudaDevice, device_count, driver_info, dtod_copy_gbps};

/// The bytes of [`device_bandwidth_gbps`]'s copy: well above an H100's or H200's L2 (50-60 MB),
/// so the copy measures device memory, not the cache.
pub const DEVICE_BANDWIDTH_BYTES: u64 = 256 << 20;

/// The device's copy bandwidth, GB/s: one `cuMemcpyDtoDAsync` of [`DEVICE_BANDWIDTH_BYTES`]
/// between two buffers on `device`, repeated for at least `min_time`. The ceiling of any
/// transport between ranks on that GPU, however it posts its copies (`kvx bench`'s
/// calibration records it).
pub fn device_bandwidth_gbps(device: u32, min_time: std::time::Duration) -> Result<f64, CudaError> {
    let dev = CudaDevice::open(device)?;
    let len = DEVICE_BANDWIDTH_BYTES as usize;
    let src = CudaBuffer::alloc(&dev, len)?;
    let mut dst = CudaBuffer::alloc(&dev, len)?;
    dtod_copy_gbps(&src, &mut dst, DEVICE_BANDWIDTH_BYTES, 1, true, min_time, 3)
}

#[cfg(feature = "cuda")]
mod imp {
    use std::ops::Range;
    use std::ptr::NonNull;
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use cudarc::driver::{CudaContext, CudaStream, result, sys};

    use super::{
        CudaError, DeviceInfo, DriverInfo, STAGING_BYTES, check_ranges, copy_runs, packed, staging_groups,
    };
    use crate::transfer::ucx::{MemType, Registrable};

    fn driver() -> Result<(), CudaError> {
        // SAFETY: only tries to dlopen libcuda and reports whether that worked; no CUDA
        // function is called, so this is sound with or without a driver installed.
        if unsafe { sys::is_culib_present() } { Ok(()) } else { Err(CudaError::NoDriver) }
    }

    fn call<T>(op: &'static str, r: Result<T, result::DriverError>) -> Result<T, CudaError> {
        r.map_err(|e| CudaError::Call { op, reason: e.to_string() })
    }

    /// Number of CUDA devices the driver reports.
    pub fn device_count() -> Result<u32, CudaError> {
        driver()?;
        call("cuInit", result::init())?;
        Ok(call("cuDeviceGetCount", result::device::get_count())?.max(0) as u32)
    }

    /// Driver version, devices and peer access.
    pub fn driver_info() -> Result<DriverInfo, CudaError> {
        let count = device_count()?;
        let mut version: std::ffi::c_int = 0;
        // SAFETY: the driver is loaded and initialised (device_count); valid out pointer.
        call("cuDriverGetVersion", unsafe { sys::cuDriverGetVersion(&mut version).result() })?;
        let mut devices = Vec::new();
        let mut handles = Vec::new();
        for ordinal in 0..count {
            let dev = call("cuDeviceGet", result::device::get(ordinal as i32))?;
            handles.push(dev);
            // SAFETY: `dev` is a valid device handle from cuDeviceGet.
            let total = call("cuDeviceTotalMem", unsafe { result::device::total_mem(dev) })?;
            devices.push(DeviceInfo {
                ordinal,
                name: call("cuDeviceGetName", result::device::get_name(dev))?,
                total_mem_bytes: total as u64,
            });
        }
        let mut peer_access = Vec::new();
        for (a, &da) in handles.iter().enumerate() {
            for (b, &db) in handles.iter().enumerate() {
                if a == b {
                    continue;
                }
                let mut can: std::ffi::c_int = 0;
                // SAFETY: two valid device handles and a valid out pointer.
                call("cuDeviceCanAccessPeer", unsafe {
                    sys::cuDeviceCanAccessPeer(&mut can, da, db).result()
                })?;
                if can != 0 {
                    peer_access.push((a as u32, b as u32));
                }
            }
        }
        Ok(DriverInfo { version, devices, peer_access })
    }

    /// One device's primary CUDA context, retained once and kept for the life of the
    /// process. [`CudaDevice::open`] hands out one shared instance per device.
    #[derive(Debug)]
    pub struct CudaDevice {
        ordinal: u32,
        ctx: Arc<CudaContext>,
    }

    /// Devices opened in this process, held for the life of the process. The GPU notes'
    /// experiment got `UCS_ERR_IO_ERROR` or wrong bytes when the primary context was released
    /// and retained again while UCX (its cuda_ipc handle cache, its memory-type cache) still
    /// knew addresses from the first one; a primary context costs nothing to keep.
    static OPEN: Mutex<Vec<(u32, Arc<CudaDevice>)>> = Mutex::new(Vec::new());

    impl CudaDevice {
        /// Retains device `ordinal`'s primary context (once per process) and makes it
        /// current on the calling thread.
        pub fn open(ordinal: u32) -> Result<Arc<CudaDevice>, CudaError> {
            let count = device_count()?;
            if count == 0 {
                return Err(CudaError::NoDevices);
            }
            if ordinal >= count {
                return Err(CudaError::NoDevice { device: ordinal, count });
            }
            let mut open = OPEN.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(dev) = open.iter().find(|(o, _)| *o == ordinal).map(|(_, d)| Arc::clone(d)) {
                dev.make_current()?;
                return Ok(dev);
            }
            // CudaContext::new retains the primary context and binds it to this thread.
            let ctx = call("cuDevicePrimaryCtxRetain", CudaContext::new(ordinal as usize))?;
            let dev = Arc::new(CudaDevice { ordinal, ctx });
            open.push((ordinal, Arc::clone(&dev)));
            Ok(dev)
        }

        pub fn ordinal(&self) -> u32 {
            self.ordinal
        }

        /// Makes this device's context current on the calling thread (every thread that
        /// calls UCX on device memory needs it).
        pub fn make_current(&self) -> Result<(), CudaError> {
            call("cuCtxSetCurrent", self.ctx.bind_to_thread())
        }

        pub fn name(&self) -> Result<String, CudaError> {
            call("cuDeviceGetName", self.ctx.name())
        }

        /// Makes this context current until the guard drops, then restores what was
        /// current before (so a copy on one device does not leave another device's UCX
        /// context without its CUDA context). The cuda-batch transport uses it too.
        pub(crate) fn scoped(&self) -> Result<Scoped, CudaError> {
            let cur = call("cuCtxGetCurrent", result::ctx::get_current())?;
            let mine = self.ctx.cu_ctx();
            if cur == Some(mine) {
                return Ok(Scoped { restore: None });
            }
            // SAFETY: `mine` is a primary context retained by `self.ctx` for as long as
            // `self` lives, which outlives the guard's use here.
            call("cuCtxSetCurrent", unsafe { result::ctx::set_current(mine) })?;
            Ok(Scoped { restore: Some(cur.unwrap_or(std::ptr::null_mut())) })
        }
    }

    /// A context made current by [`CudaDevice::scoped`], restored on drop.
    pub(crate) struct Scoped {
        restore: Option<sys::CUcontext>,
    }

    impl Drop for Scoped {
        fn drop(&mut self) {
            if let Some(prev) = self.restore {
                // SAFETY: `prev` was current on this thread when the guard was made (or
                // null: nothing was), and nothing in between released it.
                if let Err(e) = unsafe { result::ctx::set_current(prev) } {
                    tracing::warn!("restoring the current CUDA context failed: {e}");
                }
            }
        }
    }

    /// Pinned (page-locked) host memory for staging copies.
    pub struct Pinned {
        ptr: NonNull<u8>,
        len: usize,
    }

    // SAFETY: plain host memory exclusively owned by this value.
    unsafe impl Send for Pinned {}

    impl Pinned {
        /// `len` bytes of page-locked memory (page-aligned); a context must be current.
        pub fn alloc(len: usize) -> Result<Pinned, CudaError> {
            // SAFETY: called with a context current (CudaBuffer's scoped guard); the memory
            // is freed in Drop.
            let p = call("cuMemHostAlloc", unsafe { result::malloc_host(len.max(1), 0) })?;
            let ptr = NonNull::new(p.cast::<u8>())
                .ok_or(CudaError::Call { op: "cuMemHostAlloc", reason: "returned NULL".into() })?;
            Ok(Pinned { ptr, len })
        }

        fn bytes(&mut self, range: Range<usize>) -> &mut [u8] {
            // SAFETY: `len` bytes allocated for the lifetime of `self`, exclusively
            // borrowed; callers pass ranges within `len` (sized by `staging`).
            unsafe { &mut std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len)[range] }
        }

        /// The memory as u64 words (`len / 8` of them).
        pub fn words(&mut self) -> &mut [u64] {
            // SAFETY: cuMemHostAlloc returns page-aligned memory, so u64-aligned; `len / 8`
            // whole words lie inside the allocation, exclusively borrowed; any bit pattern
            // is a valid u64.
            unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast::<u64>(), self.len / 8) }
        }
    }

    impl Drop for Pinned {
        fn drop(&mut self) {
            // SAFETY: frees the allocation from cuMemHostAlloc exactly once.
            if let Err(e) = unsafe { result::free_host(self.ptr.as_ptr().cast()) } {
                tracing::warn!("cuMemFreeHost of {} bytes failed: {e}", self.len);
            }
        }
    }

    /// Device memory from `cuMemAlloc` (exportable by CUDA IPC), owned by kvx.
    pub struct CudaBuffer {
        ptr: sys::CUdeviceptr,
        len: usize,
        stream: Arc<CudaStream>,
        staging: Mutex<Option<Pinned>>,
        // Released after the memory is freed (Drop runs first).
        dev: Arc<CudaDevice>,
    }

    impl std::fmt::Debug for CudaBuffer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("CudaBuffer")
                .field("device", &self.dev.ordinal)
                .field("ptr", &format_args!("{:#x}", self.ptr))
                .field("len", &self.len)
                .finish()
        }
    }

    impl CudaBuffer {
        /// Allocates `len` zeroed bytes on `dev` with `cuMemAlloc`.
        pub fn alloc(dev: &Arc<CudaDevice>, len: usize) -> Result<CudaBuffer, CudaError> {
            if len == 0 {
                return Err(CudaError::Empty);
            }
            let _cur = dev.scoped()?;
            let stream = call("cuStreamCreate", dev.ctx.new_stream())?;
            // SAFETY: a plain allocation in the current context (this device's primary
            // context); owned by the value built right below, which frees it in Drop.
            let ptr = call("cuMemAlloc", unsafe { result::malloc_sync(len) })?;
            let buf = CudaBuffer { ptr, len, stream, staging: Mutex::new(None), dev: dev.clone() };
            // Zeroed on the buffer's own stream, and waited for. (cuMemsetD8 would run on the
            // legacy stream, which does not order with kvx's non-blocking streams and returns
            // before the memory is written: a first copy into the buffer could be zeroed
            // after it landed. Seen on an H100: a warm-up read that failed verification.)
            // SAFETY: zeroes exactly the `len` bytes just allocated, on a stream of this
            // context; the synchronize below ends it before the buffer is used.
            call("cuMemsetD8Async", unsafe { result::memset_d8_async(ptr, 0, len, buf.stream.cu_stream()) })?;
            buf.sync("cuStreamSynchronize")?;
            Ok(buf)
        }

        pub fn device(&self) -> u32 {
            self.dev.ordinal
        }

        pub fn cuda_device(&self) -> &Arc<CudaDevice> {
            &self.dev
        }

        pub fn len(&self) -> usize {
            self.len
        }

        pub fn is_empty(&self) -> bool {
            self.len == 0
        }

        fn sync(&self, op: &'static str) -> Result<(), CudaError> {
            // SAFETY: the stream belongs to this buffer's context, which is current.
            call(op, unsafe { result::stream::synchronize(self.stream.cu_stream()) })
        }

        /// Lends the staging buffer, grown to at least `len` bytes.
        fn staging(slot: &mut Option<Pinned>, len: usize) -> Result<&mut Pinned, CudaError> {
            if slot.as_ref().is_none_or(|p| p.len < len) {
                *slot = None;
                *slot = Some(Pinned::alloc(len)?);
            }
            slot.as_mut().ok_or(CudaError::Call { op: "staging", reason: "no buffer".into() })
        }

        /// Runs `each` over `ranges` one staging buffer's worth at a time (a group of
        /// consecutive indices), with pinned staging that holds the group's bytes packed
        /// ([`packed`]). Checks every range against the buffer first; the buffer's context is
        /// current throughout.
        fn staged(
            &self,
            ranges: &[Range<u64>],
            mut each: impl FnMut(Range<usize>, &mut Pinned) -> Result<(), CudaError>,
        ) -> Result<(), CudaError> {
            check_ranges(ranges, self.len)?;
            let _cur = self.dev.scoped()?;
            let mut slot = self.staging.lock().unwrap_or_else(|p| p.into_inner());
            for group in staging_groups(ranges, STAGING_BYTES) {
                let total: u64 = ranges[group.clone()].iter().map(|r| r.end - r.start).sum();
                each(group, Self::staging(&mut slot, total as usize)?)?;
            }
            Ok(())
        }

        /// Writes byte ranges of the buffer: `fill(i, bytes)` fills range `i` in pinned
        /// host staging, then one batch of `cuMemcpyHtoDAsync` per staging buffer's worth
        /// of ranges moves them, with one synchronize per batch.
        pub fn write_ranges(
            &mut self,
            ranges: &[Range<u64>],
            mut fill: impl FnMut(usize, &mut [u8]),
        ) -> Result<(), CudaError> {
            self.staged(ranges, |group, pinned| {
                for (i, at) in packed(ranges, group.clone()) {
                    fill(i, pinned.bytes(at));
                }
                for run in copy_runs(&ranges[group]) {
                    let src = pinned.bytes(run.staged..run.staged + run.len);
                    // SAFETY: a run spans ranges checked to lie inside this allocation; the
                    // source is pinned staging that is not touched again until the
                    // synchronize below.
                    call("cuMemcpyHtoDAsync", unsafe {
                        result::memcpy_htod_async(self.ptr + run.dev, &*src, self.stream.cu_stream())
                    })?;
                }
                self.sync("cuStreamSynchronize")
            })
        }

        /// Reads byte ranges of the buffer: batches of `cuMemcpyDtoHAsync` into pinned
        /// staging, one synchronize per batch, then `visit(i, bytes)` for each range.
        pub fn read_ranges(
            &self,
            ranges: &[Range<u64>],
            mut visit: impl FnMut(usize, &[u8]),
        ) -> Result<(), CudaError> {
            self.staged(ranges, |group, pinned| {
                for run in copy_runs(&ranges[group.clone()]) {
                    let dst = pinned.bytes(run.staged..run.staged + run.len);
                    // SAFETY: a run spans ranges checked to lie inside this allocation; the
                    // destination is pinned staging not read until the synchronize.
                    call("cuMemcpyDtoHAsync", unsafe {
                        result::memcpy_dtoh_async(dst, self.ptr + run.dev, self.stream.cu_stream())
                    })?;
                }
                self.sync("cuStreamSynchronize")?;
                for (i, at) in packed(ranges, group) {
                    visit(i, pinned.bytes(at));
                }
                Ok(())
            })
        }
    }

    impl Drop for CudaBuffer {
        fn drop(&mut self) {
            let cur = self.dev.scoped();
            if let Err(e) = &cur {
                tracing::warn!("freeing device memory without its context current: {e}");
            }
            self.staging.get_mut().unwrap_or_else(|p| p.into_inner()).take();
            // SAFETY: `ptr` came from cuMemAlloc in this device's context and is freed
            // once; a `MemRegion` unregisters before it drops its memory, so UCX no longer
            // refers to it, and every copy on the stream was synchronized.
            if let Err(e) = unsafe { result::free_sync(self.ptr) } {
                tracing::warn!("cuMemFree of {} bytes failed: {e}", self.len);
            }
            drop(cur);
        }
    }

    // SAFETY: a cuMemAlloc allocation has a fixed device address until `cuMemFree` in
    // Drop; moving the value does not move it and nothing else frees it.
    unsafe impl Registrable for CudaBuffer {
        fn addr(&self) -> u64 {
            self.ptr
        }
        fn len(&self) -> usize {
            self.len
        }
        fn mem_type(&self) -> MemType {
            MemType::Cuda
        }
    }

    /// A device-to-device copy over the same working set as a transfer: batches of
    /// `inflight` `cuMemcpyDtoDAsync` of `size` bytes on one stream, each batch followed
    /// by a synchronize (as a batch of GETs waits for its last completion), rotating over
    /// the buffers unless `hot`; at least `min_batches` batches and `min_time`. GB/s.
    pub fn dtod_copy_gbps(
        src: &CudaBuffer,
        dst: &mut CudaBuffer,
        size: u64,
        inflight: usize,
        hot: bool,
        min_time: Duration,
        min_batches: u64,
    ) -> Result<f64, CudaError> {
        if src.dev.ordinal != dst.dev.ordinal {
            return Err(CudaError::Call {
                op: "device copy",
                reason: "source and destination are on different devices".into(),
            });
        }
        let slots = (src.len.min(dst.len) as u64 / size.max(1)).max(1);
        check_ranges(&[Range { start: 0, end: size }], src.len.min(dst.len))?;
        let _cur = dst.dev.scoped()?;
        let stream = dst.stream.cu_stream();
        let offset = |k: u64| if hot { 0 } else { (k % slots) * size };
        let mut k: u64 = 0;
        let batch = |k: &mut u64| -> Result<(), CudaError> {
            for _ in 0..inflight.max(1) {
                // Different slots for source and destination, as a GET's offsets are.
                let (s, d) = (offset(*k), offset(*k + slots / 2));
                // SAFETY: both ranges lie inside their allocations (offsets are below
                // `slots * size` <= len), on this device, ordered on one stream.
                call("cuMemcpyDtoDAsync", unsafe {
                    result::memcpy_dtod_async(dst.ptr + d, src.ptr + s, size as usize, stream)
                })?;
                *k += 1;
            }
            // SAFETY: the stream belongs to the current context.
            call("cuStreamSynchronize", unsafe { result::stream::synchronize(stream) })
        };
        for _ in 0..3 {
            batch(&mut k)?;
        }
        let start = Instant::now();
        let mut batches = 0u64;
        while batches < min_batches.max(1)
            || (start.elapsed() < min_time && crate::interrupt::requested().is_none())
        {
            batch(&mut k)?;
            batches += 1;
        }
        let secs = start.elapsed().as_secs_f64();
        Ok((batches * inflight.max(1) as u64 * size) as f64 / secs / 1e9)
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    //! Built without the `cuda` feature: the types exist (so callers need no `cfg`) but
    //! cannot be constructed; every constructor says how to get CUDA support.
    use std::convert::Infallible;
    use std::ops::Range;
    use std::sync::Arc;
    use std::time::Duration;

    use super::{CudaError, DriverInfo};
    use crate::transfer::ucx::{MemType, Registrable};

    pub fn device_count() -> Result<u32, CudaError> {
        Err(CudaError::NotBuilt)
    }

    pub fn driver_info() -> Result<DriverInfo, CudaError> {
        Err(CudaError::NotBuilt)
    }

    /// Never constructed without the `cuda` feature.
    #[derive(Debug)]
    pub struct CudaDevice {
        never: Infallible,
    }

    impl CudaDevice {
        pub fn open(_ordinal: u32) -> Result<Arc<CudaDevice>, CudaError> {
            Err(CudaError::NotBuilt)
        }
        pub fn ordinal(&self) -> u32 {
            match self.never {}
        }
        pub fn make_current(&self) -> Result<(), CudaError> {
            match self.never {}
        }
        pub fn name(&self) -> Result<String, CudaError> {
            match self.never {}
        }
    }

    /// Never constructed without the `cuda` feature.
    #[derive(Debug)]
    pub struct CudaBuffer {
        never: Infallible,
    }

    impl CudaBuffer {
        pub fn alloc(_dev: &Arc<CudaDevice>, _len: usize) -> Result<CudaBuffer, CudaError> {
            Err(CudaError::NotBuilt)
        }
        pub fn device(&self) -> u32 {
            match self.never {}
        }
        pub fn cuda_device(&self) -> &Arc<CudaDevice> {
            match self.never {}
        }
        pub fn len(&self) -> usize {
            match self.never {}
        }
        pub fn is_empty(&self) -> bool {
            match self.never {}
        }
        pub fn write_ranges(
            &mut self,
            _ranges: &[Range<u64>],
            _fill: impl FnMut(usize, &mut [u8]),
        ) -> Result<(), CudaError> {
            match self.never {}
        }
        pub fn read_ranges(
            &self,
            _ranges: &[Range<u64>],
            _visit: impl FnMut(usize, &[u8]),
        ) -> Result<(), CudaError> {
            match self.never {}
        }
    }

    // SAFETY: the type has no values, so no address is ever handed to UCX.
    unsafe impl Registrable for CudaBuffer {
        fn addr(&self) -> u64 {
            match self.never {}
        }
        fn len(&self) -> usize {
            match self.never {}
        }
        fn mem_type(&self) -> MemType {
            match self.never {}
        }
    }

    pub fn dtod_copy_gbps(
        src: &CudaBuffer,
        _dst: &mut CudaBuffer,
        _size: u64,
        _inflight: usize,
        _hot: bool,
        _min_time: Duration,
        _min_batches: u64,
    ) -> Result<f64, CudaError> {
        match src.never {}
    }
}

/// Active NVLink links per GPU (in NVML's device order), read with NVML
/// (`nvmlDeviceGetNvLinkState` over every link index). `Err` says why it is unknown
/// (no `libnvidia-ml.so.1`, NVML failed).
pub fn nvlink_active_links() -> Result<Vec<u32>, String> {
    nvml::active_links()
}

mod nvml {
    //! The few NVML calls the NVLink check needs, loaded at run time (NVML ships with the
    //! driver; there is no Rust crate for it that loads lazily without panicking).
    use std::ffi::{c_int, c_uint, c_void};

    use libloading::Library;

    type Device = *mut c_void;
    const SUCCESS: c_int = 0;
    /// `NVML_NVLINK_MAX_LINKS` of current NVML (18 on Hopper); indices past a device's
    /// links return an error, which ends the scan for that device.
    const MAX_LINKS: c_uint = 18;

    pub fn active_links() -> Result<Vec<u32>, String> {
        // SAFETY: loading NVML runs its library constructors, which have no preconditions.
        let lib = unsafe { Library::new("libnvidia-ml.so.1") }
            .map_err(|e| format!("NVML (libnvidia-ml.so.1) not loadable: {e}"))?;
        // SAFETY: the symbol types match NVML's C declarations (nvml.h): nvmlReturn_t is an
        // int enum, nvmlDevice_t an opaque pointer, nvmlEnableState_t an int enum.
        unsafe {
            let init = lib
                .get::<unsafe extern "C" fn() -> c_int>(b"nvmlInit_v2")
                .map_err(|e| format!("NVML: {e}"))?;
            let shutdown = lib
                .get::<unsafe extern "C" fn() -> c_int>(b"nvmlShutdown")
                .map_err(|e| format!("NVML: {e}"))?;
            let count = lib
                .get::<unsafe extern "C" fn(*mut c_uint) -> c_int>(b"nvmlDeviceGetCount_v2")
                .map_err(|e| format!("NVML: {e}"))?;
            let handle = lib
                .get::<unsafe extern "C" fn(c_uint, *mut Device) -> c_int>(b"nvmlDeviceGetHandleByIndex_v2")
                .map_err(|e| format!("NVML: {e}"))?;
            let state = lib
                .get::<unsafe extern "C" fn(Device, c_uint, *mut c_int) -> c_int>(b"nvmlDeviceGetNvLinkState")
                .map_err(|e| format!("NVML: {e}"))?;
            let rc = init();
            if rc != SUCCESS {
                return Err(format!("nvmlInit failed (NVML error {rc})"));
            }
            let mut n: c_uint = 0;
            let mut out = Vec::new();
            let rc = count(&mut n);
            if rc == SUCCESS {
                for i in 0..n {
                    let mut dev: Device = std::ptr::null_mut();
                    if handle(i, &mut dev) != SUCCESS {
                        out.push(0);
                        continue;
                    }
                    let mut active = 0u32;
                    for link in 0..MAX_LINKS {
                        let mut on: c_int = 0;
                        if state(dev, link, &mut on) != SUCCESS {
                            break;
                        }
                        if on != 0 {
                            active += 1;
                        }
                    }
                    out.push(active);
                }
            }
            shutdown();
            if rc != SUCCESS {
                return Err(format!("nvmlDeviceGetCount failed (NVML error {rc})"));
            }
            Ok(out)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_lays_a_group_out_back_to_back() {
        let ranges: Vec<Range<u64>> = vec![0..10, 100..130, 40..45];
        let got: Vec<(usize, Range<usize>)> = packed(&ranges, 1..3).collect();
        assert_eq!(got, vec![(1, 0..30), (2, 30..35)]);
        assert_eq!(packed(&ranges, 0..0).count(), 0);
    }

    #[test]
    fn staging_groups_cover_every_range_once_within_the_cap() {
        let ranges: Vec<Range<u64>> = vec![0..10, 10..30, 100..105, 200..260, 300..301];
        let groups = staging_groups(&ranges, 32);
        assert_eq!(groups, vec![0..2, 2..3, 3..4, 4..5]);
        let flat: Vec<usize> = groups.iter().flat_map(|g| g.clone()).collect();
        assert_eq!(flat, (0..ranges.len()).collect::<Vec<_>>());
        assert!(staging_groups(&[], 32).is_empty());
        assert_eq!(
            staging_groups(&[Range { start: 0, end: 100 }], 32),
            vec![0..1],
            "an oversized range is a group of its own"
        );
    }

    #[test]
    fn ranges_adjacent_in_device_memory_are_one_copy() {
        let ranges: Vec<Range<u64>> = vec![0..10, 10..30, 100..105, 105..105, 105..110, 50..60];
        assert_eq!(
            copy_runs(&ranges),
            vec![
                CopyRun { dev: 0, staged: 0, len: 30 },
                CopyRun { dev: 100, staged: 30, len: 10 },
                CopyRun { dev: 50, staged: 40, len: 10 },
            ]
        );
        // Out of order in device memory: no merge, even where the bytes touch backwards.
        assert_eq!(copy_runs(&[Range { start: 10, end: 20 }, Range { start: 0, end: 10 }]).len(), 2);
        assert!(copy_runs(&[]).is_empty());
    }

    #[test]
    fn ranges_are_checked_against_the_buffer() {
        assert!(check_ranges(&[0..4096, 4096..8192], 8192).is_ok());
        assert_eq!(
            check_ranges(&[Range { start: 0, end: 8193 }], 8192),
            Err(CudaError::Range { start: 0, end: 8193, len: 8192 })
        );
        assert!(check_ranges(&[Range { start: 10, end: 5 }], 8192).is_err());
    }

    #[test]
    fn without_a_gpu_cuda_says_what_is_missing() {
        // On a host with a GPU this test checks nothing: the entry points succeed there.
        if let Err(e) = device_count() {
            let msg = e.to_string();
            assert!(
                msg.contains("libcuda") || msg.contains("`cuda` feature") || msg.contains("CUDA"),
                "{msg}"
            );
            assert!(CudaDevice::open(0).is_err());
        }
    }

    #[test]
    fn driver_versions_format_as_major_minor() {
        let d = DriverInfo { version: 12080, devices: vec![], peer_access: vec![] };
        assert_eq!(d.version_string(), "12.8");
        let d = DriverInfo { version: 13000, devices: vec![], peer_access: vec![] };
        assert_eq!(d.version_string(), "13.0");
    }
}
