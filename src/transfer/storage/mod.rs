//! The shared-storage KV transport (vLLM SharedStorageConnector's model): each prefill
//! rank writes a request's KV blocks to one file in a shared directory; each decode rank
//! reads back exactly the bytes its descriptor plan names, into its own blocks.
//!
//! The decode side consumes the planner's `(local, remote, len)` pairs unchanged: a
//! `remote` offset (bytes from the prefill rank's allocation base) is located in the
//! prefill rank's region list, mapped to (region, request position, offset in block), and
//! from there to a file offset (`format` describes the file). So head slices, block-size
//! ratios, prefix hits and P > D fan-in behave exactly as on the UCX path.
//!
//! Files are written under a temporary name and renamed into place, so a reader opens
//! either nothing or a complete file; a reader whose file is not there yet polls (short
//! backoff) until its deadline. Publishers remove their files on release and sweep files
//! whose lease expired. Buffered I/O gathers from and scatters into the ranks' memory
//! with `pwritev`/`preadv` (no staging copy) after asking the kernel to read ahead every
//! file of the fetch. `O_DIRECT` does the same when every piece is 4 KiB-aligned and
//! large; otherwise it stages through aligned buffers that a helper thread writes or
//! reads in large sequential transfers while the caller copies (see `io`).
//!
//! Owns: file format, naming, publish/fetch/release/sweep. Must not know about request
//! lifecycles, notifications or workloads (that is `pipeline`), nor about memory types:
//! byte slices in, byte slices out.
#![forbid(unsafe_code)]

pub mod format;
pub mod io;
pub mod names;

use std::fs::{self, File};
use std::io::{IoSlice, IoSliceMut};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use format::{ALIGN, FIXED_LEN, FormatError, Header, MAX_HEADER_LEN, RegionGeom};
use io::AlignedBuf;
pub use names::{MAX_ID_BYTES, SweepStats, request_path};

use crate::layouts::Region;
use crate::layouts::read_plan::ReadPlan;

/// Everything that can go wrong storing or loading KV blocks; every I/O error names its
/// path.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("cannot {op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the filesystem of {dir} refuses O_DIRECT ({source}); tmpfs and some network filesystems do: drop \
         --storage-direct-io or point --storage-dir at a disk-backed filesystem"
    )]
    DirectIoUnsupported {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} {id:?} cannot name a storage file: {reason}")]
    BadId { what: &'static str, id: String, reason: String },
    #[error(
        "timed out after {timeout:?} waiting for {path}: prefill rank {p_rank} has not published request \
         {request_id:?} of engine {engine_id:?} (is it running, and does it use the same --storage-dir?)"
    )]
    Timeout { path: PathBuf, timeout: Duration, engine_id: String, request_id: String, p_rank: u32 },
    #[error("{path} is not a usable kvx storage file: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error(
        "{path} was written in storage format version {found}; this kvx reads version {}",
        format::FORMAT_VERSION
    )]
    UnsupportedVersion { path: PathBuf, found: u32 },
    #[error("{path} is truncated: {actual} bytes, the header promises {expected}")]
    Truncated { path: PathBuf, expected: u64, actual: u64 },
    #[error("{path} holds {what} {found} but this request expects {expected}")]
    Mismatch { path: PathBuf, what: String, found: String, expected: String },
    #[error("the descriptor plan does not fit the storage file: {0}")]
    Plan(String),
    #[error("cannot publish: {0}")]
    Input(String),
}

/// How the storage backend does its I/O.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageOptions {
    /// The shared directory (`--storage-dir`); created if missing.
    pub dir: PathBuf,
    /// Bypass the page cache with `O_DIRECT` (`--storage-direct-io`).
    pub direct_io: bool,
    /// `fdatasync` each file before it becomes visible and the directory after
    /// (`--storage-fsync`), so a published request survives a crash.
    pub fsync: bool,
    /// Bytes per staged `O_DIRECT` read or write (rounded up to 4 KiB).
    pub direct_chunk_bytes: usize,
    /// `O_DIRECT` moves bytes straight between rank memory and the file when every piece
    /// is 4 KiB-aligned and pieces average at least this many bytes; smaller pieces are
    /// staged through `direct_chunk_bytes` transfers on a helper thread, which devices
    /// that charge per segment serve faster (virtio-blk here: 8 KiB pieces read at 0.6x
    /// of 8 MiB sequential reads).
    pub direct_min_piece_bytes: u64,
    /// `O_DIRECT` reads, and buffered read-ahead hints, span holes of at most this many
    /// bytes rather than starting anew after them.
    pub max_gap_bytes: u64,
}

