//! Hybrid models against vLLM 0.33's own code (`hybrid_v033.json`), and properties of the
//! hybrid planner over many models, TP pairs, prompt lengths and prefix hits.
//!
//! Each oracle case is rebuilt from its inputs only (`vllm_version`, `model`, `p`, `d`,
//! `scheduler.prompt_tokens`, `p_raw_block_ids`, `d_raw_unhashed_block_ids`); everything else
//! in the case is what kvx must reproduce.

use std::path::PathBuf;

use kvx::layouts::hybrid::coverage::check_plan;
use kvx::layouts::hybrid::geometry::{
    EngineGeometry, GroupKind, HybridEngineSpec, KvBufferDevice, RegionMem, Side,
};
use kvx::layouts::hybrid::model::{HybridModel, PRESETS};
use kvx::layouts::hybrid::preset;
use kvx::layouts::hybrid::{
    DescList, Finding, HostCopyRule, HybridPairSpec, HybridPlan, HybridPlanner, HybridRequest, RowKind,
    StateSlices,
};
use kvx::layouts::hybrid::{GdnPrefillBackend, HybridError};
use proptest::prelude::*;
use serde_json::Value;

/// Host buffers sit this far above each rank's KV base in the oracle's addresses.
const HOST_BASE: u64 = 0x8000_0000_0000;

/// `KVX_ORACLE_DIR` if set, else `../shared/oracle` beside the crate, else the committed copy.
fn oracle_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("KVX_ORACLE_DIR") {
        return PathBuf::from(dir);
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let shared = root.join("../shared/oracle");
    if shared.join("hybrid_v033.json").exists() { shared } else { root.join("tests/fixtures/oracle") }
}

fn oracle() -> Value {
    let path = oracle_dir().join("hybrid_v033.json");
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

#[test]
fn hybrid_oracle_copy_matches_shared() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let shared = root.join("../shared/oracle/hybrid_v033.json");
    if !shared.exists() {
        return;
    }
    let a = std::fs::read(&shared).expect("shared oracle readable");
    let b = std::fs::read(root.join("tests/fixtures/oracle/hybrid_v033.json")).expect("fixture readable");
    assert!(a == b, "tests/fixtures/oracle/hybrid_v033.json differs from ../shared/oracle: refresh the copy");
}

fn u64_of(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("{key} missing in {v}"))
}

fn lists(v: &Value) -> Vec<Vec<u32>> {
    v.as_array()
        .expect("list of lists")
        .iter()
        .map(|g| g.as_array().expect("list").iter().map(|b| b.as_u64().expect("id") as u32).collect())
        .collect()
}

fn abs_off(mem: RegionMem, off: u64) -> u64 {
    match mem {
        RegionMem::Vram => off,
        RegionMem::Dram => off + HOST_BASE,
    }
}

fn check_engine(label: &str, want: &Value, g: &EngineGeometry) {
    assert_eq!(
        u64_of(want, "block_size_tokens"),
        u64::from(g.sizing.block_tokens),
        "{label}: aligned block size"
    );
    assert_eq!(u64_of(want, "page_bytes"), g.sizing.page_bytes, "{label}: page bytes");
    assert_eq!(u64_of(want, "local_kv_heads"), u64::from(g.heads_per_rank), "{label}: KV heads per rank");
    let groups = want["groups"].as_array().expect("groups");
    assert_eq!(groups.len(), g.groups.len(), "{label}: groups");
    for (w, got) in groups.iter().zip(&g.groups) {
        assert_eq!(w["spec"].as_str(), Some(got.kind.vllm_spec()), "{label}: group {} spec", got.index);
        let names: Vec<&str> = got.layers.iter().map(|l| l.name.as_str()).collect();
        let want_names: Vec<&str> =
            w["layers"].as_array().expect("layers").iter().map(|n| n.as_str().expect("n")).collect();
        assert_eq!(want_names, names, "{label}: group {} layers", got.index);
    }
    if let Some(shapes) = want.get("mamba_state_shapes_local") {
        let s = g.state.as_ref().expect("state");
        let shapes: Vec<Vec<u64>> = shapes
            .as_array()
            .expect("shapes")
            .iter()
            .map(|v| lists(&Value::Array(vec![v.clone()]))[0].iter().map(|&x| u64::from(x)).collect())
            .collect();
        assert_eq!(shapes[0], s.conv_shape.to_vec(), "{label}: conv shape");
        assert_eq!(shapes[1], s.ssm_shape, "{label}: SSM shape");
        assert_eq!(
            Some(u64_of(want, "mamba_real_page_bytes")),
            g.sizing.state_page_bytes,
            "{label}: real page"
        );
        assert_eq!(u64_of(want, "mamba_page_size_padded"), g.sizing.page_bytes, "{label}: padded page");
    }
}

fn check_regions(label: &str, want_regions: &Value, want_reg: &Value, g: &EngineGeometry) {
    let want = want_regions.as_array().expect("regions");
    assert_eq!(want.len(), g.regions.len(), "{label}: regions");
    for (w, r) in want.iter().zip(&g.regions) {
        let l = format!("{label} region {}", r.index);
        assert_eq!(w["name"].as_str(), Some(r.name.as_str()), "{l}: name");
        assert_eq!(w["group_id"].as_i64(), Some(i64::from(r.group_id)), "{l}: group id");
        assert_eq!(u64_of(w, "base_off"), abs_off(r.mem, r.base_off), "{l}: base");
        assert_eq!(u64_of(w, "block_len"), r.block_len, "{l}: block_len");
        assert_eq!(u64_of(w, "block_stride"), r.block_stride, "{l}: stride");
        assert_eq!(u64_of(w, "num_blocks"), r.num_blocks, "{l}: blocks");
    }
    let got: Vec<(u64, u64, &str)> = g
        .registrations
        .iter()
        .map(|x| (abs_off(x.mem, x.off), x.len, if x.mem == RegionMem::Vram { "VRAM" } else { "DRAM" }))
        .collect();
    let want: Vec<(u64, u64, &str)> = want_reg
        .as_array()
        .expect("registered_memory")
        .iter()
        .map(|m| (u64_of(m, "off"), u64_of(m, "len"), m["mem_type"].as_str().expect("mem")))
        .collect();
    assert_eq!(want, got, "{label}: registered memory");
}

fn check_rows(label: &str, want: &Value, got: &DescList) {
    let want = want.as_array().expect("rows");
    assert_eq!(want.len(), got.rows.len(), "{label}: rows");
    for (w, r) in want.iter().zip(&got.rows) {
        let l = format!("{label} {}", r.label);
        assert_eq!(w["label"].as_str(), Some(r.label.to_string().as_str()), "{label}: row label");
        assert_eq!(u64_of(w, "addr_off"), r.addr_off, "{l}: addr");
        assert_eq!(u64_of(w, "len"), r.len, "{l}: len");
        assert_eq!(u64_of(w, "stride"), r.stride, "{l}: stride");
        assert_eq!(u64_of(w, "count"), r.count, "{l}: count");
    }
}

