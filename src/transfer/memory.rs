//! The memory a KV cache lives in: the user's own host allocation (page-aligned `mmap`,
//! optionally huge pages) or, with the `cuda` feature, CUDA device memory.
//!
//! Owns: allocating and freeing those buffers and declaring them [`Registrable`] with
//! their memory type. Must not call UCX: registration is `ucx::MemRegion`'s job, and
//! UCX-allocated memory (`--ucx-alloc`) lives in the UCX module, not here.
#![allow(unsafe_code, reason = "mmap/munmap of the host buffers kvx registers with UCX")]

use std::ptr::NonNull;

use serde::{Deserialize, Serialize};

use super::ucx::{MemType, Registrable};

/// Errors of allocating memory.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("cannot allocate an empty buffer (change --working-set or the region size)")]
    Empty,
    #[error(
        "no huge pages available for {len} bytes: {reason}. Reserve some (e.g. `sysctl vm.nr_hugepages=N`, \
         HugePages_Total in /proc/meminfo is {total}) or drop --huge-pages"
    )]
    HugePages { len: usize, total: u64, reason: String },
    #[error("mmap of {len} bytes failed: {source}")]
    Mmap { len: usize, source: std::io::Error },
    #[error("CUDA: {0}")]
    Cuda(String),
    #[error("kvx was built without CUDA support: rebuild with `cargo build --features cuda`")]
    CudaNotBuilt,
}

/// Where one rank's KV buffers live, resolved once from `--mem`/`--devices`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum MemPlace {
    #[default]
    Host,
    Cuda {
        device: u32,
    },
}

/// Page size choice for host buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PageSize {
    #[default]
    Normal,
    /// `MAP_HUGETLB` (the system's default huge page size) when the hugetlb pool has
    /// pages, else transparent huge pages (`madvise(MADV_HUGEPAGE)`) if the kernel offers
    /// them; the buffer's [`HostBuffer::page_size`] says which one it got.
    Huge,
    /// Transparent huge pages (what `Huge` falls back to).
    Transparent,
}

impl std::fmt::Display for PageSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PageSize::Normal => "4KiB pages",
            PageSize::Huge => "hugetlb pages",
            PageSize::Transparent => "transparent huge pages",
        })
    }
}

/// Page-aligned host memory from an anonymous private `mmap`, owned by kvx.
#[derive(Debug)]
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    mapped_len: usize,
    pages: PageSize,
}