impl StorageOptions {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            direct_io: false,
            fsync: false,
            direct_chunk_bytes: 8 << 20,
            direct_min_piece_bytes: 1 << 20,
            max_gap_bytes: 1 << 20,
        }
    }

    /// The default directory: `kvx-storage` under the system temp dir.
    pub fn default_dir() -> PathBuf {
        std::env::temp_dir().join("kvx-storage")
    }
}

/// What one publish cost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishStats {
    pub path: PathBuf,
    /// KV bytes written.
    pub payload_bytes: u64,
    /// Length of the file (header and padding included).
    pub file_bytes: u64,
    /// Write system calls.
    pub write_calls: u64,
    /// Bytes copied through the `O_DIRECT` staging buffer (zero when the rank's memory
    /// and blocks are 4 KiB-aligned, or without direct I/O).
    pub staged_bytes: u64,
    /// Time writing (open to last byte).
    pub write: Duration,
    /// Time in `fdatasync` (zero without `fsync`).
    pub sync: Duration,
    pub total: Duration,
}

/// What one fetch cost.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FetchStats {
    /// KV bytes delivered into the decode rank's memory.
    pub bytes: u64,
    /// Bytes read from files (more than `bytes` when direct reads read through holes).
    pub file_bytes: u64,
    pub files: u32,
    /// Read system calls (headers included).
    pub read_calls: u64,
    /// Contiguous file ranges read (after coalescing).
    pub runs: u64,
    /// Bytes read through the `O_DIRECT` staging buffer (zero when every piece and its
    /// destination are 4 KiB-aligned, or without direct I/O).
    pub staged_bytes: u64,
    /// Time waiting for files to appear.
    pub wait: Duration,
    /// Time in data reads and copies (headers, planning and waiting excluded).
    pub io: Duration,
    pub total: Duration,
}

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> StorageError {
    let path = path.to_path_buf();
    move |source| StorageError::Io { op, path, source }
}

fn create_dir(dir: &Path) -> Result<(), StorageError> {
    fs::create_dir_all(dir).map_err(io_err("create directory", dir))
}

fn open_options(direct: bool) -> fs::OpenOptions {
    let mut o = fs::OpenOptions::new();
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o
}

fn is_einval(e: &std::io::Error) -> bool {
    e.raw_os_error() == Some(libc::EINVAL)
}

/// Checks that `dir` accepts `O_DIRECT` by writing and removing one aligned block.
fn probe_direct_io(dir: &Path) -> Result<(), StorageError> {
    let path = dir.join(names::tmp_name("direct-io-probe.probe.p0.kvx"));
    let unsupported = |source| StorageError::DirectIoUnsupported { dir: dir.to_path_buf(), source };
    let file = match open_options(true).write(true).create_new(true).open(&path) {
        Ok(f) => f,
        Err(e) if is_einval(&e) => return Err(unsupported(e)),
        Err(e) => return Err(io_err("create", &path)(e)),
    };
    let buf = AlignedBuf::new(ALIGN as usize);
    let res = io::pwrite_all(&file, buf.as_slice(), 0);
    drop(file);
    let _ = fs::remove_file(&path);
    match res {
        Ok(_) => Ok(()),
        Err(e) if is_einval(&e) => Err(unsupported(e)),
        Err(e) => Err(io_err("write", &path)(e)),
    }
}

/// Prefill side: publishes a rank's request blocks as files. One per P rank.
pub struct StoragePublisher {
    opts: StorageOptions,
    engine_id: String,
    engine_enc: String,
    p_rank: u32,
    staging: Vec<AlignedBuf>,
}

impl StoragePublisher {
    /// Creates the directory if needed; with `direct_io`, checks the filesystem takes it.
    pub fn new(opts: StorageOptions, engine_id: &str, p_rank: u32) -> Result<Self, StorageError> {
        let engine_enc = names::encode_id("engine id", engine_id)?;
        create_dir(&opts.dir)?;
        if opts.direct_io {
            probe_direct_io(&opts.dir)?;
        }
        Ok(Self { opts, engine_id: engine_id.to_string(), engine_enc, p_rank, staging: Vec::new() })
    }

    pub fn options(&self) -> &StorageOptions {
        &self.opts
    }

    /// Where this rank's file of `p_request_id` is (or will be).
    pub fn path(&self, p_request_id: &str) -> Result<PathBuf, StorageError> {
        request_path(&self.opts.dir, &self.engine_id, p_request_id, self.p_rank)
    }

