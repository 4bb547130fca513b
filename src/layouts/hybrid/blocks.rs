//! Which blocks of a request move, as vLLM 0.33's scheduler and pull worker decide it.
//!
//! - Backoff: with state, prefill computes N-1 of N prompt tokens and decode loads N-1
//!   (`_prefill_backoff`), so decode derives the last state itself.
//! - Clipping at every exchange (`get_exchange_clipped_blocks`): a sliding-window group keeps
//!   its last `cdiv(window, block) + 1` blocks, a state group its last slot.
//! - Decode's local blocks are its unhashed ones, leading and null (id 0) blocks dropped
//!   (`get_unhashed_block_ids_all_groups`); a full prefix hit sends nothing.
//! - In the worker: logical ids expand to kernel blocks, attention ids to remote-block
//!   granularity (the block-size ratio), then prefix-cache trimming per group
//!   (`_apply_prefix_caching`): attention groups keep prefill's tail, state groups pair slots
//!   by position.
//!
//! Block ids are `u32` as vLLM hands them over; kernel and sub-block ids are `u64`. Id 0 is
//! vLLM's null block.

use serde::Serialize;

use super::error::HybridError;
use super::geometry::{GroupKind, KvGroup};
use crate::vocab::knob::Knob;

/// vLLM's null block id: placeholders for blocks a group does not keep.
pub const NULL_BLOCK: u32 = 0;

/// Token counts of one request through the pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TokenCounts {
    pub prompt_tokens: u32,
    /// vLLM's `_prefill_backoff()`: the trailing prompt tokens prefill leaves to decode (1 with
    /// state, else 0). It applies only to a prompt longer than it: a 1-token prompt of a model
    /// with state is computed whole (`p_computed_tokens` 1), its backoff still 1.
    pub backoff_tokens: u32,
    /// Tokens prefill computes (`num_computed_tokens` at `request_finished`), which it
    /// reports as `remote_num_tokens`.
    pub p_computed_tokens: u32,
    /// Tokens decode already holds (its local prefix hit).
    pub d_hit_tokens: u32,
    /// Tokens decode loads (`num_external_tokens`; 0 on a full hit).
    pub d_external_tokens: u32,
}

impl TokenCounts {
    /// Counts for a prompt of `prompt_tokens` with a decode prefix hit of `d_hit_tokens`.
    pub fn new(has_state: bool, prompt_tokens: u32, d_hit_tokens: u32) -> Self {
        let backoff = u32::from(has_state);
        let computed =
            if backoff > 0 && prompt_tokens > backoff { prompt_tokens - backoff } else { prompt_tokens };
        TokenCounts {
            prompt_tokens,
            backoff_tokens: backoff,
            p_computed_tokens: computed,
            d_hit_tokens,
            d_external_tokens: computed.saturating_sub(d_hit_tokens),
        }
    }
}

/// Blocks each group keeps at an exchange: `cdiv(window, block) + 1` for a sliding window
/// (vLLM `blocks_per_sw`), 0 (all) otherwise.
pub fn window_blocks(groups: &[KvGroup], block_tokens: u32) -> Vec<u32> {
    groups.iter().map(|g| blocks_per_window(g.kind, block_tokens).unwrap_or(0)).collect()
}

/// vLLM's `blocks_per_sw` of a group: `cdiv(window, block) + 1`, for a sliding window only.
fn blocks_per_window(kind: GroupKind, block_tokens: u32) -> Option<u32> {
    match kind {
        GroupKind::SlidingWindow { window_tokens } => Some(window_tokens.div_ceil(block_tokens.max(1)) + 1),
        _ => None,
    }
}

/// vLLM's `get_exchange_clipped_blocks`: sliding-window groups keep their tail, state groups
/// (with `clip_state`) their last slot. An empty list (full prefix hit) stays empty.
pub fn clip_for_exchange(
    groups: &[KvGroup],
    block_tokens: u32,
    block_ids: &[Vec<u32>],
    clip_state: bool,
) -> Result<Vec<Vec<u32>>, HybridError> {
    clip_filtered(groups, block_tokens, block_ids, clip_state, |_| true)
}

