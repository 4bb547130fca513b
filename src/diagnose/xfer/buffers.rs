//! The memory both roles of `kvx xfer` register: host buffers (the user's own, or UCX-allocated)
//! and device buffers, each filled with the byte pattern (`layouts::pattern`), cleared and
//! checked through [`BufferAccess`] (device buffers copy through the host with the transfer
//! layer's safe copies).
#![forbid(unsafe_code)]

use std::ops::Range;

use super::control::TargetRequest;
use super::{Result, XferError};
use crate::layouts::pattern::fill_at;
use crate::transfer::cuda::{CudaBuffer, CudaDevice};
use crate::transfer::memory::{HostBuffer, MemPlace, PageSize};
use crate::transfer::ucx::{Context, MemRegion, PackedRkey, Registrable, UcxAllocated};

/// What `kvx xfer` needs of a registered buffer besides its registration: filling it
/// with the pattern, clearing ranges before a sampled batch writes them, and checking them
/// after. Host buffers do this in place; device buffers copy through the host.
pub trait BufferAccess: Registrable {
    fn fill_with_pattern(&mut self, seed: u64) -> Result<()>;
    /// Sets every byte of `ranges` (offsets into the buffer) to 0.
    fn zero_ranges(&mut self, ranges: &[Range<u64>]) -> Result<()>;
    /// Runs `check(i, bytes of ranges[i])` over every range (in parallel where there is much to
    /// check) and returns the failure of the lowest `i`, if any: `(i, what check returned)`.
    /// `scratch` is reused between calls (device buffers stage their bytes in it).
    fn check_ranges(
        &self,
        ranges: &[Range<u64>],
        scratch: &mut Vec<u8>,
        check: &RangeCheck<'_>,
    ) -> Result<Option<(usize, u64)>>;
}

/// Checks one range's bytes (its index, its bytes): `Some(offset)` of the first wrong byte.
pub type RangeCheck<'a> = dyn Fn(usize, &[u8]) -> Option<u64> + Sync + 'a;

/// Below this many bytes a check runs on this thread: rayon would cost more than it saves.
const PARALLEL_CHECK_BYTES: usize = 1 << 20;

/// `check` over `(index, bytes)` items, in parallel when they are many bytes; the failure of
/// the first item (in order) that fails.
pub(super) fn first_failure(items: &[(usize, &[u8])], check: &RangeCheck<'_>) -> Option<(usize, u64)> {
    use rayon::prelude::*;
    let total: usize = items.iter().map(|(_, b)| b.len()).sum();
    if total < PARALLEL_CHECK_BYTES {
        items.iter().find_map(|&(i, b)| check(i, b).map(|off| (i, off)))
    } else {
        items.par_iter().find_map_first(|&(i, b)| check(i, b).map(|off| (i, off)))
    }
}

macro_rules! host_access {
    ($t:ty) => {
        impl BufferAccess for $t {
            fn fill_with_pattern(&mut self, seed: u64) -> Result<()> {
                fill_at(self.as_mut_slice(), seed, 0);
                Ok(())
            }
            fn zero_ranges(&mut self, ranges: &[Range<u64>]) -> Result<()> {
                let buf = self.as_mut_slice();
                for r in ranges {
                    buf[r.start as usize..r.end as usize].fill(0);
                }
                Ok(())
            }
            fn check_ranges(
                &self,
                ranges: &[Range<u64>],
                _scratch: &mut Vec<u8>,
                check: &RangeCheck<'_>,
            ) -> Result<Option<(usize, u64)>> {
                let buf = self.as_slice();
                let items: Vec<(usize, &[u8])> = ranges
                    .iter()
                    .enumerate()
                    .map(|(i, r)| (i, &buf[r.start as usize..r.end as usize]))
                    .collect();
                Ok(first_failure(&items, check))
            }
        }
    };
}
host_access!(HostBuffer);
host_access!(UcxAllocated);

/// Device bytes staged on the host per parallel check (bounds the scratch buffer).
const CHECK_STAGING_BYTES: usize = 64 << 20;

