//! A transfer-time model fitted from measurements, and what it predicts for a plan.
//!
//! One posting rank's transfer of one request takes
//!
//! ```text
//! fixed_ns + descriptors * ns_per_descriptor(k) + calls * ns_per_call + bytes / gbps(k)
//! ```
//!
//! where `k` is how many ranks post at once on the host (each decode rank of a pull, each
//! prefill rank of a push): several readers share the host's cores and memory, so the cost
//! per descriptor and the byte rate are measured at several `k` (`concurrency`) and taken
//! between them. A request's span is its slowest posting rank. The term that contributes most
//! is the one that *bounds* the request: `posting` (fewer descriptors help), `bytes` (only a
//! faster link helps) or `fixed`.
//!
//! Every figure is fitted by `kvx calibrate` from `kvx xfer` sweeps over sizes and depths
//! ([`fit_batches`], [`fit_rates`]); none is typed in. A prediction whose descriptor size or
//! reader count lies outside what the sweep measured says so ([`RankPrediction::extrapolated`]).
//!
//! Owns: the model's arithmetic and its least-squares fit. Pure: no I/O.

use serde::{Deserialize, Serialize};

/// The version of the rates file `kvx calibrate` writes (`kvx_rates_version`); a file of
/// another version is refused by name.
pub const RATES_VERSION: u64 = 1;

/// A fitted transfer-time model of one transport on one memory kind.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransferModel {
    /// Fixed cost per request and posting rank (the intercept: completion wait, wake-up).
    pub fixed_ns: f64,
    /// Posting cost of one descriptor with one reader on the host.
    pub ns_per_descriptor: f64,
    /// Fixed cost per batched call (0 where every descriptor is its own call).
    pub ns_per_call: f64,
    /// Byte rate of one reader alone, GB/s (1e9 B/s).
    pub gbps: f64,
    /// The fastest rate any measured point reached, GB/s: the ceiling.
    pub ceiling_gbps: f64,
    /// Cost per descriptor and byte rate measured with several readers at once (the first
    /// entry is one reader, the figures above).
    pub concurrency: Vec<ReadersRate>,
    /// What the sweep measured: predictions outside it are extrapolated.
    pub fitted: FittedRange,
}

/// Per-descriptor cost and byte rate of each reader when `readers` read at once on one host.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ReadersRate {
    pub readers: u32,
    pub ns_per_descriptor: f64,
    pub gbps: f64,
}

/// The range a model was fitted over.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FittedRange {
    pub min_descriptor_bytes: u64,
    pub max_descriptor_bytes: u64,
    pub max_readers: u32,
}

/// The term of the model that contributes most to a prediction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Term {
    Fixed,
    Posting,
    Bytes,
}

impl Term {
    pub fn as_str(self) -> &'static str {
        match self {
            Term::Fixed => "fixed",
            Term::Posting => "posting",
            Term::Bytes => "bytes",
        }
    }
}

/// What one posting rank moves for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RankLoad {
    pub rank: u32,
    pub descriptors: u64,
    pub calls: u64,
    pub bytes: u64,
}

/// The predicted transfer of one posting rank.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RankPrediction {
    pub rank: u32,
    pub descriptors: u64,
    pub bytes: u64,
    pub fixed_ns: f64,
    pub post_ns: f64,
    pub bytes_ns: f64,
    pub total_ns: f64,
    pub bound: Term,
    /// Why the prediction lies outside the fitted range; empty inside it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub extrapolated: Vec<String>,
}

/// The predicted transfer of one request: its posting ranks, and the span (the slowest).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestPrediction {
    /// Ranks posting at once on the host.
    pub readers: u32,
    pub ranks: Vec<RankPrediction>,
    pub span_ns: f64,
    /// The slowest rank's bounding term.
    pub bound: Term,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub extrapolated: Vec<String>,
}

