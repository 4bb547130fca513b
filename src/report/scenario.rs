//! What a run was asked to do, as its summary records it ([`Scenario`]): the settings every
//! run shares by name, the typed settings of bench and load runs past them
//! ([`ScenarioExtra`]), and a bench run's scenario from its resolved settings
//! ([`bench_scenario`]).

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::arrival::Arrival;
use crate::config::bench::BenchSettings;
use crate::config::worker::{Dispatch, Overlap, RankStart};
use crate::layouts::hybrid::{HostCopyRule, HostDescriptors, HostStatePage, StateSlices};
use crate::topology::{TransferMode, VllmVersion};
use crate::transfer::ucx::ProgressMode;
use crate::vocab::kinds::{Endpoint, KvBufferDevice, MemKind};

/// What was run. Every field is optional so `kvx bench` can grow it; fields this kvx does not
/// name are kept in `extra.other` and round-trip unchanged.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Scenario {
    /// Preset or config-file name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p_tp: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub d_tp: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p_layout: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub d_layout: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p_block_size: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub d_block_size: Option<u32>,
    /// As given: `8192`, `1024..32768` or `file:NAME`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_len: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix_hit: Option<f64>,
    /// `contiguous`, `fragmented` or `random`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alloc: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requests: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate_rps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inflight: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repeat: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verify: Option<crate::vocab::kinds::VerifyMode>,
    /// Transports asked for (`UCX_TLS`), as opposed to the ones UCX selected (`ucx.transports`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transport: Option<String>,
    /// `host` or `cuda`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mem: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub on_load_failure: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// The settings past these, written after them in key order.
    #[serde(flatten)]
    pub extra: ScenarioExtra,
}

impl Scenario {
    /// The set fields as `(name, value)` pairs, in schema order then `extra`, for headers.
    pub fn fields(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        macro_rules! push {
            ($($f:ident),*) => {
                $(if let Some(v) = &self.$f {
                    out.push((stringify!($f).to_string(), v.to_string()));
                })*
            };
        }
        push!(
            name,
            model,
            p_tp,
            d_tp,
            p_layout,
            d_layout,
            p_block_size,
            d_block_size,
            prompt_len,
            prefix_hit,
            alloc,
            requests,
            duration_s,
            warmup,
            concurrency,
            rate_rps,
            inflight,
            repeat,
            verify,
            transport,
            mem,
            on_load_failure,
            seed
        );
        let extra = BTreeMap::from(self.extra.clone());
        out.extend(extra.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.clone(), display_value(v))));
        out
    }
}

/// A JSON value as a reader would write it: strings without quotes.
pub fn display_value(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        // Measured figures (not integers) read as the tables' other numbers do.
        serde_json::Value::Number(n) if !n.is_i64() && !n.is_u64() => {
            n.as_f64().map_or_else(|| n.to_string(), super::numbers::fmt_f)
        }
        other => other.to_string(),
    }
}

/// The scenario's settings past its common fields, typed: a bench run's pair, transport and
/// host buffers, a load run's requests, and whether the serving path ran. Keys this kvx does
/// not name (a newer kvx's, a load target's `target.<name>`) stay in `other` as written.
///
/// Written as one map in key order, the typed settings among the others under their names (as
/// the one `BTreeMap` of them all that older summaries came from), so a summary reads and
/// writes back byte for byte. A value that does not read as its type (one another kvx wrote
/// differently) stays in `other`, as written.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(into = "BTreeMap<String, Value>", from = "BTreeMap<String, Value>")]
pub struct ScenarioExtra {
    /// Which vLLM release's rules the pair follows.
    pub vllm_rules: Option<VllmVersion>,
    /// Blocks in each engine's KV pool.
    pub pool_blocks_p: Option<u32>,
    pub pool_blocks_d: Option<u32>,
    pub mode: Option<TransferMode>,
    pub progress: Option<ProgressMode>,
    pub coalesce: Option<bool>,
    /// The transport's injected slowdown, where there was one.
    pub slowdown: Option<f64>,
    /// Push mode: how the legs were sent, and whether WRITEs followed each layer.
    pub dispatch: Option<Dispatch>,
    pub overlap: Option<Overlap>,
    /// When a decode engine's ranks started a request (`--rank-start`).
    pub rank_start: Option<RankStart>,
    /// The simulated prefill's time per layer, where it had one.
    pub prefill_time_per_layer_us: Option<f64>,
    /// A host buffer per rank (vLLM's `kv_buffer_device` `cpu`); absent: the KV pool itself.
    pub kv_buffer_device: Option<HostBuffer>,
    /// A hybrid model through host buffers: which of vLLM 0.33's host-buffer rules ran.
    pub host_copy: Option<HostCopyRule>,
    pub host_state_page: Option<HostStatePage>,
    pub host_descriptors: Option<HostDescriptors>,
    /// A hybrid model: where decode reads its slice of each state part.
    pub state_slices: Option<StateSlices>,
    /// A load run's requests.
    pub endpoint: Option<Endpoint>,
    pub stream: Option<bool>,
    pub max_tokens: Option<u64>,
    pub ignore_eos: Option<bool>,
    /// The goodput objectives, as `--slo` reads.
    pub slo: Option<String>,
    /// A bench run through the serving path (engines, proxy, load generator).
    pub serve: Option<bool>,
    /// Every other key, as written.
    pub other: BTreeMap<String, Value>,
}