impl BufferAccess for CudaBuffer {
    fn fill_with_pattern(&mut self, seed: u64) -> Result<()> {
        // Staged in 64 MiB pieces (multiples of 8, so the pattern's words line up at
        // every piece boundary).
        const PIECE: u64 = 64 << 20;
        let len = CudaBuffer::len(self) as u64;
        let ranges: Vec<std::ops::Range<u64>> =
            (0..len.div_ceil(PIECE)).map(|i| i * PIECE..((i + 1) * PIECE).min(len)).collect();
        self.write_ranges(&ranges, |i, bytes| fill_at(bytes, seed, ranges[i].start))?;
        Ok(())
    }
    fn zero_ranges(&mut self, ranges: &[Range<u64>]) -> Result<()> {
        self.write_ranges(ranges, |_, bytes| bytes.fill(0))?;
        Ok(())
    }
    fn check_ranges(
        &self,
        ranges: &[Range<u64>],
        scratch: &mut Vec<u8>,
        check: &RangeCheck<'_>,
    ) -> Result<Option<(usize, u64)>> {
        // Staged into `scratch` a group at a time, each group checked in parallel.
        let mut first = None;
        let mut start = 0;
        while start < ranges.len() && first.is_none() {
            let mut end = start;
            let mut bytes = 0usize;
            while end < ranges.len() && (end == start || bytes < CHECK_STAGING_BYTES) {
                bytes += (ranges[end].end - ranges[end].start) as usize;
                end += 1;
            }
            scratch.clear();
            scratch.reserve(bytes);
            self.read_ranges(&ranges[start..end], |_, got| scratch.extend_from_slice(got))?;
            let mut items = Vec::with_capacity(end - start);
            let mut at = 0usize;
            for (i, r) in ranges.iter().enumerate().take(end).skip(start) {
                let n = (r.end - r.start) as usize;
                items.push((i, &scratch[at..at + n]));
                at += n;
            }
            first = first_failure(&items, check);
            start = end;
        }
        Ok(first)
    }
}

pub(super) fn make_region(ctx: &Context, len: usize, req: &TargetRequest) -> Result<AnyRegion> {
    Ok(match req.mem {
        MemPlace::Cuda { device } => {
            let dev = CudaDevice::open(device)?;
            AnyRegion::Cuda(MemRegion::register(ctx, CudaBuffer::alloc(&dev, len)?)?)
        }
        MemPlace::Host if req.ucx_alloc => {
            let mut r = MemRegion::allocate(ctx, len)?;
            for page in r.memory_mut()?.as_mut_slice().chunks_mut(4096) {
                page[0] = 0;
            }
            AnyRegion::UcxAlloc(r)
        }
        MemPlace::Host => {
            let pages = if req.huge_pages { PageSize::Huge } else { PageSize::Normal };
            let mut buf = HostBuffer::alloc(len, pages)?;
            buf.prefault();
            AnyRegion::Host(MemRegion::register(ctx, buf)?)
        }
    })
}

/// A registered region of any of the memory kinds `kvx xfer` uses.
pub(super) enum AnyRegion {
    Host(MemRegion<HostBuffer>),
    UcxAlloc(MemRegion<UcxAllocated>),
    Cuda(MemRegion<CudaBuffer>),
}

/// Runs `$body` with `$r` bound to the `MemRegion` inside any variant.
macro_rules! with_region {
    ($region:expr, $r:ident => $body:expr) => {
        match $region {
            $crate::diagnose::xfer::buffers::AnyRegion::Host($r) => $body,
            $crate::diagnose::xfer::buffers::AnyRegion::UcxAlloc($r) => $body,
            $crate::diagnose::xfer::buffers::AnyRegion::Cuda($r) => $body,
        }
    };
}
pub(super) use with_region;

impl AnyRegion {
    pub(super) fn fill(&mut self, seed: u64) -> Result<()> {
        with_region!(self, r => r.memory_mut()?.fill_with_pattern(seed))
    }
    /// The pages the buffer got (UCX-allocated and device memory report normal pages).
    pub(super) fn page_size(&self) -> PageSize {
        match self {
            AnyRegion::Host(r) => r.memory().map_or(PageSize::Normal, HostBuffer::page_size),
            _ => PageSize::Normal,
        }
    }
    pub(super) fn addr(&self) -> u64 {
        with_region!(self, r => r.addr())
    }
    pub(super) fn len(&self) -> usize {
        with_region!(self, r => r.len())
    }
    pub(super) fn pack_rkey(&self) -> Result<PackedRkey> {
        with_region!(self, r => Ok(r.pack_rkey()?))
    }
}

/// Fails before any process starts when this host cannot have the memory asked for
/// (the cuda feature, libcuda, the device).
pub(super) fn check_mem(mem: MemPlace) -> Result<()> {
    Ok(mem.check_available()?)
}

/// The region size asked for, as a length this process can allocate.
pub(super) fn region_len(req: &TargetRequest) -> Result<usize> {
    usize::try_from(req.region_bytes).ok().filter(|&l| l > 0).ok_or_else(|| XferError::Protocol {
        stage: "target: request",
        reason: format!("bad region size {}", req.region_bytes),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layouts::pattern::check_at;

    #[test]
    fn a_parallel_check_reports_the_first_failing_range() {
        // 64 ranges of 64 KiB (4 MiB: checked in parallel), two of them damaged.
        let mut buf = vec![0u8; 4 << 20];
        fill_at(&mut buf, 7, 0);
        buf[(40 << 16) + 9] ^= 1;
        buf[(9 << 16) + 100] ^= 1;
        let items: Vec<(usize, &[u8])> = buf.chunks(1 << 16).enumerate().collect();
        let check = |i: usize, got: &[u8]| check_at(got, 7, (i as u64) << 16).err();
        assert_eq!(first_failure(&items, &check), Some((9, (9 << 16) + 100)));
        assert_eq!(first_failure(&items[..9], &check), None, "small: on this thread");
    }
}