    /// Writes the request's blocks (every region, `remote_blocks` in request order) from
    /// the rank's allocation `alloc`. Returns once a reader can open the complete file.
    /// Publishing the same request again replaces the file atomically.
    pub fn publish(
        &mut self,
        p_request_id: &str,
        regions: &[Region],
        remote_blocks: &[u32],
        alloc: &[u8],
    ) -> Result<PublishStats, StorageError> {
        let t0 = Instant::now();
        let final_name = names::file_name(&self.engine_id, p_request_id, self.p_rank)?;
        let slices = block_slices(regions, remote_blocks, alloc)?;
        let header = Header {
            p_rank: self.p_rank,
            engine_id: self.engine_id.clone(),
            request_id: p_request_id.to_string(),
            regions: regions.iter().map(region_geom).collect(),
            blocks: remote_blocks.to_vec(),
        };
        if header.header_len() > MAX_HEADER_LEN {
            return Err(StorageError::Input(format!(
                "{} regions and {} blocks need a {}-byte header; at most {MAX_HEADER_LEN} are supported",
                regions.len(),
                remote_blocks.len(),
                header.header_len()
            )));
        }
        let final_path = self.opts.dir.join(&final_name);
        let tmp_path = self.opts.dir.join(names::tmp_name(&final_name));
        let file = match open_options(self.opts.direct_io).write(true).create_new(true).open(&tmp_path) {
            Ok(f) => f,
            Err(e) if self.opts.direct_io && is_einval(&e) => {
                return Err(StorageError::DirectIoUnsupported { dir: self.opts.dir.clone(), source: e });
            }
            Err(e) => return Err(io_err("create", &tmp_path)(e)),
        };
        let res = self.write_and_commit(&file, &header, &slices, alloc, &tmp_path, &final_path);
        drop(file);
        match res {
            Ok((write_calls, staged_bytes, write, sync)) => Ok(PublishStats {
                path: final_path,
                payload_bytes: header.payload_len(),
                file_bytes: header.file_len(),
                write_calls,
                staged_bytes,
                write,
                sync,
                total: t0.elapsed(),
            }),
            Err(e) => {
                // Best effort: a failed publish leaves no temp file behind (a sweep would
                // find it otherwise).
                let _ = fs::remove_file(&tmp_path);
                Err(e)
            }
        }
    }

    fn write_and_commit(
        &mut self,
        file: &File,
        header: &Header,
        slices: &[(usize, usize)],
        alloc: &[u8],
        tmp_path: &Path,
        final_path: &Path,
    ) -> Result<(u64, u64, Duration, Duration), StorageError> {
        let t0 = Instant::now();
        let head = header.encode();
        let mut staged = 0;
        let direct_in_place = || {
            let avg = header.payload_len() / (slices.len() as u64).max(1);
            avg >= self.opts.direct_min_piece_bytes
                && slices.iter().all(|&(off, len)| {
                    (alloc[off..].as_ptr() as usize).is_multiple_of(ALIGN as usize)
                        && (len as u64).is_multiple_of(ALIGN)
                })
        };
        let write_calls = if self.opts.direct_io && direct_in_place() {
            // Straight from the rank's memory; the payload is a multiple of ALIGN already.
            let mut buf = AlignedBuf::new(head.len());
            buf.as_mut_slice().copy_from_slice(&head);
            let mut calls = io::pwrite_all(file, buf.as_slice(), 0).map_err(io_err("write", tmp_path))?;
            let mut ios: Vec<IoSlice<'_>> =
                slices.iter().map(|&(off, len)| IoSlice::new(&alloc[off..off + len])).collect();
            calls +=
                io::pwritev_all(file, &mut ios, header.header_len()).map_err(io_err("write", tmp_path))?;
            calls
        } else if self.opts.direct_io {
            let chunk = format::align_up(self.opts.direct_chunk_bytes.max(1) as u64) as usize;
            staged = header.payload_len();
            io::staged_write(file, &mut self.staging, chunk, |app| {
                app.push(&head)?;
                slices.iter().try_for_each(|&(off, len)| app.push(&alloc[off..off + len]))
            })
            .map_err(io_err("write", tmp_path))?
        } else {
            let mut calls = io::pwrite_all(file, &head, 0).map_err(io_err("write", tmp_path))?;
            let mut ios: Vec<IoSlice<'_>> =
                slices.iter().map(|&(off, len)| IoSlice::new(&alloc[off..off + len])).collect();
            calls +=
                io::pwritev_all(file, &mut ios, header.header_len()).map_err(io_err("write", tmp_path))?;
            // Pads the payload to ALIGN (a hole, not written bytes).
            file.set_len(header.file_len()).map_err(io_err("extend", tmp_path))?;
            calls
        };
        let write = t0.elapsed();
        let t1 = Instant::now();
        if self.opts.fsync {
            file.sync_data().map_err(io_err("fdatasync", tmp_path))?;
        }
        fs::rename(tmp_path, final_path).map_err(io_err("rename into place", final_path))?;
        if self.opts.fsync {
            // The rename is durable only once the directory is.
            File::open(&self.opts.dir)
                .and_then(|d| d.sync_all())
                .map_err(io_err("fsync directory", &self.opts.dir))?;
        }
        let sync = if self.opts.fsync { t1.elapsed() } else { Duration::ZERO };
        Ok((write_calls, staged, write, sync))
    }

