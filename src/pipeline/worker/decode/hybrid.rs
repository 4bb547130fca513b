//! A decode rank of a hybrid model (Mamba/GDN state beside attention, sliding windows): the
//! same lifecycle as a uniform model's (handshake on first contact, one-sided GETs to every
//! source rank, notifications, verification), with vLLM 0.33's hybrid rules in the middle:
//! per-group block lists (a window's tail, the last state slot), the hybrid TP mapping, its
//! descriptor rules (`layouts::hybrid::HybridPlanner`), and a check of every byte read against
//! what its position means (`layouts::hybrid::coverage::LandedCheck`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use super::{Decoder, Failure, LoadJob, Local, RemoteRank};
use crate::layouts::hybrid::blocks::{
    ExchangedBlocks, RequestShape, TokenCounts, clip_local, logical_to_kernel,
};
use crate::layouts::hybrid::coverage::{ByteReport, LandedCheck, PoolCheck, Sample};
use crate::layouts::hybrid::staging::host_copy_moves;
use crate::layouts::hybrid::{EngineGeometry, HybridPairSpec, HybridPlanner};
use crate::layouts::hybrid::{HostCopyRule, HybridPlan, handshake_ranks};
use crate::pipeline::params::KvTransferParams;
use crate::pipeline::wire::{FailureCause, LoadResult};
use crate::pipeline::worker::plumbing::{classify_ucx, compat_factors, fetch_peers};
use crate::transfer::handshake::meta::KvxMetadata;
use crate::transfer::notify::Notification;
use crate::transfer::ucx::{ReadDesc, ReadOptions};
use crate::vocab::kinds::TransportKind;

/// What a decode rank of a hybrid pair prepares once: the planner for the prefill engine it
/// was configured with (every rank's descriptor lists, built as vLLM builds them at handshake
/// time) and how its engine lays requests out.
pub(super) struct HybridDecode {
    planner: Arc<HybridPlanner>,
    /// With a host buffer: the KV cache's layout (the planner's geometry is the buffer's).
    cache: Option<EngineGeometry>,
    shape: RequestShape,
    /// Prefill engines handshaked with, by engine id.
    engines: BTreeMap<String, HybridRemote>,
    /// Push mode: the planner for a prefill engine of each TP (what the WRITEs into this
    /// rank hold), built once.
    push_planners: BTreeMap<u32, Arc<HybridPlanner>>,
}

/// A prefill engine this rank has handshaked with, and the plan for it (vLLM plans a remote
/// engine at handshake: its TP from `kv_transfer_params`, its pool from its metadata).
struct HybridRemote {
    planner: Arc<HybridPlanner>,
    ranks: BTreeMap<u32, RemoteRank>,
    transports: Option<String>,
}

impl HybridDecode {
    pub(super) fn new(
        config: &HybridPairSpec,
        cache: Option<EngineGeometry>,
    ) -> Result<Self, crate::layouts::hybrid::HybridError> {
        let planner = Arc::new(HybridPlanner::new(config)?);
        let shape = RequestShape::of(&planner.d);
        Ok(HybridDecode { planner, cache, shape, engines: BTreeMap::new(), push_planners: BTreeMap::new() })
    }

    /// The planner for a prefill engine of `tp` ranks of `num_blocks` logical blocks each, its
    /// other settings as this engine's (the configured one when it is that engine), or vLLM's
    /// refusal of the pair.
    fn planner_for(&self, tp: u32, num_blocks: u32, engine_id: &str) -> Result<Arc<HybridPlanner>, Failure> {
        let planned = &self.planner.config.p;
        if planned.tp == tp && planned.num_blocks == num_blocks {
            return Ok(Arc::clone(&self.planner));
        }
        let mut config = self.planner.config.clone();
        config.p.tp = tp;
        config.p.num_blocks = num_blocks;
        HybridPlanner::new(&config)
            .map(Arc::new)
            .map_err(|e| incompatible(format!("prefill engine {engine_id} (TP {tp}): {e}")))
    }

    /// Forgets a prefill engine (its connection broke): the next request handshakes again.
    pub(super) fn forget(&mut self, engine_id: &str) {
        self.engines.remove(engine_id);
    }