/// Decode's unhashed lists as its scheduler clips them for an exchange (what a push
/// registration carries): the null block left out, a window's tail, the last state slot;
/// nothing on a full prefix hit (`d_external_tokens == 0`).
pub fn clip_local(
    groups: &[KvGroup],
    d_block_tokens: u32,
    d_raw_unhashed_block_ids: &[Vec<u32>],
    d_external_tokens: u32,
) -> Result<Vec<Vec<u32>>, HybridError> {
    if d_external_tokens == 0 {
        return Ok(Vec::new());
    }
    clip_filtered(groups, d_block_tokens, d_raw_unhashed_block_ids, true, |b| b != NULL_BLOCK)
}

/// [`clip_for_exchange`] of the lists with only the ids `keep` keeps (in one pass: no list
/// of the kept ids is made first).
fn clip_filtered(
    groups: &[KvGroup],
    block_tokens: u32,
    block_ids: &[Vec<u32>],
    clip_state: bool,
    keep: impl Fn(u32) -> bool + Copy,
) -> Result<Vec<Vec<u32>>, HybridError> {
    if block_ids.is_empty() {
        return Ok(Vec::new());
    }
    if block_ids.len() != groups.len() {
        return Err(HybridError::request(
            Knob::Scenario,
            format!("{} block lists for {} KV cache groups", block_ids.len(), groups.len()),
        ));
    }
    Ok(groups
        .iter()
        .zip(block_ids)
        .map(|(g, ids)| {
            let tail = match blocks_per_window(g.kind, block_tokens) {
                Some(n) => n as usize,
                None if clip_state && g.kind.is_state() => 1,
                None => usize::MAX,
            };
            // The last `tail` kept ids, in order.
            let mut from = ids.len();
            let mut kept = 0;
            while from > 0 && kept < tail {
                from -= 1;
                kept += usize::from(keep(ids[from]));
            }
            if kept == ids.len() - from {
                return ids[from..].to_vec();
            }
            ids[from..].iter().copied().filter(|&b| keep(b)).collect()
        })
        .collect())
}

/// The block lists the two schedulers exchange for one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ExchangedBlocks {
    /// What prefill sends in `kv_transfer_params.remote_block_ids` (one list per group).
    pub remote_block_ids: Vec<Vec<u32>>,
    /// Decode's blocks to fill, after clipping; empty on a full prefix hit.
    pub local_block_ids: Vec<Vec<u32>>,
}

impl ExchangedBlocks {
    /// Clips prefill's raw lists and decode's unhashed lists as the two schedulers do.
    /// `d_external_tokens == 0` is a full prefix hit: decode reads nothing.
    pub fn new(
        p_groups: &[KvGroup],
        p_block_tokens: u32,
        d_block_tokens: u32,
        p_raw_block_ids: &[Vec<u32>],
        d_raw_unhashed_block_ids: &[Vec<u32>],
        d_external_tokens: u32,
    ) -> Result<Self, HybridError> {
        let remote = clip_for_exchange(p_groups, p_block_tokens, p_raw_block_ids, true)?;
        let local = clip_local(p_groups, d_block_tokens, d_raw_unhashed_block_ids, d_external_tokens)?;
        Ok(ExchangedBlocks { remote_block_ids: remote, local_block_ids: local })
    }

    /// Whether decode already holds everything (a notification is all that is sent).
    pub fn full_hit(&self) -> bool {
        self.local_block_ids.iter().all(Vec::is_empty)
    }
}

/// Kernel block ids, one list per group, held in one allocation (a planner builds two per
/// request, and every READ shares them): group `g`'s ids are `self[g]`. Trimming a group
/// narrows its range; nothing moves.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupIds {
    ids: Vec<u64>,
    ranges: Vec<std::ops::Range<usize>>,
}

