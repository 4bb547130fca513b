//! The READs every decode rank posts for one request of a hybrid model, as vLLM 0.33's pull
//! worker builds them: the handshake (both engines' geometry, the pair's refusals, each decode
//! rank's TP mapping and descriptor lists, built once), then per request the clipped block
//! lists, descriptor ids per group and the pairs in posting order, with the findings.
//!
//! Rules (vLLM 0.33.0, `nixl/base_worker.py` unless named): descriptor ids
//! (`_compute_desc_ids`): without state, all groups' blocks over every region when regions are
//! shared (device), else each group over its own regions (host buffer); with state, attention
//! groups over every region at kernel granularity and state groups over the state rows, past
//! the attention descriptors. With P > D each source gets a split of every local row
//! (`_build_local_splits_from_plan`): attention by its head slot, state by its position.

use std::sync::Arc;

use serde::Serialize;

use super::blocks::{
    ExchangedBlocks, GroupIds, NULL_BLOCK, TokenCounts, group_trim, list_counts, logical_to_kernel,
};
use super::desc_lists::DescList;
use super::desc_lists::DescRow;
use super::desc_lists::RowAt;
use super::desc_lists::RowKind;
use super::desc_lists::RowLabel;
use super::desc_lists::held_at;
use super::desc_lists::local_rows;
use super::desc_lists::remote_conv_offsets;
use super::error::{HybridError, RefusalKind};
use super::findings::Finding;
use super::findings::describe_span;
use super::geometry::{EngineGeometry, KvBufferDevice, Side, StatePart};
use super::pair::GeometrySource;
use super::pair::HostCopyRule;
use super::pair::HybridPairSpec;
use super::pair::StateSlices;
use super::pair::check_pair;
use super::runs::Chunk;
use super::runs::HybridRead;
use super::runs::IdRun;
use super::runs::ListBounds;
use super::runs::PairRun;
use super::runs::ReadTemplate;
use super::runs::ReadWalk;
use super::runs::RowPair;
use super::runs::RunRow;
use super::runs::RunSpan;
use super::runs::desc_id_runs;
use super::runs::min_max;
use super::tp_map::TpMapping;
use super::tp_map::handshake_ranks;
use super::tp_map::tp_mapping;
use crate::layouts::read_plan::Pair;
use crate::vocab::knob::Knob;

/// The plan of one decode rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DRankPlan {
    pub d_rank: u32,
    /// The planner's, shared.
    pub handshake_ranks: Arc<[u32]>,
    pub mapping: Arc<TpMapping>,
    pub reads: Vec<HybridRead>,
    /// Notification-only messages (full prefix hit): `(prefill rank, message)`.
    pub notifs_only: Vec<(u32, String)>,
}

impl DRankPlan {
    pub fn descriptor_count(&self) -> usize {
        self.reads.iter().map(|r| r.pairs.len()).sum()
    }

    pub fn bytes(&self) -> u64 {
        self.reads.iter().map(HybridRead::bytes).sum()
    }

    /// Bytes read per group.
    pub fn bytes_by_group(&self, groups: usize) -> Vec<u64> {
        let mut out = vec![0; groups];
        for read in &self.reads {
            for run in read.runs() {
                if let Some(b) = out.get_mut(run.group as usize) {
                    *b += read.pairs[run.pairs()].iter().map(|p| p.len).sum::<u64>();
                }
            }
        }
        out
    }
}

/// A host-buffer copy (`save_kv_to_host` on prefill, `sync_recved_kv_to_device` on decode):
/// the (kernel) block ids of every group, copied through every layer, in layer order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HostCopy {
    pub layers_in_copy_order: Vec<String>,
    pub block_ids: Vec<u64>,
    /// [`Knob::HostCopy`] `per-group`: each layer copies only the ids of its own group's blocks.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub per_group: bool,
}

/// The request, as the oracle's cases give it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct HybridRequest {
    pub prompt_tokens: u32,
    /// Prefill's block lists at `request_finished`, one per group, nulls included.
    pub p_raw_block_ids: Vec<Vec<u32>>,
    /// Decode's newly allocated (unhashed) blocks, one per group.
    pub d_raw_unhashed_block_ids: Vec<Vec<u32>>,
    /// Tokens decode already holds (its local prefix hit).
    #[serde(default)]
    pub d_hit_tokens: u32,
}

impl HybridRequest {
    /// A request of `prompt_tokens` through `planner`'s pair, its block lists allocated as
    /// vLLM's allocator leaves them (fresh ids per group, null blocks outside a window and
    /// before the last state slot), decode already holding its first `hit_blocks` blocks (at
    /// most all but the last): what `kvx plan` plans for a hybrid preset and the property
    /// tests run, for requests that are not in an oracle file.
    pub fn simulated(planner: &HybridPlanner, prompt_tokens: u32, hit_blocks: u32) -> HybridRequest {
        let t = TokenCounts::new(planner.d.has_state(), prompt_tokens, 0);
        let (bp, bd) = (planner.p.sizing.block_tokens, planner.d.sizing.block_tokens);
        let hit_blocks = hit_blocks.min(t.p_computed_tokens.saturating_sub(1) / bd.max(1));
        let mut next = 1;
        let p_raw = super::blocks::BlockSim { tokens: t.p_computed_tokens, block_tokens: bp, hit_blocks: 0 }
            .raw_block_ids(&planner.p.groups, &mut next);
        let mut next = 1;
        let d_raw = super::blocks::BlockSim { tokens: t.p_computed_tokens, block_tokens: bd, hit_blocks }
            .raw_block_ids(&planner.d.groups, &mut next);
        HybridRequest {
            prompt_tokens,
            p_raw_block_ids: p_raw,
            d_raw_unhashed_block_ids: d_raw,
            d_hit_tokens: hit_blocks * bd,
        }
    }
}

/// What clipping left of one group's blocks at prefill's exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct GroupClipping {
    pub group: u32,
    /// Blocks in prefill's list before clipping (nulls included).
    pub raw_blocks: u64,
    /// Blocks prefill sends.
    pub sent_blocks: u64,
}

/// Everything planned for one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HybridPlan {
    pub tokens: TokenCounts,
    pub blocks: ExchangedBlocks,
    /// Per group: blocks before and after the window and state-slot clipping.
    pub clipping: Vec<GroupClipping>,
    pub d_ranks: Vec<DRankPlan>,
    /// Prefill's device-to-host copy (host buffer only).
    pub p_save_to_host: Option<HostCopy>,
    /// Decode's host-to-device copy (host buffer only).
    pub d_sync_to_device: Option<HostCopy>,
    pub findings: Vec<Finding>,
}

/// What one decode rank prepares at handshake time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DRankSetup {
    pub d_rank: u32,
    pub handshake_ranks: Arc<[u32]>,
    pub mapping: Arc<TpMapping>,
    /// Local rows at decode's own block size (what it registers first).
    pub local: DescList,
    /// Local rows the READs use: one list, or one split per source rank (P > D).
    pub local_for_source: Vec<DescList>,
    /// Remote rows (the same for every prefill rank, relative to its base).
    pub remote: DescList,
    /// [`Knob::StateSlices`] `exact` with P > D: remote rows per source rank (in
    /// `mapping.all_source_ranks` order), each rank's state rows where that rank holds the
    /// piece of decode's slice its READ fills; empty otherwise (every rank reads `remote`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub remote_for_source: Vec<DescList>,
    /// Per source rank (in `mapping.all_source_ranks` order): what its READ's walk needs that
    /// no request changes.
    #[serde(skip)]
    templates: Vec<ReadTemplate>,
    /// What follows the request id in every notification: `":<consumers>"`.
    #[serde(skip)]
    notif_suffix: String,
}

