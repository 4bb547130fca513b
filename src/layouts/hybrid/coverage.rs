//! What a hybrid plan's bytes mean, checked: every descriptor pair is decoded on both sides
//! into (layer, global KV head, token, byte) for attention and (layer, state part, global byte
//! of that part) for state, the two must agree, and each decode rank must receive each of its
//! heads' tokens and each of its state parts exactly once.
//!
//! Independent of how the planner computed offsets: it reads only the engines' geometry, the
//! request's block lists and token counts, and the pairs. Device plans only (with a host
//! buffer the bytes reach the KV cache through the copies: [`PoolCheck`] checks the cache
//! after them).
//!
//! Token positions: a group's block list is the tail of the blocks covering the computed
//! tokens, so entry `j` of an `L`-long list is block `cdiv(tokens, block) - L + j`. Decode
//! blocks that run past prefill's last block are not written (vLLM zeroes that tail).

use std::collections::BTreeMap;

use serde::Serialize;

use super::desc_lists::RowKind;
use super::geometry::{EngineGeometry, GroupKind, HybridRegion, RegionMem, StatePart};
use super::planner::{HybridPlan, HybridPlanner};
use super::runs::LabeledPair;
use crate::layouts::{Layout, pattern};

/// What a byte range holds.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Meaning {
    /// Attention: `pos = token * cell_bytes + byte` of one layer and global KV head.
    Attn { layer: String, head: u32 },
    /// State: `pos` = byte of the model's (global) part.
    State { layer: String, part: StatePart },
}

/// The result of checking a plan.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CoverageReport {
    /// Bytes whose source and destination mean different things, bytes read twice or never,
    /// descriptors outside registered memory. Empty when the plan moves the right bytes.
    pub errors: Vec<String>,
    /// Bytes read for a group's block into a region where the group has no layer (a group
    /// padded to the group size): harmless, but moved.
    pub padding_bytes: u64,
    /// Pairs decoded.
    pub pairs: usize,
    /// Whether the plan was checkable (device memory on both sides).
    pub checked: bool,
}

impl CoverageReport {
    pub fn is_ok(&self) -> bool {
        self.errors.is_empty()
    }
}

/// Where each block id of a side sits: `(group, absolute block index)`.
struct Positions {
    by_id: BTreeMap<u32, (u32, u64)>,
}

impl Positions {
    fn new(geo: &EngineGeometry, lists: &[Vec<u32>], tokens: u32) -> Self {
        let n = u64::from(tokens.div_ceil(geo.sizing.block_tokens));
        let mut by_id = BTreeMap::new();
        for (g, ids) in lists.iter().enumerate() {
            let first = n.saturating_sub(ids.len() as u64);
            for (j, &b) in ids.iter().enumerate() {
                by_id.insert(b, (g as u32, first + j as u64));
            }
        }
        Positions { by_id }
    }
}

/// One decoded run: what it holds and where it starts in that meaning's positions.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Run {
    meaning: Option<Meaning>,
    pos: u64,
    /// Bytes left in this run from the decoded offset.
    left: u64,
    /// The decoder layer of its meaning (0 without one).
    layer: u32,
}

/// One rank of one side of a pair, as the check reads its bytes: its engine, its rank and the
/// prompt positions its blocks hold.
struct SideView<'a> {
    geo: &'a EngineGeometry,
    rank: u32,
    pos: Positions,
    /// Sub-blocks per kernel block the bytes arrive in (decode with a block-size ratio).
    sub_blocks: u64,
}

fn region_at(geo: &EngineGeometry, off: u64) -> Option<&HybridRegion> {
    geo.regions.iter().find(|r| r.base_off <= off && off < r.base_off + r.num_blocks * r.block_stride)
}

