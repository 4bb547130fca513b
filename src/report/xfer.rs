//! `kvx xfer`'s data and its table: what a measurement is asked for ([`XferConfig`]: sizes,
//! reads in flight, memory, the initiator's UCX options, where the target runs) and what it
//! found ([`XferReport`], the JSON of `kvx xfer --format json` and of the rates files `kvx plan
//! --rates` reads), rendered as text by [`render_table`]; and [`protocol_warnings`], the advice a
//! device-memory run gets when UCX emulates its reads or writes (`kvx bench` gives it too).
//!
//! `diagnose::xfer` measures and fills these; `pipeline::bench` asks for one measurement as its
//! calibration through a runner it is handed, so both sides of that call name the same types
//! here, below them both. Owns: the shape of the report and its text. Must not measure, run
//! a transfer or print.

use serde::Serialize;

use crate::config::xfer::Misalign;
use crate::transfer::cuda_batch::BatchPath;
use crate::transfer::memory::MemPlace;
use crate::transfer::ucx::{ErrMode, ProgressMode, ProtoReport, Rma};

#[derive(Debug, Clone, Serialize)]
pub struct UcxReport {
    pub library: String,
    pub version: String,
    pub transports: String,
    pub source: String,
    pub err_mode: ErrMode,
    pub progress: ProgressMode,
    pub target_library: String,
    pub target_version: String,
    /// The protocols UCX selected for the reads (per memory-type pair), or why unknown.
    pub protocols: ProtoReport,
    /// UCX settings kvx chose on the user's behalf (`NAME=value (why)`).
    pub env: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct MemoryReport {
    pub kind: XferMemory,
    /// The CUDA device of device memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<u32>,
    pub huge_pages: bool,
    /// The pages the initiator's buffers actually got.
    pub pages: String,
    pub working_set_bytes: u64,
    pub residency: Residency,
}

/// What the initiator's buffers are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum XferMemory {
    /// The user's own host allocation (what a KV cache is without GPUs).
    Host,
    /// Host memory UCX allocated (flattering: not what a KV cache is).
    UcxAlloc,
    /// Device memory.
    Cuda,
}

impl XferMemory {
    /// Buffers in `place`; `ucx_alloc`: host ones allocated by UCX.
    pub fn of(place: MemPlace, ucx_alloc: bool) -> XferMemory {
        match place {
            MemPlace::Cuda { .. } => XferMemory::Cuda,
            MemPlace::Host if ucx_alloc => XferMemory::UcxAlloc,
            MemPlace::Host => XferMemory::Host,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            XferMemory::Host => "host",
            XferMemory::UcxAlloc => "ucx-alloc",
            XferMemory::Cuda => "cuda",
        }
    }
}

/// Where the bytes read sit when read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Residency {
    /// Rotating offsets over the working set: DRAM, as a KV cache is.
    Cold,
    /// The same offsets every time: cache-resident (`--hot`).
    Hot,
}

impl Residency {
    pub fn of(hot: bool) -> Residency {
        if hot { Residency::Hot } else { Residency::Cold }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Residency::Cold => "cold",
            Residency::Hot => "hot",
        }
    }
}

/// What a report's `ceiling_gbps` measured: one thread's memcpy (host memory) or a device
/// copy (device memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CeilingKind {
    Memcpy,
    DeviceCopy,
}

impl CeilingKind {
    /// The ceiling of a run over memory in `place`.
    pub fn over(place: MemPlace) -> CeilingKind {
        match place {
            MemPlace::Host => CeilingKind::Memcpy,
            MemPlace::Cuda { .. } => CeilingKind::DeviceCopy,
        }
    }
}

