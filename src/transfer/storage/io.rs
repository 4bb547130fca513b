//! Positioned, vectored and aligned file I/O for the storage backend, all through safe
//! wrappers (`rustix`, `std`): gather writes straight from the rank's allocation,
//! scatter reads straight into it, and the 4 KiB-aligned staging `O_DIRECT` needs.

use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut};

use super::format::ALIGN;

/// Most iovecs one `preadv`/`pwritev` call takes (Linux `UIO_MAXIOV`).
pub const IOV_MAX: usize = 1024;

/// A zeroed buffer whose start and length are multiples of `ALIGN`, as `O_DIRECT` needs.
pub struct AlignedBuf {
    raw: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    /// A buffer of at least `len` bytes (rounded up to `ALIGN`).
    pub fn new(len: usize) -> Self {
        let align = ALIGN as usize;
        let len = len.div_ceil(align).max(1) * align;
        let raw = vec![0u8; len + align];
        let start = raw.as_ptr().align_offset(align);
        Self { raw, start, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.raw[self.start..self.start + self.len]
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.raw[self.start..self.start + self.len]
    }
}

fn errno(e: rustix::io::Errno) -> io::Error {
    io::Error::from_raw_os_error(e.raw_os_error())
}

/// Writes every byte of `bufs` at `off`, `IOV_MAX` slices per call, resuming after short
/// writes and `EINTR`. Returns the number of calls made.
pub fn pwritev_all(file: &File, mut bufs: &mut [IoSlice<'_>], mut off: u64) -> io::Result<u64> {
    let mut calls = 0;
    // Empty slices would make a zero-byte write look like a stall.
    while bufs.first().is_some_and(|b| b.is_empty()) {
        bufs = &mut bufs[1..];
    }
    while !bufs.is_empty() {
        let n = bufs.len().min(IOV_MAX);
        let written = match rustix::io::pwritev(file, &bufs[..n], off) {
            Ok(w) => w,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(errno(e)),
        };
        calls += 1;
        if written == 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "the filesystem accepted no bytes"));
        }
        off += written as u64;
        IoSlice::advance_slices(&mut bufs, written);
    }
    Ok(calls)
}

/// Fills every byte of `bufs` from `off`, `IOV_MAX` slices per call, resuming after short
/// reads and `EINTR`; the file ending first is `UnexpectedEof`. Returns the calls made.
pub fn preadv_all(file: &File, mut bufs: &mut [IoSliceMut<'_>], mut off: u64) -> io::Result<u64> {
    let mut calls = 0;
    while bufs.first().is_some_and(|b| b.is_empty()) {
        bufs = &mut bufs[1..];
    }
    while !bufs.is_empty() {
        let n = bufs.len().min(IOV_MAX);
        let got = match rustix::io::preadv(file, &mut bufs[..n], off) {
            Ok(g) => g,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(errno(e)),
        };
        calls += 1;
        if got == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("the file ends at byte {off}, before the data the header promises"),
            ));
        }
        off += got as u64;
        IoSliceMut::advance_slices(&mut bufs, got);
    }
    Ok(calls)
}

/// Reads exactly `buf.len()` bytes at `off` (one call unless the kernel returns less).
pub fn pread_exact(file: &File, buf: &mut [u8], off: u64) -> io::Result<u64> {
    let mut one = [IoSliceMut::new(buf)];
    preadv_all(file, &mut one, off)
}

/// Writes all of `buf` at `off`.
pub fn pwrite_all(file: &File, buf: &[u8], off: u64) -> io::Result<u64> {
    let mut one = [IoSlice::new(buf)];
    pwritev_all(file, &mut one, off)
}

/// Splits `alloc` into the disjoint destinations `(offset, len)` of `segs`, returned in
/// the order of `segs`. `Err((a, b))` names two destinations that overlap (indices into
/// `segs`), or `(a, a)` for one that runs past the end of `alloc`.
pub fn carve<'a>(alloc: &'a mut [u8], segs: &[(u64, u64)]) -> Result<Vec<&'a mut [u8]>, (usize, usize)> {
    let mut order: Vec<usize> = (0..segs.len()).collect();
    order.sort_unstable_by_key(|&i| segs[i].0);
    let total = alloc.len() as u64;
    let mut out: Vec<Option<&'a mut [u8]>> = Vec::with_capacity(segs.len());
    out.resize_with(segs.len(), || None);
    let mut rest: &'a mut [u8] = alloc;
    let mut cursor = 0u64;
    let mut prev: Option<usize> = None;
    for i in order {
        let (off, len) = segs[i];
        if off.checked_add(len).is_none_or(|end| end > total) {
            return Err((i, i));
        }
        if off < cursor {
            return Err((prev.unwrap_or(i), i));
        }
        let tail = std::mem::take(&mut rest);
        let (_, tail) = tail.split_at_mut((off - cursor) as usize);
        let (dst, tail) = tail.split_at_mut(len as usize);
        rest = tail;
        cursor = off + len;
        out[i] = Some(dst);
        prev = Some(i);
    }
    Ok(out.into_iter().flatten().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_buffers_are_aligned() {
        for n in [1, 4096, 5000, 1 << 20] {
            let b = AlignedBuf::new(n);
            assert_eq!(b.as_slice().as_ptr() as usize % ALIGN as usize, 0);
            assert!(b.len() >= n && b.len() % ALIGN as usize == 0);
        }
    }

    #[test]
    fn carve_returns_slices_in_request_order_and_refuses_overlap() {
        let mut a: Vec<u8> = (0..100).collect();
        let s = carve(&mut a, &[(50, 10), (0, 5), (90, 10)]).expect("disjoint");
        assert_eq!((s[0][0], s[1][0], s[2][9]), (50, 0, 99));
        assert_eq!(carve(&mut a, &[(0, 10), (5, 10)]).err(), Some((0, 1)));
        assert_eq!(carve(&mut a, &[(95, 10)]).err(), Some((0, 0)));
        assert_eq!(carve(&mut a, &[(u64::MAX, 2)]).err(), Some((0, 0)));
    }

    #[test]
    fn vectored_io_round_trips_many_slices() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("v"))
            .expect("open");
        // More slices than IOV_MAX, with empty ones, forces chunking and slice skipping.
        let src: Vec<Vec<u8>> = (0..3000u32).map(|i| vec![(i % 251) as u8; (i % 7) as usize]).collect();
        let mut ios: Vec<IoSlice<'_>> = src.iter().map(|v| IoSlice::new(v)).collect();
        let calls = pwritev_all(&f, &mut ios, 10).expect("write");
        assert!(calls >= 3);
        let mut dst: Vec<Vec<u8>> = src.iter().map(|v| vec![0u8; v.len()]).collect();
        let mut ios: Vec<IoSliceMut<'_>> = dst.iter_mut().map(|v| IoSliceMut::new(v)).collect();
        preadv_all(&f, &mut ios, 10).expect("read");
        assert_eq!(dst, src);
        let mut more = [0u8; 8];
        let err = pread_exact(&f, &mut more, f.metadata().expect("stat").len() - 4).expect_err("eof");
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }
}
