//! The tables of `kvx bench --compare-transports` (connectors in the shape of vLLM's guide,
//! measured, and those not measured here with the reason) and `--compare-modes` (pull against
//! push). Pure: `pipeline::compare` runs the workloads and fills the rows.

use super::table::{Style, new_table};
use crate::topology::TransferMode;
use crate::vocab::kinds::{KvBufferDevice, TransportKind};

/// What a compared run was set to: the one setting the runs of a comparison differ in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunSetting {
    Transport(TransportKind),
    Mode(TransferMode),
    KvBuffer(KvBufferDevice),
}

impl RunSetting {
    /// As its flag names it: `ucx`, `push`, `cpu`.
    pub fn as_str(self) -> &'static str {
        match self {
            RunSetting::Transport(t) => t.as_str(),
            RunSetting::Mode(m) => m.as_str(),
            RunSetting::KvBuffer(k) => k.as_str(),
        }
    }

    /// The run's name in its table: the setting and what it models.
    fn label(self) -> &'static str {
        match self {
            RunSetting::Transport(TransportKind::Ucx) => "ucx (NixlConnector's model)",
            RunSetting::Transport(TransportKind::Storage) => "storage (SharedStorageConnector's model)",
            RunSetting::Transport(TransportKind::Multi) => {
                "multi: ucx, then storage (MultiConnector's model)"
            }
            RunSetting::Transport(TransportKind::CudaBatch) => "cuda-batch (one batched copy per peer)",
            RunSetting::Transport(TransportKind::Nixl) => "nixl (NixlConnector itself: NIXL's UCX)",
            RunSetting::Mode(TransferMode::Pull) => "pull (NixlConnector: decode READs)",
            RunSetting::Mode(TransferMode::Push) => "push (NixlPushConnector: prefill WRITEs)",
            RunSetting::KvBuffer(KvBufferDevice::Cuda) => "cuda (the KV pool itself)",
            RunSetting::KvBuffer(KvBufferDevice::Cpu) => "cpu (host buffers, two copies)",
        }
    }
}

/// One run's figures for the table.
pub struct RunRow {
    pub setting: RunSetting,
    pub transfer: (f64, f64),
    pub e2e: (f64, f64),
    /// Prefill start to the KV in decode's blocks (`kv_ready`), p50 and p99.
    pub ready: (f64, f64),
    /// Push: the WRITE time hidden behind prefill (`push_hidden`), p50.
    pub hidden_p50: Option<f64>,
    pub post_p50: f64,
    pub notify_p50: f64,
    /// Host buffer: prefill's copy to it and decode's copy from it (`save_to_host`,
    /// `sync_to_device`), p50.
    pub save_p50: Option<f64>,
    pub sync_p50: Option<f64>,
    pub descriptors: f64,
    pub gbps: f64,
    pub cpu_per_gb: f64,
    pub failed: u64,
    /// Throughput against the first run's, round by round (`None` where the first run has
    /// none to compare with).
    pub vs_first: Option<Spread>,
    /// Rounds this run measured (`--rounds`); its figures are their medians.
    pub rounds: usize,
}

/// Ratios over a comparison's rounds: their median and range.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub n: usize,
}

impl Spread {
    pub fn of(v: &[f64]) -> Spread {
        Spread {
            median: super::stats::median(v).unwrap_or(0.0),
            min: v.iter().copied().fold(f64::INFINITY, f64::min),
            max: v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            n: v.len(),
        }
    }

    /// `0.93x`, or with several rounds `0.93x (0.88-0.97, 5 rounds)`.
    pub fn cell(&self) -> String {
        if self.n > 1 {
            format!("{:.2}x ({:.2}-{:.2}, {} rounds)", self.median, self.min, self.max, self.n)
        } else {
            format!("{:.2}x", self.median)
        }
    }
}

/// What a connector needs, for the table.
fn needs(setting: RunSetting) -> &'static str {
    match setting {
        RunSetting::Transport(TransportKind::Ucx) => {
            "UCX (RDMA NIC, NVLink or shared memory); a side channel (ZMQ) to handshake"
        }
        RunSetting::Transport(TransportKind::Storage) => {
            "a directory both sides reach (local disk, NFS, Lustre); no NIC or service"
        }
        RunSetting::Transport(TransportKind::Multi) => {
            "both of the above; storage is used only when UCX fails"
        }
        RunSetting::Transport(TransportKind::CudaBatch) => {
            "GPUs of one machine (CUDA IPC), a CUDA 12.8+ driver for the batch API; ZMQ to notify"
        }
        RunSetting::Transport(TransportKind::Nixl) => {
            "NIXL (its wheel's C API and UCX); a side channel (ZMQ) carrying vLLM's handshake"
        }
        RunSetting::Mode(_) | RunSetting::KvBuffer(_) => "",
    }
}