impl TransferModel {
    /// Cost per descriptor and byte rate with `readers` at once, and whether that count lies
    /// beyond what was measured. Between two measured counts the time per descriptor and per
    /// byte are interpolated linearly; beyond the last, extended along the last two.
    pub fn at_readers(&self, readers: u32) -> (f64, f64, bool) {
        let base = ReadersRate { readers: 1, ns_per_descriptor: self.ns_per_descriptor, gbps: self.gbps };
        let mut pts: Vec<ReadersRate> = std::iter::once(base)
            .chain(self.concurrency.iter().copied().filter(|r| r.readers > 1 && r.gbps > 0.0))
            .collect();
        pts.sort_by_key(|r| r.readers);
        pts.dedup_by_key(|r| r.readers);
        let k = f64::from(readers.max(1));
        let per_byte = |r: &ReadersRate| 1.0 / r.gbps;
        let lerp = |a: &ReadersRate, b: &ReadersRate| {
            let t = (k - f64::from(a.readers)) / f64::from(b.readers - a.readers).max(1.0);
            let ns = a.ns_per_descriptor + t * (b.ns_per_descriptor - a.ns_per_descriptor);
            let pb = per_byte(a) + t * (per_byte(b) - per_byte(a));
            (ns.max(0.0), if pb > 0.0 { 1.0 / pb } else { a.gbps })
        };
        if let Some(hit) = pts.iter().find(|r| f64::from(r.readers) == k) {
            return (hit.ns_per_descriptor, hit.gbps, false);
        }
        if let Some(w) = pts.windows(2).find(|w| f64::from(w[0].readers) < k && k < f64::from(w[1].readers)) {
            let (ns, g) = lerp(&w[0], &w[1]);
            return (ns, g, false);
        }
        match pts.as_slice() {
            [.., a, b] => {
                let (ns, g) = lerp(a, b);
                (ns, g, true)
            }
            [one] => (one.ns_per_descriptor, one.gbps, readers > one.readers),
            [] => (self.ns_per_descriptor, self.gbps, true),
        }
    }

    /// One posting rank's transfer with `readers` posting at once.
    pub fn predict_rank(&self, load: &RankLoad, readers: u32) -> RankPrediction {
        let (ns_desc, gbps, beyond) = self.at_readers(readers);
        let mut extrapolated = Vec::new();
        if beyond || readers > self.fitted.max_readers {
            extrapolated.push(format!("{readers} ranks at once (fitted up to {})", self.fitted.max_readers));
        }
        if let Some(size) = load.bytes.checked_div(load.descriptors) {
            let (lo, hi) = (self.fitted.min_descriptor_bytes, self.fitted.max_descriptor_bytes);
            if size < lo || size > hi {
                extrapolated.push(format!("{size} B per descriptor (fitted {lo}..{hi} B)"));
            }
        }
        let nothing = load.descriptors == 0 && load.bytes == 0;
        let fixed_ns = if nothing { 0.0 } else { self.fixed_ns };
        let post_ns = load.descriptors as f64 * ns_desc + load.calls as f64 * self.ns_per_call;
        // 1 GB/s is one byte per nanosecond.
        let bytes_ns = if gbps > 0.0 { load.bytes as f64 / gbps } else { 0.0 };
        let bound = if bytes_ns >= post_ns && bytes_ns >= fixed_ns {
            Term::Bytes
        } else if post_ns >= fixed_ns {
            Term::Posting
        } else {
            Term::Fixed
        };
        RankPrediction {
            rank: load.rank,
            descriptors: load.descriptors,
            bytes: load.bytes,
            fixed_ns,
            post_ns,
            bytes_ns,
            total_ns: fixed_ns + post_ns + bytes_ns,
            bound,
            extrapolated,
        }
    }

    /// A request: every posting rank at once (`readers` = how many post together on the host).
    pub fn predict_request(&self, loads: &[RankLoad], readers: u32) -> RequestPrediction {
        let ranks: Vec<RankPrediction> = loads.iter().map(|l| self.predict_rank(l, readers)).collect();
        let slowest = ranks.iter().max_by(|a, b| a.total_ns.total_cmp(&b.total_ns));
        let mut extrapolated: Vec<String> = ranks.iter().flat_map(|r| r.extrapolated.clone()).collect();
        extrapolated.sort();
        extrapolated.dedup();
        RequestPrediction {
            readers,
            span_ns: slowest.map_or(0.0, |r| r.total_ns),
            bound: slowest.map_or(Term::Fixed, |r| r.bound),
            ranks,
            extrapolated,
        }
    }
}

/// One measured case of a `kvx xfer` sweep: batches of `inflight` reads of `size_bytes` each,
/// one batch every `batch_ns` (posting to the last completion).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct XferPoint {
    pub size_bytes: u64,
    pub inflight: u64,
    pub batch_ns: f64,
    /// How many ran at once (1: alone).
    #[serde(default = "one")]
    pub readers: u32,
}

fn one() -> u32 {
    1
}