impl GroupIds {
    /// Logical ids to kernel ids (`_logical_to_kernel_block_ids`), one list per group of
    /// `groups` that `block_ids` has: attention ids expand by `ppl`, state ids stay (a state
    /// slot is one block whatever the kernel).
    pub fn kernel(groups: &[KvGroup], block_ids: &[Vec<u32>], ppl: u32) -> GroupIds {
        let r = u64::from(ppl.max(1));
        let pairs = groups.iter().zip(block_ids);
        let total =
            pairs.clone().map(|(g, ids)| if g.kind.is_state() { ids.len() } else { ids.len() * r as usize });
        let mut out =
            GroupIds { ids: Vec::with_capacity(total.sum()), ranges: Vec::with_capacity(groups.len()) };
        for (g, ids) in pairs {
            let start = out.ids.len();
            if g.kind.is_state() || r == 1 {
                out.ids.extend(ids.iter().map(|&b| u64::from(b)));
            } else {
                out.ids.extend(ids.iter().flat_map(|&b| (0..r).map(move |k| u64::from(b) * r + k)));
            }
            out.ranges.push(start..out.ids.len());
        }
        out
    }

    /// Attention ids to remote-block granularity (`_map_block_ids_for_block_size_ratio`): each
    /// local block of an attention group splits into `bsr` sub-blocks (the caller clips them to
    /// the remote list's length); state groups' ids stay.
    pub fn ratio_mapped(&self, groups: &[KvGroup], bsr: u32) -> GroupIds {
        let r = u64::from(bsr.max(1));
        let mut out = GroupIds { ids: Vec::with_capacity(self.ids.len() * r as usize), ranges: Vec::new() };
        out.ranges.reserve(self.ranges.len());
        for (g, ids) in groups.iter().zip(self.iter()) {
            let start = out.ids.len();
            if g.kind.is_state() || r == 1 {
                out.ids.extend_from_slice(ids);
            } else {
                out.ids.extend(ids.iter().flat_map(|&b| (0..r).map(move |k| b * r + k)));
            }
            out.ranges.push(start..out.ids.len());
        }
        out
    }

    /// How many groups' lists it holds.
    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    pub fn get(&self, g: usize) -> Option<&[u64]> {
        self.ranges.get(g).map(|r| &self.ids[r.clone()])
    }

    /// Every group's list, in group order.
    pub fn iter(&self) -> impl Iterator<Item = &[u64]> + Clone + '_ {
        self.ranges.iter().map(|r| &self.ids[r.clone()])
    }

    /// Keeps group `g`'s first `n` ids at most.
    pub fn truncate(&mut self, g: usize, n: usize) {
        if let Some(r) = self.ranges.get_mut(g) {
            r.end = r.end.min(r.start.saturating_add(n));
        }
    }

    /// Drops group `g`'s first `n` ids (all of them, if it holds fewer).
    pub fn drop_front(&mut self, g: usize, n: usize) {
        if let Some(r) = self.ranges.get_mut(g) {
            r.start = r.end.min(r.start.saturating_add(n));
        }
    }
}

impl std::ops::Index<usize> for GroupIds {
    type Output = [u64];
    fn index(&self, g: usize) -> &[u64] {
        &self.ids[self.ranges[g].clone()]
    }
}

