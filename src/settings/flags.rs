//! The flags several commands share, each group one struct that is its clap arguments
//! (`#[command(flatten)]` into a command's flags) and, for `kvx bench`, the keys of its
//! config file (`#[serde(flatten)]`, a [`layered!`] group). Everything in `settings`
//! resolves from these types; sweep points and `--compare-transports` build them too.
//!
//! A field is `None` (or `false`) when the flag was not given; defaults belong to resolution.
//! [`Format`] is the output choice of the report-like commands.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use serde::Deserialize;

use super::layer::layered;
use crate::topology::VllmVersion;
use crate::topology::ports::PortScheme;
use crate::transfer::ucx::{ErrMode, ProgressMode};
use crate::vocab::kinds::{KvBufferDevice, VerifyMode};
use crate::vocab::model::Dtype;

layered! {
    /// Which model's KV cache: a preset, a Hugging Face config.json, or explicit shape flags
    /// (which override the preset or config).
    #[derive(Debug, Clone, Default, PartialEq, Args, Deserialize)]
    pub struct ModelFlags {
        /// Model: a preset (llama-3.1-8b|70b|405b, qwen3-0.6b|8b|32b|235b-a22b, mistral-7b,
        /// deepseek-v3 = deepseek-r1, gpt-oss-120b, qwen3-next-80b-a3b, nemotron-h-8b,
        /// granite-4.0-h-tiny, jamba-v0.1, falcon-h1-7b, gemma-3-4b, or a Hugging Face id of
        /// one), a config.json or the folder holding it, or a model TOML. Default: llama-3.1-70b.
        #[arg(long, short = 'm', value_name = "NAME|PATH", help_heading = "Model")]
        pub model: Option<String>,
        /// Read the model from a Hugging Face config.json (or the folder holding it), as vLLM
        /// reads it for its architecture.
        #[arg(long, value_name = "PATH", conflicts_with = "model", help_heading = "Model")]
        pub model_config: Option<PathBuf>,
        /// vLLM's hybrid KV cache manager: on (vLLM's default with the NixlConnector: sliding
        /// windows and Mamba/GDN state keep their own KV cache groups) or off
        /// (--disable-hybrid-kv-cache-manager: windowed layers keep every block; state models
        /// cannot run) [default: on].
        #[arg(long, value_enum, value_name = "on|off", help_heading = "Model")]
        #[serde(default)]
        pub hma: Option<Hma>,
        /// Total KV heads of the model (overrides the preset).
        #[arg(long, value_name = "H", help_heading = "Model")]
        pub num_kv_heads: Option<u32>,
        /// Head dimension in elements (overrides the preset).
        #[arg(long, value_name = "D", help_heading = "Model")]
        pub head_dim: Option<u32>,
        /// Number of attention layers (overrides the preset).
        #[arg(long, value_name = "L", help_heading = "Model")]
        pub layers: Option<u32>,
        /// KV cache element type: bf16, fp16, fp32, fp8.
        #[arg(long, value_name = "T", help_heading = "Model")]
        #[serde(default, deserialize_with = "super::parse::opt_parsed")]
        pub dtype: Option<Dtype>,
        /// Multi-head latent attention: one latent vector per token (576 elements unless --mla-dim).
        #[arg(long, help_heading = "Model")]
        #[serde(default)]
        pub mla: bool,
        /// Elements of the MLA latent vector (kv_lora_rank + qk_rope_head_dim).
        #[arg(long, value_name = "N", help_heading = "Model")]
        #[serde(skip)]
        pub mla_dim: Option<u32>,
    }
}

layered! {
    /// The prefill and decode engines: TP sizes, layouts, block sizes, vLLM rules.
    ///
    /// The layouts stay names until resolution: which name means which layout depends on
    /// `--vllm` (`HND` is `LBHNC` under 0.33, a FlashAttention layout under 0.19).
    #[derive(Debug, Clone, Default, PartialEq, Args, Deserialize)]
    #[serde(from = "PairKeys")]
    pub struct PairFlags {
        /// Prefill tensor-parallel size [default: 1].
        #[arg(long, value_name = "P", help_heading = "Engines")]
        pub p_tp: Option<u32>,
        /// Decode tensor-parallel size [default: 1].
        #[arg(long, value_name = "D", help_heading = "Engines")]
        pub d_tp: Option<u32>,
        #[command(flatten, next_help_heading = "Engines")]
        #[serde(flatten)]
        pub engine: EngineFlags,
        /// Prefill layout (overrides --layout).
        #[arg(long, value_name = "LAYOUT", help_heading = "Engines")]
        pub p_layout: Option<String>,
        /// Decode layout (overrides --layout).
        #[arg(long, value_name = "LAYOUT", help_heading = "Engines")]
        pub d_layout: Option<String>,
        /// Prefill tokens per block (overrides --block-size).
        #[arg(long, value_name = "N", help_heading = "Engines")]
        pub p_block_size: Option<u32>,
        /// Decode tokens per block (overrides --block-size); must be a multiple of the prefill's.
        #[arg(long, value_name = "N", help_heading = "Engines")]
        pub d_block_size: Option<u32>,
        /// Receive prefill HND blocks into a decode NHD cache (vLLM's enable_permute_local_kv).
        #[arg(long, help_heading = "Engines")]
        #[serde(default)]
        pub permute: bool,
    }
}