/// One (size, in-flight) case.
#[derive(Debug, Clone, Serialize)]
pub struct XferResult {
    pub size_bytes: u64,
    pub inflight: usize,
    pub gbps: f64,
    /// The same-run ceiling ([`XferReport::ceiling`] says which): a host memcpy, or a
    /// device-to-device copy of the same size and batch for device memory.
    pub ceiling_gbps: f64,
    pub ratio_to_ceiling: f64,
    /// Host memory only: the memcpy ceiling under its historical names.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memcpy_gbps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_to_memcpy: Option<f64>,
    /// Device memory only: the GPU's bandwidth for the batch's bytes, the same run's one
    /// `cuMemcpyDtoDAsync` of `size * inflight` bytes (at most the working set). The ceiling
    /// a batched transport such as cuda-batch can approach; `ceiling_gbps` (one copy per read)
    /// is what a transport that posts one copy per descriptor can.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bulk_copy_gbps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_to_bulk_copy: Option<f64>,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    /// Mean time to post one batch of `inflight` GETs.
    pub post_us: f64,
    /// Mean time from the start of a batch to its last completion.
    pub complete_us: f64,
    /// cuda-batch: mean host time packing a batch (bounds checks, merging), before posting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pack_us: Option<f64>,
    /// cuda-batch with the gather kernel: of `post_us`, the host's time writing the kernel's
    /// descriptors into pinned memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fill_us: Option<f64>,
    /// nixl: NIXL's own telemetry per batch (`nixl_capi_get_xfer_telemetry`), means over the
    /// timed batches: its post, and its transfer from post to completion.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nixl_post_us: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nixl_xfer_us: Option<f64>,
    /// nixl: kvx's clock around `make_xfer_req` (part of `post_us`; 0 with `--nixl-requests
    /// reuse`, whose requests are made before the timed batches) and around the release after
    /// completion (inside the measured time, after `complete_us`), means per timed batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nixl_make_us: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nixl_release_us: Option<f64>,
    pub msgs_per_sec: f64,
    pub batches: u64,
    pub bytes: u64,
    /// Bytes checked against the pattern: every destination byte of the verified batches.
    pub verified_bytes: u64,
    /// Timed batches whose destinations were checked, of `timed_batches` ([`VERIFY_EVERY`]:
    /// 1 in 16 cleared before and checked after, plus the last one).
    pub verified_batches: u64,
    /// The batches timed (the same as `batches`), so a reader sees "N of M verified".
    pub timed_batches: u64,
    /// Reads of the timed batches whose local or remote address or length is not a multiple
    /// of 16 (`--misalign`).
    pub unaligned_descriptors: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct XferReport {
    pub ucx: UcxReport,
    pub memory: MemoryReport,
    /// What `ceiling_gbps` measured.
    pub ceiling: CeilingKind,
    /// A slow path or an unknown protocol for device memory, with the fix.
    pub warnings: Vec<String>,
    pub results: Vec<XferResult>,
    /// `ucx` or `cuda-batch`.
    pub transport: String,
    /// `--transport cuda-batch`: the driver path that moved the batches.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cuda_batch: Option<XferBatchReport>,
    /// `--transport nixl`: the NIXL that moved the batches and how it was driven.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nixl: Option<XferNixlReport>,
    /// What `verified_bytes` and `verified_batches` mean: which timed batches were checked, and how.
    pub verification: String,
    /// `--misalign`: bytes added to every read's local and remote offset.
    #[serde(skip_serializing_if = "Misalign::is_none")]
    pub misalign: Misalign,
}

/// [`XferReport::verification`].
pub fn verification_rule() -> String {
    format!(
        "in place, on the timed reads: 1 timed batch in {VERIFY_EVERY} (the first included) has its \
         destinations cleared before it is posted and every byte of them checked against the target's \
         pattern after it completes, outside the measured time; the last timed batch's destinations are \
         checked after the loop"
    )
}

/// How `kvx xfer --transport cuda-batch` moved its batches.
#[derive(Debug, Clone, Serialize)]
pub struct XferBatchReport {
    /// `batch-v2`, `batch-v1` or `per-descriptor`.
    pub path: BatchPath,
    pub driver_call: String,
    /// Driver calls per batch of `inflight` reads (1 with the batch API).
    pub calls_per_batch: f64,
}

/// How `kvx xfer --transport nixl` drove NIXL, and which NIXL it was.
#[derive(Debug, Clone, Serialize)]
pub struct XferNixlReport {
    /// `libnixl_capi.so` as loaded.
    pub library: String,
    /// The wheel's version, where its `dist-info` says.
    pub version: Option<String>,
    /// NIXL's own UCX (not kvx's), and its version.
    pub bundled_ucx: Option<String>,
    pub bundled_ucx_version: Option<String>,
    pub backend: String,
    /// The backend's parameters after initialisation (NIXL's names and values).
    pub backend_params: Vec<(String, String)>,
    pub progress_thread: bool,
    /// Whether NIXL merged descriptors contiguous on both sides (kvx xfer asks it not to, so
    /// that each read stays one GET as with `--transport ucx`).
    pub desc_merge: bool,
    /// What one batch is: `make_xfer_req` on two prepared lists, post, poll, release.
    /// How requests were made (`--nixl-requests`).
    #[serde(default)]
    pub requests: crate::config::xfer::NixlRequests,
    pub per_batch: String,
}

/// One timed batch in this many has its destinations cleared before it is posted and every
/// byte of them checked after it completes (the first timed batch always, and the last one
/// when `--iters` says which it is): the rule `diagnose::xfer` samples by and
/// [`verification_rule`] states.
pub const VERIFY_EVERY: u64 = 16;

/// Warnings for a device-memory run whose `op`s (the GETs of a pull, the PUTs of a push)
/// UCX emulates in software, or whose protocol is unknown, each with the reason and the
/// fix. Host memory gets none here (`kvx doctor` explains host-memory emulation).
pub fn protocol_warnings(
    mem: MemPlace,
    op: Rma,
    protocols: &ProtoReport,
    env: &[String],
    transports: &str,
) -> Vec<String> {
    if !mem.is_device() {
        return Vec::new();
    }
    let verb = match op {
        Rma::Get => "read",
        Rma::Put => "write",
    };
    let uses: Vec<_> = protocols.device_uses(op).collect();
    if uses.is_empty() {
        return vec![format!(
            "the protocol UCX uses to {verb} device memory is unknown ({}); run with UCX_PROTO_INFO=y to see \
             whether it is `software emulation` (the slow path) or `zero-copy cuda_ipc`",
            protocols.summary()
        )];
    }
    // GET zero-copy over cuda_ipc is off by default where GPUs have no NVLink; PUT's is on.
    let zcopy = match op {
        Rma::Get => format!(
            "(3) UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y where GPUs have no NVLink (here: {}), ",
            if env.is_empty() { "not set".to_string() } else { env.join("; ") }
        ),
        Rma::Put => String::new(),
    };
    let library = if zcopy.is_empty() { "(3)" } else { "(4)" };
    uses.into_iter()
        .filter(|u| u.emulated)
        .map(|u| {
            format!(
                "UCX {verb}s device memory by software emulation ({u}): expect well under 1 GB/s. It needs (1) a \
                 CUDA context current before UCX starts and alive as long as UCX (kvx does this for its own \
                 processes; `kvx doctor` checks it), (2) device memory CUDA IPC can export (cuMemAlloc, not the \
                 stream-ordered pool), {zcopy}{library} a UCX built with CUDA (this one selected {transports}; use \
                 libucx/lib/libucp.so.0 of the PyPI wheel libucx-cu12 or libucx-cu13 with --ucx-lib)"
            )
        })
        .collect()
}

/// Human-readable size: 4KiB, 64MiB.
pub fn fmt_size(b: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (m, u) in UNITS {
        if b >= m && b.is_multiple_of(m) {
            return format!("{}{u}", b / m);
        }
    }
    format!("{b}B")
}

/// The table view of a report (`kvx xfer`'s default output).
pub fn render_table(r: &XferReport) -> String {
    let mut out = String::new();
    let memory = match r.memory.device {
        Some(d) => format!("{} (device {d})", r.memory.kind.as_str()),
        None => format!("{} ({})", r.memory.kind.as_str(), r.memory.pages),
    };
    if let Some(b) = &r.cuda_batch {
        out.push_str(&format!(
            "cuda-batch: {} ({}), {:.0} driver call(s) per batch, CUDA IPC between two processes\n\
             memory {memory}  {}  working set {}\n",
            b.driver_call,
            b.path,
            b.calls_per_batch,
            r.memory.residency.as_str(),
            fmt_size(r.memory.working_set_bytes),
        ));
        return out + &misalign_line(r) + &results_table(r) + &verification_line(r);
    }
    if let Some(n) = &r.nixl {
        out.push_str(&nixl_header(n, &memory, r));
        return out + &misalign_line(r) + &results_table(r) + &nixl_phases(r) + &verification_line(r);
    }
    out.push_str(&format!(
        "UCX {} ({}, {})  transports: {}\nerr-mode {}  progress {}  memory {memory}  {}  working set {}\n",
        r.ucx.version,
        r.ucx.library,
        r.ucx.source,
        r.ucx.transports,
        r.ucx.err_mode,
        r.ucx.progress,
        r.memory.residency.as_str(),
        fmt_size(r.memory.working_set_bytes),
    ));
    out.push_str(&format!("protocols: {}\n", r.ucx.protocols.summary()));
    for e in &r.ucx.env {
        out.push_str(&format!("ucx setting: {e}\n"));
    }
    for w in &r.warnings {
        out.push_str(&format!("warning: {w}\n"));
    }
    if r.memory.kind == XferMemory::UcxAlloc || r.memory.residency == Residency::Hot {
        out.push_str(
            "note: hot and/or UCX-allocated buffers flatter the numbers; a KV cache is cold user memory\n",
        );
    }
    out + &misalign_line(r) + &results_table(r) + &verification_line(r)
}

/// What moved the bytes with `--transport nixl`, and how it was driven.
fn nixl_header(n: &XferNixlReport, memory: &str, r: &XferReport) -> String {
    let unknown = || "version unknown".to_owned();
    let ucx = match (&n.bundled_ucx_version, &n.bundled_ucx) {
        (Some(v), _) => format!("NIXL's own UCX {v}"),
        (None, Some(p)) => format!("NIXL's own UCX ({p})"),
        (None, None) => "NIXL's own UCX (not found)".to_owned(),
    };
    let params = n.backend_params.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ");
    format!(
        "NIXL {} ({})  backend {} over {ucx}  [{params}]\nprogress thread {}  descriptor merging {}  memory {memory}  {}  working set {}\nper batch: {}\n",
        n.version.clone().unwrap_or_else(unknown),
        n.library,
        n.backend,
        if n.progress_thread { "on" } else { "off (each side progresses NIXL when it polls)" },
        if n.desc_merge { "on" } else { "off (one GET per read, as --transport ucx)" },
        r.memory.residency.as_str(),
        fmt_size(r.memory.working_set_bytes),
        n.per_batch,
    )
}

/// Where a NIXL batch's time went, means per timed batch: kvx's clock around `make_xfer_req`,
/// the post and the wait to DONE, and the release; NIXL's own telemetry of its post and
/// transfer beside them.
fn nixl_phases(r: &XferReport) -> String {
    let rows: Vec<&XferResult> = r.results.iter().filter(|x| x.nixl_make_us.is_some()).collect();
    if rows.is_empty() {
        return String::new();
    }
    let mut t = comfy_table::Table::new();
    t.load_style(comfy_table::presets::ASCII_BORDERS_ONLY_CONDENSED);
    t.set_header(vec![
        "size",
        "inflight",
        "make us",
        "post us",
        "to DONE us",
        "release us",
        "batch us",
        "NIXL post us",
        "NIXL xfer us",
    ]);
    let us = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"));
    for x in rows {
        let make = x.nixl_make_us.unwrap_or(0.0);
        let release = x.nixl_release_us.unwrap_or(0.0);
        t.add_row(vec![
            fmt_size(x.size_bytes),
            x.inflight.to_string(),
            format!("{make:.1}"),
            format!("{:.1}", x.post_us - make),
            format!("{:.1}", x.complete_us - x.post_us),
            format!("{release:.1}"),
            format!("{:.1}", x.complete_us + release),
            us(x.nixl_post_us),
            us(x.nixl_xfer_us),
        ]);
    }
    format!(
        "NIXL's phases per batch (means over the timed batches; kvx's clock, NIXL's telemetry in the last two columns)\n{t}\n"
    )
}

/// `--misalign`'s shift, when there is one.
fn misalign_line(r: &XferReport) -> String {
    if r.misalign.is_none() {
        return String::new();
    }
    format!(
        "misaligned: every read's local offset +{} B, remote offset +{} B\n",
        r.misalign.local_bytes, r.misalign.remote_bytes
    )
}

/// What the `verified` columns mean.
fn verification_line(r: &XferReport) -> String {
    format!("verified: {}\n", r.verification)
}

/// The per-case rows.
fn results_table(r: &XferReport) -> String {
    let mut out = String::new();
    let mut t = comfy_table::Table::new();
    t.load_style(comfy_table::presets::ASCII_BORDERS_ONLY_CONDENSED);
    let (ceiling, ratio) = match r.ceiling {
        CeilingKind::DeviceCopy => ("device copy GB/s", "vs device copy"),
        CeilingKind::Memcpy => ("memcpy GB/s", "ratio"),
    };
    // Device memory also names the GPU's bandwidth for each batch's bytes (one copy).
    let bulk = r.results.iter().any(|x| x.bulk_copy_gbps.is_some());
    let mut header = vec!["size", "inflight", "GB/s", ceiling, ratio];
    if bulk {
        header.extend(["bulk copy GB/s", "vs bulk"]);
    }
    header.extend(["p50 us", "p99 us", "post us", "done us", "msgs/s"]);
    // Unaligned descriptors per batch: always with cuda-batch (the kernel's path depends on
    // it), elsewhere when there are any.
    let unaligned = r.cuda_batch.is_some() || r.results.iter().any(|x| x.unaligned_descriptors > 0);
    if unaligned {
        header.push("unaligned/batch");
    }
    header.extend(["verified batches", "verified"]);
    t.set_header(header);
    for x in &r.results {
        let mut row = vec![fmt_size(x.size_bytes), x.inflight.to_string(), format!("{:.2}", x.gbps)];
        row.extend([format!("{:.2}", x.ceiling_gbps), format!("{:.2}", x.ratio_to_ceiling)]);
        if bulk {
            let f = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.2}"));
            row.extend([f(x.bulk_copy_gbps), f(x.ratio_to_bulk_copy)]);
        }
        row.extend([
            format!("{:.1}", x.p50_us),
            format!("{:.1}", x.p99_us),
            format!("{:.1}", x.post_us),
            format!("{:.1}", x.complete_us),
            format!("{:.0}", x.msgs_per_sec),
        ]);
        if unaligned {
            row.push(format!("{:.0}", x.unaligned_descriptors as f64 / x.timed_batches.max(1) as f64));
        }
        row.extend([format!("{} of {}", x.verified_batches, x.timed_batches), fmt_size(x.verified_bytes)]);
        t.add_row(row);
    }
    out.push_str(&t.to_string());
    out.push('\n');
    out
}

