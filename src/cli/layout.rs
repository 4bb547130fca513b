//! `kvx layout`: the KV cache layout of one rank: shape, strides, registered regions, bytes. Builds
//! the report (`report::layout` has its shape and renders it) from the resolved geometry.

use clap::Args;

use super::common::Format;
use super::common::reject;
use crate::error::Outcome;
use crate::layouts::compat::PairSpec;
use crate::layouts::{RankGeometry, Region};
use crate::output;
use crate::report::layout::{AxisJson, HybridLayoutJson, LayoutJson, RegionJson, render_uniform};
use crate::settings::layout::{LayoutFlags, resolve, resolve_hybrid};

#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  kvx layout --model llama-3.1-70b --tp 8\n  \
    kvx layout --model deepseek-v3 --layout BLHNC --tokens 32768\n  \
    kvx layout --model qwen3-8b --vllm 0.19 --layout NHD --format json")]
pub struct LayoutArgs {
    #[command(flatten)]
    pub settings: LayoutFlags,
}

fn build(args: &LayoutFlags, pair: &PairSpec, g: &RankGeometry, names: &[String]) -> LayoutJson {
    let regions: Vec<Region> = g.regions();
    let request_blocks = args.tokens.div_ceil(args.block_size);
    LayoutJson {
        status: "ok",
        model: pair.model.name.clone(),
        vllm_version: pair.version.as_str(),
        layout: g.layout.to_string(),
        layout_description: g.layout.describe(),
        tp: args.tp,
        rank: args.rank,
        kv_heads_on_rank: g.heads,
        global_heads: g.global_heads.clone().collect(),
        block_size: g.block_tokens,
        num_blocks: g.num_blocks,
        bytes_per_token: g.bytes_per_token(),
        bytes_per_block_per_layer: g.page_bytes(),
        bytes_per_block: g.block_bytes_all_layers(),
        allocation_bytes: g.total_bytes(),
        request_tokens: args.tokens,
        request_blocks,
        bytes_per_request: g.block_bytes_all_layers() * u64::from(request_blocks),
        descriptors_per_request: regions.len() as u64 * u64::from(request_blocks),
        physical_axes: g
            .physical_axes()
            .into_iter()
            .map(|(axis, size, stride)| AxisJson { axis, size, stride_bytes: stride })
            .collect(),
        regions: regions
            .iter()
            .map(|r| RegionJson {
                name: r.name.clone(),
                base_offset: r.base_off,
                block_len: r.block_len,
                block_stride: r.block_stride,
                num_blocks: r.num_blocks,
                block_content: r.content.shape_string(),
            })
            .collect(),
        registrations: g.registrations().into_iter().map(|(o, n)| [o, n]).collect(),
        origin: serde_json::Value::Null,
        engine: serde_json::json!({
            "tp": args.tp,
            "block_size_tokens": g.block_tokens,
            "num_blocks": g.num_blocks,
            "local_kv_heads": g.heads,
            "page_bytes": g.page_bytes(),
            "kv_buffer_device": "cuda",
            "groups": [{
                "group": 0,
                "spec": if pair.model.is_mla() { "MLAAttentionSpec" } else { "FullAttentionSpec" },
                // vLLM's names where the model has them (a `--layers` override renumbers).
                "layers": if names.len() == pair.model.num_layers as usize {
                    names.to_vec()
                } else {
                    (0..pair.model.num_layers).map(|i| format!("model.layers.{i}.self_attn.attn")).collect()
                },
            }],
        }),
    }
}

pub fn run(args: &LayoutArgs) -> anyhow::Result<Outcome> {
    let args = &args.settings;
    if let Some((model, geom, origin)) = resolve_hybrid(args).map_err(|e| reject(args.format, e))? {
        match args.format {
            Format::Json => output::stdout_json(&HybridLayoutJson {
                status: "ok",
                model: &model.name,
                tp: args.tp,
                rank: args.rank,
                vllm_version: "0.33",
                block_size: geom.sizing.block_tokens,
                kernel_block_size: geom.kernel_block_tokens,
                page_bytes: geom.sizing.page_bytes,
                padding_bytes: geom.sizing.padding_bytes(),
                engine: geom.stated().case_json(args.tp, args.num_blocks, geom.config.kv_buffer_device),
                origin: serde_json::to_value(&origin)?,
                geometry: &geom,
            })?,
            Format::Table => {
                let mut text =
                    crate::report::layout::render_hybrid(&model.name, args.rank, &geom, args.show_regions);
                text.push_str(&origin.text());
                output::stdout(text)?
            }
        }
        return Ok(Outcome::Ok);
    }
    let (pair, geom, names, origin) = resolve(args).map_err(|e| reject(args.format, e))?;
    let mut report = build(args, &pair, &geom, &names);
    report.origin = serde_json::to_value(&origin)?;
    match args.format {
        Format::Json => output::stdout_json(&report)?,
        Format::Table => {
            let mut text = render_uniform(&report, args.show_regions);
            text.push_str(&origin.text());
            output::stdout(text)?
        }
    }
    Ok(Outcome::Ok)
}
