//! Agreement tests for the dot-product kernels: every SIMD level against the scalar reference on
//! fresh seeded random data, and the scalar reference against "dequantize, then dot in f64".
//!
//! Tolerances (stated once, used everywhere):
//! - activation quantization: bit-identical across levels;
//! - SIMD vs scalar dot: `|simd - scalar| <= 2e-6 * M + 1e-30`, with `M = sum |w_i * a_i|` over the
//!   dequantized operands (the integer work is exact; only f32 additions are reordered, and an f32
//!   sum of K terms reordered moves by at most about K_blocks * 2^-24 * M);
//! - scalar dot vs dequantized f64 dot: `|scalar - ref| <= 2e-6 * M + 1e-30` likewise (the
//!   reference combines exactly the same values in f64);
//! - f32 helpers: `1e-6 * M` for dots, `1e-6 * |y|` per element for axpy, 2 ulp (relative 2.4e-7)
//!   for exp.

mod common;

use common::inputs::{run_seed, WEIGHT_TYPES};
use gguf::GgmlType;
use half::f16;
use quant::dot::{self, f32ops, ActBuf, DotError, Isa, Pool};

/// splitmix64: small, seedable, good enough for test data.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Standard normal (Box-Muller).
    fn normal(&mut self) -> f32 {
        let u1 = (self.uniform() as f64).max(1e-12);
        let u2 = self.uniform() as f64;
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }
    /// Activation-like values: normal with a per-row scale and occasional large outliers.
    fn acts(&mut self, n: usize) -> Vec<f32> {
        let scale = 0.1 + 3.0 * self.uniform();
        (0..n)
            .map(|_| {
                let v = self.normal() * scale;
                if self.uniform() < 0.01 {
                    v * 20.0
                } else {
                    v
                }
            })
            .collect()
    }
    /// Weight-like values: normal, std 0.02..0.1.
    fn weights(&mut self, n: usize) -> Vec<f32> {
        let scale = 0.02 + 0.08 * self.uniform();
        (0..n).map(|_| self.normal() * scale).collect()
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

/// The SIMD levels this machine has; prints the ones it lacks.
fn simd_levels() -> Vec<Isa> {
    let mut v = Vec::new();
    for isa in [Isa::Avx2, Isa::Avx512, Isa::Neon] {
        if isa.available() {
            v.push(isa);
        } else {
            println!("skipping {}: not available on this CPU", isa.name());
        }
    }
    v
}

/// A weight row of `cols` elements: quantized from random f32 (`random_bytes = false`) or raw
/// random bytes with every f16 scale field replaced by a finite random scale.
fn weight_row(rng: &mut Rng, ty: GgmlType, cols: usize, random_bytes: bool) -> Vec<u8> {
    if !random_bytes {
        let x = rng.weights(cols);
        return quant::quantize_to_vec(ty, &x).expect("quantize weights");
    }
    let n = dot::row_bytes(ty, cols).expect("row bytes");
    let mut b = rng.bytes(n);
    let bs = ty.type_size();
    // Offsets of the f16 scale fields in each block.
    let scale_fields: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 => &[0, 2],
        GgmlType::Q2K => &[80, 82],
        GgmlType::Q3K => &[108],
        GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q6K => &[208],
        GgmlType::F16 => &[0],
        _ => &[],
    };
    match ty {
        GgmlType::F32 => {
            for c in b.chunks_exact_mut(4) {
                c.copy_from_slice(&(rng.normal() * 0.05).to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for c in b.chunks_exact_mut(2) {
                let v = quant::float16::f32_to_bf16(rng.normal() * 0.05);
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        _ => {
            for blk in b.chunks_exact_mut(bs) {
                for &off in scale_fields {
                    let v = f16::from_f32((rng.uniform() - 0.3) * 0.01).to_bits();
                    blk[off..off + 2].copy_from_slice(&v.to_le_bytes());
                }
                if ty == GgmlType::F16 {
                    let v = f16::from_f32(rng.normal() * 0.05).to_bits();
                    blk.copy_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
    b
}

/// Dequantize a weight or activation row to f64.
fn deq(ty: GgmlType, bytes: &[u8], cols: usize) -> Vec<f64> {
    let v = quant::dequantize_to_vec(ty, bytes, cols).expect("dequantize");
    v.into_iter().map(|x| x as f64).collect()
}

fn quantized_acts(ty: GgmlType, x: &[f32], n_tokens: usize, cols: usize, isa: Isa) -> ActBuf {
    let mut b = ActBuf::new();
    dot::quantize_acts_with_isa(ty, x, n_tokens, cols, &mut b, isa).expect("quantize acts");
    b
}

#[test]
fn dot_act_quantization_is_bit_identical_across_levels() {
    let mut rng = Rng(0x5eed_0001);
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q4K, GgmlType::F16] {
        for &cols in &[256usize, 512, 2048] {
            let n_tokens = 3;
            let mut x = rng.acts(n_tokens * cols);
            // An exact tie in magnitude with opposite signs, and an all-zero block.
            x[5] = 7.5;
            x[9] = -7.5;
            x[cols..cols + 256].fill(0.0);
            let reference = quantized_acts(ty, &x, n_tokens, cols, Isa::Scalar);
            for isa in simd_levels() {
                let got = quantized_acts(ty, &x, n_tokens, cols, isa);
                assert_eq!(got.act_type(), reference.act_type());
                assert!(
                    got.bytes() == reference.bytes(),
                    "{ty} acts, cols {cols}: {} quantization differs from scalar",
                    isa.name()
                );
            }
        }
    }
}

#[test]
fn dot_act_quantization_matches_reference_quantizer() {
    // Independent check of the scalar activation quantizers: dequantizing them gives back x
    // within half a quantization step.
    let mut rng = Rng(0x5eed_0002);
    let cols = 1024;
    for ty in [GgmlType::Q8_0, GgmlType::Q4_1, GgmlType::Q6K] {
        let x = rng.acts(cols);
        let b = quantized_acts(ty, &x, 1, cols, Isa::Scalar);
        let at = b.act_type();
        let back = deq(at, b.bytes(), cols);
        let bs = at.block_size();
        for (blk, (xs, ys)) in x.chunks(bs).zip(back.chunks(bs)).enumerate() {
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
            // Q8_0/Q8_1 store d in f16 (relative rounding 2^-11 on every value), Q8_K in f32.
            let step = amax / 127.0;
            for (i, (&a, &b)) in xs.iter().zip(ys).enumerate() {
                let tol = 0.5 * step + amax * 1e-3 + 1e-30;
                assert!(
                    (a as f64 - b).abs() <= tol,
                    "{at} block {blk} elem {i}: x {a} back {b} (tol {tol})"
                );
            }
        }
    }
}

/// Magnitude M = sum |w_i a_i| over dequantized operands, and the exact f64 dot.
fn reference_dot(ty: GgmlType, w: &[u8], acts: &[u8], cols: usize) -> (f64, f64) {
    let at = dot::act_type(ty).unwrap();
    let wd = deq(ty, w, cols);
    let ad = deq(at, acts, cols);
    let mut m = 0f64;
    let mut s = 0f64;
    for (x, y) in wd.iter().zip(&ad) {
        m += (x * y).abs();
        s += x * y;
    }
    (m, s)
}

#[test]
fn dot_simd_matches_scalar_for_every_type() {
    let mut rng = Rng(0x5eed_0003);
    let levels = simd_levels();
    let mut worst: Vec<(GgmlType, f64)> = Vec::new();
    for ty in WEIGHT_TYPES {
        let mut type_worst = 0f64;
        for random_bytes in [false, true] {
            for &cols in &[256usize, 768, 2048, 4352] {
                let w = weight_row(&mut rng, ty, cols, random_bytes);
                let x = rng.acts(cols);
                let a = quantized_acts(ty, &x, 1, cols, Isa::Scalar);
                let (m, _) = reference_dot(ty, &w, a.bytes(), cols);
                let s = dot::vec_dot(ty, &w, a.bytes(), cols, Isa::Scalar).unwrap() as f64;
                for &isa in &levels {
                    let v = dot::vec_dot(ty, &w, a.bytes(), cols, isa).unwrap() as f64;
                    let tol = 2e-6 * m + 1e-30;
                    type_worst = type_worst.max((v - s).abs() / m.max(1e-30));
                    assert!(
                        (v - s).abs() <= tol,
                        "{ty} cols {cols} random_bytes {random_bytes}: {} {v} vs scalar {s} (M {m}, tol {tol})",
                        isa.name()
                    );
                }
            }
        }
        worst.push((ty, type_worst));
    }
    for (ty, w) in worst {
        println!("{ty}: worst |simd - scalar| / M = {w:.2e}");
    }
}

/// Q4_1/Q5_1 dots use the activation block's stored `s = f16(d * sum(q))`, whose f16 rounding
/// (relative 2^-11) dequantization does not see: the bound `sum_b |m_b| |s_b| 2^-11`.
fn q8_1_sum_rounding(ty: GgmlType, w: &[u8], acts: &[u8]) -> f64 {
    if !matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
        return 0.0;
    }
    let f = |b: &[u8]| {
        f16::from_bits(u16::from_le_bytes([b[2], b[3]]))
            .to_f64()
            .abs()
    };
    w.chunks_exact(ty.type_size())
        .zip(acts.chunks_exact(36))
        .map(|(wb, ab)| f(wb) * f(ab) * (2f64).powi(-11))
        .sum()
}

#[test]
fn dot_scalar_matches_dequantized_reference() {
    let mut rng = Rng(0x5eed_0004);
    for ty in WEIGHT_TYPES {
        for random_bytes in [false, true] {
            for &cols in &[256usize, 1280] {
                let w = weight_row(&mut rng, ty, cols, random_bytes);
                let x = rng.acts(cols);
                let a = quantized_acts(ty, &x, 1, cols, Isa::Scalar);
                let (m, r) = reference_dot(ty, &w, a.bytes(), cols);
                let s = dot::vec_dot(ty, &w, a.bytes(), cols, Isa::Scalar).unwrap() as f64;
                let tol = 2e-6 * m + q8_1_sum_rounding(ty, &w, a.bytes()) + 1e-30;
                assert!(
                    (s - r).abs() <= tol,
                    "{ty} cols {cols} random_bytes {random_bytes}: scalar {s} vs dequantized {r} (M {m})"
                );
            }
        }
    }
}

#[test]
fn dot_quantized_product_tracks_f32_product() {
    // End-to-end sanity: quantized weights times quantized activations stay close to the f32
    // product of the dequantized weights with the unquantized activations (the activation
    // quantization error is the only difference: 8 bits, so well under 2% of M).
    let mut rng = Rng(0x5eed_0005);
    let cols = 2048;
    for ty in WEIGHT_TYPES {
        let w = weight_row(&mut rng, ty, cols, false);
        let x = rng.acts(cols);
        let wd = deq(ty, &w, cols);
        let exact: f64 = wd.iter().zip(&x).map(|(a, b)| a * *b as f64).sum();
        let m: f64 = wd.iter().zip(&x).map(|(a, b)| (a * *b as f64).abs()).sum();
        let a = quantized_acts(ty, &x, 1, cols, dot::best_isa());
        let got = dot::vec_dot(ty, &w, a.bytes(), cols, dot::best_isa()).unwrap() as f64;
        assert!(
            (got - exact).abs() <= 0.02 * m,
            "{ty}: {got} vs f32 product {exact} (M {m})"
        );
    }
}

#[test]
fn dot_matmul_matches_vec_dot_on_every_level() {
    let mut rng = Rng(0x5eed_0006);
    let mut levels = vec![Isa::Scalar];
    levels.extend(simd_levels());
    let pools = [Pool::new(1).unwrap(), Pool::new(3).unwrap()];
    // Shapes with ragged row/token counts, and one large enough to be split into chunks.
    let shapes = [
        (1usize, 256usize, 1usize),
        (7, 512, 1),
        (13, 256, 5),
        (70, 768, 9),
        (300, 512, 70),
    ];
    for ty in WEIGHT_TYPES {
        for &(rows, cols, n_tokens) in &shapes {
            let w: Vec<u8> = (0..rows)
                .flat_map(|_| weight_row(&mut rng, ty, cols, false))
                .collect();
            let x = rng.acts(n_tokens * cols);
            let rb = dot::row_bytes(ty, cols).unwrap();
            for &isa in &levels {
                let acts = quantized_acts(ty, &x, n_tokens, cols, isa);
                for pool in &pools {
                    let mut out = vec![f32::NAN; rows * n_tokens];
                    dot::matmul_with_isa(ty, &w, rows, cols, &acts, &mut out, pool, isa).unwrap();
                    for t in 0..n_tokens {
                        let arow = acts.row(t).unwrap();
                        for r in 0..rows {
                            let wrow = &w[r * rb..(r + 1) * rb];
                            let want = dot::vec_dot(ty, wrow, arow, cols, isa).unwrap();
                            let (m, _) = reference_dot(ty, wrow, arow, cols);
                            let got = out[t * rows + r];
                            assert!(
                                ((got - want) as f64).abs() <= 2e-6 * m + 1e-30,
                                "{ty} {rows}x{cols}x{n_tokens} {} threads {}: out[{t}][{r}] {got} vs vec_dot {want}",
                                isa.name(),
                                pool.n_threads()
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn dot_float_weights_take_any_length() {
    // Float weights have no block structure: lengths that are not a multiple of the vector
    // width exercise the masked tails.
    let mut rng = Rng(0x5eed_000a);
    let pool = Pool::new(2).unwrap();
    let mut levels = vec![Isa::Scalar];
    levels.extend(simd_levels());
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        for &cols in &[1usize, 7, 17, 100, 333] {
            let rows = 6;
            let n = 5;
            let w: Vec<u8> = (0..rows)
                .flat_map(|_| weight_row(&mut rng, ty, cols, true))
                .collect();
            let x = rng.acts(n * cols);
            let wd = deq(ty, &w, rows * cols);
            for &isa in &levels {
                let a = quantized_acts(ty, &x, n, cols, isa);
                let mut out = vec![0f32; rows * n];
                dot::matmul_with_isa(ty, &w, rows, cols, &a, &mut out, &pool, isa).unwrap();
                for t in 0..n {
                    for r in 0..rows {
                        let (mut m, mut e) = (0f64, 0f64);
                        for c in 0..cols {
                            let p = wd[r * cols + c] * x[t * cols + c] as f64;
                            m += p.abs();
                            e += p;
                        }
                        let got = out[t * rows + r] as f64;
                        assert!(
                            (got - e).abs() <= 2e-6 * m + 1e-30,
                            "{ty} cols {cols} {}: out[{t}][{r}] {got} vs {e}",
                            isa.name()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn dot_matmul_f32_equals_quantize_then_matmul() {
    let mut rng = Rng(0x5eed_0007);
    let pool = Pool::new(2).unwrap();
    let (rows, cols, n) = (33, 512, 3);
    for ty in [GgmlType::Q4_1, GgmlType::Q6K, GgmlType::F16] {
        let w: Vec<u8> = (0..rows)
            .flat_map(|_| weight_row(&mut rng, ty, cols, false))
            .collect();
        let x = rng.acts(n * cols);
        let mut a = ActBuf::new();
        dot::quantize_acts(ty, &x, n, cols, &mut a).unwrap();
        let mut o1 = vec![0f32; rows * n];
        let mut o2 = vec![0f32; rows * n];
        dot::matmul(ty, &w, rows, cols, &a, &mut o1, &pool).unwrap();
        dot::matmul_f32(ty, &w, rows, cols, &x, n, &mut o2, &pool).unwrap();
        assert_eq!(o1, o2, "{ty}");
    }
}

#[test]
fn dot_multi_equals_separate_products() {
    // One dispatch over several weight types (three different activation types) gives exactly
    // the separate products; 40 tokens also take the pool-parallel activation quantization.
    let mut rng = Rng(0x5eed_000b);
    let pool = Pool::new(3).unwrap();
    let cols = 512;
    for n in [1usize, 40] {
        let x = rng.acts(n * cols);
        let specs = [
            (GgmlType::Q4_1, 37usize),
            (GgmlType::Q8_0, 64),
            (GgmlType::Q6K, 5),
            (GgmlType::F16, 9),
        ];
        let ws: Vec<Vec<u8>> = specs
            .iter()
            .map(|&(ty, rows)| {
                (0..rows)
                    .flat_map(|_| weight_row(&mut rng, ty, cols, false))
                    .collect()
            })
            .collect();
        let mut outs: Vec<Vec<f32>> = specs
            .iter()
            .map(|&(_, rows)| vec![f32::NAN; rows * n])
            .collect();
        {
            let mut jobs: Vec<dot::MatJob<'_>> = specs
                .iter()
                .zip(&ws)
                .zip(outs.iter_mut())
                .map(|((&(ty, rows), w), out)| dot::MatJob {
                    weight_ty: ty,
                    w,
                    rows,
                    out,
                })
                .collect();
            dot::matmul_f32_multi(&mut jobs, &x, n, cols, &pool).unwrap();
        }
        for ((&(ty, rows), w), got) in specs.iter().zip(&ws).zip(&outs) {
            let mut want = vec![0f32; rows * n];
            let mut a = ActBuf::new();
            dot::quantize_acts(ty, &x, n, cols, &mut a).unwrap();
            dot::matmul(ty, w, rows, cols, &a, &mut want, &pool).unwrap();
            assert_eq!(got, &want, "{ty} with {n} tokens");
        }
    }
    // A job whose activation type was not supplied is refused.
    let mut a = ActBuf::new();
    dot::quantize_acts(GgmlType::Q8_0, &[1.0; 32], 1, 32, &mut a).unwrap();
    let w = [0u8; 20];
    let mut out = [0f32; 1];
    let mut jobs = [dot::MatJob {
        weight_ty: GgmlType::Q4_1,
        w: &w,
        rows: 1,
        out: &mut out,
    }];
    assert_eq!(
        dot::matmul_multi(&mut jobs, &[&a], &pool),
        Err(DotError::ActType {
            weight_ty: GgmlType::Q4_1,
            expected: GgmlType::Q8_1,
            got: GgmlType::Q8_0
        })
    );
}

#[test]
fn dot_errors_name_the_problem() {
    let pool = Pool::new(1).unwrap();
    let mut a = ActBuf::new();
    assert_eq!(
        dot::quantize_acts(GgmlType::Q4K, &[0.0; 100], 1, 100, &mut a),
        Err(DotError::NotBlockMultiple {
            ty: GgmlType::Q4K,
            cols: 100,
            block_size: 256
        })
    );
    assert_eq!(
        dot::quantize_acts(GgmlType::Q4_0, &[0.0; 63], 2, 32, &mut a),
        Err(DotError::Length {
            what: "activations x (f32)",
            expected: 64,
            got: 63
        })
    );
    assert!(matches!(
        dot::quantize_acts(GgmlType::I32, &[0.0; 32], 1, 32, &mut a),
        Err(DotError::Unsupported { ty: GgmlType::I32 })
    ));
    dot::quantize_acts(GgmlType::Q4_0, &[1.0; 64], 2, 32, &mut a).unwrap();
    let w = vec![0u8; 18 * 3];
    let mut out = vec![0f32; 6];
    // Q8_0 acts are right for Q8_0 weights, but not for Q4_1 (which needs Q8_1).
    assert_eq!(
        dot::matmul(GgmlType::Q4_1, &[0u8; 60], 3, 32, &a, &mut out, &pool),
        Err(DotError::ActType {
            weight_ty: GgmlType::Q4_1,
            expected: GgmlType::Q8_1,
            got: GgmlType::Q8_0
        })
    );
    assert_eq!(
        dot::matmul(GgmlType::Q4_0, &w[..50], 3, 32, &a, &mut out, &pool),
        Err(DotError::Length {
            what: "weights (bytes)",
            expected: 54,
            got: 50
        })
    );
    assert_eq!(
        dot::matmul(GgmlType::Q4_0, &w, 3, 32, &a, &mut out[..5], &pool),
        Err(DotError::Length {
            what: "output (f32)",
            expected: 6,
            got: 5
        })
    );
    assert_eq!(
        dot::matmul(GgmlType::Q4_0, &[0u8; 36], 1, 64, &a, &mut out[..2], &pool),
        Err(DotError::Cols {
            weight_ty: GgmlType::Q4_0,
            expected: 64,
            got: 32
        })
    );
    assert!(dot::matmul(GgmlType::Q4_0, &w, 3, 32, &a, &mut out, &pool).is_ok());
    for isa in Isa::ALL {
        if !isa.available() {
            assert_eq!(
                dot::vec_dot(GgmlType::Q4_0, &w[..18], &[0u8; 34], 32, isa),
                Err(DotError::IsaUnavailable { isa })
            );
        }
    }
}

#[test]
fn dot_f32_helpers_match_scalar() {
    let mut rng = Rng(0x5eed_0008);
    let mut levels = vec![Isa::Scalar];
    levels.extend(simd_levels());
    for &n in &[1usize, 7, 8, 15, 16, 17, 63, 64, 65, 100, 576, 1000] {
        let a = rng.acts(n);
        let b = rng.acts(n);
        let h: Vec<f16> = rng.acts(n).into_iter().map(f16::from_f32).collect();
        let exact_ff: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        let m_ff: f64 = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (*x as f64 * *y as f64).abs())
            .sum();
        let exact_fh: f64 = a.iter().zip(&h).map(|(x, y)| *x as f64 * y.to_f64()).sum();
        let m_fh: f64 = a
            .iter()
            .zip(&h)
            .map(|(x, y)| (*x as f64 * y.to_f64()).abs())
            .sum();
        for &isa in &levels {
            let d = f32ops::dot_f32_isa(isa, &a, &b).unwrap() as f64;
            assert!(
                (d - exact_ff).abs() <= 1e-6 * m_ff + 1e-30,
                "dot_f32 {} n {n}",
                isa.name()
            );
            let d = f32ops::dot_f32_f16_isa(isa, &a, &h).unwrap() as f64;
            assert!(
                (d - exact_fh).abs() <= 1e-6 * m_fh + 1e-30,
                "dot_f32_f16 {} n {n}",
                isa.name()
            );
            let alpha = rng.normal();
            let mut y = b.clone();
            f32ops::axpy_f16_isa(isa, &mut y, alpha, &h).unwrap();
            for i in 0..n {
                let want = b[i] as f64 + alpha as f64 * h[i].to_f64();
                let mag = b[i].abs() as f64 + (alpha as f64 * h[i].to_f64()).abs();
                assert!(
                    (y[i] as f64 - want).abs() <= 1e-6 * mag + 1e-30,
                    "axpy_f16 {} n {n} i {i}",
                    isa.name()
                );
            }
        }
    }
}

#[test]
fn dot_exp_matches_std_exp() {
    let mut rng = Rng(0x5eed_0009);
    let mut x: Vec<f32> = (0..5000).map(|_| (rng.uniform() - 0.5) * 180.0).collect();
    x.extend([
        0.0,
        -0.0,
        1.0,
        -1.0,
        88.7,
        88.8,
        -87.3,
        -87.4,
        -200.0,
        200.0,
        f32::NEG_INFINITY,
    ]);
    for isa in simd_levels() {
        let mut y = x.clone();
        f32ops::exp_inplace_isa(isa, &mut y).unwrap();
        for (i, (&xi, &yi)) in x.iter().zip(&y).enumerate() {
            let want = xi.exp();
            let ok = if want.is_infinite() {
                yi == want
            } else if want < 1e-37 {
                (0.0..=1e-37).contains(&yi)
            } else {
                ((yi - want) / want).abs() <= 2.4e-7
            };
            assert!(
                ok,
                "{} exp({xi}) = {yi}, want {want} (index {i})",
                isa.name()
            );
        }
    }
    let mut s = vec![1.0f32, 2.0, 3.0, f32::NEG_INFINITY];
    dot::softmax_inplace(&mut s);
    let e: Vec<f64> = [1.0f64, 2.0, 3.0].iter().map(|v| (v - 3.0).exp()).collect();
    let z: f64 = e.iter().sum();
    for i in 0..3 {
        assert!(
            (s[i] as f64 - e[i] / z).abs() < 1e-6,
            "softmax {i}: {}",
            s[i]
        );
    }
    assert_eq!(s[3], 0.0);
}

#[test]
fn dot_pool_runs_every_index_once() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    for n in [1usize, 2, 4] {
        let pool = Pool::new(n).unwrap();
        assert_eq!(pool.n_threads(), n);
        for round in 0..200 {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            for (i, h) in hits.iter().enumerate() {
                assert_eq!(h.load(Ordering::Relaxed), 1, "round {round} thread {i}");
            }
            let items = 37 + round % 5;
            let seen: Vec<AtomicUsize> = (0..items).map(|_| AtomicUsize::new(0)).collect();
            pool.par_for(items, |i| {
                seen[i].fetch_add(1, Ordering::Relaxed);
                // Nested use runs inline instead of deadlocking.
                pool.run(|_| {});
            });
            assert!(
                seen.iter().all(|s| s.load(Ordering::Relaxed) == 1),
                "round {round}"
            );
        }
    }
    // Oversubscribed (more threads than cores) and with jobs of every size, each item still
    // runs exactly once: workers that arrive after the job closed must skip it.
    let pool = Pool::new(6).unwrap();
    let mut rng = Rng(0x5eed_000c);
    for round in 0..3000 {
        let items = 1 + (rng.next_u64() % 40) as usize;
        let seen: Vec<AtomicUsize> = (0..items).map(|_| AtomicUsize::new(0)).collect();
        pool.par_for(items, |i| {
            seen[i].fetch_add(1, Ordering::Relaxed);
        });
        assert!(
            seen.iter().all(|s| s.load(Ordering::Relaxed) == 1),
            "round {round}, {items} items"
        );
    }
    // After idling past the spin window the workers sleep, and still wake for the next job.
    let pool = Pool::with_spin(3, std::time::Duration::from_micros(50)).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    let count = AtomicUsize::new(0);
    pool.run(|_| {
        count.fetch_add(1, Ordering::Relaxed);
    });
    assert_eq!(count.load(Ordering::Relaxed), 3);
    // A panicking job is re-raised on the caller, and the pool keeps working.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        pool.run(|i| {
            if i == 2 {
                panic!("boom");
            }
        })
    }));
    assert!(r.is_err());
    let count = AtomicUsize::new(0);
    pool.run(|_| {
        count.fetch_add(1, Ordering::Relaxed);
    });
    assert_eq!(count.load(Ordering::Relaxed), 3);
}

/// Regression: SmolLM2's shapes (576 and 1536 columns: 18 and 48 legacy blocks) produced garbage
/// on the AVX-512 path while every shape above (multiples of 256 columns) passed.
#[test]
fn dot_matmul_smollm2_shapes_match_scalar() {
    let mut rng = Rng(0x5eed_0576);
    let pool = Pool::new(2).unwrap();
    for ty in WEIGHT_TYPES {
        for &(rows, cols, n_tokens) in &[(64usize, 576usize, 1usize), (40, 1536, 1), (33, 576, 27)]
        {
            if cols % ty.block_size() != 0 {
                continue;
            }
            let w: Vec<u8> = (0..rows)
                .flat_map(|_| weight_row(&mut rng, ty, cols, false))
                .collect();
            let x = rng.acts(n_tokens * cols);
            let scalar_acts = quantized_acts(ty, &x, n_tokens, cols, Isa::Scalar);
            let mut want = vec![f32::NAN; rows * n_tokens];
            dot::matmul_with_isa(
                ty,
                &w,
                rows,
                cols,
                &scalar_acts,
                &mut want,
                &pool,
                Isa::Scalar,
            )
            .unwrap();
            for isa in simd_levels() {
                let acts = quantized_acts(ty, &x, n_tokens, cols, isa);
                let mut got = vec![f32::NAN; rows * n_tokens];
                dot::matmul_with_isa(ty, &w, rows, cols, &acts, &mut got, &pool, isa).unwrap();
                let scale = want
                    .iter()
                    .map(|v| v.abs())
                    .fold(0.0f32, f32::max)
                    .max(1e-6);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-4 * scale,
                        "{ty} {rows}x{cols}x{n_tokens} {}: out[{i}] {g} vs scalar {w}",
                        isa.name()
                    );
                }
            }
        }
    }
}

/// The AVX-512 and NEON kernels of the quantized types reproduce the scalar references bit for
/// bit: all follow llama.cpp's order of float operations (the teacher-forced tests rely on it),
/// including the separate order of the tokens left over from groups of 4 (Q4_K), in both
/// summation orders of the 32-element types.
#[test]
fn dot_simd_matmul_is_bit_identical_to_scalar() {
    for isa in [Isa::Avx2, Isa::Avx512, Isa::Neon] {
        if isa.available() {
            matmul_is_bit_identical_to_scalar(isa);
        } else {
            println!("skipping {}: not available on this CPU", isa.name());
        }
    }
}

fn matmul_is_bit_identical_to_scalar(isa: Isa) {
    let mut rng = Rng(run_seed(isa.name()));
    let pool = Pool::new(2).unwrap();
    for ty in &WEIGHT_TYPES[3..] {
        let ty = *ty;
        for &(rows, cols, n_tokens, random_bytes) in &[
            (13usize, 512usize, 7usize, false),
            (8, 256, 1, false),
            (70, 768, 9, false),
            (5, 256, 16, true),
            (9, 256, 47, false),
            (6, 512, 5, true),
        ] {
            let w: Vec<u8> = (0..rows)
                .flat_map(|_| weight_row(&mut rng, ty, cols, random_bytes))
                .collect();
            let x = rng.acts(n_tokens * cols);
            for order in dot::SumOrder::ALL {
                let mut outs = Vec::new();
                for level in [Isa::Scalar, isa] {
                    let acts = quantized_acts(ty, &x, n_tokens, cols, level);
                    let mut out = vec![f32::NAN; rows * n_tokens];
                    dot::matmul_ordered(ty, &w, rows, cols, &acts, &mut out, &pool, level, order)
                        .unwrap();
                    outs.push(out);
                }
                for (i, (a, b)) in outs[0].iter().zip(&outs[1]).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{ty} {rows}x{cols}x{n_tokens} ({order}, random bytes {random_bytes}): element {i}: scalar {a} vs {} {b}",
                        isa.name()
                    );
                }
            }
        }
    }
}

/// The packed layouts (16 interleaved rows, made at load) of Q4_K, Q6_K, Q4_0, Q4_1 and Q8_0
/// (AVX-512 and AVX2) give the scalar reference's results bit for bit, for every
/// token count (Q4_K: groups of 4 and the tokens left over take llama.cpp's two orders), and
/// unpack back to the GGUF bytes.
#[test]
fn dot_packed_is_bit_identical_to_scalar() {
    let mut ran = false;
    for (isa, types) in [
        (
            Isa::Avx512,
            &[
                GgmlType::Q4K,
                GgmlType::Q6K,
                GgmlType::Q4_0,
                GgmlType::Q4_1,
                GgmlType::Q8_0,
            ][..],
        ),
        (
            Isa::Avx2,
            &[
                GgmlType::Q4K,
                GgmlType::Q6K,
                GgmlType::Q4_0,
                GgmlType::Q4_1,
                GgmlType::Q8_0,
            ][..],
        ),
    ] {
        if isa.available() {
            packed_is_bit_identical_to_scalar(isa, types);
            ran = true;
        } else {
            println!("skipping {}: not available on this CPU", isa.name());
        }
    }
    if !ran {
        println!("skipping: no packed layout on this CPU");
    }
}

fn packed_is_bit_identical_to_scalar(isa: Isa, types: &[GgmlType]) {
    let mut rng = Rng(run_seed(&format!("packed-{}", isa.name())));
    let pool = Pool::new(2).unwrap();
    for (ty, rows, cols, random_bytes) in types.iter().copied().flat_map(|ty| {
        [
            (ty, 16usize, 256usize, true),
            (ty, 48, 1024, false),
            (ty, 32, 512, true),
            (ty, 2048, 256, false),
        ]
    }) {
        let w: Vec<u8> = (0..rows)
            .flat_map(|_| weight_row(&mut rng, ty, cols, random_bytes))
            .collect();
        let p = dot::PackedMat::pack_with_isa(ty, &w, rows, cols, isa)
            .unwrap()
            .expect("16-row groups pack");
        let rb = dot::row_bytes(ty, cols).unwrap();
        for r in 0..rows {
            assert_eq!(p.unpack_row(r).unwrap(), w[r * rb..(r + 1) * rb], "row {r}");
        }
        for n_tokens in [1usize, 2, 3, 4, 5, 7, 8, 9, 13] {
            let x = rng.acts(n_tokens * cols);
            let acts = quantized_acts(ty, &x, n_tokens, cols, Isa::Scalar);
            let mut want = vec![f32::NAN; rows * n_tokens];
            dot::matmul_with_isa(ty, &w, rows, cols, &acts, &mut want, &pool, Isa::Scalar).unwrap();
            let mut got = vec![f32::NAN; rows * n_tokens];
            dot::matmul_packed(&p, &acts, &mut got, &pool).unwrap();
            let mut got_f32 = vec![f32::NAN; rows * n_tokens];
            dot::matmul_f32_packed(&p, &x, n_tokens, &mut got_f32, &pool).unwrap();
            // A plain owned copy runs the GGUF-layout kernels.
            let copy = dot::PackedMat::copy(ty, &w, rows, cols).unwrap();
            assert!(!copy.is_interleaved());
            let mut got_copy = vec![f32::NAN; rows * n_tokens];
            dot::matmul_packed(&copy, &acts, &mut got_copy, &pool).unwrap();
            for (i, (a, b)) in want.iter().zip(&got_copy).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "copy: element {i}");
            }
            for (i, ((a, b), c)) in want.iter().zip(&got).zip(&got_f32).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{ty} {rows}x{cols}x{n_tokens}: element {i}: scalar {a} vs packed {b}"
                );
                assert_eq!(b.to_bits(), c.to_bits(), "element {i}: f32 entry point");
            }
            // The whole-block order (decode's), where a type has one.
            let order = dot::SumOrder::Block;
            let mut want_b = vec![f32::NAN; rows * n_tokens];
            dot::matmul_ordered(
                ty,
                &w,
                rows,
                cols,
                &acts,
                &mut want_b,
                &pool,
                Isa::Scalar,
                order,
            )
            .unwrap();
            let mut got_b = vec![f32::NAN; rows * n_tokens];
            dot::matmul_packed_ordered(&p, &acts, &mut got_b, &pool, false, order).unwrap();
            for (i, (a, b)) in want_b.iter().zip(&got_b).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{ty} {rows}x{cols}x{n_tokens} block order: element {i}: scalar {a} vs \
                     packed {b}"
                );
            }
        }
    }
    // Shapes the packed kernel does not take are refused, not mangled.
    let ty = GgmlType::Q4K;
    let w = weight_row(&mut rng, ty, 256, false);
    assert!(dot::PackedMat::pack_with_isa(ty, &w, 1, 256, isa)
        .unwrap()
        .is_none());
    assert!(dot::PackedMat::pack_with_isa(GgmlType::Q4K, &w, 1, 255, isa).is_err());
}

/// The AMX kernels of the packed types (many-token products: tile-unit integer sums, the
/// vector unit's float order): legacy types and `Q4_K` give the scalar reference's results bit
/// for bit, and the `vpdpbusd` packed kernels', over token counts that fill, split and pad
/// 16-token groups (and, for `Q4_K`, leave 1-3 tokens to the gemv order), odd and even block
/// counts (stretches of 2 blocks), and random bytes (every f16 scale, `Q8_0`'s -128, every
/// 6-bit scale and min) as well as quantized weights.
#[test]
fn dot_amx_is_bit_identical_to_scalar_and_vnni() {
    if !dot::amx_available() {
        println!("skipping: AMX-INT8 not available on this CPU (or not permitted by the OS)");
        return;
    }
    let seed = 0xa3c5_0017_u64;
    println!("seed {seed:#x}");
    let mut rng = Rng(seed);
    let pool = Pool::new(2).unwrap();
    for (ty, rows, cols, random_bytes) in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0]
        .into_iter()
        .flat_map(|ty| {
            [
                (ty, 16usize, 32usize, true),
                (ty, 32, 96, false),
                (ty, 48, 576, true),
                (ty, 64, 1536, false),
            ]
        })
        .chain([
            (GgmlType::Q4K, 16, 256, true),
            (GgmlType::Q4K, 32, 512, false),
            (GgmlType::Q4K, 48, 768, true),
            (GgmlType::Q4K, 64, 2048, false),
        ])
    {
        let w: Vec<u8> = (0..rows)
            .flat_map(|_| weight_row(&mut rng, ty, cols, random_bytes))
            .collect();
        let p = dot::PackedMat::pack_with_isa(ty, &w, rows, cols, Isa::Avx512)
            .unwrap()
            .expect("16-row groups pack on AVX-512");
        for n_tokens in [8usize, 15, 16, 17, 33, 64, 70, 130] {
            let x = rng.acts(n_tokens * cols);
            let acts = quantized_acts(ty, &x, n_tokens, cols, Isa::Scalar);
            let mut want = vec![f32::NAN; rows * n_tokens];
            dot::matmul_with_isa(ty, &w, rows, cols, &acts, &mut want, &pool, Isa::Scalar).unwrap();
            let mut amx = vec![f32::NAN; rows * n_tokens];
            dot::matmul_packed_with_amx(&p, &acts, &mut amx, &pool, true).unwrap();
            let mut vnni = vec![f32::NAN; rows * n_tokens];
            dot::matmul_packed_with_amx(&p, &acts, &mut vnni, &pool, false).unwrap();
            for (i, ((a, b), c)) in want.iter().zip(&amx).zip(&vnni).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{ty} {rows}x{cols}x{n_tokens}: element {i}: scalar {a} vs amx {b}"
                );
                assert_eq!(b.to_bits(), c.to_bits(), "element {i}: amx {b} vs vnni {c}");
            }
        }
    }
}

