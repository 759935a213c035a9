//! Summaries of repeated measurements: a median with its spread.

use serde::Serialize;

/// Summary of samples of one quantity. The spread shown in tables is half the interquartile
/// range (`(p75 - p25) / 2`): robust to the odd slow run, unlike the standard deviation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Stat {
    pub n: usize,
    pub median: f64,
    pub p25: f64,
    pub p75: f64,
    pub min: f64,
    pub max: f64,
}

impl Stat {
    /// Summary of `samples`; `None` when there are none or one is not finite.
    pub fn of(samples: &[f64]) -> Option<Stat> {
        if samples.is_empty() || samples.iter().any(|v| !v.is_finite()) {
            return None;
        }
        let mut s = samples.to_vec();
        s.sort_by(f64::total_cmp);
        Some(Stat {
            n: s.len(),
            median: percentile(&s, 50.0),
            p25: percentile(&s, 25.0),
            p75: percentile(&s, 75.0),
            min: s[0],
            max: s[s.len() - 1],
        })
    }

    /// Half the interquartile range.
    pub fn spread(&self) -> f64 {
        (self.p75 - self.p25) / 2.0
    }

    /// `median ±spread` with `decimals` digits.
    pub fn show(&self, decimals: usize) -> String {
        format!("{:.d$} ±{:.d$}", self.median, self.spread(), d = decimals)
    }
}

/// The `q`-th percentile (0..=100) of `sorted` (ascending), linearly interpolated between the
/// closest ranks (numpy's default). `sorted` must not be empty.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.len() == 1 {
        return sorted[0];
    }
    let pos = (q.clamp(0.0, 100.0) / 100.0) * (sorted.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    let frac = pos - lo as f64;
    sorted[lo] + (sorted[hi] - sorted[lo]) * frac
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Against a direct evaluation of numpy's definition (rank `q/100 * (n-1)`, interpolated) on
    /// random samples, and the order-independence of the summary.
    #[test]
    fn percentiles_follow_linear_interpolation() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for n in [1usize, 2, 5, 20, 101] {
            let v: Vec<f64> = (0..n).map(|_| rng.gen_range(0.0..100.0)).collect();
            let mut s = v.clone();
            s.sort_by(f64::total_cmp);
            for q in [0.0, 25.0, 50.0, 95.0, 99.0, 100.0] {
                let r = q / 100.0 * (n as f64 - 1.0);
                let (i, f) = (r.floor() as usize, r.fract());
                let want = if i + 1 < n {
                    s[i] * (1.0 - f) + s[i + 1] * f
                } else {
                    s[i]
                };
                assert!((percentile(&s, q) - want).abs() < 1e-9, "n {n} q {q}");
            }
            let st = Stat::of(&v).unwrap();
            let mut rev = v.clone();
            rev.reverse();
            assert_eq!(Stat::of(&rev).unwrap(), st);
            assert!(st.min <= st.p25 && st.p25 <= st.median && st.median <= st.p75);
            assert!(st.p75 <= st.max);
        }
        assert!(Stat::of(&[]).is_none());
        assert!(Stat::of(&[1.0, f64::NAN]).is_none());
    }
}
