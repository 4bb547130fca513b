//! The memory a KV cache lives in: the user's own host allocation (page-aligned `mmap`,
//! optionally huge pages) or CUDA device memory ([`super::cuda`]), and [`KvBuffer`], one
//! type over both with batched range writes and reads, so that filling blocks with a
//! pattern and verifying received bytes is one code path for host and device pools.
//!
//! Owns: allocating and freeing those buffers, [`MemPlace`] (where one rank's buffers
//! live, a typed value from the flags to the worker) and declaring buffers
//! [`Registrable`] with their memory type. Must not call UCX: registration is
//! `ucx::MemRegion`'s job, and UCX-allocated memory (`--ucx-alloc`) lives in the UCX
//! module, not here.
#![allow(unsafe_code, reason = "mmap/munmap of the host buffers kvx registers with UCX")]

use std::ops::Range;
use std::ptr::NonNull;

use serde::{Deserialize, Serialize};

pub use super::cuda::{CudaBuffer, CudaDevice, CudaError};
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
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error("byte range {start}..{end} is outside the {len}-byte buffer")]
    Range { start: u64, end: u64, len: usize },
    #[error("copy {index}: the source and destination ranges differ in length (or in number)")]
    Lengths { index: usize },
    #[error("a host-buffer copy needs host memory on one side: both are device buffers")]
    DeviceToDevice,
}

pub use crate::vocab::kinds::MemKind;

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

impl MemPlace {
    /// The UCX memory type of buffers in this place.
    pub fn mem_type(self) -> MemType {
        match self {
            MemPlace::Host => MemType::Host,
            MemPlace::Cuda { .. } => MemType::Cuda,
        }
    }

    /// The CUDA device, for device memory.
    pub fn device(self) -> Option<u32> {
        match self {
            MemPlace::Host => None,
            MemPlace::Cuda { device } => Some(device),
        }
    }

    pub fn is_device(self) -> bool {
        matches!(self, MemPlace::Cuda { .. })
    }

    /// Host or device memory.
    pub fn kind(self) -> MemKind {
        match self {
            MemPlace::Host => MemKind::Host,
            MemPlace::Cuda { .. } => MemKind::Cuda,
        }
    }

    /// Checks that this host can have buffers here (for `Cuda`: the feature, libcuda and
    /// the device), before any process is started.
    pub fn check_available(self) -> Result<(), MemoryError> {
        match self {
            MemPlace::Host => Ok(()),
            MemPlace::Cuda { device } => {
                let count = super::cuda::device_count()?;
                if count == 0 {
                    Err(CudaError::NoDevices.into())
                } else if device >= count {
                    Err(CudaError::NoDevice { device, count }.into())
                } else {
                    Ok(())
                }
            }
        }
    }
}

impl std::fmt::Display for MemPlace {
    /// `host` or `cuda:N`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MemPlace::Host => f.write_str("host"),
            MemPlace::Cuda { device } => write!(f, "cuda:{device}"),
        }
    }
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

/// One rank's KV buffer in host or device memory, with the range access the pipeline
/// needs: [`KvBuffer::write_ranges`] (fill blocks) and [`KvBuffer::read_ranges`] (verify
/// what arrived). Host buffers are accessed in place; device buffers through pinned
/// staging, one batch of copies and one synchronize per staging buffer's worth of ranges.
#[derive(Debug)]
pub enum KvBuffer {
    Host(HostBuffer),
    Cuda(CudaBuffer),
}

impl KvBuffer {
    /// Allocates `len` zeroed bytes at `place` (`pages` applies to host memory only).
    pub fn alloc(place: MemPlace, len: usize, pages: PageSize) -> Result<KvBuffer, MemoryError> {
        match place {
            MemPlace::Host => Ok(KvBuffer::Host(HostBuffer::alloc(len, pages)?)),
            MemPlace::Cuda { device } => {
                if len == 0 {
                    return Err(MemoryError::Empty);
                }
                let dev = CudaDevice::open(device)?;
                Ok(KvBuffer::Cuda(CudaBuffer::alloc(&dev, len)?))
            }
        }
    }

    pub fn place(&self) -> MemPlace {
        match self {
            KvBuffer::Host(_) => MemPlace::Host,
            KvBuffer::Cuda(b) => MemPlace::Cuda { device: b.device() },
        }
    }

    /// The host buffer, for code that only handles host memory.
    pub fn as_host(&self) -> Option<&HostBuffer> {
        match self {
            KvBuffer::Host(h) => Some(h),
            KvBuffer::Cuda(_) => None,
        }
    }