impl DRankSetup {
    /// The remote rows the READ from source rank `i` (in `mapping.all_source_ranks` order) uses.
    pub fn remote_of(&self, i: usize) -> &DescList {
        self.remote_for_source.get(i).unwrap_or(&self.remote)
    }
}

/// One request's block lists per group, paired as every READ that reads the group pairs them
/// (the TP mapping decides only which READs read a group): worked out once per request.
struct RequestLists {
    /// The request's lists do not match the groups (vLLM's shape assertion).
    shape: Option<HybridError>,
    /// What each group's pairing found (one entry per group).
    paired: Vec<GroupPairing>,
    /// (decode, prefill) lists per group, paired 1:1.
    lists: [Arc<GroupIds>; 2],
    /// Per side and group: the lowest and highest block of the list, and its length.
    bounds: [Vec<ListBounds>; 2],
}

/// One group of a request, paired.
struct GroupPairing {
    /// The local list after the block-size-ratio mapping is empty.
    mapped_empty: bool,
    /// vLLM's pairing assertion, for the first READ of the group to report.
    error: Option<HybridError>,
    /// The attention group's first paired blocks hold different token positions (decode's
    /// first token, prefill's).
    shift: Option<(u64, u64)>,
}

/// Plans requests for every decode rank of a pair; build once (the handshake), plan many.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HybridPlanner {
    pub config: HybridPairSpec,
    pub p: EngineGeometry,
    pub d: EngineGeometry,
    pub tp_ratio: i64,
    /// Decode kernel block / prefill kernel block.
    pub block_size_ratio: u32,
    pub d_ranks: Vec<DRankSetup>,
    /// Findings that hold for every request (slice misreads, host page padding).
    pub findings: Vec<Finding>,
    /// Where each engine's geometry came from (prefill, decode).
    pub sources: [GeometrySource; 2],
}

impl HybridPlanner {
    /// Builds both engines and every decode rank's descriptor lists, or vLLM's refusal.
    pub fn new(config: &HybridPairSpec) -> Result<Self, HybridError> {
        let model = &config.model;
        let (p, p_source) = GeometrySource::build(model, &config.p, config.stated.p.as_ref(), Side::Prefill)?;
        let (d, d_source) = GeometrySource::build(model, &config.d, config.stated.d.as_ref(), Side::Decode)?;
        let ratio = check_pair(config, &p, &d)?;
        let bsr = d.kernel_block_tokens / p.kernel_block_tokens;
        let is_state: Vec<bool> = d.groups.iter().map(|g| g.kind.is_state()).collect();
        let mut d_ranks = Vec::new();
        for d_rank in 0..config.d.tp {
            let mapping =
                tp_mapping(config.p.tp, config.d.tp, d_rank, model.attention.num_kv_heads, &is_state);
            if ratio < 0 && bsr != 1 {
                let fa = is_state.iter().position(|&s| !s).unwrap_or(0);
                if mapping.source_ranks_per_group[fa].len() > 1 {
                    return Err(HybridError::refused(
                        RefusalKind::HeadShardedBlockSizes,
                        "Head-sharded attention reads with P_TP > D_TP and heterogeneous block sizes are not supported",
                        "nixl/base_worker.py:323 (_build_local_splits_from_plan)",
                        Knob::DTp,
                        format!(
                            "decode rank {d_rank} would gather {} attention heads from different prefill ranks \
                             into {}-token blocks from {}-token ones; use equal TP sizes or TP sizes with equal \
                             hybrid block sizes",
                            mapping.source_ranks_per_group[fa].len(),
                            d.kernel_block_tokens,
                            p.kernel_block_tokens
                        ),
                    ));
                }
            }
            d_ranks.push(build_rank(&p, &d, d_rank, ratio, bsr, mapping, config.state_slices));
        }
        let mut planner = HybridPlanner {
            config: config.clone(),
            p,
            d,
            tp_ratio: ratio,
            block_size_ratio: bsr,
            d_ranks,
            findings: Vec::new(),
            sources: [p_source, d_source],
        };
        planner.findings = planner.static_findings();
        Ok(planner)
    }

    fn static_findings(&self) -> Vec<Finding> {
        let mut out = Vec::new();
        for g in [&self.p, &self.d] {
            if g.config.kv_buffer_device == KvBufferDevice::Cpu
                && !g.config.host_state_page_padded
                && let Some(real) = g.sizing.state_page_bytes
                && real != g.sizing.page_bytes
            {
                out.push(Finding::HostStatePagePadded {
                    side: g.side,
                    real_page_bytes: real,
                    padded_page_bytes: g.sizing.page_bytes,
                });
            }
        }
        if !self.d.config.layout.heads_contiguous() {
            let attention = self.d.groups.iter().position(|g| g.kind.is_attention());
            for setup in &self.d_ranks {
                let sources = attention.map_or(0, |g| setup.mapping.source_ranks_per_group[g].len());
                if sources > 1 {
                    out.push(Finding::HeadSlotsNotContiguous {
                        d_rank: setup.d_rank,
                        layout: self.d.config.layout.vllm_name().to_string(),
                        source_ranks: sources as u32,
                    });
                }
            }
        }
        let (Some(ps), Some(ds)) = (&self.p.state, &self.d.state) else { return out };
        for setup in &self.d_ranks {
            for (i, &p_rank) in setup.mapping.all_source_ranks.iter().enumerate() {
                let local = &setup.local_for_source[i.min(setup.local_for_source.len() - 1)];
                let state_rows = |l: &DescList| -> Vec<DescRow> {
                    l.rows.iter().filter(|r| matches!(r.label.kind, RowKind::State(_))).copied().collect()
                };
                let (lrows, rrows) = (state_rows(local), state_rows(setup.remote_of(i)));
                let mut reported: Vec<RowKind> = Vec::new();
                for (lr, rr) in lrows.iter().zip(&rrows) {
                    let (Some(lregion), Some(rregion)) = (
                        self.d.regions.get(lr.label.region as usize),
                        self.p.regions.get(rr.label.region as usize),
                    ) else {
                        continue;
                    };
                    // Offsets inside the page: every row starts at its region's block 0.
                    let want = ds.global_span(setup.d_rank, lr.addr_off - lregion.base_off, lr.len);
                    let got = ps.global_span(p_rank, rr.addr_off - rregion.base_off, rr.len);
                    if (want != got || want.is_none()) && !reported.contains(&lr.label.kind) {
                        reported.push(lr.label.kind);
                        let part = match lr.label.kind {
                            RowKind::State(p) => p.label(),
                            RowKind::AttnPage => "attn".into(),
                        };
                        out.push(Finding::StateSliceMisread {
                            d_rank: setup.d_rank,
                            p_rank,
                            part,
                            reads: format!(
                                "needs {}, reads {}",
                                describe_span(want.as_ref()),
                                describe_span(got.as_ref())
                            ),
                        });
                    }
                }
            }
        }
        out
    }

