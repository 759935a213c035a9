//! Rotary position embedding as llama.cpp's CPU backend computes it: the CPU engine's RoPE and
//! the angle tables of the GPU's exact mode.

use crate::RopeStyle;

/// Rotary position embedding for one model.
///
/// Angles follow ggml's recurrence (`theta_i = pos * scale^i`, computed by repeated f32
/// multiplication, then `* freq_scale / factor_i`) rather than a fresh `powf` per pair: the few
/// ulps this differs by are enough to move logits measurably after 30 layers, and llama.cpp is the
/// reference our tests hold us to.
#[derive(Clone, Debug)]
pub struct Rope {
    theta_scale: f32,
    freq_scale: f32,
    /// Llama 3 frequency factors (`rope_freqs.weight`), one per pair, or empty.
    factors: Vec<f32>,
    style: RopeStyle,
    n_rot: usize,
}

impl Rope {
    /// RoPE over the first `n_rot` dimensions of each head.
    pub fn new(
        n_rot: usize,
        base: f32,
        freq_scale: f32,
        factors: Option<&[f32]>,
        style: RopeStyle,
    ) -> Rope {
        Rope {
            theta_scale: base.powf(-2.0 / n_rot as f32),
            freq_scale,
            factors: factors.map(<[f32]>::to_vec).unwrap_or_default(),
            style,
            n_rot,
        }
    }

    /// `(cos, sin)` of every pair's angle at `pos`, into `out` (`n_rot / 2` entries).
    pub fn angles(&self, pos: usize, out: &mut Vec<(f32, f32)>) {
        out.clear();
        let mut theta = pos as f32;
        for i in 0..self.n_rot / 2 {
            let ff = self
                .factors
                .get(i)
                .copied()
                .filter(|&f| f != 0.0)
                .unwrap_or(1.0);
            let t = self.freq_scale * (theta / ff);
            out.push((t.cos(), t.sin()));
            theta *= self.theta_scale;
        }
    }

    /// Rotate one head vector `x` (len >= n_rot) in place with angles from [`Rope::angles`].
    pub fn apply_with(&self, x: &mut [f32], cs: &[(f32, f32)]) {
        // Without the `fma` target feature each `mul_add` below is a call into libm (a
        // visible share of a batched step); with it, one instruction. Both round once.
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has FMA (checked above).
            unsafe { self.apply_fma(x, cs) };
            return;
        }
        self.apply_plain(x, cs);
    }

    /// [`Rope::apply_with`] compiled with FMA instructions.
    ///
    /// # Safety
    /// The CPU has FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "fma")]
    unsafe fn apply_fma(&self, x: &mut [f32], cs: &[(f32, f32)]) {
        self.apply_plain(x, cs);
    }

    /// The rotation itself (the reference: portable `mul_add`).
    #[inline(always)]
    fn apply_plain(&self, x: &mut [f32], cs: &[(f32, f32)]) {
        let half = self.n_rot / 2;
        for (i, &(c, s)) in cs.iter().enumerate().take(half) {
            let (a, b) = match self.style {
                RopeStyle::Normal => (2 * i, 2 * i + 1),
                RopeStyle::Neox => (i, i + half),
            };
            let x0 = x[a];
            let x1 = x[b];
            // ggml's `x0*cos - x1*sin` and `x0*sin + x1*cos`, as GCC contracts them into
            // fused multiply-adds in llama.cpp's build (checked bit for bit against its RoPE).
            x[a] = x0.mul_add(c, -(x1 * s));
            x[b] = x0.mul_add(s, x1 * c);
        }
    }

    /// Rotate one head vector `x` in place for position `pos`.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let mut cs = Vec::with_capacity(self.n_rot / 2);
        self.angles(pos, &mut cs);
        self.apply_with(x, &cs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_preserves_norm_and_is_identity_at_zero() {
        let r = Rope::new(64, 10000.0, 1.0, None, RopeStyle::Normal);
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3)
            .collect();
        let mut y = x.clone();
        r.apply(&mut y, 0);
        assert_eq!(x, y);
        r.apply(&mut y, 1234);
        let n0: f32 = x.iter().map(|v| v * v).sum();
        let n1: f32 = y.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-3 * n0);
    }

    /// The FMA-compiled rotation equals the portable one bit for bit (both styles).
    #[test]
    fn rope_with_fma_instructions_equals_the_portable_form() {
        let mut st = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(7, |d| d.as_nanos() as u64);
        let seed = st;
        let mut f = || {
            st = st
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((st >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0
        };
        for style in [RopeStyle::Normal, RopeStyle::Neox] {
            let r = Rope::new(64, 10000.0, 1.0, None, style);
            for pos in [1usize, 17, 300, 4000] {
                let x: Vec<f32> = (0..64).map(|_| f()).collect();
                let mut cs = Vec::new();
                r.angles(pos, &mut cs);
                let (mut a, mut b) = (x.clone(), x);
                r.apply_plain(&mut a, &cs);
                r.apply_with(&mut b, &cs);
                let (a, b): (Vec<u32>, Vec<u32>) = (
                    a.iter().map(|v| v.to_bits()).collect(),
                    b.iter().map(|v| v.to_bits()).collect(),
                );
                assert_eq!(a, b, "{style:?} pos {pos} (seed {seed})");
            }
        }
    }
}