/// Connectors of vLLM's guide kvx does not measure here, with the reason.
const NOT_MEASURED: &[(&str, &str, &str)] = &[
    ("PyNcclConnector", "medium (vLLM's guide)", "needs NVIDIA GPUs and NCCL: no GPU on this machine"),
    ("P2pNcclConnector", "medium (vLLM's guide)", "needs NVIDIA GPUs and NCCL: no GPU on this machine"),
    ("LMCacheConnectorV1", "variable (vLLM's guide)", "needs an LMCache server (external service) and GPUs"),
];

fn failed_suffix(failed: u64) -> String {
    if failed > 0 { format!(" ({failed} failed)") } else { String::new() }
}

/// The connector table in the shape of vLLM's guide, measured, plus what is not measured.
pub fn transports_table(rows: &[RunRow]) -> String {
    let mut t = new_table(
        Style::Terminal,
        &[
            "connector",
            "transfer p50/p99 ms",
            "e2e p50/p99 ms",
            "throughput GB/s",
            "vs first",
            "CPU s per GB",
            "needs",
        ],
    );
    for r in rows {
        t.add_row(vec![
            format!("{}{}", r.setting.label(), failed_suffix(r.failed)),
            format!("{:.2} / {:.2}", r.transfer.0, r.transfer.1),
            format!("{:.2} / {:.2}", r.e2e.0, r.e2e.1),
            format!("{:.3}", r.gbps),
            r.vs_first.map_or_else(|| "-".into(), |v| v.cell()),
            format!("{:.2}", r.cpu_per_gb),
            needs(r.setting).to_string(),
        ]);
    }
    for (name, guide, why) in NOT_MEASURED {
        t.add_row(vec![
            (*name).to_string(),
            "not measured".into(),
            "not measured".into(),
            (*guide).to_string(),
            "-".into(),
            "-".into(),
            (*why).to_string(),
        ]);
    }
    format!("\nConnectors, measured on this machine (same workload each{})\n{t}\n", rounds_note(rows))
}

/// Pull against push: what each moves and how fast, and the ratio to the first run.
/// A comparison row's first cells: the run (and its failures), throughput, throughput against
/// the first run, KV ready p50/p99.
fn lead_cells(r: &RunRow, base: f64) -> Vec<String> {
    let vs = match r.vs_first {
        Some(v) => v.cell(),
        None if base > 0.0 => format!("{:.2}x", r.gbps / base),
        None => "-".into(),
    };
    vec![
        format!("{}{}", r.setting.label(), failed_suffix(r.failed)),
        format!("{:.3}", r.gbps),
        vs,
        format!("{:.2} / {:.2}", r.ready.0, r.ready.1),
    ]
}

/// How a comparison of several rounds was run, for its table's title.
fn rounds_note(rows: &[RunRow]) -> String {
    match rows.iter().map(|r| r.rounds).max() {
        Some(n) if n > 1 => format!(
            "; {n} rounds, runs interleaved, order reversed every other round: medians, and the median of the \
             rounds' ratios to the first run with their range"
        ),
        _ => String::new(),
    }
}