    /// Plans one request for every decode rank.
    pub fn plan(&self, request: &HybridRequest, p_request_id: &str) -> Result<HybridPlan, HybridError> {
        if request.d_hit_tokens > 0 && !self.config.d.prefix_caching {
            return Err(HybridError::request(
                Knob::PrefixHit,
                "decode cannot hold a prefix-cache hit with prefix caching off",
            ));
        }
        let tokens = TokenCounts::new(self.d.has_state(), request.prompt_tokens, request.d_hit_tokens);
        let blocks = ExchangedBlocks::new(
            &self.p.groups,
            self.p.sizing.block_tokens,
            self.d.sizing.block_tokens,
            &request.p_raw_block_ids,
            &request.d_raw_unhashed_block_ids,
            tokens.d_external_tokens,
        )?;
        self.plan_exchanged(tokens, blocks, Some(&request.p_raw_block_ids), p_request_id)
    }

    /// Plans a request whose block lists were already exchanged (what a decode engine holds:
    /// prefill's lists as `kv_transfer_params` carried them, its own after clipping).
    /// `p_raw`: prefill's lists before clipping, when known (the clipping figures and
    /// prefill's host-buffer copy need them).
    pub fn plan_exchanged(
        &self,
        tokens: TokenCounts,
        blocks: ExchangedBlocks,
        p_raw: Option<&[Vec<u32>]>,
        p_request_id: &str,
    ) -> Result<HybridPlan, HybridError> {
        self.plan_ranks(tokens, blocks, p_raw, p_request_id, None)
    }

    /// [`plan_exchanged`](Self::plan_exchanged) for decode ranks `d_ranks` alone (what a
    /// decode rank posts, or what a prefill rank writes into in push mode; the plan's
    /// `d_ranks` holds them only).
    pub fn plan_exchanged_ranks(
        &self,
        tokens: TokenCounts,
        blocks: ExchangedBlocks,
        d_ranks: &[u32],
        p_request_id: &str,
    ) -> Result<HybridPlan, HybridError> {
        self.plan_ranks(tokens, blocks, None, p_request_id, Some(d_ranks))
    }

    fn plan_ranks(
        &self,
        tokens: TokenCounts,
        blocks: ExchangedBlocks,
        p_raw: Option<&[Vec<u32>]>,
        p_request_id: &str,
        only: Option<&[u32]>,
    ) -> Result<HybridPlan, HybridError> {
        self.check_pools(&blocks)?;
        let mut findings = self.findings.clone();
        let lists = (!blocks.full_hit()).then(|| self.request_lists(&blocks, tokens.p_computed_tokens));
        let mut d_ranks = Vec::with_capacity(self.d_ranks.len());
        for setup in self.d_ranks.iter().filter(|s| only.is_none_or(|r| r.contains(&s.d_rank))) {
            d_ranks.push(self.plan_rank(setup, lists.as_ref(), p_request_id, &mut findings)?);
        }
        let (mut p_save, mut d_sync) = (None, None);
        if self.p.config.kv_buffer_device == KvBufferDevice::Cpu
            && let Some(p_raw) = p_raw
        {
            p_save = Some(HostCopy {
                layers_in_copy_order: self.p.host_slots.iter().map(|s| s.layer.clone()).collect(),
                block_ids: super::staging::saved_kernel_ids(&self.p, p_raw)?.concat(),
                per_group: false,
            });
        }
        if self.d.config.kv_buffer_device == KvBufferDevice::Cpu && !blocks.full_hit() {
            d_sync = Some(HostCopy {
                layers_in_copy_order: self.d.host_slots.iter().map(|s| s.layer.clone()).collect(),
                block_ids: logical_to_kernel(
                    &self.d.groups,
                    &blocks.local_block_ids,
                    self.d.physical_per_logical,
                )
                .concat(),
                per_group: self.config.host_copy == HostCopyRule::PerGroup,
            });
            for rank in &d_ranks {
                findings.extend(self.host_copy_losses(rank, &blocks));
            }
        }
        let clipping = (0u32..)
            .zip(&blocks.remote_block_ids)
            .map(|(group, sent)| GroupClipping {
                group,
                raw_blocks: p_raw.and_then(|r| r.get(group as usize)).map_or(sent.len(), Vec::len) as u64,
                sent_blocks: sent.len() as u64,
            })
            .collect();
        Ok(HybridPlan {
            tokens,
            blocks,
            clipping,
            d_ranks,
            p_save_to_host: p_save,
            d_sync_to_device: d_sync,
            findings,
        })
    }

    fn check_pools(&self, blocks: &ExchangedBlocks) -> Result<(), HybridError> {
        let check = |lists: &[Vec<u32>], pool: u32, knob: Knob, who: &str| -> Result<(), HybridError> {
            match lists.iter().flatten().find(|&&b| b >= pool) {
                Some(b) => Err(HybridError::request(
                    knob,
                    format!("{who} block id {b} is outside the {who} pool of {pool} blocks"),
                )),
                None => Ok(()),
            }
        };
        check(&blocks.remote_block_ids, self.config.p.num_blocks, Knob::PNumBlocks, "prefill")?;
        check(&blocks.local_block_ids, self.config.d.num_blocks, Knob::DNumBlocks, "decode")
    }

    /// The request's lists per group, paired once for every READ (vLLM pairs them per READ,
    /// over the groups its prefill rank serves; each group pairs on its own, so the result is
    /// the same).
    fn request_lists(&self, blocks: &ExchangedBlocks, computed_tokens: u32) -> RequestLists {
        let groups = &self.d.groups;
        let local_k = GroupIds::kernel(groups, &blocks.local_block_ids, self.d.physical_per_logical);
        let mut remote = GroupIds::kernel(groups, &blocks.remote_block_ids, self.p.physical_per_logical);
        let mut local = if self.block_size_ratio > 1 {
            let mut local = local_k.ratio_mapped(groups, self.block_size_ratio);
            for (g, group) in groups.iter().enumerate().take(remote.len()) {
                if group.kind.is_attention() {
                    local.truncate(g, remote[g].len());
                }
            }
            local
        } else {
            local_k
        };
        let shape = list_counts(groups.len(), local.len(), remote.len()).err();
        let (d_ppl, p_ppl) = (self.d.physical_per_logical, self.p.physical_per_logical);
        let has_state = self.d.has_state();
        let mut paired = Vec::with_capacity(groups.len());
        for (i, group) in groups.iter().enumerate() {
            let mapped_empty = local.get(i).is_none_or(<[u64]>::is_empty);
            let (Some(l), Some(r)) = (local.get(i), remote.get(i)) else {
                paired.push(GroupPairing { mapped_empty, error: None, shift: None });
                continue;
            };
            match group_trim(i, group, has_state, (l.len(), r.len()), d_ppl, p_ppl) {
                Ok(trim) => {
                    // Where prefill's first paired block first appears in its whole list.
                    let first = r.get(trim.p_front).and_then(|&b0| r.iter().position(|&b| b == b0));
                    trim.apply_group(i, (&mut local, &mut remote));
                    let shift = self.token_shift(i, blocks, first, &local[i], &remote[i], computed_tokens);
                    paired.push(GroupPairing { mapped_empty, error: None, shift });
                }
                Err(e) => {
                    // The group's READs report the error; no shift is looked at.
                    paired.push(GroupPairing { mapped_empty, error: Some(e), shift: None });
                }
            }
        }
        let bounds = [&local, &remote].map(|lists| lists.iter().map(|l| (min_max(l), l.len())).collect());
        RequestLists { shape, paired, lists: [Arc::new(local), Arc::new(remote)], bounds }
    }