/// [`PairFlags`] as a config file writes it: every key at the top level. A flattened group
/// that flattens another would keep its keys from the file's unknown-key check (serde's
/// `deny_unknown_fields` sees only the keys of groups without groups inside), so the pair
/// reads its engine's keys itself.
#[derive(Deserialize)]
struct PairKeys {
    p_tp: Option<u32>,
    d_tp: Option<u32>,
    #[serde(default, deserialize_with = "super::parse::opt_parsed")]
    vllm: Option<VllmVersion>,
    layout: Option<String>,
    block_size: Option<u32>,
    kernel_block_size: Option<u32>,
    #[serde(default)]
    no_prefix_caching: bool,
    #[serde(default)]
    gdn_prefill: Option<crate::layouts::hybrid::GdnPrefillBackend>,
    #[serde(default)]
    attention_backend: Option<crate::layouts::hybrid::AttentionBackend>,
    p_layout: Option<String>,
    d_layout: Option<String>,
    p_block_size: Option<u32>,
    d_block_size: Option<u32>,
    #[serde(default)]
    permute: bool,
}

impl From<PairKeys> for PairFlags {
    fn from(k: PairKeys) -> Self {
        let engine = EngineFlags {
            vllm: k.vllm,
            layout: k.layout,
            block_size: k.block_size,
            kernel_block_size: k.kernel_block_size,
            no_prefix_caching: k.no_prefix_caching,
            gdn_prefill: k.gdn_prefill,
            attention_backend: k.attention_backend,
        };
        PairFlags {
            p_tp: k.p_tp,
            d_tp: k.d_tp,
            engine,
            p_layout: k.p_layout,
            d_layout: k.d_layout,
            p_block_size: k.p_block_size,
            d_block_size: k.d_block_size,
            permute: k.permute,
        }
    }
}

/// `--hma`: vLLM's hybrid KV cache manager.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Hma {
    /// On (vLLM's default with the NixlConnector, which supports it): sliding-window and
    /// state layers keep their own KV cache groups; a window group sends its window only.
    #[default]
    On,
    /// Off (`--disable-hybrid-kv-cache-manager`): windowed layers allocate every token's
    /// blocks like full attention; models with Mamba/GDN state do not run.
    Off,
}

/// Tokens per block when `--block-size` is not given (vLLM's default).
pub const DEFAULT_BLOCK_SIZE: u32 = 16;

impl PairFlags {
    /// `--block-size`, or its default.
    pub fn block_size(&self) -> u32 {
        self.engine.block_size()
    }
}

/// Output format of a report-like command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum Format {
    /// Human-readable tables.
    #[default]
    Table,
    /// One JSON object on stdout.
    Json,
}

/// Data-parallel engines and side-channel ports.
#[derive(Debug, Clone, PartialEq, Eq, Args)]
pub struct PortFlags {
    /// Prefill data-parallel engines.
    #[arg(long, value_name = "N", default_value_t = 1, help_heading = "Ports")]
    pub p_dp: u32,
    /// Decode data-parallel engines.
    #[arg(long, value_name = "N", default_value_t = 1, help_heading = "Ports")]
    pub d_dp: u32,
    #[command(flatten, next_help_heading = "Ports")]
    pub side_channel: SideChannelPortFlags,
    /// Port scheme: engine (base + dp_rank, vLLM >= 0.11) or worker (base + dp_rank*tp + tp_rank).
    #[arg(long, value_name = "SCHEME", value_enum, default_value = "engine", help_heading = "Ports")]
    pub port_scheme: PortScheme,
}

layered! {
    /// `--verify`: how decode checks the bytes it read, one definition for every command that
    /// takes it (`kvx bench`, `kvx serve-engine`); the default is resolved by
    /// [`super::workers::verify_or_default`].
    #[derive(Debug, Clone, Copy, Default, PartialEq, Args, Deserialize)]
    pub struct VerifyFlags {
        /// Check the bytes decode read: full, sample (1 block in 16 of every layer), off
        /// [default, for every command: full for a run moving up to 2 GiB, else sample; a serving
        /// engine, whose run has no end, samples. Checking a byte costs about what copying it
        /// does on a host, so long runs sample to keep the timing honest].
        #[arg(long, value_enum)]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub verify: Option<VerifyMode>,
    }
}

