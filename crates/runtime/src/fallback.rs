//! Host fallback: how a backend runs a weight matmul it has no kernel for.
//!
//! A backend that lacks a kernel for a weight type (a GPU without a Q5_1 matmul, say) still runs
//! the model: that op runs on the host CPU inside the backend's own plan. The weights stay where
//! they are in host memory (the memory-mapped GGUF file); the backend copies the op's activations
//! into this executor's staging buffer (a device-to-host copy on a GPU), calls
//! [`HostMatMul::run`], and copies the result back (host-to-device). Its `support` answer for
//! such an op is [`Support::Fallback`](crate::Support) with `to = "host"` and the reason, which
//! `crossover audit` lists and counts.
//!
//! The arithmetic is deliberately plain and independent of the backends' quantized kernels:
//! each weight row is dequantized to f32 and dotted with the f32 activations. Rows are split over
//! rayon's pool in blocks.
//!
//! ```ignore
//! let mut host = HostMatMul::default();
//! gpu.read(&activations, host.stage(n_tok * w.cols))?;      // device -> host
//! let y = host.run(&w, n_tok)?;                             // [n_tok][w.rows], token-major
//! gpu.write(&out, y)?;                                      // host -> device
//! ```

use std::time::{Duration, Instant};

use gguf::GgmlType;
use rayon::prelude::*;

/// A weight matrix in host memory: `rows` rows of `cols` elements of `ty`, row-major as GGUF
/// stores it (ggml shape `[cols, rows]`).
#[derive(Clone, Copy, Debug)]
pub struct HostWeight<'a> {
    /// Tensor name, for errors.
    pub name: &'a str,
    pub ty: GgmlType,
    pub data: &'a [u8],
    pub rows: usize,
    pub cols: usize,
}

/// Why a host matmul could not run.
#[derive(Debug, thiserror::Error)]
pub enum FallbackError {
    #[error("host fallback for {name}: type {ty} cannot be dequantized")]
    Type { name: String, ty: GgmlType },
    #[error("host fallback for {name}: {rows} rows of {cols} {ty} need {need} bytes, the tensor has {have}")]
    Size {
        name: String,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        need: usize,
        have: usize,
    },
    #[error("host fallback for {name}: staged {staged} activations, {n_tok} tokens x {cols} columns need {need}")]
    Staging {
        name: String,
        staged: usize,
        n_tok: usize,
        cols: usize,
        need: usize,
    },
    #[error("host fallback for {name}: {why}")]
    Dequantize { name: String, why: String },
}

/// What the executor has done, for reports.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FallbackStats {
    /// Matmuls run.
    pub calls: u64,
    /// Activation floats staged (copied in).
    pub staged: u64,
    /// Result floats produced (copied out).
    pub produced: u64,
    /// Time spent in [`HostMatMul::run`].
    pub time: Duration,
}

/// Rows dequantized together by one worker.
const ROW_BLOCK: usize = 32;

/// The host-side matmul executor of a backend's fallback ops. Keeps its staging and output
/// buffers between calls.
#[derive(Debug, Default)]
pub struct HostMatMul {
    staging: Vec<f32>,
    out: Vec<f32>,
    stats: FallbackStats,
}

impl HostMatMul {
    /// The staging buffer for the next call's activations, `n` floats (`n_tok * cols`,
    /// token-major). The backend copies its activations here.
    pub fn stage(&mut self, n: usize) -> &mut [f32] {
        self.staging.clear();
        self.staging.resize(n, 0.0);
        &mut self.staging
    }