/// As a list per group (what the `Vec<Vec<u64>>` it replaces gave).
impl Serialize for GroupIds {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

/// Logical ids to kernel ids (`_logical_to_kernel_block_ids`): attention ids expand by
/// `ppl`, state ids stay (a state slot is one block whatever the kernel). A list per group;
/// [`GroupIds::kernel`] holds them flat.
pub fn logical_to_kernel(groups: &[KvGroup], block_ids: &[Vec<u32>], ppl: u32) -> Vec<Vec<u64>> {
    GroupIds::kernel(groups, block_ids, ppl).iter().map(<[u64]>::to_vec).collect()
}

/// Decode's and prefill's block lists, one per group, to pair 1:1.
pub type PairedLists = (Vec<Vec<u64>>, Vec<Vec<u64>>);

/// Prefix-cache trimming (`_apply_prefix_caching`), after the ratio mapping. Returns the
/// (decode, prefill) lists to pair 1:1 per group.
pub fn apply_prefix_caching(
    groups: &[KvGroup],
    has_state: bool,
    decode: &[Vec<u64>],
    prefill: &[Vec<u64>],
    d_ppl: u32,
    p_ppl: u32,
) -> Result<PairedLists, HybridError> {
    list_counts(groups.len(), decode.len(), prefill.len())?;
    let mut d: Vec<Vec<u64>> = decode.to_vec();
    let mut p: Vec<Vec<u64>> = prefill.to_vec();
    for (i, g) in groups.iter().enumerate() {
        pair_group(i, g, has_state, (&mut d[i], &mut p[i]), d_ppl, p_ppl)?;
    }
    Ok((d, p))
}

/// One block list per group on each side, or the request's error.
pub fn list_counts(groups: usize, decode: usize, prefill: usize) -> Result<(), HybridError> {
    if decode != groups || prefill != groups {
        return Err(HybridError::request(
            Knob::Scenario,
            format!("{decode} decode and {prefill} prefill block lists for {groups} KV cache groups"),
        ));
    }
    Ok(())
}

/// How prefix-cache trimming cuts one group's lists: decode keeps its first `d_len` blocks,
/// prefill its `p_len` blocks from `p_front`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trim {
    pub d_len: usize,
    pub p_front: usize,
    pub p_len: usize,
}

impl Trim {
    /// Applies the trim to the group's (decode, prefill) lists in place.
    pub fn apply<T>(self, (d, p): (&mut Vec<T>, &mut Vec<T>)) {
        d.truncate(self.d_len);
        p.drain(..self.p_front.min(p.len()));
        p.truncate(self.p_len);
    }

    /// [`apply`](Self::apply) to group `g` of (decode, prefill) lists held flat.
    pub fn apply_group(self, g: usize, (d, p): (&mut GroupIds, &mut GroupIds)) {
        d.truncate(g, self.d_len);
        p.drop_front(g, self.p_front);
        p.truncate(g, self.p_len);
    }
}

/// [`apply_prefix_caching`] for group `i` alone, from its list lengths (`nd` decode, `np`
/// prefill blocks): how to trim them, or vLLM's assertion. Each group pairs on its own, so a
/// planner can pair a request's groups once and hand them to every READ that reads them.
pub fn group_trim(
    i: usize,
    g: &KvGroup,
    has_state: bool,
    (nd, np): (usize, usize),
    d_ppl: u32,
    p_ppl: u32,
) -> Result<Trim, HybridError> {
    // Keep the last `n` of prefill's blocks and decode's first `n`.
    let tail = |n: usize| Trim { d_len: n, p_front: np - n, p_len: n };
    if !has_state {
        // vLLM asserts decode never holds more blocks than prefill here.
        if nd > np {
            return Err(HybridError::request(
                Knob::Scenario,
                format!(
                    "group {i}: decode has {nd} blocks to fill but prefill sent {np} \
                     (vLLM asserts num_decode_blocks <= len(prefill_group))"
                ),
            ));
        }
        Ok(tail(nd))
    } else if g.kind.is_state() {
        if nd == np {
            return Ok(tail(nd));
        }
        if nd > np + 1 {
            return Err(HybridError::request(
                Knob::Scenario,
                format!("group {i}: unpairable SSM state slots, decode={nd} prefill={np}"),
            ));
        }
        Ok(tail(nd.min(np)))
    } else if d_ppl == p_ppl && nd < np {
        Ok(tail(nd))
    } else {
        let max_padding = (d_ppl + p_ppl) as usize;
        if nd.abs_diff(np) > max_padding {
            return Err(HybridError::request(
                Knob::Scenario,
                format!("group {i}: |{nd} - {np}| > {max_padding} blocks"),
            ));
        }
        let n = nd.min(np);
        Ok(Trim { d_len: n, p_front: 0, p_len: n })
    }
}