impl SideView<'_> {
    /// Decodes the byte at `off` read by a row of kind `kind`.
    fn decode(&self, kind: RowKind, off: u64) -> Result<Run, String> {
        let g = self.geo;
        let region = region_at(g, off).ok_or_else(|| format!("offset {off} is in no region"))?;
        let rel = off - region.base_off;
        let ppl = u64::from(g.physical_per_logical);
        let (logical, intra) = match kind {
            RowKind::AttnPage => (rel / region.block_stride / ppl, rel % region.block_stride),
            RowKind::State(_) => (rel / (region.block_stride * ppl), rel % (region.block_stride * ppl)),
        };
        let kernel_in_logical = (rel / region.block_stride) % ppl;
        let id = u32::try_from(logical).map_err(|_| "block id overflows".to_string())?;
        let &(group, abs) =
            self.pos.by_id.get(&id).ok_or_else(|| format!("block {id} is not in the request"))?;
        let grp = &g.groups[group as usize];
        let cache_layer = grp.layers.get(region.index as usize);
        let layer = cache_layer.map(|l| l.name.clone());
        let layer_index = cache_layer.map_or(0, |l| l.layer);
        let page_left = |unit: u64| unit - intra % unit;
        match (kind, grp.kind) {
            (RowKind::AttnPage, GroupKind::State(_))
            | (RowKind::State(_), GroupKind::Full | GroupKind::SlidingWindow { .. }) => {
                Err(format!("{kind:?} row reads block {id} of a {:?} group", grp.kind))
            }
            (RowKind::AttnPage, _) => {
                let kpage = g.kernel_page_bytes();
                let sub_len = kpage / self.sub_blocks;
                let (sub, o) = (intra / sub_len, intra % sub_len);
                let c = g.cell_bytes;
                let heads = u64::from(g.heads_per_rank);
                let ktok = u64::from(g.kernel_block_tokens);
                let sub_tok = ktok / self.sub_blocks;
                let (h, t, byte, left) = match g.config.layout {
                    Layout::Lbnhc => {
                        let t = o / (heads * c);
                        let h = (o % (heads * c)) / c;
                        (h, t, o % c, c - o % c)
                    }
                    _ => {
                        let run = sub_tok * c;
                        (o / run, (o % run) / c, o % c, run - o % run)
                    }
                };
                let token =
                    abs * u64::from(g.sizing.block_tokens) + kernel_in_logical * ktok + sub * sub_tok + t;
                let head = g.rank_heads(self.rank).start + u32::try_from(h).unwrap_or(u32::MAX);
                Ok(Run {
                    meaning: layer.map(|layer| Meaning::Attn { layer, head }),
                    pos: token * c + byte,
                    left: left.min(page_left(sub_len)),
                    layer: layer_index,
                })
            }
            (RowKind::State(_), GroupKind::State(_)) => {
                let s = g.state.as_ref().ok_or("state row without state")?;
                let p = s
                    .parts
                    .iter()
                    .find(|p| p.offset_bytes <= intra && intra < p.offset_bytes + p.len_bytes)
                    .ok_or_else(|| format!("state byte {intra} is padding"))?;
                let (part, gbyte, _) =
                    s.global_span(self.rank, intra, 1).ok_or("state byte outside parts")?;
                Ok(Run {
                    meaning: layer.map(|layer| Meaning::State { layer, part }),
                    pos: gbyte,
                    left: p.offset_bytes + p.len_bytes - intra,
                    layer: layer_index,
                })
            }
        }
    }
}

/// Intervals recorded per meaning: `(start, end)`.
type Cover = BTreeMap<(u32, Meaning), Vec<(u64, u64)>>;

/// Checks every decode rank of `plan` (see the module docs).
pub fn check_plan(planner: &HybridPlanner, plan: &HybridPlan) -> CoverageReport {
    let mut report = CoverageReport::default();
    let (p, d) = (&planner.p, &planner.d);
    if p.mem() != RegionMem::Vram || d.mem() != RegionMem::Vram {
        return report;
    }
    report.checked = true;
    let tokens = plan.tokens.p_computed_tokens;
    let mut got: Cover = BTreeMap::new();
    for rank in &plan.d_ranks {
        for read in &rank.reads {
            let local = SideView {
                geo: d,
                rank: rank.d_rank,
                pos: Positions::new(d, &plan.blocks.local_block_ids, tokens),
                sub_blocks: u64::from(planner.block_size_ratio),
            };
            let remote = SideView {
                geo: p,
                rank: read.p_rank,
                pos: Positions::new(p, &plan.blocks.remote_block_ids, tokens),
                sub_blocks: 1,
            };
            for pair in read.labeled() {
                report.pairs += 1;
                if let Err(e) = check_pair(&local, &remote, &pair, &mut got, &mut report.padding_bytes) {
                    report.errors.push(format!("D{} from P{} {}: {e}", rank.d_rank, read.p_rank, pair.label));
                }
            }
        }
    }
    // Overlaps: a byte read twice.
    for ((r, m), v) in &mut got {
        v.sort_unstable();
        for w in v.windows(2) {
            if w[1].0 < w[0].1 {
                report.errors.push(format!(
                    "D{r} {m:?}: bytes {}..{} read twice",
                    w[1].0,
                    w[0].1.min(w[1].1)
                ));
            }
        }
    }
    // What each decode rank must receive.
    for rank in &plan.d_ranks {
        for (meaning, want) in expected(planner, plan, rank.d_rank) {
            let have = merged(got.get(&(rank.d_rank, meaning.clone())).map_or(&[][..], Vec::as_slice));
            if have != want {
                report.errors.push(format!(
                    "D{} {meaning:?}: must receive {}, received {}",
                    rank.d_rank,
                    show(&want),
                    show(&have)
                ));
            }
        }
    }
    report
}

