//! What a run was asked to do, as its summary records it ([`Scenario`]), from the run's
//! resolved settings.

use std::collections::BTreeMap;

use super::summary::Scenario;
use crate::config::arrival::Arrival;
use crate::config::bench::BenchSettings;

/// A bench run's scenario as the summary records it.
pub fn bench_scenario(b: &BenchSettings) -> Scenario {
    let (concurrency, rate) = match b.arrival {
        Arrival::Closed { concurrency } => (Some(concurrency), None),
        Arrival::Poisson { rate } => (None, Some(rate)),
    };
    let w = &b.workers;
    let pair = &w.pair;
    let mut s = Scenario {
        name: Some(b.name.clone()),
        model: Some(pair.model.name.clone()),
        p_tp: Some(pair.p.tp),
        d_tp: Some(pair.d.tp),
        p_layout: Some(pair.p.layout.to_string()),
        d_layout: Some(pair.d.layout.to_string()),
        p_block_size: Some(pair.p.block_tokens),
        d_block_size: Some(pair.d.block_tokens),
        prompt_len: Some(b.lens.to_string()),
        prefix_hit: Some(b.prefix_hit),
        alloc: Some(w.alloc.to_string()),
        requests: b.requests,
        duration_s: b.duration.map(|d| d.as_secs_f64()),
        warmup: Some(b.warmup),
        concurrency,
        rate_rps: rate,
        inflight: Some(w.transport.inflight),
        repeat: Some(b.repeat),
        verify: Some(w.verify),
        transport: Some(w.transport.kind.as_str().to_string()),
        mem: Some(w.mem.to_string()),
        on_load_failure: Some(b.on_failure.as_str().to_string()),
        seed: Some(w.seed),
        extra: BTreeMap::new(),
    };
    s.extra.insert("vllm_rules".into(), serde_json::json!(pair.version.as_str()));
    s.extra.insert("pool_blocks_p".into(), serde_json::json!(pair.p.num_blocks));
    s.extra.insert("pool_blocks_d".into(), serde_json::json!(pair.d.num_blocks));
    s.extra.insert("coalesce".into(), serde_json::json!(w.transport.coalesce));
    if w.transport.slowdown > 0.0 {
        s.extra.insert("slowdown".into(), serde_json::json!(w.transport.slowdown));
    }
    s.extra.insert("progress".into(), serde_json::json!(w.transport.progress.to_string()));
    s.extra.insert("mode".into(), serde_json::json!(w.transport.mode.as_str()));
    if w.transport.mode == crate::topology::TransferMode::Push {
        s.extra.insert("dispatch".into(), serde_json::json!(b.dispatch.as_str()));
        s.extra.insert("overlap".into(), serde_json::json!(w.prefill.overlap.as_str()));
    }
    if w.transport.kv_buffer == crate::vocab::kinds::KvBufferDevice::Cpu {
        // What the two staged copies are on this memory (stages save_to_host, sync_to_device).
        let how = if w.mem.kind() == crate::transfer::memory::MemKind::Cuda {
            "cpu: a host buffer per rank; device/host copies through pinned staging"
        } else {
            "cpu: a host buffer per rank, apart from its host KV pool; the copies are memcpy"
        };
        s.extra.insert("kv_buffer_device".into(), serde_json::json!(how));
        if let Some(h) = w.hybrid.as_ref() {
            // Which of vLLM 0.33's host-buffer rules ran (or the switch that replaced it).
            let copy = match h.host_copy {
                crate::layouts::hybrid::HostCopyRule::Vllm => "vllm",
                crate::layouts::hybrid::HostCopyRule::PerGroup => "per-group",
            };
            let page = if h.d.host_state_page_padded { "padded" } else { "vllm" };
            s.extra.insert("host_copy".into(), serde_json::json!(copy));
            s.extra.insert("host_state_page".into(), serde_json::json!(page));
            let descs = if h.d.host_descriptors_per_group { "per-group" } else { "vllm" };
            s.extra.insert("host_descriptors".into(), serde_json::json!(descs));
        }
    }
    if let Some(h) = w.hybrid.as_ref() {
        let slices = match h.state_slices {
            crate::layouts::hybrid::StateSlices::Vllm => "vllm",
            crate::layouts::hybrid::StateSlices::Exact => "exact",
        };
        s.extra.insert("state_slices".into(), serde_json::json!(slices));
    }
    if w.prefill.per_layer_ns > 0 {
        s.extra.insert(
            "prefill_time_per_layer_us".into(),
            serde_json::json!(w.prefill.per_layer_ns as f64 / 1e3),
        );
    }
    s
}