layered! {
    /// `--kv-buffer-device`: where transfers read the KV, one definition for every command that
    /// takes it (`kvx bench`, `kvx serve-engine`, `kvx plan`, `kvx layout`).
    #[derive(Debug, Clone, Copy, Default, PartialEq, Args, Deserialize)]
    pub struct KvBufferFlags {
        /// Where transfers read the KV (vLLM's kv_buffer_device): cuda (the KV pool itself) or cpu
        /// (a host buffer: prefill copies a request's blocks into it, decode reads into its own
        /// and copies them into its pool; both copies are timed stages; pull mode over UCX or NIXL)
        /// [default: cuda].
        #[arg(long, value_enum)]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub kv_buffer_device: Option<KvBufferDevice>,
    }
}

/// Runs moving at most this many bytes check every byte by default (`--verify full`).
pub const VERIFY_FULL_UP_TO_BYTES: u64 = 2 << 30;

impl VerifyFlags {
    /// `--verify` as given, else the one default rule: full for a run moving at most
    /// [`VERIFY_FULL_UP_TO_BYTES`], else sample. A serving engine (`run_bytes` unknown: it runs
    /// until stopped) samples.
    pub fn resolve(self, run_bytes: Option<u64>) -> VerifyMode {
        match (self.verify, run_bytes) {
            (Some(v), _) => v,
            (None, Some(bytes)) if bytes <= VERIFY_FULL_UP_TO_BYTES => VerifyMode::Full,
            (None, _) => VerifyMode::Sample,
        }
    }
}

impl KvBufferFlags {
    /// `--kv-buffer-device` as given, else cuda (the KV pool itself, vLLM's default).
    pub fn device(self) -> KvBufferDevice {
        self.kv_buffer_device.unwrap_or_default()
    }
}

layered! {
    /// How UCX treats a failed peer and how waiting ranks progress it, one definition for every
    /// command that starts UCX (`kvx bench`, `kvx serve-engine`, `kvx xfer`).
    #[derive(Debug, Clone, Default, PartialEq, Args, Deserialize)]
    pub struct UcxModeFlags {
        /// UCX error-handling mode: none or peer (kvx's UCX then excludes the shared-memory
        /// transports) [default: none; with --transport nixl: peer, NIXL's and vLLM's setting].
        #[arg(long, value_enum)]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub err_mode: Option<ErrMode>,
        /// How waiting ranks progress UCX: busy, wait, hybrid [default: hybrid].
        #[arg(long, value_enum)]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub progress: Option<ProgressMode>,
        /// Restrict UCX's transports (UCX_TLS), e.g. posix,cma,self or tcp.
        #[arg(long)]
        pub ucx_tls: Option<String>,
    }
}

impl UcxModeFlags {
    /// `--err-mode` as given, else none (UCX's default), or peer for NIXL's UCX backend
    /// (`nixl`: NIXL's default, which vLLM keeps).
    pub fn err_mode(&self, nixl: bool) -> ErrMode {
        self.err_mode.unwrap_or(if nixl { ErrMode::Peer } else { ErrMode::None })
    }

    /// `--progress` as given, else hybrid.
    pub fn progress(&self) -> ProgressMode {
        self.progress.unwrap_or_default()
    }
}

/// `--lease` when not given: vLLM's `kv_lease_duration` default.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

layered! {
    /// `--lease`, one definition for the commands that run prefill engines (`kvx bench`,
    /// `kvx serve-engine`).
    #[derive(Debug, Clone, Copy, Default, PartialEq, Args, Deserialize)]
    pub struct LeaseFlags {
        /// Lease prefill ranks hold blocks under (vLLM kv_lease_duration) [default: 30s].
        #[arg(long, value_parser = super::parse::parse_duration, allow_hyphen_values = true)]
        #[serde(default, deserialize_with = "super::parse::opt_duration")]
        pub lease: Option<Duration>,
    }
}

impl LeaseFlags {
    /// `--lease` as given, else [`DEFAULT_LEASE`].
    pub fn lease(self) -> Duration {
        self.lease.unwrap_or(DEFAULT_LEASE)
    }
}