    /// Removes this rank's file of `p_request_id` (the request completed, or its lease
    /// expired). Removing a file that is not there is not an error.
    pub fn release(&mut self, p_request_id: &str) -> Result<(), StorageError> {
        let path = self.path(p_request_id)?;
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err("remove", &path)(e)),
        }
    }

    /// Removes this engine-and-rank's files (complete or abandoned temporaries) not
    /// modified for longer than `lease`: requests whose decode never came. Files of other
    /// engines and ranks sharing the directory are left to their own publishers.
    pub fn sweep(&mut self, lease: Duration) -> Result<SweepStats, StorageError> {
        names::sweep(&self.opts.dir, lease, SystemTime::now(), |n| {
            n.engine != self.engine_enc || n.p_rank != self.p_rank
        })
    }
}

/// Sweeps every kvx file under `dir` older than `lease` (a cleanup command for a
/// directory whose publishers are gone).
pub fn sweep_dir(dir: &Path, lease: Duration) -> Result<SweepStats, StorageError> {
    names::sweep(dir, lease, SystemTime::now(), |_| false)
}

fn region_geom(r: &Region) -> RegionGeom {
    RegionGeom {
        base_off: r.base_off,
        block_len: r.block_len,
        block_stride: r.block_stride,
        num_blocks: r.num_blocks,
    }
}

fn describe_geom(g: &RegionGeom) -> String {
    format!(
        "(base offset {}, block length {}, stride {}, {} blocks)",
        g.base_off, g.block_len, g.block_stride, g.num_blocks
    )
}

/// The allocation ranges `(offset, len)` of a request's blocks in payload order
/// (region-major), neighbours merged; checks ids and bounds.
fn block_slices(
    regions: &[Region],
    blocks: &[u32],
    alloc: &[u8],
) -> Result<Vec<(usize, usize)>, StorageError> {
    check_unique(blocks).map_err(StorageError::Input)?;
    let mut out: Vec<(usize, usize)> = Vec::with_capacity(regions.len() * blocks.len());
    for (ri, r) in regions.iter().enumerate() {
        for &b in blocks {
            if u64::from(b) >= r.num_blocks {
                return Err(StorageError::Input(format!(
                    "block id {b} is outside region {ri} ({}) of {} blocks",
                    r.name, r.num_blocks
                )));
            }
            let off = r.block_off(u64::from(b));
            if off.checked_add(r.block_len).is_none_or(|end| end > alloc.len() as u64) {
                return Err(StorageError::Input(format!(
                    "block {b} of region {ri} ({}) ends past the rank's allocation of {} bytes",
                    r.name,
                    alloc.len()
                )));
            }
            let (off, len) = (off as usize, r.block_len as usize);
            match out.last_mut() {
                Some(last) if last.0 + last.1 == off => last.1 += len,
                _ => out.push((off, len)),
            }
        }
    }
    Ok(out)
}

fn check_unique(blocks: &[u32]) -> Result<(), String> {
    let mut sorted = blocks.to_vec();
    sorted.sort_unstable();
    match sorted.windows(2).find(|w| w[0] == w[1]) {
        Some(w) => Err(format!("the request's prefill block list names block {} twice", w[0])),
        None => Ok(()),
    }
}

/// Decode side: reads planned pairs out of published files. One per D rank.
pub struct StorageFetcher {
    opts: StorageOptions,
    staging: Vec<AlignedBuf>,
}

/// One contiguous piece of a read: `len` bytes at `file` go to `local`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Seg {
    file: u64,
    local: u64,
    len: u64,
}

/// An opened, validated file and the pieces to read from it.
struct Source {
    path: PathBuf,
    file: File,
    header_calls: u64,
    segs: Vec<Seg>,
}

impl StorageFetcher {
    /// Creates the directory if needed (decode may start before prefill).
    pub fn new(opts: StorageOptions) -> Result<Self, StorageError> {
        create_dir(&opts.dir)?;
        Ok(Self { opts, staging: Vec::new() })
    }