/// [`group_trim`] applied: trims group `i`'s (decode, prefill) lists in place.
pub fn pair_group(
    i: usize,
    g: &KvGroup,
    has_state: bool,
    (d, p): (&mut Vec<u64>, &mut Vec<u64>),
    d_ppl: u32,
    p_ppl: u32,
) -> Result<(), HybridError> {
    group_trim(i, g, has_state, (d.len(), p.len()), d_ppl, p_ppl)?.apply((d, p));
    Ok(())
}

/// A hybrid engine's requests as its block allocator sees them: per group, one block per
/// block position of the tokens it holds (flat: group after group), of which vLLM's lists keep
/// what each group needs (nulls outside a window and before the last state slot).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestShape {
    pub groups: Vec<KvGroup>,
    pub block_tokens: u32,
    pub has_state: bool,
}

impl RequestShape {
    pub fn of(geo: &super::geometry::EngineGeometry) -> Self {
        RequestShape {
            groups: geo.groups.clone(),
            block_tokens: geo.sizing.block_tokens,
            has_state: geo.has_state(),
        }
    }

    /// The request's token counts (with state, prefill computes all but the last token).
    pub fn tokens(&self, prompt_tokens: u32, d_hit_tokens: u32) -> TokenCounts {
        TokenCounts::new(self.has_state, prompt_tokens, d_hit_tokens)
    }

    fn sim(&self, prompt_tokens: u32, hit_blocks: u32) -> BlockSim {
        BlockSim {
            tokens: self.tokens(prompt_tokens, 0).p_computed_tokens,
            block_tokens: self.block_tokens,
            hit_blocks,
        }
    }

    /// The prompt behind a prefill engine's `remote_num_tokens` (the tokens it computed): one
    /// token more with state (the backoff); a one-token prompt, which backs off nothing, reads
    /// as two, which computes the same one token.
    pub fn prompt_of_computed(&self, computed: u32) -> u32 {
        computed.saturating_add(u32::from(self.has_state))
    }

    /// Block positions of the computed tokens (before any hit).
    pub fn positions(&self, prompt_tokens: u32) -> u32 {
        self.tokens(prompt_tokens, 0).p_computed_tokens.div_ceil(self.block_tokens.max(1))
    }

    /// Blocks to allocate for a request of `prompt_tokens` whose first `hit_blocks` are held.
    pub fn blocks(&self, prompt_tokens: u32, hit_blocks: u32) -> u32 {
        self.groups.len() as u32 * self.sim(prompt_tokens, hit_blocks).blocks_per_group()
    }

    /// The raw lists (vLLM's shape) of a flat allocation of [`blocks`](Self::blocks) ids.
    pub fn lists(&self, prompt_tokens: u32, hit_blocks: u32, flat: &[u32]) -> Option<Vec<Vec<u32>>> {
        self.sim(prompt_tokens, hit_blocks).lists_from_flat(&self.groups, flat)
    }

    /// The hit a flat allocation of `flat_len` ids implies for a prompt (every group holds
    /// the same number of positions).
    pub fn hit_blocks(&self, prompt_tokens: u32, flat_len: usize) -> Option<u32> {
        let per_group = u32::try_from(flat_len / self.groups.len().max(1)).ok()?;
        self.positions(prompt_tokens).checked_sub(per_group)
    }
}

/// Allocates raw block lists the way vLLM's allocator leaves them, for planning requests
/// that are not in an oracle file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BlockSim {
    /// Tokens in the request's blocks (prefill: what it computed).
    pub tokens: u32,
    pub block_tokens: u32,
    /// Leading blocks already held (decode's prefix hit); they are not in an unhashed list.
    pub hit_blocks: u32,
}

impl BlockSim {
    /// One list per group; ids are fresh from `next_id` upwards, 0 marks a block outside a
    /// sliding window or an earlier state slot.
    pub fn raw_block_ids(&self, groups: &[KvGroup], next_id: &mut u32) -> Vec<Vec<u32>> {
        let mut fresh = |_: usize| {
            let id = *next_id;
            *next_id += 1;
            id
        };
        self.lists(groups, &mut fresh)
    }