impl ScenarioExtra {
    /// Each typed setting under its key.
    fn slots(&mut self) -> [(&'static str, &mut dyn Slot); 22] {
        macro_rules! slots {
            ($($f:ident),*) => { [$((stringify!($f), &mut self.$f as &mut dyn Slot)),*] };
        }
        slots!(
            vllm_rules,
            pool_blocks_p,
            pool_blocks_d,
            mode,
            progress,
            coalesce,
            slowdown,
            dispatch,
            overlap,
            rank_start,
            prefill_time_per_layer_us,
            kv_buffer_device,
            host_copy,
            host_state_page,
            host_descriptors,
            state_slices,
            endpoint,
            stream,
            max_tokens,
            ignore_eos,
            slo,
            serve
        )
    }

    /// Adds `more`'s settings, as one map extends another: where both set one, `more`'s.
    pub fn extend(&mut self, more: ScenarioExtra) {
        let mut all = BTreeMap::from(std::mem::take(self));
        all.extend(BTreeMap::from(more));
        *self = ScenarioExtra::from(all);
    }
}

impl From<ScenarioExtra> for BTreeMap<String, Value> {
    fn from(mut x: ScenarioExtra) -> Self {
        let mut map = std::mem::take(&mut x.other);
        for (key, slot) in x.slots() {
            slot.write(key, &mut map);
        }
        map
    }
}

impl From<BTreeMap<String, Value>> for ScenarioExtra {
    fn from(mut map: BTreeMap<String, Value>) -> Self {
        let mut x = ScenarioExtra::default();
        for (key, slot) in x.slots() {
            slot.read(key, &mut map);
        }
        x.other = map;
        x
    }
}

/// A typed setting of [`ScenarioExtra`], written to and read from the map under its key.
trait Slot {
    fn write(&self, key: &str, map: &mut BTreeMap<String, Value>);
    fn read(&mut self, key: &str, map: &mut BTreeMap<String, Value>);
}

impl<T: Serialize + DeserializeOwned> Slot for Option<T> {
    fn write(&self, key: &str, map: &mut BTreeMap<String, Value>) {
        if let Some(v) = self.as_ref().and_then(|t| serde_json::to_value(t).ok()) {
            map.insert(key.to_string(), v);
        }
    }

    /// Takes the key's value when it reads as a `T` that writes back the same (`1` read as a
    /// float would write back as `1.0`); otherwise leaves it in the map.
    fn read(&mut self, key: &str, map: &mut BTreeMap<String, Value>) {
        let Some(v) = map.get(key) else { return };
        let Ok(t) = T::deserialize(v) else { return };
        if serde_json::to_value(&t).is_ok_and(|back| back == *v) {
            map.remove(key);
            *self = Some(t);
        }
    }
}

/// vLLM's `kv_buffer_device` `cpu` as a summary records it: a host buffer per rank, and what
/// its two copies (prefill's save to it, decode's sync from it) are over the run's KV pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum HostBuffer {
    /// Over a device pool: device/host copies through pinned staging.
    #[serde(rename = "cpu: a host buffer per rank; device/host copies through pinned staging")]
    DevicePool,
    /// Over a host pool: memcpy.
    #[serde(rename = "cpu: a host buffer per rank, apart from its host KV pool; the copies are memcpy")]
    HostPool,
}

impl HostBuffer {
    /// Host buffers over a KV pool in `pool` memory.
    pub fn over(pool: MemKind) -> HostBuffer {
        match pool {
            MemKind::Cuda => HostBuffer::DevicePool,
            MemKind::Host => HostBuffer::HostPool,
        }
    }
}