    fn plan_rank(
        &self,
        setup: &DRankSetup,
        lists: Option<&RequestLists>,
        p_request_id: &str,
        findings: &mut Vec<Finding>,
    ) -> Result<DRankPlan, HybridError> {
        let m = &setup.mapping;
        let notif = [p_request_id, &setup.notif_suffix].concat();
        let mut reads = Vec::new();
        let mut notifs_only = Vec::new();
        let groups = self.d.groups.len();
        let Some(lists) = lists else {
            notifs_only = m.all_source_ranks.iter().map(|&r| (r, notif.clone())).collect();
            return Ok(DRankPlan {
                d_rank: setup.d_rank,
                handshake_ranks: setup.handshake_ranks.clone(),
                mapping: m.clone(),
                reads,
                notifs_only,
            });
        };
        for (i, &p_rank) in m.all_source_ranks.iter().enumerate() {
            let t = &setup.templates[i];
            let kept = |g: usize| t.keeps.get(g).copied().unwrap_or(false);
            if (0..groups).all(|g| !kept(g) || lists.paired[g].mapped_empty) {
                notifs_only.push((p_rank, notif.clone()));
                continue;
            }
            if let Some(e) = &lists.shape {
                return Err(e.clone());
            }
            if let Some(e) = (0..groups).filter(|&g| kept(g)).find_map(|g| lists.paired[g].error.clone()) {
                return Err(e);
            }
            for g in (0..groups).filter(|&g| kept(g)) {
                if let Some((local_token, remote_token)) = lists.paired[g].shift {
                    findings.push(Finding::AttentionTokensShifted {
                        d_rank: setup.d_rank,
                        p_rank,
                        group: self.d.groups[g].index,
                        local_token,
                        remote_token,
                    });
                }
            }
            // A group this READ does not read has an empty list here.
            let len =
                |side: usize, g: u32| if kept(g as usize) { lists.lists[side][g as usize].len() } else { 0 };
            let count = |side: usize| -> usize {
                t.runs_per_group[side].iter().zip(0u32..).map(|(&n, g)| n * len(side, g)).sum()
            };
            let (nl, nr) = (count(0), count(1));
            if nl != nr {
                return Err(HybridError::request(
                    Knob::Scenario,
                    format!(
                        "decode rank {} from prefill rank {p_rank}: {nl} local and {nr} remote descriptors \
                         (vLLM asserts they match)",
                        setup.d_rank,
                    ),
                ));
            }
            let mut read = HybridRead {
                p_rank,
                notif_msg: notif.clone(),
                pairs: Vec::with_capacity(nl),
                batches: Vec::with_capacity(if t.aligned.is_some() {
                    t.spans.len()
                } else {
                    t.runs[0].len()
                }),
                local_blocks: lists.lists[0].clone(),
                remote_blocks: lists.lists[1].clone(),
            };
            let mut walk = ReadWalk {
                d_rank: setup.d_rank,
                p_rank,
                llist: &setup.local_for_source[i.min(setup.local_for_source.len() - 1)],
                rlist: setup.remote_of(i),
                near: [0; 2],
                rows: [0; 2],
                bounds: [&lists.bounds[0], &lists.bounds[1]],
            };
            let (local, remote) = (&lists.lists[0], &lists.lists[1]);
            if let Some(pairs) = &t.aligned
                && (0..groups).all(|g| !kept(g) || local[g].len() == remote[g].len())
            {
                // Run k of one side pairs with run k of the other, whole lists each.
                for span in &t.spans {
                    let g = span.group as usize;
                    if !kept(g) || local[g].is_empty() {
                        continue;
                    }
                    let (ls, rs) = (&local[g][..], &remote[g][..]);
                    let bounds = (&lists.bounds[0][g], &lists.bounds[1][g]);
                    let rps = &pairs[span.start..span.end];
                    if span.fits(bounds) {
                        span.emit(rps, &mut read, (ls, rs));
                        continue;
                    }
                    for (k, rp) in (span.start..).zip(rps) {
                        if !(rp.fast && rp.emit(&mut read, bounds, (ls, rs))) {
                            let (lr, rr) = (t.runs[0][k].run, t.runs[1][k].run);
                            let chunk =
                                Chunk { local: lr, remote: rr, local_at: 0, remote_at: 0, n: ls.len() };
                            self.plan_chunk(&mut walk, &mut read, chunk, (ls, rs), findings)?;
                        }
                    }
                }
                reads.push(read);
                continue;
            }
            let (lruns, rruns) = (&t.runs[0], &t.runs[1]);
            // Both sides' id runs walked together, cut where either side's run ends.
            let (mut li, mut lpos, mut ri, mut rpos) = (0, 0, 0, 0);
            loop {
                while li < lruns.len() && lpos == len(0, lruns[li].run.group) {
                    (li, lpos) = (li + 1, 0);
                }
                while ri < rruns.len() && rpos == len(1, rruns[ri].run.group) {
                    (ri, rpos) = (ri + 1, 0);
                }
                let (Some(&lr), Some(&rr)) = (lruns.get(li), rruns.get(ri)) else { break };
                let (lg, rg) = (lr.run.group as usize, rr.run.group as usize);
                let (ls, rs) = (&local[lg][lpos..], &remote[rg][rpos..]);
                let n = ls.len().min(rs.len());
                let chunk = Chunk { local: lr.run, remote: rr.run, local_at: lpos, remote_at: rpos, n };
                let whole = lpos == 0 && rpos == 0 && n == ls.len() && n == rs.len();
                if !(whole && whole_lists(&walk, &mut read, chunk, (lr.row, rr.row), (ls, rs))) {
                    self.plan_chunk(&mut walk, &mut read, chunk, (&ls[..n], &rs[..n]), findings)?;
                }
                (lpos, rpos) = (lpos + n, rpos + n);
            }
            reads.push(read);
        }
        Ok(DRankPlan {
            d_rank: setup.d_rank,
            handshake_ranks: setup.handshake_ranks.clone(),
            mapping: m.clone(),
            reads,
            notifs_only,
        })
    }

