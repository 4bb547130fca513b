//! The strided descriptor lists a rank registers (vLLM 0.33's `_build_fa_local`,
//! `_build_mamba_local`, `_build_fa_remote`, `_build_mamba_remote`): one attention row per
//! region at the remote block granularity, then per state region one row per conv part and
//! one for the SSM state; remote conv parts at `remote_conv_offsets` (which assume every part
//! is sharded like `x`), the SSM state at `conv_remote + local_offset * ssm_local`.

use std::fmt;

use serde::Serialize;

use super::geometry::{EngineGeometry, RegionMem, StatePart};

/// What a descriptor row reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum RowKind {
    /// A whole (kernel) attention page, or a head slice of it.
    AttnPage,
    /// A part of a state slot.
    State(StatePart),
}

/// A descriptor row's label as the oracle writes it: `attn_page:region0`,
/// `mamba_conv_x:region1`, `mamba_ssm:region0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct RowLabel {
    pub kind: RowKind,
    pub region: u32,
}

impl fmt::Display for RowLabel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            RowKind::AttnPage => write!(f, "attn_page:region{}", self.region),
            RowKind::State(p) => write!(f, "{}:region{}", p.label(), self.region),
        }
    }
}

/// One strided descriptor row (NIXL >= 1.5): `count` descriptors of `len` bytes, `stride`
/// apart from `addr_off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DescRow {
    pub label: RowLabel,
    pub addr_off: u64,
    pub len: u64,
    pub stride: u64,
    pub count: u64,
}

/// A prepared descriptor list: rows in id order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DescList {
    pub mem: RegionMem,
    pub rows: Vec<DescRow>,
    #[serde(skip)]
    pub(super) starts: Vec<u64>,
    /// Per row: every descriptor of the row lies in one registration of its memory.
    #[serde(skip)]
    pub(super) registered: Vec<bool>,
}

impl DescList {
    /// The rows of a list over `geo`'s memory.
    pub(super) fn new(geo: &EngineGeometry, rows: Vec<DescRow>) -> Self {
        let mem = geo.mem();
        let mut starts = Vec::with_capacity(rows.len());
        let mut n = 0;
        for r in &rows {
            starts.push(n);
            n += r.count;
        }
        // A strided row's first and last descriptor bound it: both in one registration puts
        // every descriptor inside it.
        let registered = rows
            .iter()
            .map(|r| {
                let mut near = 0;
                let last = r.addr_off.saturating_add(r.count.saturating_sub(1).saturating_mul(r.stride));
                let first = geo.registered_near(mem, r.addr_off, r.len, &mut near);
                let hint = near;
                first && geo.registered_near(mem, last, r.len, &mut near) && near == hint
            })
            .collect();
        DescList { mem, rows, starts, registered }
    }

