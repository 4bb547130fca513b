//! Positioned, vectored and aligned file I/O for the storage backend, all through safe
//! wrappers (`rustix`, `std`): gather writes straight from the rank's allocation,
//! scatter reads straight into it, and the 4 KiB-aligned staging `O_DIRECT` needs.

use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut};
use std::sync::mpsc;

use super::format::ALIGN;
use crate::transfer::memory::{HostBuffer, PageSize};

/// Most iovecs one `preadv`/`pwritev` call takes (Linux `UIO_MAXIOV`).
pub const IOV_MAX: usize = 1024;

/// Staging buffers at least this large are mapped with transparent huge pages.
const HUGE_STAGING: usize = 2 << 20;

/// A zeroed buffer whose start and length are multiples of `ALIGN`, as `O_DIRECT` needs.
///
/// Large ones are kvx's own page-aligned host mappings with transparent huge pages:
/// physically contiguous 2 MiB runs give a device a few large DMA segments per transfer
/// instead of one per 4 KiB page. With 4 KiB pages the same code read at 0.9 or 2 GB/s
/// here depending on how fragmented the freshly faulted pages happened to be.
pub struct AlignedBuf {
    mem: Backing,
    len: usize,
}

enum Backing {
    Vec { raw: Vec<u8>, start: usize },
    Map(HostBuffer),
}

impl AlignedBuf {
    /// A buffer of at least `len` bytes (rounded up to `ALIGN`).
    pub fn new(len: usize) -> Self {
        let align = ALIGN as usize;
        let len = len.div_ceil(align).max(1) * align;
        if len >= HUGE_STAGING {
            // A failed mapping falls back to the heap (which then reports OOM itself).
            if let Ok(m) = HostBuffer::alloc(len, PageSize::Transparent) {
                return Self { mem: Backing::Map(m), len };
            }
        }
        let raw = vec![0u8; len + align];
        let start = raw.as_ptr().align_offset(align);
        Self { mem: Backing::Vec { raw, start }, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        match &self.mem {
            Backing::Vec { raw, start } => &raw[*start..*start + self.len],
            Backing::Map(m) => &m.as_slice()[..self.len],
        }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.mem {
            Backing::Vec { raw, start } => &mut raw[*start..*start + self.len],
            Backing::Map(m) => &mut m.as_mut_slice()[..self.len],
        }
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

/// Staging buffers in flight between the caller's thread and the I/O thread.
pub const STAGING_DEPTH: usize = 3;

fn fill_pool(pool: &mut Vec<AlignedBuf>, chunk: usize) -> Vec<AlignedBuf> {
    pool.retain(|b| b.len() >= chunk);
    while pool.len() < STAGING_DEPTH {
        pool.push(AlignedBuf::new(chunk));
    }
    std::mem::take(pool)
}

fn io_thread_gone() -> io::Error {
    io::Error::other("the storage I/O thread stopped unexpectedly")
}

/// Reads `windows` (file, offset, length; each at most `chunk` bytes) on a helper thread
/// into staging buffers, and calls `consume(window index, bytes)` for each window, in
/// order, on the caller's thread while the next windows are being read: disk time and
/// copy time overlap instead of adding up, across files too. Buffers come from and
/// return to `pool`. Returns the read calls made, or the failing window and its error.
pub fn staged_read(
    windows: &[(&File, u64, u64)],
    pool: &mut Vec<AlignedBuf>,
    chunk: usize,
    mut consume: impl FnMut(usize, &[u8]),
) -> Result<u64, (usize, io::Error)> {
    let bufs = fill_pool(pool, chunk);
    std::thread::scope(|s| {
        let (full_tx, full_rx) = mpsc::sync_channel::<(AlignedBuf, io::Result<u64>)>(STAGING_DEPTH);
        let (empty_tx, empty_rx) = mpsc::channel::<AlignedBuf>();
        for b in bufs {
            // The receiver is alive: it is moved into the reader below.
            let _ = empty_tx.send(b);
        }
        let reader = s.spawn(move || {
            for &(file, off, len) in windows {
                let Ok(mut buf) = empty_rx.recv() else { break };
                let r = pread_exact(file, &mut buf.as_mut_slice()[..len as usize], off);
                let failed = r.is_err();
                if full_tx.send((buf, r)).is_err() || failed {
                    break;
                }
            }
            empty_rx
        });
        let mut calls = 0;
        for (i, &(_, _, len)) in windows.iter().enumerate() {
            let (buf, r) = full_rx.recv().map_err(|_| (i, io_thread_gone()))?;
            calls += r.map_err(|e| (i, e))?;
            consume(i, &buf.as_slice()[..len as usize]);
            if let Err(mpsc::SendError(buf)) = empty_tx.send(buf) {
                pool.push(buf);
            }
        }
        let empty_rx = reader.join().map_err(|_| (windows.len(), io_thread_gone()))?;
        pool.extend(empty_rx.try_iter());
        Ok(calls)
    })
}

/// Appends bytes to a file through staging buffers that a helper thread writes out (see
/// `staged_write`).
pub struct Appender<'a> {
    cur: Option<AlignedBuf>,
    filled: usize,
    off: u64,
    full_tx: mpsc::SyncSender<(AlignedBuf, u64, usize)>,
    empty_rx: &'a mpsc::Receiver<io::Result<AlignedBuf>>,
}

impl Appender<'_> {
    fn next_buf(&mut self) -> io::Result<AlignedBuf> {
        self.empty_rx.recv().map_err(|_| io_thread_gone())?
    }

    /// Appends `data`; full buffers go to the writer thread.
    pub fn push(&mut self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let mut buf = match self.cur.take() {
                Some(b) => b,
                None => self.next_buf()?,
            };
            let space = buf.len() - self.filled;
            let n = space.min(data.len());
            buf.as_mut_slice()[self.filled..self.filled + n].copy_from_slice(&data[..n]);
            self.filled += n;
            data = &data[n..];
            let full = self.filled == buf.len();
            self.cur = Some(buf);
            if full {
                self.send()?;
            }
        }
        Ok(())
    }