/// A bench run's scenario as the summary records it.
pub fn bench_scenario(b: &BenchSettings) -> Scenario {
    let (concurrency, rate) = match b.arrival {
        Arrival::Closed { concurrency } => (Some(concurrency), None),
        Arrival::Poisson { rate } => (None, Some(rate)),
    };
    let w = &b.workers;
    let pair = &w.pair;
    let push = w.transport.mode == TransferMode::Push;
    let host_buffer = w.transport.kv_buffer == KvBufferDevice::Cpu;
    // Which of vLLM 0.33's host-buffer rules ran (or the switches that replaced them).
    let hybrid_host = w.hybrid.as_ref().filter(|_| host_buffer);
    Scenario {
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
        extra: ScenarioExtra {
            vllm_rules: Some(pair.version),
            pool_blocks_p: Some(pair.p.num_blocks),
            pool_blocks_d: Some(pair.d.num_blocks),
            mode: Some(w.transport.mode),
            progress: Some(w.transport.progress),
            coalesce: Some(w.transport.coalesce),
            slowdown: Some(w.transport.slowdown).filter(|s| *s > 0.0),
            dispatch: push.then_some(b.dispatch),
            overlap: push.then_some(w.prefill.overlap),
            rank_start: Some(w.rank_start),
            prefill_time_per_layer_us: (w.prefill.per_layer_ns > 0)
                .then(|| w.prefill.per_layer_ns as f64 / 1e3),
            kv_buffer_device: host_buffer.then(|| HostBuffer::over(w.mem.kind())),
            host_copy: hybrid_host.map(|h| h.host_copy),
            host_state_page: hybrid_host.map(|h| h.d.host_state_page()),
            host_descriptors: hybrid_host.map(|h| h.d.host_descriptors()),
            state_slices: w.hybrid.as_ref().map(|h| h.state_slices),
            ..ScenarioExtra::default()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scenario_keeps_unknown_fields() {
        let json = r#"{"model":"m","p_tp":8,"future_knob":{"a":1}}"#;
        let sc: Scenario = serde_json::from_str(json).expect("parse");
        assert_eq!(sc.p_tp, Some(8));
        assert_eq!(sc.extra.other.get("future_knob"), Some(&serde_json::json!({"a": 1})));
        let back = serde_json::to_value(&sc).expect("ser");
        assert_eq!(back, serde_json::from_str::<serde_json::Value>(json).expect("v"));
        assert_eq!(
            sc.fields(),
            vec![
                ("model".to_string(), "m".to_string()),
                ("p_tp".to_string(), "8".to_string()),
                ("future_knob".to_string(), r#"{"a":1}"#.to_string())
            ]
        );
    }

    /// The typed settings read back from their keys and write back in key order, among the
    /// keys this kvx does not name, byte for byte; a value that does not read as its type
    /// stays as written.
    #[test]
    fn typed_settings_round_trip_byte_for_byte() {
        let json = r#"{"p_tp":2,"coalesce":false,"dispatch":"concurrent","endpoint":"/v1/completions","host_copy":"per-group","kv_buffer_device":"cpu: a host buffer per rank, apart from its host KV pool; the copies are memcpy","mode":"push","overlap":"layers","pool_blocks_d":65,"progress":"hybrid","serve":true,"slowdown":0.15,"state_slices":"exact","target.url":"http://x/","vllm_rules":"0.33","zzz":1}"#;
        let sc: Scenario = serde_json::from_str(json).expect("parse");
        let x = &sc.extra;
        assert_eq!(x.mode, Some(TransferMode::Push));
        assert_eq!((x.dispatch, x.overlap), (Some(Dispatch::Concurrent), Some(Overlap::Layers)));
        assert_eq!(x.kv_buffer_device, Some(HostBuffer::HostPool));
        assert_eq!((x.host_copy, x.state_slices), (Some(HostCopyRule::PerGroup), Some(StateSlices::Exact)));
        assert_eq!((x.endpoint, x.serve, x.slowdown), (Some(Endpoint::Completions), Some(true), Some(0.15)));
        assert_eq!(x.other.keys().collect::<Vec<_>>(), ["target.url", "zzz"]);
        assert_eq!(serde_json::to_string(&sc).expect("ser"), json);

        let odd = r#"{"mode":"sideways","pool_blocks_p":-1,"slowdown":1}"#;
        let sc: Scenario = serde_json::from_str(odd).expect("parse");
        assert_eq!((sc.extra.mode, sc.extra.pool_blocks_p, sc.extra.slowdown), (None, None, None));
        assert_eq!(sc.extra.other.len(), 3);
        assert_eq!(serde_json::to_string(&sc).expect("ser"), odd);
    }
}
