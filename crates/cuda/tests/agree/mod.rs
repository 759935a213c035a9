//! Agreement of two sets of logits rows (teacher-forced): top-1, KL, and top-1 on the rows where
//! the reference's choice is decisive. Shared by tests/model_agree.rs and examples/cuda_trace.rs.

/// Random-weight models give nearly flat distributions whose top two tokens often differ by less
/// than the CPU's own activation quantization moves them; top-1 agreement is asserted on the rows
/// where the reference's choice is decisive, and reported on all rows.
pub const DECISIVE: f64 = 0.1;

fn softmax(l: &[f32]) -> Vec<f64> {
    let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = l.iter().map(|&v| (v as f64 - m).exp()).collect();
    let z: f64 = e.iter().sum();
    e.into_iter().map(|v| v / z).collect()
}

/// Index of the largest value (the first of equals).
pub fn argmax(l: &[f32]) -> usize {
    let mut b = 0;
    for (i, &v) in l.iter().enumerate() {
        if v > l[b] {
            b = i;
        }
    }
    b
}

/// Running agreement figures.
#[derive(Default, Clone, Copy, Debug)]
pub struct Agree {
    pub rows: usize,
    pub top1: usize,
    /// Rows whose reference top-1 logit leads its runner-up by at least `DECISIVE`, and how
    /// many of those the other side picks the same token for.
    pub decisive: usize,
    pub decisive_top1: usize,
    pub kl: f64,
    pub max_kl: f64,
    /// Sum over rows of the RMS logit difference.
    pub rms: f64,
}

impl Agree {
    /// Add one row: `c` the reference, `g` the other side.
    pub fn add(&mut self, c: &[f32], g: &[f32]) {
        assert!(g.iter().all(|v| v.is_finite()), "non-finite logits");
        let (p, q) = (softmax(c), softmax(g));
        let kl: f64 = p
            .iter()
            .zip(&q)
            .filter(|(&a, _)| a > 0.0)
            .map(|(&a, &b)| a * (a.ln() - b.max(1e-300).ln()))
            .sum();
        self.rows += 1;
        let ac = argmax(c);
        let same = ac == argmax(g);
        self.top1 += same as usize;
        let top = c[ac];
        let second = c
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != ac)
            .map(|(_, &v)| v)
            .fold(f32::NEG_INFINITY, f32::max);
        if (top - second) as f64 >= DECISIVE {
            self.decisive += 1;
            self.decisive_top1 += same as usize;
        }
        self.kl += kl;
        self.max_kl = self.max_kl.max(kl);
        let d2: f64 = c
            .iter()
            .zip(g)
            .map(|(&a, &b)| ((a - b) as f64).powi(2))
            .sum();
        self.rms += (d2 / c.len().max(1) as f64).sqrt();
    }

    /// Top-1 agreement over all rows.
    pub fn top1_rate(&self) -> f64 {
        self.top1 as f64 / self.rows.max(1) as f64
    }

    /// Top-1 agreement over the decisive rows.
    pub fn decisive_rate(&self) -> f64 {
        self.decisive_top1 as f64 / self.decisive.max(1) as f64
    }

    /// Mean KL(reference || other).
    pub fn mean_kl(&self) -> f64 {
        self.kl / self.rows.max(1) as f64
    }

    /// One line: rows, top-1, decisive top-1, mean and max KL, mean RMS logit difference.
    pub fn line(&self) -> String {
        format!(
            "{} rows, top-1 {:.4}, decisive top-1 {:.4} ({} rows), mean KL {:.2e}, max KL {:.2e}, rms logit diff {:.3e}",
            self.rows,
            self.top1_rate(),
            self.decisive_rate(),
            self.decisive,
            self.mean_kl(),
            self.max_kl,
            self.rms / self.rows.max(1) as f64
        )
    }
}