/// `--compare-kv-buffer-device`: what staging through host buffers costs against reading the
/// KV pool itself, on the same workload.
pub fn kv_buffer_table(rows: &[RunRow]) -> String {
    let mut t = new_table(
        Style::Terminal,
        &[
            "KV buffer",
            "throughput GB/s",
            "vs first",
            "KV ready p50/p99 ms",
            "save_to_host p50 ms",
            "transfer p50/p99 ms",
            "sync_to_device p50 ms",
            "e2e p50/p99 ms",
            "descriptors/request",
            "CPU s per GB",
        ],
    );
    let base = rows.first().map_or(0.0, |r| r.gbps);
    let ms = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.3}"));
    for r in rows {
        let mut row = lead_cells(r, base);
        row.extend([
            ms(r.save_p50),
            format!("{:.2} / {:.2}", r.transfer.0, r.transfer.1),
            ms(r.sync_p50),
            format!("{:.2} / {:.2}", r.e2e.0, r.e2e.1),
            format!("{:.0}", r.descriptors),
            format!("{:.2}", r.cpu_per_gb),
        ]);
        t.add_row(row);
    }
    format!(
        "\nThe KV pool and a host buffer (vLLM's kv_buffer_device), measured on this machine (same workload \
         each). save_to_host = prefill's copy of a request's blocks from its pool to its host buffer; \
         sync_to_device = decode's copy of the received blocks into its pool (each the slowest rank's); \
         transfer = the reads, host buffer to host buffer with cpu. KV ready (prefill leg sent to the KV in \
         every decode rank's pool) includes both copies: the figure that compares the two{}.\n{t}\n",
        rounds_note(rows)
    )
}

pub fn modes_table(rows: &[RunRow]) -> String {
    let mut t = new_table(
        Style::Terminal,
        &[
            "mode",
            "throughput GB/s",
            "vs first",
            "KV ready p50/p99 ms",
            "transfer p50/p99 ms",
            "hidden p50 ms",
            "e2e p50/p99 ms",
            "post p50 ms",
            "notify p50 ms",
            "descriptors/request",
            "CPU s per GB",
        ],
    );
    let base = rows.first().map_or(0.0, |r| r.gbps);
    for r in rows {
        let mut row = lead_cells(r, base);
        row.extend([
            format!("{:.2} / {:.2}", r.transfer.0, r.transfer.1),
            r.hidden_p50.map_or_else(|| "-".into(), |h| format!("{h:.2}")),
            format!("{:.2} / {:.2}", r.e2e.0, r.e2e.1),
            format!("{:.3}", r.post_p50),
            format!("{:.3}", r.notify_p50),
            format!("{:.0}", r.descriptors),
            format!("{:.2}", r.cpu_per_gb),
        ]);
        t.add_row(row);
    }
    format!(
        "\nPull and push, measured on this machine (same workload each). KV ready = from sending the \
         prefill leg to the KV in every decode rank's blocks (prefill, handoff, transfer): the figure that \
         compares the modes. Push: post = decode's registration, transfer = registration to the last \
         WRITE's notification (the prefill ranks' posting, transfer, flush and notification inside it), \
         hidden = WRITE time spent while prefill still computed (--overlap layers), notify = 0 (the \
         notifications are part of the transfer); descriptors count duplicate WRITEs of replicated heads{}.\n{t}\n",
        rounds_note(rows)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(mode: TransferMode, gbps: f64, vs_first: Option<Spread>, rounds: usize) -> RunRow {
        RunRow {
            setting: RunSetting::Mode(mode),
            transfer: (1.0, 2.0),
            e2e: (1.5, 2.5),
            ready: (1.2, 2.2),
            hidden_p50: None,
            post_p50: 0.1,
            notify_p50: 0.2,
            save_p50: None,
            sync_p50: None,
            descriptors: 10.0,
            gbps,
            cpu_per_gb: 0.5,
            failed: 0,
            vs_first,
            rounds,
        }
    }

    #[test]
    fn rounds_show_the_median_ratio_its_range_and_how_they_ran() {
        let spread = Spread::of(&[0.9, 1.2, 1.0]);
        assert_eq!((spread.median, spread.min, spread.max, spread.n), (1.0, 0.9, 1.2, 3));
        assert_eq!(spread.cell(), "1.00x (0.90-1.20, 3 rounds)");
        let rows = [
            row(TransferMode::Pull, 2.0, Some(Spread::of(&[1.0, 1.0, 1.0])), 3),
            row(TransferMode::Push, 2.4, Some(spread), 3),
        ];
        let t = modes_table(&rows);
        assert!(t.contains("3 rounds, runs interleaved"), "{t}");
        assert!(
            t.contains("1.00x (0.90-1.20, 3 rounds)"),
            "the median of the rounds' ratios, not 2.4/2.0: {t}"
        );
        // One round: the plain ratio, and no word of rounds.
        let one = [row(TransferMode::Pull, 2.0, None, 1), row(TransferMode::Push, 3.0, None, 1)];
        let t = modes_table(&one);
        assert!(t.contains("1.50x") && !t.contains("rounds"), "{t}");
    }
}