    /// Blocks an engine allocates per group for such a request: one per block position
    /// past the hit (a flat allocation holds this many for each group, group after group).
    pub fn blocks_per_group(&self) -> u32 {
        let n = self.tokens.div_ceil(self.block_tokens.max(1));
        n - self.hit_blocks.min(n)
    }

    /// [`raw_block_ids`](Self::raw_block_ids) from a flat allocation: group `g`'s block at
    /// list position `j` is `flat[g * m + j]` (`m` = [`blocks_per_group`](Self::blocks_per_group)),
    /// where vLLM's allocator holds a block there (positions it leaves null keep their id
    /// allocated but unused). `None` when `flat` is not `groups.len() * m` long.
    pub fn lists_from_flat(&self, groups: &[KvGroup], flat: &[u32]) -> Option<Vec<Vec<u32>>> {
        let m = self.blocks_per_group() as usize;
        if flat.len() != groups.len() * m {
            return None;
        }
        let out = groups
            .iter()
            .zip(flat.chunks(m.max(1)).chain(std::iter::repeat(&[][..])))
            .flat_map(|(g, ids)| self.lists(std::slice::from_ref(g), &mut |j| ids[j]))
            .collect();
        Some(out)
    }

    /// Each group's list; `id(j)` gives the block at list position `j` that is not null.
    fn lists(&self, groups: &[KvGroup], id: &mut dyn FnMut(usize) -> u32) -> Vec<Vec<u32>> {
        let n = self.tokens.div_ceil(self.block_tokens.max(1));
        let first = self.hit_blocks.min(n);
        let mut fresh = |b: u32| id((b - first) as usize);
        groups
            .iter()
            .map(|g| match g.kind {
                GroupKind::Full => (first..n).map(&mut fresh).collect(),
                GroupKind::SlidingWindow { window_tokens } => {
                    let skipped = (i64::from(self.tokens) - i64::from(window_tokens) + 1).max(0);
                    let skipped_blocks =
                        u32::try_from(skipped / i64::from(self.block_tokens.max(1))).unwrap_or(0);
                    (first..n).map(|b| if b < skipped_blocks { NULL_BLOCK } else { fresh(b) }).collect()
                }
                GroupKind::State(_) => {
                    (first..n).map(|b| if b + 1 == n { fresh(b) } else { NULL_BLOCK }).collect()
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layouts::hybrid::geometry::kv_groups;
    use crate::layouts::hybrid::preset;

    #[test]
    fn flat_group_ids_trim_as_the_lists_they_hold() {
        // Qwen3-Next: GDN state groups and one attention group; kernel blocks of 4 per block.
        let groups = kv_groups(&preset("qwen3-next-80b-a3b").expect("preset"));
        let ids: Vec<Vec<u32>> = (0..groups.len() as u32).map(|g| (10 * g..10 * g + 5).collect()).collect();
        let mut flat = GroupIds::kernel(&groups, &ids, 4);
        let mut lists = logical_to_kernel(&groups, &ids, 4);
        assert_eq!(flat.iter().map(<[u64]>::to_vec).collect::<Vec<_>>(), lists);
        let mut other = flat.clone();
        let mut other_lists = lists.clone();
        let trims = [
            Trim { d_len: 3, p_front: 1, p_len: 2 },
            Trim { d_len: 99, p_front: 99, p_len: 1 },
            Trim { d_len: 0, p_front: 0, p_len: 99 },
        ];
        for (g, trim) in (0..groups.len()).zip(trims.iter().cycle()) {
            trim.apply((&mut lists[g], &mut other_lists[g]));
            trim.apply_group(g, (&mut flat, &mut other));
            assert_eq!(&flat[g], &lists[g][..], "decode, group {g}, {trim:?}");
            assert_eq!(&other[g], &other_lists[g][..], "prefill, group {g}, {trim:?}");
        }
        // Serialised as the lists.
        assert_eq!(serde_json::to_string(&flat).expect("json"), serde_json::to_string(&lists).expect("json"));
        // Attention ids split by the ratio, state ids as they are.
        let split = GroupIds::kernel(&groups, &ids, 1).ratio_mapped(&groups, 2);
        for (g, group) in groups.iter().enumerate() {
            let want: Vec<u64> = if group.kind.is_state() {
                ids[g].iter().map(|&b| u64::from(b)).collect()
            } else {
                ids[g].iter().flat_map(|&b| [2 * u64::from(b), 2 * u64::from(b) + 1]).collect()
            };
            assert_eq!(&split[g], &want[..], "group {g}");
        }
    }

    #[test]
    fn window_keeps_cdiv_plus_one_and_state_its_last_slot() {
        let gpt = kv_groups(&preset("gpt-oss-120b").expect("preset"));
        assert_eq!(window_blocks(&gpt, 16), vec![9, 0]);
        let raw = vec![vec![0, 0, 0, 0, 20, 21, 22, 23, 24, 25, 26, 27, 28], (1..=13).collect()];
        let clipped = clip_for_exchange(&gpt, 16, &raw, true).expect("clip");
        assert_eq!(clipped[0], (20..=28).collect::<Vec<u32>>());
        assert_eq!(clipped[1].len(), 13);
        let q = kv_groups(&preset("qwen3-next-80b-a3b").expect("preset"));
        let raw = vec![vec![0, 0, 7]; 4];
        let clipped = clip_for_exchange(&q, 544, &raw, true).expect("clip");
        assert_eq!(clipped[0], vec![7]);
        assert_eq!(clipped[3], vec![0, 0, 7]);
        // Host-buffer saves do not strip the state (clip_ssm=False).
        assert_eq!(clip_for_exchange(&q, 544, &raw, false).expect("clip")[0], vec![0, 0, 7]);
    }

    #[test]
    fn backoff_only_with_state() {
        let t = TokenCounts::new(true, 2500, 0);
        assert_eq!((t.backoff_tokens, t.p_computed_tokens, t.d_external_tokens), (1, 2499, 2499));
        let t = TokenCounts::new(false, 200, 64);
        assert_eq!((t.backoff_tokens, t.p_computed_tokens, t.d_external_tokens), (0, 200, 136));
        // A 1-token prompt is computed whole; vLLM's backoff is still 1 (not applied).
        let t = TokenCounts::new(true, 1, 0);
        assert_eq!((t.backoff_tokens, t.p_computed_tokens, t.d_external_tokens), (1, 1, 1));
    }

    #[test]
    fn prefix_trimming_per_group() {
        let q = kv_groups(&preset("qwen3-next-80b-a3b").expect("preset"));
        let d = vec![vec![7], vec![8], vec![9], vec![3, 4]];
        let p = vec![vec![17], vec![18], vec![19], vec![11, 12, 13]];
        let (d2, p2) = apply_prefix_caching(&q, true, &d, &p, 1, 1).expect("trim");
        assert_eq!(d2, d);
        assert_eq!(p2[3], vec![12, 13]);
        // Decode one state slot longer: it keeps the first.
        let d = vec![vec![7, 70], vec![8], vec![9], vec![3]];
        let (d2, _) = apply_prefix_caching(&q, true, &d, &p, 1, 1).expect("trim");
        assert_eq!(d2[0], vec![7]);
    }

    #[test]
    fn simulated_lists_look_like_vllms() {
        let gpt = kv_groups(&preset("gpt-oss-120b").expect("preset"));
        let mut next = 1;
        let raw = BlockSim { tokens: 200, block_tokens: 16, hit_blocks: 0 }.raw_block_ids(&gpt, &mut next);
        assert_eq!(raw[0].iter().filter(|&&b| b == NULL_BLOCK).count(), 4);
        assert_eq!(raw[1].len(), 13);
        let n = kv_groups(&preset("nemotron-h-8b").expect("preset"));
        let raw = BlockSim { tokens: 2499, block_tokens: 1040, hit_blocks: 0 }.raw_block_ids(&n, &mut next);
        assert_eq!(raw[0].len(), 3);
        assert_eq!(raw[0][..2], [0, 0]);
    }
}
