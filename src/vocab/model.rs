//! What the KV cache of a model looks like: element type, heads, dims, layers, MLA. Plain data
//! every layer may use; resolving it from presets, `config.json` files and flags is
//! `settings::model`'s.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    Bf16,
    Fp16,
    Fp32,
    Fp8,
}

impl Dtype {
    pub fn bytes(self) -> u32 {
        match self {
            Dtype::Bf16 | Dtype::Fp16 => 2,
            Dtype::Fp32 => 4,
            Dtype::Fp8 => 1,
        }
    }

    /// The name torch prints, as vLLM puts it in its compatibility hash.
    pub fn torch_name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "torch.bfloat16",
            Dtype::Fp16 => "torch.float16",
            Dtype::Fp32 => "torch.float32",
            Dtype::Fp8 => "torch.float8_e4m3fn",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::Fp16 => "fp16",
            Dtype::Fp32 => "fp32",
            Dtype::Fp8 => "fp8",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Dtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().trim_start_matches("torch.") {
            "bf16" | "bfloat16" => Ok(Dtype::Bf16),
            "fp16" | "float16" | "half" => Ok(Dtype::Fp16),
            "fp32" | "float32" | "float" => Ok(Dtype::Fp32),
            "fp8" | "fp8_e4m3" | "float8_e4m3fn" | "fp8_e5m2" | "float8_e5m2" => Ok(Dtype::Fp8),
            other => Err(format!("unknown dtype '{other}' (expected bf16, fp16, fp32 or fp8)")),
        }
    }
}

/// Multi-head latent attention: one latent vector per token instead of K and V per head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mla {
    pub kv_lora_rank: u32,
    pub qk_rope_head_dim: u32,
}

impl Mla {
    /// DeepSeek-V3/R1: 512 + 64.
    pub const DEEPSEEK: Mla = Mla { kv_lora_rank: 512, qk_rope_head_dim: 64 };

    /// Elements per token of the latent KV vector (576 for DeepSeek).
    pub fn head_size(self) -> u32 {
        self.kv_lora_rank + self.qk_rope_head_dim
    }
}

/// The shape of a model's KV cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelShape {
    /// Short name (a preset name, or what the config file called itself).
    pub name: String,
    pub num_layers: u32,
    /// Total KV heads of the model (`num_key_value_heads`). For MLA this is what the
    /// config reports (DeepSeek: 128); vLLM 0.33 treats MLA as one head.
    pub num_kv_heads: u32,
    /// K head size in elements; V uses the same size.
    pub head_dim: u32,
    pub dtype: Dtype,
    pub mla: Option<Mla>,
}

impl ModelShape {
    /// A two-layer bf16 model with 64-wide heads, for tests of geometry and plans.
    #[cfg(test)]
    pub(crate) fn toy(num_kv_heads: u32) -> ModelShape {
        ModelShape {
            name: "toy".into(),
            num_layers: 2,
            num_kv_heads,
            head_dim: 64,
            dtype: Dtype::Bf16,
            mla: None,
        }
    }

    pub fn is_mla(&self) -> bool {
        self.mla.is_some()
    }

    /// Bytes of one KV "cell": what one head holds for one token (K then V packed,
    /// or the MLA latent vector). This is C in vLLM 0.33's `[L,B,H,N,C]`.
    pub fn cell_bytes(&self) -> u64 {
        match self.mla {
            Some(m) => u64::from(m.head_size()) * u64::from(self.dtype.bytes()),
            None => 2 * u64::from(self.head_dim) * u64::from(self.dtype.bytes()),
        }
    }

    /// Bytes of KV cache per token over the whole model (all layers, all KV heads).
    pub fn bytes_per_token(&self) -> u64 {
        let heads = if self.is_mla() { 1 } else { u64::from(self.num_kv_heads) };
        u64::from(self.num_layers) * heads * self.cell_bytes()
    }
}