    /// The pairs of one chunk of a READ (one id run on each side): a row on each side that
    /// holds the whole chunk, inside one registration each, with no null block, takes the
    /// fast way (pairs computed in one pass, nothing to report); anything else goes pair by
    /// pair, resolving each id and reporting what it finds.
    fn plan_chunk(
        &self,
        walk: &mut ReadWalk<'_>,
        read: &mut HybridRead,
        chunk: Chunk,
        (ls, rs): (&[u64], &[u64]),
        findings: &mut Vec<Finding>,
    ) -> Result<(), HybridError> {
        let Chunk { local: lr, remote: rr, n, .. } = chunk;
        let start = read.pairs.len();
        let run = |label| PairRun {
            label,
            group: lr.group,
            remote_group: rr.group,
            start: start as u32,
            count: n as u32,
            local_at: chunk.local_at as u32,
            remote_at: chunk.remote_at as u32,
        };
        if n == 0 {
            return Ok(());
        }
        // One descriptor (a state part's last slot, mostly): its row on each side, both rows
        // inside one registration, no null block: the pair as the general way below computes
        // it, with nothing else to work out.
        if let ([lb], [rb]) = (ls, rs)
            && *rb != u64::from(NULL_BLOCK)
            && let (lid, rid) = (lr.base + lb, rr.base + rb)
            && let (Some((lrow, lstart, true)), Some((rrow, rstart, true))) = (
                walk.llist.row_spanning(lid, lid, &mut walk.rows[0]),
                walk.rlist.row_spanning(rid, rid, &mut walk.rows[1]),
            )
            && lrow.len == rrow.len
        {
            read.pairs.push(Pair {
                local: lrow.addr_off + (lid - lstart) * lrow.stride,
                remote: rrow.addr_off + (rid - rstart) * rrow.stride,
                len: lrow.len,
            });
            read.push_run(run(lrow.label));
            return Ok(());
        }
        let bounds = |side: usize, run: IdRun, at: usize, xs: &[u64]| match walk.bounds[side]
            .get(run.group as usize)
        {
            Some(&(whole, len)) if at == 0 && len == n => whole,
            _ => min_max(xs),
        };
        let (lmin, lmax) = bounds(0, lr, chunk.local_at, ls);
        let (rmin, rmax) = bounds(1, rr, chunk.remote_at, rs);
        let rows = (
            walk.llist.row_spanning(lr.base + lmin, lr.base + lmax, &mut walk.rows[0]),
            walk.rlist.row_spanning(rr.base + rmin, rr.base + rmax, &mut walk.rows[1]),
        );
        if let (Some((lrow, lstart, l_in)), Some((rrow, rstart, r_in))) = rows
            && lrow.len == rrow.len
            && rmin != u64::from(NULL_BLOCK)
        {
            // Offsets are `row.addr_off + (base + b - start) * row.stride`; the row's base may
            // lie before the run's (wrapping arithmetic is exact: every result fits).
            let at = |row: &DescRow, base: u64, start: u64| {
                row.addr_off.wrapping_add(base.wrapping_sub(start).wrapping_mul(row.stride))
            };
            let (l0, r0) = (at(lrow, lr.base, lstart), at(rrow, rr.base, rstart));
            let (lst, rst, len) = (lrow.stride, rrow.stride, lrow.len);
            // Strided rows: the lowest and the highest block bound the chunk's addresses, so
            // both in one registration puts every descriptor inside it.
            let inside = |geo: &EngineGeometry, o0: u64, st: u64, (lo, hi): (u64, u64), near: &mut usize| {
                let at = |b: u64| o0.wrapping_add(b.wrapping_mul(st));
                let first = geo.registered_near(geo.mem(), at(lo), len, near);
                let hint = *near;
                first && (lo == hi || geo.registered_near(geo.mem(), at(hi), len, near) && *near == hint)
            };
            let [ln, rn] = &mut walk.near;
            if (l_in || inside(&self.d, l0, lst, (lmin, lmax), ln))
                && (r_in || inside(&self.p, r0, rst, (rmin, rmax), rn))
            {
                let r = run(lrow.label);
                read.pairs.extend(ls.iter().zip(rs).map(|(&lb, &rb)| Pair {
                    local: l0.wrapping_add(lb.wrapping_mul(lst)),
                    remote: r0.wrapping_add(rb.wrapping_mul(rst)),
                    len,
                }));
                read.push_run(r);
                return Ok(());
            }
        }
        for (j, (&lb, &rb)) in ls.iter().zip(rs).enumerate() {
            let (lid, rid) = (lr.base + lb, rr.base + rb);
            let (Some((label, loff, llen)), Some((_, roff, rlen))) = (
                walk.llist.resolve_near(lid, &mut walk.rows[0]),
                walk.rlist.resolve_near(rid, &mut walk.rows[1]),
            ) else {
                return Err(HybridError::request(
                    Knob::Scenario,
                    format!("descriptor id {lid} or {rid} outside the prepared lists"),
                ));
            };
            if llen != rlen {
                return Err(HybridError::request(
                    Knob::Scenario,
                    format!("descriptor lengths differ ({label}: local {llen}, remote {rlen})"),
                ));
            }
            let (d_rank, p_rank, g) = (walk.d_rank, walk.p_rank, lr.group);
            if rb == u64::from(NULL_BLOCK)
                && !findings.iter().any(|f| {
                    matches!(f, Finding::NullBlockRead { d_rank: d, p_rank: pr, group }
                    if *d == d_rank && *pr == p_rank && *group == g)
                })
            {
                findings.push(Finding::NullBlockRead { d_rank, p_rank, group: g });
            }
            for (k, side, geo, off) in [(0, Side::Decode, &self.d, loff), (1, Side::Prefill, &self.p, roff)] {
                if !geo.registered_near(geo.mem(), off, llen, &mut walk.near[k]) {
                    findings.push(Finding::OutsideRegistration {
                        d_rank,
                        p_rank,
                        side,
                        label: label.to_string(),
                        off,
                        len: llen,
                    });
                }
            }
            let one = PairRun {
                label,
                count: 1,
                start: read.pairs.len() as u32,
                local_at: (chunk.local_at + j) as u32,
                remote_at: (chunk.remote_at + j) as u32,
                ..run(label)
            };
            read.pairs.push(Pair { local: loff, remote: roff, len: llen });
            read.push_run(one);
        }
        Ok(())
    }

    /// Whether attention group `gi`'s first paired blocks hold different token positions:
    /// (decode's first token, prefill's). A group's list is the tail of the blocks covering the
    /// computed tokens; trimming only shortens decode's list at its end, prefill's at either end.
    /// `first_at`: where prefill's first paired block first appears in its untrimmed list.
    fn token_shift(
        &self,
        gi: usize,
        blocks: &ExchangedBlocks,
        first_at: Option<usize>,
        local: &[u64],
        remote: &[u64],
        computed_tokens: u32,
    ) -> Option<(u64, u64)> {
        let (p, d) = (&self.p, &self.d);
        let tokens = u64::from(computed_tokens);
        if d.groups[gi].kind.is_state() || local.is_empty() {
            return None;
        }
        remote.first()?;
        let ld = blocks.local_block_ids.get(gi)?;
        let (bd, bp) = (u64::from(d.sizing.block_tokens), u64::from(p.sizing.block_tokens));
        let d_first = tokens.div_ceil(bd).saturating_sub(ld.len() as u64) * bd;
        let lp = blocks.remote_block_ids[gi].len() as u64;
        let pos = first_at.unwrap_or(0) as u64;
        let p_first = (tokens.div_ceil(bp).saturating_sub(lp) * u64::from(p.physical_per_logical) + pos)
            * u64::from(p.kernel_block_tokens);
        (d_first != p_first).then_some((d_first, p_first))
    }