/// One case of `kvx xfer --compare-transports`: its GB/s on each transport (in the order
/// given), and each one's ratio to the first transport's.
#[derive(Debug, Clone, Serialize)]
pub struct ComparisonRow {
    pub size_bytes: u64,
    pub inflight: usize,
    /// `(transport, GB/s, ratio to the same run's ceiling)`.
    pub gbps: Vec<(String, f64, f64)>,
    /// Each transport's GB/s over the first's.
    pub ratio_to_first: Vec<(String, f64)>,
    /// `--rounds`: the rounds' ratios to the first transport, `(transport, min, max)`, beside
    /// their median in `ratio_to_first` (whose GB/s are the rounds' medians); empty for one
    /// round.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ratio_range: Vec<(String, f64, f64)>,
    /// Rounds measured (`--rounds`).
    pub rounds: usize,
}

/// The same cases over several rounds (each round's rows from [`comparison`]): each GB/s and
/// ceiling ratio the median of its rounds, each ratio to the first transport the median of the
/// rounds' ratios, with their range.
pub fn merge_rounds(rounds: &[Vec<ComparisonRow>]) -> Vec<ComparisonRow> {
    let Some(first) = rounds.first() else { return Vec::new() };
    if rounds.len() == 1 {
        return first.clone();
    }
    let med = |v: Vec<f64>| super::stats::median(&v).unwrap_or(0.0);
    first
        .iter()
        .map(|base| {
            let same: Vec<&ComparisonRow> = rounds
                .iter()
                .filter_map(|rows| {
                    rows.iter().find(|r| r.size_bytes == base.size_bytes && r.inflight == base.inflight)
                })
                .collect();
            let gbps = base
                .gbps
                .iter()
                .map(|(t, _, _)| {
                    let of = |f: fn(&(String, f64, f64)) -> f64| {
                        med(same.iter().flat_map(|r| r.gbps.iter().filter(|g| &g.0 == t).map(f)).collect())
                    };
                    (t.clone(), of(|g| g.1), of(|g| g.2))
                })
                .collect();
            let ratios = |t: &str| -> Vec<f64> {
                same.iter().flat_map(|r| r.ratio_to_first.iter().filter(|x| x.0 == t).map(|x| x.1)).collect()
            };
            ComparisonRow {
                size_bytes: base.size_bytes,
                inflight: base.inflight,
                gbps,
                ratio_to_first: base
                    .ratio_to_first
                    .iter()
                    .map(|(t, _)| (t.clone(), med(ratios(t))))
                    .collect(),
                ratio_range: base
                    .ratio_to_first
                    .iter()
                    .map(|(t, _)| {
                        let v = ratios(t);
                        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
                        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                        (t.clone(), lo, hi)
                    })
                    .collect(),
                rounds: same.len(),
            }
        })
        .collect()
}