    /// Sends the current buffer, its tail zero-padded to `ALIGN`.
    fn send(&mut self) -> io::Result<()> {
        let Some(mut buf) = self.cur.take() else { return Ok(()) };
        let len = super::format::align_up(self.filled as u64) as usize;
        // Buffers are reused: the padding must not carry an older chunk's bytes.
        buf.as_mut_slice()[self.filled..len].fill(0);
        let off = self.off;
        self.off += len as u64;
        self.filled = 0;
        self.full_tx.send((buf, off, len)).map_err(|_| io_thread_gone())
    }
}

/// Writes what `fill` appends to `file` from offset 0, in `chunk`-byte aligned writes on
/// a helper thread, so copying into one buffer overlaps writing the previous one. The
/// last write is zero-padded to `ALIGN`. Returns the write calls made.
pub fn staged_write(
    file: &File,
    pool: &mut Vec<AlignedBuf>,
    chunk: usize,
    fill: impl FnOnce(&mut Appender<'_>) -> io::Result<()>,
) -> io::Result<u64> {
    let bufs = fill_pool(pool, chunk);
    std::thread::scope(|s| {
        let (full_tx, full_rx) = mpsc::sync_channel::<(AlignedBuf, u64, usize)>(STAGING_DEPTH);
        let (empty_tx, empty_rx) = mpsc::channel::<io::Result<AlignedBuf>>();
        for b in bufs {
            let _ = empty_tx.send(Ok(b));
        }
        let writer = s.spawn(move || {
            let mut calls = 0;
            for (buf, off, len) in full_rx {
                match pwrite_all(file, &buf.as_slice()[..len], off) {
                    Ok(c) => {
                        calls += c;
                        if empty_tx.send(Ok(buf)).is_err() {
                            break;
                        }
                    }
                    Err(e) => {
                        let _ = empty_tx.send(Err(e));
                        break;
                    }
                }
            }
            calls
        });
        let mut app = Appender { cur: None, filled: 0, off: 0, full_tx, empty_rx: &empty_rx };
        let filled = fill(&mut app).and_then(|()| app.send());
        let Appender { cur, full_tx, .. } = app;
        pool.extend(cur);
        // Closing the channel ends the writer once it has written everything sent.
        drop(full_tx);
        let calls = writer.join().map_err(|_| io_thread_gone())?;
        // The writer's own error first: once it stops, `fill` can only see it gone.
        let mut write_err = None;
        for r in empty_rx.try_iter() {
            match r {
                Ok(b) => pool.push(b),
                Err(e) => write_err = write_err.or(Some(e)),
            }
        }
        match write_err.or(filled.err()) {
            Some(e) => Err(e),
            None => Ok(calls),
        }
    })
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
    use std::fs;

    use super::*;

    #[test]
    fn aligned_buffers_are_aligned() {
        for n in [1, 4096, 5000, 1 << 20] {
            let b = AlignedBuf::new(n);
            assert_eq!(b.as_slice().as_ptr() as usize % ALIGN as usize, 0);
            assert!(b.len() >= n && b.len().is_multiple_of(ALIGN as usize));
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
    fn staged_io_round_trips_and_reuses_buffers() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("s");
        let f = File::options().read(true).write(true).create(true).truncate(true).open(&path).expect("open");
        let data: Vec<u8> = (0..50_000u32).map(|i| (i % 253) as u8).collect();
        let mut pool = Vec::new();
        // Odd-sized pushes across 4 KiB chunks: many buffer hand-offs.
        let calls = staged_write(&f, &mut pool, 4096, |app| data.chunks(777).try_for_each(|c| app.push(c)))
            .expect("write");
        assert_eq!(calls, 50_000u64.div_ceil(4096));
        assert_eq!(f.metadata().expect("stat").len(), 50_000u64.div_ceil(4096) * 4096, "padded to ALIGN");
        assert_eq!(pool.len(), STAGING_DEPTH, "buffers come back");
        let windows: Vec<(&File, u64, u64)> = (0..13).map(|i| (&f, i * 4096, 4096)).collect();
        let mut back = Vec::new();
        staged_read(&windows, &mut pool, 4096, |i, b| {
            assert_eq!(i * 4096, back.len());
            back.extend_from_slice(b);
        })
        .expect("read");
        assert_eq!(&back[..data.len()], &data[..]);
        assert!(back[data.len()..].iter().all(|&b| b == 0));
        assert_eq!(pool.len(), STAGING_DEPTH);
    }

    #[test]
    fn staged_io_errors_surface_without_hanging() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("s");
        fs::write(&path, [1u8; 8192]).expect("write");
        let ro = File::open(&path).expect("open");
        let mut pool = Vec::new();
        let err = staged_write(&ro, &mut pool, 4096, |app| (0..10).try_for_each(|_| app.push(&[0u8; 4096])))
            .expect_err("read-only file");
        assert_eq!(err.raw_os_error(), Some(libc::EBADF), "{err}");
        let windows = [(&ro, 0, 4096), (&ro, 4096, 4096), (&ro, 8192, 4096), (&ro, 12288, 4096)];
        let mut seen = 0;
        let (at, err) = staged_read(&windows, &mut pool, 4096, |_, _| seen += 1).expect_err("past the end");
        assert_eq!((err.kind(), seen, at), (io::ErrorKind::UnexpectedEof, 2, 2));
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