fn show(v: &[(u64, u64)]) -> String {
    if v.is_empty() {
        return "nothing".into();
    }
    v.iter().map(|(a, b)| format!("{a}..{b}")).collect::<Vec<_>>().join(", ")
}

fn merged(v: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut v = v.to_vec();
    v.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (a, b) in v {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

fn check_pair(
    local: &SideView,
    remote: &SideView,
    pair: &LabeledPair,
    got: &mut Cover,
    padding: &mut u64,
) -> Result<(), String> {
    let lp = pair;
    let pair = &lp.pair;
    for (side, off) in [(local, pair.local), (remote, pair.remote)] {
        if !side.geo.registered(side.geo.mem(), off, pair.len) {
            return Err(format!("{off}+{} is outside registered memory", pair.len));
        }
    }
    let mut done = 0;
    while done < pair.len {
        let l = local.decode(lp.label.kind, pair.local + done)?;
        let r = remote.decode(lp.label.kind, pair.remote + done)?;
        let n = l.left.min(r.left).min(pair.len - done);
        match (&l.meaning, &r.meaning) {
            (None, None) => *padding += n,
            (Some(lm), Some(rm)) if lm == rm && l.pos == r.pos => {
                got.entry((local.rank, lm.clone())).or_default().push((l.pos, l.pos + n));
            }
            _ => {
                return Err(format!(
                    "bytes {}..{} land as {:?}@{} but hold {:?}@{}",
                    done,
                    done + n,
                    l.meaning,
                    l.pos,
                    r.meaning,
                    r.pos
                ));
            }
        }
        done += n;
    }
    Ok(())
}

/// The meanings decode rank `d_rank` must receive, with their position ranges.
fn expected(planner: &HybridPlanner, plan: &HybridPlan, d_rank: u32) -> Vec<(Meaning, Vec<(u64, u64)>)> {
    let (p, d) = (&planner.p, &planner.d);
    let tokens = u64::from(plan.tokens.p_computed_tokens);
    let mut out = Vec::new();
    if plan.blocks.full_hit() {
        return out;
    }
    for (gi, grp) in d.groups.iter().enumerate() {
        let (Some(local), Some(remote)) =
            (plan.blocks.local_block_ids.get(gi), plan.blocks.remote_block_ids.get(gi))
        else {
            continue;
        };
        if local.is_empty() || remote.is_empty() {
            continue;
        }
        match grp.kind {
            GroupKind::State(_) => {
                let Some(s) = &d.state else { continue };
                for layer in &grp.layers {
                    for part in &s.parts {
                        let start = part.first_global_unit(d_rank) * part.unit_bytes;
                        out.push((
                            Meaning::State { layer: layer.name.clone(), part: part.part },
                            vec![(start, start + part.len_bytes)],
                        ));
                    }
                }
            }
            _ => {
                let (bd, bp) = (u64::from(d.sizing.block_tokens), u64::from(p.sizing.block_tokens));
                let (nd, np) = (tokens.div_ceil(bd), tokens.div_ceil(bp));
                let d_first = (nd - local.len() as u64) * bd;
                let p_first = (np - remote.len() as u64) * bp;
                let (lo, hi) = (d_first.max(p_first), (nd * bd).min(np * bp));
                if lo >= hi {
                    continue;
                }
                let c = d.cell_bytes;
                for layer in &grp.layers {
                    for head in d.rank_heads(d_rank) {
                        out.push((Meaning::Attn { layer: layer.name.clone(), head }, vec![(lo * c, hi * c)]));
                    }
                }
            }
        }
    }
    out
}

/// What moving a plan's bytes did (see [`move_and_check`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ByteReport {
    /// Bytes the prefill ranks' pools hold for the request (filled by meaning).
    pub bytes_filled: u64,
    /// Bytes the READs moved, and of those the bytes that mean something on decode (not padding).
    pub bytes_moved: u64,
    pub bytes_checked: u64,
    /// Bytes of the pairs checked that hold no layer's data (a group's block in a region where
    /// the group has no layer).
    pub bytes_padding: u64,
    /// Each range of wrong bytes, as what it is: where it landed and what it holds.
    pub wrong: Vec<String>,
    /// Whether the plan was movable here (device memory on both sides).
    pub checked: bool,
}

/// A meaning's key for [`pattern_into`] (FNV-1a of what it names).
fn meaning_key(m: &Meaning) -> u64 {
    let text = match m {
        Meaning::Attn { layer, head } => format!("attn/{layer}/{head}"),
        Meaning::State { layer, part } => format!("state/{layer}/{}", part.label()),
    };
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// Bytes of a rank's registered memory (every region's blocks).
fn pool_len(geo: &EngineGeometry) -> u64 {
    geo.regions.iter().map(|r| r.base_off + r.num_blocks * r.block_stride).max().unwrap_or(0)
}

/// The pattern bytes of the meaning keyed `key` from position `pos` into `out`: each byte
/// depends on the meaning and its position only, so it is the same whichever rank, TP size or
/// layout holds it. One hash per run, then a cheap step per 8 positions (the uniform
/// pattern's: [`pattern::word_at`]), so prefill fills and decode checks at close to memory
/// speed.
fn pattern_into(key: u64, pos: u64, seed: u64, out: &mut [u8]) {
    let k = run_key(key, seed);
    // A leading part word, then whole words, then a trailing part word.
    let lane = (pos % 8) as usize;
    let head = if lane == 0 { 0 } else { (8 - lane).min(out.len()) };
    let (first, rest) = out.split_at_mut(head);
    if head > 0 {
        first.copy_from_slice(&pattern::word_at(k, pos / 8).to_le_bytes()[lane..lane + head]);
    }
    // Anything left starts on a word (`fill_at` takes word offsets only).
    if !rest.is_empty() {
        pattern::fill_at(rest, k, pos + head as u64);
    }
}

/// Whether `have` holds the pattern bytes of the meaning keyed `key` from position `pos` on
/// (checked in place, word by word); `Err` holds the index in `have` of the first byte that
/// differs.
fn pattern_check(key: u64, pos: u64, seed: u64, have: &[u8]) -> Result<(), u64> {
    pattern::check_at(have, run_key(key, seed), pos).map_err(|at| at - pos)
}

/// The key a meaning's words derive from under `seed`.
#[inline]
fn run_key(key: u64, seed: u64) -> u64 {
    pattern::mix(key ^ seed.rotate_left(17))
}

/// The 8 pattern bytes of positions `8 * w .. 8 * w + 8`, little-endian.
#[cfg(test)]
fn pattern_word(key: u64, w: u64, seed: u64) -> u64 {
    pattern::word_at(run_key(key, seed), w)
}

/// One block of a side's request in one region.
#[derive(Debug, Clone)]
struct BlockRange {
    off: u64,
    len: u64,
    /// How its group reads it: a state block's parts, an attention block's kernel pages.
    kind: RowKind,
    /// The decoder layer whose data it holds (`None`: its group has no layer in this region).
    layer: Option<u32>,
    /// The tokens it holds (attention).
    tokens: std::ops::Range<u64>,
}

/// Every block of `side`'s request in every region.
fn block_ranges(side: &SideView<'_>) -> Vec<BlockRange> {
    let geo = side.geo;
    let ppl = u64::from(geo.physical_per_logical);
    let bt = u64::from(geo.sizing.block_tokens);
    let mut ranges = Vec::new();
    for region in &geo.regions {
        for (&id, &(group, abs)) in &side.pos.by_id {
            let Some(grp) = geo.groups.get(group as usize) else { continue };
            let off = region.base_off + u64::from(id) * region.block_stride * ppl;
            let layer = grp.layers.get(region.index as usize).map(|l| l.layer);
            let tokens = abs * bt..(abs + 1) * bt;
            if grp.kind.is_state() {
                let Some(s) = &geo.state else { continue };
                let len = s.parts.iter().map(|p| p.offset_bytes + p.len_bytes).max().unwrap_or(0);
                ranges.push(BlockRange { off, len, kind: RowKind::State(StatePart::Ssm), layer, tokens });
            } else {
                let len = ppl * region.block_stride;
                ranges.push(BlockRange { off, len, kind: RowKind::AttnPage, layer, tokens });
            }
        }
    }
    ranges
}

/// Which of a request's bytes [verification] fills and checks, the same on both sides: with stride
/// `s`, one unit in `s` of (layer, prefill block) for attention and of layers for state, on a
/// diagonal (the units where the layer's ordinal among the model's cache layers plus the
/// prefill block's index plus a shift drawn from the request's seed is a multiple of `s`).
/// Every attention layer gets one block in `s`, and one state layer in `s` its whole state;
/// prefill writes only those units' blocks and decode checks only them, so neither pays for
/// the bytes nobody reads back. Stride 1 is every byte.
///
/// [verification]: crate::vocab::knob::Knob::Verify
#[derive(Debug, Clone)]
pub struct Sample {
    stride: u64,
    shift: u64,
    /// Tokens of a prefill block, and bytes of one token of one KV head.
    p_block_tokens: u64,
    cell_bytes: u64,
    /// Each cache layer's decoder index, in order (its position is its ordinal).
    layers: Vec<u32>,
}

impl Sample {
    /// Every byte.
    pub fn every(p: &EngineGeometry) -> Self {
        Self::new(p, 1, 0)
    }

    /// One unit in `stride` of a request whose pattern seed is `seed`, in prefill blocks of `p`
    /// (the prefill engine's KV cache).
    pub fn new(p: &EngineGeometry, stride: u32, seed: u64) -> Self {
        let stride = u64::from(stride.max(1));
        let mut layers: Vec<u32> = p.groups.iter().flat_map(|g| g.layers.iter().map(|l| l.layer)).collect();
        layers.sort_unstable();
        layers.dedup();
        Sample {
            stride,
            shift: pattern::mix(seed) % stride,
            p_block_tokens: u64::from(p.sizing.block_tokens.max(1)),
            cell_bytes: p.cell_bytes.max(1),
            layers,
        }
    }

    /// Whether every byte is in the sample.
    pub fn is_every(&self) -> bool {
        self.stride == 1
    }

    fn unit(&self, layer: u32, chunk: u64) -> bool {
        let ordinal = self.layers.binary_search(&layer).map_or(u64::from(layer), |i| i as u64);
        (ordinal + chunk + self.shift).is_multiple_of(self.stride)
    }

    /// Whether a decoded run's bytes are in the sample.
    fn run(&self, run: &Run) -> bool {
        match &run.meaning {
            _ if self.is_every() => true,
            Some(Meaning::Attn { .. }) => {
                self.unit(run.layer, run.pos / (self.cell_bytes * self.p_block_tokens))
            }
            Some(Meaning::State { .. }) => self.unit(run.layer, 0),
            None => false,
        }
    }

    /// Whether any byte of a block is in the sample.
    fn block(&self, b: &BlockRange) -> bool {
        let Some(layer) = b.layer else { return self.is_every() };
        match b.kind {
            _ if self.is_every() => true,
            RowKind::State(_) => self.unit(layer, 0),
            RowKind::AttnPage => {
                let first = b.tokens.start / self.p_block_tokens;
                let end = b.tokens.end.div_ceil(self.p_block_tokens);
                end - first >= self.stride || (first..end).any(|c| self.unit(layer, c))
            }
        }
    }
}

/// What a prefill rank writes for one request: every block the request holds in every region,
/// each byte by what it means there (its layer, KV head and token, or state part and global
/// byte), padding left as it is. Ranges are offsets from the rank's registered base.
pub struct RequestFill<'a> {
    side: SideView<'a>,
    seed: u64,
    ranges: Vec<BlockRange>,
}

impl<'a> RequestFill<'a> {
    /// `lists`: the request's block lists per group as the rank holds them (nulls included),
    /// for `tokens` computed tokens.
    pub fn new(geo: &'a EngineGeometry, rank: u32, lists: &[Vec<u32>], tokens: u32, seed: u64) -> Self {
        let side = SideView { geo, rank, pos: Positions::new(geo, lists, tokens), sub_blocks: 1 };
        let ranges = block_ranges(&side);
        RequestFill { side, seed, ranges }
    }

    /// Only the blocks `sample` holds ([verification] `sample`: nothing reads the others back).
    ///
    /// [verification]: crate::vocab::knob::Knob::Verify
    pub fn only(mut self, sample: &Sample) -> Self {
        self.ranges.retain(|b| sample.block(b));
        self
    }

    /// The byte ranges written, in order.
    pub fn ranges(&self) -> Vec<std::ops::Range<u64>> {
        self.ranges.iter().map(|b| b.off..b.off + b.len).collect()
    }

    /// Writes range `i`'s bytes into `buf` (its length); returns the bytes that mean something.
    pub fn fill(&self, i: usize, buf: &mut [u8]) -> u64 {
        let Some(&BlockRange { off, kind, .. }) = self.ranges.get(i) else { return 0 };
        let mut filled = 0;
        let mut done = 0;
        while done < buf.len() {
            match self.side.decode(kind, off + done as u64) {
                Ok(run) => {
                    let n = (run.left as usize).min(buf.len() - done).max(1);
                    if let Some(m) = &run.meaning {
                        pattern_into(meaning_key(m), run.pos, self.seed, &mut buf[done..done + n]);
                        filled += n as u64;
                    }
                    done += n;
                }
                // Padding (a state page's tail, a kernel page's unused heads): left as it is.
                Err(_) => done += 1,
            }
        }
        filled
    }
}

/// Checks the bytes a decode rank received for a request against what each position means.
pub struct LandedCheck<'a> {
    local: SideView<'a>,
    /// Prefill's side, for saying what wrong bytes hold instead.
    remote: SideView<'a>,
    seed: u64,
    sample: Sample,
}