/// Least squares of `y ~ x . beta`, each row weighted by `1 / y` (relative error, so a 4 KiB
/// batch counts as much as a 4 MiB one). `None` when the system is singular.
fn least_squares<const N: usize>(rows: &[([f64; N], f64)]) -> Option<[f64; N]> {
    let mut a = [[0.0f64; N]; N];
    let mut b = [0.0f64; N];
    for (x, y) in rows.iter().filter(|(_, y)| *y > 0.0) {
        let w = 1.0 / (y * y);
        for i in 0..N {
            for j in 0..N {
                a[i][j] += w * x[i] * x[j];
            }
            b[i] += w * x[i] * y;
        }
    }
    // Gaussian elimination with partial pivoting.
    for col in 0..N {
        let pivot = (col..N).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-300 {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        let pivot_row = a[col];
        for row in col + 1..N {
            let f = a[row][col] / pivot_row[col];
            for (v, p) in a[row].iter_mut().zip(pivot_row.iter()).skip(col) {
                *v -= f * p;
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = [0.0f64; N];
    for row in (0..N).rev() {
        let s: f64 = (row + 1..N).map(|k| a[row][k] * x[k]).sum();
        x[row] = (b[row] - s) / a[row][row];
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

/// The single-reader terms fitted from a sweep, each batch's time being fixed, plus inflight
/// times the cost per descriptor, plus inflight times size over the rate. A negative fixed or
/// per-descriptor term is pinned at 0 and the rest refitted.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct BatchFit {
    pub fixed_ns: f64,
    pub ns_per_descriptor: f64,
    pub gbps: f64,
    /// The worst relative miss of the fit over its points.
    pub max_rel_error: f64,
}

pub fn fit_batches(points: &[XferPoint]) -> Result<BatchFit, String> {
    let pts: Vec<&XferPoint> = points.iter().filter(|p| p.batch_ns > 0.0 && p.inflight > 0).collect();
    if pts.len() < 3 {
        return Err(format!("{} usable points; the fit needs at least 3", pts.len()));
    }
    let row = |p: &XferPoint| (p.inflight as f64, p.inflight as f64 * p.size_bytes as f64);
    let full: Vec<([f64; 3], f64)> = pts
        .iter()
        .map(|p| {
            let (d, db) = row(p);
            ([1.0, d, db], p.batch_ns)
        })
        .collect();
    let mut beta =
        least_squares(&full).ok_or("the sweep's points do not determine the fit (vary sizes and depths)")?;
    if beta[0] < 0.0 || beta[1] < 0.0 {
        // Refit with the negative term pinned at zero.
        let keep_fixed = beta[0] >= 0.0;
        let two: Vec<([f64; 2], f64)> = pts
            .iter()
            .map(|p| {
                let (d, db) = row(p);
                ([if keep_fixed { 1.0 } else { d }, db], p.batch_ns)
            })
            .collect();
        let b2 = least_squares(&two).ok_or("the sweep's points do not determine the fit")?;
        beta = if keep_fixed { [b2[0].max(0.0), 0.0, b2[1]] } else { [0.0, b2[0].max(0.0), b2[1]] };
    }
    if beta[2] <= 0.0 {
        return Err("the fitted byte rate is not positive (sweep larger sizes)".into());
    }
    let predict = |p: &XferPoint| {
        let (d, db) = row(p);
        beta[0] + beta[1] * d + beta[2] * db
    };
    let max_rel_error = pts.iter().map(|p| (predict(p) - p.batch_ns).abs() / p.batch_ns).fold(0.0, f64::max);
    Ok(BatchFit { fixed_ns: beta[0], ns_per_descriptor: beta[1], gbps: 1.0 / beta[2], max_rel_error })
}

/// One point per case (size, depth, readers): the median batch time of every round's points
/// of that case (the upper middle of an even count), in the order the cases first appear.
pub fn median_points(rounds: impl IntoIterator<Item = Vec<XferPoint>>) -> Vec<XferPoint> {
    let mut cases: Vec<(XferPoint, Vec<f64>)> = Vec::new();
    for p in rounds.into_iter().flatten() {
        let key = |q: &XferPoint| (q.size_bytes, q.inflight, q.readers);
        match cases.iter_mut().find(|(c, _)| key(c) == key(&p)) {
            Some((_, times)) => times.push(p.batch_ns),
            None => cases.push((p, vec![p.batch_ns])),
        }
    }
    cases
        .into_iter()
        .map(|(mut p, mut times)| {
            times.sort_by(f64::total_cmp);
            p.batch_ns = times[times.len() / 2];
            p
        })
        .collect()
}

/// The cost per descriptor and byte rate with several readers at once, from points measured
/// with that many (each reader's own batches), the fixed term taken from the single-reader fit.
pub fn fit_rates(points: &[XferPoint], fixed_ns: f64) -> Result<(f64, f64), String> {
    let rows: Vec<([f64; 2], f64)> = points
        .iter()
        .filter(|p| p.batch_ns > fixed_ns && p.inflight > 0)
        .map(|p| {
            let d = p.inflight as f64;
            ([d, d * p.size_bytes as f64], p.batch_ns - fixed_ns)
        })
        .collect();
    if rows.len() < 2 {
        return Err("fewer than 2 usable points".into());
    }
    let b = least_squares(&rows).ok_or("the points do not determine the fit (two sizes at least)")?;
    if b[1] <= 0.0 {
        return Err("the fitted byte rate is not positive".into());
    }
    Ok((b[0].max(0.0), 1.0 / b[1]))
}

/// One term of two fits of the same path compared.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TermChange {
    pub term: String,
    pub before: f64,
    pub after: f64,
    /// `(after - before) / before`, in percent.
    pub change_pct: f64,
    /// Moved by [`UNSTABLE_PCT`] or more.
    pub unstable: bool,
}

/// A term that moves by this much between two fits on one host is unstable there.
pub const UNSTABLE_PCT: f64 = 10.0;

/// Every term of `after` beside the same term of `before` (the concurrency entries of reader
/// counts both measured).
pub fn compare_models(before: &TransferModel, after: &TransferModel) -> Vec<TermChange> {
    let mut terms: Vec<(String, f64, f64)> = vec![
        ("fixed_ns".into(), before.fixed_ns, after.fixed_ns),
        ("ns_per_descriptor".into(), before.ns_per_descriptor, after.ns_per_descriptor),
        ("ns_per_call".into(), before.ns_per_call, after.ns_per_call),
        ("gbps".into(), before.gbps, after.gbps),
    ];
    for a in after.concurrency.iter().filter(|a| a.readers > 1) {
        if let Some(b) = before.concurrency.iter().find(|b| b.readers == a.readers) {
            terms.push((
                format!("concurrency[readers={}].ns_per_descriptor", a.readers),
                b.ns_per_descriptor,
                a.ns_per_descriptor,
            ));
            terms.push((format!("concurrency[readers={}].gbps", a.readers), b.gbps, a.gbps));
        }
    }
    terms
        .into_iter()
        .filter(|(_, b, a)| *b != 0.0 || *a != 0.0)
        .map(|(term, before, after)| {
            let change_pct = if before != 0.0 { 100.0 * (after - before) / before } else { f64::INFINITY };
            TermChange { term, before, after, change_pct, unstable: change_pct.abs() >= UNSTABLE_PCT }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_case_keeps_the_median_of_its_rounds() {
        let pt = |size_bytes, batch_ns, readers| XferPoint { size_bytes, inflight: 1, batch_ns, readers };
        let rounds = vec![
            vec![pt(4096, 10.0, 1), pt(65536, 100.0, 1), pt(4096, 30.0, 2)],
            vec![pt(4096, 50.0, 1), pt(65536, 90.0, 1), pt(4096, 20.0, 2)],
            vec![pt(4096, 11.0, 1), pt(65536, 400.0, 1)],
        ];
        let got = median_points(rounds);
        // One round slowed by a neighbour (50 ns, 400 ns) moves no case; two points: the upper.
        assert_eq!(got, vec![pt(4096, 11.0, 1), pt(65536, 100.0, 1), pt(4096, 30.0, 2)]);
    }

    fn model() -> TransferModel {
        TransferModel {
            fixed_ns: 2_000.0,
            ns_per_descriptor: 500.0,
            ns_per_call: 0.0,
            gbps: 5.0,
            ceiling_gbps: 5.0,
            concurrency: vec![ReadersRate { readers: 2, ns_per_descriptor: 600.0, gbps: 2.5 }],
            fitted: FittedRange { min_descriptor_bytes: 4096, max_descriptor_bytes: 4 << 20, max_readers: 2 },
        }
    }

    #[test]
    fn a_fit_recovers_the_terms_it_was_made_from() {
        let (fixed, per, gbps) = (1_500.0, 420.0, 4.8);
        let pts: Vec<XferPoint> = [4096u64, 65536, 1 << 20]
            .iter()
            .flat_map(|&s| {
                [1u64, 16, 64].map(move |d| XferPoint {
                    size_bytes: s,
                    inflight: d,
                    batch_ns: fixed + d as f64 * (per + s as f64 / gbps),
                    readers: 1,
                })
            })
            .collect();
        let f = fit_batches(&pts).expect("fit");
        assert!((f.fixed_ns - fixed).abs() < 1e-3, "{f:?}");
        assert!((f.ns_per_descriptor - per).abs() < 1e-6, "{f:?}");
        assert!((f.gbps - gbps).abs() < 1e-9, "{f:?}");
        assert!(f.max_rel_error < 1e-9);
        let (p2, g2) = fit_rates(&pts, fixed).expect("rates");
        assert!((p2 - per).abs() < 1e-6 && (g2 - gbps).abs() < 1e-9);
        assert!(fit_batches(&pts[..2]).is_err());
    }

    #[test]
    fn a_negative_intercept_is_pinned_at_zero() {
        let pts: Vec<XferPoint> = [(4096, 1, 900.0), (4096, 64, 60_000.0), (1 << 20, 64, 14_000_000.0)]
            .iter()
            .map(|&(s, d, t)| XferPoint { size_bytes: s, inflight: d, batch_ns: t, readers: 1 })
            .collect();
        let f = fit_batches(&pts).expect("fit");
        assert!(f.fixed_ns >= 0.0 && f.ns_per_descriptor >= 0.0 && f.gbps > 0.0, "{f:?}");
    }

    #[test]
    fn a_rank_is_the_sum_of_its_terms_and_names_the_largest() {
        let m = model();
        let big = m.predict_rank(&RankLoad { rank: 0, descriptors: 100, calls: 100, bytes: 100 << 20 }, 1);
        assert!((big.post_ns - 50_000.0).abs() < 1e-6);
        assert!((big.bytes_ns - (100u64 << 20) as f64 / 5.0).abs() < 1e-6);
        assert!((big.total_ns - (2_000.0 + big.post_ns + big.bytes_ns)).abs() < 1e-6);
        assert_eq!(big.bound, Term::Bytes);
        assert!(big.extrapolated.is_empty(), "{:?}", big.extrapolated);
        let small =
            m.predict_rank(&RankLoad { rank: 1, descriptors: 1000, calls: 1000, bytes: 1000 * 512 }, 1);
        assert_eq!(small.bound, Term::Posting);
        assert!(small.extrapolated[0].contains("512 B per descriptor"), "{:?}", small.extrapolated);
        let tiny = m.predict_rank(&RankLoad { rank: 2, descriptors: 1, calls: 1, bytes: 4096 }, 1);
        assert_eq!(tiny.bound, Term::Fixed);
        let none = m.predict_rank(&RankLoad::default(), 1);
        assert_eq!(none.total_ns, 0.0);
    }

    #[test]
    fn readers_slow_each_rank_and_beyond_the_fit_is_extrapolated() {
        let m = model();
        assert_eq!(m.at_readers(1), (500.0, 5.0, false));
        assert_eq!(m.at_readers(2), (600.0, 2.5, false));
        let (ns, g, beyond) = m.at_readers(4);
        assert!(beyond && ns > 600.0 && g < 2.5, "{ns} {g}");
        // Time per byte grows linearly: 0.2, 0.4, then 0.8 ns/B at 4.
        assert!((1.0 / g - 0.8).abs() < 1e-9);
        let loads = [
            RankLoad { rank: 0, descriptors: 10, calls: 10, bytes: 10 << 20 },
            RankLoad { rank: 1, descriptors: 10, calls: 10, bytes: 20 << 20 },
        ];
        let r = m.predict_request(&loads, 2);
        assert_eq!(r.span_ns, r.ranks[1].total_ns);
        assert!(r.extrapolated.is_empty());
        let r4 = m.predict_request(&loads, 4);
        assert!(r4.span_ns > r.span_ns);
        assert!(r4.extrapolated.iter().any(|e| e.contains("4 ranks at once")), "{:?}", r4.extrapolated);
    }

    #[test]
    fn two_fits_compare_term_by_term() {
        let a = model();
        let mut b = model();
        b.gbps = 5.2;
        b.fixed_ns = 3_000.0;
        let c = compare_models(&a, &b);
        let get = |t: &str| c.iter().find(|x| x.term == t).expect(t);
        assert!(!get("gbps").unstable && (get("gbps").change_pct - 4.0).abs() < 1e-9);
        assert!(get("fixed_ns").unstable);
        assert!(c.iter().all(|x| x.term != "ns_per_call"), "both zero: left out");
        assert!(c.iter().any(|x| x.term == "concurrency[readers=2].gbps"));
    }
}