layered! {
    /// What one engine runs with, beside its TP size: vLLM's rules, the KV cache layout, the
    /// block size and the hybrid models' kernel choices; one definition for every command that
    /// sets up an engine (`kvx layout`, `kvx serve-engine`) or a pair of them ([`PairFlags`]:
    /// both engines).
    #[derive(Debug, Clone, Default, PartialEq, Args, Deserialize)]
    pub struct EngineFlags {
        #[arg(long, value_name = "VERSION", help = VLLM_HELP)]
        #[serde(default, deserialize_with = "super::parse::opt_parsed")]
        pub vllm: Option<VllmVersion>,
        /// KV cache layout (0.33: LBHNC=HND, LBNHC=NHD, LHBNC, BLHNC, BLNHC, BHLNC; 0.19: HND, NHD,
        /// FI-HND, FI-NHD, FA-HND-XL, FI-HND-XL). A decode engine serving on its own learns the
        /// prefill engine's at handshake time.
        #[arg(long, value_name = "LAYOUT")]
        pub layout: Option<String>,
        /// Tokens per block [default: 16].
        #[arg(long, value_name = "N")]
        pub block_size: Option<u32>,
        /// Hybrid models: tokens per attention kernel block (the block the attention backend
        /// sees, e.g. 16; it divides the hybrid block, whose attention pages split into kernel
        /// blocks) [default: the hybrid block size].
        #[arg(long, value_name = "N")]
        pub kernel_block_size: Option<u32>,
        /// Hybrid models: prefix caching off (vLLM's --no-enable-prefix-caching: no checkpoint
        /// alignment of the block size), which vLLM requires for some kernel block sizes.
        #[arg(long)]
        #[serde(default)]
        pub no_prefix_caching: bool,
        /// Hybrid models with GDN state (Qwen3-Next): the GDN prefill kernel. flashinfer is
        /// vLLM's choice on H100, H200 and B200 (SM90; SM100 with CUDA 13): with prefix caching
        /// on, it aligns hybrid blocks to its 64-token checkpoints; triton (A100-class GPUs) does
        /// not [default: flashinfer].
        #[arg(long, value_enum, value_name = "BACKEND")]
        #[serde(default)]
        pub gdn_prefill: Option<crate::layouts::hybrid::GdnPrefillBackend>,
        /// Hybrid models: the attention backend (vLLM's --attention-backend). flash-attn (vLLM's
        /// default on Hopper) and triton run the whole block as one kernel block; flashinfer
        /// splits it into kernel blocks of 64, 32 or 16 tokens, which NIXL then reads
        /// [default: flash-attn].
        #[arg(long, value_enum, value_name = "BACKEND")]
        #[serde(default)]
        pub attention_backend: Option<crate::layouts::hybrid::AttentionBackend>,
    }
}

impl EngineFlags {
    /// `--block-size`, or its default.
    pub fn block_size(&self) -> u32 {
        self.block_size.unwrap_or(DEFAULT_BLOCK_SIZE)
    }

    /// `--vllm`, or its default (0.33).
    pub fn vllm(&self) -> VllmVersion {
        self.vllm.unwrap_or(VllmVersion::V0_33)
    }
}

layered! {
    /// The host buffer's and the state parts' rules of hybrid models, one definition for the
    /// commands that plan or move them (`kvx plan`, `kvx bench`, `kvx serve-engine`).
    #[derive(Debug, Clone, Copy, Default, PartialEq, Args, Deserialize)]
    pub struct HybridRuleFlags {
        /// Hybrid models: where decode reads its slice of each state part: vllm (vLLM 0.33's
        /// remote_conv_offsets, which assume every conv part is sharded like x) or exact (each
        /// part as the model splits it: replicated Mamba2 B and C read where each prefill rank
        /// holds decode's slice of them) [default: vllm].
        #[arg(long, value_enum)]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub state_slices: Option<crate::layouts::hybrid::StateSlices>,
        /// Hybrid models with --kv-buffer-device cpu: which blocks decode's host-to-device copy
        /// passes through each layer: vllm (every group's through every layer, as vLLM 0.33) or
        /// per-group (each layer its own group's) [default: vllm].
        #[arg(long, value_enum)]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub host_copy: Option<crate::layouts::hybrid::HostCopyRule>,
        /// Hybrid models with --kv-buffer-device cpu: the host tensors' state pages: vllm
        /// (unpadded, as vLLM 0.33 allocates them, while the regions assume padded ones) or
        /// padded [default: vllm]. Both engines must use the same.
        #[arg(long, value_enum)]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub host_state_page: Option<crate::layouts::hybrid::HostStatePage>,
        /// Hybrid models with --kv-buffer-device cpu: which host tensors each group's
        /// descriptors read: vllm (with state in the model, every layer's tensor, as vLLM 0.33)
        /// or per-group (each group's own layers'; prefill copies only those into the buffer)
        /// [default: vllm]. Both engines must use the same.
        #[arg(long, value_enum)]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub host_descriptors: Option<crate::layouts::hybrid::HostDescriptors>,
    }
}