// SAFETY: the buffer is plain memory exclusively owned by this value; moving it to
// another thread moves that ownership. Shared references only allow reads.
unsafe impl Send for HostBuffer {}
// SAFETY: `&HostBuffer` exposes only `&[u8]` reads; mutation needs `&mut`.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Maps `len` zeroed bytes. With [`PageSize::Huge`] the length is rounded up to the
    /// huge page size and a missing huge-page pool is reported with its fix.
    pub fn alloc(len: usize, pages: PageSize) -> Result<Self, MemoryError> {
        match Self::map(len, pages) {
            Err(MemoryError::HugePages { .. }) if pages == PageSize::Huge && thp_available() => {
                tracing::info!("no hugetlb pages reserved; using transparent huge pages");
                Self::map(len, PageSize::Transparent)
            }
            other => other,
        }
    }

    fn map(len: usize, pages: PageSize) -> Result<Self, MemoryError> {
        if len == 0 {
            return Err(MemoryError::Empty);
        }
        let (flags, mapped_len) = match pages {
            PageSize::Normal => (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, len),
            PageSize::Transparent => {
                (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, len.div_ceil(2 << 20) * (2 << 20))
            }
            PageSize::Huge => {
                let hp = huge_page_size().unwrap_or(2 << 20);
                (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB, len.div_ceil(hp) * hp)
            }
        };
        // SAFETY: anonymous private mapping at a kernel-chosen address; no existing memory
        // is affected. The result is checked for MAP_FAILED below.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), mapped_len, libc::PROT_READ | libc::PROT_WRITE, flags, -1, 0)
        };
        if p == libc::MAP_FAILED {
            let err = std::io::Error::last_os_error();
            return Err(match pages {
                PageSize::Huge => MemoryError::HugePages {
                    len: mapped_len,
                    total: huge_pages_total().unwrap_or(0),
                    reason: err.to_string(),
                },
                PageSize::Normal | PageSize::Transparent => MemoryError::Mmap { len, source: err },
            });
        }
        if pages == PageSize::Transparent {
            // SAFETY: advice on the mapping just created; it changes no contents.
            if unsafe { libc::madvise(p, mapped_len, libc::MADV_HUGEPAGE) } != 0 {
                tracing::warn!("madvise(MADV_HUGEPAGE) failed: {}", std::io::Error::last_os_error());
            }
        }
        let ptr = NonNull::new(p.cast::<u8>())
            .ok_or(MemoryError::Mmap { len, source: std::io::Error::other("null mapping") })?;
        Ok(Self { ptr, len, mapped_len, pages })
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes mapped readable for the lifetime of `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes mapped writable; `&mut self` makes this the only Rust view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The pages this buffer actually got.
    pub fn page_size(&self) -> PageSize {
        self.pages
    }

    /// Touches every page so that page faults happen now, not inside a measurement.
    pub fn prefault(&mut self) {
        for page in self.as_mut_slice().chunks_mut(4096) {
            page[0] = 0;
        }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping created in `alloc`, once.
        if unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.mapped_len) } != 0 {
            tracing::warn!("munmap of {} bytes failed: {}", self.mapped_len, std::io::Error::last_os_error());
        }
    }
}

// SAFETY: the mapping lives at a fixed address until Drop and moving a HostBuffer does
// not move it; nothing else unmaps it.
unsafe impl Registrable for HostBuffer {
    fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }
    fn len(&self) -> usize {
        self.len
    }
    fn mem_type(&self) -> MemType {
        MemType::Host
    }
}

fn meminfo_field(name: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim_start_matches(':').split_whitespace().next()?.parse().ok())
}

/// `Hugepagesize` from /proc/meminfo, in bytes.
pub fn huge_page_size() -> Option<usize> {
    meminfo_field("Hugepagesize").map(|kb| kb as usize * 1024)
}

/// `HugePages_Total` from /proc/meminfo.
pub fn huge_pages_total() -> Option<u64> {
    meminfo_field("HugePages_Total")
}

/// Whether the kernel hands out transparent huge pages on request (`always` or `madvise`).
pub fn thp_available() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .is_ok_and(|s| s.contains("[always]") || s.contains("[madvise]"))
}

/// `HugePages_Free` from /proc/meminfo.
pub fn huge_pages_free() -> Option<u64> {
    meminfo_field("HugePages_Free")
}

#[cfg(feature = "cuda")]
pub use cuda::{CudaBuffer, cuda_devices};

/// Number of CUDA devices, or why there are none usable.
#[cfg(not(feature = "cuda"))]
pub fn cuda_devices() -> Result<usize, MemoryError> {
    Err(MemoryError::CudaNotBuilt)
}

#[cfg(feature = "cuda")]
mod cuda {
    //! CUDA device memory via cudarc (dynamically loaded driver). Every entry point
    //! checks that `libcuda` is present first: cudarc's loaders panic otherwise.
    use std::sync::Arc;

    use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};

    use super::MemoryError;
    use crate::transfer::ucx::{MemType, Registrable};

    fn driver_present() -> Result<(), MemoryError> {
        // SAFETY: only tries to dlopen libcuda and reports whether that worked; it calls
        // no CUDA function, so it is sound with or without a driver installed.
        if unsafe { cudarc::driver::sys::is_culib_present() } {
            Ok(())
        } else {
            Err(MemoryError::Cuda(
                "the CUDA driver library (libcuda.so) is not installed on this host".into(),
            ))
        }
    }

    /// Number of CUDA devices the driver reports.
    pub fn cuda_devices() -> Result<usize, MemoryError> {
        driver_present()?;
        CudaContext::device_count()
            .map(|n| n as usize)
            .map_err(|e| MemoryError::Cuda(format!("cuDeviceGetCount: {e}")))
    }

    /// Device memory on one GPU, owned by kvx.
    pub struct CudaBuffer {
        _ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        slice: CudaSlice<u8>,
        addr: u64,
        device: usize,
    }

    impl CudaBuffer {
        pub fn alloc(device: usize, len: usize) -> Result<Self, MemoryError> {
            if len == 0 {
                return Err(MemoryError::Empty);
            }
            driver_present()?;
            let n = cuda_devices()?;
            if device >= n {
                return Err(MemoryError::Cuda(format!(
                    "--device {device} does not exist ({n} CUDA device(s))"
                )));
            }
            let ctx = CudaContext::new(device)
                .map_err(|e| MemoryError::Cuda(format!("context on device {device}: {e}")))?;
            let stream = ctx.default_stream();
            let slice = stream
                .alloc_zeros::<u8>(len)
                .map_err(|e| MemoryError::Cuda(format!("cuMemAlloc({len}): {e}")))?;
            let (addr, sync) = slice.device_ptr(&stream);
            drop(sync);
            Ok(Self { _ctx: ctx, stream, slice, addr, device })
        }

        pub fn device(&self) -> usize {
            self.device
        }

        fn check(&self, off: usize, len: usize) -> Result<(), MemoryError> {
            if off.checked_add(len).is_none_or(|end| end > self.slice.len()) {
                return Err(MemoryError::Cuda(format!(
                    "range {off}+{len} outside a {}-byte buffer",
                    self.slice.len()
                )));
            }
            Ok(())
        }

        fn sync(&self, what: &str) -> Result<(), MemoryError> {
            self.stream.synchronize().map_err(|e| MemoryError::Cuda(format!("{what}: {e}")))
        }

        /// Copies `data` to device offset `off` and waits for the copy.
        pub fn write(&mut self, off: usize, data: &[u8]) -> Result<(), MemoryError> {
            self.check(off, data.len())?;
            let mut view = self.slice.slice_mut(off..off + data.len());
            self.stream
                .memcpy_htod(data, &mut view)
                .map_err(|e| MemoryError::Cuda(format!("cuMemcpyHtoD: {e}")))?;
            self.sync("cuMemcpyHtoD")
        }

        /// Copies `len` bytes at device offset `off` to the host.
        pub fn read_range(&self, off: usize, len: usize) -> Result<Vec<u8>, MemoryError> {
            self.check(off, len)?;
            let view = self.slice.slice(off..off + len);
            let v =
                self.stream.clone_dtoh(&view).map_err(|e| MemoryError::Cuda(format!("cuMemcpyDtoH: {e}")))?;
            self.sync("cuMemcpyDtoH")?;
            Ok(v)
        }

        /// Zeroes `len` bytes at device offset `off`.
        pub fn zero_range(&mut self, off: usize, len: usize) -> Result<(), MemoryError> {
            self.check(off, len)?;
            let mut view = self.slice.slice_mut(off..off + len);
            self.stream.memset_zeros(&mut view).map_err(|e| MemoryError::Cuda(format!("cuMemsetD8: {e}")))?;
            self.sync("cuMemsetD8")
        }
    }

    // SAFETY: a cuMemAlloc'd device allocation has a fixed device address until the
    // `CudaSlice` is dropped, which happens only when this value is dropped.
    unsafe impl Registrable for CudaBuffer {
        fn addr(&self) -> u64 {
            self.addr
        }
        fn len(&self) -> usize {
            self.slice.len()
        }
        fn mem_type(&self) -> MemType {
            MemType::Cuda
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_buffers_are_page_aligned_zeroed_and_writable() {
        let mut b = HostBuffer::alloc(3 * 4096 + 5, PageSize::Normal).expect("alloc");
        assert_eq!(b.addr() % 4096, 0);
        assert_eq!(b.len(), 3 * 4096 + 5);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[3 * 4096 + 4] = 7;
        assert_eq!(b.as_slice()[3 * 4096 + 4], 7);
        assert!(matches!(HostBuffer::alloc(0, PageSize::Normal), Err(MemoryError::Empty)));
    }

    #[test]
    fn huge_pages_succeed_or_say_how_to_get_them() {
        match HostBuffer::alloc(1 << 20, PageSize::Huge) {
            Ok(b) => match b.page_size() {
                PageSize::Huge => assert_eq!(b.addr() % huge_page_size().unwrap_or(2 << 20) as u64, 0),
                got => {
                    assert_eq!(got, PageSize::Transparent, "--huge-pages never silently gives 4KiB pages");
                    assert!(thp_available());
                    assert_eq!(b.addr() % 4096, 0);
                }
            },
            Err(e) => {
                assert!(!thp_available(), "falls back to THP when the kernel offers it");
                let msg = e.to_string();
                assert!(msg.contains("vm.nr_hugepages") && msg.contains("--huge-pages"), "{msg}");
            }
        }
    }
}
