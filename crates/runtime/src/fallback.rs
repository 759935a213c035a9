//! Host fallback: how a backend runs a weight matmul it has no kernel for.
//!
//! A backend that lacks a kernel for a weight type (a GPU without a Q5_1 matmul, say), or that
//! keeps some layers' weights in host memory (`--layers-on-gpu`), still runs the model: those
//! ops run on the host CPU inside the backend's own plan. The weights stay where they are in
//! host memory (the memory-mapped GGUF file); the backend copies the op's activations into this
//! executor's staging buffer (a device-to-host copy on a GPU), calls [`HostMatMul::run`], and
//! copies the result back (host-to-device). Its `support` answer for such an op is
//! [`Support::Fallback`](crate::Support) with `to = "host"` and the reason, which
//! `crossover audit` lists and counts.
//!
//! The arithmetic is the CPU backend's own: [`quant::dot::matmul_f32`], which quantizes the
//! activations to the weight type's activation format (Q8_0, Q8_1, Q8_K or f32) and runs the
//! CPU's dot kernels in their fixed float order. Every output element is a function of its
//! weight row and its token's activations alone (not of how work is split over threads), so an
//! op that falls back gives bit for bit what the CPU backend computes for the same input.
//!
//! ```ignore
//! let mut host = HostMatMul::default();
//! gpu.read(&activations, host.stage(n_tok * w.cols))?;      // device -> host
//! let y = host.run(&w, n_tok)?;                             // [n_tok][w.rows], token-major
//! gpu.write(&out, y)?;                                      // host -> device
//! ```

use std::time::{Duration, Instant};

use gguf::GgmlType;
use quant::dot::{self, Pool};

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
    #[error("host fallback for {name}: the CPU has no {ty} matmul kernel either")]
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
    Kernel { name: String, why: String },
    #[error("host fallback: could not start its {threads} threads: {why}")]
    Pool { threads: usize, why: String },
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

/// The host-side matmul executor of a backend's fallback ops. Keeps its staging and output
/// buffers, and its thread pool, between calls.
#[derive(Debug, Default)]
pub struct HostMatMul {
    staging: Vec<f32>,
    out: Vec<f32>,
    stats: FallbackStats,
    /// Threads of the pool (0: one per available CPU), started at the first call.
    threads: usize,
    pool: Option<Pool>,
}

impl HostMatMul {
    /// An executor whose pool has `threads` threads (0: one per available CPU, the default).
    pub fn with_threads(threads: usize) -> HostMatMul {
        HostMatMul {
            threads,
            ..HostMatMul::default()
        }
    }

    /// The staging buffer for the next call's activations, `n` floats (`n_tok * cols`,
    /// token-major). The backend copies its activations here.
    pub fn stage(&mut self, n: usize) -> &mut [f32] {
        self.staging.clear();
        self.staging.resize(n, 0.0);
        &mut self.staging
    }

    /// `y[t][r] = dot(W[r], x[t])` over the staged activations `x` (`n_tok` rows of `w.cols`),
    /// as the CPU backend computes it ([`quant::dot::matmul_f32`]). Returns `y`, `n_tok` rows of
    /// `w.rows`, for the backend to copy back.
    pub fn run(&mut self, w: &HostWeight<'_>, n_tok: usize) -> Result<&[f32], FallbackError> {
        let t0 = Instant::now();
        if !dot::supports(w.ty) {
            return Err(FallbackError::Type {
                name: w.name.into(),
                ty: w.ty,
            });
        }
        let row_bytes = dot::row_bytes(w.ty, w.cols).map_err(|e| FallbackError::Kernel {
            name: w.name.into(),
            why: e.to_string(),
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
        let pool = match &mut self.pool {
            Some(p) => p,
            slot => slot.insert(Pool::new(self.threads).map_err(|e| FallbackError::Pool {
                threads: self.threads,
                why: e.to_string(),
            })?),
        };
        self.out.clear();
        self.out.resize(n_tok * w.rows, 0.0);
        dot::matmul_f32(
            w.ty,
            &w.data[..need],
            w.rows,
            w.cols,
            &self.staging,
            n_tok,
            &mut self.out,
            pool,
        )
        .map_err(|e| FallbackError::Kernel {
            name: w.name.into(),
            why: e.to_string(),
        })?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The fallback is the CPU backend's arithmetic: bit for bit what `quant::dot::matmul_f32`
    /// gives on one thread (so the split over threads changes nothing), for quantized, K-quant
    /// and float types and token counts that take the one-token, grouped and left-over paths;
    /// and within 8-bit activation rounding of a plain f64 product of the dequantized weights.
    #[test]
    fn equals_the_cpu_kernels_bit_for_bit() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let (rows, cols) = (70, 512);
        let one = Pool::new(1).unwrap();
        let mut h = HostMatMul::with_threads(2);
        let mut calls = 0;
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q8_0,
            GgmlType::Q4K,
            GgmlType::Q6K,
            GgmlType::F16,
            GgmlType::F32,
        ] {
            let wf: Vec<f32> = (0..rows * cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let data = quant::quantize_to_vec(ty, &wf).unwrap();
            let deq = quant::dequantize_to_vec(ty, &data, rows * cols).unwrap();
            let w = HostWeight {
                name: "w",
                ty,
                data: &data,
                rows,
                cols,
            };
            for n_tok in [1, 3, 9] {
                let x: Vec<f32> = (0..n_tok * cols)
                    .map(|_| rng.gen_range(-1.0..1.0))
                    .collect();
                h.stage(x.len()).copy_from_slice(&x);
                let y = h.run(&w, n_tok).unwrap().to_vec();
                calls += 1;
                let mut cpu = vec![0f32; n_tok * rows];
                dot::matmul_f32(ty, &data, rows, cols, &x, n_tok, &mut cpu, &one).unwrap();
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&y), bits(&cpu), "{ty}, {n_tok} tokens");
                for t in 0..n_tok {
                    for r in 0..rows {
                        let (mut want, mut mag) = (0f64, 0f64);
                        for c in 0..cols {
                            let p = deq[r * cols + c] as f64 * x[t * cols + c] as f64;
                            want += p;
                            mag += p.abs();
                        }
                        let got = y[t * rows + r] as f64;
                        assert!(
                            (got - want).abs() <= 0.01 * mag + 1e-4,
                            "{ty} t{t} r{r}: {got} vs {want}"
                        );
                    }
                }
            }
        }
        assert_eq!(h.stats().calls, calls);
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