    /// Host buffer: which decode blocks the host-to-device copy overwrites with bytes the
    /// host layer never received (the last layer copied at a device region wins).
    fn host_copy_losses(&self, rank: &DRankPlan, blocks: &ExchangedBlocks) -> Vec<Finding> {
        let d = &self.d;
        // (host region, block) pairs some READ wrote.
        let mut written = std::collections::HashSet::new();
        for p in rank.reads.iter().flat_map(HybridRead::labeled) {
            written.insert((p.label.region, p.local_block));
        }
        let region_of = |layer: &str| d.regions.iter().find(|r| r.name == layer).map(|r| r.index);
        let mut out = Vec::new();
        for (g, ids) in d.groups.iter().zip(&blocks.local_block_ids) {
            let mut lost = 0;
            for &b in ids {
                let kb = u64::from(b) * if g.kind.is_state() { 1 } else { u64::from(d.physical_per_logical) };
                let mut bad = false;
                for k in 0..u32::try_from(g.layers.len()).unwrap_or(0) {
                    // The last layer at device position k in copy order writes last (per group:
                    // the last of this group's layers there, the others do not copy block b).
                    let per_group = self.config.host_copy == HostCopyRule::PerGroup;
                    let last = d
                        .host_slots
                        .iter()
                        .rev()
                        .find(|s| s.position == k && (!per_group || s.group == g.index));
                    // Its host bytes are right only if a READ wrote them (device memory is
                    // aliased, so any group's layer at this position carries the same page).
                    let ok =
                        last.is_some_and(|s| region_of(&s.layer).is_some_and(|r| written.contains(&(r, kb))));
                    bad |= !ok;
                }
                lost += u64::from(bad);
            }
            if lost > 0 {
                out.push(Finding::HostCopyOverwrites {
                    d_rank: rank.d_rank,
                    group: g.index,
                    lost_blocks: lost,
                    blocks: ids.len() as u64,
                });
            }
        }
        out
    }
}

/// A chunk covering whole lists on both sides, each side's ids inside the row its template
/// found, both rows inside one registration, no null block read: its pairs in one pass, as
/// [`HybridPlanner::plan_chunk`] computes them. False (nothing pushed) when anything else
/// holds: the general way decides.
fn whole_lists(
    walk: &ReadWalk<'_>,
    read: &mut HybridRead,
    chunk: Chunk,
    rows: (RowAt, RowAt),
    (ls, rs): (&[u64], &[u64]),
) -> bool {
    let (Some((li, loff)), Some((ri, roff))) = rows else { return false };
    let ((_, lmax), _) = walk.bounds[0][chunk.local.group as usize];
    let ((rmin, rmax), _) = walk.bounds[1][chunk.remote.group as usize];
    let (lrow, rrow) = (&walk.llist.rows[li], &walk.rlist.rows[ri]);
    if !(walk.llist.registered[li] && walk.rlist.registered[ri])
        || lrow.len != rrow.len
        || rmin == u64::from(NULL_BLOCK)
        || loff.saturating_add(lmax) >= lrow.count
        || roff.saturating_add(rmax) >= rrow.count
    {
        return false;
    }
    let l0 = lrow.addr_off.wrapping_add(loff.wrapping_mul(lrow.stride));
    let r0 = rrow.addr_off.wrapping_add(roff.wrapping_mul(rrow.stride));
    let (lst, rst, len) = (lrow.stride, rrow.stride, lrow.len);
    let run = PairRun {
        label: lrow.label,
        group: chunk.local.group,
        remote_group: chunk.remote.group,
        start: read.pairs.len() as u32,
        count: chunk.n as u32,
        local_at: 0,
        remote_at: 0,
    };
    if let ([lb], [rb]) = (ls, rs) {
        read.pairs.push(Pair {
            local: l0.wrapping_add(lb.wrapping_mul(lst)),
            remote: r0.wrapping_add(rb.wrapping_mul(rst)),
            len,
        });
    } else {
        read.pairs.extend(ls.iter().zip(rs).map(|(&lb, &rb)| Pair {
            local: l0.wrapping_add(lb.wrapping_mul(lst)),
            remote: r0.wrapping_add(rb.wrapping_mul(rst)),
            len,
        }));
    }
    read.push_run(run);
    true
}