impl<'a> LandedCheck<'a> {
    /// Decode rank `d_rank` of `planner`'s pair, receiving `plan`'s request.
    pub fn new(planner: &'a HybridPlanner, plan: &HybridPlan, d_rank: u32, seed: u64) -> Self {
        let tokens = plan.tokens.p_computed_tokens;
        LandedCheck {
            local: SideView {
                geo: &planner.d,
                rank: d_rank,
                pos: Positions::new(&planner.d, &plan.blocks.local_block_ids, tokens),
                sub_blocks: u64::from(planner.block_size_ratio),
            },
            remote: SideView {
                geo: &planner.p,
                rank: 0,
                pos: Positions::new(&planner.p, &plan.blocks.remote_block_ids, tokens),
                sub_blocks: 1,
            },
            seed,
            sample: Sample::every(&planner.p),
        }
    }

    /// Checks only the bytes `sample` holds (the blocks prefill filled).
    pub fn only(mut self, sample: Sample) -> Self {
        self.sample = sample;
        self
    }

    /// Whether any byte of `pair` is in the sample (judged by its first byte: a pair lies in
    /// one block of one layer on both sides).
    pub fn wants(&self, pair: &LabeledPair) -> bool {
        self.sample.is_every()
            || self.local.decode(pair.label.kind, pair.pair.local).is_ok_and(|run| self.sample.run(&run))
    }