const LEGACY_TYPES: [GgmlType; 5] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
];

/// The whole-block order (`SumOrder::Block`) gives the same bits in every kernel: the scalar
/// reference row by row (`vec_dot_ordered`), the GGUF-layout tiles of every level (4-row and
/// 1-row tiles, 1-2 tokens; AVX-512's wide kernel for 8+ tokens), the packed 16-row kernel
/// (1-4 tokens per tile, decode included) and its f32 entry point, with AMX allowed or not,
/// over token counts 1..70 that fill and split the tiles and 16-token groups, rows that leave
/// tails, random bytes (every f16 scale, Q8_0's -128) and quantized weights. So a token's
/// result does not depend on how many tokens or rows a kernel handles at once.
#[test]
fn dot_block_order_is_bit_identical_everywhere() {
    let mut rng = Rng(0xb10c_0001);
    let pool = Pool::new(2).unwrap();
    let order = dot::SumOrder::Block;
    for ty in LEGACY_TYPES {
        for &(rows, cols, random_bytes) in &[
            (32usize, 576usize, false),
            (13, 64, true),
            (16, 1536, true),
            (7, 32, false),
        ] {
            let w: Vec<u8> = (0..rows)
                .flat_map(|_| weight_row(&mut rng, ty, cols, random_bytes))
                .collect();
            let rb = dot::row_bytes(ty, cols).unwrap();
            let packed = dot::PackedMat::pack(ty, &w, rows, cols).unwrap();
            for n_tokens in [1usize, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64, 70] {
                let x = rng.acts(n_tokens * cols);
                let acts = quantized_acts(ty, &x, n_tokens, cols, Isa::Scalar);
                let mut want = vec![f32::NAN; rows * n_tokens];
                for t in 0..n_tokens {
                    for r in 0..rows {
                        want[t * rows + r] = dot::vec_dot_ordered(
                            ty,
                            &w[r * rb..(r + 1) * rb],
                            acts.row(t).unwrap(),
                            cols,
                            Isa::Scalar,
                            order,
                        )
                        .unwrap();
                    }
                }
                let same = |got: &[f32], what: &str| {
                    for (i, (a, b)) in want.iter().zip(got).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{ty} {rows}x{cols}x{n_tokens} {what}: element {i}: scalar {a} vs {b}"
                        );
                    }
                };
                for isa in std::iter::once(Isa::Scalar).chain(simd_levels()) {
                    let a = quantized_acts(ty, &x, n_tokens, cols, isa);
                    let mut got = vec![f32::NAN; rows * n_tokens];
                    dot::matmul_ordered(ty, &w, rows, cols, &a, &mut got, &pool, isa, order)
                        .unwrap();
                    same(&got, isa.name());
                    let mut got = vec![f32::NAN; rows * n_tokens];
                    if isa == dot::best_isa() {
                        dot::matmul_f32_ordered(
                            ty, &w, rows, cols, &x, n_tokens, &mut got, &pool, order,
                        )
                        .unwrap();
                        same(&got, "matmul_f32_ordered");
                    }
                }
                if let Some(p) = &packed {
                    for amx in [false, true] {
                        let mut got = vec![f32::NAN; rows * n_tokens];
                        dot::matmul_packed_ordered(p, &acts, &mut got, &pool, amx, order).unwrap();
                        same(&got, if amx { "packed, amx allowed" } else { "packed" });
                    }
                    let mut got = vec![f32::NAN; rows * n_tokens];
                    dot::matmul_f32_packed_ordered(p, &x, n_tokens, &mut got, &pool, order)
                        .unwrap();
                    same(&got, "packed f32");
                }
            }
        }
    }
}