fn build_rank(
    p: &EngineGeometry,
    d: &EngineGeometry,
    d_rank: u32,
    ratio: i64,
    bsr: u32,
    m: TpMapping,
    slices: StateSlices,
) -> DRankSetup {
    let bsr64 = u64::from(bsr);
    let local = DescList::new(d, local_rows(d, 1));
    let at_remote = DescList::new(d, local_rows(d, bsr64));
    let fa = d.groups.iter().position(|g| g.kind.is_attention()).unwrap_or(0);
    let st = d.groups.iter().position(|g| g.kind.is_state());
    let fa_splits = m.source_ranks_per_group[fa].len().max(1) as u64;
    let local_for_source = if ratio < 0 {
        let ssm_splits = st.map_or(1, |s| m.source_ranks_per_group[s].len().max(1)) as u64;
        m.all_source_ranks
            .iter()
            .enumerate()
            .map(|(i, &r)| {
                let slot = m.rank_to_attention_slot.iter().find(|(x, _)| *x == r).map_or(0, |&(_, s)| s);
                let rows = at_remote
                    .rows
                    .iter()
                    .map(|row| {
                        let mut row = *row;
                        match row.label.kind {
                            RowKind::AttnPage => {
                                row.len /= fa_splits;
                                row.addr_off += u64::from(slot) * row.len;
                            }
                            RowKind::State(_) => {
                                row.len /= ssm_splits;
                                row.addr_off += i as u64 * row.len;
                            }
                        }
                        row
                    })
                    .collect();
                DescList::new(d, rows)
            })
            .collect()
    } else {
        vec![at_remote]
    };
    // Remote rows, from this decode rank's point of view.
    let mut rows = Vec::new();
    for (lr, rr) in d.regions.iter().zip(&p.regions) {
        let mut len = lr.block_len;
        let remote_kv_block_len = len / bsr64;
        if bsr64 > 1 {
            len = remote_kv_block_len;
        }
        let offset = u64::from(m.rank_offset_factor) * remote_kv_block_len;
        rows.push(DescRow {
            label: RowLabel { kind: RowKind::AttnPage, region: rr.index },
            addr_off: rr.base_off + offset,
            len: len / fa_splits,
            stride: rr.block_stride,
            count: rr.num_blocks,
        });
    }
    let mut remote_for_source = Vec::new();
    if let (Some(ds), Some(ps)) = (&d.state, &p.state) {
        let local_offset = u64::from(d_rank) % u64::try_from(ratio.max(1)).unwrap_or(1);
        let parts: Vec<(StatePart, u64)> = ds.conv_parts().map(|x| (x.part, x.len_bytes)).collect();
        let mut conv = remote_conv_offsets(&parts, local_offset, ratio);
        let ssm_read = if ratio >= 1 { ds.ssm_bytes } else { ps.ssm_bytes };
        let ppl = u64::from(p.physical_per_logical);
        // vLLM indexes the remote regions with the decode side's state region indices.
        let state_rows = |conv: &[(StatePart, u64, u64)]| {
            let mut rows = Vec::new();
            for idx in d.state_region_indices() {
                let Some(r) = p.regions.get(idx as usize) else { continue };
                let stride = r.block_stride * ppl;
                for &(part, off, size) in conv {
                    rows.push(DescRow {
                        label: RowLabel { kind: RowKind::State(part), region: r.index },
                        addr_off: r.base_off + off,
                        len: size,
                        stride,
                        count: p.num_blocks(),
                    });
                }
                rows.push(DescRow {
                    label: RowLabel { kind: RowKind::State(StatePart::Ssm), region: r.index },
                    addr_off: r.base_off + ps.conv_bytes + local_offset * ssm_read,
                    len: ssm_read,
                    stride,
                    count: p.num_blocks(),
                });
            }
            rows
        };
        if slices == StateSlices::Exact && ratio < 0 {
            // Source rank i fills piece i of each of decode's parts (vLLM's local split); it
            // reads that piece where it holds those global units (a replicated part: the
            // piece's own offset in it, not the part's start).
            let k = ratio.unsigned_abs();
            remote_for_source = m
                .all_source_ranks
                .iter()
                .enumerate()
                .map(|(i, &source)| {
                    let exact: Vec<(StatePart, u64, u64)> = ds
                        .conv_parts()
                        .zip(&conv)
                        .map(|(dp, &vllm)| {
                            let piece = dp.len_bytes / k;
                            let start = dp.first_global_unit(d_rank) * dp.unit_bytes + i as u64 * piece;
                            held_at(ps, dp.part, source, start, piece).unwrap_or(vllm)
                        })
                        .collect();
                    let mut rows = rows.clone();
                    rows.extend(state_rows(&exact));
                    DescList::new(p, rows)
                })
                .collect();
        }
        if slices == StateSlices::Exact && ratio >= 1 {
            // The one source rank's part holds global units from its first; decode's slice
            // starts at its own first unit (0 for a replicated part on both sides).
            let source = m.all_source_ranks.first().copied().unwrap_or(0);
            conv = ds
                .conv_parts()
                .zip(conv)
                .map(|(dp, vllm)| {
                    let exact = ps.part(dp.part).and_then(|pp| {
                        let d_start = dp.first_global_unit(d_rank) * dp.unit_bytes;
                        let rel = d_start.checked_sub(pp.first_global_unit(source) * pp.unit_bytes)?;
                        (rel + dp.len_bytes <= pp.len_bytes).then_some((
                            dp.part,
                            pp.offset_bytes + rel,
                            dp.len_bytes,
                        ))
                    });
                    exact.unwrap_or(vllm)
                })
                .collect();
        }
        rows.extend(state_rows(&conv));
    }
    let remote = DescList::new(p, rows);
    let groups = d.groups.len();
    let (lruns, rruns) = (desc_id_runs(d, groups, bsr), desc_id_runs(p, groups, 1));
    let templates = m
        .all_source_ranks
        .iter()
        .enumerate()
        .map(|(i, p_rank)| {
            let llist = &local_for_source[i.min(local_for_source.len() - 1)];
            let rlist = remote_for_source.get(i).unwrap_or(&remote);
            let with_rows = |runs: &[IdRun], list: &DescList| {
                runs.iter().map(|&run| RunRow { run, row: list.row_of(run.base) }).collect()
            };
            let runs: [Vec<RunRow>; 2] = [with_rows(&lruns, llist), with_rows(&rruns, rlist)];
            let aligned = (runs[0].len() == runs[1].len())
                .then(|| {
                    runs[0].iter().zip(&runs[1]).map(|(&l, &r)| RowPair::new(l, r, llist, rlist)).collect()
                })
                .flatten();
            let spans = aligned.as_deref().map(RunSpan::cut).unwrap_or_default();
            let runs_per_group = [&lruns, &rruns].map(|runs| {
                let mut n = vec![0; groups];
                for r in runs.iter() {
                    if let Some(x) = n.get_mut(r.group as usize) {
                        *x += 1;
                    }
                }
                n
            });
            ReadTemplate {
                keeps: m.source_ranks_per_group.iter().map(|s| s.contains(p_rank)).collect(),
                runs,
                runs_per_group,
                aligned,
                spans,
            }
        })
        .collect();
    DRankSetup {
        d_rank,
        handshake_ranks: handshake_ranks(p.config.tp, d.config.tp, d_rank).into(),
        notif_suffix: format!(":{}", m.local_consumers),
        mapping: Arc::new(m),
        local,
        local_for_source,
        remote,
        remote_for_source,
        templates,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layouts::hybrid::geometry::HybridEngineSpec;

    #[test]
    fn tp_mapping_dedups_attention_but_not_state() {
        // Qwen3-Next (2 KV heads), P4 -> D1: attention from ranks 0 and 2, state from all four.
        let m = tp_mapping(4, 1, 0, 2, &[true, false]);
        assert_eq!(m.source_ranks_per_group, vec![vec![0, 1, 2, 3], vec![0, 2]]);
        assert_eq!(m.all_source_ranks, vec![0, 1, 2, 3]);
        assert_eq!(m.rank_to_attention_slot, vec![(0, 0), (1, 0), (2, 1), (3, 1)]);
        assert_eq!(m.local_consumers, 1);
        // D > P: one source, head offset by rank.
        let m = tp_mapping(1, 2, 1, 8, &[true, false]);
        assert_eq!((m.all_source_ranks.clone(), m.rank_offset_factor, m.local_consumers), (vec![0], 1, 2));
        // D beyond the heads: replicas read the same head.
        let m = tp_mapping(1, 4, 3, 2, &[false, false]);
        assert_eq!(m.rank_offset_factor, 1);
    }

    /// The planner with no templates' shortcuts: every chunk goes the general way.
    fn general(planner: &HybridPlanner) -> HybridPlanner {
        let mut slow = planner.clone();
        for setup in &mut slow.d_ranks {
            for t in &mut setup.templates {
                t.aligned = None;
                for r in t.runs.iter_mut().flatten() {
                    r.row = None;
                }
            }
        }
        slow
    }

    #[test]
    fn templates_plan_exactly_what_the_general_walk_plans() {
        use super::super::model::PRESETS;
        use crate::layouts::hybrid::preset;
        let mut planned = 0;
        for name in PRESETS {
            for (p_tp, d_tp) in [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 8), (8, 2)] {
                for (kernel, cpu) in [(None, false), (Some(16), false), (None, true)] {
                    let engine = |tp| HybridEngineSpec {
                        tp,
                        num_blocks: 4096,
                        kernel_block_tokens: kernel,
                        kv_buffer_device: if cpu { KvBufferDevice::Cpu } else { KvBufferDevice::Cuda },
                        ..HybridEngineSpec::default()
                    };
                    let config = HybridPairSpec {
                        model: preset(name).expect("preset"),
                        p: engine(p_tp),
                        d: engine(d_tp),
                        permute_local_kv: false,
                        state_slices: StateSlices::Vllm,
                        host_copy: HostCopyRule::Vllm,
                        push_attention: Default::default(),
                        stated: Default::default(),
                    };
                    let Ok(planner) = HybridPlanner::new(&config) else { continue };
                    let slow = general(&planner);
                    for (tokens, hit) in [(1, 0), (700, 0), (5000, 2), (20_000, 0), (20_000, 7)] {
                        let req = HybridRequest::simulated(&planner, tokens, hit);
                        let (fast, general) = (planner.plan(&req, "r"), slow.plan(&req, "r"));
                        assert_eq!(
                            fast, general,
                            "{name} P{p_tp} D{d_tp} kernel {kernel:?} cpu {cpu} {tokens} tokens hit {hit}"
                        );
                        planned += usize::from(fast.is_ok());
                    }
                }
            }
        }
        assert!(planned > 200, "only {planned} plans compared");
    }

    #[test]
    fn remote_conv_offsets_assume_sharding() {
        let parts = [(StatePart::Conv(super::super::geometry::ConvPart::X), 100), (StatePart::Ssm, 10)];
        assert_eq!(remote_conv_offsets(&parts[..1], 1, 2), vec![(parts[0].0, 100, 100)]);
        assert_eq!(remote_conv_offsets(&parts[..1], 0, -2), vec![(parts[0].0, 0, 50)]);
    }
}