/// Checks one case; returns its name and how many descriptor pairs were compared.
fn check_case(case: &Value) -> (String, usize) {
    let name = case["name"].as_str().expect("name").to_string();
    assert_eq!(case["vllm_version"].as_str(), Some("0.33.0"), "{name}: kvx follows vLLM 0.33");
    // The library's reader of a case (what `kvx plan --scenario` uses), from its inputs only.
    let parsed = kvx::settings::hybrid_case::parse(case).unwrap_or_else(|e| panic!("{name}: {e}"));
    let model = parsed.pair.model.clone();
    let config = parsed.pair.clone();
    // The engines as the case states them (what kvx plans with), and kvx's own derivation of
    // them from the model, which must agree on every public case.
    let stated =
        |e: &Option<kvx::layouts::hybrid::StatedEngine>| e.clone().expect("a case states both engines");
    let pg = EngineGeometry::from_stated(&model, &config.p, &stated(&config.stated.p), Side::Prefill)
        .expect("prefill geometry");
    let dg = EngineGeometry::from_stated(&model, &config.d, &stated(&config.stated.d), Side::Decode)
        .expect("decode geometry");
    for (label, g, e, side) in [("P", &pg, &config.p, Side::Prefill), ("D", &dg, &config.d, Side::Decode)] {
        let derived =
            EngineGeometry::new(&model, e, side).unwrap_or_else(|e| panic!("{name} {label}: derive: {e}"));
        let diff = kvx::layouts::hybrid::compare_stated(&g.stated(), &derived.stated());
        assert!(diff.is_empty(), "{name} {label}: kvx derives another engine than vLLM built: {diff:?}");
    }
    check_engine(&format!("{name} P"), &case["p"], &pg);
    check_engine(&format!("{name} D"), &case["d"], &dg);
    for pr in case["p_ranks"].as_array().expect("p_ranks") {
        let l = format!("{name} P{}", pr["p_rank"]);
        check_regions(&l, &pr["regions"], &pr["registered_memory"], &pg);
        let meta = &pr["agent_metadata"];
        let sizes = lists(&Value::Array(vec![meta["ssm_sizes(conv_bytes,ssm_bytes)"].clone()]))[0].clone();
        let got = pg.state.as_ref().map_or((0, 0), |s| s.ssm_sizes());
        assert_eq!((u64::from(sizes[0]), u64::from(sizes[1])), got, "{l}: ssm_sizes");
        assert_eq!(u64_of(meta, "block_size"), u64::from(pg.kernel_block_tokens), "{l}: metadata block size");
    }
    for dr in case["d_ranks"].as_array().expect("d_ranks") {
        check_regions(&format!("{name} D{}", dr["d_rank"]), &dr["regions"], &dr["registered_memory"], &dg);
    }
    let planner = match HybridPlanner::new(&config) {
        Ok(p) => p,
        Err(e) => {
            let rejected = case["d_ranks"]
                .as_array()
                .and_then(|d| d.iter().find_map(|r| r.get("handshake_rejected")))
                .unwrap_or_else(|| panic!("{name}: vLLM accepts, kvx refused: {e}"));
            let msg = rejected["error"].as_str().expect("error");
            let refusal = e.refusal().unwrap_or_else(|| panic!("{name}: not a vLLM refusal: {e}"));
            assert_eq!(refusal.vllm_message, msg, "{name}: vLLM's condition text");
            assert!(e.to_string().contains(msg), "{name}: message quotes vLLM: {e}");
            assert!(e.knob().to_string().starts_with("--"), "{name}: names a flag: {e}");
            return (name, 0);
        }
    };
    assert!(
        case["d_ranks"].as_array().expect("d_ranks").iter().all(|r| r.get("handshake_rejected").is_none()),
        "{name}: vLLM refuses, kvx accepted"
    );
    let s = &case["scheduler"];
    let plan = planner.plan(&parsed.request.for_planner(&planner), "req-P").expect("plan");
    assert_eq!(
        u64_of(s, "p_prefill_backoff_tokens"),
        u64::from(plan.tokens.backoff_tokens),
        "{name}: backoff"
    );
    assert_eq!(
        u64_of(s, "p_num_computed_tokens_at_finish"),
        u64::from(plan.tokens.p_computed_tokens),
        "{name}"
    );
    assert_eq!(u64_of(s, "d_num_external_tokens"), u64::from(plan.tokens.d_external_tokens), "{name}");
    let window = kvx::layouts::hybrid::blocks::window_blocks(&pg.groups, pg.sizing.block_tokens);
    assert_eq!(
        lists(&Value::Array(vec![s["p_blocks_per_sw"].clone()]))[0],
        window,
        "{name}: blocks per window"
    );
    assert_eq!(
        lists(&s["remote_block_ids_sent"]),
        plan.blocks.remote_block_ids,
        "{name}: remote_block_ids_sent"
    );
    assert_eq!(
        lists(&s["d_local_block_ids_after_clip"]),
        plan.blocks.local_block_ids,
        "{name}: local blocks"
    );
    let mut compared = 0;
    let want_ranks = case["d_ranks"].as_array().expect("d_ranks");
    assert_eq!(want_ranks.len(), plan.d_ranks.len(), "{name}: decode ranks");
    for ((w, got), setup) in want_ranks.iter().zip(&plan.d_ranks).zip(&planner.d_ranks) {
        let l = format!("{name} D{}", got.d_rank);
        assert_eq!(
            lists(&Value::Array(vec![w["handshake_ranks"].clone()]))[0],
            got.handshake_ranks.to_vec(),
            "{l}"
        );
        let tm = &w["tp_mapping"];
        assert_eq!(lists(&tm["source_ranks_per_group"]), got.mapping.source_ranks_per_group, "{l}: sources");
        assert_eq!(u64_of(tm, "rank_offset_factor"), u64::from(got.mapping.rank_offset_factor), "{l}");
        assert_eq!(
            u64_of(tm, "local_consumers(notif count P waits for)"),
            u64::from(got.mapping.local_consumers),
            "{l}: consumers"
        );
        assert_eq!(w["tp_ratio"].as_i64(), Some(planner.tp_ratio), "{l}: tp_ratio");
        assert_eq!(
            u64_of(w, "block_size_ratio"),
            u64::from(planner.block_size_ratio),
            "{l}: block_size_ratio"
        );
        let local = &w["local_dlists(strided rows)"];
        check_rows(
            &format!("{l} local"),
            &local[format!("local_block_size_{}", dg.kernel_block_tokens)],
            &setup.local,
        );
        for (key, rows) in w["remote_dlists(strided rows)"].as_object().expect("remote dlists") {
            assert!(key.starts_with("remote_p_rank_"), "{l}: {key}");
            check_rows(&format!("{l} {key}"), rows, &setup.remote);
        }
        let reads = w["reads"].as_array().expect("reads");
        assert_eq!(reads.len(), got.reads.len(), "{l}: READs");
        for (wr, gr) in reads.iter().zip(&got.reads) {
            assert_eq!(
                wr["remote_dlist"].as_str(),
                Some(format!("remote_p_rank_{}", gr.p_rank).as_str()),
                "{l}"
            );
            assert_eq!(wr["notif_msg"].as_str(), Some(gr.notif_msg.as_str()), "{l}: notification");
            assert_eq!(u64_of(wr, "num_descs") as usize, gr.pairs.len(), "{l}: descriptors");
            let want: Vec<(String, u64, u64, u64)> = wr["pairs[label,local_off,remote_off,len]"]
                .as_array()
                .expect("pairs")
                .iter()
                .map(|t| {
                    let t = t.as_array().expect("quad");
                    let n = |i: usize| t[i].as_u64().expect("number");
                    (t[0].as_str().expect("label").to_string(), n(1), n(2), n(3))
                })
                .collect();
            let got_pairs: Vec<(String, u64, u64, u64)> = gr
                .labeled()
                .map(|p| (p.label.to_string(), p.pair.local, p.pair.remote, p.pair.len))
                .collect();
            assert_eq!(want, got_pairs, "{l}: every pair, in posting order");
            compared += want.len();
        }
        assert!(w["notifs_only"].as_array().expect("notifs").is_empty() && got.notifs_only.is_empty(), "{l}");
        if let Some(h2d) = w.get("h2d_copy_plan(sync_recved_kv_to_device)") {
            let copy = plan.d_sync_to_device.as_ref().expect("h2d copy");
            let h = &h2d[0];
            let layers: Vec<&str> = h["layers_in_copy_order"]
                .as_array()
                .expect("l")
                .iter()
                .map(|x| x.as_str().expect("s"))
                .collect();
            assert_eq!(layers, copy.layers_in_copy_order, "{l}: h2d layer order");
            assert_eq!(
                lists(&Value::Array(vec![h["block_ids"].clone()]))[0]
                    .iter()
                    .map(|&b| u64::from(b))
                    .collect::<Vec<_>>(),
                copy.block_ids,
                "{l}: h2d blocks"
            );
        }
    }
    for pr in case["p_ranks"].as_array().expect("p_ranks") {
        if let Some(d2h) = pr["agent_metadata"].get("d2h_copy_plan(save_kv_to_host)") {
            let copy = plan.p_save_to_host.as_ref().expect("d2h copy");
            let h = &d2h[0];
            let layers: Vec<&str> = h["layers_in_copy_order"]
                .as_array()
                .expect("l")
                .iter()
                .map(|x| x.as_str().expect("s"))
                .collect();
            assert_eq!(layers, copy.layers_in_copy_order, "{name}: d2h layer order");
            assert_eq!(
                lists(&Value::Array(vec![h["block_ids"].clone()]))[0]
                    .iter()
                    .map(|&b| u64::from(b))
                    .collect::<Vec<_>>(),
                copy.block_ids,
                "{name}: d2h blocks"
            );
        }
    }
    (name, compared)
}

#[test]
fn hybrid_oracle_reproduces_every_case() {
    let doc = oracle();
    assert_eq!(doc["vllm_version"].as_str(), Some("0.33.0"));
    let checked: Vec<(String, usize)> =
        doc["cases"].as_array().expect("cases").iter().map(check_case).collect();
    assert_eq!(checked.len(), 8, "{checked:?}");
    assert_eq!(checked.iter().map(|c| c.1).sum::<usize>(), 352, "every descriptor pair of the file compared");
    assert_eq!(checked.iter().filter(|c| c.1 == 0).count(), 1, "one refusal: {checked:?}");
}

/// Whether vLLM refused the case's pair at the handshake.
fn refused(case: &Value) -> bool {
    case["d_ranks"].as_array().is_some_and(|d| d.iter().any(|r| r.get("handshake_rejected").is_some()))
}

/// Cases kvx's own generator (`scripts/hybrid-oracle`) wrote by running vLLM 0.33.0's connector
/// code under recorders: what the shared oracle does not show (Mamba1, Falcon-H1, granite, Gemma-3,
/// prefill TP above decode TP, FlashInfer-aligned GDN, 64-token sliding-window blocks, host
/// buffers, bare-assert refusals). Each is checked as a public case is, every READ pair compared.
#[test]
fn generated_cases_from_vllms_code_are_reproduced() {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/oracle/hybrid_generated_v033.json");
    let doc: Value = serde_json::from_slice(&std::fs::read(&path).expect("generated cases")).expect("JSON");
    assert_eq!(doc["vllm_version"].as_str(), Some("0.33.0"));
    let cases = doc["cases"].as_array().expect("cases");
    let pairs: usize = cases
        .iter()
        .flat_map(|c| c["d_ranks"].as_array().into_iter().flatten())
        .flat_map(|d| d["reads"].as_array().into_iter().flatten())
        .map(|r| r["pairs[label,local_off,remote_off,len]"].as_array().map_or(0, Vec::len))
        .sum();
    let checked: Vec<(String, usize)> = cases.iter().map(check_case).collect();
    assert_eq!(checked.len(), 76, "every generated case");
    assert_eq!(cases.iter().filter(|c| refused(c)).count(), 14, "refused at the handshake");
    assert_eq!(
        checked.iter().map(|c| c.1).sum::<usize>(),
        pairs,
        "every descriptor pair of the file compared"
    );
    assert_eq!(pairs, 11_218);
    assert_eq!(scenario_through_the_binary(cases), pairs, "every pair compared through `kvx plan`");
}

/// kvx's generator's random batch (`scripts/hybrid-oracle/generate-random.sh`, seed 1): layer
/// patterns of every family drawn at random (group counts that do not divide included, so the
/// last group of a kind is short), TP pairs from 1 to 8, host buffers, stated block sizes of
/// window models, FlashInfer-aligned GDN, prompts from 1 token, each run through vLLM 0.33.0's
/// schedulers and workers. Each case is checked as a public case is, and through the binary.
#[test]
fn random_cases_from_vllms_code_are_reproduced() {
    use std::io::Read;
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/oracle/hybrid_random_v033.json.gz");
    let mut text = Vec::new();
    flate2::read::GzDecoder::new(std::fs::File::open(&path).expect("random cases"))
        .read_to_end(&mut text)
        .expect("gzip");
    let doc: Value = serde_json::from_slice(&text).expect("JSON");
    assert_eq!(doc["vllm_version"].as_str(), Some("0.33.0"));
    let cases = doc["cases"].as_array().expect("cases");
    let checked: Vec<(String, usize)> = cases.iter().map(check_case).collect();
    assert_eq!(checked.len(), 111, "every random case");
    assert_eq!(cases.iter().filter(|c| refused(c)).count(), 39, "refused at the handshake");
    for ((name, pairs), case) in checked.iter().zip(cases) {
        assert_eq!(*pairs == 0, refused(case), "{name}: pairs only where vLLM accepts");
    }
    assert_eq!(checked.iter().map(|c| c.1).sum::<usize>(), 30_333, "every descriptor pair compared");
    assert_eq!(scenario_through_the_binary(cases), 30_333, "every pair compared through `kvx plan`");
}

/// A request of `prompt_tokens` with decode holding its first `hit_blocks` blocks, its block
/// lists allocated as vLLM's allocator leaves them.
fn simulated(planner: &HybridPlanner, prompt_tokens: u32, hit_blocks: u32) -> HybridRequest {
    HybridRequest::simulated(planner, prompt_tokens, hit_blocks)
}

/// Pools big enough for a prompt of `max_tokens` on the engine's smallest block.
fn pool_blocks(model: &HybridModel, max_tokens: u32) -> u32 {
    let groups = kvx::layouts::hybrid::geometry::kv_groups(model).len() as u32;
    groups * (max_tokens / 16 + 2) + 2
}

fn planner(
    model: &HybridModel,
    p: HybridEngineSpec,
    d: HybridEngineSpec,
) -> Result<HybridPlanner, HybridError> {
    HybridPlanner::new(&HybridPairSpec {
        model: model.clone(),
        p,
        d,
        permute_local_kv: false,
        state_slices: Default::default(),
        host_copy: Default::default(),
        push_attention: Default::default(),
        stated: Default::default(),
    })
}