layered! {
    /// `--push-attention`, for the commands that plan or move a hybrid push (`kvx topo`,
    /// `kvx plan`, `kvx bench`).
    #[derive(Debug, Clone, Copy, Default, PartialEq, Args, Deserialize)]
    pub struct PushAttentionFlags {
        /// Hybrid models in push mode, decode TP above prefill TP and above the KV heads: which
        /// decode ranks prefill writes attention into: vllm (the first of each head only, as
        /// vLLM 0.33's push connector reads; the others get state but no attention) or
        /// every-rank (each its head, as pull reads them) [default: vllm].
        #[arg(long, value_enum)]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub push_attention: Option<crate::layouts::hybrid::write_plan::PushAttention>,
    }
}

layered! {
    /// `--mode`: who moves the KV, for every command that plans or moves it.
    #[derive(Debug, Clone, Copy, Default, PartialEq, Args, Deserialize)]
    pub struct ModeFlags {
        /// Who moves the KV: pull (decode reads, as vLLM's NixlConnector) or push (prefill
        /// writes into the blocks decode registers, as vLLM's NixlPushConnector); both engines
        /// must use the same [default: pull].
        #[arg(long, value_enum, value_name = "pull|push")]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub mode: Option<crate::topology::TransferMode>,
    }
}

impl ModeFlags {
    /// `--mode`, or pull.
    pub fn mode(self) -> crate::topology::TransferMode {
        self.mode.unwrap_or(crate::topology::TransferMode::Pull)
    }
}

layered! {
    /// The request a command plans or a workload sends: its prompt, the blocks it gets, what
    /// decode has cached, the seed (`kvx plan`, `kvx bench`; `kvx load` and `kvx serve-engine`
    /// take some).
    #[derive(Debug, Clone, Copy, Default, PartialEq, Args, Deserialize)]
    pub struct AllocFlags {
        /// Block allocation pattern: contiguous, fragmented, random [default: contiguous].
        #[arg(long, value_enum, value_name = "PATTERN")]
        #[serde(default, deserialize_with = "super::parse::opt_parsed")]
        pub alloc: Option<crate::layouts::alloc::AllocPattern>,
    }
}

impl AllocFlags {
    /// `--alloc`, or contiguous.
    pub fn alloc(self) -> crate::layouts::alloc::AllocPattern {
        self.alloc.unwrap_or_default()
    }
}

layered! {
    /// `--seed`, one definition for every command that draws at random.
    #[derive(Debug, Clone, Copy, Default, PartialEq, Args, Deserialize)]
    pub struct SeedFlags {
        /// Seed of what the run draws: prompt lengths, block allocations, arrival times, byte
        /// patterns [default: 0].
        #[arg(long)]
        pub seed: Option<u64>,
    }
}

impl SeedFlags {
    /// `--seed`, or 0.
    pub fn seed(self) -> u64 {
        self.seed.unwrap_or(0)
    }
}

layered! {
    /// `--prefix-hit`, for the commands that plan or move a request's KV.
    #[derive(Debug, Clone, Copy, Default, PartialEq, Args, Deserialize)]
    pub struct PrefixHitFlags {
        /// Fraction of each prompt already cached on decode; only the rest is read [default: 0].
        #[arg(long, value_name = "FRACTION", allow_negative_numbers = true)]
        pub prefix_hit: Option<f64>,
    }
}

impl PrefixHitFlags {
    /// `--prefix-hit`, or 0.
    pub fn prefix_hit(self) -> f64 {
        self.prefix_hit.unwrap_or(0.0)
    }
}

layered! {
    /// `--prompt-len`, for the commands that plan or send prompts (`kvx plan`, `kvx bench`,
    /// `kvx load`); each command resolves it into its typed prompt lengths.
    #[derive(Debug, Clone, Default, PartialEq, Args, Deserialize)]
    pub struct PromptLenFlags {
        /// Prompt length in tokens, fixed (8192) or uniform over a range (1024..32768; not
        /// `kvx plan`, which plans one request) [default: 2048; kvx load: 16; kvx plan: the
        /// request's blocks, --local-blocks].
        #[arg(long, value_name = "TOKENS")]
        #[serde(default, deserialize_with = "super::parse::opt_text")]
        pub prompt_len: Option<String>,
    }
}

layered! {
    /// How many requests a workload sends and how fast (`kvx bench`, `kvx load`).
    #[derive(Debug, Clone, Copy, Default, PartialEq, Args, Deserialize)]
    pub struct ArrivalFlags {
        /// Measured requests per repeat (kvx load: per target) [default: 20, kvx load 100; none
        /// with --duration].
        #[arg(long, value_name = "N")]
        pub requests: Option<u64>,
        /// Open loop: Poisson arrivals at this many requests per second (kvx load: per target).
        #[arg(long, value_name = "R", conflicts_with = "concurrency", allow_negative_numbers = true)]
        pub rate: Option<f64>,
        /// Closed loop: requests kept in flight (kvx load: per target) [default: 2; kvx load
        /// needs --rate or --concurrency].
        #[arg(long, value_name = "C")]
        pub concurrency: Option<u32>,
        /// Requests sent first and left out of the statistics (kvx load: per target) [default:
        /// 2; kvx load: 0].
        #[arg(long, value_name = "N")]
        pub warmup: Option<u64>,
    }
}