/// The cases every report measured, side by side.
pub fn comparison(reports: &[(&str, &XferReport)]) -> Vec<ComparisonRow> {
    let Some((_, first)) = reports.first() else { return Vec::new() };
    first
        .results
        .iter()
        .map(|base| {
            let same = |r: &XferReport| {
                r.results
                    .iter()
                    .find(|x| x.size_bytes == base.size_bytes && x.inflight == base.inflight)
                    .cloned()
            };
            let found: Vec<(String, Option<XferResult>)> =
                reports.iter().map(|(t, r)| ((*t).to_owned(), same(r))).collect();
            ComparisonRow {
                size_bytes: base.size_bytes,
                inflight: base.inflight,
                gbps: found
                    .iter()
                    .filter_map(|(t, x)| x.as_ref().map(|x| (t.clone(), x.gbps, x.ratio_to_ceiling)))
                    .collect(),
                ratio_to_first: found
                    .iter()
                    .filter_map(|(t, x)| {
                        x.as_ref().filter(|_| base.gbps > 0.0).map(|x| (t.clone(), x.gbps / base.gbps))
                    })
                    .collect(),
                ratio_range: Vec::new(),
                rounds: 1,
            }
        })
        .collect()
}

/// The comparison as a table: one row per case, GB/s (and ratio to the ceiling) per transport,
/// then each transport over the first.
pub fn render_comparison(rows: &[ComparisonRow]) -> String {
    let names: Vec<String> =
        rows.first().map(|r| r.gbps.iter().map(|g| g.0.clone()).collect()).unwrap_or_default();
    let mut header = vec!["size".to_string(), "inflight".to_string()];
    header.extend(names.iter().map(|n| format!("{n} GB/s (vs ceiling)")));
    header.extend(names.iter().skip(1).map(|n| format!("{n} / {}", names[0])));
    let mut t = comfy_table::Table::new();
    t.load_style(comfy_table::presets::ASCII_BORDERS_ONLY_CONDENSED);
    t.set_header(header);
    for r in rows {
        let mut row = vec![fmt_size(r.size_bytes), r.inflight.to_string()];
        row.extend(r.gbps.iter().map(|(_, g, c)| format!("{g:.2} ({c:.2})")));
        row.extend(r.ratio_to_first.iter().skip(1).map(
            |(t, x)| match r.ratio_range.iter().find(|g| &g.0 == t) {
                Some((_, lo, hi)) => format!("{x:.2}x ({lo:.2}-{hi:.2})"),
                None => format!("{x:.2}x"),
            },
        ));
        t.add_row(row);
    }
    let rounds = rows.iter().map(|r| r.rounds).max().unwrap_or(1);
    let how = if rounds > 1 {
        format!(
            "same cases, {rounds} rounds in this run, the transports' order reversed every other round: medians of \
             the rounds, and the median of the rounds' ratios with their range"
        )
    } else {
        "same cases, one transport after the other in this run".to_owned()
    };
    format!("{how} (GB/s = 1e9 B/s; the ceiling is each run's own)\n{t}\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(size: u64, inflight: usize, gbps: f64, bulk: Option<f64>) -> XferResult {
        XferResult {
            size_bytes: size,
            inflight,
            gbps,
            ceiling_gbps: 2.0,
            ratio_to_ceiling: gbps / 2.0,
            memcpy_gbps: None,
            ratio_to_memcpy: None,
            bulk_copy_gbps: bulk,
            ratio_to_bulk_copy: bulk.map(|b| gbps / b),
            p50_us: 100.0,
            p99_us: 110.0,
            max_us: 120.0,
            post_us: 25.0,
            complete_us: 104.0,
            pack_us: None,
            fill_us: None,
            nixl_post_us: None,
            nixl_xfer_us: None,
            nixl_make_us: None,
            nixl_release_us: None,
            msgs_per_sec: 1e6,
            batches: 3,
            bytes: size * inflight as u64 * 3,
            verified_bytes: size * inflight as u64,
            verified_batches: 1,
            timed_batches: 3,
            unaligned_descriptors: 0,
        }
    }

    fn report(memory: XferMemory, ceiling: CeilingKind, results: Vec<XferResult>) -> XferReport {
        XferReport {
            ucx: UcxReport {
                library: "libucp.so.0".into(),
                version: "1.22.0".into(),
                transports: "cuda_ipc/cuda".into(),
                source: "--ucx-lib".into(),
                err_mode: ErrMode::None,
                progress: ProgressMode::default(),
                target_library: "libucp.so.0".into(),
                target_version: "1.22.0".into(),
                protocols: crate::transfer::ucx::ProtoReport { uses: Vec::new(), note: Some("test".into()) },
                env: Vec::new(),
            },
            memory: MemoryReport {
                kind: memory,
                device: (memory == XferMemory::Cuda).then_some(0),
                huge_pages: false,
                pages: "4KiB".into(),
                working_set_bytes: 1 << 30,
                residency: Residency::Cold,
            },
            ceiling,
            warnings: Vec::new(),
            results,
            transport: "ucx".into(),
            cuda_batch: None,
            nixl: None,
            verification: verification_rule(),
            misalign: Misalign::default(),
        }
    }

    #[test]
    fn device_memory_tables_add_the_bulk_copy_and_host_tables_do_not() {
        let cuda = render_table(&report(
            XferMemory::Cuda,
            CeilingKind::DeviceCopy,
            vec![result(8192, 10_240, 497.0, Some(1277.0)), result(8192, 1, 0.7, None)],
        ));
        let header = cuda.lines().find(|l| l.contains("inflight")).expect("a header");
        for col in ["device copy GB/s", "vs device copy", "bulk copy GB/s", "vs bulk"] {
            assert!(header.contains(col), "{col} missing from {header}");
        }
        let row = cuda.lines().find(|l| l.contains("10240")).expect("the 10,240 row");
        assert!(row.contains("1277.00") && row.contains("0.39"), "{row}");
        // A case without the figure shows a dash, not a zero.
        let one = cuda.lines().find(|l| l.contains("0.70")).expect("the batch-of-1 row");
        assert!(one.contains(" - "), "{one}");
        let host =
            render_table(&report(XferMemory::Host, CeilingKind::Memcpy, vec![result(65536, 32, 5.0, None)]));
        assert!(!host.contains("bulk"), "{host}");
        assert!(host.contains("memcpy GB/s"), "{host}");
    }

    #[test]
    fn tables_say_how_many_timed_batches_were_verified_and_how() {
        let mut r = result(8192, 64, 5.0, None);
        (r.verified_batches, r.timed_batches, r.unaligned_descriptors) = (5, 70, 0);
        let host = render_table(&report(XferMemory::Host, CeilingKind::Memcpy, vec![r.clone()]));
        assert!(host.contains("verified batches") && host.contains("5 of 70"), "{host}");
        assert!(host.contains("verified: in place, on the timed reads: 1 timed batch in 16"), "{host}");
        assert!(!host.contains("unaligned"), "no column without unaligned reads: {host}");
        r.unaligned_descriptors = 70 * 64;
        let mut rep = report(XferMemory::Host, CeilingKind::Memcpy, vec![r]);
        rep.misalign = Misalign { local_bytes: 3, remote_bytes: 3 };
        let shifted = render_table(&rep);
        assert!(shifted.contains("unaligned/batch"), "{shifted}");
        assert!(
            shifted.contains("misaligned: every read's local offset +3 B, remote offset +3 B"),
            "{shifted}"
        );
        let row = shifted.lines().find(|l| l.contains("8KiB")).expect("the row");
        assert!(row.contains(" 64 "), "64 unaligned reads per batch: {row}");
    }

    #[test]
    fn sizes_format_back() {
        assert_eq!(fmt_size(64 << 10), "64KiB");
        assert_eq!(fmt_size(3 << 30), "3GiB");
        assert_eq!(fmt_size(1000), "1000B");
    }

    fn proto_report(op: &str, description: &str, config: &str) -> ProtoReport {
        let sel = crate::transfer::ucx::ProtoSelection {
            op: op.into(),
            local: "cuda/GPU0".into(),
            remote: "cuda/dev[0]".into(),
            range: "0..inf".into(),
            description: description.into(),
            config: config.into(),
        };
        ProtoReport { uses: crate::transfer::ucx::summarize_protocols(&[sel]), note: None }
    }

    #[test]
    fn device_memory_moved_by_emulation_warns_with_the_fix_for_its_operation() {
        let dev = MemPlace::Cuda { device: 0 };
        let env = vec!["UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y (kvx: device memory)".to_string()];
        let emulated_get = proto_report("get", "software emulation", "sysv/memory");
        let w = protocol_warnings(dev, Rma::Get, &emulated_get, &env, "sysv/memory");
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].starts_with("UCX reads device memory by software emulation"), "{}", w[0]);
        assert!(w[0].contains("UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y (kvx"), "names the setting: {}", w[0]);
        // PUT zero-copy is on without any setting: a push's warning does not send the user there.
        let emulated_put = proto_report("put", "software emulation", "sysv/memory");
        let w = protocol_warnings(dev, Rma::Put, &emulated_put, &env, "sysv/memory");
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].starts_with("UCX writes device memory by software emulation"), "{}", w[0]);
        assert!(!w[0].contains("GET_ZCOPY") && w[0].contains("(3) a UCX built with CUDA"), "{}", w[0]);
        // Zero-copy over cuda_ipc: nothing to say.
        let fast = proto_report("put", "zero-copy", "cuda_ipc/cuda");
        assert!(protocol_warnings(dev, Rma::Put, &fast, &env, "cuda_ipc/cuda").is_empty());
        // The other operation's selection says nothing about this one's: unknown, by name.
        let w = protocol_warnings(dev, Rma::Get, &fast, &env, "cuda_ipc/cuda");
        assert!(w.len() == 1 && w[0].contains("to read device memory is unknown"), "{w:?}");
        // Host memory: no warning here (kvx doctor explains host-memory emulation).
        assert!(protocol_warnings(MemPlace::Host, Rma::Get, &emulated_get, &env, "").is_empty());
    }
}