    pub fn options(&self) -> &StorageOptions {
        &self.opts
    }

    /// Reads every pair of every READ of `reads` into `local_alloc` (the decode rank's
    /// allocation). `remote_regions` is the prefill ranks' region list and
    /// `remote_blocks` the request's whole prefill block list in request order (as
    /// published), so a remote offset maps to (region, request position, offset in
    /// block). Waits up to `timeout` (in total) for files that are not there yet.
    #[expect(clippy::too_many_arguments, reason = "the request's identity, its plan and both sides' memory")]
    pub fn fetch(
        &mut self,
        engine_id: &str,
        p_request_id: &str,
        reads: &[ReadPlan],
        remote_regions: &[Region],
        remote_blocks: &[u32],
        local_alloc: &mut [u8],
        timeout: Duration,
    ) -> Result<FetchStats, StorageError> {
        let t0 = Instant::now();
        let deadline = t0 + timeout;
        // Refuse bad ids even when the plan reads nothing (a full prefix hit).
        names::encode_id("engine id", engine_id)?;
        names::encode_id("request id", p_request_id)?;
        check_unique(remote_blocks).map_err(StorageError::Plan)?;
        let mut locator = Locator::new(remote_regions, remote_blocks)?;
        let expect = ExpectedHeader {
            engine_id,
            request_id: p_request_id,
            regions: remote_regions,
            blocks: remote_blocks,
        };
        let mut stats = FetchStats::default();
        let mut sources = Vec::with_capacity(reads.len());
        for read in reads {
            let path = request_path(&self.opts.dir, engine_id, p_request_id, read.p_rank)?;
            let tw = Instant::now();
            let file = self.open_wait(&path, deadline, timeout, engine_id, p_request_id, read.p_rank)?;
            stats.wait += tw.elapsed();
            let (header, header_calls) = self.read_header(&file, &path)?;
            expect.check(&header, read.p_rank, &path)?;
            let mut segs = Vec::with_capacity(read.pairs.len());
            for (i, p) in read.pairs.iter().enumerate() {
                locator.map(p.remote, p.local, p.len, header.header_len(), &mut segs).map_err(|why| {
                    StorageError::Plan(format!(
                        "pair {i} of the READ from prefill rank {}: {why}",
                        read.p_rank
                    ))
                })?;
            }
            if !segs.is_sorted_by_key(|s| s.file) {
                segs.sort_by_key(|s| s.file);
            }
            sources.push(Source { path, file, header_calls, segs });
        }
        let dests: Vec<(u64, u64)> = sources.iter().flat_map(|s| &s.segs).map(|s| (s.local, s.len)).collect();
        let local_len = local_alloc.len();
        let mut slices = io::carve(local_alloc, &dests).map_err(|(a, b)| {
            let (x, y) = (dests[a], dests[b]);
            StorageError::Plan(if a == b {
                format!(
                    "local range {}..{} runs past the decode rank's allocation of {local_len} bytes",
                    x.0,
                    x.0.saturating_add(x.1)
                )
            } else {
                format!("local ranges {}..{} and {}..{} overlap", x.0, x.0 + x.1, y.0, y.0 + y.1)
            })
        })?;
        let mut rest = slices.as_mut_slice();
        let t_io = Instant::now();
        if !self.opts.direct_io {
            // Starts every file's disk reads now, so they overlap each other and the
            // copies (a cold 4-file fetch ran at 0.55x of one sequential read without).
            for src in &sources {
                read_ahead(src, self.opts.max_gap_bytes);
            }
        }
        let mut staged = Vec::new();
        for src in &sources {
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(src.segs.len());
            rest = tail;
            stats.read_calls += src.header_calls;
            stats.files += 1;
            if self.opts.direct_io && !in_place(&src.segs, mine, self.opts.direct_min_piece_bytes) {
                staged.push((src, mine));
            } else {
                read_vectored(src, mine, &mut stats)?;
            }
        }
        if !staged.is_empty() {
            self.read_staged(&mut staged, &mut stats)?;
        }
        stats.io = t_io.elapsed();
        stats.total = t0.elapsed();
        Ok(stats)
    }

