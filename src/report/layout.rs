//! `kvx layout`'s views ([`render`] of an [`EngineLayout`]): a uniform engine's rank (its JSON
//! shape and table) and a hybrid model's engine: the KV cache groups, vLLM's aligned block
//! size and padded page, the state slot's parts with their byte ranges, and the regions. Pure:
//! `settings::layout` resolves the geometry, `cli::layout` prints what [`render`] returns.

use comfy_table::{ContentArrangement, Table, presets::UTF8_FULL_CONDENSED};
use serde::Serialize;

use super::export::pretty_json as pretty;
use super::numbers::bytes_text;
use super::table::wrapped_table;
use crate::config::layout::{EngineLayout, ModelOrigin};
use crate::layouts::compat::PairSpec;
use crate::layouts::hybrid::EngineGeometry;
use crate::layouts::hybrid::geometry::GroupKind;
use crate::layouts::{RankGeometry, Region};

/// How `kvx layout` shows an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayoutView {
    /// Pretty JSON.
    Json,
    /// The tables, with at most `show_regions` rows of regions.
    Table { show_regions: usize },
}

/// The engine as `view` asks, ready to print.
pub fn render(engine: &EngineLayout, view: LayoutView) -> serde_json::Result<String> {
    Ok(match (engine, view) {
        (EngineLayout::Uniform { pair, rank, geom, layer_names, request_tokens, origin }, view) => {
            let mut report = LayoutJson::new(pair, *rank, geom, layer_names, *request_tokens);
            report.origin = serde_json::to_value(origin)?;
            match view {
                LayoutView::Json => pretty(&report)?,
                LayoutView::Table { show_regions } => render_uniform(&report, show_regions) + &origin.text(),
            }
        }
        (EngineLayout::Hybrid { model, tp, rank, num_blocks, geom, origin }, LayoutView::Json) => {
            pretty(&HybridLayoutJson {
                status: "ok",
                model: &model.name,
                tp: *tp,
                rank: *rank,
                vllm_version: "0.33",
                block_size: geom.sizing.block_tokens,
                kernel_block_size: geom.kernel_block_tokens,
                page_bytes: geom.sizing.page_bytes,
                padding_bytes: geom.sizing.padding_bytes(),
                engine: geom.stated().case_json(*tp, *num_blocks, geom.config.kv_buffer_device),
                origin: serde_json::to_value(origin)?,
                geometry: geom,
            })?
        }
        (EngineLayout::Hybrid { model, rank, geom, origin, .. }, LayoutView::Table { show_regions }) => {
            render_hybrid(&model.name, *rank, geom, show_regions) + &origin.text()
        }
    })
}

impl ModelOrigin {
    /// One line for the table view, or nothing when no default was taken.
    pub fn text(&self) -> String {
        match (&self.architecture, self.defaults.is_empty()) {
            (Some(arch), false) => format!(
                "read as {arch}; left out of the config, so its defaults (as transformers fills them for vLLM): {}\n",
                self.defaults.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(", ")
            ),
            _ => String::new(),
        }
    }
}

/// The table view of a hybrid engine's rank.
fn render_hybrid(model: &str, rank: u32, g: &EngineGeometry, show_regions: usize) -> String {
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

impl LayoutJson {
    /// The report of rank `rank` of `pair`'s (prefill) engine, with the per-request figures for
    /// a request of `request_tokens`; `origin` is left null.
    fn new(
        pair: &PairSpec,
        rank: u32,
        g: &RankGeometry,
        names: &[String],
        request_tokens: u32,
    ) -> LayoutJson {
        let (tp, block_size) = (pair.p.tp, pair.p.block_tokens);
        let regions: Vec<Region> = g.regions();
        let request_blocks = request_tokens.div_ceil(block_size);
        LayoutJson {
            status: "ok",
            model: pair.model.name.clone(),
            vllm_version: pair.version.as_str(),
            layout: g.layout.to_string(),
            layout_description: g.layout.describe(),
            tp,
            rank,
            kv_heads_on_rank: g.heads,
            global_heads: g.global_heads.clone().collect(),
            block_size: g.block_tokens,
            num_blocks: g.num_blocks,
            bytes_per_token: g.bytes_per_token(),
            bytes_per_block_per_layer: g.page_bytes(),
            bytes_per_block: g.block_bytes_all_layers(),
            allocation_bytes: g.total_bytes(),
            request_tokens,
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
                "tp": tp,
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
fn render_uniform(t: &LayoutJson, show_regions: usize) -> String {
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
