//! `kvx layout`'s views: a uniform engine's rank (its JSON shape and table) and a hybrid model's engine: the KV cache groups, vLLM's aligned block
//! size and padded page, the state slot's parts with their byte ranges, and the regions. Pure:
//! `cli::layout` resolves the geometry and prints this.

use comfy_table::{ContentArrangement, Table, presets::UTF8_FULL_CONDENSED};
use serde::Serialize;

use super::numbers::bytes_text;
use super::table::wrapped_table;
use crate::layouts::hybrid::EngineGeometry;
use crate::layouts::hybrid::geometry::GroupKind;

/// The table view of a hybrid engine's rank.
pub fn render_hybrid(model: &str, rank: u32, g: &EngineGeometry, show_regions: usize) -> String {
    let s = &g.sizing;
    let mut out = format!(
        "kvx layout: {model} | tp {} rank {rank} ({} KV heads on the rank) | {} | vLLM 0.33 (hybrid)\n\
         block size {} tokens (aligned from {} in steps of {}; kernel blocks of {}), page {} per layer per block{}\n",
        g.config.tp,
        g.heads_per_rank,
        g.config.layout,
        s.block_tokens,
        g.config.block_tokens,
        s.alignment_tokens,
        g.kernel_block_tokens,
        bytes_text(s.page_bytes),
        match s.state_page_bytes {
            Some(real) =>
                format!(" (state slot {}, padded by {})", bytes_text(real), bytes_text(s.padding_bytes())),
            None => String::new(),
        },
    );
    // The settings the block size follows, where they matter.
    if let Some(state) = &g.state {
        let mut why = vec![format!("{} attention", g.config.attention_backend.vllm_name())];
        if state.kind == crate::layouts::hybrid::model::StateKind::Gdn {
            why.push(format!("GDN prefill {}", g.config.gdn_prefill.name()));
        }
        why.push(
            if g.config.prefix_caching { "prefix caching on" } else { "prefix caching off" }.to_string(),
        );
        out.push_str(&format!("aligned for {}\n", why.join(", ")));
    }
    let mut groups = wrapped_table(vec!["group", "kind", "layers", "first layers"]);
    for grp in &g.groups {
        let kind = match grp.kind {
            GroupKind::SlidingWindow { window_tokens } => format!("sliding window ({window_tokens} tokens)"),
            k => k.vllm_spec().trim_end_matches("Spec").to_string(),
        };
        let first: Vec<&str> = grp.layers.iter().take(3).map(|l| l.name.as_str()).collect();
        let more = grp.layers.len().saturating_sub(3);
        groups.add_row(vec![
            grp.index.to_string(),
            kind,
            grp.layers.len().to_string(),
            if more > 0 { format!("{} ... +{more}", first.join(", ")) } else { first.join(", ") },
        ]);
    }
    out.push_str(&groups.to_string());
    out.push('\n');
    if let Some(st) = &g.state {
        let mut parts = wrapped_table(vec![
            "state part",
            "bytes in the slot",
            "units on the rank",
            "unit",
            "of the model",
        ]);
        for p in &st.parts {
            parts.add_row(vec![
                p.part.label(),
                format!("{}..{}", p.offset_bytes, p.offset_bytes + p.len_bytes),
                p.units.to_string(),
                bytes_text(p.unit_bytes),
                p.global_units.to_string(),
            ]);
        }
        out.push_str(&parts.to_string());
        out.push_str(&format!(
            "\nstate shapes on the rank: conv {:?}, SSM {:?}\n",
            st.conv_shape, st.ssm_shape
        ));
    }
    let mut regions = wrapped_table(vec![
        "region",
        "name",
        "group",
        "memory",
        "base offset",
        "block len",
        "block stride",
        "blocks",
    ]);
    let n = g.regions.len();
    for r in g.regions.iter().take(show_regions) {
        regions.add_row(vec![
            r.index.to_string(),
            r.name.clone(),
            if r.group_id < 0 { "shared".into() } else { r.group_id.to_string() },
            format!("{:?}", r.mem),
            r.base_off.to_string(),
            r.block_len.to_string(),
            r.block_stride.to_string(),
            r.num_blocks.to_string(),
        ]);
    }
    out.push_str(&regions.to_string());
    if n > show_regions {
        out.push_str(&format!("\n... {} more regions ({n} in all; --show-regions N)", n - show_regions));
    }
    out.push_str(&format!("\nmemory registrations: {}\n", g.registrations.len()));
    out
}

#[derive(Debug, Serialize)]
pub struct AxisJson {
    pub axis: &'static str,
    pub size: u64,
    pub stride_bytes: u64,
}

#[derive(Debug, Serialize)]
pub struct RegionJson {
    pub name: String,
    pub base_offset: u64,
    pub block_len: u64,
    pub block_stride: u64,
    pub num_blocks: u64,
    pub block_content: String,
}

#[derive(Debug, Serialize)]
pub struct LayoutJson {
    pub status: &'static str,
    pub model: String,
    pub vllm_version: &'static str,
    pub layout: String,
    pub layout_description: &'static str,
    pub tp: u32,
    pub rank: u32,
    pub kv_heads_on_rank: u32,
    pub global_heads: Vec<u32>,
    pub block_size: u32,
    pub num_blocks: u32,
    pub bytes_per_token: u64,
    pub bytes_per_block_per_layer: u64,
    pub bytes_per_block: u64,
    pub allocation_bytes: u64,
    pub request_tokens: u32,
    pub request_blocks: u32,
    pub bytes_per_request: u64,
    pub descriptors_per_request: u64,
    pub physical_axes: Vec<AxisJson>,
    pub regions: Vec<RegionJson>,
    pub registrations: Vec<[u64; 2]>,
    /// The engine in the terms of a case's `p`/`d` (one KV cache group of every layer).
    pub engine: serde_json::Value,
    /// What the model was read as: its architecture and the config fields it left out.
    pub origin: serde_json::Value,
}

/// `kvx layout --format json` of a hybrid preset: vLLM's aligned block size and padded page up
/// front, then the whole geometry (groups, state parts, regions, registrations).
#[derive(Debug, Serialize)]
pub struct HybridLayoutJson<'a> {
    pub status: &'static str,
    pub model: &'a str,
    pub tp: u32,
    pub rank: u32,
    pub vllm_version: &'static str,
    /// Tokens per block after vLLM's hybrid alignment.
    pub block_size: u32,
    pub kernel_block_size: u32,
    pub page_bytes: u64,
    pub padding_bytes: u64,
    /// The engine in the terms of a case's `p`/`d` (what vLLM's engine reports: groups, block
    /// size, pages, state shapes), as `kvx plan --scenario` reads it.
    pub engine: serde_json::Value,
    /// What the model was read as: its architecture and the config fields it left out.
    pub origin: serde_json::Value,
    pub geometry: &'a crate::layouts::hybrid::EngineGeometry,
}

/// The table view of a uniform engine's rank; `show_regions` rows of regions at most.
pub fn render_uniform(t: &LayoutJson, show_regions: usize) -> String {
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
        if n > show_regions && i >= show_regions.saturating_sub(1) && i + 1 < n {
            if i == show_regions.saturating_sub(1) {
                table.add_row(vec![
                    "...".to_string(),
                    format!("{} more regions", n - show_regions),
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