    fn open_wait(
        &self,
        path: &Path,
        deadline: Instant,
        timeout: Duration,
        engine_id: &str,
        request_id: &str,
        p_rank: u32,
    ) -> Result<File, StorageError> {
        // Polling rather than inotify: it works the same on network filesystems.
        let mut backoff = Duration::from_micros(50);
        loop {
            match open_options(self.opts.direct_io).read(true).open(path) {
                Ok(f) => return Ok(f),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) if self.opts.direct_io && is_einval(&e) => {
                    return Err(StorageError::DirectIoUnsupported { dir: self.opts.dir.clone(), source: e });
                }
                Err(e) => return Err(io_err("open", path)(e)),
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(StorageError::Timeout {
                    path: path.to_path_buf(),
                    timeout,
                    engine_id: engine_id.to_string(),
                    request_id: request_id.to_string(),
                    p_rank,
                });
            }
            std::thread::sleep(backoff.min(deadline - now));
            backoff = (backoff * 2).min(Duration::from_millis(1));
        }
    }

    /// Reads, decodes and size-checks a file's header.
    fn read_header(&mut self, file: &File, path: &Path) -> Result<(Header, u64), StorageError> {
        let actual = file.metadata().map_err(io_err("stat", path))?.len();
        let truncated = |expected| StorageError::Truncated { path: path.to_path_buf(), expected, actual };
        if actual < ALIGN {
            return Err(truncated(ALIGN));
        }
        let mut calls = 0;
        let mut buf = AlignedBuf::new(ALIGN as usize);
        calls += io::pread_exact(file, buf.as_mut_slice(), 0).map_err(io_err("read", path))?;
        let corrupt = |e: FormatError| match e {
            FormatError::BadMagic => StorageError::Corrupt {
                path: path.to_path_buf(),
                reason: "it does not start with kvx's magic bytes".into(),
            },
            FormatError::Version(found) => {
                StorageError::UnsupportedVersion { path: path.to_path_buf(), found }
            }
            FormatError::Corrupt(reason) => StorageError::Corrupt { path: path.to_path_buf(), reason },
        };
        let header_len = Header::decode_len(&buf.as_slice()[..FIXED_LEN]).map_err(corrupt)?;
        if header_len > actual {
            return Err(truncated(header_len));
        }
        if header_len > ALIGN {
            let mut whole = AlignedBuf::new(header_len as usize);
            whole.as_mut_slice()[..ALIGN as usize].copy_from_slice(buf.as_slice());
            calls +=
                io::pread_exact(file, &mut whole.as_mut_slice()[ALIGN as usize..header_len as usize], ALIGN)
                    .map_err(io_err("read", path))?;
            buf = whole;
        }
        let header = Header::decode(buf.as_slice()).map_err(corrupt)?;
        let expected = header.file_len();
        if actual < expected {
            return Err(truncated(expected));
        }
        if actual > expected {
            return Err(StorageError::Corrupt {
                path: path.to_path_buf(),
                reason: format!("{actual} bytes, {} more than the header accounts for", actual - expected),
            });
        }
        Ok((header, calls))
    }

    /// `O_DIRECT`, staged: aligned windows over each file's merged extents are read on a
    /// helper thread (all files in one stream, so the pipeline never drains between
    /// files) while the previous window's pieces are copied out.
    fn read_staged(
        &mut self,
        srcs: &mut [(&Source, &mut [&mut [u8]])],
        stats: &mut FetchStats,
    ) -> Result<(), StorageError> {
        let chunk = format::align_up(self.opts.direct_chunk_bytes.max(1) as u64);
        // (file, offset, length) and which source each window belongs to.
        let mut windows = Vec::new();
        let mut owner = Vec::new();
        for (k, (src, _)) in srcs.iter().enumerate() {
            for (a, b) in extents(&src.segs, self.opts.max_gap_bytes) {
                stats.runs += 1;
                let mut w = a;
                while w < b {
                    let n = chunk.min(b - w);
                    windows.push((&src.file, w, n));
                    owner.push(k);
                    stats.file_bytes += n;
                    w += n;
                }
            }
        }
        // Per source: the first piece that may still overlap a later window.
        let mut first = vec![0usize; srcs.len()];
        let mut copied = 0;
        let calls = io::staged_read(&windows, &mut self.staging, chunk as usize, |i, buf| {
            let k = owner[i];
            let (src, dst) = &mut srcs[k];
            let segs = &src.segs;
            let w = windows[i].1;
            let wend = w + buf.len() as u64;
            let first = &mut first[k];
            while *first < segs.len() && segs[*first].file + segs[*first].len <= w {
                *first += 1;
            }
            for (s, d) in segs[*first..].iter().zip(dst[*first..].iter_mut()) {
                if s.file >= wend {
                    break;
                }
                let lo = s.file.max(w);
                let hi = (s.file + s.len).min(wend);
                if lo < hi {
                    d[(lo - s.file) as usize..(hi - s.file) as usize]
                        .copy_from_slice(&buf[(lo - w) as usize..(hi - w) as usize]);
                    copied += hi - lo;
                }
            }
        })
        .map_err(|(i, e)| {
            let path = owner.get(i).map_or(&self.opts.dir, |&k| &srcs[k].0.path);
            io_err("read", path)(e)
        })?;
        stats.read_calls += calls;
        stats.bytes += copied;
        stats.staged_bytes += copied;
        Ok(())
    }
}