    /// Checks the `got` bytes a pair from prefill rank `p_rank` wrote (the pair's local range),
    /// adding to `report`: bytes checked, and each wrong range as what it is.
    pub fn check(&mut self, p_rank: u32, pair: &LabeledPair, got: &[u8], report: &mut ByteReport) {
        self.remote.rank = p_rank;
        let mut done = 0;
        while done < pair.pair.len {
            let off = pair.pair.local + done;
            let Ok(run) = self.local.decode(pair.label.kind, off) else {
                done += 1;
                continue;
            };
            let n = run.left.min(pair.pair.len - done).max(1);
            if run.meaning.is_none() {
                report.bytes_padding += n;
            }
            if let Some(m) = run.meaning.as_ref().filter(|_| self.sample.run(&run)) {
                let have = got.get(done as usize..(done + n) as usize).unwrap_or(&[]);
                report.bytes_checked += n;
                let first_wrong = if have.len() as u64 == n {
                    pattern_check(meaning_key(m), run.pos, self.seed, have).err()
                } else {
                    // Fewer bytes than the pair's range: the first missing one is wrong.
                    Some(have.len() as u64)
                };
                if let Some(i) = first_wrong {
                    let held = self.remote.decode(pair.label.kind, pair.pair.remote + done + i).ok();
                    let held = held.map_or_else(
                        || "bytes that mean nothing there".to_string(),
                        |h| match h.meaning {
                            Some(hm) => format!("{} bytes from {}", describe(&hm), h.pos),
                            None => "padding".to_string(),
                        },
                    );
                    report.wrong.push(format!(
                        "decode rank {}, {} bytes {}..{}: holds prefill rank {p_rank}'s {held}",
                        self.local.rank,
                        describe(m),
                        run.pos + i,
                        run.pos + n,
                    ));
                }
            }
            done += n;
        }
    }
}

