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
    pub struct PairFlags {
        /// Prefill tensor-parallel size [default: 1].
        #[arg(long, value_name = "P", help_heading = "Engines")]
        pub p_tp: Option<u32>,
        /// Decode tensor-parallel size [default: 1].
        #[arg(long, value_name = "D", help_heading = "Engines")]
        pub d_tp: Option<u32>,
        /// Which vLLM release's rules to follow: 0.33 or 0.19 [default: 0.33].
        #[arg(long, value_name = "VERSION", help_heading = "Engines")]
        #[serde(default, deserialize_with = "super::parse::opt_parsed")]
        pub vllm: Option<VllmVersion>,
        /// KV cache layout of both engines (0.33: LBHNC=HND, LBNHC=NHD, LHBNC, BLHNC, BLNHC, BHLNC;
        /// 0.19: HND, NHD, FI-HND, FI-NHD, FA-HND-XL, FI-HND-XL).
        #[arg(long, value_name = "LAYOUT", help_heading = "Engines")]
        pub layout: Option<String>,
        /// Prefill layout (overrides --layout).
        #[arg(long, value_name = "LAYOUT", help_heading = "Engines")]
        pub p_layout: Option<String>,
        /// Decode layout (overrides --layout).
        #[arg(long, value_name = "LAYOUT", help_heading = "Engines")]
        pub d_layout: Option<String>,
        /// Tokens per block on both engines [default: 16].
        #[arg(long, value_name = "N", help_heading = "Engines")]
        pub block_size: Option<u32>,
        /// Prefill tokens per block (overrides --block-size).
        #[arg(long, value_name = "N", help_heading = "Engines")]
        pub p_block_size: Option<u32>,
        /// Decode tokens per block (overrides --block-size); must be a multiple of the prefill's.
        #[arg(long, value_name = "N", help_heading = "Engines")]
        pub d_block_size: Option<u32>,
        /// Hybrid models: tokens per attention kernel block on both engines (the block the
        /// attention backend sees, e.g. 16; it divides the hybrid block, whose attention pages
        /// split into kernel blocks) [default: the hybrid block size].
        #[arg(long, value_name = "N", help_heading = "Engines")]
        pub kernel_block_size: Option<u32>,
        /// Hybrid models: prefix caching off on both engines (vLLM's
        /// --no-enable-prefix-caching), which vLLM requires for some kernel block sizes.
        #[arg(long, help_heading = "Engines")]
        #[serde(default)]
        pub no_prefix_caching: bool,
        /// Hybrid models with GDN state (Qwen3-Next): the GDN prefill kernel on both engines.
        /// flashinfer is vLLM's choice on H100, H200 and B200 (SM90; SM100 with CUDA 13): with
        /// prefix caching on, it aligns hybrid blocks to its 64-token checkpoints; triton
        /// (A100-class GPUs) does not [default: flashinfer].
        #[arg(long, value_enum, value_name = "BACKEND", help_heading = "Engines")]
        #[serde(default)]
        pub gdn_prefill: Option<crate::layouts::hybrid::GdnPrefillBackend>,
        /// Hybrid models: the attention backend on both engines (vLLM's --attention-backend).
        /// flash-attn (vLLM's default on Hopper) and triton run the whole block as one kernel
        /// block; flashinfer splits it into kernel blocks of 64, 32 or 16 tokens, which NIXL
        /// then reads [default: flash-attn].
        #[arg(long, value_enum, value_name = "BACKEND", help_heading = "Engines")]
        #[serde(default)]
        pub attention_backend: Option<crate::layouts::hybrid::AttentionBackend>,
        /// Receive prefill HND blocks into a decode NHD cache (vLLM's enable_permute_local_kv).
        #[arg(long, help_heading = "Engines")]
        #[serde(default)]
        pub permute: bool,
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
        self.block_size.unwrap_or(DEFAULT_BLOCK_SIZE)
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
    /// Side-channel base port (VLLM_NIXL_SIDE_CHANNEL_PORT).
    #[arg(long, value_name = "PORT", default_value_t = 5600, help_heading = "Ports")]
    pub side_channel_port: u16,
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
        /// Check the bytes decode read: full, sample (1 block in 16), off [default: full for a
        /// bench run moving up to 2 GiB, else sample].
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
        /// and copies them into its pool; both copies are timed stages; pull mode over UCX)
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
    #[derive(Debug, Clone, Copy, Default, PartialEq, Args, Deserialize)]
    pub struct UcxModeFlags {
        /// UCX error-handling mode: none or peer (peer excludes the shared-memory transports)
        /// [default: none].
        #[arg(long, value_enum)]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub err_mode: Option<ErrMode>,
        /// How waiting ranks progress UCX: busy, wait, hybrid [default: hybrid].
        #[arg(long, value_enum)]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub progress: Option<ProgressMode>,
    }
}

impl UcxModeFlags {
    /// `--err-mode` as given, else none (UCX's default).
    pub fn err_mode(self) -> ErrMode {
        self.err_mode.unwrap_or_default()
    }

    /// `--progress` as given, else hybrid.
    pub fn progress(self) -> ProgressMode {
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
