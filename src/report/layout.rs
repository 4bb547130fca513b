//! `kvx layout`'s view of a hybrid model's engine: the KV cache groups, vLLM's aligned block
//! size and padded page, the state slot's parts with their byte ranges, and the regions. Pure:
//! `cli::layout` resolves the geometry and prints this.

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
