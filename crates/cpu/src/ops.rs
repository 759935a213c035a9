//! Element-wise and row operations of the forward pass: RMSNorm, RoPE, SwiGLU, softmax.
//!
//! These are a small share of a step's time next to the matrix products; they are written so the
//! compiler vectorizes them (plain loops over slices, no bounds checks in the inner loop).

/// `out = x / sqrt(mean(x^2) + eps) * w`, one row.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len();
    // As ggml's ggml_compute_forward_rms_norm_f32: each square in f32, summed in f64.
    let mut sum = 0.0f64;
    for &v in x {
        sum += (v * v) as f64;
    }
    let mean = (sum / n as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * g;
    }
}

/// Rotary position embedding (shared with the GPU's exact mode: one definition of the angles).
pub use model::Rope;

/// `gate = silu(gate) * up`, in place on `gate`, rounded as llama.cpp's CPU backend rounds it
/// ([`quant::dot::ggml::swiglu`]).
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    quant::dot::ggml::swiglu(gate, up);
}

/// Softmax in place, rounded as llama.cpp's CPU backend rounds it
/// ([`quant::dot::ggml::softmax`]); the row sums to 1.
pub fn softmax(x: &mut [f32]) {
    quant::dot::ggml::softmax(x);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_sums_to_one() {
        let mut x: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin() * 20.0).collect();
        softmax(&mut x);
        let s: f32 = x.iter().sum();
        assert!((s - 1.0).abs() < 1e-5);
    }
}