/// Checks a decode rank's KV cache after a host buffer's copy into it (vLLM's
/// `sync_recved_kv_to_device`): every block of the request's lists in every region where its
/// group has a layer, against what each position means. The cache is laid out as `geo` (the
/// engine with `kv_buffer_device = cuda`), whatever the READs read.
pub struct PoolCheck<'a> {
    side: SideView<'a>,
    seed: u64,
    ranges: Vec<BlockRange>,
    sample: Sample,
    /// Attention tokens prefill wrote (its blocks' end): later tokens of decode's last block
    /// are not compared.
    attn_tokens: u64,
    /// Where the bytes were checked, for reports.
    place: &'static str,
}

impl<'a> PoolCheck<'a> {
    /// Names where the checked bytes are (default: "in its KV cache after the host-to-device
    /// copy").
    pub fn place(mut self, place: &'static str) -> Self {
        self.place = place;
        self
    }

    /// Decode rank `rank`'s blocks `lists` (per group, as decode loads them) of a request of
    /// `tokens` computed tokens, of which prefill's blocks hold the first `attn_tokens`.
    pub fn new(
        geo: &'a EngineGeometry,
        rank: u32,
        lists: &[Vec<u32>],
        tokens: u32,
        attn_tokens: u64,
        seed: u64,
    ) -> Self {
        let side = SideView { geo, rank, pos: Positions::new(geo, lists, tokens), sub_blocks: 1 };
        let ranges = block_ranges(&side);
        PoolCheck {
            side,
            seed,
            ranges,
            sample: Sample::every(geo),
            attn_tokens,
            place: "in its KV cache after the host-to-device copy",
        }
    }