layered! {
    /// `--duration`: how long to measure (`kvx xfer`, `kvx bench`, `kvx load`).
    #[derive(Debug, Clone, Copy, Default, PartialEq, Args, Deserialize)]
    pub struct DurationFlags {
        /// How long to measure, e.g. 200ms, 30s (a bare number is seconds): kvx xfer measures
        /// each case at least this long [default: 200ms]; kvx bench (per repeat) and kvx load
        /// send requests for this long instead of a request count.
        #[arg(long, value_parser = super::parse::parse_duration, allow_hyphen_values = true)]
        #[serde(default, deserialize_with = "super::parse::opt_duration")]
        pub duration: Option<Duration>,
    }
}

layered! {
    /// `--timeout`: the deadline of a wait on a peer.
    #[derive(Debug, Clone, Copy, Default, PartialEq, Args, Deserialize)]
    pub struct TimeoutFlags {
        /// Deadline of every wait on a peer, e.g. 500ms, 5s, 1m (a bare number is seconds):
        /// handshake, reads, notifications; kvx xfer: one batch of reads; kvx load: one whole
        /// response [default: 5s; kvx xfer: 10s; kvx load: 60s].
        #[arg(long, value_parser = super::parse::parse_duration, allow_hyphen_values = true)]
        #[serde(default, deserialize_with = "super::parse::opt_duration")]
        pub timeout: Option<Duration>,
    }
}

impl TimeoutFlags {
    /// `--timeout`, or `default` (the command's).
    pub fn or(self, default: Duration) -> Duration {
        self.timeout.unwrap_or(default)
    }
}

/// `--timeout` when not given, for the commands that wait on KV peers.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

layered! {
    /// The memory the KV (or `kvx xfer`'s buffers) lives in, one definition for every command
    /// that allocates it (`kvx xfer`, `kvx bench`, `kvx serve-engine`).
    #[derive(Debug, Clone, Default, PartialEq, Args, Deserialize)]
    pub struct MemFlags {
        /// Memory of the KV pools (kvx xfer: its buffers): host or cuda [default: host].
        #[arg(long, value_enum)]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub mem: Option<crate::vocab::kinds::MemKind>,
        /// One GPU for --mem cuda: every rank's (as --devices N) [default: 0].
        #[arg(long, value_name = "N")]
        #[serde(skip)]
        pub device: Option<u32>,
        /// Back host memory with huge pages (MAP_HUGETLB; fails with a hint if none are
        /// reserved).
        #[arg(long)]
        #[serde(default)]
        pub huge_pages: bool,
    }
}

impl MemFlags {
    /// `--mem`, or host.
    pub fn mem(&self) -> crate::vocab::kinds::MemKind {
        self.mem.unwrap_or(crate::vocab::kinds::MemKind::Host)
    }
}

layered! {
    /// `--devices`: the GPUs of a command's ranks (`kvx bench`, `kvx serve-engine`).
    #[derive(Debug, Clone, Default, PartialEq, Args, Deserialize)]
    pub struct DevicesFlags {
        /// GPUs of --mem cuda, e.g. 0,1,2,3: the ranks round-robin over them (kvx bench:
        /// prefill ranks, then decode ranks) [default: 0].
        #[arg(long, value_delimiter = ',', conflicts_with = "device")]
        pub devices: Option<Vec<u32>>,
    }
}

layered! {
    /// `--ucx-lib`: which UCX build to load, for every command that loads UCX (`kvx xfer`,
    /// `kvx bench`, `kvx serve-engine`, `kvx doctor`).
    #[derive(Debug, Clone, Default, PartialEq, Args, Deserialize)]
    pub struct UcxLibFlags {
        /// libucp.so to load (default: KVX_UCX_LIB, then .ucx/, then the system's).
        #[arg(long)]
        #[serde(skip)]
        pub ucx_lib: Option<PathBuf>,
    }
}

layered! {
    /// `--fill`: what prefill ranks write into a request's blocks and decode ranks check
    /// (`kvx bench`, `kvx serve-engine`).
    #[derive(Debug, Clone, Copy, Default, PartialEq, Args, Deserialize)]
    pub struct FillFlags {
        /// What prefill ranks write into a request's blocks, and decode ranks check: kvx (each
        /// K/V vector from its layer, head and token: a wrong rank map shows) or peer (the
        /// NIXL peers' and vLLM peer scripts' bytes, (region*131 + block*31 + offset) mod 251
        /// per prefill block, for reading from and being read by them) [default: kvx].
        #[arg(long, value_enum)]
        #[serde(default)]
        pub fill: Option<crate::vocab::kinds::FillPattern>,
    }
}