/// Whether `O_DIRECT` should read every piece straight into its destination: all
/// aligned, and large enough on average (see `StorageOptions::direct_min_piece_bytes`).
fn in_place(segs: &[Seg], dst: &[&mut [u8]], min_avg: u64) -> bool {
    let total: u64 = segs.iter().map(|s| s.len).sum();
    total / (segs.len() as u64).max(1) >= min_avg && all_aligned(segs, dst)
}

/// Whether `O_DIRECT` can read every piece straight into its destination.
fn all_aligned(segs: &[Seg], dst: &[&mut [u8]]) -> bool {
    segs.iter().zip(dst).all(|(s, d)| {
        s.file.is_multiple_of(ALIGN)
            && s.len.is_multiple_of(ALIGN)
            && (d.as_ptr() as usize).is_multiple_of(ALIGN as usize)
    })
}

/// Asks the kernel to start reading a file's extents now, so the reads of every file
/// overlap with each other and with the copies (hint only: errors are ignored).
fn read_ahead(src: &Source, max_gap: u64) {
    for (a, b) in extents(&src.segs, max_gap) {
        let _ =
            rustix::fs::fadvise(&src.file, a, std::num::NonZeroU64::new(b - a), rustix::fs::Advice::WillNeed);
    }
}

/// Vectored reads straight into decode memory: one `preadv` per file-contiguous run
/// (`IOV_MAX` pieces per call), no staging copy.
///
/// Measured on a P tp 8 -> D tp 2 fan-in from the page cache: the kernel copies into
/// 8 KiB pieces at a 32 KiB stride ~30% slower than into contiguous memory, and taking
/// turns between files in 64 KiB-4 MiB stripes did not recover any of it, so files are
/// read one after the other.
fn read_vectored(src: &Source, dst: &mut [&mut [u8]], stats: &mut FetchStats) -> Result<(), StorageError> {
    let segs = &src.segs;
    let mut i = 0;
    while i < segs.len() {
        // One run: pieces contiguous in the file (a piece overlapping the previous one,
        // two pairs reading the same bytes, starts a new run).
        let (first, start) = (i, segs[i].file);
        let mut end = start;
        while i < segs.len() && segs[i].file == end {
            end += segs[i].len;
            i += 1;
        }
        let mut ios: Vec<IoSliceMut<'_>> = dst[first..i].iter_mut().map(|d| IoSliceMut::new(d)).collect();
        stats.read_calls += io::preadv_all(&src.file, &mut ios, start).map_err(io_err("read", &src.path))?;
        stats.runs += 1;
        stats.file_bytes += end - start;
        stats.bytes += end - start;
    }
    Ok(())
}

/// Aligned file extents covering `segs` (sorted by file offset), merging across holes of
/// at most `max_gap` bytes.
fn extents(segs: &[Seg], max_gap: u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for s in segs {
        let (a, b) = (s.file / ALIGN * ALIGN, format::align_up(s.file + s.len));
        match out.last_mut() {
            Some(last) if a <= last.1.saturating_add(max_gap) => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

/// What the decode side expects a file's header to say.
struct ExpectedHeader<'a> {
    engine_id: &'a str,
    request_id: &'a str,
    regions: &'a [Region],
    blocks: &'a [u32],
}

impl ExpectedHeader<'_> {
    fn check(&self, h: &Header, p_rank: u32, path: &Path) -> Result<(), StorageError> {
        let mismatch = |what: String, found: String, expected: String| StorageError::Mismatch {
            path: path.to_path_buf(),
            what,
            found,
            expected,
        };
        if h.engine_id != self.engine_id {
            return Err(mismatch(
                "engine id".into(),
                format!("{:?}", h.engine_id),
                format!("{:?}", self.engine_id),
            ));
        }
        if h.request_id != self.request_id {
            return Err(mismatch(
                "request id".into(),
                format!("{:?}", h.request_id),
                format!("{:?}", self.request_id),
            ));
        }
        if h.p_rank != p_rank {
            return Err(mismatch("prefill rank".into(), h.p_rank.to_string(), p_rank.to_string()));
        }
        if h.regions.len() != self.regions.len() {
            return Err(mismatch(
                "a region count of".into(),
                h.regions.len().to_string(),
                format!(
                    "{} (the prefill geometry differs: same model, layout, TP and block size on both sides?)",
                    self.regions.len()
                ),
            ));
        }
        for (i, (found, r)) in h.regions.iter().zip(self.regions).enumerate() {
            let want = region_geom(r);
            if *found != want {
                return Err(mismatch(
                    format!("region {i} ({}) as", r.name),
                    describe_geom(found),
                    describe_geom(&want),
                ));
            }
        }
        if h.blocks.len() != self.blocks.len() {
            return Err(mismatch(
                "a block list of length".into(),
                h.blocks.len().to_string(),
                self.blocks.len().to_string(),
            ));
        }
        if let Some(i) = h.blocks.iter().zip(self.blocks).position(|(a, b)| a != b) {
            return Err(mismatch(
                format!("prefill block id at request position {i}:"),
                h.blocks[i].to_string(),
                self.blocks[i].to_string(),
            ));
        }
        Ok(())
    }
}

/// Maps prefill allocation offsets to file offsets.
struct Locator<'a> {
    regions: &'a [Region],
    /// Payload-relative offset of each region's run.
    region_start: Vec<u64>,
    /// Request position of each prefill block id (`u32::MAX`: not in the request).
    pos_of: Vec<u32>,
    hint: usize,
}