    /// Only the blocks (and of them the bytes) `sample` holds.
    pub fn only(mut self, sample: Sample) -> Self {
        self.ranges.retain(|b| sample.block(b));
        self.sample = sample;
        self
    }

    /// The byte ranges to read back, in order.
    pub fn ranges(&self) -> Vec<std::ops::Range<u64>> {
        self.ranges.iter().map(|b| b.off..b.off + b.len).collect()
    }

    /// Checks range `i`'s bytes `got`, adding to `report`.
    pub fn check(&mut self, i: usize, got: &[u8], report: &mut ByteReport) {
        let Some(&BlockRange { off, kind, .. }) = self.ranges.get(i) else { return };
        let cell = self.side.geo.cell_bytes.max(1);
        let mut done = 0;
        while done < got.len() {
            let Ok(run) = self.side.decode(kind, off + done as u64) else {
                done += 1;
                continue;
            };
            let mut n = (run.left as usize).min(got.len() - done).max(1);
            let Some(m) = run.meaning.as_ref().filter(|_| self.sample.run(&run)) else {
                done += n;
                continue;
            };
            if matches!(m, Meaning::Attn { .. }) {
                let limit = self.attn_tokens * cell;
                if run.pos >= limit {
                    done += n;
                    continue;
                }
                n = n.min(usize::try_from(limit - run.pos).unwrap_or(usize::MAX));
            }
            let have = &got[done..done + n];
            report.bytes_checked += n as u64;
            if let Err(k) = pattern_check(meaning_key(m), run.pos, self.seed, have) {
                let k = k as usize;
                let held = if have[k..].iter().all(|&b| b == 0) {
                    "zeros (no copy brought its bytes)"
                } else {
                    "other bytes (a copy put something else there)"
                };
                report.wrong.push(format!(
                    "decode rank {}, {} bytes {}..{} {}: holds {held}",
                    self.side.rank,
                    describe(m),
                    run.pos + k as u64,
                    run.pos + n as u64,
                    self.place,
                ));
            }
            done += n;
        }
    }
}

/// Moves `plan`'s bytes for real, in this process: fills every prefill rank's pool with the
/// request's blocks by meaning, copies each READ's pairs from it into its decode rank's pool,
/// and checks every byte each decode rank received against what its position there means.
/// Independent of how the planner computed offsets: only the pairs move bytes. A wrong byte
/// range is reported as what it is: the decode rank, the meaning its position must hold, and
/// the prefill rank and meaning of the bytes it holds.
pub fn move_and_check(planner: &HybridPlanner, plan: &HybridPlan, seed: u64) -> ByteReport {
    move_and_check_sampled(planner, plan, seed, 1)
}