    /// Push mode: the planner for a prefill engine of `tp` ranks (its pool as configured),
    /// built on first use.
    fn push_planner(&mut self, tp: u32, engine_id: &str) -> Result<Arc<HybridPlanner>, Failure> {
        if let Some(p) = self.push_planners.get(&tp) {
            return Ok(Arc::clone(p));
        }
        let planner = self.planner_for(tp, self.planner.config.p.num_blocks, engine_id)?;
        self.push_planners.insert(tp, Arc::clone(&planner));
        Ok(planner)
    }

    /// Push mode: the request's token counts and this engine's lists per group as its
    /// scheduler registers them (clipped: a window's tail, the last state slot; empty on a
    /// full prefix hit), from its allocation `local_blocks`.
    pub(super) fn push_lists(
        &self,
        params: &KvTransferParams,
        local_blocks: &[u32],
    ) -> Result<(TokenCounts, Vec<Vec<u32>>), Failure> {
        let (tokens, d_raw) = self.request_lists(params, local_blocks)?;
        let d = &self.planner.d;
        let lists = clip_local(&d.groups, d.sizing.block_tokens, &d_raw, tokens.d_external_tokens)
            .map_err(|e| incompatible(e.to_string()))?;
        Ok((tokens, lists))
    }

    /// The request's token counts and this engine's raw lists per group: the prompt from what
    /// prefill computed (`remote_num_tokens`: one short of the prompt with state, the backoff),
    /// the prefix hit from how many blocks the engine allocated.
    fn request_lists(
        &self,
        params: &KvTransferParams,
        local_blocks: &[u32],
    ) -> Result<(TokenCounts, Vec<Vec<u32>>), Failure> {
        let computed = u32::try_from(params.remote_num_tokens).map_err(|_| {
            incompatible(format!("remote_num_tokens {} is out of range", params.remote_num_tokens))
        })?;
        let shape = &self.shape;
        let prompt = shape.prompt_of_computed(computed);
        let hit = shape.hit_blocks(prompt, local_blocks.len()).ok_or_else(|| {
            incompatible(format!("{} local blocks for a {prompt}-token request", local_blocks.len()))
        })?;
        let d_raw = shape.lists(prompt, hit, local_blocks).ok_or_else(|| {
            incompatible(format!(
                "{} local blocks do not split into {} KV cache groups",
                local_blocks.len(),
                shape.groups.len()
            ))
        })?;
        Ok((shape.tokens(prompt, hit * shape.block_tokens), d_raw))
    }
}

/// What a decode rank's READs read per KV cache group and part, with what clipping kept off
/// the wire: a group that sent fewer of its blocks than the `every` blocks decode loads
/// without clipping would have moved the rest at the bytes per block it moved.
fn parts_read(
    planner: &HybridPlanner,
    rank: &crate::layouts::hybrid::DRankPlan,
    blocks: &ExchangedBlocks,
    every: u64,
) -> Vec<crate::report::summary::PartBytes> {
    use crate::layouts::hybrid::RowKind;
    let mut runs = Vec::new();
    for read in &rank.reads {
        for run in read.runs() {
            let part = match run.label.kind {
                RowKind::AttnPage => "attention".to_string(),
                RowKind::State(p) => p.label(),
            };
            let kind = planner.d.groups.get(run.group as usize).map_or("", |g| g.kind.vllm_spec());
            let bytes: u64 = read.pairs[run.pairs()].iter().map(|p| p.len).sum();
            let sent = blocks.local_block_ids.get(run.group as usize).map_or(0, |l| l.len() as u64);
            let clipped_bytes = match sent {
                0 => 0,
                n => (u128::from(bytes) * u128::from(every.saturating_sub(n)) / u128::from(n)) as u64,
            };
            runs.push(crate::report::summary::PartBytes {
                group: run.group,
                kind: kind.to_string(),
                part,
                bytes,
                descriptors: u64::from(run.count),
                clipped_bytes,
            });
        }
    }
    // Summed per group and part, sorted once.
    let mut out = Vec::new();
    crate::report::summary::add_parts(&mut out, &runs);
    out
}