impl<'a> Locator<'a> {
    fn new(regions: &'a [Region], blocks: &[u32]) -> Result<Self, StorageError> {
        let n = blocks.len() as u64;
        let mut at = 0;
        let region_start = regions
            .iter()
            .map(|r| {
                let s = at;
                at += r.block_len * n;
                s
            })
            .collect();
        let pool = regions.iter().map(|r| r.num_blocks).max().unwrap_or(0);
        if let Some(&b) = blocks.iter().find(|&&b| u64::from(b) >= pool) {
            return Err(StorageError::Plan(format!(
                "prefill block id {b} is outside the prefill pool of {pool} blocks"
            )));
        }
        let pool = blocks.iter().map(|&b| b as usize + 1).max().unwrap_or(0);
        let mut pos_of = vec![u32::MAX; pool];
        for (i, &b) in blocks.iter().enumerate() {
            pos_of[b as usize] = i as u32;
        }
        Ok(Self { regions, region_start, pos_of, hint: 0 })
    }

    /// The region, block and offset in block holding prefill offset `remote`.
    fn find(&mut self, remote: u64) -> Option<(usize, u64, u64)> {
        let hit = |r: &Region| -> Option<(u64, u64)> {
            let rel = remote.checked_sub(r.base_off)?;
            let (b, o) = (rel / r.block_stride.max(1), rel % r.block_stride.max(1));
            (b < r.num_blocks && o < r.block_len).then_some((b, o))
        };
        // Plans are region-major: the last region (or the next) almost always matches.
        for ri in [self.hint, self.hint + 1] {
            if let Some((b, o)) = self.regions.get(ri).and_then(hit) {
                self.hint = ri;
                return Some((ri, b, o));
            }
        }
        let (ri, (b, o)) = self.regions.iter().enumerate().find_map(|(i, r)| hit(r).map(|x| (i, x)))?;
        self.hint = ri;
        Some((ri, b, o))
    }

    /// Appends the file pieces of pair `(remote, local, len)`, splitting it at block ends
    /// and merging with the previous piece when contiguous on both sides.
    fn map(
        &mut self,
        remote: u64,
        local: u64,
        len: u64,
        header_len: u64,
        out: &mut Vec<Seg>,
    ) -> Result<(), String> {
        let (mut remote, mut local, mut left) = (remote, local, len);
        while left > 0 {
            let (ri, b, o) = self.find(remote).ok_or_else(|| {
                format!("prefill offset {remote} is not inside any block of any prefill region")
            })?;
            let r = &self.regions[ri];
            let pos = self.pos_of.get(b as usize).copied().unwrap_or(u32::MAX);
            if pos == u32::MAX {
                return Err(format!(
                    "prefill offset {remote} is in block {b} of region {ri} ({}), which is not one of the request's blocks",
                    r.name
                ));
            }
            let n = left.min(r.block_len - o);
            let file = header_len + self.region_start[ri] + u64::from(pos) * r.block_len + o;
            match out.last_mut() {
                Some(s) if s.file + s.len == file && s.local + s.len == local => s.len += n,
                _ => out.push(Seg { file, local, len: n }),
            }
            remote += n;
            local += n;
            left -= n;
        }
        Ok(())
    }
}
