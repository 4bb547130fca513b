//! Every case of both oracle files (vectors produced by executing vLLM's own code).

use kvx::layouts::compat::PairSpec;
use kvx::layouts::read_plan::{Planner, RequestBlocks, RequestIds};
use kvx::layouts::{EngineSpec, Layout};
use kvx::settings::model::{Dtype, Mla, ModelShape};
use kvx::settings::scenario::PlanScenario;
use kvx::topology::VllmVersion;
use serde_json::Value;

use crate::common::{kvx, oracle, oracle_dir};

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array().expect("array").iter().map(|x| x.as_u64().expect("int") as u32).collect()
}

fn u64_of(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("{key} missing in {v}"))
}

#[test]
fn oracle_copies_match_shared() {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let shared = root.join("../shared/oracle");
    if !shared.exists() {
        eprintln!("../shared/oracle not present; tests use the committed copies in tests/fixtures/oracle");
        return;
    }
    for f in ["rank_maps.json", "descriptors.json"] {
        let a = std::fs::read(shared.join(f)).expect("shared oracle readable");
        let b = std::fs::read(root.join("tests/fixtures/oracle").join(f)).expect("fixture readable");
        assert!(a == b, "tests/fixtures/oracle/{f} differs from ../shared/oracle/{f}: refresh the copy");
    }
}

/// The pair every rank-map case uses.
fn rank_map_pair(version: VllmVersion, section: &Value, case: &Value) -> PairSpec {
    let m = &section["model"];
    let use_mla = case["use_mla"].as_bool().expect("use_mla");
    let model = ModelShape {
        name: "oracle".into(),
        num_layers: u64_of(m, "num_layers") as u32,
        num_kv_heads: u64_of(case, "num_kv_heads") as u32,
        head_dim: u64_of(m, "head_dim") as u32,
        dtype: m["dtype"].as_str().expect("dtype").parse::<Dtype>().expect("dtype parses"),
        mla: use_mla.then(|| Mla { kv_lora_rank: u64_of(m, "mla_head_size") as u32, qk_rope_head_dim: 0 }),
    };
    let layout = Layout::parse_for(m["kv_cache_layout"].as_str().expect("layout"), version).expect("layout");
    let engine = |tp: u64, blocks: u64| EngineSpec {
        tp: tp as u32,
        block_tokens: u64_of(m, "block_size_tokens") as u32,
        num_blocks: blocks as u32,
        layout,
    };
    PairSpec {
        version,
        model,
        p: engine(u64_of(case, "p_tp"), u64_of(m, "p_num_blocks")),
        d: engine(u64_of(case, "d_tp"), u64_of(m, "d_num_blocks")),
        permute: false,
    }
}