/// Pairs outside registered memory, counted from the geometry alone.
fn outside(planner: &HybridPlanner, plan: &HybridPlan) -> usize {
    let (p, d) = (&planner.p, &planner.d);
    plan.d_ranks
        .iter()
        .flat_map(|r| &r.reads)
        .flat_map(|r| r.labeled())
        .map(|x| {
            usize::from(!d.registered(d.mem(), x.pair.local, x.pair.len))
                + usize::from(!p.registered(p.mem(), x.pair.remote, x.pair.len))
        })
        .sum()
}

fn shift_found(plan: &HybridPlan) -> bool {
    plan.findings.iter().any(|f| matches!(f, Finding::AttentionTokensShifted { .. }))
}

fn misread_found(plan: &HybridPlan) -> bool {
    plan.findings.iter().any(|f| matches!(f, Finding::StateSliceMisread { .. }))
}

#[derive(Debug, Clone)]
struct Case {
    model: &'static str,
    p_tp: u32,
    d_tp: u32,
    prompt_tokens: u32,
    hit_blocks: u32,
    flashinfer: bool,
    host: bool,
    /// 16-token attention kernel blocks on both sides.
    kernel16: bool,
    prefix_caching: bool,
    /// LBNHC on both sides (vLLM refuses it with heterogeneous TP).
    nhd: bool,
}

impl Case {
    fn simple(model: &'static str, p_tp: u32, d_tp: u32, prompt_tokens: u32, hit_blocks: u32) -> Self {
        Case {
            model,
            p_tp,
            d_tp,
            prompt_tokens,
            hit_blocks,
            flashinfer: false,
            host: false,
            kernel16: false,
            prefix_caching: true,
            nhd: false,
        }
    }
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::sample::select(PRESETS.to_vec()),
        prop::sample::select(vec![1u32, 2, 4, 8]),
        prop::sample::select(vec![1u32, 2, 4, 8]),
        1u32..12_000,
        0u32..6,
        any::<bool>(),
        prop::bool::weighted(0.15),
        prop::bool::weighted(0.2),
        prop::bool::weighted(0.85),
        prop::bool::weighted(0.1),
    )
        .prop_map(
            |(
                model,
                p_tp,
                d_tp,
                prompt_tokens,
                hit_blocks,
                flashinfer,
                host,
                kernel16,
                prefix_caching,
                nhd,
            )| Case {
                model,
                p_tp,
                d_tp,
                prompt_tokens,
                hit_blocks,
                flashinfer,
                host,
                kernel16,
                prefix_caching,
                nhd,
            },
        )
}

