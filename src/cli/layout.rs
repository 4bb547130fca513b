//! `kvx layout`: the KV cache layout of one rank — shape, strides, registered regions, bytes.

use clap::Args;
use comfy_table::{ContentArrangement, Table, presets::UTF8_FULL_CONDENSED};
use serde::Serialize;

use super::common::Format;
use super::topo::reject;
use crate::error::Outcome;
use crate::layouts::compat::PairSpec;
use crate::layouts::{RankGeometry, Region};
use crate::output;
use crate::report::numbers::bytes_text;
use crate::settings::layout::{LayoutFlags, resolve, resolve_hybrid};

#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  kvx layout --model llama-3.1-70b --tp 8\n  \
    kvx layout --model deepseek-v3 --layout BLHNC --tokens 32768\n  \
    kvx layout --model qwen3-8b --vllm 0.19 --layout NHD --format json")]
pub struct LayoutArgs {
    #[command(flatten)]
    pub settings: LayoutFlags,
}

#[derive(Debug, Serialize)]
struct AxisJson {
    axis: &'static str,
    size: u64,
    stride_bytes: u64,
}

#[derive(Debug, Serialize)]
struct RegionJson {
    name: String,
    base_offset: u64,
    block_len: u64,
    block_stride: u64,
    num_blocks: u64,
    block_content: String,
}

#[derive(Debug, Serialize)]
struct LayoutJson {
    status: &'static str,
    model: String,
    vllm_version: &'static str,
    layout: String,
    layout_description: &'static str,
    tp: u32,
    rank: u32,
    kv_heads_on_rank: u32,
    global_heads: Vec<u32>,
    block_size: u32,
    num_blocks: u32,
    bytes_per_token: u64,
    bytes_per_block_per_layer: u64,
    bytes_per_block: u64,
    allocation_bytes: u64,
    request_tokens: u32,
    request_blocks: u32,
    bytes_per_request: u64,
    descriptors_per_request: u64,
    physical_axes: Vec<AxisJson>,
    regions: Vec<RegionJson>,
    registrations: Vec<[u64; 2]>,
}

fn build(args: &LayoutFlags, pair: &PairSpec, g: &RankGeometry) -> LayoutJson {
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
    }
}

pub fn run(args: &LayoutArgs) -> anyhow::Result<Outcome> {
    let args = &args.settings;
    if let Some((model, geom)) = resolve_hybrid(args).map_err(|e| reject(args.format, e))? {
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
                geometry: &geom,
            })?,
            Format::Table => output::stdout(crate::report::layout::render_hybrid(
                &model.name,
                args.rank,
                &geom,
                args.show_regions,
            ))?,
        }
        return Ok(Outcome::Ok);
    }
    let (pair, geom) = resolve(args).map_err(|e| reject(args.format, e))?;
    let report = build(args, &pair, &geom);
    match args.format {
        Format::Json => output::stdout_json(&report)?,
        Format::Table => output::stdout(render(args, &report))?,
    }
    Ok(Outcome::Ok)
}

fn render(args: &LayoutFlags, t: &LayoutJson) -> String {
    let mut out = format!(
        "kvx layout: {} | tp {} rank {} ({} KV heads: {:?}) | {} ({}) | vLLM {}\n",
        t.model,
        t.tp,
        t.rank,
        t.kv_heads_on_rank,
        t.global_heads,
        t.layout,
        t.layout_description,
        t.vllm_version
    );
    let axes: Vec<String> = t
        .physical_axes
        .iter()
        .map(|a| format!("{}={} (stride {})", a.axis, a.size, bytes_text(a.stride_bytes)))
        .collect();
    out.push_str(&format!("physical axes, outermost first: {}\n", axes.join(", ")));
    out.push_str(&format!(
        "bytes: {} per token, {} per block per layer, {} per block ({} tokens), {} allocated for {} blocks\n",
        bytes_text(t.bytes_per_token),
        bytes_text(t.bytes_per_block_per_layer),
        bytes_text(t.bytes_per_block),
        t.block_size,
        bytes_text(t.allocation_bytes),
        t.num_blocks
    ));
    out.push_str(&format!(
        "a request of {} tokens: {} blocks, {}, {} descriptors per source rank ({} regions x {} blocks)\n",
        t.request_tokens,
        t.request_blocks,
        bytes_text(t.bytes_per_request),
        t.descriptors_per_request,
        t.regions.len(),
        t.request_blocks
    ));
    let mut table = Table::new();
    table.load_style(UTF8_FULL_CONDENSED).set_content_arrangement(ContentArrangement::Dynamic);
    table.set_header(vec![
        "region",
        "name",
        "base offset",
        "block len",
        "block stride",
        "blocks",
        "block holds",
    ]);
    let n = t.regions.len();
    for (i, r) in t.regions.iter().enumerate() {
        if n > args.show_regions && i >= args.show_regions.saturating_sub(1) && i + 1 < n {
            if i == args.show_regions.saturating_sub(1) {
                table.add_row(vec![
                    "...".to_string(),
                    format!("{} more regions", n - args.show_regions),
                    String::new(),
                ]);
            }
            continue;
        }
        table.add_row(vec![
            i.to_string(),
            r.name.clone(),
            r.base_offset.to_string(),
            r.block_len.to_string(),
            r.block_stride.to_string(),
            r.num_blocks.to_string(),
            r.block_content.clone(),
        ]);
    }
    out.push_str(&table.to_string());
    let regs: Vec<String> =
        t.registrations.iter().take(4).map(|[o, n]| format!("[{o}, +{})", bytes_text(*n))).collect();
    out.push_str(&format!(
        "\nmemory registrations: {}{}\n",
        regs.join(" "),
        if t.registrations.len() > 4 {
            format!(" ... ({} in all)", t.registrations.len())
        } else {
            String::new()
        }
    ));
    out
}

/// `kvx layout --format json` of a hybrid preset: vLLM's aligned block size and padded page up
/// front, then the whole geometry (groups, state parts, regions, registrations).
#[derive(Debug, Serialize)]
struct HybridLayoutJson<'a> {
    status: &'static str,
    model: &'a str,
    tp: u32,
    rank: u32,
    vllm_version: &'static str,
    /// Tokens per block after vLLM's hybrid alignment.
    block_size: u32,
    kernel_block_size: u32,
    page_bytes: u64,
    padding_bytes: u64,
    geometry: &'a crate::layouts::hybrid::EngineGeometry,
}