    pub fn as_host_mut(&mut self) -> Option<&mut HostBuffer> {
        match self {
            KvBuffer::Host(h) => Some(h),
            KvBuffer::Cuda(_) => None,
        }
    }

    /// The device buffer, for code that only handles device memory (the cuda-batch transport).
    pub fn as_cuda(&self) -> Option<&CudaBuffer> {
        match self {
            KvBuffer::Cuda(b) => Some(b),
            KvBuffer::Host(_) => None,
        }
    }

    pub fn as_cuda_mut(&mut self) -> Option<&mut CudaBuffer> {
        match self {
            KvBuffer::Cuda(b) => Some(b),
            KvBuffer::Host(_) => None,
        }
    }

    /// Touches every host page now (no-op for device memory, which cuMemAlloc maps).
    pub fn prefault(&mut self) {
        if let KvBuffer::Host(h) = self {
            h.prefault();
        }
    }

    /// Writes byte ranges (offsets from the buffer's start): `fill(i, bytes)` fills the
    /// bytes of `ranges[i]`. Every range is checked before anything is written.
    pub fn write_ranges(
        &mut self,
        ranges: &[Range<u64>],
        mut fill: impl FnMut(usize, &mut [u8]),
    ) -> Result<(), MemoryError> {
        match self {
            KvBuffer::Host(h) => {
                let bytes = h.as_mut_slice();
                check_host_ranges(ranges, bytes.len())?;
                for (i, r) in ranges.iter().enumerate() {
                    fill(i, &mut bytes[r.start as usize..r.end as usize]);
                }
                Ok(())
            }
            KvBuffer::Cuda(d) => Ok(d.write_ranges(ranges, fill)?),
        }
    }

    /// Reads byte ranges: `visit(i, bytes)` sees the bytes of `ranges[i]`.
    pub fn read_ranges(
        &self,
        ranges: &[Range<u64>],
        mut visit: impl FnMut(usize, &[u8]),
    ) -> Result<(), MemoryError> {
        match self {
            KvBuffer::Host(h) => {
                let bytes = h.as_slice();
                check_host_ranges(ranges, bytes.len())?;
                for (i, r) in ranges.iter().enumerate() {
                    visit(i, &bytes[r.start as usize..r.end as usize]);
                }
                Ok(())
            }
            KvBuffer::Cuda(d) => Ok(d.read_ranges(ranges, visit)?),
        }
    }
}

/// Copies byte ranges of `src` to the same offsets of `dst` (a host buffer and its KV pool):
/// memcpy between host buffers, device copies through pinned staging otherwise. Every range is
/// checked on both sides before anything is copied.
pub fn copy_ranges(src: &KvBuffer, dst: &mut KvBuffer, ranges: &[Range<u64>]) -> Result<(), MemoryError> {
    copy_moved(src, ranges, dst, ranges)
}

/// Copies each range `from[i]` of `src` to `to[i]` of `dst` (equal lengths: a KV cache laid
/// out otherwise than its host buffer), as [`copy_ranges`] copies.
pub fn copy_moved(
    src: &KvBuffer,
    from: &[Range<u64>],
    dst: &mut KvBuffer,
    to: &[Range<u64>],
) -> Result<(), MemoryError> {
    let at = |r: &Range<u64>| r.start as usize..r.end as usize;
    if let Some(i) = (0..from.len().max(to.len()))
        .find(|&i| from.get(i).map(|r| r.end - r.start) != to.get(i).map(|r| r.end - r.start))
    {
        return Err(MemoryError::Lengths { index: i });
    }
    match (src, dst) {
        (KvBuffer::Host(s), d) => {
            let bytes = s.as_slice();
            check_host_ranges(from, bytes.len())?;
            d.write_ranges(to, |i, out| out.copy_from_slice(&bytes[at(&from[i])]))
        }
        (s, KvBuffer::Host(d)) => {
            let bytes = d.as_mut_slice();
            check_host_ranges(to, bytes.len())?;
            s.read_ranges(from, |i, got| bytes[at(&to[i])].copy_from_slice(got))
        }
        (KvBuffer::Cuda(_), KvBuffer::Cuda(_)) => Err(MemoryError::DeviceToDevice),
    }
}

fn check_host_ranges(ranges: &[Range<u64>], len: usize) -> Result<(), MemoryError> {
    match ranges.iter().find(|r| r.start > r.end || r.end > len as u64) {
        Some(r) => Err(MemoryError::Range { start: r.start, end: r.end, len }),
        None => Ok(()),
    }
}