    /// Descriptors in the list.
    pub fn len(&self) -> u64 {
        self.rows.iter().map(|r| r.count).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The row and address of descriptor `id`.
    pub fn resolve(&self, id: u64) -> Option<(RowLabel, u64, u64)> {
        let mut hint = 0;
        self.resolve_near(id, &mut hint)
    }

    /// The row holding every id from `lo` to `hi` (`lo <= hi`), with the id of its first
    /// descriptor, trying row `hint` first and leaving there the row that holds `lo`.
    pub(super) fn row_spanning(&self, lo: u64, hi: u64, hint: &mut usize) -> Option<(&DescRow, u64, bool)> {
        let holds = |i: usize| self.starts.get(i).is_some_and(|&s| s <= lo && lo - s < self.rows[i].count);
        // Runs mostly go row after row: the hint's row, then the next, then a search.
        if holds(*hint + 1) {
            *hint += 1;
        } else if !holds(*hint) {
            *hint = self.starts.partition_point(|&s| s <= lo).checked_sub(1)?;
        }
        let (row, start) = (&self.rows[*hint], self.starts[*hint]);
        (lo - start < row.count && hi - start < row.count).then_some((row, start, self.registered[*hint]))
    }

    /// The row holding descriptor `id`, and how far into the row `id` is.
    pub(super) fn row_of(&self, id: u64) -> RowAt {
        let i = self.starts.partition_point(|&s| s <= id).checked_sub(1)?;
        let k = id - self.starts[i];
        (k < self.rows[i].count).then_some((i, k))
    }

    /// [`resolve`](Self::resolve), trying row `hint` first and leaving the row found there:
    /// descriptor ids come row by row, so a plan's walk rarely searches.
    pub fn resolve_near(&self, id: u64, hint: &mut usize) -> Option<(RowLabel, u64, u64)> {
        let holds = |i: usize| self.starts.get(i).is_some_and(|&s| s <= id && id - s < self.rows[i].count);
        if !holds(*hint) {
            *hint = self.starts.partition_point(|&s| s <= id).checked_sub(1)?;
        }
        let row = &self.rows[*hint];
        let k = id - self.starts[*hint];
        (k < row.count).then(|| (row.label, row.addr_off + k * row.stride, row.len))
    }
}

/// vLLM's `_block_strided_descs`: `num_blocks` blocks split in `bsr` sub-blocks each.
pub(super) fn block_rows(
    label: RowLabel,
    base: u64,
    sub_len: u64,
    stride: u64,
    num_blocks: u64,
    bsr: u64,
) -> Vec<DescRow> {
    if bsr == 1 || stride == bsr * sub_len {
        vec![DescRow { label, addr_off: base, len: sub_len, stride: stride / bsr, count: num_blocks * bsr }]
    } else {
        (0..num_blocks)
            .map(|b| DescRow {
                label,
                addr_off: base + b * stride,
                len: sub_len,
                stride: sub_len,
                count: bsr,
            })
            .collect()
    }
}

/// Local rows of a decode rank at `bsr` sub-blocks per block: attention, then state.
pub(super) fn local_rows(d: &EngineGeometry, bsr: u64) -> Vec<DescRow> {
    let mut rows = Vec::new();
    for r in &d.regions {
        let label = RowLabel { kind: RowKind::AttnPage, region: r.index };
        rows.extend(block_rows(label, r.base_off, r.block_len / bsr, r.block_stride, r.num_blocks, bsr));
    }
    if let Some(s) = &d.state {
        let ppl = u64::from(d.physical_per_logical);
        for r in d.regions.iter().filter(|r| r.holds_state) {
            for part in &s.parts {
                rows.push(DescRow {
                    label: RowLabel { kind: RowKind::State(part.part), region: r.index },
                    addr_off: r.base_off + part.offset_bytes,
                    len: part.len_bytes,
                    stride: r.block_stride * ppl,
                    count: d.num_blocks(),
                });
            }
        }
    }
    rows
}

/// vLLM's `remote_conv_offsets`: where decode's slice of each conv part sits in a prefill
/// page, assuming every part is sharded like `x`.
pub(super) fn remote_conv_offsets(
    d_parts: &[(StatePart, u64)],
    local_offset: u64,
    ratio: i64,
) -> Vec<(StatePart, u64, u64)> {
    let mut out = Vec::new();
    let mut base = 0;
    for &(part, size) in d_parts {
        if ratio >= 1 {
            out.push((part, base + local_offset * size, size));
            base += size * ratio.unsigned_abs();
        } else {
            let s = size / ratio.unsigned_abs();
            out.push((part, base, s));
            base += s;
        }
    }
    out
}

/// Where prefill rank `source` holds `len` bytes of `part` from global byte `start` of the
/// model's part: (part, offset in the page, len), or `None` when it does not hold them all.
pub(super) fn held_at(
    ps: &super::geometry::StateLayout,
    part: StatePart,
    source: u32,
    start: u64,
    len: u64,
) -> Option<(StatePart, u64, u64)> {
    let pp = ps.part(part)?;
    let rel = start.checked_sub(pp.first_global_unit(source) * pp.unit_bytes)?;
    (rel + len <= pp.len_bytes).then_some((part, pp.offset_bytes + rel, len))
}

/// A row of a descriptor list and how far into it an id is: `(row, id - row start)`.
pub(super) type RowAt = Option<(usize, u64)>;