layered! {
    /// `--nixl-progress-thread`: how `--transport nixl` agents are progressed (`kvx xfer`,
    /// `kvx bench`, `kvx serve-engine`).
    #[derive(Debug, Clone, Copy, Default, PartialEq, Args, Deserialize)]
    pub struct NixlFlags {
        /// With --transport nixl: give each NIXL agent its progress thread, as vLLM does (the
        /// Python API's default). Off, the rank progresses NIXL when it polls, as vLLM's worker
        /// polls every step: on hosts with few cores a spinning progress thread per process
        /// competes with the ranks themselves.
        #[arg(long)]
        #[serde(default)]
        pub nixl_progress_thread: bool,
    }
}

/// `--compare-transports`' help (`kvx bench`: whole runs; `kvx xfer`: its cases).
pub const COMPARE_TRANSPORTS_HELP: &str = "Run the same workload on each transport in turn and print one comparison table, e.g. ucx,nixl or ucx,storage,multi (ucx,cuda-batch with --mem cuda); kvx xfer gives each case's GB/s as a ratio to the first transport's";

/// `--rounds`' help (`kvx bench` and `kvx xfer` comparisons).
pub const ROUNDS_HELP: &str = "With --compare-transports (kvx bench also --compare-modes, --compare-kv-buffer-device): run the comparison this many rounds, the runs interleaved, their order reversed every other round (a busy host's drift falls on each alike); each figure is the median of its rounds, each ratio to the first run the median of the rounds' ratios, with their range [default: 1]";

/// `--inflight`'s help: `kvx xfer` takes a list of depths (one case each), the engines one
/// depth, so the two are two fields with one text.
pub const INFLIGHT_HELP: &str = "GETs in flight per source rank (kvx xfer: a list of depths, one case each) [default: 64; kvx xfer: 1,8,32]";

/// `--inflight` when not given: GETs in flight per source rank of an engine.
pub const DEFAULT_INFLIGHT: u32 = 64;

layered! {
    /// `--dispatch`: how a request's two legs are sent (`kvx bench`, `kvx serve-proxy`).
    #[derive(Debug, Clone, Copy, Default, PartialEq, Args, Deserialize)]
    pub struct DispatchFlags {
        /// How a request's legs are sent: sequential (prefill, then decode with prefill's
        /// answer, as vLLM's toy proxy) or concurrent (both at once: push mode, decode
        /// registering its blocks while prefill computes) [default: sequential; kvx bench:
        /// concurrent with --overlap layers].
        #[arg(long, value_enum, value_name = "sequential|concurrent")]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub dispatch: Option<crate::config::worker::Dispatch>,
    }
}

layered! {
    /// What names a run and what it is held to (`kvx bench`, `kvx load`).
    #[derive(Debug, Clone, Default, PartialEq, Args, Deserialize)]
    pub struct RunNameFlags {
        /// Name of the run (the scenario name in reports) [default: the config file's name,
        /// else the command's: bench, load].
        #[arg(long)]
        pub name: Option<String>,
        /// Service-level objectives for goodput, e.g. ttft=200ms,tpot=50ms (also itl, e2el; a
        /// bare number is milliseconds): the report gives the share of requests within all of
        /// them and goodput (requests/s within them). kvx bench: with --serve.
        #[arg(long, value_name = "NAME=LIMIT,...")]
        #[serde(skip)]
        pub slo: Option<String>,
    }
}

layered! {
    /// `--api-key`: the OpenAI API's bearer token (`kvx serve-engine`, `kvx serve-proxy`,
    /// `kvx load`).
    #[derive(Debug, Clone, Default, PartialEq, Args, Deserialize)]
    pub struct ApiKeyFlags {
        /// The OpenAI API's key (`Authorization: Bearer <KEY>` on /v1/*, as vLLM's --api-key):
        /// the servers require it of clients, kvx load sends it.
        #[arg(long)]
        #[serde(skip)]
        pub api_key: Option<String>,
    }
}

/// `--format`'s help, one text for every command's (each command lists its own formats).
pub const FORMAT_HELP: &str = "Output format on stdout";

/// `--tp`: the tensor-parallel size of the one engine a command sets up (`kvx layout`,
/// `kvx serve-engine`; a pair's are `--p-tp` and `--d-tp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Args)]
pub struct TpFlags {
    /// Tensor-parallel size of the engine: its ranks (kvx serve-engine: the worker processes it
    /// starts, and `tp_size` in kv_transfer_params).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub tp: u32,
}