#[cfg(test)]
mod refusal_tests {
    use super::*;
    use crate::layouts::Layout;
    use crate::layouts::hybrid::geometry::{ConvStateLayout, GdnPrefillBackend, HybridEngineSpec};
    use crate::layouts::hybrid::preset;

    fn pair(model: &str, p: HybridEngineSpec, d: HybridEngineSpec) -> Result<HybridPlanner, HybridError> {
        HybridPlanner::new(&HybridPairSpec {
            model: preset(model).expect("preset"),
            p,
            d,
            permute_local_kv: false,
            state_slices: Default::default(),
            host_copy: Default::default(),
            push_attention: Default::default(),
            stated: Default::default(),
        })
    }

    fn refusal(r: Result<HybridPlanner, HybridError>) -> (RefusalKind, String, Knob) {
        let e = r.expect_err("vLLM refuses");
        let f = e.refusal().unwrap_or_else(|| panic!("not a refusal: {e}"));
        (f.kind, f.raised(), f.knob)
    }

    #[test]
    fn block_sizes_that_do_not_divide_are_refused_one_way() {
        let e =
            |tp| HybridEngineSpec { gdn_prefill: GdnPrefillBackend::Triton, ..HybridEngineSpec::new(tp, 64) };
        let (k, msg, flag) = refusal(pair("qwen3-next-80b-a3b", e(2), e(4)));
        assert_eq!(k, RefusalKind::BlockSizeNotDivisible);
        assert_eq!(msg, "Local block size 272 is not divisible by remote block size 544 or vice versa.");
        assert_eq!(flag, Knob::BlockSize);
        // P4 -> D2 works with triton (544 is a multiple of 272) ...
        let ok = pair("qwen3-next-80b-a3b", e(4), e(2)).expect("accepted");
        assert_eq!(ok.block_size_ratio, 2);
        // ... and fails on H100-class GPUs (FlashInfer GDN prefill: 576 vs 320 tokens).
        let fi = |tp| HybridEngineSpec { gdn_prefill: GdnPrefillBackend::FlashInfer, ..e(tp) };
        assert_eq!(refusal(pair("qwen3-next-80b-a3b", fi(4), fi(2))).0, RefusalKind::BlockSizeNotDivisible);
        assert_eq!(refusal(pair("qwen3-next-80b-a3b", fi(2), fi(4))).0, RefusalKind::BlockSizeNotDivisible);
        // The suggested common block size makes the pair work.
        let b = |tp| HybridEngineSpec { block_tokens: 544, ..e(tp) };
        assert!(pair("qwen3-next-80b-a3b", b(2), b(4)).is_ok());
    }

    #[test]
    fn every_vllm_refusal_names_its_setting() {
        let e =
            |tp| HybridEngineSpec { gdn_prefill: GdnPrefillBackend::Triton, ..HybridEngineSpec::new(tp, 64) };
        let cases: Vec<(Result<HybridPlanner, HybridError>, RefusalKind, Knob)> = vec![
            (pair("nemotron-h-8b", e(3), e(2)), RefusalKind::ModelNotDivisible, Knob::PTp),
            // TP sizes that each split the model's 8 KV heads but not each other.
            (pair("gpt-oss-120b", e(16), e(24)), RefusalKind::TpNotDivisible, Knob::DTp),
            (
                pair("nemotron-h-8b", HybridEngineSpec { pp: 2, ..e(1) }, e(1)),
                RefusalKind::PipelineParallel,
                Knob::PPp,
            ),
            (
                pair(
                    "nemotron-h-8b",
                    e(1),
                    HybridEngineSpec { conv_state_layout: ConvStateLayout::Sd, ..e(1) },
                ),
                RefusalKind::ConvStateLayout,
                Knob::ConvStateLayout,
            ),
            (
                pair(
                    "qwen3-next-80b-a3b",
                    e(4),
                    HybridEngineSpec { kv_buffer_device: KvBufferDevice::Cpu, ..e(2) },
                ),
                RefusalKind::HostBufferBlockSizes,
                Knob::KvBufferDevice,
            ),
            (pair("qwen3-next-80b-a3b", e(4), e(1)), RefusalKind::HeadShardedBlockSizes, Knob::DTp),
            (
                // 16-token kernel blocks under 272- and 544-token blocks: 17 vs 34 per block.
                pair(
                    "qwen3-next-80b-a3b",
                    HybridEngineSpec { kernel_block_tokens: Some(16), ..e(4) },
                    HybridEngineSpec { kernel_block_tokens: Some(16), ..e(2) },
                ),
                RefusalKind::PrefixCachingKernelBlocks,
                Knob::NoPrefixCaching,
            ),
            (
                pair("gpt-oss-120b", e(1), HybridEngineSpec { layout: Layout::Lbnhc, ..e(1) }),
                RefusalKind::LayoutMismatch,
                Knob::DLayout,
            ),
            (
                pair(
                    "gpt-oss-120b",
                    HybridEngineSpec { layout: Layout::Lbnhc, ..e(1) },
                    HybridEngineSpec { layout: Layout::Lbnhc, ..e(2) },
                ),
                RefusalKind::NonContiguousHeads,
                Knob::Layout,
            ),
            (pair("gpt-oss-120b", e(16), e(8)), RefusalKind::ReplicatedKvPrefillAboveDecode, Knob::PTp),
            (
                pair("granite-4.0-h-tiny", e(1), e(4)).and_then(|_| pair("granite-4.0-h-tiny", e(1), e(3))),
                RefusalKind::ModelNotDivisible,
                Knob::DTp,
            ),
        ];
        for (r, kind, flag) in cases {
            let (k, msg, f) = refusal(r);
            assert_eq!((k, f), (kind, flag), "{msg}");
            assert!(!msg.is_empty());
        }
        // A bare assert: vLLM raises an AssertionError with no message; kvx quotes the condition.
        let err = pair("gpt-oss-120b", e(16), e(8)).expect_err("vLLM refuses");
        let r = err.refusal().expect("a refusal");
        assert_eq!(r.vllm_message, "", "what vLLM raises");
        assert_eq!(
            r.assertion,
            Some("assert not (tp_ratio < 0 and self.transfer_topo.is_kv_replicated(remote_engine_id))")
        );
        assert!(
            err.to_string().contains("AssertionError (no message) from `assert not (tp_ratio < 0"),
            "{err}"
        );
        let permuted = HybridPlanner::new(&HybridPairSpec {
            model: preset("gpt-oss-120b").expect("preset"),
            p: e(1),
            d: HybridEngineSpec { layout: Layout::Lbnhc, ..e(1) },
            permute_local_kv: true,
            state_slices: Default::default(),
            host_copy: Default::default(),
            push_attention: Default::default(),
            stated: Default::default(),
        });
        assert_eq!(refusal(permuted).0, RefusalKind::PermuteWithHma);
    }
}