/// [`move_and_check`] as [verification] `sample` runs it with stride `stride`: prefill fills only the
/// sampled blocks ([`Sample`]), the rest of its pool stays zero, and decode checks only the
/// pairs of sampled blocks.
///
/// [verification]: crate::vocab::knob::Knob::Verify
pub fn move_and_check_sampled(
    planner: &HybridPlanner,
    plan: &HybridPlan,
    seed: u64,
    stride: u32,
) -> ByteReport {
    let mut report = ByteReport::default();
    let sample = Sample::new(&planner.p, stride, seed);
    let (p, d) = (&planner.p, &planner.d);
    if p.mem() != RegionMem::Vram || d.mem() != RegionMem::Vram {
        return report;
    }
    report.checked = true;
    let tokens = plan.tokens.p_computed_tokens;
    let mut pools: BTreeMap<u32, Vec<u8>> = BTreeMap::new();
    for rank in &plan.d_ranks {
        for read in &rank.reads {
            if let std::collections::btree_map::Entry::Vacant(e) = pools.entry(read.p_rank) {
                let mut buf = vec![0u8; pool_len(p) as usize];
                let fill = RequestFill::new(p, read.p_rank, &plan.blocks.remote_block_ids, tokens, seed)
                    .only(&sample);
                for (i, r) in fill.ranges().into_iter().enumerate() {
                    if let Some(bytes) = buf.get_mut(r.start as usize..r.end as usize) {
                        report.bytes_filled += fill.fill(i, bytes);
                    }
                }
                e.insert(buf);
            }
        }
    }
    for rank in &plan.d_ranks {
        let mut pool = vec![0u8; pool_len(d) as usize];
        // The READs, as a transport would run them.
        for read in &rank.reads {
            let Some(src) = pools.get(&read.p_rank) else { continue };
            for pair in &read.pairs {
                let (l, r, n) = (pair.local as usize, pair.remote as usize, pair.len as usize);
                if let (Some(to), Some(from)) = (pool.get_mut(l..l + n), src.get(r..r + n)) {
                    to.copy_from_slice(from);
                    report.bytes_moved += pair.len;
                }
            }
        }
        // What landed, against what each position must hold.
        let mut check = LandedCheck::new(planner, plan, rank.d_rank, seed).only(sample.clone());
        for read in &rank.reads {
            for pair in read.labeled() {
                if !check.wants(&pair) {
                    continue;
                }
                let (l, n) = (pair.pair.local as usize, pair.pair.len as usize);
                let got = pool.get(l..l + n).unwrap_or(&[]);
                check.check(read.p_rank, &pair, got, &mut report);
            }
        }
    }
    report
}

/// A meaning as a person reads it: `layer L conv C`, `layer L KV head 3`.
fn describe(m: &Meaning) -> String {
    match m {
        Meaning::Attn { layer, head } => format!("{layer} KV head {head}"),
        Meaning::State { layer, part } => format!("{layer} {}", part.label()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Word by word or byte by byte, every position gets its own byte of its word.
    #[test]
    fn pattern_bytes_depend_on_the_position_only() {
        let byte = |pos: u64| (pattern_word(7, pos / 8, 3) >> (8 * (pos % 8))) as u8;
        for start in 0..17u64 {
            for len in 0..40usize {
                let mut out = vec![0u8; len];
                pattern_into(7, start, 3, &mut out);
                let want: Vec<u8> = (start..start + len as u64).map(byte).collect();
                assert_eq!(out, want, "from {start}, {len} bytes");
            }
        }
    }

    /// The in-place check accepts exactly what the fill wrote and names the first wrong byte,
    /// wherever the run starts and ends.
    #[test]
    fn pattern_check_finds_the_first_wrong_byte() {
        for start in 0..17u64 {
            for len in 1..40usize {
                let mut buf = vec![0u8; len];
                pattern_into(7, start, 3, &mut buf);
                assert_eq!(pattern_check(7, start, 3, &buf), Ok(()), "from {start}, {len} bytes");
                assert!(pattern_check(8, start, 3, &buf).is_err(), "another meaning's bytes");
                for bad in [0, len / 2, len - 1] {
                    let mut flipped = buf.clone();
                    flipped[bad] ^= 0x10;
                    assert_eq!(
                        pattern_check(7, start, 3, &flipped),
                        Err(bad as u64),
                        "from {start}, byte {bad}"
                    );
                }
            }
        }
    }
}