/// `--side-channel-port`, one definition for every command that binds, maps or checks vLLM's
/// side channel (`kvx topo`, `kvx serve-engine`, `kvx doctor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Args)]
pub struct SideChannelPortFlags {
    /// Side-channel base port (vLLM: VLLM_NIXL_SIDE_CHANNEL_PORT; an engine of data-parallel
    /// rank R uses base + R). kvx serve-engine binds it (0: an ephemeral one, which
    /// `remote_port` in kv_transfer_params carries); kvx doctor checks --ports ports from it.
    #[arg(long, value_name = "PORT", default_value_t = 5600)]
    pub side_channel_port: u16,
}

/// `--rank`: one rank of an engine (`kvx layout`: the rank shown; `kvx worker`: this process).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Args)]
pub struct RankFlags {
    /// The TP rank: kvx layout shows it [default: 0]; kvx worker is it [default: from the
    /// launcher's environment, else assigned by the engine].
    #[arg(long, value_name = "RANK")]
    pub rank: Option<u32>,
}

/// `--transport`'s help, one text for every command's (each command lists the transports it
/// takes).
pub const TRANSPORT_HELP: &str = "What moves the bytes [default: ucx]";

layered! {
    /// `--listen`: the endpoint of a run across hosts (`kvx xfer`, `kvx bench`).
    #[derive(Debug, Clone, Default, PartialEq, Args, Deserialize)]
    pub struct ListenFlags {
        /// Two-host mode: listen on this endpoint for the processes started with --connect: kvx
        /// xfer serves a region to one initiator; kvx bench waits for its `kvx worker` ranks,
        /// prefill on the port, decode on port + 1.
        #[arg(long, value_name = "tcp://HOST:PORT")]
        #[serde(skip)]
        pub listen: Option<String>,
    }
}

/// `--connect`: the other end of `--listen` (`kvx xfer`, `kvx worker`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Args)]
pub struct ConnectFlags {
    /// Two-host mode: connect to the endpoint a --listen process gave: kvx xfer reads from its
    /// target there; kvx worker (where it is required) joins the engine there.
    #[arg(long, value_name = "tcp://HOST:PORT")]
    pub connect: Option<String>,
}

/// `--vllm`'s help: `kvx probe` also takes `auto` (it frames its request after the peer's
/// answer), so its field has its own type, and the text is one.
pub const VLLM_HELP: &str = "Which vLLM release's rules to follow: 0.33 or 0.19 [default: 0.33; kvx probe: auto, \
     from the peer's answer]";

layered! {
    /// `--repeat`: how many times a command runs what it measures (`kvx bench`, `kvx probe`).
    #[derive(Debug, Clone, Copy, Default, PartialEq, Args, Deserialize)]
    pub struct RepeatFlags {
        /// Run the measured part this many times: kvx bench for noise-aware gates, kvx probe a
        /// new connection each time, reporting latency percentiles [default: 1].
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
        pub repeat: Option<u32>,
    }
}

impl RepeatFlags {
    /// `--repeat`, or 1.
    pub fn repeat(self) -> u32 {
        self.repeat.unwrap_or(1)
    }
}

/// `--model-name`: the model id of the OpenAI API (`kvx serve-engine` serves it, `kvx load`
/// sends it).
#[derive(Debug, Clone, Default, PartialEq, Eq, Args)]
pub struct ModelNameFlags {
    /// The model id of the OpenAI API: kvx serve-engine serves it on /v1/models and checks
    /// requests' `model` against it [default: the --model preset's name, else kvx-synthetic];
    /// kvx load sends it [default: the first id of --url's /v1/models].
    #[arg(long, visible_alias = "served-model-name", value_name = "ID")]
    pub model_name: Option<String>,
}

/// `--role`: which side of the P/D pair (`kvx serve-engine`, `kvx worker`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Args)]
pub struct RoleFlags {
    /// Role in the P/D pair: prefill (kvx serve-engine answers with kv_transfer_params) or
    /// decode (it loads them). Required by kvx serve-engine; kvx worker takes it from the
    /// launcher's environment with --p-tp.
    #[arg(long, value_enum)]
    pub role: Option<crate::vocab::kinds::Role>,
}

layered! {
    /// `--pool-blocks`: the size of each rank's KV pool (`kvx bench`, `kvx serve-engine`).
    #[derive(Debug, Clone, Copy, Default, PartialEq, Args, Deserialize)]
    pub struct PoolBlocksFlags {
        /// Blocks in each rank's KV pool [default: kvx bench: enough for the concurrency; kvx
        /// serve-engine: 4 prompts of --max-model-len within 512 MiB per rank, never less than
        /// one prompt; pages are touched only as blocks are used].
        #[arg(long, value_name = "N")]
        pub pool_blocks: Option<u32>,
    }
}
