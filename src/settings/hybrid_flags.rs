//! The hybrid model a command's flags name, and its engines from the pair flags: shared by
//! the commands that plan hybrid models (`kvx plan`, `kvx topo`) and the one that moves them
//! (`kvx bench`).

use crate::error::ConfigError;

/// The hybrid model `--model`/`--model-config` name (state, or windows under `--hma on`), or
/// `None` for a uniform one. A shape flag, or one of `refused` given, is refused: a hybrid
/// model's shape is its config's, and vLLM 0.33's rules plan it.
pub fn hybrid_preset_of(
    m: &super::flags::ModelFlags,
    vllm: Option<crate::topology::VllmVersion>,
    refused: &[(bool, &'static str)],
) -> Result<Option<crate::layouts::hybrid::HybridModel>, ConfigError> {
    let resolved = crate::settings::model::resolve_flags(m)?;
    let crate::layouts::model_config::PlanModel::Hybrid(model) = resolved.plan else { return Ok(None) };
    let name = &model.name;
    let shape = [
        (m.num_kv_heads.is_some(), "--num-kv-heads"),
        (m.head_dim.is_some(), "--head-dim"),
        (m.layers.is_some(), "--layers"),
        (m.dtype.is_some(), "--dtype"),
        (m.mla || m.mla_dim.is_some(), "--mla"),
        (vllm.is_some_and(|v| v != crate::topology::VllmVersion::V0_33), "--vllm"),
    ];
    if let Some((_, flag)) = shape.iter().chain(refused).find(|(given, _)| *given) {
        return Err(ConfigError::new(
            *flag,
            format!(
                "{name} is a hybrid model, planned by vLLM 0.33's rules (its shape is its file's or preset's)"
            ),
        ));
    }
    Ok(Some(model))
}

/// The prefill and decode engines of a hybrid pair from the pair flags; `pool` blocks each
/// unless `p_blocks` / `d_blocks` say otherwise.
pub fn hybrid_engines(
    pair: &super::flags::PairFlags,
    pool: u32,
    p_blocks: Option<u32>,
    d_blocks: Option<u32>,
) -> Result<(crate::layouts::hybrid::HybridEngineSpec, crate::layouts::hybrid::HybridEngineSpec), ConfigError>
{
    let engine = |tp: Option<u32>, block: Option<u32>, layout: &Option<String>, blocks: Option<u32>| {
        let mut e = crate::layouts::hybrid::HybridEngineSpec::new(tp.unwrap_or(1), blocks.unwrap_or(pool));
        e.block_tokens = block.unwrap_or(pair.block_size());
        e.kernel_block_tokens = pair.engine.kernel_block_size;
        e.prefix_caching = !pair.engine.no_prefix_caching;
        e.gdn_prefill = pair.engine.gdn_prefill.unwrap_or_default();
        e.attention_backend = pair.engine.attention_backend.unwrap_or_default();
        if let Some(l) = layout.as_ref().or(pair.engine.layout.as_ref()) {
            e.layout = crate::layouts::Layout::parse_for(l, crate::topology::VllmVersion::V0_33)
                .map_err(|e| ConfigError::new("--layout", e))?;
        }
        Ok::<_, ConfigError>(e)
    };
    Ok((
        engine(pair.p_tp, pair.p_block_size, &pair.p_layout, p_blocks)?,
        engine(pair.d_tp, pair.d_block_size, &pair.d_layout, d_blocks)?,
    ))
}

/// The pool an engine needs for `copies` requests of `tokens` prompt tokens on `side` (every
/// KV cache group, at the engine's own block size), plus vLLM's null block: how `kvx bench`
/// and `kvx plan` size a pool the user did not give.
pub fn request_pool(
    model: &crate::layouts::hybrid::HybridModel,
    engine: &crate::layouts::hybrid::HybridEngineSpec,
    side: crate::layouts::hybrid::geometry::Side,
    tokens: u32,
    copies: u32,
) -> Result<u32, ConfigError> {
    use crate::layouts::hybrid::blocks::RequestShape;
    use crate::layouts::hybrid::geometry::EngineGeometry;
    let per_request = RequestShape::of(&EngineGeometry::new(model, engine, side)?).blocks(tokens, 0);
    Ok(per_request.saturating_mul(copies).saturating_add(1))
}

/// A hybrid pair's planner (vLLM's refusals of the pair) and the pair its engines share with
/// uniform models (what the workers' common code reads: TP, the aligned block size, the pool,
/// the layout).
pub fn hybrid_pair_spec(
    config: &crate::layouts::hybrid::HybridPairSpec,
) -> Result<(crate::layouts::compat::PairSpec, crate::layouts::hybrid::HybridPlanner), ConfigError> {
    use crate::layouts::hybrid::geometry::EngineGeometry;
    let planner = crate::layouts::hybrid::HybridPlanner::new(config)?;
    let m = &config.model;
    let engine =
        |e: &crate::layouts::hybrid::HybridEngineSpec, g: &EngineGeometry| crate::layouts::EngineSpec {
            tp: e.tp,
            block_tokens: g.sizing.block_tokens,
            num_blocks: e.num_blocks,
            layout: e.layout,
        };
    let pair = crate::layouts::compat::PairSpec {
        version: crate::topology::VllmVersion::V0_33,
        model: crate::settings::model::ModelShape {
            name: m.name.clone(),
            num_layers: m.num_layers(),
            num_kv_heads: m.attention.num_kv_heads,
            head_dim: m.attention.head_dim,
            dtype: m.attention.dtype,
            mla: None,
        },
        p: engine(&config.p, &planner.p),
        d: engine(&config.d, &planner.d),
        permute: config.permute_local_kv,
    };
    Ok((pair, planner))
}

/// Refuses hybrid-only flags given for a uniform model (`hybrid_only`, then the host buffer's
/// switches `host`), and the host buffer's switches without a host buffer (`add_buffer`: how
/// to add one).
pub fn check_host_switches(
    hybrid: bool,
    host_buffer: bool,
    hybrid_only: &[(bool, &'static str)],
    host: &[(bool, &'static str)],
    add_buffer: &str,
) -> Result<(), ConfigError> {
    let given = |flags: &[(bool, &'static str)]| flags.iter().find(|(on, _)| *on).map(|&(_, flag)| flag);
    if !hybrid && let Some(flag) = given(&[hybrid_only, host].concat()) {
        return Err(ConfigError::new(
            flag,
            "applies to hybrid models (a hybrid preset or model TOML with --model, e.g. nemotron-h-8b)",
        ));
    }
    if !host_buffer && let Some(flag) = given(host) {
        return Err(ConfigError::new(flag, format!("applies to the host buffer's copies: add {add_buffer}")));
    }
    Ok(())
}