/// The host-buffer rules of vLLM 0.33 a plan's findings say move wrong bytes on decode rank
/// `rank`, each with the switch that moves the right ones.
fn staging_rules(findings: &[crate::layouts::hybrid::Finding], rank: u32) -> Vec<String> {
    use crate::layouts::hybrid::Finding;
    use crate::layouts::hybrid::geometry::Side;
    let (mut lost, mut pages) = (Vec::new(), Vec::new());
    for f in findings {
        match *f {
            Finding::HostCopyOverwrites { d_rank, group, lost_blocks, blocks } if d_rank == rank => {
                lost.push(format!("group {group}: {lost_blocks} of {blocks}"));
            }
            Finding::HostStatePagePadded { side, real_page_bytes, padded_page_bytes } => {
                let who = if side == Side::Prefill { "prefill" } else { "decode" };
                pages.push(format!("{who} {real_page_bytes} of {padded_page_bytes} bytes"));
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    if !pages.is_empty() {
        out.push(format!(
            "host tensors hold unpadded state pages while the regions step by padded ones ({}; \
             --host-state-page padded pads them)",
            pages.join(", ")
        ));
    }
    if !lost.is_empty() {
        out.push(format!(
            "the host-to-device copy passes every group's blocks through every layer, and a later group's \
             layer overwrites the others' blocks with bytes it never received (blocks lost: {}; \
             --host-copy per-group copies each layer's own)",
            lost.join(", ")
        ));
    }
    out
}

/// Prefill's block lists per group as its `kv_transfer_params` carried them.
fn remote_lists(params: &KvTransferParams) -> Result<Vec<Vec<u32>>, Failure> {
    params
        .remote_block_ids
        .iter()
        .map(|l| l.iter().map(|&b| u32::try_from(b)).collect::<Result<Vec<u32>, _>>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| incompatible("remote_block_ids: a block id is out of range"))
}

fn incompatible(msg: impl Into<String>) -> Failure {
    (FailureCause::Incompatible, msg.into())
}

impl Decoder<'_> {
    /// Handshakes with the prefill ranks this rank reads from (vLLM's handshake set).
    fn hybrid_handshake(&self, h: &HybridDecode, params: &KvTransferParams) -> Result<HybridRemote, Failure> {
        let cfg = self.cfg;
        let p_tp = params.tp_size;
        let engine_id = &params.remote_engine_id;
        // The prefill engine's geometry at its TP (its block size and kernel split); the plan
        // is built once its pool is known, from its metadata.
        let config = &h.planner.config;
        let p_geometry = EngineGeometry::new(
            &config.model,
            &crate::layouts::hybrid::HybridEngineSpec { tp: p_tp, ..config.p },
            crate::layouts::hybrid::geometry::Side::Prefill,
        )
        .map_err(|e| incompatible(format!("prefill engine {engine_id} (TP {p_tp}): {e}")))?;
        let endpoint = format!("tcp://{}:{}", params.remote_host, params.remote_port);
        let ranks: Vec<(u32, u32)> =
            handshake_ranks(p_tp, config.d.tp, cfg.rank).into_iter().map(|r| (0, r)).collect();
        let factors = compat_factors(&cfg.pair.model, cfg.pair.version, cfg.transport.mode);
        let block_tokens = p_geometry.sizing.block_tokens;
        let validate = |meta: &KvxMetadata| -> Result<(), String> {
            if meta.tp_size != p_tp {
                Err(format!("TP {} where {p_tp} was planned", meta.tp_size))
            } else if meta.block_size_tokens != block_tokens {
                Err(format!(
                    "{}-token blocks where {block_tokens} were planned for prefill TP {p_tp} (give both \
                     engines the same --block-size and --kernel-block-size)",
                    meta.block_size_tokens
                ))
            } else {
                Ok(())
            }
        };
        let peers = fetch_peers(&self.client, &endpoint, &ranks, &factors, validate)?;
        // The prefill pool: its ranks' first region holds one kernel block per logical block's
        // kernel split (the configured pool when a rank advertises no region).
        let blocks = match peers.first().and_then(|p| p.metadata.regions.first()) {
            Some(r0) => {
                let blocks = r0.num_blocks / u64::from(p_geometry.physical_per_logical.max(1));
                u32::try_from(blocks).map_err(|_| {
                    incompatible(format!("prefill engine {engine_id}: {blocks} blocks per rank"))
                })?
            }
            None => config.p.num_blocks,
        };
        let planner = h.planner_for(p_tp, blocks, engine_id)?;
        // The plan assumes the prefill engine lays its pool out as this one would at its TP.
        let (first, p_len) = crate::pipeline::worker::plumbing::hybrid_peer_regions(
            &planner.p,
            &peers,
            &format!("prefill engine {engine_id}"),
            &format!("this decode engine plans for it at TP {p_tp}"),
        )?;
        let mut out = BTreeMap::new();
        for peer in &peers {
            out.insert(peer.metadata.tp_rank, self.connect_peer(&peer.metadata, first, p_len)?);
        }
        Ok(HybridRemote { planner, ranks: out, transports: None })
    }

    /// One request of a hybrid model: plan by vLLM's hybrid rules, read, notify, verify.
    pub(super) fn load_hybrid(
        &mut self,
        h: &mut HybridDecode,
        r: &mut LoadResult,
        t0: Instant,
        job: LoadJob<'_>,
    ) -> Result<(), Failure> {
        let LoadJob { params, local_blocks, seed, .. } = job;
        let cfg = self.cfg;
        if !h.engines.contains_key(&params.remote_engine_id) {
            let th = Instant::now();
            let engine = self.hybrid_handshake(h, params)?;
            r.handshake_ns = Some(th.elapsed().as_nanos() as u64);
            h.engines.insert(params.remote_engine_id.clone(), engine);
        }
        // Plan: prefill's lists as it sent them, this engine's own from its allocation.
        let tp = Instant::now();
        let (tokens, d_raw) = h.request_lists(params, &local_blocks)?;
        let remote = remote_lists(params)?;
        let planner = match h.engines.get(&params.remote_engine_id) {
            Some(eng) => Arc::clone(&eng.planner),
            None => return Err((FailureCause::Internal, "engine vanished from the cache".into())),
        };
        let planner = &*planner;
        let blocks = ExchangedBlocks::new(
            &planner.p.groups,
            planner.p.sizing.block_tokens,
            planner.d.sizing.block_tokens,
            &remote,
            &d_raw,
            tokens.d_external_tokens,
        )
        .map_err(|e| incompatible(e.to_string()))?;
        let plan = planner
            .plan_exchanged_ranks(tokens, blocks, &[cfg.rank], &params.remote_request_id)
            .map_err(|e| incompatible(e.to_string()))?;
        let Some(mine) = plan.d_ranks.iter().find(|d| d.d_rank == cfg.rank) else {
            return Err(incompatible(format!("decode rank {} is not in the plan", cfg.rank)));
        };
        r.plan_ns = tp.elapsed().as_nanos() as u64;
        // Without clipping decode would load every block from its prefix hit to the last.
        let bd = planner.d.sizing.block_tokens.max(1);
        let hit = tokens.d_hit_tokens / bd;
        let every = u64::from(tokens.p_computed_tokens.div_ceil(bd).saturating_sub(hit));
        r.parts = parts_read(planner, mine, &plan.blocks, every);
        r.descs_raw = mine.descriptor_count() as u64;
        r.descs_coalesced = r.descs_raw;
        // Read.
        let Some(eng) = h.engines.get_mut(&params.remote_engine_id) else {
            return Err((FailureCause::Internal, "engine vanished from the cache".into()));
        };
        let tt = Instant::now();
        let tt_mono = crate::clock::now_ns();
        if let Some(side) = self.batch.as_mut() {
            // cuda-batch: every READ's pairs copied from the prefill ranks' mapped pools, as
            // for a uniform model (one batch per request, or one per prefill rank), one wait.
            let mem = self.local.memory_mut()?;
            let reads: Vec<crate::pipeline::worker::batch::BatchRead<'_>> = mine
                .reads
                .iter()
                .map(|read| {
                    let ipc = eng.ranks.get(&read.p_rank).and_then(|rk| rk.ipc.as_ref());
                    (read.p_rank, ipc, read.pairs.as_slice())
                })
                .collect();
            side.read_request(mem, &reads, self.timeout, r)?;
        } else {
            let Local::Ucx(u) = &mut self.local else {
                return Err((
                    FailureCause::Internal,
                    "a hybrid model moves over UCX or cuda-batch; this rank has neither".into(),
                ));
            };
            let opts =
                ReadOptions { max_inflight: cfg.transport.inflight.max(1) as usize, timeout: self.timeout };
            for read in &mine.reads {
                let region = eng.ranks.get(&read.p_rank).and_then(|rk| rk.region.as_ref()).ok_or((
                    FailureCause::PeerGone,
                    format!("no UCX connection to prefill rank {}", read.p_rank),
                ))?;
                let descs = read.pairs.iter().map(|p| ReadDesc {
                    local_off: p.local,
                    remote_off: p.remote,
                    len: p.len,
                });
                let stats = region.read_batch(&mut u.local, descs, &opts).map_err(|e| {
                    (classify_ucx(&e), format!("read from prefill rank {}: {e}", read.p_rank))
                })?;
                r.post_ns += stats.post_ns;
                r.bytes += stats.bytes;
            }
            if eng.transports.is_none() {
                eng.transports = super::ucx_choices(&eng.ranks, &u.ctx, r);
            }
            r.transport = Some(TransportKind::Ucx);
            r.transports = eng.transports.clone();
        }
        if cfg.transport.slowdown > 0.0 {
            // A staged regression for testing gates (`--slowdown`): the read takes longer.
            std::thread::sleep(tt.elapsed().mul_f64(cfg.transport.slowdown));
        }
        r.transfer_ns = tt.elapsed().as_nanos() as u64;
        r.transfer_span = Some(crate::clock::ClockSpan::since(tt_mono));
        // Notify every prefill rank of the handshake set: those read from, and those that
        // hold blocks this rank did not need (a full hit, heads another rank reads).
        let tn = Instant::now();
        let count = mine.mapping.local_consumers;
        let setup = &planner.d_ranks[cfg.rank as usize];
        let done = Notification::Notif { p_request_id: params.remote_request_id.clone(), count };
        let mut notified = Vec::new();
        for &p_rank in setup.handshake_ranks.iter().chain(&mine.mapping.all_source_ranks) {
            if notified.contains(&p_rank) {
                continue;
            }
            notified.push(p_rank);
            if let Some(rank) = eng.ranks.get(&p_rank) {
                rank.send(&done, true)
                    .map_err(|e| (FailureCause::Notify, format!("notify prefill rank {p_rank}: {e}")))?;
            }
        }
        r.notify_ns = tn.elapsed().as_nanos() as u64;
        r.e2e_ns = t0.elapsed().as_nanos() as u64;
        // Host buffer: the received blocks into the KV cache (vLLM's
        // `sync_recved_kv_to_device`: layer by layer, the blocks `--host-copy` says), timed as
        // its own stage.
        if let (Some(pool), Some(cache)) = (self.staged.as_mut(), h.cache.as_ref()) {
            let ts = Instant::now();
            let d = &planner.d;
            let kernel = logical_to_kernel(&d.groups, &plan.blocks.local_block_ids, d.physical_per_logical);
            let per_group = planner.config.host_copy == HostCopyRule::PerGroup;
            let moves = host_copy_moves(cache, d, &kernel, per_group);
            let (from, to) = crate::pipeline::worker::plumbing::split_moves(&moves, false);
            crate::transfer::memory::copy_moved(self.local.memory()?, &from, pool, &to).map_err(|e| {
                (FailureCause::Internal, format!("copy the received blocks into the KV cache: {e}"))
            })?;
            r.sync_ns = ts.elapsed().as_nanos() as u64;
        }
        // Verify (outside the timed path).
        if let Some(stride) = cfg.verify.stride() {
            let tv = Instant::now();
            let report = match (self.staged.as_ref(), h.cache.as_ref()) {
                (Some(pool), Some(cache)) => self.check_cache(planner, cache, pool, &plan, seed, stride)?,
                _ => self.check_landed(planner, &plan, mine, seed, stride)?,
            };
            r.bytes_padding = report.bytes_padding;
            match report.wrong.first() {
                None => r.bytes_verified = report.bytes_checked,
                Some(first) => {
                    let mut why = format!("{first} ({} wrong ranges in all)", report.wrong.len());
                    let rules = staging_rules(&plan.findings, cfg.rank);
                    if !rules.is_empty() {
                        why = format!("{why}; vLLM 0.33's rules here: {}", rules.join("; "));
                    }
                    r.verify_failure = Some(why);
                }
            }
            r.verify_ns = tv.elapsed().as_nanos() as u64;
        }
        Ok(())
    }

    /// Push mode, once every WRITE into this rank arrived: what they held (planned from both
    /// sides' lists, when prefill's came with the request) and every `stride`-th block range
    /// of the request in this rank's pool against what its position means.
    pub(super) fn push_landed(
        &self,
        h: &mut HybridDecode,
        r: &mut LoadResult,
        params: &KvTransferParams,
        (tokens, lists): (TokenCounts, &[Vec<u32>]),
        seed: u64,
    ) -> Result<(), Failure> {
        use crate::layouts::hybrid::write_plan::{attention_skipped, writes};
        let cfg = self.cfg;
        let planner = h.push_planner(params.tp_size, &params.remote_engine_id)?;
        let planner = &*planner;
        // Prefill's lists come with its answer (not with a concurrent dispatch's decode leg).
        let p_lists = params.remote_block_ids.len() == planner.p.groups.len();
        if p_lists && !lists.is_empty() {
            let remote = remote_lists(params)?;
            let blocks = ExchangedBlocks::new(
                &planner.p.groups,
                planner.p.sizing.block_tokens,
                planner.d.sizing.block_tokens,
                &remote,
                lists,
                tokens.d_external_tokens,
            )
            .map_err(|e| incompatible(e.to_string()))?;
            let plan = planner
                .plan_exchanged_ranks(tokens, blocks, &[cfg.rank], &params.remote_request_id)
                .map_err(|e| incompatible(e.to_string()))?;
            let into_me: Vec<_> = handshake_ranks(planner.config.p.tp, planner.config.d.tp, cfg.rank)
                .into_iter()
                .flat_map(|p| writes(planner, &plan, p))
                .filter(|w| w.d_rank == cfg.rank)
                .collect();
            r.bytes = into_me.iter().map(|w| w.bytes()).sum();
            r.descs_raw = into_me.iter().map(|w| w.pairs.len() as u64).sum();
            r.descs_coalesced = r.descs_raw;
            // Parts as pull reads them, where push writes the same set.
            if let Some(mine) = plan.d_ranks.iter().find(|d| d.d_rank == cfg.rank)
                && into_me.iter().all(|w| w.duplicate_pairs == 0 && !w.attention_skipped)
            {
                let bd = planner.d.sizing.block_tokens.max(1);
                let every =
                    u64::from(tokens.p_computed_tokens.div_ceil(bd).saturating_sub(tokens.d_hit_tokens / bd));
                r.parts = parts_read(planner, mine, &plan.blocks, every);
            }
        }
        let stride = cfg.verify.stride();
        if p_lists && stride.is_none() {
            return Ok(());
        }
        let bp = u64::from(planner.p.sizing.block_tokens.max(1));
        let written = u64::from(tokens.p_computed_tokens).div_ceil(bp) * bp;
        let check = PoolCheck::new(&planner.d, cfg.rank, lists, tokens.p_computed_tokens, written, seed)
            .place("in its pool after the prefill ranks' WRITEs");
        if !p_lists {
            // Without prefill's lists: the request's blocks in this rank's pool.
            r.bytes = check.ranges().iter().map(|x| x.end - x.start).sum();
        }
        let Some(stride) = stride else { return Ok(()) };
        let tv = Instant::now();
        // The blocks prefill filled (`Sample`).
        let mut check = check.only(Sample::new(&planner.p, stride, seed));
        let ranges = check.ranges();
        let mut report = ByteReport::default();
        self.local
            .memory()?
            .read_ranges(&ranges, |i, got| check.check(i, got, &mut report))
            .map_err(|e| (FailureCause::Internal, format!("read back the written blocks: {e}")))?;
        r.bytes_padding = report.bytes_padding;
        match report.wrong.first() {
            None => r.bytes_verified = report.bytes_checked,
            Some(first) => {
                let mut rules = Vec::new();
                if attention_skipped(&planner.config, cfg.rank) {
                    rules.push(
                        "its push connector writes attention only into the first decode rank of each head when \
                         decode TP is above prefill TP and the KV heads (as read from its code; --push-attention \
                         every-rank writes each rank's)"
                            .to_string(),
                    );
                }
                if planner.findings.iter().any(|f| {
                    matches!(f, crate::layouts::hybrid::Finding::StateSliceMisread { d_rank, .. } if *d_rank == cfg.rank)
                }) {
                    rules.push(
                        "remote_conv_offsets assume every conv part is sharded like x (--state-slices exact moves \
                         each part's own slice)"
                            .to_string(),
                    );
                }
                let mut why = format!("{first} ({} wrong ranges in all)", report.wrong.len());
                if !rules.is_empty() {
                    why = format!("{why}; vLLM 0.33's rules here: {}", rules.join("; "));
                }
                r.verify_failure = Some(why);
            }
        }
        r.verify_ns = tv.elapsed().as_nanos() as u64;
        Ok(())
    }

    /// Every byte of every `stride`-th pair this rank read, against what its position means.
    fn check_landed(
        &self,
        planner: &HybridPlanner,
        plan: &HybridPlan,
        mine: &crate::layouts::hybrid::DRankPlan,
        seed: u64,
        stride: u32,
    ) -> Result<ByteReport, Failure> {
        // The pairs of the blocks prefill filled (`Sample`).
        let mut check =
            LandedCheck::new(planner, plan, self.cfg.rank, seed).only(Sample::new(&planner.p, stride, seed));
        let pairs: Vec<(u32, crate::layouts::hybrid::LabeledPair)> = mine
            .reads
            .iter()
            .flat_map(|read| read.labeled().map(move |p| (read.p_rank, p)))
            .filter(|(_, p)| check.wants(p))
            .collect();
        let ranges: Vec<std::ops::Range<u64>> =
            pairs.iter().map(|(_, p)| p.pair.local..p.pair.local + p.pair.len).collect();
        let mut report = ByteReport::default();
        self.local
            .memory()?
            .read_ranges(&ranges, |i, got| {
                let (p_rank, pair) = &pairs[i];
                check.check(*p_rank, pair, got, &mut report);
            })
            .map_err(|e| (FailureCause::Internal, format!("read back the received blocks: {e}")))?;
        Ok(report)
    }

    /// With a host buffer: every `stride`-th block range (one layer's block) of the request in
    /// the KV cache, after the copy into it, against what its position means.
    fn check_cache(
        &self,
        planner: &HybridPlanner,
        cache: &EngineGeometry,
        pool: &crate::transfer::memory::KvBuffer,
        plan: &HybridPlan,
        seed: u64,
        stride: u32,
    ) -> Result<ByteReport, Failure> {
        let tokens = plan.tokens.p_computed_tokens;
        let bp = u64::from(planner.p.sizing.block_tokens);
        let written = u64::from(tokens).div_ceil(bp.max(1)) * bp;
        let mut check =
            PoolCheck::new(cache, self.cfg.rank, &plan.blocks.local_block_ids, tokens, written, seed)
                .only(Sample::new(&planner.p, stride, seed));
        let ranges = check.ranges();
        let mut report = ByteReport::default();
        pool.read_ranges(&ranges, |i, got| check.check(i, got, &mut report))
            .map_err(|e| (FailureCause::Internal, format!("read back the KV cache: {e}")))?;
        Ok(report)
    }
}