#[test]
fn rank_maps_reproduce_every_case() {
    let doc = oracle("rank_maps.json");
    let mut checked = 0;
    for (key, version) in [("vllm_0.33.0", VllmVersion::V0_33), ("vllm_0.19.1", VllmVersion::V0_19)] {
        let section = &doc[key];
        let req = &section["request"];
        let blocks = RequestBlocks {
            local: u32s(&req["d_local_block_ids"]),
            remote: u32s(&req["p_remote_block_ids"]),
        };
        let ids = RequestIds { p_request_id: "req-P".into(), d_request_id: "req-D".into() };
        for case in section["cases"].as_array().expect("cases") {
            let label = format!(
                "{key} p{} d{} h{} mla={}",
                case["p_tp"], case["d_tp"], case["num_kv_heads"], case["use_mla"]
            );
            let pair = rank_map_pair(version, section, case);
            let result = pair.validate();
            if case["status"] == "rejected" {
                assert!(result.is_err(), "{label}: vLLM rejects, kvx accepted");
                checked += 1;
                continue;
            }
            let map = result.unwrap_or_else(|e| panic!("{label}: vLLM accepts, kvx rejected: {e}"));
            let d_ranks = case["d_ranks"].as_array().expect("d_ranks");
            assert_eq!(d_ranks.len(), map.d_ranks.len(), "{label}: decode ranks");
            for (want, got) in d_ranks.iter().zip(&map.d_ranks) {
                let l = format!("{label} d{}", got.d_rank);
                assert_eq!(u32s(&want["handshake_ranks"]), got.handshake_ranks, "{l}: handshake ranks");
                if let Some(rr) = want.get("read_ranks") {
                    assert_eq!(u32s(rr), got.read_ranks, "{l}: read ranks");
                    assert_eq!(
                        u64_of(want, "rank_offset_factor") as u32,
                        got.rank_offset_factor,
                        "{l}: offset factor"
                    );
                    assert_eq!(
                        u64_of(want, "expected_consumers_in_notif") as u32,
                        got.notif_count,
                        "{l}: notif count"
                    );
                }
                let planner = Planner::new(&pair, &map, got.d_rank).expect("planner");
                let plan = planner.plan(&blocks, &ids).expect("plan");
                let want_reads = want["reads"].as_array().expect("reads");
                assert_eq!(want_reads.len(), planner.reads.len(), "{l}: number of reads");
                for ((w, g), hr) in want_reads.iter().zip(&planner.reads).zip(&got.reads) {
                    assert_eq!(u64_of(w, "p_rank") as u32, g.p_rank, "{l}: read rank");
                    assert_eq!(
                        u64_of(w, "remote_offset_in_block"),
                        g.remote_offset_in_block,
                        "{l}: remote offset"
                    );
                    assert_eq!(
                        u64_of(w, "local_offset_in_block"),
                        g.local_offset_in_block,
                        "{l}: local offset"
                    );
                    assert_eq!(u64_of(w, "length"), g.length, "{l}: length");
                    if let Some(s) = w.get("p_local_head_slice") {
                        assert_eq!(u32s(s), vec![hr.p_heads.start, hr.p_heads.end], "{l}: P head slice");
                        assert_eq!(
                            u32s(&w["d_local_head_slice"]),
                            vec![hr.d_heads.start, hr.d_heads.end],
                            "{l}: D slice"
                        );
                        assert_eq!(
                            u32s(&w["global_heads"]),
                            hr.global_heads.clone().collect::<Vec<_>>(),
                            "{l}: heads"
                        );
                    }
                    let read = plan.reads.iter().find(|r| r.p_rank == g.p_rank).expect("planned read");
                    assert_eq!(w["notif_msg"].as_str(), Some(read.notif_msg.as_str()), "{l}: notification");
                    assert_eq!(u64_of(w, "num_descs") as usize, read.pairs.len(), "{l}: descriptors");
                }
                let want_extra: Vec<(u32, String)> = want["extra_notifs"]
                    .as_array()
                    .expect("extra_notifs")
                    .iter()
                    .map(|e| (u64_of(e, "p_rank") as u32, e["msg"].as_str().expect("msg").to_string()))
                    .collect();
                let got_extra: Vec<(u32, String)> =
                    plan.notifs_only.iter().map(|n| (n.p_rank, n.msg.clone())).collect();
                assert_eq!(want_extra, got_extra, "{l}: notification-only messages");
                if let Some(h) = want.get("d_heads_expected") {
                    assert_eq!(u32s(h), got.d_heads.clone().collect::<Vec<_>>(), "{l}: decode heads");
                }
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 192, "every rank-map case was checked");
}

/// The first sentence of vLLM's message, which kvx's message must quote.
fn vllm_phrase(msg: &str) -> Option<&str> {
    if msg == "AssertionError" {
        return None;
    }
    let cut = msg.find(" (").into_iter().chain(msg.find(". ")).min().unwrap_or(msg.len());
    Some(&msg[..cut])
}

fn check_regions(label: &str, want: &Value, got: &[kvx::layouts::Region]) {
    let want: Vec<&Value> =
        want.as_array().expect("regions").iter().filter(|r| r.get("region").is_some()).collect();
    assert_eq!(want.len(), got.len(), "{label}: number of regions");
    for (w, g) in want.iter().zip(got) {
        let len =
            w.get("block_len").or_else(|| w.get("block_len(page bytes per region)")).expect("block_len");
        assert_eq!(len.as_u64(), Some(g.block_len), "{label} {}: block_len", g.name);
        assert_eq!(u64_of(w, "base_off"), g.base_off, "{label} {}: base", g.name);
        assert_eq!(u64_of(w, "num_blocks"), g.num_blocks, "{label} {}: blocks", g.name);
        if let Some(s) = w.get("block_stride") {
            assert_eq!(s.as_u64(), Some(g.block_stride), "{label} {}: stride", g.name);
        }
        if let Some(n) = w.get("name") {
            assert_eq!(n.as_str(), Some(g.name.as_str()), "{label}: region name");
        }
    }
}

#[test]
fn descriptors_reproduce_every_case() {
    let doc = oracle("descriptors.json");
    let mut requests = 0;
    for key in ["vllm_0.33.0", "vllm_0.19.1"] {
        for case in doc[key]["cases"].as_array().expect("cases") {
            let name = case["name"].as_str().expect("name");
            let scenario = |request: &Value| {
                let v = serde_json::json!({
                    "vllm_version": case["vllm_version"], "model": case["model"], "request": request
                });
                PlanScenario::parse(&v.to_string(), name).expect("scenario parses")
            };
            let base = scenario(&serde_json::json!({"local": [[0]], "remote": [[0]]}));
            let pair = base.pair().expect("pair");
            for p in case["p_engine"].as_array().expect("p_engine") {
                let r = u64_of(p, "p_rank") as u32;
                check_regions(&format!("{name} P{r}"), &p["regions"], &pair.p_geometry(r).regions());
            }
            for d in case["d_ranks"].as_array().expect("d_ranks") {
                let d_rank = u64_of(d, "d_rank") as u32;
                let label = format!("{name} D{d_rank}");
                check_regions(&label, &d["regions"], &pair.d_geometry(d_rank).regions());
                if name.contains("ACCEPTED_but_wrong") {
                    // vLLM 0.19.1 accepts this and reads token halves as head halves; kvx refuses.
                    let err = pair
                        .validate()
                        .expect_err(&format!("{label}: kvx must reject what 0.19.1 reads wrong"));
                    assert!(err.to_string().contains("contiguous"), "{label}: {err}");
                    continue;
                }
                if let Some(rej) = d.get("rejected") {
                    let err = pair.validate().expect_err(&format!("{label}: vLLM rejects, kvx accepted"));
                    if let Some(phrase) = vllm_phrase(rej["error"].as_str().expect("error")) {
                        assert!(
                            err.to_string().contains(phrase),
                            "{label}: message should quote '{phrase}': {err}"
                        );
                    }
                    continue;
                }
                let map =
                    pair.validate().unwrap_or_else(|e| panic!("{label}: vLLM accepts, kvx rejected: {e}"));
                assert_eq!(
                    u32s(&d["handshake_ranks"]),
                    map.d_ranks[d_rank as usize].handshake_ranks,
                    "{label}"
                );
                for read in d["reads"].as_array().expect("reads") {
                    let sc = scenario(&read["request"]);
                    let planner = Planner::new(&pair, &map, d_rank).expect("planner");
                    let plan = planner.plan(&sc.blocks().expect("blocks"), &sc.ids()).expect("plan");
                    let l = format!("{label} {}", read["request"]["name"]);
                    let xfers = read["xfers"].as_array().expect("xfers");
                    assert_eq!(xfers.len(), plan.reads.len(), "{l}: READs");
                    for (x, got) in xfers.iter().zip(&plan.reads) {
                        let dl = x["remote_dlist"].as_str().expect("remote_dlist");
                        assert_eq!(dl, format!("remote_p_rank_{}", got.p_rank), "{l}: source rank");
                        assert_eq!(
                            x["notif_msg"].as_str(),
                            Some(got.notif_msg.as_str()),
                            "{l}: notification"
                        );
                        let want: Vec<[u64; 3]> = x["pairs_local_off_remote_off_len"]
                            .as_array()
                            .expect("pairs")
                            .iter()
                            .map(|t| {
                                let t = t.as_array().expect("triple");
                                [
                                    t[0].as_u64().expect("l"),
                                    t[1].as_u64().expect("r"),
                                    t[2].as_u64().expect("n"),
                                ]
                            })
                            .collect();
                        let got_pairs: Vec<[u64; 3]> =
                            got.pairs.iter().map(|p| [p.local, p.remote, p.len]).collect();
                        assert_eq!(want, got_pairs, "{l}: descriptor pairs in posting order");
                    }
                    let want_notifs: Vec<(u32, String)> = read["notifs_only"]
                        .as_array()
                        .expect("notifs_only")
                        .iter()
                        .map(|n| (u64_of(n, "p_rank") as u32, n["msg"].as_str().expect("msg").to_string()))
                        .collect();
                    let got_notifs: Vec<(u32, String)> =
                        plan.notifs_only.iter().map(|n| (n.p_rank, n.msg.clone())).collect();
                    assert_eq!(want_notifs, got_notifs, "{l}: notification-only messages");
                    requests += 1;
                }
            }
        }
    }
    assert!(requests >= 15, "only {requests} requests checked");
}

/// The CLI path: `kvx plan --scenario` on every accepted request of the descriptor oracle.
#[test]
fn plan_scenario_cli_matches_oracle() {
    let doc = oracle("descriptors.json");
    let dir = tempfile::tempdir().expect("tempdir");
    let mut n = 0;
    for key in ["vllm_0.33.0", "vllm_0.19.1"] {
        for case in doc[key]["cases"].as_array().expect("cases") {
            let Some(d0) = case["d_ranks"].as_array().and_then(|d| d.first()) else { continue };
            let file = dir.path().join(format!("{n}.json"));
            let request = d0.get("reads").and_then(|r| r.get(0)).map(|r| r["request"].clone());
            let v = serde_json::json!({
                "vllm_version": case["vllm_version"], "model": case["model"],
                "request": request.clone().unwrap_or(serde_json::json!({"local": [[0]], "remote": [[0]]}))
            });
            std::fs::write(&file, v.to_string()).expect("write scenario");
            let out = kvx()
                .args(["plan", "--scenario"])
                .arg(&file)
                .args(["--format", "json"])
                .output()
                .expect("runs");
            let json: Value = serde_json::from_slice(&out.stdout).expect("stdout is JSON");
            if d0.get("rejected").is_some()
                || case["name"].as_str().is_some_and(|n| n.contains("ACCEPTED_but_wrong"))
            {
                assert_eq!(out.status.code(), Some(2), "{}: rejected exits 2", case["name"]);
                assert_eq!(json["status"], "rejected");
                assert!(!String::from_utf8_lossy(&out.stderr).is_empty(), "rejection explained on stderr");
            } else {
                assert!(out.status.success(), "{}: {}", case["name"], String::from_utf8_lossy(&out.stderr));
                assert_eq!(json["status"], "ok");
                let want = &d0["reads"][0]["xfers"];
                let got = &json["d_ranks"][0]["reads"];
                for (w, g) in want.as_array().expect("xfers").iter().zip(got.as_array().expect("reads")) {
                    assert_eq!(w["pairs_local_off_remote_off_len"], g["pairs"], "{}", case["name"]);
                    assert_eq!(w["notif_msg"], g["notif_msg"]);
                }
            }
            n += 1;
        }
    }
    assert!(n >= 20, "{n} scenarios");
    let _ = oracle_dir();
}