fn run_case(c: &Case) -> Result<(), TestCaseError> {
    let model = preset(c.model).expect("preset");
    let blocks = pool_blocks(&model, c.prompt_tokens);
    let cfg = |tp| HybridEngineSpec {
        gdn_prefill: if c.flashinfer { GdnPrefillBackend::FlashInfer } else { GdnPrefillBackend::Triton },
        kv_buffer_device: if c.host { KvBufferDevice::Cpu } else { KvBufferDevice::Cuda },
        kernel_block_tokens: c.kernel16.then_some(16),
        prefix_caching: c.prefix_caching,
        layout: if c.nhd { kvx::layouts::Layout::Lbnhc } else { kvx::layouts::Layout::Lbhnc },
        ..HybridEngineSpec::new(tp, blocks)
    };
    let pl = match planner(&model, cfg(c.p_tp), cfg(c.d_tp)) {
        Ok(p) => p,
        Err(e) => {
            // A refusal is vLLM's, names a setting and quotes vLLM's condition.
            let r = e.refusal().ok_or_else(|| TestCaseError::fail(format!("not a vLLM refusal: {e}")))?;
            prop_assert!(r.knob.to_string().starts_with("--") && !r.raised().is_empty(), "{e}");
            // A bare assert raises no message: its condition is quoted instead.
            prop_assert!(r.vllm_message.is_empty() == r.assertion.is_some(), "{e}");
            return Ok(());
        }
    };
    // No prefix hit without prefix caching.
    let req = simulated(&pl, c.prompt_tokens, if c.prefix_caching { c.hit_blocks } else { 0 });
    let plan = pl.plan(&req, "req").map_err(|e| TestCaseError::fail(format!("{c:?}: {e}")))?;
    // Every descriptor outside registered memory is reported, and only those.
    let reported = plan.findings.iter().filter(|f| matches!(f, Finding::OutsideRegistration { .. })).count();
    prop_assert_eq!(reported, outside(&pl, &plan), "{:?}", c);
    if c.host {
        let padded = pl.p.sizing.padding_bytes() > 0 || pl.d.sizing.padding_bytes() > 0;
        let says = plan.findings.iter().any(|f| matches!(f, Finding::HostStatePagePadded { .. }));
        prop_assert_eq!(padded, says, "{:?}", c);
        return Ok(());
    }
    prop_assert_eq!(reported, 0, "device plans stay inside registered memory: {:?}", c);
    let report = check_plan(&pl, &plan);
    prop_assert!(report.checked);
    // Wrong bytes only where vLLM's own rules move them, and then the plan says which rule:
    // conv B/C slices (Mamba2 with n_groups below TP), shifted attention tokens (block-size
    // ratio with a decode prefix hit) or head slots of an LBNHC block (prefill heads
    // replicated, so vLLM lets the layout through).
    let shifted = shift_found(&plan);
    let interleaved = pl.findings.iter().any(|f| matches!(f, Finding::HeadSlotsNotContiguous { .. }));
    for e in &report.errors {
        let explained = ((e.contains("Conv(B)") || e.contains("Conv(C)")) && misread_found(&plan))
            || (e.contains("Attn") && (shifted || interleaved));
        prop_assert!(explained, "{:?}: {} (findings {:?})", c, e, plan.findings);
    }
    if report.is_ok() {
        prop_assert!(!shifted, "{:?}: shift reported but bytes are right", c);
        prop_assert!(
            !interleaved || plan.blocks.full_hit(),
            "{:?}: interleaved head slots reported but bytes are right",
            c
        );
        prop_assert!(
            !misread_found(&plan) || plan.blocks.full_hit(),
            "{:?}: misread reported but bytes are right",
            c
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// Over presets, TP pairs, prompt lengths and prefix hits: every accepted pair reads each
    /// attention head's bytes and each state part's slice exactly once (or the plan names
    /// vLLM's misread), and nothing outside registered memory goes unreported.
    #[test]
    fn hybrid_plans_move_each_byte_once(c in case()) {
        run_case(&c)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Past the window, a sliding-window group's bytes per request depend only on where the
    /// prompt ends inside a block, never on its length.
    #[test]
    fn window_bytes_do_not_grow(
        model in prop::sample::select(vec!["gpt-oss-120b", "gemma-3-4b"]),
        p_tp in prop::sample::select(vec![1u32, 2, 4]),
        d_tp in prop::sample::select(vec![1u32, 2, 4]),
        tokens in 2100u32..6000,
        more_blocks in 1u32..400,
    ) {
        let m = preset(model).expect("preset");
        let blocks = pool_blocks(&m, tokens + 16 * more_blocks);
        let pl = planner(&m, HybridEngineSpec::new(p_tp, blocks), HybridEngineSpec::new(d_tp, blocks)).expect("accepted");
        let window_groups: Vec<usize> =
            pl.d.groups.iter().enumerate().filter(|(_, g)| !g.kind.is_state() && g.kind != GroupKind::Full).map(|(i, _)| i).collect();
        let bytes = |t: u32| -> Vec<u64> {
            let plan = pl.plan(&simulated(&pl, t, 0), "req").expect("plan");
            plan.d_ranks.iter().flat_map(|r| {
                let b = r.bytes_by_group(pl.d.groups.len());
                window_groups.iter().map(move |&g| b[g]).collect::<Vec<_>>()
            }).collect()
        };
        prop_assert_eq!(bytes(tokens), bytes(tokens + 16 * more_blocks));
    }
}

#[test]
fn sliding_window_bytes_stop_growing_past_the_window() {
    let model = preset("gpt-oss-120b").expect("preset");
    let blocks = pool_blocks(&model, 33_000);
    for (p_tp, d_tp) in [(1, 1), (1, 2), (2, 1), (2, 8), (8, 8)] {
        let pl = planner(&model, HybridEngineSpec::new(p_tp, blocks), HybridEngineSpec::new(d_tp, blocks))
            .expect("accepted");
        let bytes = |tokens| -> Vec<Vec<u64>> {
            let plan = pl.plan(&simulated(&pl, tokens, 0), "req").expect("plan");
            assert!(check_plan(&pl, &plan).is_ok());
            plan.d_ranks.iter().map(|r| r.bytes_by_group(2)).collect()
        };
        let (short, long) = (bytes(4096), bytes(32_768));
        for (s, l) in short.iter().zip(&long) {
            assert_eq!(s[0], l[0], "P{p_tp} D{d_tp}: window group bytes at 4k and 32k tokens");
            assert!(l[1] > 7 * s[1], "P{p_tp} D{d_tp}: full attention grows with the prompt");
        }
        // At most cdiv(128, 16) + 1 = 9 blocks of the window over 18 layers; at these lengths
        // the first of the 9 is already out of the window (a null block) and is not read.
        let page = pl.d.sizing.page_bytes;
        assert_eq!(short[0][0], 8 * 18 * page, "P{p_tp} D{d_tp}");
    }
}

#[test]
fn vllm_misreads_replicated_mamba2_groups() {
    // Falcon-H1 P1 -> D2 (the reference's finding 3): x and the SSM state are right, B and C
    // are not; the plan says so and the byte check agrees.
    let model = preset("falcon-h1-7b").expect("preset");
    let pl = planner(&model, HybridEngineSpec::new(1, 64), HybridEngineSpec::new(2, 64)).expect("accepted");
    let parts: Vec<(u32, String)> = pl
        .findings
        .iter()
        .filter_map(|f| match f {
            Finding::StateSliceMisread { d_rank, part, .. } => Some((*d_rank, part.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(
        parts,
        vec![(0, "mamba_conv_C".into()), (1, "mamba_conv_B".into()), (1, "mamba_conv_C".into())]
    );
    let plan = pl.plan(&simulated(&pl, 5000, 0), "req").expect("plan");
    let report = check_plan(&pl, &plan);
    assert!(!report.is_ok());
    assert!(report.errors.iter().all(|e| e.contains("Conv(B)") || e.contains("Conv(C)")));
    // Nemotron-H (n_groups 8 divides every TP here) reads every slice right.
    let nem = preset("nemotron-h-8b").expect("preset");
    for (p, d) in [(1, 2), (1, 8), (8, 1), (2, 4), (4, 2)] {
        let pl = planner(&nem, HybridEngineSpec::new(p, 64), HybridEngineSpec::new(d, 64)).expect("accepted");
        assert!(pl.findings.is_empty(), "P{p} D{d}: {:?}", pl.findings);
        let plan = pl.plan(&simulated(&pl, 9000, 2), "req").expect("plan");
        let report = check_plan(&pl, &plan);
        assert!(report.is_ok(), "P{p} D{d}: {:?}", &report.errors[..report.errors.len().min(3)]);
    }
}

#[test]
fn host_buffer_findings() {
    // gpt-oss P1 -> D1 with kv_buffer_device=cpu: the window group's blocks are overwritten by
    // the full-attention layers' host bytes in the host-to-device copy (9 of 9).
    let model = preset("gpt-oss-120b").expect("preset");
    let cpu =
        |tp| HybridEngineSpec { kv_buffer_device: KvBufferDevice::Cpu, ..HybridEngineSpec::new(tp, 200) };
    let pl = planner(&model, cpu(1), cpu(1)).expect("accepted");
    let plan = pl.plan(&simulated(&pl, 200, 0), "req").expect("plan");
    let lost: Vec<(u32, u64, u64)> = plan
        .findings
        .iter()
        .filter_map(|f| match f {
            Finding::HostCopyOverwrites { group, lost_blocks, blocks, .. } => {
                Some((*group, *lost_blocks, *blocks))
            }
            _ => None,
        })
        .collect();
    assert_eq!(lost, vec![(0, 9, 9)]);
    // Nemotron-H: the padded state page runs the last host block past the registration.
    let nem = preset("nemotron-h-8b").expect("preset");
    // Prefill's pool of 10 blocks ends with the attention group's third block (ids 1-6 go to
    // the six state groups).
    let pl = planner(
        &nem,
        HybridEngineSpec { num_blocks: 10, ..cpu(1) },
        HybridEngineSpec { num_blocks: 10, ..cpu(1) },
    )
    .expect("accepted");
    assert!(pl.findings.iter().any(|f| matches!(
        f,
        Finding::HostStatePagePadded { real_page_bytes: 4_255_744, padded_page_bytes: 4_259_840, .. }
    )));
    let plan = pl.plan(&simulated(&pl, 2500, 0), "req").expect("plan");
    let out: Vec<&Finding> = plan
        .findings
        .iter()
        .filter(|f| matches!(f, Finding::OutsideRegistration { side: Side::Prefill, .. }))
        .collect();
    assert!(!out.is_empty(), "prefill block 7 of 8 ends past the unpadded host tensor");
    // The attention group is copied last: at every device position its host layer, which never
    // received the state slots, overwrites them (each state group loses its one slot).
    let lost: Vec<(u32, u64, u64)> = plan
        .findings
        .iter()
        .filter_map(|f| match f {
            Finding::HostCopyOverwrites { group, lost_blocks, blocks, .. } => {
                Some((*group, *lost_blocks, *blocks))
            }
            _ => None,
        })
        .collect();
    assert_eq!(lost, (0..6).map(|g| (g, 1, 1)).collect::<Vec<_>>());
}

/// `--host-state-page padded` (kvx's switch for finding 2): host tensors of state layers hold
/// padded pages, as their regions assume, so nothing is misplaced or reaches past a tensor.
#[test]
fn padded_host_state_pages_keep_every_block_inside() {
    let nem = preset("nemotron-h-8b").expect("preset");
    let e = |padded| HybridEngineSpec {
        kv_buffer_device: KvBufferDevice::Cpu,
        host_state_page_padded: padded,
        ..HybridEngineSpec::new(1, 10)
    };
    for padded in [false, true] {
        let pl = planner(&nem, e(padded), e(padded)).expect("accepted");
        let plan = pl.plan(&simulated(&pl, 2500, 0), "req").expect("plan");
        let page = pl.findings.iter().any(|f| matches!(f, Finding::HostStatePagePadded { .. }));
        let outside = plan.findings.iter().any(|f| matches!(f, Finding::OutsideRegistration { .. }));
        assert_eq!((page, outside), (!padded, !padded), "padded {padded}: {:?}", plan.findings);
    }
}

/// `--host-copy per-group` (kvx's switch for finding 1): each layer copies only its own
/// group's blocks from the host buffer, so no group's blocks are overwritten, for every preset
/// with several KV cache groups; the copy says it is per group.
#[test]
fn per_group_host_copies_overwrite_nothing() {
    let cpu = |tp, blocks| HybridEngineSpec {
        kv_buffer_device: KvBufferDevice::Cpu,
        ..HybridEngineSpec::new(tp, blocks)
    };
    let mut fixed = 0;
    for name in PRESETS {
        let model = preset(name).expect("preset");
        let blocks = pool_blocks(&model, 6000);
        let with = |rule| {
            HybridPlanner::new(&HybridPairSpec {
                model: model.clone(),
                p: cpu(1, blocks),
                d: cpu(1, blocks),
                permute_local_kv: false,
                state_slices: Default::default(),
                host_copy: rule,
                push_attention: Default::default(),
                stated: Default::default(),
            })
            .expect("accepted")
        };
        let overwrites = |pl: &HybridPlanner| {
            let plan = pl.plan(&simulated(pl, 5000, 0), "req").expect("plan");
            let n = plan.findings.iter().filter(|f| matches!(f, Finding::HostCopyOverwrites { .. })).count();
            (n, plan.d_sync_to_device.map(|c| c.per_group))
        };
        let (vllm, _) = overwrites(&with(HostCopyRule::Vllm));
        let (per_group, marked) = overwrites(&with(HostCopyRule::PerGroup));
        assert_eq!(per_group, 0, "{name}");
        assert_eq!(marked, Some(true), "{name}");
        fixed += usize::from(vllm > 0);
    }
    assert!(fixed >= 2, "gpt-oss, Gemma-3 and the Mamba models lose blocks under vLLM's copy: {fixed}");
}

#[test]
fn full_prefix_hit_only_notifies() {
    let model = preset("nemotron-h-8b").expect("preset");
    let pl = planner(&model, HybridEngineSpec::new(4, 64), HybridEngineSpec::new(1, 64)).expect("accepted");
    let mut req = simulated(&pl, 3000, 0);
    req.d_hit_tokens = 2999;
    let plan = pl.plan(&req, "req-P").expect("plan");
    assert!(plan.blocks.full_hit());
    assert!(plan.d_ranks[0].reads.is_empty());
    assert_eq!(plan.d_ranks[0].notifs_only.len(), 4, "every prefill rank of the slice frees its blocks");
}

/// `--state-slices exact` (kvx's switch for the rule vLLM gets wrong): Falcon-H1's replicated B
/// and C read where the model holds them, every byte where the model expects it, at every TP
/// pair vLLM accepts (decode TP at least prefill TP: each part read whole from the one source
/// rank; prefill TP above decode TP: each source rank's piece of decode's slice read where that
/// rank holds it); the x and SSM rows, and every model whose parts are all sharded, read
/// exactly as vLLM reads them.
#[test]
fn exact_state_slices_move_the_right_bytes_where_vllm_misreads() {
    let exact = |model: &HybridModel, p, d| {
        HybridPlanner::new(&HybridPairSpec {
            model: model.clone(),
            p: HybridEngineSpec::new(p, pool_blocks(model, 6000)),
            d: HybridEngineSpec::new(d, pool_blocks(model, 6000)),
            permute_local_kv: false,
            state_slices: StateSlices::Exact,
            host_copy: Default::default(),
            push_attention: Default::default(),
            stated: Default::default(),
        })
    };
    let (mut fixed, mut fixed_above) = (0, 0);
    for name in PRESETS {
        let model = preset(name).expect("preset");
        for (p, d) in [1, 2, 4, 8].into_iter().flat_map(|p| [1, 2, 4, 8].map(|d| (p, d))) {
            let Ok(vllm) = planner(
                &model,
                HybridEngineSpec::new(p, pool_blocks(&model, 6000)),
                HybridEngineSpec::new(d, pool_blocks(&model, 6000)),
            ) else {
                continue;
            };
            let pl = exact(&model, p, d).unwrap_or_else(|e| panic!("{name} P{p} D{d}: {e}"));
            assert!(
                !pl.findings.iter().any(|f| matches!(f, Finding::StateSliceMisread { .. })),
                "{name} P{p} D{d}: {:?}",
                pl.findings
            );
            let plan = pl.plan(&simulated(&pl, 5000, 0), "req").expect("plan");
            let report = check_plan(&pl, &plan);
            assert!(report.is_ok(), "{name} P{p} D{d}: {:?}", &report.errors[..report.errors.len().min(3)]);
            if vllm.findings.iter().any(|f| matches!(f, Finding::StateSliceMisread { .. })) {
                fixed += 1;
            } else {
                // Nothing to fix: the same rows as vLLM's.
                for (a, b) in vllm.d_ranks.iter().zip(&pl.d_ranks) {
                    for i in 0..a.mapping.all_source_ranks.len() {
                        assert_eq!(a.remote_of(i), b.remote_of(i), "{name} P{p} D{d}");
                    }
                }
            }
            if p > d && vllm.findings.iter().any(|f| matches!(f, Finding::StateSliceMisread { .. })) {
                fixed_above += 1;
            }
        }
    }
    assert!(fixed >= 3, "Falcon-H1's misread pairs are fixed: {fixed}");
    assert!(fixed_above >= 2, "and those with prefill TP above decode TP: {fixed_above}");
}

#[test]
fn every_preset_at_every_tp_pair() {
    // Which pairs vLLM accepts, and that every accepted one moves the right bytes (or names
    // the rule that does not), at a prompt past the window and with a decode prefix hit.
    let mut accepted = 0;
    let mut refused = std::collections::BTreeMap::new();
    for name in PRESETS {
        let model = preset(name).expect("preset");
        let blocks = pool_blocks(&model, 6000);
        for p_tp in [1, 2, 4, 8] {
            for d_tp in [1, 2, 4, 8] {
                match planner(
                    &model,
                    HybridEngineSpec::new(p_tp, blocks),
                    HybridEngineSpec::new(d_tp, blocks),
                ) {
                    Err(e) => {
                        let r = e.refusal().unwrap_or_else(|| panic!("{name} P{p_tp} D{d_tp}: {e}"));
                        *refused.entry(format!("{:?}", r.kind)).or_insert(0) += 1;
                    }
                    Ok(_) => {
                        accepted += 1;
                        for hit in [0, 1] {
                            let c = Case::simple(name, p_tp, d_tp, 5000, hit);
                            run_case(&c).unwrap_or_else(|e| panic!("{c:?}: {e}"));
                        }
                    }
                }
            }
        }
    }
    // Aligned blocks per TP 1/2/4/8: Qwen3-Next 544/544/272/144 (triton), granite
    // 400/400/400/208, Falcon-H1 1568/1568/784/400: a pair passes when decode's block is a
    // multiple of prefill's (8 + 6 + 8 refused), and with P > D and a ratio only if each decode
    // rank reads attention from one prefill rank (Qwen3-Next and Falcon-H1 P4 -> D1 refused).
    // Gemma-3 (4 KV heads) refuses P8 -> D1/2/4; Nemotron-H, Jamba and gpt-oss accept all 16.
    let want: std::collections::BTreeMap<String, i32> =
        [("BlockSizeNotDivisible", 22), ("HeadShardedBlockSizes", 2), ("ReplicatedKvPrefillAboveDecode", 3)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
    assert_eq!(refused, want);
    assert_eq!(accepted, 85);
}

#[test]
fn block_size_ratio_with_a_prefix_hit_shifts_attention_tokens() {
    // Falcon-H1 P4 (784-token blocks) -> D2 (1568): decode holds its first block; its two
    // remaining blocks hold 4 sub-blocks but prefill has only 3 more blocks of data, so vLLM
    // trims prefill's list to its last 4 blocks and every token lands one prefill block early.
    let model = preset("falcon-h1-7b").expect("preset");
    let pl = planner(&model, HybridEngineSpec::new(4, 64), HybridEngineSpec::new(2, 64)).expect("accepted");
    assert_eq!(pl.block_size_ratio, 2);
    let plan = pl.plan(&simulated(&pl, 3138, 1), "req").expect("plan");
    let shifts: Vec<(u32, u64, u64)> = plan
        .findings
        .iter()
        .filter_map(|f| match f {
            Finding::AttentionTokensShifted { d_rank, local_token, remote_token, .. } => {
                Some((*d_rank, *local_token, *remote_token))
            }
            _ => None,
        })
        .collect();
    assert_eq!(shifts, vec![(0, 1568, 784), (1, 1568, 784)]);
    assert!(!check_plan(&pl, &plan).is_ok());
    // Without the hit, or when decode's blocks are full, the same pair is right.
    for (tokens, hit) in [(3138, 0), (4705, 1)] {
        let plan = pl.plan(&simulated(&pl, tokens, hit), "req").expect("plan");
        assert!(!shift_found(&plan), "{tokens} tokens, hit {hit}");
        assert!(check_plan(&pl, &plan).errors.iter().all(|e| !e.contains("Attn")));
    }
}

#[test]
fn window_with_different_block_sizes() {
    // gpt-oss with 16-token prefill blocks and 32-token decode blocks: the window keeps 9
    // prefill blocks (144 tokens) and 5 decode blocks (160): does vLLM pair the right tokens?
    let model = preset("gpt-oss-120b").expect("preset");
    let d = HybridEngineSpec { block_tokens: 32, ..HybridEngineSpec::new(1, 800) };
    let pl = planner(&model, HybridEngineSpec::new(1, 800), d).expect("accepted");
    let mut shifted = Vec::new();
    for tokens in 129..1200 {
        let plan = pl.plan(&simulated(&pl, tokens, 0), "req").expect("plan");
        let report = check_plan(&pl, &plan);
        assert_eq!(report.is_ok(), !shift_found(&plan), "{tokens}: {:?}", plan.findings);
        if !report.is_ok() {
            shifted.push(tokens);
        }
    }
    // At 210 tokens prefill keeps blocks 5..13 (tokens 80..224) and decode blocks 2..6
    // (64..224): vLLM clips decode's 10 sub-blocks to the first 9 and so pairs tokens 64..208
    // with 80..224. Whenever decode's window starts a prefill block earlier than prefill's.
    assert!(shifted.contains(&210) && !shifted.contains(&200) && !shifted.contains(&1001), "{shifted:?}");
    assert!(shifted.len() > 200, "{} of 1071 lengths shift", shifted.len());
}

#[test]
fn models_read_from_toml() {
    let text = r#"
        name = "tiny-hybrid"
        layers = ["mamba2", "full", "mamba2", "swa:64", "mlp", "full+mamba2"]
        [attention]
        num_kv_heads = 4
        head_dim = 64
        dtype = "bf16"
        [state]
        kind = "mamba2"
        num_heads = 8
        head_dim = 32
        d_state = 16
        n_groups = 2
        conv_kernel = 4
        conv_dtype = "bf16"
        ssm_dtype = "fp32"
    "#;
    let model: HybridModel = toml::from_str(text).expect("parses");
    model.validate().expect("valid");
    assert_eq!(model.layers[5].to_string(), "full+mamba2");
    let pl = planner(&model, HybridEngineSpec::new(1, 256), HybridEngineSpec::new(2, 256)).expect("accepted");
    let plan = pl.plan(&simulated(&pl, 900, 0), "req").expect("plan");
    assert!(check_plan(&pl, &plan).is_ok());
}

#[test]
fn kernel_blocks_smaller_than_the_block() {
    // 16-token kernel blocks under Nemotron-H's 1040-token blocks (65 per block) on both sides:
    // attention moves at kernel granularity, state slots stay whole.
    let model = preset("nemotron-h-8b").expect("preset");
    let k = |tp| HybridEngineSpec { kernel_block_tokens: Some(16), ..HybridEngineSpec::new(tp, 64) };
    for (p, d) in [(1, 1), (1, 2), (2, 1)] {
        let pl = planner(&model, k(p), k(d)).expect("accepted");
        assert_eq!((pl.p.physical_per_logical, pl.d.kernel_block_tokens), (65, 16));
        let plan = pl.plan(&simulated(&pl, 5000, 1), "req").expect("plan");
        let report = check_plan(&pl, &plan);
        assert!(report.is_ok(), "P{p} D{d}: {:?}", &report.errors[..report.errors.len().min(3)]);
        let attn =
            plan.d_ranks[0].reads[0].labeled().find(|x| x.label.kind == RowKind::AttnPage).expect("attn");
        // A head slice of a kernel page: the smaller of the two sides' kernel pages.
        assert_eq!(attn.pair.len, pl.d.kernel_page_bytes().min(pl.p.kernel_page_bytes()));
    }
    // What clipping saved: the state groups send one slot of their 5.
    let pl = planner(&model, k(1), k(1)).expect("accepted");
    let plan = pl.plan(&simulated(&pl, 5000, 0), "req").expect("plan");
    assert!(plan.clipping.iter().take(6).all(|c| (c.raw_blocks, c.sent_blocks) == (5, 1)));
    assert_eq!((plan.clipping[6].raw_blocks, plan.clipping[6].sent_blocks), (5, 5));
}

/// `kvx plan --scenario CASE --format json` on every case of the oracle, each written to a file
/// as it stands: the blocks after clipping and every READ's pairs are vLLM's, or the refusal is
/// vLLM's (exit 2, JSON status `rejected`, its condition quoted).
#[test]
fn kvx_plan_scenario_reproduces_every_hybrid_case() {
    let doc = oracle();
    assert!(scenario_through_the_binary(doc["cases"].as_array().expect("cases")) > 0, "no pair compared");
}

/// Each case through `kvx plan --scenario CASE --format json`: the blocks after clipping and
/// every READ's pairs are vLLM's, or the refusal is (exit 2, `rejected`, its condition quoted).
/// Returns the pairs compared.
fn scenario_through_the_binary(cases: &[Value]) -> usize {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut compared = 0;
    for (i, case) in cases.iter().enumerate() {
        let name = case["name"].as_str().expect("name");
        let path = dir.path().join(format!("case-{i}.json"));
        std::fs::write(&path, serde_json::to_vec(case).expect("json")).expect("write case");
        let out = crate::common::kvx()
            .args(["plan", "--scenario"])
            .arg(&path)
            .args(["--format", "json"])
            .output()
            .expect("kvx runs");
        let got: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!("{name}: stdout is not JSON ({e}): {}", String::from_utf8_lossy(&out.stderr))
        });
        let rejected =
            case["d_ranks"].as_array().and_then(|d| d.iter().find_map(|r| r.get("handshake_rejected")));
        if let Some(r) = rejected {
            assert_eq!(out.status.code(), Some(2), "{name}: a refusal exits 2");
            assert_eq!(got["status"], "rejected", "{name}");
            assert!(
                got["error"].as_str().expect("error").contains(r["error"].as_str().expect("vLLM's error")),
                "{name}: quotes vLLM's condition: {got}"
            );
            continue;
        }
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        let s = &case["scheduler"];
        assert_eq!(got["remote_block_ids"], s["remote_block_ids_sent"], "{name}: remote_block_ids");
        assert_eq!(got["local_block_ids"], s["d_local_block_ids_after_clip"], "{name}: local_block_ids");
        let want_ranks = case["d_ranks"].as_array().expect("d_ranks");
        let got_ranks = got["d_ranks"].as_array().expect("d_ranks");
        assert_eq!(want_ranks.len(), got_ranks.len(), "{name}: decode ranks");
        assert_eq!(got["tokens"]["backoff_tokens"], s["p_prefill_backoff_tokens"], "{name}: backoff");
        assert_eq!(got["tokens"]["p_computed_tokens"], s["p_num_computed_tokens_at_finish"], "{name}");
        assert_eq!(got["tokens"]["d_external_tokens"], s["d_num_external_tokens"], "{name}");
        for (w, g) in want_ranks.iter().zip(got_ranks) {
            assert_eq!(w["handshake_ranks"], g["handshake_ranks"], "{name}: handshake ranks");
            let (wm, gm) = (&w["tp_mapping"], &g["tp_mapping"]);
            for key in
                ["source_ranks_per_group", "all_source_ranks", "rank_to_attention_slot", "rank_offset_factor"]
            {
                assert_eq!(wm[key], gm[key], "{name}: tp_mapping.{key}");
            }
            assert_eq!(
                wm["local_consumers(notif count P waits for)"], gm["local_consumers"],
                "{name}: consumers"
            );
            assert_eq!(w["tp_ratio"], g["tp_ratio"], "{name}: tp_ratio");
            assert_eq!(w["block_size_ratio"], g["block_size_ratio"], "{name}: block_size_ratio");
            let want_reads = w["reads"].as_array().expect("reads");
            let got_reads = g["reads"].as_array().expect("reads");
            assert_eq!(want_reads.len(), got_reads.len(), "{name}: READs");
            for (wr, gr) in want_reads.iter().zip(got_reads) {
                assert_eq!(wr["notif_msg"], gr["notif_msg"], "{name}: notification");
                assert_eq!(wr["pairs[label,local_off,remote_off,len]"], gr["pairs"], "{name}: every pair");
                compared += gr["pairs"].as_array().expect("pairs").len();
            }
        }
    }
    compared
}

/// `kvx plan --model <hybrid preset>` from flags: planned from --prompt-len; a flag that does
/// not apply to a hybrid preset is refused (exit 2, naming it), never ignored.
#[test]
fn kvx_plan_of_a_hybrid_preset_from_flags() {
    let base = ["plan", "--model", "nemotron-h-8b", "--p-tp", "1", "--d-tp", "2"];
    let out = crate::common::kvx()
        .args(base)
        .args(["--prompt-len", "3000", "--format", "json"])
        .output()
        .expect("kvx runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["d_block_size"], 1040, "Nemotron-H's aligned block size");
    let descs: u64 = v["d_ranks"]
        .as_array()
        .expect("d_ranks")
        .iter()
        .flat_map(|d| d["reads"].as_array().expect("reads"))
        .map(|r| r["num_descs"].as_u64().expect("n"))
        .sum();
    assert!(descs > 0, "{v}");
    assert!(v["posting"]["paths"].as_array().is_some_and(|p| !p.is_empty()), "posting cost");
    for (extra, flag) in [
        (&["--prompt-len", "3000", "--push-attention", "every-rank"][..], "--push-attention"),
        (&["--prompt-len", "3000", "--mode", "push", "--kv-buffer-device", "cpu"][..], "--kv-buffer-device"),
        (&["--prompt-len", "3000", "--layers", "4"][..], "--layers"),
        (&[][..], "--prompt-len"),
    ] {
        let out = crate::common::kvx().args(base).args(extra).output().expect("kvx runs");
        assert_eq!(out.status.code(), Some(2), "{extra:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{extra:?} names {flag}: {err}");
    }
}

/// `kvx plan --mode push` of a hybrid preset: every WRITE is a pull READ with its roles
/// swapped (the same prefill bytes to the same decode place), except where vLLM's push differs
/// (attention left out of decode ranks sharing a head, named, and written with
/// `--push-attention every-rank`); `kvx topo --mode push` shows the same rank map; push's own
/// refusal exits 2 naming `--mode`.
#[test]
fn kvx_plan_and_topo_of_a_hybrid_model_in_push_mode() {
    let run = |args: &[&str]| -> Value {
        let out = crate::common::kvx().args(args).args(["--format", "json"]).output().expect("kvx runs");
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("json")
    };
    // (decode rank, decode offset, len) -> prefill offset, over every READ or WRITE.
    type Landed = std::collections::BTreeMap<(u64, u64, u64), u64>;
    let pulled = |v: &Value| -> Landed {
        let mut out = Landed::new();
        for d in v["d_ranks"].as_array().expect("d_ranks") {
            for r in d["reads"].as_array().expect("reads") {
                for p in r["pairs"].as_array().expect("pairs") {
                    let n = |i: usize| p[i].as_u64().expect("number");
                    out.insert((d["d_rank"].as_u64().expect("d"), n(1), n(3)), n(2));
                }
            }
        }
        out
    };
    let pushed = |v: &Value| -> Landed {
        let mut out = Landed::new();
        for p in v["p_ranks"].as_array().expect("p_ranks") {
            for w in p["writes"].as_array().expect("writes") {
                for x in w["pairs"].as_array().expect("pairs") {
                    let n = |i: usize| x[i].as_u64().expect("number");
                    out.insert((w["d_rank"].as_u64().expect("d"), n(1), n(2)), n(0));
                }
            }
        }
        out
    };
    // Nemotron-H P1 -> D2: more KV heads than decode ranks, so push writes what pull reads.
    let base = ["plan", "--model", "nemotron-h-8b", "--p-tp", "1", "--d-tp", "2", "--prompt-len", "3000"];
    let push = run(&[&base[..], &["--mode", "push"]].concat());
    assert_eq!(push["mode"], "push");
    let landed = pushed(&push);
    assert!(!landed.is_empty());
    assert_eq!(landed, pulled(&run(&base)), "every WRITE is a READ with its roles swapped");
    for d in push["d_ranks"].as_array().expect("d_ranks") {
        assert_eq!(d["writers"], serde_json::json!([0]), "{d}");
        assert_eq!(d["expected_notifs"], 1);
    }
    // Qwen3-Next P1 -> D4 (2 KV heads): vLLM's push writes attention into decode ranks 0 and 2.
    let base = [
        "plan",
        "--model",
        "qwen3-next-80b-a3b",
        "--p-tp",
        "1",
        "--d-tp",
        "4",
        "--block-size",
        "544",
        "--prompt-len",
        "2048",
    ];
    let vllm = run(&[&base[..], &["--mode", "push"]].concat());
    let skipped: Vec<bool> = vllm["p_ranks"][0]["writes"]
        .as_array()
        .expect("writes")
        .iter()
        .map(|w| w["attention_skipped"].as_bool().expect("bool"))
        .collect();
    assert_eq!(skipped, [false, true, false, true]);
    let every = run(&[&base[..], &["--mode", "push", "--push-attention", "every-rank"]].concat());
    assert_eq!(every["push_attention"], "every-rank");
    let pull = pulled(&run(&base));
    assert_eq!(pushed(&every), pull, "every rank's head written, as pull reads it");
    let (with_rule, all) = (pushed(&vllm), pull);
    assert!(with_rule.len() < all.len() && with_rule.iter().all(|(k, v)| all.get(k) == Some(v)));
    let table = crate::common::kvx().args(base).args(["--mode", "push"]).output().expect("kvx runs");
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.contains("D1, D3 get their state but no attention"), "{text}");
    // The rank map alone says the same.
    let topo = run(&[
        "topo",
        "--model",
        "qwen3-next-80b-a3b",
        "--p-tp",
        "1",
        "--d-tp",
        "4",
        "--block-size",
        "544",
        "--mode",
        "push",
    ]);
    let groups: Vec<Value> = topo["push"]["p_ranks"][0]["writes"]
        .as_array()
        .expect("writes")
        .iter()
        .map(|w| w["groups"].clone())
        .collect();
    let (all, state) = (serde_json::json!([0, 1, 2, 3]), serde_json::json!([0, 1, 2]));
    assert_eq!(groups, [all.clone(), state.clone(), all, state]);
    assert_eq!(topo["push"]["d_ranks"][1]["attention_skipped"], true);
    // An oracle case read as push: the same bytes as its READs; a host-buffer case is refused.
    let dir = tempfile::tempdir().expect("temp dir");
    let doc = oracle();
    for (name, ok) in [("mamba2_nemotronh_P1_D2", true), ("mamba2_nemotronh_hostbuf_P1_D1", false)] {
        let case = doc["cases"].as_array().expect("cases").iter().find(|c| c["name"] == name).expect("case");
        let path = dir.path().join(format!("{name}.json"));
        std::fs::write(&path, serde_json::to_vec(case).expect("json")).expect("write case");
        let path = path.to_str().expect("utf-8 path");
        if ok {
            let push = run(&["plan", "--scenario", path, "--mode", "push"]);
            assert_eq!(pushed(&push), pulled(&run(&["plan", "--scenario", path])), "{name}");
        } else {
            let out = crate::common::kvx()
                .args(["plan", "--scenario", path, "--mode", "push"])
                .output()
                .expect("kvx");
            assert_eq!(out.status.code(), Some(2), "{name}");
            assert!(String::from_utf8_lossy(&out.stderr).contains("--mode"), "{name}");
        }
    }
    // Push's own refusal (kernel blocks differ at P4 -> D2), and the switch where it does not apply.
    for (args, flag) in [
        (
            &[
                "plan",
                "--model",
                "qwen3-next-80b-a3b",
                "--gdn-prefill",
                "triton",
                "--p-tp",
                "4",
                "--d-tp",
                "2",
                "--prompt-len",
                "64",
                "--mode",
                "push",
            ][..],
            "--mode",
        ),
        (
            &[
                "topo",
                "--model",
                "qwen3-next-80b-a3b",
                "--gdn-prefill",
                "triton",
                "--p-tp",
                "4",
                "--d-tp",
                "2",
                "--mode",
                "push",
            ][..],
            "--mode",
        ),
        (
            &["topo", "--model", "llama-3.1-8b", "--mode", "push", "--push-attention", "every-rank"][..],
            "--push-attention",
        ),
        (&["topo", "--model", "nemotron-h-8b", "--push-attention", "every-rank"][..], "--push-attention"),
    ] {
        let out = crate::common::kvx().args(args).output().expect("kvx runs");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{args:?} names {flag}: {err}");
    }
}

/// A hybrid model of one's own: `--model FILE.toml` (the TOML `layouts::hybrid::model` reads)
/// works wherever a hybrid preset does (layout, topo, plan), and a file that is not one is
/// refused naming `--model`.
#[test]
fn a_model_toml_runs_layout_topo_and_plan() {
    let file = format!("{}/tests/fixtures/hybrid-model-tiny.toml", env!("CARGO_MANIFEST_DIR"));
    let json = |args: &[&str]| -> Value {
        let out = crate::common::kvx()
            .args(args)
            .args(["--model", &file, "--format", "json"])
            .output()
            .expect("kvx");
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("json")
    };
    let topo = json(&["topo", "--p-tp", "1", "--d-tp", "2"]);
    assert_eq!(topo["model"], "tiny-hybrid");
    // Three Mamba2 groups, two full-attention groups and a sliding window of 64 tokens.
    let kinds: Vec<&str> =
        topo["groups"].as_array().expect("groups").iter().filter_map(|g| g["kind"].as_str()).collect();
    assert_eq!(kinds, ["mamba2", "mamba2", "mamba2", "full", "full", "sliding_window(64)"]);
    let layout = json(&["layout", "--tp", "2"]);
    assert_eq!(layout["block_size"], 32, "{layout}");
    let plan = json(&["plan", "--p-tp", "2", "--d-tp", "1", "--prompt-len", "500"]);
    assert!(plan["d_ranks"][0]["reads"].as_array().is_some_and(|r| !r.is_empty()), "{plan}");
    let bad = format!("{}/Cargo.toml", env!("CARGO_MANIFEST_DIR"));
    let out = crate::common::kvx().args(["topo", "--model", &bad]).output().expect("kvx");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--model"));
}

/// `docs/hybrid-findings.md`: each documented command gives the findings the page describes.
#[test]
fn documented_findings_hold() {
    // `kvx plan` of `model`, P1 -> D`d_tp` at 2,000 tokens, with `extra` flags: its findings.
    let findings = |model: &str, d_tp: &str, extra: &[&str]| -> Vec<Value> {
        let args =
            [&["--model", model, "--p-tp", "1", "--d-tp", d_tp, "--prompt-len", "2000"][..], extra].concat();
        let out = crate::common::kvx().args(["plan", "--format", "json"]).args(&args).output().expect("kvx");
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        let v: Value = serde_json::from_slice(&out.stdout).expect("json");
        v["findings"].as_array().cloned().unwrap_or_default()
    };
    let named =
        |f: &[Value], name: &str| -> Vec<Value> { f.iter().filter_map(|x| x.get(name).cloned()).collect() };
    // 1. Host buffer with several groups: every group of Gemma-3 loses every block.
    let gemma = findings("gemma-3-4b", "1", &["--kv-buffer-device", "cpu"]);
    let lost = named(&gemma, "HostCopyOverwrites");
    assert!(lost.len() > 1, "{gemma:?}");
    assert!(lost.iter().all(|l| l["lost_blocks"] == l["blocks"]), "{lost:?}");
    // 2. Host buffer with a padded state page: 4,096 bytes per block on Nemotron-H.
    let nemo = findings("nemotron-h-8b", "1", &["--kv-buffer-device", "cpu"]);
    let padded = named(&nemo, "HostStatePagePadded");
    assert_eq!(padded.len(), 2, "{nemo:?}");
    for p in &padded {
        assert_eq!(
            p["padded_page_bytes"].as_u64().zip(p["real_page_bytes"].as_u64()).map(|(a, b)| a - b),
            Some(4096)
        );
    }
    // 3. Mamba2 with n_groups below decode TP: Falcon-H1 P1 -> D2 misreads B and C only.
    let falcon = findings("falcon-h1-7b", "2", &[]);
    let misread = named(&falcon, "StateSliceMisread");
    let parts: Vec<(u64, &str)> =
        misread.iter().filter_map(|m| Some((m["d_rank"].as_u64()?, m["part"].as_str()?))).collect();
    assert_eq!(parts, [(0, "mamba_conv_C"), (1, "mamba_conv_B"), (1, "mamba_conv_C")], "{falcon:?}");
    assert!(
        misread[0]["reads"].as_str().is_some_and(|r| r.contains("reads mamba_ssm bytes 0..")),
        "{misread:?}"
    );
    // The switches: Gemma-3's host copy per group loses nothing; the same Falcon-H1 request
    // with exact state slices has nothing to report.
    let per_group = findings("gemma-3-4b", "1", &["--kv-buffer-device", "cpu", "--host-copy", "per-group"]);
    assert!(named(&per_group, "HostCopyOverwrites").is_empty(), "{per_group:?}");
    let padded =
        findings("nemotron-h-8b", "1", &["--kv-buffer-device", "cpu", "--host-state-page", "padded"]);
    assert!(named(&padded, "HostStatePagePadded").is_empty(), "{padded:?}");
    let exact = findings("falcon-h1-7b", "2", &["--state-slices", "exact"]);
    assert!(exact.is_empty(), "{exact:?}");
    // 5. Host buffers with state: every group's blocks read from every layer's host tensor (the
    // plan's total line, as the page shows it); without state, the same either way.
    let total = |model: &str, extra: &[&str]| -> String {
        let args =
            [&["plan", "--model", model, "--p-tp", "1", "--d-tp", "1", "--prompt-len", "4096"][..], extra]
                .concat();
        let out = crate::common::kvx().args(&args).output().expect("kvx");
        assert_eq!(out.status.code(), Some(0), "{args:?}");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        text.lines().find(|l| l.starts_with("total:")).unwrap_or_default().to_string()
    };
    let cpu = ["--kv-buffer-device", "cpu"];
    assert_eq!(total("nemotron-h-8b", &[]), "total: 112 descriptors, 162.4 MiB");
    assert_eq!(total("nemotron-h-8b", &cpu), "total: 688 descriptors, 1.0 GiB");
    // The switch: each group's blocks from its own layers' tensors, the same as direct.
    let own = ["--kv-buffer-device", "cpu", "--host-descriptors", "per-group"];
    assert_eq!(total("nemotron-h-8b", &own), "total: 112 descriptors, 162.4 MiB");
    assert_eq!(total("gpt-oss-120b", &[]), total("gpt-oss-120b", &own));
    assert_eq!(total("gpt-oss-120b", &[]), total("gpt-oss-120b", &cpu));
    assert!(total("gpt-oss-120b", &[]).starts_with("total: 4752 descriptors"));
}

/// Bytes moved for real (in one process): every prefill pool filled by meaning, each READ's
/// pairs copied into its decode pool, every byte checked against what its position means. A
/// tiny Mamba2 + attention model with `n_groups` 1 (B and C replicated), P1 -> D2: vLLM's conv
/// offsets put other parts' bytes into B and C, named as such; `--state-slices exact` moves every
/// byte right; with `n_groups` 4 (every TP here divides it) both rules move every byte right.
#[test]
fn moved_bytes_land_where_the_model_expects_them_or_say_what_they_hold() {
    use kvx::layouts::hybrid::coverage::move_and_check;
    let model = tiny_mamba2;
    let run = |m: &HybridModel, p: u32, d: u32, slices| {
        let pl = HybridPlanner::new(&HybridPairSpec {
            model: m.clone(),
            p: HybridEngineSpec::new(p, pool_blocks(m, 900)),
            d: HybridEngineSpec::new(d, pool_blocks(m, 900)),
            permute_local_kv: false,
            state_slices: slices,
            host_copy: Default::default(),
            push_attention: Default::default(),
            stated: Default::default(),
        })
        .expect("accepted");
        let plan = pl.plan(&simulated(&pl, 900, 0), "req").expect("plan");
        move_and_check(&pl, &plan, 7)
    };
    let g1 = model(1);
    let vllm = run(&g1, 1, 2, StateSlices::Vllm);
    assert!(vllm.checked && vllm.bytes_moved > 0);
    assert!(!vllm.wrong.is_empty(), "vLLM's offsets misplace B and C");
    assert!(
        vllm.wrong.iter().all(|w| w.contains("mamba_conv_B bytes") || w.contains("mamba_conv_C bytes")),
        "only B and C land wrong: {:?}",
        vllm.wrong
    );
    assert!(vllm.wrong.iter().any(|w| w.contains("holds prefill rank 0's")), "{:?}", vllm.wrong);
    let exact = run(&g1, 1, 2, StateSlices::Exact);
    assert!(exact.wrong.is_empty(), "{:?}", exact.wrong);
    assert!(exact.bytes_checked > 0 && exact.bytes_checked <= exact.bytes_moved, "{exact:?}");
    let g4 = model(4);
    for (p, d) in [(1, 1), (1, 2), (2, 2), (2, 4), (1, 4)] {
        for slices in [StateSlices::Vllm, StateSlices::Exact] {
            let r = run(&g4, p, d, slices);
            assert!(r.wrong.is_empty(), "P{p} D{d} {slices:?}: {:?}", &r.wrong[..r.wrong.len().min(3)]);
            assert!(r.bytes_checked > 0, "P{p} D{d}");
        }
    }
}

/// A tiny Mamba2 + attention model whose B and C have `n_groups` groups.
fn tiny_mamba2(n_groups: u32) -> HybridModel {
    let text = format!(
        r#"
        name = "tiny-hybrid-g{n_groups}"
        layers = ["mamba2", "full", "mamba2", "swa:64", "full+mamba2"]
        [attention]
        num_kv_heads = 4
        head_dim = 64
        dtype = "bf16"
        [state]
        kind = "mamba2"
        num_heads = 8
        head_dim = 32
        d_state = 16
        n_groups = {n_groups}
        conv_kernel = 4
        conv_dtype = "bf16"
        ssm_dtype = "fp32"
        "#
    );
    let m: HybridModel = toml::from_str(&text).expect("parses");
    m.validate().expect("valid");
    m
}

/// `--verify sample` as the pipeline runs it: prefill fills only the sampled blocks (the rest
/// of its pool stays zero) and decode checks only their pairs, each side choosing by itself.
/// A plan that moves every byte right shows no wrong byte whatever the request's seed (the two
/// sides agree on the sample), checks a small part of what `full` checks, and checks something
/// over a few requests; a rule that misplaces bytes (vLLM's conv offsets with `n_groups` 1) is
/// caught by some seeds, and only as what it is.
#[test]
fn a_sample_is_the_same_blocks_on_both_sides() {
    use kvx::layouts::hybrid::coverage::{move_and_check, move_and_check_sampled};
    let run = |m: &HybridModel, p: u32, d: u32, slices, seed: u64, stride: u32| {
        let blocks = pool_blocks(m, 2200);
        let pl = HybridPlanner::new(&HybridPairSpec {
            model: m.clone(),
            p: HybridEngineSpec::new(p, blocks),
            d: HybridEngineSpec::new(d, blocks),
            permute_local_kv: false,
            state_slices: slices,
            host_copy: Default::default(),
            push_attention: Default::default(),
            stated: Default::default(),
        })
        .ok()?;
        let plan = pl.plan(&simulated(&pl, 2100, 0), "req").expect("plan");
        Some(if stride == 1 {
            move_and_check(&pl, &plan, seed)
        } else {
            move_and_check_sampled(&pl, &plan, seed, stride)
        })
    };
    let mut pairs_run = 0;
    for name in ["qwen3-next-80b-a3b", "nemotron-h-8b", "falcon-h1-7b", "gpt-oss-120b", "granite-4.0-h-tiny"]
    {
        let m = preset(name).expect("preset");
        for (p, d) in [(1, 2), (2, 1), (4, 2)] {
            let Some(full) = run(&m, p, d, StateSlices::Exact, 1, 1) else { continue };
            assert!(full.wrong.is_empty(), "{name} P{p} D{d}: {:?}", &full.wrong[..full.wrong.len().min(3)]);
            let mut checked = 0;
            for seed in 0..6 {
                let r = run(&m, p, d, StateSlices::Exact, seed, 16).expect("accepted");
                assert!(
                    r.wrong.is_empty(),
                    "{name} P{p} D{d} seed {seed}: {:?}",
                    &r.wrong[..r.wrong.len().min(3)]
                );
                assert_eq!(r.bytes_moved, full.bytes_moved, "{name} P{p} D{d}: the same reads");
                assert!(r.bytes_checked < full.bytes_checked / 4, "{name} P{p} D{d} seed {seed}: {r:?}");
                checked += r.bytes_checked;
            }
            assert!(checked > 0, "{name} P{p} D{d}: six requests checked nothing");
            pairs_run += 1;
        }
    }
    assert!(pairs_run >= 10, "{pairs_run} model and TP pairs accepted");
    let g1 = tiny_mamba2(1);
    let caught: Vec<u64> = (0..16)
        .filter(|&seed| {
            let r = run(&g1, 1, 2, StateSlices::Vllm, seed, 16).expect("accepted");
            assert!(
                r.wrong.iter().all(|w| w.contains("mamba_conv_B bytes") || w.contains("mamba_conv_C bytes")),
                "seed {seed}: only B and C land wrong: {:?}",
                r.wrong
            );
            !r.wrong.is_empty()
        })
        .collect();
    assert!(!caught.is_empty(), "no seed of 16 caught vLLM's conv offsets");
}

/// The oracle case `name`, for the variants below.
fn oracle_case(name: &str) -> Value {
    oracle()["cases"].as_array().expect("cases").iter().find(|c| c["name"] == name).expect("case").clone()
}

/// A case of kvx's own writing: each engine as kvx derives it from `config` (in a case's
/// terms, `StatedEngine::case_json`), with a `model` section that names nothing but the
/// attention (as a case may), and block lists allocated as vLLM's allocator leaves them.
fn written_case(config: Value, p_tp: u32, d_tp: u32, prompt_tokens: u32) -> Value {
    let arch = kvx::layouts::model_config::read(&config, "written").expect("config reads");
    let model = arch.model;
    let p = HybridEngineSpec::new(p_tp, 64);
    let d = HybridEngineSpec::new(d_tp, 64);
    let planner = planner(&model, p, d).expect("pair");
    let request = HybridRequest::simulated(&planner, prompt_tokens, 0);
    let engine = |g: &EngineGeometry, tp| g.stated().case_json(tp, 64, KvBufferDevice::Cuda);
    serde_json::json!({
        "name": "written",
        "vllm_version": "0.33.0",
        "model": {"kv_heads": model.attention.num_kv_heads, "head_dim": model.attention.head_dim},
        "p": engine(&planner.p, p_tp),
        "d": engine(&planner.d, d_tp),
        "scheduler": {
            "prompt_tokens": prompt_tokens,
            "p_raw_block_ids": request.p_raw_block_ids,
            "d_raw_unhashed_block_ids": request.d_raw_unhashed_block_ids,
        },
    })
}

/// The classes of case the held-back oracle cases exercise: a case's engine geometry is what
/// kvx plans with (64-token blocks, FlashInfer-aligned GDN blocks), groups come from any
/// pattern (Mamba1 one attention layer in eight, attention and state in one layer), and a pair
/// whose stated block sizes do not divide is refused as vLLM refuses it.
#[test]
fn a_case_is_planned_as_its_engines_state_it() {
    use kvx::settings::hybrid_case::parse;
    // gpt-oss at 64-token blocks: every pair one 64-token page; the window keeps
    // cdiv(128, 64) + 1 = 3 blocks; no state raises the block size, so the engines were started
    // with 64 (vLLM's --block-size, or the backend's preferred size) and kvx derives from it.
    let mut c = oracle_case("swa_gptoss_P1_D1");
    for side in ["p", "d"] {
        c[side]["block_size_tokens"] = 64.into();
        c[side]["page_bytes"] = (64 * 8 * 64 * 2 * 2).into();
    }
    c["scheduler"]["prompt_tokens"] = 400.into();
    c["scheduler"]["p_raw_block_ids"] =
        serde_json::json!([[0, 0, 21, 22, 23, 24, 25], [1, 2, 3, 4, 5, 6, 7]]);
    c["scheduler"]["d_raw_unhashed_block_ids"] =
        serde_json::json!([[0, 0, 31, 32, 33, 34, 35], [3, 4, 5, 6, 7, 8, 9]]);
    let case = parse(&c).expect("parses");
    let planner = HybridPlanner::new(&case.pair).expect("accepted");
    let plan = planner.plan(&case.request.for_planner(&planner), "req-P").expect("plan");
    assert_eq!(plan.blocks.remote_block_ids, vec![vec![23, 24, 25], (1..=7).collect::<Vec<u32>>()]);
    assert!(
        plan.d_ranks[0].reads[0].pairs.iter().all(|p| p.len == 64 * 8 * 64 * 2 * 2),
        "whole 64-token pages"
    );
    assert_eq!(
        (case.pair.p.block_tokens, case.pair.d.block_tokens),
        (64, 64),
        "started from the stated size"
    );
    let diff = &planner.sources[0].differences;
    assert!(diff.is_empty(), "kvx's own derivation agrees with the stated engines: {diff:?}");
    // Qwen3-Next aligned for FlashInfer's GDN prefill (576 tokens at TP 2, 320 at TP 4): vLLM
    // refuses the pair at the handshake, and so does kvx, from the stated sizes.
    let mut c = oracle_case("gdn_qwen3next_P2_D4");
    for (side, block, heads) in [("p", 576u64, 1u64), ("d", 320, 1)] {
        let page = block * heads * 256 * 2 * 2;
        c[side]["block_size_tokens"] = block.into();
        c[side]["page_bytes"] = page.into();
        c[side]["mamba_page_size_padded"] = page.into();
    }
    let case = parse(&c).expect("parses");
    assert_eq!(
        case.pair.p.gdn_prefill,
        kvx::layouts::hybrid::GdnPrefillBackend::FlashInfer,
        "derived as stated"
    );
    let e = HybridPlanner::new(&case.pair).expect_err("vLLM refuses 576 vs 320");
    assert_eq!(
        e.refusal().map(|r| r.vllm_message.as_str()),
        Some("Local block size 320 is not divisible by remote block size 576 or vice versa.")
    );
    // Mamba1 with one attention layer in eight (Jamba's pattern at 8 layers), P1 -> D2: 7
    // state groups of one layer and one attention group; the state read as Mamba1 from its
    // shapes alone (the case's model section names no state).
    let jamba = serde_json::json!({"architectures": ["JambaForCausalLM"], "num_hidden_layers": 8});
    let case = parse(&written_case(jamba, 1, 2, 300)).expect("parses");
    let planner = HybridPlanner::new(&case.pair).expect("accepted");
    assert_eq!(planner.p.groups.len(), 8);
    assert!(planner.sources.iter().all(|s| s.differences.is_empty()), "{:?}", planner.sources);
    let plan = planner.plan(&case.request.for_planner(&planner), "req-P").expect("plan");
    assert_eq!(plan.blocks.remote_block_ids.len(), 8);
    // Falcon-H1 (attention and Mamba2 in every layer, n_groups 1), 4 layers, P1 -> D2: one
    // attention and one state group, B and C replicated (recovered from how the conv width
    // differs between the two TP sizes), which vLLM's offsets misread.
    let falcon = serde_json::json!({
        "architectures": ["FalconH1ForCausalLM"], "num_hidden_layers": 4, "num_attention_heads": 12,
        "num_key_value_heads": 2, "head_dim": 128, "hidden_size": 3072, "mamba_d_ssm": 3072,
        "mamba_n_heads": 24, "mamba_d_head": 128, "mamba_d_state": 256, "mamba_n_groups": 1
    });
    let case = parse(&written_case(falcon, 1, 2, 3000)).expect("parses");
    let planner = HybridPlanner::new(&case.pair).expect("accepted");
    assert_eq!(planner.p.groups.len(), 2);
    assert!(planner.sources.iter().all(|s| s.differences.is_empty()), "{:?}", planner.sources);
    assert!(
        planner.findings.iter().any(|f| matches!(f, kvx::layouts::hybrid::Finding::StateSliceMisread { .. })),
        "{:?}",
        planner.findings
    );
}

/// Issue 47: `kvx plan` sized a window model's pools as if blocks were 16 tokens, so at block
/// sizes under 16 (a kernel block given with `--kernel-block-size`) it refused a request that
/// `kvx bench` moved ("prefill block id 254 is outside the prefill pool of 254 blocks"). For
/// every block size 1..=64, both window presets, HMA on and off and three TP pairs, `plan`
/// plans the request (or refuses it by a rule of vLLM's, naming --block-size); at a sample of
/// block sizes, the bytes it plans are the bytes `kvx bench` moves for that request.
#[test]
fn window_models_plan_every_block_size_as_bench_moves_it() {
    use crate::common::kvx;
    let plan_bytes = |args: &[String]| -> Result<u64, String> {
        let out = kvx().arg("plan").args(args).args(["--format", "json"]).output().expect("kvx plan");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        if out.status.code() != Some(0) {
            return Err(stderr);
        }
        let v: Value = serde_json::from_slice(&out.stdout).expect("plan JSON");
        let reads = v["d_ranks"].as_array().expect("d_ranks");
        Ok(reads.iter().flat_map(|r| r["reads"].as_array().expect("reads")).map(|r| u64_of(r, "bytes")).sum())
    };
    let mut planned = 0;
    let mut compared = 0;
    for model in ["gemma-3-4b", "gpt-oss-120b"] {
        for hma in ["on", "off"] {
            for (p_tp, d_tp) in [(1, 1), (2, 1), (1, 2)] {
                for bs in 1u32..=64 {
                    // Prompts that end inside, at and past a block, and span the 128-token window.
                    let prompt = [bs * 5 + 1, 256, 300][(bs % 3) as usize];
                    let mut args: Vec<String> = [
                        "--model",
                        model,
                        "--hma",
                        hma,
                        "--p-tp",
                        &p_tp.to_string(),
                        "--d-tp",
                        &d_tp.to_string(),
                        "--prompt-len",
                        &prompt.to_string(),
                        "--block-size",
                        &bs.to_string(),
                    ]
                    .iter()
                    .map(|s| s.to_string())
                    .collect();
                    if hma == "on" {
                        args.extend(["--kernel-block-size".to_string(), bs.to_string()]);
                    }
                    let what = format!("kvx plan {}", args.join(" "));
                    let bytes = match plan_bytes(&args) {
                        Ok(b) => b,
                        Err(e) if e.contains("refuses this pair") && e.contains("--block-size") => continue,
                        Err(e) => panic!("{what}: {e}"),
                    };
                    planned += 1;
                    if (p_tp, d_tp) == (2, 1) && [1, 7, 16, 33, 64].contains(&bs) {
                        let results = tempfile::tempdir().expect("results");
                        let out = kvx()
                            .arg("bench")
                            .args(&args)
                            .args(["--requests", "1", "--no-calibrate", "--format", "json", "--results-dir"])
                            .arg(results.path())
                            .output()
                            .expect("kvx bench");
                        let stderr = String::from_utf8_lossy(&out.stderr);
                        assert_eq!(out.status.code(), Some(0), "{what}: bench: {stderr}");
                        let s: Value = serde_json::from_slice(&out.stdout).expect("bench JSON");
                        let moved = s["bytes_per_request"].as_f64().expect("bytes_per_request");
                        assert_eq!(
                            moved, bytes as f64,
                            "{what}: bench moved {moved} bytes, plan says {bytes}"
                        );
                        compared += 1;
                    }
                }
            }
        }
    }
    assert!(planned > 300, "only {planned} cases planned");
    assert!(compared >= 15, "only {compared} cases compared with bench");
}

/// Any case file in the oracle's format (`KVX_HYBRID_CASES=path`), each case checked as a public
/// case is, each failure named: how a newly generated batch (`scripts/hybrid-oracle`) is tried
/// before it is committed. Run with `cargo test --release --test it hybrid::check_a_case_file --
/// --ignored`.
#[test]
#[ignore = "needs KVX_HYBRID_CASES=<case file>"]
fn check_a_case_file() {
    let path = std::env::var_os("KVX_HYBRID_CASES").expect("set KVX_HYBRID_CASES to a case file");
    let doc: Value = serde_json::from_slice(&std::fs::read(&path).expect("case file")).expect("JSON");
    let mut failed = Vec::new();
    for case in doc["cases"].as_array().expect("cases") {
        let name = case["name"].as_str().unwrap_or("?").to_string();
        match std::panic::catch_unwind(|| check_case(case)) {
            Ok((_, pairs)) => eprintln!("ok {name} ({pairs} pairs)"),
            Err(_) => failed.push(name),
        }
    }
    assert!(failed.is_empty(), "cases kvx does not reproduce: {failed:?}");
}

/// A case whose stated engine contradicts itself or the model: exit 2, the case's field named,
/// `--scenario` the thing to change (not a flag the run was not given).
#[test]
fn a_contradictory_case_names_its_field_and_the_scenario() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut case = oracle_case("mamba2_nemotronh_P1_D2");
    case["d"]["groups"][1]["layers"][0] = "model.layers.99.mixer".into();
    let path = dir.path().join("case.json");
    std::fs::write(&path, serde_json::to_vec(&case).expect("json")).expect("write");
    let out = crate::common::kvx().args(["plan", "--scenario"]).arg(&path).output().expect("kvx runs");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("d.groups") && err.contains("(change --scenario)"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