// SAFETY: both variants are `Registrable` (fixed address for their lifetime); the enum
// only delegates, and moving it moves neither allocation.
unsafe impl Registrable for KvBuffer {
    fn addr(&self) -> u64 {
        match self {
            KvBuffer::Host(h) => h.addr(),
            KvBuffer::Cuda(d) => d.addr(),
        }
    }
    fn len(&self) -> usize {
        match self {
            KvBuffer::Host(h) => Registrable::len(h),
            KvBuffer::Cuda(d) => Registrable::len(d),
        }
    }
    fn mem_type(&self) -> MemType {
        match self {
            KvBuffer::Host(h) => h.mem_type(),
            KvBuffer::Cuda(d) => d.mem_type(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_buffer_copies_move_exactly_the_ranges_and_check_them_first() {
        let mut src = KvBuffer::alloc(MemPlace::Host, 64, PageSize::Normal).expect("alloc");
        let whole = vec![Range { start: 0, end: 64 }];
        src.write_ranges(&whole, |_, b| b.iter_mut().enumerate().for_each(|(i, x)| *x = i as u8 + 1))
            .expect("fill");
        let mut dst = KvBuffer::alloc(MemPlace::Host, 64, PageSize::Normal).expect("alloc");
        copy_ranges(&src, &mut dst, &[4..8, 32..40]).expect("copy");
        let got = dst.as_host().expect("host").as_slice();
        for (i, &b) in got.iter().enumerate() {
            let copied = (4..8).contains(&i) || (32..40).contains(&i);
            assert_eq!(b, if copied { i as u8 + 1 } else { 0 }, "byte {i}");
        }
        // A range past either end is refused before anything moves.
        let err = copy_ranges(&src, &mut dst, &[0..4, 60..65]).expect_err("past the end");
        assert!(matches!(err, MemoryError::Range { end: 65, .. }), "{err}");
        assert_eq!(&dst.as_host().expect("host").as_slice()[..4], &[0; 4]);
    }

    #[test]
    fn mem_places_serialize_tagged_and_display_short() {
        assert_eq!(serde_json::to_value(MemPlace::Host).expect("json"), serde_json::json!({"kind": "host"}));
        let cuda = MemPlace::Cuda { device: 3 };
        assert_eq!(
            serde_json::to_value(cuda).expect("json"),
            serde_json::json!({"kind": "cuda", "device": 3})
        );
        let back: MemPlace =
            rmp_serde::from_slice(&rmp_serde::to_vec_named(&cuda).expect("msgpack")).expect("back");
        assert_eq!(back, cuda);
        assert_eq!(cuda.to_string(), "cuda:3");
        assert_eq!(MemPlace::Host.to_string(), "host");
        assert_eq!(cuda.mem_type(), MemType::Cuda);
        assert_eq!(MemPlace::Host.mem_type(), MemType::Host);
        assert_eq!((cuda.device(), MemPlace::Host.device()), (Some(3), None));
        assert_eq!(MemPlace::default(), MemPlace::Host);
        assert!(MemPlace::Host.check_available().is_ok());
    }

    #[test]
    fn host_kv_buffers_write_and_read_ranges_in_place() {
        let mut b = KvBuffer::alloc(MemPlace::Host, 64 << 10, PageSize::Normal).expect("alloc");
        assert_eq!(b.place(), MemPlace::Host);
        assert_eq!(b.mem_type(), MemType::Host);
        let ranges = [0..16, 4096..4100, 65_000..65_536];
        b.write_ranges(&ranges, |i, bytes| bytes.fill(i as u8 + 1)).expect("write");
        let mut seen = Vec::new();
        b.read_ranges(&ranges, |i, bytes| {
            seen.push((i, bytes.len(), bytes.iter().all(|&x| x == i as u8 + 1)))
        })
        .expect("read");
        assert_eq!(seen, vec![(0, 16, true), (1, 4, true), (2, 536, true)]);
        let host = b.as_host().expect("host");
        assert_eq!(host.as_slice()[16], 0, "bytes outside the ranges are untouched");
        let err =
            b.write_ranges(&[Range { start: 0, end: (64 << 10) + 1 }], |_, _| {}).expect_err("out of bounds");
        assert!(err.to_string().contains("outside"), "{err}");
    }

    #[test]
    fn device_kv_buffers_without_a_gpu_name_what_is_missing() {
        let place = MemPlace::Cuda { device: 0 };
        // On a GPU host both succeed; elsewhere both fail the same clear way.
        if let Err(e) = place.check_available() {
            let msg = e.to_string();
            assert!(
                msg.contains("libcuda") || msg.contains("`cuda` feature") || msg.contains("CUDA device"),
                "{msg}"
            );
            let err = KvBuffer::alloc(place, 4096, PageSize::Normal).expect_err("no device memory here");
            assert_eq!(err.to_string(), msg);
        }
    }

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