    /// `y[t][r] = sum_c W[r][c] * x[t][c]` over the staged activations `x` (`n_tok` rows of
    /// `w.cols`). Returns `y`, `n_tok` rows of `w.rows`, for the backend to copy back.
    pub fn run(&mut self, w: &HostWeight<'_>, n_tok: usize) -> Result<&[f32], FallbackError> {
        let t0 = Instant::now();
        if !quant::can_dequantize(w.ty) {
            return Err(FallbackError::Type {
                name: w.name.into(),
                ty: w.ty,
            });
        }
        let row_bytes =
            w.ty.bytes_for(w.cols as u64)
                .map(|b| b as usize)
                .ok_or_else(|| FallbackError::Dequantize {
                    name: w.name.into(),
                    why: format!("{} columns are not whole {} blocks", w.cols, w.ty),
                })?;
        let need = row_bytes.saturating_mul(w.rows);
        if w.data.len() < need {
            return Err(FallbackError::Size {
                name: w.name.into(),
                ty: w.ty,
                rows: w.rows,
                cols: w.cols,
                need,
                have: w.data.len(),
            });
        }
        let need_x = n_tok.saturating_mul(w.cols);
        if self.staging.len() != need_x {
            return Err(FallbackError::Staging {
                name: w.name.into(),
                staged: self.staging.len(),
                n_tok,
                cols: w.cols,
                need: need_x,
            });
        }
        let x = &self.staging;
        // Each block of rows: dequantize into a local buffer, then dot with every token.
        let blocks: Vec<Result<Vec<f32>, String>> = (0..w.rows.div_ceil(ROW_BLOCK))
            .into_par_iter()
            .map(|b| {
                let r0 = b * ROW_BLOCK;
                let nr = ROW_BLOCK.min(w.rows - r0);
                let mut wf = vec![0.0f32; nr * w.cols];
                let src = &w.data[r0 * row_bytes..(r0 + nr) * row_bytes];
                quant::dequantize_serial(w.ty, src, &mut wf).map_err(|e| e.to_string())?;
                let mut y = vec![0.0f32; n_tok * nr];
                for (t, yt) in y.chunks_exact_mut(nr).enumerate() {
                    let xt = &x[t * w.cols..(t + 1) * w.cols];
                    for (yr, wr) in yt.iter_mut().zip(wf.chunks_exact(w.cols)) {
                        *yr = dot_f32(wr, xt);
                    }
                }
                Ok(y)
            })
            .collect();
        self.out.clear();
        self.out.resize(n_tok * w.rows, 0.0);
        for (b, y) in blocks.into_iter().enumerate() {
            let y = y.map_err(|why| FallbackError::Dequantize {
                name: w.name.into(),
                why,
            })?;
            let r0 = b * ROW_BLOCK;
            let nr = y.len() / n_tok.max(1);
            for t in 0..n_tok {
                self.out[t * w.rows + r0..t * w.rows + r0 + nr]
                    .copy_from_slice(&y[t * nr..(t + 1) * nr]);
            }
        }
        self.stats.calls += 1;
        self.stats.staged += need_x as u64;
        self.stats.produced += self.out.len() as u64;
        self.stats.time += t0.elapsed();
        Ok(&self.out)
    }

    /// Totals since creation.
    pub fn stats(&self) -> FallbackStats {
        self.stats
    }
}

/// Plain f32 dot product, accumulated in four lanes (order fixed, so results are reproducible).
fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 4];
    let mut ca = a.chunks_exact(4);
    let mut cb = b.chunks_exact(4);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..4 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        s += x * y;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Against a plain f64 triple loop over weights dequantized in one go, for a quantized and
    /// a float type, on random data.
    #[test]
    fn matches_reference_on_random_weights() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let (rows, cols, n_tok) = (70, 64, 3);
        for ty in [GgmlType::Q8_0, GgmlType::F32] {
            let wf: Vec<f32> = (0..rows * cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let data = quant::quantize_to_vec(ty, &wf).unwrap();
            let deq = quant::dequantize_to_vec(ty, &data, rows * cols).unwrap();
            let x: Vec<f32> = (0..n_tok * cols)
                .map(|_| rng.gen_range(-1.0..1.0))
                .collect();
            let w = HostWeight {
                name: "w",
                ty,
                data: &data,
                rows,
                cols,
            };
            let mut h = HostMatMul::default();
            h.stage(x.len()).copy_from_slice(&x);
            let y = h.run(&w, n_tok).unwrap().to_vec();
            for t in 0..n_tok {
                for r in 0..rows {
                    let want: f64 = (0..cols)
                        .map(|c| deq[r * cols + c] as f64 * x[t * cols + c] as f64)
                        .sum();
                    let got = y[t * rows + r] as f64;
                    assert!((got - want).abs() < 1e-4, "{ty} t{t} r{r}: {got} vs {want}");
                }
            }
            assert_eq!(h.stats().calls, 1);
        }
    }

    #[test]
    fn bad_sizes_are_typed_errors() {
        let data = vec![0u8; 10];
        let w = HostWeight {
            name: "blk.0.x",
            ty: GgmlType::F32,
            data: &data,
            rows: 2,
            cols: 4,
        };
        let mut h = HostMatMul::default();
        h.stage(4);
        assert!(matches!(
            h.run(&w, 1),
            Err(FallbackError::Size {
                need: 32,
                have: 10,
                ..
            })
        ));
        let data = vec![0u8; 32];
        let w = HostWeight { data: &data, ..w };
        h.stage(3);
        let e = h.run(&w, 1).unwrap_err();
        assert!(matches!(e, FallbackError::Staging { .. }), "{e}");
        assert!(e.to_string().contains("blk.0.x"), "{e}");
    }
}
