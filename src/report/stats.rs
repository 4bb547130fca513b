//! Robust statistics over a handful of repeats: median, MAD, and the noise figures the gate
//! derives from them. Pure arithmetic; owns no policy (thresholds live in `gate/`).

/// Scales a MAD to a standard deviation for normally distributed data.
pub const MAD_TO_SD: f64 = 1.4826;

/// Standard error of the median over that of the mean for normal data (sqrt(pi/2)).
pub const MEDIAN_SE_FACTOR: f64 = 1.2533;

/// The median of the finite values, or `None` if there are none.
pub fn median(xs: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 })
}

/// The median absolute deviation from the median.
pub fn mad(xs: &[f64]) -> Option<f64> {
    let m = median(xs)?;
    let dev: Vec<f64> = xs.iter().filter(|x| x.is_finite()).map(|x| (x - m).abs()).collect();
    median(&dev)
}

/// Median and spread of one metric's samples.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Robust {
    pub n: usize,
    pub median: f64,
    pub mad: f64,
}

impl Robust {
    pub fn of(xs: &[f64]) -> Option<Robust> {
        let n = xs.iter().filter(|x| x.is_finite()).count();
        Some(Robust { n, median: median(xs)?, mad: mad(xs)? })
    }

    /// Run-to-run relative standard deviation estimated from the MAD (`None` from one sample,
    /// which shows no spread at all, or with a zero median).
    pub fn rel_sd(&self) -> Option<f64> {
        (self.n >= 2 && self.median != 0.0).then(|| MAD_TO_SD * self.mad / self.median.abs())
    }
}

/// Relative standard error of a median of `n` samples with relative run-to-run spread `rel_sd`.
///
/// One sample's error is the spread itself; from two on, the median's error shrinks as
/// `1.2533 * sd / sqrt(n)` (asymptotic, a fair guide from n = 3).
pub fn rel_se_of_median(rel_sd: f64, n: usize) -> f64 {
    match n {
        0 => f64::INFINITY,
        1 => rel_sd,
        n => MEDIAN_SE_FACTOR * rel_sd / (n as f64).sqrt(),
    }
}

/// Geometric mean of positive finite values.
pub fn geomean(xs: &[f64]) -> Option<f64> {
    let v: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite() && *x > 0.0).collect();
    if v.is_empty() || v.len() != xs.len() {
        return None;
    }
    Some((v.iter().map(|x| x.ln()).sum::<f64>() / v.len() as f64).exp())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_mad() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[f64::NAN, 1.0]), Some(1.0));
        assert_eq!(mad(&[1.0, 2.0, 3.0, 4.0, 100.0]), Some(1.0));
        let r = Robust::of(&[10.0, 10.0, 10.0, 12.0, 8.0]).expect("robust");
        assert_eq!((r.n, r.median, r.mad), (5, 10.0, 0.0));
        assert_eq!(Robust::of(&[5.0]).expect("one").rel_sd(), None);
    }

    #[test]
    fn a_wild_repeat_does_not_move_the_median() {
        let calm = Robust::of(&[100.0, 101.0, 99.0, 100.5, 99.5]).expect("calm");
        let wild = Robust::of(&[100.0, 101.0, 99.0, 100.5, 40.0]).expect("wild");
        assert!((calm.median - wild.median).abs() <= 0.5);
        assert!(wild.rel_sd().expect("sd") < 0.02);
    }

    #[test]
    fn standard_error_shrinks_with_repeats() {
        assert_eq!(rel_se_of_median(0.1, 1), 0.1);
        assert!((rel_se_of_median(0.1, 4) - 0.062665).abs() < 1e-6);
        assert!(rel_se_of_median(0.1, 0).is_infinite());
    }

    #[test]
    fn geomean_needs_all_positive() {
        assert!((geomean(&[2.0, 8.0]).expect("g") - 4.0).abs() < 1e-12);
        assert_eq!(geomean(&[2.0, 0.0]), None);
        assert_eq!(geomean(&[]), None);
    }
}