/// The packed 16-row kernels at the edges of their integer sums: weights with every quant at
/// its extreme (`Q8_0`'s -128 and 127, the nibbles 0 and 15) against activations all at +-127
/// give the largest block and group sums the formats allow, both signs (random data seldom comes
/// near them); every packed product (both orders, one token and many) gives the scalar
/// reference's results bit for bit.
#[test]
fn dot_packed_extreme_sums_are_exact() {
    for isa in [Isa::Avx512, Isa::Avx2] {
        if isa.available() {
            packed_extreme_sums_are_exact(isa);
        } else {
            println!("skipping {}: not available on this CPU", isa.name());
        }
    }
}

fn packed_extreme_sums_are_exact(isa: Isa) {
    let pool = Pool::new(2).unwrap();
    let (rows, cols) = (32usize, 256usize);
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
        let bs = ty.type_size();
        // Bytes before the quants: d (and m for Q4_1), both 1.0 in f16.
        let head = if ty == GgmlType::Q4_1 { 4 } else { 2 };
        for fill in [0x00u8, 0xff, 0x80, 0x7f, 0x0f, 0xf0] {
            let block: Vec<u8> = (0..bs)
                .map(|i| match i {
                    _ if i < head && i % 2 == 0 => 0x00,
                    _ if i < head => 0x3c,
                    _ => fill,
                })
                .collect();
            let w: Vec<u8> = (0..rows * cols / 32).flat_map(|_| block.clone()).collect();
            let p = dot::PackedMat::pack_with_isa(ty, &w, rows, cols, isa)
                .unwrap()
                .expect("16-row groups pack");
            for pattern in 0..3 {
                let n_tokens = 9;
                let x: Vec<f32> = (0..n_tokens * cols)
                    .map(|i| match pattern {
                        0 => 1.0,
                        1 => -1.0,
                        _ => [1.0, -1.0][(i / 4) % 2],
                    })
                    .collect();
                let acts = quantized_acts(ty, &x, n_tokens, cols, Isa::Scalar);
                for order in dot::SumOrder::ALL {
                    for n in [1usize, n_tokens] {
                        let rb = dot::row_bytes(ty, cols).unwrap();
                        let mut got = vec![f32::NAN; rows * n];
                        dot::matmul_f32_packed_ordered(
                            &p,
                            &x[..n * cols],
                            n,
                            &mut got,
                            &pool,
                            order,
                        )
                        .unwrap();
                        for t in 0..n {
                            for r in 0..rows {
                                let want = dot::vec_dot_ordered(
                                    ty,
                                    &w[r * rb..(r + 1) * rb],
                                    acts.row(t).unwrap(),
                                    cols,
                                    Isa::Scalar,
                                    order,
                                )
                                .unwrap();
                                let g = got[t * rows + r];
                                assert_eq!(
                                    want.to_bits(),
                                    g.to_bits(),
                                    "{} {ty} fill {fill:#04x} pattern {pattern} {order:?} {n} \
                                     tokens: token {t} row {r}: scalar {want} vs packed {g}",
                                    isa.name()
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The packed `Q4_K` and `Q6_K` kernels of every level this CPU has, at the edges of their
/// integer sums: every value at its largest (Q4_K nibbles 15, Q6_K 6-bit values 63; or 0, or
/// half of them), every Q4_K scale and min 63, every Q6_K scale -128 or 127, against
/// activations that quantize to -127 throughout (all +1.0 or all -1.0: Q8_K's extreme, its
/// scale's sign following the largest value) or to alternating signs. AVX2 keeps a sub-block's
/// products in i16 (Q4_K: 8 pairs of up to 15 * 127 each; Q6_K: 2 pairs of up to 63 * 127),
/// so this is where an overflow or a saturation would show; every product (one token, groups
/// of 4 and the tokens left over) is the scalar reference's bit for bit.
#[test]
fn dot_packed_kquant_extreme_sums_are_exact() {
    let pool = Pool::new(2).unwrap();
    let (rows, cols) = (32usize, 512usize);
    let mut ran = false;
    for isa in [Isa::Avx512, Isa::Avx2] {
        if !isa.available() {
            println!("skipping {}: not available on this CPU", isa.name());
            continue;
        }
        ran = true;
        let cases = [
            (GgmlType::Q4K, 0xffu8, 0xffu8),
            (GgmlType::Q4K, 0x00, 0xff),
            (GgmlType::Q4K, 0x0f, 0xff),
            (GgmlType::Q4K, 0xf0, 0xff),
            (GgmlType::Q6K, 0xff, 0x80),
            (GgmlType::Q6K, 0xff, 0x7f),
            (GgmlType::Q6K, 0x00, 0x80),
            (GgmlType::Q6K, 0x0f, 0x80),
        ];
        for (ty, fill, scale) in cases {
            if !dot::PackedMat::packable(ty, rows, cols, isa) {
                continue;
            }
            // Q4_K: d = dmin = 1.0 (f16 0x3c00), the 12 scale bytes `scale` (0xff: every scale
            // and min 63). Q6_K: ql and qh `fill`, the 16 scales `scale`, d = 1.0.
            let block: Vec<u8> = if ty == GgmlType::Q4K {
                (0..144)
                    .map(|i| match i {
                        0 | 2 => 0x00,
                        1 | 3 => 0x3c,
                        4..16 => scale,
                        _ => fill,
                    })
                    .collect()
            } else {
                (0..210)
                    .map(|i| match i {
                        0..192 => fill,
                        192..208 => scale,
                        208 => 0x00,
                        _ => 0x3c,
                    })
                    .collect()
            };
            let per_row = cols / 256 * block.len();
            let w: Vec<u8> = (0..rows * cols / 256).flat_map(|_| block.clone()).collect();
            assert_eq!(w.len(), rows * per_row);
            let p = dot::PackedMat::pack_with_isa(ty, &w, rows, cols, isa)
                .unwrap()
                .expect("16-row groups pack");
            for pattern in 0..3 {
                let n_tokens = 9;
                let x: Vec<f32> = (0..n_tokens * cols)
                    .map(|i| match pattern {
                        0 => 1.0,
                        1 => -1.0,
                        _ => [1.0, -1.0][(i / 4) % 2],
                    })
                    .collect();
                for n in [1usize, 4, n_tokens] {
                    let a = quantized_acts(ty, &x[..n * cols], n, cols, Isa::Scalar);
                    if pattern < 2 {
                        // Every activation byte at -127 (Q8_K's extreme).
                        assert!(a.row(0).unwrap()[4..260].iter().all(|&q| q == 0x81));
                    }
                    let mut want = vec![f32::NAN; rows * n];
                    dot::matmul_with_isa(ty, &w, rows, cols, &a, &mut want, &pool, Isa::Scalar)
                        .unwrap();
                    let mut got = vec![f32::NAN; rows * n];
                    dot::matmul_packed(&p, &a, &mut got, &pool).unwrap();
                    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                        assert_eq!(
                            w.to_bits(),
                            g.to_bits(),
                            "{} {ty} fill {fill:#04x} scale {scale:#04x} pattern {pattern} \
                             {n} tokens: element {i}: scalar {w} vs packed {g}",
                            isa.name()
                        );
                    }
                }
            }
        }
    }
    if !ran {
        println!("skipping: no packed K-quant kernel on this CPU");
    }
}

/// Both orders combine the same exact per-block terms `d_b * isum_b` (and `m_b * s_b`); measured
/// against their exact f64 sum over many random rows and lengths, the whole-block order (one
/// rounding per block instead of eight plus the final tree) is on average at least as close as
/// ggml's, and both stay within a few f32 roundings of the terms' magnitude. The figures are
/// printed (`-- --nocapture`).
#[test]
fn dot_block_order_accuracy_against_exact_sum() {
    let mut rng = Rng(0xacc0_0001);
    for ty in LEGACY_TYPES {
        let (mut err_g, mut err_b, mut mag) = (0f64, 0f64, 0f64);
        let (mut worse, mut n) = (0usize, 0usize);
        for &cols in &[64usize, 576, 1536, 4096] {
            for _ in 0..60 {
                let w = weight_row(&mut rng, ty, cols, false);
                let x = rng.acts(cols);
                let acts = quantized_acts(ty, &x, 1, cols, Isa::Scalar);
                let a = acts.row(0).unwrap();
                let (exact, abs) = exact_block_terms(ty, &w, a, cols);
                let g = dot::vec_dot_ordered(ty, &w, a, cols, Isa::Scalar, dot::SumOrder::Ggml)
                    .unwrap() as f64;
                let b = dot::vec_dot_ordered(ty, &w, a, cols, Isa::Scalar, dot::SumOrder::Block)
                    .unwrap() as f64;
                err_g += (g - exact).abs();
                err_b += (b - exact).abs();
                mag += abs;
                worse += usize::from((b - exact).abs() > (g - exact).abs());
                n += 1;
            }
        }
        println!(
            "{ty}: mean |error| vs the exact sum of the block terms: ggml {:.3e}, block {:.3e} \
             (mean sum of the terms' magnitudes {:.3e}); block further than ggml in {worse} of {n}",
            err_g / n as f64,
            err_b / n as f64,
            mag / n as f64
        );
        // A few roundings of 2^-24 of the result, whichever order.
        assert!(
            err_b / mag < 4e-7,
            "{ty}: block order relative error {}",
            err_b / mag
        );
        assert!(
            err_g / mag < 4e-7,
            "{ty}: ggml order relative error {}",
            err_g / mag
        );
    }
}

/// `sum_b (d_w * d_y in f32) * isum_b + sum_b m_b * s_b`, in f64: the exact value both orders
/// round, from the scale fields and the integer dot of each block; and the sum of the terms'
/// magnitudes.
fn exact_block_terms(ty: GgmlType, w: &[u8], a: &[u8], cols: usize) -> (f64, f64) {
    let (wb, ab) = (
        ty.type_size(),
        if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
            36
        } else {
            34
        },
    );
    let f16 = |b: &[u8], o: usize| f16::from_le_bytes([b[o], b[o + 1]]).to_f32();
    let (mut s, mut abs) = (0f64, 0f64);
    for b in 0..cols / 32 {
        let (x, y) = (&w[b * wb..(b + 1) * wb], &a[b * ab..(b + 1) * ab]);
        // The weight block's values as integers: dequantize with d = 1, m = 0.
        let mut unit = x.to_vec();
        unit[0..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
            unit[2..4].copy_from_slice(&f16::ZERO.to_le_bytes());
        }
        let q = quant::dequantize_to_vec(ty, &unit, 32).unwrap();
        let yq = &y[ab - 32..];
        let isum: i64 = q
            .iter()
            .zip(yq)
            .map(|(&v, &u)| v as i64 * u as i8 as i64)
            .sum();
        let d = f16(x, 0) * f16(y, 0);
        let t = d as f64 * isum as f64;
        s += t;
        abs += t.abs();
        if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
            let m = f16(x, 2) as f64 * f16(y, 2) as f64;
            s += m;
            abs += m.abs();
        }
    }
    (s, abs)
}

#[test]
fn dot_sum_order_names_round_trip() {
    for o in dot::SumOrder::ALL {
        assert_eq!(dot::SumOrder::from_name(o.name()), Some(o));
        assert_eq!(
            dot::SumOrder::from_name(&format!(" {} ", o.name().to_uppercase())),
            Some(o)
        );
    }
    assert_eq!(dot::SumOrder::from_name("fast"), None);
    assert_eq!(dot::SumOrder::default(), dot::SumOrder::Ggml);
}

/// Packed products of one dispatch (`matmul_f32_packed_multi_ordered`, the engine's Q/K/V and
/// gate/up) give each matrix's results of a product alone, bit for bit, in both orders, for
/// decode and many tokens; matrices that differ in type, row length or layout are refused.
#[test]
fn dot_packed_multi_equals_separate_products() {
    let mut rng = Rng(0x3a17_0001);
    let pool = Pool::new(2).unwrap();
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4K] {
        let cols = 512;
        let mats: Vec<dot::PackedMat> = [64usize, 16, 32]
            .iter()
            .map(|&rows| {
                let w: Vec<u8> = (0..rows)
                    .flat_map(|_| weight_row(&mut rng, ty, cols, false))
                    .collect();
                match dot::PackedMat::pack(ty, &w, rows, cols).unwrap() {
                    Some(p) => p,
                    None => dot::PackedMat::copy(ty, &w, rows, cols).unwrap(),
                }
            })
            .collect();
        for order in dot::SumOrder::ALL {
            for n_tokens in [1usize, 5, 19, 64] {
                let x = rng.acts(n_tokens * cols);
                let want: Vec<Vec<f32>> = mats
                    .iter()
                    .map(|m| {
                        let mut o = vec![f32::NAN; n_tokens * m.rows()];
                        dot::matmul_f32_packed_ordered(m, &x, n_tokens, &mut o, &pool, order)
                            .unwrap();
                        o
                    })
                    .collect();
                let mut outs: Vec<Vec<f32>> = mats
                    .iter()
                    .map(|m| vec![f32::NAN; n_tokens * m.rows()])
                    .collect();
                let mut pairs: Vec<(&dot::PackedMat, &mut [f32])> = mats
                    .iter()
                    .zip(outs.iter_mut())
                    .map(|(m, o)| (m, &mut o[..]))
                    .collect();
                dot::matmul_f32_packed_multi_ordered(&mut pairs, &x, n_tokens, &pool, order)
                    .unwrap();
                for (i, (a, b)) in want.iter().zip(&outs).enumerate() {
                    let same = a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
                    assert!(same, "{ty} {order} {n_tokens} tokens: matrix {i} differs");
                }
            }
        }
    }
    let a = dot::PackedMat::copy(GgmlType::Q8_0, &[0u8; 34 * 2], 1, 64).unwrap();
    let b = dot::PackedMat::copy(GgmlType::Q8_0, &[0u8; 34], 1, 32).unwrap();
    let (mut oa, mut ob) = (vec![0f32; 1], vec![0f32; 1]);
    let err = dot::matmul_f32_packed_multi_ordered(
        &mut [(&a, &mut oa[..]), (&b, &mut ob[..])],
        &[0.5; 64],
        1,
        &pool,
        dot::SumOrder::Block,
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            DotError::Mixed {
                what: "columns",
                ..
            }
        ),
        "{err}"
    );
}
