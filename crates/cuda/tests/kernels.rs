//! Each GPU kernel against a scalar CPU reference (crates/quant's dequantizer and plain f64
//! math) on fresh random inputs. Skips, saying so, where no GPU is present.

mod seed;

use cuda::kernels::{act_bytes, act_format, matrix_bytes, ActFormat, OutQuant, QTYPES, TYPES};
use cuda::{DevBuf, Gpu};
use gguf::GgmlType;
use half::f16;
use quant::dot::Isa;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

fn gpu_or_skip(test: &str) -> Option<Gpu> {
    match cuda::available() {
        Ok(_) => Some(Gpu::new(0).unwrap_or_else(|e| panic!("GPU present but unusable: {e}"))),
        Err(e) => {
            eprintln!("SKIPPED {test}: {e}");
            None
        }
    }
}

fn rng(test: &str) -> ChaCha8Rng {
    seed::rng(test)
}

fn randn(r: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            // Sum of uniforms: roughly normal, with outliers rare enough.
            let s: f32 = (0..4).map(|_| r.gen::<f32>() - 0.5).sum();
            s * scale
        })
        .collect()
}

fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    assert!(a.iter().all(|x| x.is_finite()), "non-finite GPU output");
    (num / den.max(1e-30)).sqrt()
}

fn quantized(ty: GgmlType, vals: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let q = quant::quantize_to_vec(ty, vals).expect("quantize");
    let d = quant::dequantize_to_vec(ty, &q, vals.len()).expect("dequantize");
    (q, d)
}

/// A paged KV cache of `n_blocks` blocks of `bt` positions of `kv_row` values: random K and V
/// as f16 bits, and a shuffled block table (sequence s's block i is entry s * max_blocks + i).
fn paged_kv(
    r: &mut ChaCha8Rng,
    n_blocks: usize,
    bt: usize,
    kv_row: usize,
) -> (Vec<u16>, Vec<u16>, Vec<i32>) {
    let half = |r: &mut ChaCha8Rng| -> Vec<u16> {
        randn(r, n_blocks * bt * kv_row, 1.0)
            .iter()
            .map(|&v| f16::from_f32(v).to_bits())
            .collect()
    };
    let (kh, vh) = (half(r), half(r));
    let mut btab: Vec<i32> = (0..n_blocks as i32).collect();
    for i in (1..btab.len()).rev() {
        btab.swap(i, r.gen_range(0..=i));
    }
    (kh, vh, btab)
}

/// Poisoned output buffer (NaN bytes), so an unwritten element fails the comparison.
fn poisoned(g: &Gpu, floats: usize) -> DevBuf {
    g.upload(&vec![f32::NAN; floats]).expect("alloc")
}

/// The RMS slots at `ss` hold the sum of the squares of `y` (f64, to 1e-12 relative).
fn assert_slots_hold_squares(g: &Gpu, ss: &DevBuf, y: &[f32], what: &str) {
    let sums: Vec<f64> = g.download(ss, cuda::kernels::RMS_SLOTS).unwrap();
    let want: f64 = y.iter().map(|&v| v as f64 * v as f64).sum();
    let got: f64 = sums.iter().sum();
    assert!(
        (got - want).abs() <= 1e-12 * want,
        "{what}: slots sum to {got}, the rows' squares to {want}"
    );
}

/// One token `x` quantized to Q8_K for the K-quant one-token products: on the GPU (int8 values,
/// scales) and by the CPU's scalar code (the reference's activation).
fn q8k_token(g: &Gpu, x: &[f32]) -> (DevBuf, DevBuf, quant::dot::ActBuf) {
    let cols = x.len();
    let xb = g.upload(x).unwrap();
    let (qb, db) = act_bufs(g, 1, cols);
    g.quantize_act(xb.ptr(), 1, cols, ActFormat::Q8K, qb.ptr(), db.ptr())
        .unwrap();
    let mut buf = quant::dot::ActBuf::new();
    quant::dot::quantize_acts_with_isa(GgmlType::Q4K, x, 1, cols, &mut buf, Isa::Scalar).unwrap();
    (qb, db, buf)
}

/// The CPU's scalar `vec_dot` of every row of the `ty` matrix `q` (`rows` x `cols`) with the
/// first activation row of `a`.
fn cpu_rows(ty: GgmlType, q: &[u8], rows: usize, cols: usize, a: &quant::dot::ActBuf) -> Vec<f64> {
    let rb = q.len() / rows;
    let a = a.row(0).unwrap();
    (0..rows)
        .map(|i| {
            quant::dot::vec_dot(ty, &q[i * rb..(i + 1) * rb], a, cols, Isa::Scalar).unwrap() as f64
        })
        .collect()
}

#[test]
fn get_rows_and_dequant_match_cpu_dequantizer_for_every_type() {
    let Some(g) = gpu_or_skip("get_rows") else {
        return;
    };
    let mut r = rng("get_rows");
    let (rows, cols) = (7, 512);
    for &(ty, name) in TYPES {
        let vals = randn(&mut r, rows * cols, 1.0);
        let (q, want) = quantized(ty, &vals);
        assert_eq!(q.len(), matrix_bytes(ty, rows, cols));
        let w = g.upload(&q).unwrap();
        // Rows in a shuffled order with a repeat.
        let ids: Vec<i32> = vec![3, 0, 6, 3, 1, 5, 2, 4];
        let idb = g.upload(&ids).unwrap();
        let out = poisoned(&g, ids.len() * cols);
        g.get_rows(ty, w.ptr(), cols, idb.ptr(), ids.len(), out.ptr())
            .unwrap();
        let got: Vec<f32> = g.download(&out, ids.len() * cols).unwrap();
        for (i, &id) in ids.iter().enumerate() {
            for c in 0..cols {
                let (a, b) = (got[i * cols + c], want[id as usize * cols + c]);
                // Same formula as the CPU; only fused multiply-add rounding may differ.
                assert!(
                    (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                    "{name}: row {id} col {c}: gpu {a} cpu {b}"
                );
            }
        }
        let h = g.upload(&vec![0xffffu16; rows * cols]).unwrap();
        g.dequant_f16(ty, w.ptr(), rows, cols, h.ptr()).unwrap();
        let got: Vec<u16> = g.download(&h, rows * cols).unwrap();
        for (i, (&a, &b)) in got.iter().zip(&want).enumerate() {
            let a = f16::from_bits(a).to_f32();
            assert!(
                (a - b).abs() <= 1e-3 * b.abs() + 1e-6,
                "{name} f16 element {i}: gpu {a} cpu {b}"
            );
        }
    }
}

#[test]
fn matvec_matches_f64_reference_for_every_type_and_token_count() {
    let Some(g) = gpu_or_skip("matvec") else {
        return;
    };
    let mut r = rng("matvec");
    let (rows, cols) = (37, 768);
    for &(ty, name) in TYPES {
        let vals = randn(&mut r, rows * cols, 0.5);
        let (q, wd) = quantized(ty, &vals);
        let w = g.upload(&q).unwrap();
        let wu_vals = randn(&mut r, rows * cols, 0.5);
        let (qu, wud) = quantized(ty, &wu_vals);
        let wu = g.upload(&qu).unwrap();
        for nt in [1usize, 2, 3, 5, 8] {
            let x = randn(&mut r, nt * cols, 1.0);
            let xb = g.upload(&x).unwrap();
            let refy = |wm: &[f32]| -> Vec<f64> {
                let mut y = vec![0f64; nt * rows];
                for t in 0..nt {
                    for rr in 0..rows {
                        y[t * rows + rr] = (0..cols)
                            .map(|c| wm[rr * cols + c] as f64 * x[t * cols + c] as f64)
                            .sum();
                    }
                }
                y
            };
            let want = refy(&wd);
            let y = poisoned(&g, nt * rows);
            g.matvec(ty, w.ptr(), rows, cols, xb.ptr(), nt, y.ptr(), false)
                .unwrap();
            let got: Vec<f32> = g.download(&y, nt * rows).unwrap();
            let e = rel_err(&got, &want);
            assert!(e < 1e-5, "{name} nt={nt}: relative error {e:e}");

            // Several rows per warp (the one-token kernels for tall matrices).
            if nt == 1 {
                for rpw in [2usize, 4] {
                    let y = poisoned(&g, rows);
                    g.matvec_r(ty, w.ptr(), rows, cols, xb.ptr(), 1, y.ptr(), false, rpw)
                        .unwrap();
                    let got: Vec<f32> = g.download(&y, rows).unwrap();
                    let e = rel_err(&got, &want);
                    assert!(e < 1e-5, "{name} {rpw} rows/warp: relative error {e:e}");
                }
            }

            // Accumulate into a random residual.
            let y0 = randn(&mut r, nt * rows, 1.0);
            let yb = g.upload(&y0).unwrap();
            g.matvec(ty, w.ptr(), rows, cols, xb.ptr(), nt, yb.ptr(), true)
                .unwrap();
            let got: Vec<f32> = g.download(&yb, nt * rows).unwrap();
            let want2: Vec<f64> = want.iter().zip(&y0).map(|(a, &b)| a + b as f64).collect();
            let e = rel_err(&got, &want2);
            assert!(e < 1e-5, "{name} nt={nt} accumulate: relative error {e:e}");

            // Gate/up with SwiGLU.
            let wantu = refy(&wud);
            let want3: Vec<f64> = want
                .iter()
                .zip(&wantu)
                .map(|(&gg, &u)| gg / (1.0 + (-gg).exp()) * u)
                .collect();
            let ys = poisoned(&g, nt * rows);
            g.matvec_swiglu(ty, w.ptr(), wu.ptr(), rows, cols, xb.ptr(), nt, ys.ptr())
                .unwrap();
            let got: Vec<f32> = g.download(&ys, nt * rows).unwrap();
            let e = rel_err(&got, &want3);
            assert!(e < 1e-5, "{name} nt={nt} swiglu: relative error {e:e}");
        }
    }
}

/// Activation buffers (int8 values, scales) poisoned with 0x7f / NaN bytes.
fn act_bufs(g: &Gpu, rows: usize, cols: usize) -> (DevBuf, DevBuf) {
    let (qb, db) = act_bytes(rows, cols);
    (
        g.upload(&vec![0x7fu8; qb]).unwrap(),
        g.upload(&vec![0xffu8; db]).unwrap(),
    )
}

/// The GPU's activation quantization against the CPU backend's (`quant::dot::quantize_acts`,
/// scalar): every int8 value, scale, sum and sum of 16 bit for bit, with planted edge cases
/// (a block of zeros, a block whose largest magnitudes tie with opposite signs, tiny values).
#[test]
fn quantize_act_is_bit_identical_to_cpu() {
    let Some(g) = gpu_or_skip("quantize_act") else {
        return;
    };
    let mut r = rng("quantize_act");
    let (rows, cols) = (3, 1024);
    for (wty, fmt) in [
        (GgmlType::Q4_1, ActFormat::Q8x32),
        (GgmlType::Q4K, ActFormat::Q8K),
    ] {
        let mut x = randn(&mut r, rows * cols, 3.0);
        x[256..512].iter_mut().for_each(|v| *v = 0.0);
        x[600] = 9.5;
        x[700] = -9.5;
        x[1030] = -9.5;
        x[1100] = 9.5;
        x[2048..2304].iter_mut().for_each(|v| *v *= 1e-30);
        let mut buf = quant::dot::ActBuf::new();
        quant::dot::quantize_acts_with_isa(wty, &x, rows, cols, &mut buf, Isa::Scalar).unwrap();
        let xb = g.upload(&x).unwrap();
        let (qb, db) = act_bufs(&g, rows, cols);
        g.quantize_act(xb.ptr(), rows, cols, fmt, qb.ptr(), db.ptr())
            .unwrap();
        let q: Vec<i8> = g.download(&qb, rows * cols).unwrap();
        let d: Vec<u32> = g.download(&db, rows * cols / 16).unwrap();
        let bytes = buf.bytes();
        let h16 = |b: &[u8]| f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
        for row in 0..rows {
            for u in 0..cols / 32 {
                let gq = &q[row * cols + 32 * u..row * cols + 32 * u + 32];
                let (gd, gs) = (
                    d[2 * (row * cols / 32 + u)],
                    d[2 * (row * cols / 32 + u) + 1],
                );
                match fmt {
                    ActFormat::Q8x32 => {
                        let b = &bytes[(row * cols / 32 + u) * 36..][..36];
                        let cq: Vec<i8> = b[4..36].iter().map(|&v| v as i8).collect();
                        assert_eq!(gq, &cq[..], "row {row} block {u}: int8 values");
                        assert_eq!(gd, h16(&b[0..2]).to_bits(), "row {row} block {u}: d");
                        assert_eq!(gs, h16(&b[2..4]).to_bits(), "row {row} block {u}: s");
                    }
                    ActFormat::Q8K => {
                        let (sb, j) = (u / 8, u % 8);
                        let b = &bytes[(row * cols / 256 + sb) * 292..][..292];
                        let cq: Vec<i8> = b[4 + 32 * j..4 + 32 * j + 32]
                            .iter()
                            .map(|&v| v as i8)
                            .collect();
                        assert_eq!(gq, &cq[..], "row {row} unit {u}: int8 values");
                        let cd = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                        assert_eq!(gd, cd, "row {row} unit {u}: d");
                        let bs = |k: usize| {
                            i16::from_le_bytes([b[260 + 2 * k], b[261 + 2 * k]]) as i32 as u32
                        };
                        let want = (bs(2 * j) & 0xffff) | (bs(2 * j + 1) << 16);
                        assert_eq!(gs, want, "row {row} unit {u}: sums of 16");
                    }
                }
            }
        }
        // Session 35: one row at a time as a warp per group (`quantize_act1`, `Gpu::quant1`)
        // writes the bytes checked above.
        let q1_0 = g.quant1.get();
        g.quant1.set(true);
        let (qb1, db1) = act_bufs(&g, rows, cols);
        for row in 0..rows {
            g.quantize_act(
                xb.ptr() + (row * cols * 4) as u64,
                1,
                cols,
                fmt,
                qb1.ptr() + (row * cols) as u64,
                db1.ptr() + (row * cols / 32 * 8) as u64,
            )
            .unwrap();
        }
        g.quant1.set(q1_0);
        let q1: Vec<i8> = g.download(&qb1, rows * cols).unwrap();
        let d1: Vec<u32> = g.download(&db1, rows * cols / 16).unwrap();
        assert_eq!(q1, q, "{fmt:?}: quantize_act1's int8 values");
        assert_eq!(d1, d, "{fmt:?}: quantize_act1's scales and sums");
    }
}

/// The GEMM path's activation operand: `f16(d * q)` of the CPU backend's own quantized
/// activations (`quant::dot::quantize_acts`, scalar), bit for bit, for both formats and for
/// weight types of each, with the planted edge cases of the test above.
#[test]
fn quantize_act_f16_is_the_cpu_quantized_value() {
    let Some(g) = gpu_or_skip("quantize_act_f16") else {
        return;
    };
    let mut r = rng("quantize_act_f16");
    let (rows, cols) = (5, 1536);
    for wty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K] {
        let fmt = act_format(wty).unwrap();
        let mut x = randn(&mut r, rows * cols, 2.0);
        x[256..512].iter_mut().for_each(|v| *v = 0.0);
        x[600] = 7.25;
        x[700] = -7.25;
        x[1600] = -7.25;
        x[1700] = 7.25;
        x[3072..3328].iter_mut().for_each(|v| *v *= 1e-30);
        let mut buf = quant::dot::ActBuf::new();
        quant::dot::quantize_acts_with_isa(wty, &x, rows, cols, &mut buf, Isa::Scalar).unwrap();
        let bytes = buf.bytes();
        let h16 = |b: &[u8]| f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
        let mut want = vec![0u16; rows * cols];
        for (i, w) in want.iter_mut().enumerate() {
            let (d, q) = match fmt {
                ActFormat::Q8x32 => {
                    // Q8_0 blocks are {d, q[32]}, Q8_1 blocks {d, s, q[32]}.
                    let hdr = if quant::dot::act_type(wty).unwrap() == GgmlType::Q8_1 {
                        4
                    } else {
                        2
                    };
                    let b = &bytes[(i / 32) * (hdr + 32)..][..hdr + 32];
                    (h16(&b[0..2]), b[hdr + i % 32] as i8)
                }
                ActFormat::Q8K => {
                    let b = &bytes[(i / 256) * 292..][..292];
                    (
                        f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                        b[4 + i % 256] as i8,
                    )
                }
            };
            *w = f16::from_f32(d * q as f32).to_bits();
        }
        let xb = g.upload(&x).unwrap();
        let out = g.upload(&vec![0xffffu16; rows * cols]).unwrap();
        g.quantize_act_f16(xb.ptr(), rows, cols, fmt, out.ptr())
            .unwrap();
        let got: Vec<u16> = g.download(&out, rows * cols).unwrap();
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                a,
                b,
                "{wty}: row {} col {}: GPU {} vs CPU {} (x = {})",
                i / cols,
                i % cols,
                f16::from_bits(*a),
                f16::from_bits(*b),
                x[i]
            );
        }
    }
}

/// Integer-dot matrix-vector kernels (plain, accumulating, SwiGLU) for every quantized type and
/// token count against the CPU backend's scalar `vec_dot` on the CPU's own quantized activations.
#[test]
fn matvec_q_matches_cpu_scalar_vec_dot() {
    let Some(g) = gpu_or_skip("matvec_q") else {
        return;
    };
    let mut r = rng("matvec_q");
    for &(rows, cols) in &[(37usize, 768usize), (5, 8192)] {
        for &(ty, name) in QTYPES {
            let fmt = act_format(ty).unwrap();
            let (q, _) = quantized(ty, &randn(&mut r, rows * cols, 0.5));
            let (qu, _) = quantized(ty, &randn(&mut r, rows * cols, 0.5));
            let (w, wu) = (g.upload(&q).unwrap(), g.upload(&qu).unwrap());
            let rb = q.len() / rows;
            // One token: the two-rows-per-warp kernels (mvr) and the block-per-row ones.
            for (nt, warp) in [
                (1usize, true),
                (1, false),
                (2, false),
                (3, false),
                (5, false),
                (8, false),
            ] {
                g.mvr.set(warp);
                // v10: wider rows one warp per row (mvd) with mvr, block per row without.
                g.warp_rows.set(warp);
                let x = randn(&mut r, nt * cols, 1.0);
                let mut buf = quant::dot::ActBuf::new();
                quant::dot::quantize_acts_with_isa(ty, &x, nt, cols, &mut buf, Isa::Scalar)
                    .unwrap();
                let refy = |wq: &[u8]| -> Vec<f64> {
                    let mut y = vec![0f64; nt * rows];
                    for t in 0..nt {
                        for rr in 0..rows {
                            let a = buf.row(t).unwrap();
                            y[t * rows + rr] = quant::dot::vec_dot(
                                ty,
                                &wq[rr * rb..(rr + 1) * rb],
                                a,
                                cols,
                                Isa::Scalar,
                            )
                            .unwrap() as f64;
                        }
                    }
                    y
                };
                let want = refy(&q);
                let xb = g.upload(&x).unwrap();
                let (qb, db) = act_bufs(&g, nt, cols);
                g.quantize_act(xb.ptr(), nt, cols, fmt, qb.ptr(), db.ptr())
                    .unwrap();
                let y = poisoned(&g, nt * rows);
                g.matvec_q(
                    ty,
                    w.ptr(),
                    rows,
                    cols,
                    qb.ptr(),
                    db.ptr(),
                    nt,
                    y.ptr(),
                    false,
                )
                .unwrap();
                let got: Vec<f32> = g.download(&y, nt * rows).unwrap();
                // Same integer sums, same per-unit scaling; only the order of float additions
                // across units differs (256 terms of both signs: 2.03e-6 was seen once).
                let e = rel_err(&got, &want);
                assert!(
                    e < 5e-6,
                    "{name} {rows}x{cols} nt={nt} mvr={warp}: relative error {e:e}"
                );

                let y0 = randn(&mut r, nt * rows, 1.0);
                let yb = g.upload(&y0).unwrap();
                g.matvec_q(
                    ty,
                    w.ptr(),
                    rows,
                    cols,
                    qb.ptr(),
                    db.ptr(),
                    nt,
                    yb.ptr(),
                    true,
                )
                .unwrap();
                let got: Vec<f32> = g.download(&yb, nt * rows).unwrap();
                let want2: Vec<f64> = want.iter().zip(&y0).map(|(a, &b)| a + b as f64).collect();
                let e = rel_err(&got, &want2);
                assert!(
                    e < 5e-6,
                    "{name} nt={nt} mvr={warp} accumulate: relative error {e:e}"
                );

                let wantu = refy(&qu);
                let want3: Vec<f64> = want
                    .iter()
                    .zip(&wantu)
                    .map(|(&gg, &u)| gg / (1.0 + (-gg).exp()) * u)
                    .collect();
                let ys = poisoned(&g, nt * rows);
                g.matvec_q_swiglu(
                    ty,
                    w.ptr(),
                    wu.ptr(),
                    rows,
                    cols,
                    qb.ptr(),
                    db.ptr(),
                    nt,
                    ys.ptr(),
                )
                .unwrap();
                let got: Vec<f32> = g.download(&ys, nt * rows).unwrap();
                // silu(g) * u multiplies each product's rounding (relative to the size of its
                // terms, which for the K-quants' d*isum - dmin*msum can exceed the result) by |u|.
                let e = rel_err(&got, &want3);
                assert!(
                    e < 1e-4,
                    "{name} nt={nt} mvr={warp} swiglu: relative error {e:e}"
                );
            }
        }
    }
}

/// The one-token kernel over three matrices in one launch (a layer's Q, K and V), with row
/// counts that put a warp's two rows across matrix boundaries, against the CPU's scalar
/// `vec_dot`; every output row checked written (poisoned buffers), accumulate form too.
/// The tensor-core integer GEMM of batched decode (`mmq_*`, 9..64 tokens) against the CPU's
/// scalar `vec_dot` on the CPU's own quantized activations: every type, every token tile,
/// row counts that leave a partial 64-row tile, token counts that leave a partial token tile,
/// rows whose length is not a whole 256-element step (legacy types), plain and accumulating.
#[test]
fn matmul_q_matches_cpu_scalar_vec_dot() {
    let Some(g) = gpu_or_skip("matmul_q") else {
        return;
    };
    let mut r = rng("matmul_q");
    for &(ty, name) in QTYPES {
        let fmt = act_format(ty).unwrap();
        let legacy = ty.block_size() == 32;
        let shapes: &[(usize, usize)] = if legacy {
            &[(100, 768), (70, 544)]
        } else {
            &[(100, 768), (70, 512)]
        };
        for &(rows, cols) in shapes {
            let (q, _) = quantized(ty, &randn(&mut r, rows * cols, 0.5));
            let w = g.upload(&q).unwrap();
            let rb = q.len() / rows;
            for (n, nb) in [
                (9usize, 2usize),
                (16, 2),
                (37, 4),
                (64, 8),
                (50, 2),
                (20, 8),
            ] {
                let x = randn(&mut r, n * cols, 1.0);
                let mut buf = quant::dot::ActBuf::new();
                quant::dot::quantize_acts_with_isa(ty, &x, n, cols, &mut buf, Isa::Scalar).unwrap();
                let mut want = vec![0f64; n * rows];
                for t in 0..n {
                    let a = buf.row(t).unwrap();
                    for rr in 0..rows {
                        want[t * rows + rr] = quant::dot::vec_dot(
                            ty,
                            &q[rr * rb..(rr + 1) * rb],
                            a,
                            cols,
                            Isa::Scalar,
                        )
                        .unwrap() as f64;
                    }
                }
                let xb = g.upload(&x).unwrap();
                let (qb, db) = act_bufs(&g, n, cols);
                g.quantize_act(xb.ptr(), n, cols, fmt, qb.ptr(), db.ptr())
                    .unwrap();
                let y = poisoned(&g, n * rows);
                g.matmul_q_nb(
                    ty,
                    w.ptr(),
                    rows,
                    cols,
                    qb.ptr(),
                    db.ptr(),
                    n,
                    y.ptr(),
                    false,
                    nb,
                )
                .unwrap();
                let got: Vec<f32> = g.download(&y, n * rows).unwrap();
                // Same integer sums; the K-quants fold them per super-block as the CPU does,
                // the other types per unit as the matrix-vector kernels do (float order only).
                let e = rel_err(&got, &want);
                assert!(
                    e < 5e-6,
                    "{name} {rows}x{cols} n={n} nb={nb}: relative error {e:e}"
                );
                let y0 = randn(&mut r, n * rows, 1.0);
                let yb = g.upload(&y0).unwrap();
                g.matmul_q(
                    ty,
                    w.ptr(),
                    rows,
                    cols,
                    qb.ptr(),
                    db.ptr(),
                    n,
                    yb.ptr(),
                    true,
                )
                .unwrap();
                let got: Vec<f32> = g.download(&yb, n * rows).unwrap();
                let want2: Vec<f64> = want.iter().zip(&y0).map(|(a, &b)| a + b as f64).collect();
                let e = rel_err(&got, &want2);
                assert!(
                    e < 5e-6,
                    "{name} {rows}x{cols} n={n} accumulate: relative error {e:e}"
                );
            }
        }
    }
}

#[test]
fn matvec_q_multi_matches_cpu_scalar_vec_dot() {
    let Some(g) = gpu_or_skip("matvec_q_multi") else {
        return;
    };
    let mut r = rng("matvec_q_multi");
    let cols = 3072;
    for &(ty, name) in QTYPES {
        let fmt = act_format(ty).unwrap();
        let rows = [
            r.gen_range(1..70usize),
            r.gen_range(1..40usize),
            r.gen_range(1..40usize),
        ];
        let x = randn(&mut r, cols, 1.0);
        let mut buf = quant::dot::ActBuf::new();
        quant::dot::quantize_acts_with_isa(ty, &x, 1, cols, &mut buf, Isa::Scalar).unwrap();
        let xb = g.upload(&x).unwrap();
        let (qb, db) = act_bufs(&g, 1, cols);
        g.quantize_act(xb.ptr(), 1, cols, fmt, qb.ptr(), db.ptr())
            .unwrap();
        let mut ws = Vec::new();
        let mut want = Vec::new();
        // Per row, the sum of |w_j x_j| over the dequantized weights: the scale of the float
        // order's rounding (a row whose terms cancel has a small result but not a small error).
        let mut mag = Vec::new();
        for &n in &rows {
            let (q, d) = quantized(ty, &randn(&mut r, n * cols, 0.5));
            let rb = q.len() / n;
            let a = buf.row(0).unwrap();
            mag.push(
                (0..n)
                    .map(|i| {
                        let w = &d[i * cols..(i + 1) * cols];
                        w.iter()
                            .zip(&x)
                            .map(|(&wj, &xj)| (wj as f64 * xj as f64).abs())
                            .sum()
                    })
                    .collect::<Vec<f64>>(),
            );
            want.push(
                (0..n)
                    .map(|i| {
                        quant::dot::vec_dot(ty, &q[i * rb..(i + 1) * rb], a, cols, Isa::Scalar)
                            .unwrap() as f64
                    })
                    .collect::<Vec<f64>>(),
            );
            ws.push(g.upload(&q).unwrap());
        }
        for acc in [false, true] {
            let y0: Vec<Vec<f32>> = rows.iter().map(|&n| randn(&mut r, n, 1.0)).collect();
            let ys: Vec<DevBuf> = if acc {
                y0.iter().map(|v| g.upload(v).unwrap()).collect()
            } else {
                rows.iter().map(|&n| poisoned(&g, n)).collect()
            };
            let segs: Vec<(u64, usize, u64)> = (0..3)
                .map(|i| (ws[i].ptr(), rows[i], ys[i].ptr()))
                .collect();
            g.matvec_q_multi(ty, &segs, cols, qb.ptr(), db.ptr(), acc)
                .unwrap();
            for i in 0..3 {
                let got: Vec<f32> = g.download(&ys[i], rows[i]).unwrap();
                let w: Vec<f64> = want[i]
                    .iter()
                    .zip(&y0[i])
                    .map(|(&a, &b)| if acc { a + b as f64 } else { a })
                    .collect();
                // Same integer sums in another float order: each row within 1e-6 of the scale
                // of its terms (and of the value it adds to). A wrong or missing 32-weight unit
                // is ~1e-2 of that scale at 3072 columns. The relative error over the whole
                // vector (rel_err) failed once on a single row whose terms nearly cancelled
                // (5.8e-6 on q5_1, one row; session 13).
                for (k, (&gk, &wk)) in got.iter().zip(&w).enumerate() {
                    let scale = mag[i][k] + if acc { (y0[i][k] as f64).abs() } else { 0.0 };
                    let d = (gk as f64 - wk).abs();
                    assert!(
                        gk.is_finite() && d <= 1e-6 * scale,
                        "{name} rows {rows:?} matrix {i} row {k} accumulate={acc}: got {gk}, \
                         want {wk}, difference {d:e} against the scale of its terms {scale:e}"
                    );
                }
            }
        }
    }
}

/// The kernels that quantize their own output as it completes (the SwiGLU product for the down
/// projection, the attention merge for the output projection) write exactly the bytes
/// `quantize_act` writes from that output, in both formats, twice in a row (the group counters
/// must be left zeroed), with a partial last group.
#[test]
fn fused_output_quantization_is_quantize_act() {
    let Some(g) = gpu_or_skip("fused_quant") else {
        return;
    };
    let mut r = rng("fused_quant");
    let check = |what: &str,
                 y: &DevBuf,
                 rows: usize,
                 n: usize,
                 fmt: ActFormat,
                 qb: &DevBuf,
                 db: &DevBuf| {
        let (qb2, db2) = act_bufs(&g, rows, n);
        g.quantize_act(y.ptr(), rows, n, fmt, qb2.ptr(), db2.ptr())
            .unwrap();
        let a: Vec<i8> = g.download(qb, rows * n).unwrap();
        let b: Vec<i8> = g.download(&qb2, rows * n).unwrap();
        assert_eq!(a, b, "{what} {fmt:?}: int8 values");
        let a: Vec<u32> = g.download(db, rows * n / 16).unwrap();
        let b: Vec<u32> = g.download(&db2, rows * n / 16).unwrap();
        assert_eq!(a, b, "{what} {fmt:?}: scales and sums");
    };
    let cnt = g.alloc_zeroed(64 * 1024).unwrap();
    let zero = |what: &str| {
        let c: Vec<u32> = g.download(&cnt, 16 * 1024).unwrap();
        assert!(
            c.iter().all(|&v| v == 0),
            "{what}: group counters left non-zero"
        );
    };
    let cols = 1024;
    for (fmt, rows) in [(ActFormat::Q8K, 768usize), (ActFormat::Q8x32, 992)] {
        let ty = GgmlType::Q4K;
        let (q, _) = quantized(ty, &randn(&mut r, rows * cols, 0.5));
        let (qu, _) = quantized(ty, &randn(&mut r, rows * cols, 0.5));
        let (w, wu) = (g.upload(&q).unwrap(), g.upload(&qu).unwrap());
        for _ in 0..2 {
            let x = randn(&mut r, cols, 1.0);
            let xb = g.upload(&x).unwrap();
            let (qa, da) = act_bufs(&g, 1, cols);
            g.quantize_act(xb.ptr(), 1, cols, ActFormat::Q8K, qa.ptr(), da.ptr())
                .unwrap();
            let y = poisoned(&g, rows);
            let (qb, db) = act_bufs(&g, 1, rows);
            let oq = |qb: &DevBuf, db: &DevBuf| {
                Some(OutQuant {
                    fmt,
                    cnt: cnt.ptr(),
                    qs: qb.ptr(),
                    ds: db.ptr(),
                })
            };
            g.matvec_q_swiglu_quant(
                ty,
                w.ptr(),
                wu.ptr(),
                rows,
                cols,
                qa.ptr(),
                da.ptr(),
                1,
                y.ptr(),
                oq(&qb, &db),
            )
            .unwrap();
            check("swiglu", &y, 1, rows, fmt, &qb, &db);
            zero("swiglu");
        }
    }
    for (fmt, nh, hd) in [
        (ActFormat::Q8K, 24usize, 128usize),
        (ActFormat::Q8x32, 24, 128),
        (ActFormat::Q8K, 12, 64),
        (ActFormat::Q8x32, 5, 64),
    ] {
        let (n, ns, sl) = (3usize, 5usize, 64usize);
        for _ in 0..2 {
            let mut part = Vec::with_capacity(n * nh * ns * (hd + 2));
            for _ in 0..n * nh * ns {
                part.push(randn(&mut r, 1, 2.0)[0]);
                part.push(0.5 + r.gen::<f32>());
                part.extend(randn(&mut r, hd, 1.0));
            }
            let pos: Vec<i32> = (0..n).map(|_| r.gen_range(0..(ns * sl) as i32)).collect();
            let (pb, posb) = (g.upload(&part).unwrap(), g.upload(&pos).unwrap());
            let w = nh * hd;
            let out = poisoned(&g, n * w);
            let (qb, db) = act_bufs(&g, n, w);
            g.attn_combine_q(
                n,
                pb.ptr(),
                posb.ptr(),
                nh,
                hd,
                ns,
                sl,
                out.ptr(),
                Some((fmt, cnt.ptr(), qb.ptr(), db.ptr())),
            )
            .unwrap();
            check("attn_combine", &out, n, w, fmt, &qb, &db);
            zero("attn_combine");
        }
    }
}

/// Session 33: the pipelined one-token Q/K/V launch (`mvpq<S>_q4_k_<v>`: a warp per Q4_K
/// rotation pair, half-unit lanes) gives the `mvr` launch's bits: rotated Q, K and V cache
/// entries, V rows of Q4_K, of Q6_K and of its aligned copy (the unit code in the same launch);
/// Q4_K V rows also within 2e-5 of the rows' scale (plus f16 rounding) of the CPU's scalar
/// `vec_dot`; widths of one and three
/// four-super-block steps, full and partial rotation. (Lane l of a warp sums sub-block l % 8
/// of super-blocks l / 8 + 4 k, k in order, each sub-block's value as the unit code computes
/// it, so the half-unit form keeps mvr's float order.)
#[test]
fn pipelined_qkv_rope_equals_mvr_launch_and_cpu() {
    let Some(g) = gpu_or_skip("mvpq") else {
        return;
    };
    g.q6_half.set(false);
    let saved = g.mvpq.get();
    let mut r = rng("mvpq");
    let (nh, nkv, hd) = (4usize, 2usize, 64usize);
    let (rq, rk) = (nh * hd, nkv * hd);
    let factors: Vec<f32> = (0..hd / 4).map(|i| 1.0 + i as f32 * 0.37).collect();
    let fb = g.upload(&factors).unwrap();
    let ropes = [
        cuda::kernels::RopeParams::new(hd, 500000.0, 1.0, 0),
        cuda::kernels::RopeParams::new(hd / 2, 10000.0, 0.25, fb.ptr()),
    ];
    for cols in [1024usize, 3072] {
        for (ci, rope) in ropes.iter().enumerate() {
            for (vty, vcopy) in [
                (GgmlType::Q4K, false),
                (GgmlType::Q6K, false),
                (GgmlType::Q6K, true),
            ] {
                let what = format!("{cols} columns, rope {ci}, V {vty} copy={vcopy}");
                let mut mk =
                    |ty: GgmlType, rows: usize| quantized(ty, &randn(&mut r, rows * cols, 0.5)).0;
                let (hq, hk, hv) = (mk(GgmlType::Q4K, rq), mk(GgmlType::Q4K, rk), mk(vty, rk));
                let (wq, wk, wv) = (
                    g.upload(&hq).unwrap(),
                    g.upload(&hk).unwrap(),
                    g.upload(&hv).unwrap(),
                );
                let vpad = vcopy.then(|| g.pad_q6k(wv.ptr(), rk, cols).unwrap());
                let vptr = vpad.as_ref().map_or(wv.ptr(), |p| p.ptr());
                let x = randn(&mut r, cols, 1.0);
                let xb = g.upload(&x).unwrap();
                let (qa, da) = act_bufs(&g, 1, cols);
                g.quantize_act(xb.ptr(), 1, cols, ActFormat::Q8K, qa.ptr(), da.ptr())
                    .unwrap();
                let pos = vec![r.gen_range(0..4000i32)];
                let slot = vec![r.gen_range(0..8i32)];
                let (pb, sb) = (g.upload(&pos).unwrap(), g.upload(&slot).unwrap());
                let run = |on: bool| -> (Vec<f32>, Vec<u16>, Vec<u16>) {
                    g.mvpq.set(on);
                    let q = poisoned(&g, rq);
                    let (kc, vc) = (
                        g.upload(&vec![0u16; 8 * rk]).unwrap(),
                        g.upload(&vec![0u16; 8 * rk]).unwrap(),
                    );
                    let w = [wq.ptr(), wk.ptr(), vptr];
                    let (qs, ds, y) = (qa.ptr(), da.ptr(), q.ptr());
                    let (p, sl, k, v) = (pb.ptr(), sb.ptr(), kc.ptr(), vc.ptr());
                    if vty == GgmlType::Q4K {
                        g.matvec_q_qkv_rope(
                            vty,
                            w,
                            [rq, rk, rk],
                            cols,
                            qs,
                            ds,
                            y,
                            rope,
                            p,
                            sl,
                            hd,
                            rk,
                            k,
                            v,
                        )
                    } else {
                        g.matvec_q_qkv_rope_mixed(
                            GgmlType::Q4K,
                            vty,
                            vcopy,
                            w,
                            [rq, rk, rk],
                            cols,
                            qs,
                            ds,
                            y,
                            rope,
                            p,
                            sl,
                            hd,
                            rk,
                            k,
                            v,
                        )
                    }
                    .unwrap();
                    (
                        g.download(&q, rq).unwrap(),
                        g.download(&kc, 8 * rk).unwrap(),
                        g.download(&vc, 8 * rk).unwrap(),
                    )
                };
                let (q1, k1, v1) = run(false);
                let (q2, k2, v2) = run(true);
                assert!(q2.iter().all(|v| v.is_finite()), "{what}: Q not finite");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
                assert_eq!(bits(&q2), bits(&q1), "{what}: rotated Q");
                assert_eq!(k2, k1, "{what}: K cache");
                assert_eq!(v2, v1, "{what}: V cache");
                if vty == GgmlType::Q4K {
                    // The CPU's scalar products of the V rows. The GPU sums in another order:
                    // within 2e-5 of the rows' largest value (a sum near zero after
                    // cancellation moves by more than an f16 step of its own), plus the f16
                    // store's rounding.
                    let mut buf = quant::dot::ActBuf::new();
                    quant::dot::quantize_acts_with_isa(vty, &x, 1, cols, &mut buf, Isa::Scalar)
                        .unwrap();
                    let rb = hv.len() / rk;
                    let want: Vec<f32> = (0..rk)
                        .map(|i| {
                            quant::dot::vec_dot(
                                vty,
                                &hv[i * rb..(i + 1) * rb],
                                buf.row(0).unwrap(),
                                cols,
                                Isa::Scalar,
                            )
                            .unwrap()
                        })
                        .collect();
                    let at = slot[0] as usize * rk;
                    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    for (i, (&gb, &cv)) in v2[at..at + rk].iter().zip(&want).enumerate() {
                        let gv = half::f16::from_bits(gb).to_f32();
                        let tol = 2e-5 * scale + cv.abs() / 1024.0;
                        assert!(
                            (gv - cv).abs() <= tol,
                            "{what}: V row {i}: GPU {gv} CPU {cv} (tolerance {tol:e})"
                        );
                    }
                }
            }
        }
    }
    g.mvpq.set(saved);
}

/// The one-token Q/K/V launch with RoPE and the KV-cache store fused gives the bits of the
/// separate products followed by `rope_store`: full and partial rotation (with frequency
/// factors), and a V of another type in its own launch.
#[test]
fn qkv_rope_fused_equals_products_then_rope_store() {
    let Some(g) = gpu_or_skip("qkv_rope") else {
        return;
    };
    // The reference V of type Q6_K through the mvr kernel (v10's half-block kernel sums in
    // another order; it has its own test). Session 33's pipelined launch sums in another order
    // too (its own test below).
    g.q6_half.set(false);
    g.mvpq.set(false);
    let mut r = rng("qkv_rope");
    let (nh, nkv, hd, cols) = (4usize, 2usize, 64usize, 1024usize);
    let (rq, rk) = (nh * hd, nkv * hd);
    let factors: Vec<f32> = (0..hd / 4).map(|i| 1.0 + i as f32 * 0.37).collect();
    let fb = g.upload(&factors).unwrap();
    let ropes = [
        cuda::kernels::RopeParams::new(hd, 500000.0, 1.0, 0),
        cuda::kernels::RopeParams::new(hd / 2, 10000.0, 0.25, fb.ptr()),
    ];
    for (ci, rope) in ropes.iter().enumerate() {
        for vty in [GgmlType::Q4K, GgmlType::Q6K] {
            let mk = |r: &mut ChaCha8Rng, ty: GgmlType, rows: usize| {
                g.upload(&quantized(ty, &randn(r, rows * cols, 0.5)).0)
                    .unwrap()
            };
            let (wq, wk, wv) = (
                mk(&mut r, GgmlType::Q4K, rq),
                mk(&mut r, GgmlType::Q4K, rk),
                mk(&mut r, vty, rk),
            );
            let x = randn(&mut r, cols, 1.0);
            let xb = g.upload(&x).unwrap();
            let (qa, da) = act_bufs(&g, 1, cols);
            g.quantize_act(xb.ptr(), 1, cols, ActFormat::Q8K, qa.ptr(), da.ptr())
                .unwrap();
            let pos = vec![r.gen_range(0..4000i32)];
            let slot = vec![r.gen_range(0..8i32)];
            let (pb, sb) = (g.upload(&pos).unwrap(), g.upload(&slot).unwrap());
            // Reference: the products, then rope_store.
            let (q1, k1, v1) = (poisoned(&g, rq), poisoned(&g, rk), poisoned(&g, rk));
            let (kc1, vc1) = (
                g.upload(&vec![0u16; 8 * rk]).unwrap(),
                g.upload(&vec![0u16; 8 * rk]).unwrap(),
            );
            g.matvec_q_multi(
                GgmlType::Q4K,
                &[(wq.ptr(), rq, q1.ptr()), (wk.ptr(), rk, k1.ptr())],
                cols,
                qa.ptr(),
                da.ptr(),
                false,
            )
            .unwrap();
            g.matvec_q(
                vty,
                wv.ptr(),
                rk,
                cols,
                qa.ptr(),
                da.ptr(),
                1,
                v1.ptr(),
                false,
            )
            .unwrap();
            g.rope_store(
                1,
                q1.ptr(),
                k1.ptr(),
                v1.ptr(),
                [0, 0, 0],
                pb.ptr(),
                sb.ptr(),
                rope,
                nh,
                nkv,
                hd,
                false,
                kc1.ptr(),
                vc1.ptr(),
            )
            .unwrap();
            // Fused.
            let q2 = poisoned(&g, rq);
            let (kc2, vc2) = (
                g.upload(&vec![0u16; 8 * rk]).unwrap(),
                g.upload(&vec![0u16; 8 * rk]).unwrap(),
            );
            let launches: Vec<(GgmlType, [u64; 3], [usize; 3])> = if vty == GgmlType::Q4K {
                vec![(vty, [wq.ptr(), wk.ptr(), wv.ptr()], [rq, rk, rk])]
            } else {
                vec![
                    (GgmlType::Q4K, [wq.ptr(), wk.ptr(), 0], [rq, rk, 0]),
                    (vty, [0, 0, wv.ptr()], [0, 0, rk]),
                ]
            };
            for (ty, w, rows) in launches {
                g.matvec_q_qkv_rope(
                    ty,
                    w,
                    rows,
                    cols,
                    qa.ptr(),
                    da.ptr(),
                    q2.ptr(),
                    rope,
                    pb.ptr(),
                    sb.ptr(),
                    hd,
                    rk,
                    kc2.ptr(),
                    vc2.ptr(),
                )
                .unwrap();
            }
            let a: Vec<u32> = g.download(&q1, rq).unwrap();
            let b: Vec<u32> = g.download(&q2, rq).unwrap();
            assert_eq!(a, b, "case {ci} V {vty}: rotated Q");
            let a: Vec<u16> = g.download(&kc1, 8 * rk).unwrap();
            let b: Vec<u16> = g.download(&kc2, 8 * rk).unwrap();
            assert_eq!(a, b, "case {ci} V {vty}: K cache");
            let a: Vec<u16> = g.download(&vc1, 8 * rk).unwrap();
            let b: Vec<u16> = g.download(&vc2, 8 * rk).unwrap();
            assert_eq!(a, b, "case {ci} V {vty}: V cache");
            if !Gpu::qkv_mixed_fits(GgmlType::Q4K, vty) {
                continue;
            }
            // v9: V of the other type in the same launch; v10: also with the one-wave grid
            // capped at 3 blocks (several pairs per warp), and the 64-register build of the
            // mixed kernel (mvr4_rope2).
            // Session 17: blocks of fewer warps too. Session 20: V of Q6_K also from its
            // Q6_KA copy (Q6_KU's decoding), which must give the same bits.
            let vpad = (vty == GgmlType::Q6K).then(|| g.pad_q6k(wv.ptr(), rk, cols).unwrap());
            let forms = [
                (0usize, false, 8usize, false),
                (3, false, 8, false),
                (0, true, 8, false),
                (3, true, 8, false),
                (0, true, 4, false),
                (0, false, 1, false),
                (2, true, 3, false),
                (0, true, 4, true),
                (0, false, 8, true),
                (2, true, 3, true),
            ];
            for (cap, lb4, nw, vc) in forms {
                let Some(wv_ptr) = (if vc {
                    vpad.as_ref().map(|p| p.ptr())
                } else {
                    Some(wv.ptr())
                }) else {
                    continue;
                };
                g.mvr_warps.set(nw);
                g.wave_cap.set(cap);
                g.wave.set(cap > 0);
                g.mvr_lb4.set(lb4);
                let q3 = poisoned(&g, rq);
                let (kc3, vc3) = (
                    g.upload(&vec![0u16; 8 * rk]).unwrap(),
                    g.upload(&vec![0u16; 8 * rk]).unwrap(),
                );
                g.matvec_q_qkv_rope_mixed(
                    GgmlType::Q4K,
                    vty,
                    vc,
                    [wq.ptr(), wk.ptr(), wv_ptr],
                    [rq, rk, rk],
                    cols,
                    qa.ptr(),
                    da.ptr(),
                    q3.ptr(),
                    rope,
                    pb.ptr(),
                    sb.ptr(),
                    hd,
                    rk,
                    kc3.ptr(),
                    vc3.ptr(),
                )
                .unwrap();
                let a: Vec<u32> = g.download(&q1, rq).unwrap();
                let b: Vec<u32> = g.download(&q3, rq).unwrap();
                assert_eq!(
                    a, b,
                    "case {ci} V {vty} mixed cap={cap} lb4={lb4} warps={nw} copy={vc}: rotated Q"
                );
                let a: Vec<u16> = g.download(&kc1, 8 * rk).unwrap();
                let b: Vec<u16> = g.download(&kc3, 8 * rk).unwrap();
                assert_eq!(
                    a, b,
                    "case {ci} V {vty} mixed cap={cap} lb4={lb4} warps={nw} copy={vc}: K cache"
                );
                let a: Vec<u16> = g.download(&vc1, 8 * rk).unwrap();
                let b: Vec<u16> = g.download(&vc3, 8 * rk).unwrap();
                assert_eq!(
                    a, b,
                    "case {ci} V {vty} mixed cap={cap} lb4={lb4} warps={nw} copy={vc}: V cache"
                );
            }
            g.wave_cap.set(0);
            g.wave.set(false);
            g.mvr_lb4.set(false);
            g.mvr_warps.set(8);
        }
    }
}

#[test]
fn gemm_f16_matches_reference() {
    let Some(g) = gpu_or_skip("gemm") else { return };
    if !g.has_blas() {
        eprintln!(
            "SKIPPED gemm: {}",
            g.blas_missing.clone().unwrap_or_default()
        );
        return;
    }
    let mut r = rng("gemm");
    let (m, n, k) = (300, 70, 512);
    let w = randn(&mut r, m * k, 0.5);
    let x = randn(&mut r, n * k, 1.0);
    let wh: Vec<u16> = w.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
    let wb = g.upload(&wh).unwrap();
    let xb = g.upload(&x).unwrap();
    let xh = g.alloc(n * k * 2).unwrap();
    g.to_f16(xb.ptr(), n * k, xh.ptr()).unwrap();
    let c0 = randn(&mut r, n * m, 1.0);
    let cb = g.upload(&c0).unwrap();
    g.gemm_f16(wb.ptr(), xh.ptr(), cb.ptr(), m, n, k, 1.0)
        .unwrap();
    let got: Vec<f32> = g.download(&cb, n * m).unwrap();
    let mut want = vec![0f64; n * m];
    for t in 0..n {
        for rr in 0..m {
            let s: f64 = (0..k)
                .map(|c| {
                    f16::from_f32(w[rr * k + c]).to_f64() * f16::from_f32(x[t * k + c]).to_f64()
                })
                .sum();
            want[t * m + rr] = s + c0[t * m + rr] as f64;
        }
    }
    let e = rel_err(&got, &want);
    assert!(e < 1e-5, "gemm relative error {e:e}");
}

#[test]
fn rms_norm_and_argmax_match_reference() {
    let Some(g) = gpu_or_skip("rms_norm") else {
        return;
    };
    let mut r = rng("rms_norm");
    let (rows, n) = (5, 3072);
    let x = randn(&mut r, rows * n, 2.0);
    let w = randn(&mut r, n, 1.0);
    let (xb, wb) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
    let sel: Vec<i32> = vec![4, 1, 1];
    let selb = g.upload(&sel).unwrap();
    let out = poisoned(&g, sel.len() * n);
    let outh = g.upload(&vec![0xffffu16; sel.len() * n]).unwrap();
    g.rms_norm(
        xb.ptr(),
        selb.ptr(),
        wb.ptr(),
        n,
        1e-5,
        sel.len(),
        out.ptr(),
        outh.ptr(),
        None,
    )
    .unwrap();
    let got: Vec<f32> = g.download(&out, sel.len() * n).unwrap();
    let goth: Vec<u16> = g.download(&outh, sel.len() * n).unwrap();
    let mut want = Vec::new();
    for &s in &sel {
        let xr = &x[s as usize * n..(s as usize + 1) * n];
        let ms: f64 = xr.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / n as f64;
        let sc = 1.0 / (ms + 1e-5).sqrt();
        want.extend(xr.iter().zip(&w).map(|(&v, &ww)| v as f64 * sc * ww as f64));
    }
    let e = rel_err(&got, &want);
    assert!(e < 1e-6, "rms_norm relative error {e:e}");
    // The CPU backend's own RMSNorm: same f64 sum, same f32 rounding of mean and scale.
    let mut ulps = 0u32;
    for (k, &s) in sel.iter().enumerate() {
        let mut c = vec![0f32; n];
        cpu::ops::rms_norm(&x[s as usize * n..(s as usize + 1) * n], &w, 1e-5, &mut c);
        for (&a, &b) in got[k * n..(k + 1) * n].iter().zip(&c) {
            ulps = ulps.max((a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32);
        }
    }
    assert!(
        ulps <= 1,
        "rms_norm differs from cpu::ops::rms_norm by {ulps} ulps"
    );
    // Fused quantization equals quantizing the normalized rows afterwards, in both formats.
    for fmt in [ActFormat::Q8x32, ActFormat::Q8K] {
        let (qb, db) = act_bufs(&g, sel.len(), n);
        g.rms_norm(
            xb.ptr(),
            selb.ptr(),
            wb.ptr(),
            n,
            1e-5,
            sel.len(),
            out.ptr(),
            0,
            Some((fmt, qb.ptr(), db.ptr())),
        )
        .unwrap();
        let (qb2, db2) = act_bufs(&g, sel.len(), n);
        g.quantize_act(out.ptr(), sel.len(), n, fmt, qb2.ptr(), db2.ptr())
            .unwrap();
        let a: Vec<i8> = g.download(&qb, sel.len() * n).unwrap();
        let b: Vec<i8> = g.download(&qb2, sel.len() * n).unwrap();
        assert_eq!(a, b, "{fmt:?}: fused int8 values");
        let a: Vec<u32> = g.download(&db, sel.len() * n / 16).unwrap();
        let b: Vec<u32> = g.download(&db2, sel.len() * n / 16).unwrap();
        assert_eq!(a, b, "{fmt:?}: fused scales");
    }
    for (i, (&h, &f)) in goth.iter().zip(&got).enumerate() {
        assert_eq!(h, f16::from_f32(f).to_bits(), "f16 copy element {i}");
    }

    // Argmax over a vocabulary-sized row, with the maximum planted at a random place.
    let (nr, nv) = (3, 128_256);
    let mut l = randn(&mut r, nr * nv, 3.0);
    let mut want = Vec::new();
    for row in 0..nr {
        let at = r.gen_range(0..nv);
        l[row * nv + at] = 100.0 + row as f32;
        want.push(at as i32);
    }
    let lb = g.upload(&l).unwrap();
    let ob = g.upload(&vec![-1i32; nr]).unwrap();
    g.argmax_rows(lb.ptr(), nv, nr, ob.ptr()).unwrap();
    let got: Vec<i32> = g.download(&ob, nr).unwrap();
    assert_eq!(got, want);
}

/// RoPE (both pairings), biases and the KV write against the CPU backend's own `Rope`.
#[test]
fn rope_store_matches_cpu_rope() {
    let Some(g) = gpu_or_skip("rope_store") else {
        return;
    };
    let mut r = rng("rope_store");
    let (nh, nkv, hd, n) = (6, 2, 64, 5);
    let factors: Vec<f32> = (0..hd / 4).map(|i| 1.0 + i as f32 * 0.37).collect();
    let fb = g.upload(&factors).unwrap();
    // Full rotation at base 500000; and a partial one (half the head) with Llama-3-style
    // frequency factors and linear scaling.
    let cases = [
        (model::RopeStyle::Normal, hd, 500000.0f32, 1.0f32, false),
        (model::RopeStyle::Neox, hd, 500000.0, 1.0, false),
        (model::RopeStyle::Normal, hd / 2, 10000.0, 0.25, true),
        (model::RopeStyle::Neox, hd / 2, 10000.0, 0.25, true),
    ];
    for (style, n_rot, base, fscale, with_f) in cases {
        let rope = cpu::ops::Rope::new(n_rot, base, fscale, with_f.then_some(&factors[..]), style);
        let params =
            cuda::kernels::RopeParams::new(n_rot, base, fscale, if with_f { fb.ptr() } else { 0 });
        let q = randn(&mut r, n * nh * hd, 1.0);
        let k = randn(&mut r, n * nkv * hd, 1.0);
        let v = randn(&mut r, n * nkv * hd, 1.0);
        let bq = randn(&mut r, nh * hd, 0.1);
        let bk = randn(&mut r, nkv * hd, 0.1);
        let bv = randn(&mut r, nkv * hd, 0.1);
        let pos: Vec<i32> = (0..n).map(|_| r.gen_range(0..5000)).collect();
        let slot: Vec<i32> = vec![9, 2, 7, 0, 4];
        let rows = 10;
        let up = |d: &[f32]| g.upload(d).unwrap();
        let (qb, kb, vb) = (up(&q), up(&k), up(&v));
        let (bqb, bkb, bvb) = (up(&bq), up(&bk), up(&bv));
        let (pb, sb) = (g.upload(&pos).unwrap(), g.upload(&slot).unwrap());
        let kc = g.upload(&vec![0u16; rows * nkv * hd]).unwrap();
        let vc = g.upload(&vec![0u16; rows * nkv * hd]).unwrap();
        g.rope_store(
            n,
            qb.ptr(),
            kb.ptr(),
            vb.ptr(),
            [bqb.ptr(), bkb.ptr(), bvb.ptr()],
            pb.ptr(),
            sb.ptr(),
            &params,
            nh,
            nkv,
            hd,
            style == model::RopeStyle::Neox,
            kc.ptr(),
            vc.ptr(),
        )
        .unwrap();
        let gq: Vec<f32> = g.download(&qb, q.len()).unwrap();
        let gk: Vec<u16> = g.download(&kc, rows * nkv * hd).unwrap();
        let gv: Vec<u16> = g.download(&vc, rows * nkv * hd).unwrap();
        for t in 0..n {
            let mut wq: Vec<f32> = q[t * nh * hd..(t + 1) * nh * hd]
                .iter()
                .zip(&bq)
                .map(|(a, b)| a + b)
                .collect();
            for h in wq.chunks_exact_mut(hd) {
                rope.apply(h, pos[t] as usize);
            }
            let mut wk: Vec<f32> = k[t * nkv * hd..(t + 1) * nkv * hd]
                .iter()
                .zip(&bk)
                .map(|(a, b)| a + b)
                .collect();
            for h in wk.chunks_exact_mut(hd) {
                rope.apply(h, pos[t] as usize);
            }
            for (i, &w) in wq.iter().enumerate() {
                let a = gq[t * nh * hd + i];
                // Same angles, same rounding order: only a last-ulp difference of cos/sin may remain.
                assert!(
                    (a - w).abs() <= 1e-6 * (1.0 + w.abs()),
                    "{style:?} n_rot {n_rot} q t{t} i{i}: {a} vs {w}"
                );
            }
            let s = slot[t] as usize * nkv * hd;
            for (i, &w) in wk.iter().enumerate() {
                let a = f16::from_bits(gk[s + i]).to_f32();
                assert!(
                    (a - w).abs() <= 1e-3 * w.abs() + 1e-4,
                    "{style:?} k t{t} i{i}: {a} vs {w}"
                );
            }
            for i in 0..nkv * hd {
                let w = f16::from_f32(v[t * nkv * hd + i] + bv[i]).to_bits();
                assert_eq!(gv[s + i], w, "v t{t} i{i}");
            }
        }
    }
}

/// Split-K paged attention against a direct f64 softmax, for decode-like and prefill-like
/// token sets, several split counts, every head size, shuffled block tables.
#[test]
fn paged_attention_matches_reference() {
    let Some(g) = gpu_or_skip("attention") else {
        return;
    };
    let mut r = rng("attention");
    for &hd in &cuda::kernels::HEAD_DIMS {
        let (nh, nkv, bt) = (12, 4, 16);
        let gqa = nh / nkv;
        let n_seq = 2;
        let max_blocks = 20;
        let n_blocks = n_seq * max_blocks;
        let kv_row = nkv * hd;
        let kc: Vec<f32> = randn(&mut r, n_blocks * bt * kv_row, 1.0);
        let vc: Vec<f32> = randn(&mut r, n_blocks * bt * kv_row, 1.0);
        let kh: Vec<u16> = kc.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
        let vh: Vec<u16> = vc.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
        // A random permutation of blocks shared out between the sequences.
        let mut perm: Vec<i32> = (0..n_blocks as i32).collect();
        for i in (1..perm.len()).rev() {
            perm.swap(i, r.gen_range(0..=i));
        }
        let btab = perm.clone();
        // Tokens: several of sequence 0 (prefill-like, consecutive positions) and one of seq 1.
        let pos: Vec<i32> = vec![100, 101, 102, 250, 0, 319];
        let seq: Vec<i32> = vec![0, 0, 0, 0, 1, 1];
        let n = pos.len();
        let q = randn(&mut r, n * nh * hd, 1.0);
        let scale = 1.0 / (hd as f64).sqrt();
        let mut want = vec![0f64; n * nh * hd];
        for t in 0..n {
            let len = pos[t] as usize + 1;
            for h in 0..nh {
                let kvh = h / gqa;
                let row = |p: usize| {
                    let b = btab[seq[t] as usize * max_blocks + p / bt] as usize;
                    (b * bt + p % bt) * kv_row + kvh * hd
                };
                let s: Vec<f64> = (0..len)
                    .map(|p| {
                        (0..hd)
                            .map(|d| {
                                // The query meets the f16 keys rounded to f16, as on the CPU.
                                f16::from_f32(q[(t * nh + h) * hd + d]).to_f64()
                                    * f16::from_bits(kh[row(p) + d]).to_f64()
                            })
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..hd {
                    want[(t * nh + h) * hd + d] = (0..len)
                        .map(|p| e[p] / z * f16::from_bits(vh[row(p) + d]).to_f64())
                        .sum();
                }
            }
        }
        let (qb, kb, vb) = (
            g.upload(&q).unwrap(),
            g.upload(&kh).unwrap(),
            g.upload(&vh).unwrap(),
        );
        let (pb, sb, tb) = (
            g.upload(&pos).unwrap(),
            g.upload(&seq).unwrap(),
            g.upload(&btab).unwrap(),
        );
        for (n_split, split_len) in [(1usize, 320usize), (3, 128), (10, 32)] {
            let part = poisoned(&g, n * nh * n_split * (hd + 2));
            let out = poisoned(&g, n * nh * hd);
            g.attn_partial(
                n,
                qb.ptr(),
                kb.ptr(),
                vb.ptr(),
                pb.ptr(),
                sb.ptr(),
                tb.ptr(),
                max_blocks,
                bt,
                nh,
                nkv,
                hd,
                n_split,
                split_len,
                part.ptr(),
            )
            .unwrap();
            g.attn_combine(
                n,
                part.ptr(),
                pb.ptr(),
                nh,
                hd,
                n_split,
                split_len,
                out.ptr(),
            )
            .unwrap();
            let got: Vec<f32> = g.download(&out, n * nh * hd).unwrap();
            let e = rel_err(&got, &want);
            assert!(e < 1e-5, "hd {hd} splits {n_split}: relative error {e:e}");
            if !cuda::kernels::PREFILL_HEAD_DIMS.contains(&hd) {
                continue;
            }
            // The tensor-core form: same partial results, probabilities into PV as f16.
            let part = poisoned(&g, n * nh * n_split * (hd + 2));
            let out = poisoned(&g, n * nh * hd);
            g.attn_decode(
                n,
                qb.ptr(),
                kb.ptr(),
                vb.ptr(),
                pb.ptr(),
                sb.ptr(),
                tb.ptr(),
                max_blocks,
                bt,
                nh,
                nkv,
                hd,
                n_split,
                split_len,
                part.ptr(),
            )
            .unwrap();
            g.attn_combine(
                n,
                part.ptr(),
                pb.ptr(),
                nh,
                hd,
                n_split,
                split_len,
                out.ptr(),
            )
            .unwrap();
            let got: Vec<f32> = g.download(&out, n * nh * hd).unwrap();
            let e = rel_err(&got, &want);
            eprintln!("attn_decode hd {hd} splits {n_split}: relative error {e:.2e}");
            assert!(
                e < 2e-3,
                "mma hd {hd} splits {n_split}: relative error {e:e}"
            );
            // The many-sequence form (v7): slices from each token's own length, merged by
            // attn_combine with split_len 0; rows of other tokens' heads checked too.
            let part = poisoned(&g, n * nh * n_split * (hd + 2));
            let out = poisoned(&g, n * nh * hd);
            g.attn_batch(
                n,
                qb.ptr(),
                kb.ptr(),
                vb.ptr(),
                pb.ptr(),
                sb.ptr(),
                tb.ptr(),
                max_blocks,
                bt,
                nh,
                nkv,
                hd,
                n_split,
                part.ptr(),
            )
            .unwrap();
            g.attn_combine(n, part.ptr(), pb.ptr(), nh, hd, n_split, 0, out.ptr())
                .unwrap();
            let got: Vec<f32> = g.download(&out, n * nh * hd).unwrap();
            let e = rel_err(&got, &want);
            eprintln!("attn_batch hd {hd} splits {n_split}: relative error {e:.2e}");
            assert!(
                e < 2e-3,
                "attn_batch hd {hd} splits {n_split}: relative error {e:e}"
            );
        }
    }
}

#[test]
fn swiglu_is_bit_identical_to_cpu() {
    let Some(g) = gpu_or_skip("swiglu_is_bit_identical_to_cpu") else {
        return;
    };
    let mut r = rng("swiglu_is_bit_identical_to_cpu");
    // A multiple of 16, as the CPU takes every element through ggml's vector expf then; a few
    // values far out reach its overflow and underflow branches.
    let n = 16 * 4099;
    let mut gate = randn(&mut r, n, 6.0);
    let up = randn(&mut r, n, 3.0);
    for (i, v) in [-300.0f32, -120.0, -88.5, 88.5, 120.0, 300.0, 0.0, -0.0]
        .into_iter()
        .enumerate()
    {
        gate[i * 37] = v;
    }
    let gd = g.upload(&gate).expect("upload");
    let ud = g.upload(&up).expect("upload");
    g.swiglu(gd.ptr(), ud.ptr(), n).expect("swiglu");
    let got: Vec<f32> = g.download(&gd, n).expect("download");
    let mut want = gate.clone();
    quant::dot::ggml::swiglu_isa(Isa::Scalar, &mut want, &up);
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            a.to_bits(),
            b.to_bits(),
            "element {i}: gate {} up {}: gpu {a} cpu {b}",
            gate[i],
            up[i]
        );
    }
}

#[test]
fn prefill_attention_matches_reference() {
    let Some(g) = gpu_or_skip("prefill_attention") else {
        return;
    };
    let mut r = rng("prefill_attention");
    for &hd in &cuda::kernels::PREFILL_HEAD_DIMS {
        let (nh, nkv, bt, max_blocks) = (12, 4, 16, 20);
        let gqa = nh / nkv;
        let kv_row = nkv * hd;
        let kc = randn(&mut r, max_blocks * bt * kv_row, 1.5);
        let vc = randn(&mut r, max_blocks * bt * kv_row, 1.0);
        let kh: Vec<u16> = kc.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
        let vh: Vec<u16> = vc.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
        let mut btab: Vec<i32> = (0..max_blocks as i32).collect();
        for i in (1..btab.len()).rev() {
            btab.swap(i, r.gen_range(0..=i));
        }
        // A chunk of `t` tokens at positions p0.. that starts at step row t0 (earlier context
        // already cached); partial query and key tiles at both ends.
        let (t0, t, p0) = (3usize, 150usize, 37usize);
        let rows = t0 + t + 2;
        let q = randn(&mut r, rows * nh * hd, 1.0);
        let scale = 1.0 / (hd as f64).sqrt();
        let row = |p: usize, kvh: usize| (btab[p / bt] as usize * bt + p % bt) * kv_row + kvh * hd;
        let mut want = vec![0f64; t * nh * hd];
        for i in 0..t {
            let len = p0 + i + 1;
            for h in 0..nh {
                let kvh = h / gqa;
                let s: Vec<f64> = (0..len)
                    .map(|p| {
                        (0..hd)
                            .map(|d| {
                                f16::from_f32(q[((t0 + i) * nh + h) * hd + d]).to_f64()
                                    * f16::from_bits(kh[row(p, kvh) + d]).to_f64()
                            })
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..hd {
                    want[(i * nh + h) * hd + d] = (0..len)
                        .map(|p| e[p] / z * f16::from_bits(vh[row(p, kvh) + d]).to_f64())
                        .sum();
                }
            }
        }
        let (qb, kb, vb, tb) = (
            g.upload(&q).unwrap(),
            g.upload(&kh).unwrap(),
            g.upload(&vh).unwrap(),
            g.upload(&btab).unwrap(),
        );
        let out = poisoned(&g, rows * nh * hd);
        g.attn_prefill(
            qb.ptr(),
            kb.ptr(),
            vb.ptr(),
            tb.ptr(),
            bt,
            t0,
            t,
            p0,
            nh,
            nkv,
            hd,
            out.ptr(),
        )
        .unwrap();
        let got: Vec<f32> = g.download(&out, rows * nh * hd).unwrap();
        let (before, rest) = got.split_at(t0 * nh * hd);
        let (mine, after) = rest.split_at(t * nh * hd);
        assert!(
            before.iter().chain(after).all(|v| v.is_nan()),
            "hd {hd}: rows outside the chunk were written"
        );
        // The probabilities meet V as f16 (as on the CPU, in another order): ~2^-12 relative.
        let e = rel_err(mine, &want);
        eprintln!("prefill attention hd {hd}: relative error {e:.2e}");
        assert!(e < 2e-3, "hd {hd}: relative error {e:e}");
    }
}

#[test]
fn rms_norm_f16_operand_is_the_quantized_value() {
    let Some(g) = gpu_or_skip("rms_norm_f16") else {
        return;
    };
    let mut r = rng("rms_norm_f16");
    let n = 3072;
    let w = randn(&mut r, n, 1.0);
    let wb = g.upload(&w).unwrap();
    // 3 rows: a block per 256 elements; 400 rows: each block walks several chunks of its row.
    for rows in [3usize, 400] {
        let x = randn(&mut r, rows * n, 2.0);
        let xb = g.upload(&x).unwrap();
        for fmt in [None, Some(ActFormat::Q8x32), Some(ActFormat::Q8K)] {
            let out = poisoned(&g, rows * n);
            let outh = g.upload(&vec![0xffffu16; rows * n]).unwrap();
            g.rms_norm(
                xb.ptr(),
                0,
                wb.ptr(),
                n,
                1e-5,
                rows,
                out.ptr(),
                outh.ptr(),
                fmt.map(|f| (f, 0, 0)),
            )
            .unwrap();
            let got: Vec<f32> = g.download(&out, rows * n).unwrap();
            let mut c = vec![0f32; n];
            for t in 0..rows {
                cpu::ops::rms_norm(&x[t * n..(t + 1) * n], &w, 1e-5, &mut c);
                for (i, (&a, &b)) in got[t * n..(t + 1) * n].iter().zip(&c).enumerate() {
                    // The f64 sum of squares is added in another order: a row's f32 mean can
                    // land one ulp off, so its scale too (at most 2^-23 relative), which moves
                    // the exact x*scale*w by up to 2 of the output's ulps (2^-24 relative at the
                    // least), and each of the two roundings on the way by one more: <= 4 ulps
                    // (2 seen in 43 x 3072 rows, 3 in 400 x 3072 on the H200).
                    let d = (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs();
                    assert!(d <= 4, "rows {rows} row {t} element {i}: {a} vs cpu {b}");
                }
            }
            let goth: Vec<u16> = g.download(&outh, rows * n).unwrap();
            let want: Vec<u16> = match fmt {
                None => got.iter().map(|&v| f16::from_f32(v).to_bits()).collect(),
                Some(f) => {
                    let hb = g.upload(&vec![0u16; rows * n]).unwrap();
                    g.quantize_act_f16(out.ptr(), rows, n, f, hb.ptr()).unwrap();
                    g.download(&hb, rows * n).unwrap()
                }
            };
            assert_eq!(goth, want, "rows {rows} {fmt:?}: f16 operand");
        }
    }
}

#[test]
fn swiglu_f16_operand_is_the_quantized_product() {
    let Some(g) = gpu_or_skip("swiglu_f16") else {
        return;
    };
    let mut r = rng("swiglu_f16");
    let (rows, n) = (3usize, 8192usize);
    let gate = randn(&mut r, rows * n, 6.0);
    let up = randn(&mut r, rows * n, 3.0);
    let mut want = gate.clone();
    quant::dot::ggml::swiglu_isa(Isa::Scalar, &mut want, &up);
    for fmt in [None, Some(ActFormat::Q8x32), Some(ActFormat::Q8K)] {
        let (gd, ud) = (g.upload(&gate).unwrap(), g.upload(&up).unwrap());
        let xh = g.upload(&vec![0xffffu16; rows * n]).unwrap();
        g.swiglu_f16(gd.ptr(), ud.ptr(), rows, n, fmt, xh.ptr())
            .unwrap();
        let got: Vec<f32> = g.download(&gd, rows * n).unwrap();
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "{fmt:?} element {i}: {a} vs cpu {b}"
            );
        }
        let goth: Vec<u16> = g.download(&xh, rows * n).unwrap();
        let wanth: Vec<u16> = match fmt {
            None => want.iter().map(|&v| f16::from_f32(v).to_bits()).collect(),
            Some(f) => {
                let hb = g.upload(&vec![0u16; rows * n]).unwrap();
                g.quantize_act_f16(gd.ptr(), rows, n, f, hb.ptr()).unwrap();
                g.download(&hb, rows * n).unwrap()
            }
        };
        assert_eq!(goth, wanth, "{fmt:?}: f16 operand");
    }
}

/// v7: the one-token products that prepare their own activation (RMSNorm and quantization in
/// the product's launch, `*_prep`) give the bits of the unfused path: `rms_norm` with
/// quantization (or `quantize_act`) followed by the product. Q/K/V with RoPE (a V of another
/// type in its own launch), SwiGLU, and the accumulating plain product without a norm; both
/// activation formats; one and several row pairs per warp.
#[test]
fn prep_products_equal_norm_then_products() {
    let Some(g) = gpu_or_skip("prep_products") else {
        return;
    };
    let mut r = rng("prep_products");
    let eps = 1e-5f32;
    let cols = 1024usize;
    let mk = |r: &mut ChaCha8Rng, ty: GgmlType, rows: usize| {
        g.upload(&quantized(ty, &randn(r, rows * cols, 0.5)).0)
            .unwrap()
    };
    let bits = |b: &DevBuf, n: usize| -> Vec<u32> { g.download(b, n).unwrap() };
    for blocks_per_sm in [4usize, 1] {
        g.prep_blocks.set(blocks_per_sm);
        for ty in [GgmlType::Q4K, GgmlType::Q8_0] {
            let fmt = act_format(ty).unwrap();
            let x = randn(&mut r, cols, 2.0);
            let nw: Vec<f32> = (0..cols).map(|_| 0.5 + r.gen::<f32>()).collect();
            let (xb, nwb) = (g.upload(&x).unwrap(), g.upload(&nw).unwrap());
            let prep = cuda::kernels::ActPrep {
                x: xb.ptr(),
                norm: nwb.ptr(),
                eps,
            };
            let xn = poisoned(&g, cols);
            let (qa, da) = act_bufs(&g, 1, cols);
            g.rms_norm(
                xb.ptr(),
                0,
                nwb.ptr(),
                cols,
                eps,
                1,
                xn.ptr(),
                0,
                Some((fmt, qa.ptr(), da.ptr())),
            )
            .unwrap();
            // SwiGLU: 2304 rows take several rows per warp at one block per SM.
            let rows = 2304;
            let (wg, wu) = (mk(&mut r, ty, rows), mk(&mut r, ty, rows));
            let (y1, y2) = (poisoned(&g, rows), poisoned(&g, rows));
            g.matvec_q_swiglu(
                ty,
                wg.ptr(),
                wu.ptr(),
                rows,
                cols,
                qa.ptr(),
                da.ptr(),
                1,
                y1.ptr(),
            )
            .unwrap();
            g.matvec_q_swiglu_prep(ty, wg.ptr(), wu.ptr(), rows, cols, &prep, y2.ptr())
                .unwrap();
            assert_eq!(
                bits(&y1, rows),
                bits(&y2, rows),
                "{ty} swiglu, {blocks_per_sm}/SM"
            );
            // Plain accumulating product on an un-normalized row (the output projection).
            let rows = r.gen_range(2000..3000usize);
            let w = mk(&mut r, ty, rows);
            let a = randn(&mut r, cols, 1.0);
            let ab = g.upload(&a).unwrap();
            let (qa2, da2) = act_bufs(&g, 1, cols);
            g.quantize_act(ab.ptr(), 1, cols, fmt, qa2.ptr(), da2.ptr())
                .unwrap();
            let y0 = randn(&mut r, rows, 1.0);
            let (y1, y2) = (g.upload(&y0).unwrap(), g.upload(&y0).unwrap());
            g.matvec_q(
                ty,
                w.ptr(),
                rows,
                cols,
                qa2.ptr(),
                da2.ptr(),
                1,
                y1.ptr(),
                true,
            )
            .unwrap();
            let p2 = cuda::kernels::ActPrep {
                x: ab.ptr(),
                norm: 0,
                eps: 0.0,
            };
            g.matvec_q_prep(ty, w.ptr(), rows, cols, &p2, y2.ptr(), true)
                .unwrap();
            assert_eq!(
                bits(&y1, rows),
                bits(&y2, rows),
                "{ty} accumulate, {rows} rows, {blocks_per_sm}/SM"
            );
            // Q/K/V with RoPE and the cache store (K-quants only: rotation pairs need the same
            // format for V of another type).
            if ty != GgmlType::Q4K {
                continue;
            }
            let (nh, nkv, hd) = (24usize, 8usize, 64usize);
            let (rq, rk) = (nh * hd, nkv * hd);
            let rope = cuda::kernels::RopeParams::new(hd, 500000.0, 1.0, 0);
            for vty in [GgmlType::Q4K, GgmlType::Q6K] {
                let (wq, wk, wv) = (mk(&mut r, ty, rq), mk(&mut r, ty, rk), mk(&mut r, vty, rk));
                let pos = vec![r.gen_range(0..4000i32)];
                let slot = vec![r.gen_range(0..8i32)];
                let (pb, sb) = (g.upload(&pos).unwrap(), g.upload(&slot).unwrap());
                let launches: Vec<(GgmlType, [u64; 3], [usize; 3])> = if vty == ty {
                    vec![(ty, [wq.ptr(), wk.ptr(), wv.ptr()], [rq, rk, rk])]
                } else {
                    vec![
                        (ty, [wq.ptr(), wk.ptr(), 0], [rq, rk, 0]),
                        (vty, [0, 0, wv.ptr()], [0, 0, rk]),
                    ]
                };
                let mut outs = Vec::new();
                for fused in [false, true] {
                    let q = poisoned(&g, rq);
                    let kc = g.upload(&vec![0u16; 8 * rk]).unwrap();
                    let vc = g.upload(&vec![0u16; 8 * rk]).unwrap();
                    for &(lt, w, rows) in &launches {
                        let (p, s) = (pb.ptr(), sb.ptr());
                        if fused {
                            g.matvec_q_qkv_rope_prep(
                                lt,
                                w,
                                rows,
                                cols,
                                &prep,
                                q.ptr(),
                                &rope,
                                p,
                                s,
                                hd,
                                rk,
                                kc.ptr(),
                                vc.ptr(),
                            )
                        } else {
                            g.matvec_q_qkv_rope(
                                lt,
                                w,
                                rows,
                                cols,
                                qa.ptr(),
                                da.ptr(),
                                q.ptr(),
                                &rope,
                                p,
                                s,
                                hd,
                                rk,
                                kc.ptr(),
                                vc.ptr(),
                            )
                        }
                        .unwrap();
                    }
                    let kb: Vec<u16> = g.download(&kc, 8 * rk).unwrap();
                    let vb: Vec<u16> = g.download(&vc, 8 * rk).unwrap();
                    outs.push((bits(&q, rq), kb, vb));
                }
                assert_eq!(
                    outs[0].0, outs[1].0,
                    "V {vty}: rotated Q, {blocks_per_sm}/SM"
                );
                assert_eq!(outs[0].1, outs[1].1, "V {vty}: K cache");
                assert_eq!(outs[0].2, outs[1].2, "V {vty}: V cache");
            }
        }
    }
    g.prep_blocks.set(4);
}

/// v7: the split attention that merges its own slices (the last block of each token and KV
/// head) writes the bits of `attn_decode` followed by `attn_combine`, leaves its counters
/// zeroed (so a replay works), and stays within the f64 reference's tolerance; one, several and
/// many slices.
#[test]
fn attn_decode_merge_equals_decode_then_combine() {
    let Some(g) = gpu_or_skip("attn_merge") else {
        return;
    };
    let mut r = rng("attn_merge");
    for hd in cuda::kernels::PREFILL_HEAD_DIMS {
        let (nh, nkv, bt) = (24usize, 8usize, 32usize);
        let max_blocks = 40;
        let n_seq = 3;
        let n_blocks = n_seq * max_blocks;
        let kv_row = nkv * hd;
        let (kh, vh, btab) = paged_kv(&mut r, n_blocks, bt, kv_row);
        // One token per sequence: a short context (one slice) and two long ones.
        let pos: Vec<i32> = vec![
            r.gen_range(0..100),
            r.gen_range(600..1279),
            r.gen_range(1000..1279),
        ];
        let seq: Vec<i32> = vec![0, 1, 2];
        let n = pos.len();
        let q = randn(&mut r, n * nh * hd, 1.0);
        let up16 = |d: &[u16]| g.upload(d).unwrap();
        let (qb, kb, vb) = (g.upload(&q).unwrap(), up16(&kh), up16(&vh));
        let (pb, sb, tb) = (
            g.upload(&pos).unwrap(),
            g.upload(&seq).unwrap(),
            g.upload(&btab).unwrap(),
        );
        let cnt = g.alloc_zeroed(n * nkv * 4).unwrap();
        for (n_split, split_len) in [(1usize, 1280usize), (10, 128), (40, 32)] {
            let part = poisoned(&g, n * nh * n_split * (hd + 2));
            let run = |merge: Option<(u64, u64)>| {
                g.attn_decode_merge(
                    n,
                    qb.ptr(),
                    kb.ptr(),
                    vb.ptr(),
                    pb.ptr(),
                    sb.ptr(),
                    tb.ptr(),
                    max_blocks,
                    bt,
                    nh,
                    nkv,
                    hd,
                    n_split,
                    split_len,
                    part.ptr(),
                    merge,
                )
                .unwrap()
            };
            run(None);
            let want = poisoned(&g, n * nh * hd);
            g.attn_combine(
                n,
                part.ptr(),
                pb.ptr(),
                nh,
                hd,
                n_split,
                split_len,
                want.ptr(),
            )
            .unwrap();
            let want: Vec<u32> = g.download(&want, n * nh * hd).unwrap();
            for rep in 0..2 {
                let out = poisoned(&g, n * nh * hd);
                run(Some((out.ptr(), cnt.ptr())));
                let got: Vec<u32> = g.download(&out, n * nh * hd).unwrap();
                assert_eq!(got, want, "hd {hd}, {n_split} x {split_len}, run {rep}");
                let c: Vec<u32> = g.download(&cnt, n * nkv).unwrap();
                assert!(c.iter().all(|&v| v == 0), "counters left non-zero");
            }
        }
        // The merged output against a direct f64 softmax (attn_decode's rounding: query and
        // probabilities as f16), for the token with the longest context.
        let t = 2;
        let out = poisoned(&g, n * nh * hd);
        let part = poisoned(&g, n * nh * 10 * (hd + 2));
        g.attn_decode_merge(
            n,
            qb.ptr(),
            kb.ptr(),
            vb.ptr(),
            pb.ptr(),
            sb.ptr(),
            tb.ptr(),
            max_blocks,
            bt,
            nh,
            nkv,
            hd,
            10,
            128,
            part.ptr(),
            Some((out.ptr(), cnt.ptr())),
        )
        .unwrap();
        let got: Vec<f32> = g.download(&out, n * nh * hd).unwrap();
        let len = pos[t] as usize + 1;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut want = Vec::new();
        for h in 0..nh {
            let kvh = h / (nh / nkv);
            let row = |p: usize| {
                let b = btab[seq[t] as usize * max_blocks + p / bt] as usize;
                (b * bt + p % bt) * kv_row + kvh * hd
            };
            let s: Vec<f64> = (0..len)
                .map(|p| {
                    (0..hd)
                        .map(|d| {
                            f16::from_f32(q[(t * nh + h) * hd + d]).to_f64()
                                * f16::from_bits(kh[row(p) + d]).to_f64()
                        })
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..hd {
                want.push(
                    (0..len)
                        .map(|p| e[p] / z * f16::from_bits(vh[row(p) + d]).to_f64())
                        .sum::<f64>(),
                );
            }
        }
        let e = rel_err(&got[t * nh * hd..(t + 1) * nh * hd], &want);
        assert!(
            e < 2e-3,
            "hd {hd}: merged attention off the f64 reference by {e:.2e}"
        );
    }
}

/// v8: the one-token attention (`attn_one`: `attn_batch` with its first tiles' copies issued
/// before the wait and the token's own K/V row stored by plain stores) writes `attn_batch`'s
/// partial results bit for bit, and `attn_merge` writes `attn_combine`'s bits on them (slices
/// from the token's length) and on `attn_decode`'s (fixed slices); the result within 2e-3 of
/// an f64 softmax. Contexts of 1, 100, 130 and ~2.5K positions, 1 to 40 splits: the own row in
/// a slice's first tile, in its second (both copied before the wait) and in a later one.
#[test]
fn one_token_attention_equals_batch_kernel_and_merge_equals_combine() {
    let Some(g) = gpu_or_skip("attn_one") else {
        return;
    };
    let mut r = rng("attn_one");
    for hd in cuda::kernels::PREFILL_HEAD_DIMS {
        let (nh, nkv, bt) = (24usize, 8usize, 16usize);
        let max_blocks = 170;
        let n_seq = 4;
        let n_blocks = n_seq * max_blocks;
        let kv_row = nkv * hd;
        let (kh, vh, btab) = paged_kv(&mut r, n_blocks, bt, kv_row);
        let up16 = |d: &[u16]| g.upload(d).unwrap();
        let (kb, vb, tb) = (up16(&kh), up16(&vh), g.upload(&btab).unwrap());
        let seq_of = r.gen_range(0..n_seq as i32);
        for len in [1usize, 100, 130, r.gen_range(2300..2700)] {
            // One token, as the decode step has it (the kernel's early copies assume so).
            let (pos, seq) = (vec![len as i32 - 1], vec![seq_of]);
            let q = randn(&mut r, nh * hd, 1.0);
            let (qb, pb, sb) = (
                g.upload(&q).unwrap(),
                g.upload(&pos).unwrap(),
                g.upload(&seq).unwrap(),
            );
            let args = |qp| (qp, kb.ptr(), vb.ptr(), pb.ptr(), sb.ptr(), tb.ptr());
            let words = nh * hd;
            for n_split in [1usize, 7, 33, 40] {
                let pw = nh * n_split * (hd + 2);
                let (pa, pbatch) = (poisoned(&g, pw), poisoned(&g, pw));
                let (q0, k0, v0, p0, s0, b0) = args(qb.ptr());
                // The one-token kernel (early copies) or attn_batch, into `out`.
                let split = |early: bool, out: &DevBuf| {
                    let f = if early {
                        Gpu::attn_one
                    } else {
                        Gpu::attn_batch
                    };
                    f(
                        &g,
                        1,
                        q0,
                        k0,
                        v0,
                        p0,
                        s0,
                        b0,
                        max_blocks,
                        bt,
                        nh,
                        nkv,
                        hd,
                        n_split,
                        out.ptr(),
                    )
                    .unwrap();
                };
                split(true, &pa);
                split(false, &pbatch);
                let got: Vec<u32> = g.download(&pa, pw).unwrap();
                let want: Vec<u32> = g.download(&pbatch, pw).unwrap();
                assert!(
                    got == want,
                    "hd {hd} len {len} splits {n_split}: attn_one's partials differ from attn_batch's"
                );
                // Session 11: the other loader form (warp-private or block-wide) of both
                // kernels writes the same bits.
                let wp = g.attn_wp.get();
                g.attn_wp.set(!wp);
                for early in [true, false] {
                    let po = poisoned(&g, pw);
                    split(early, &po);
                    let other: Vec<u32> = g.download(&po, pw).unwrap();
                    assert!(
                        other == want,
                        "hd {hd} len {len} splits {n_split}: attn_wp={} early={early} differs",
                        !wp
                    );
                }
                g.attn_wp.set(wp);
                let (om, oc) = (poisoned(&g, words), poisoned(&g, words));
                g.attn_merge(1, pa.ptr(), p0, nh, hd, n_split, 0, om.ptr())
                    .unwrap();
                g.attn_combine(1, pa.ptr(), p0, nh, hd, n_split, 0, oc.ptr())
                    .unwrap();
                let got: Vec<u32> = g.download(&om, words).unwrap();
                let want: Vec<u32> = g.download(&oc, words).unwrap();
                assert!(
                    got == want,
                    "hd {hd} len {len} splits {n_split}: attn_merge differs from attn_combine"
                );
                if n_split == 1 {
                    // Session 18/26: one split over all of the context's tiles writes the
                    // merged rows itself, attn_merge's bits (the default one-token path up to
                    // `CROSSOVER_CUDA_ONE_TILES` tiles).
                    let od = poisoned(&g, words);
                    g.attn_one_direct(
                        1,
                        (q0, k0, v0),
                        (p0, s0, b0, max_blocks, bt),
                        nh,
                        nkv,
                        hd,
                        od.ptr(),
                    )
                    .unwrap();
                    let direct: Vec<u32> = g.download(&od, words).unwrap();
                    assert!(
                        direct == got,
                        "hd {hd} len {len}: attn_one_direct differs from attn_one + attn_merge"
                    );
                }
                // Fixed slices (attn_decode's partial results, split_len > 0).
                let split_len = len.div_ceil(n_split).div_ceil(32) * 32;
                let ns = len.div_ceil(split_len);
                let pd = poisoned(&g, nh * ns * (hd + 2));
                g.attn_decode(
                    1,
                    q0,
                    k0,
                    v0,
                    p0,
                    s0,
                    b0,
                    max_blocks,
                    bt,
                    nh,
                    nkv,
                    hd,
                    ns,
                    split_len,
                    pd.ptr(),
                )
                .unwrap();
                let (om, oc) = (poisoned(&g, words), poisoned(&g, words));
                g.attn_merge(1, pd.ptr(), p0, nh, hd, ns, split_len, om.ptr())
                    .unwrap();
                g.attn_combine(1, pd.ptr(), p0, nh, hd, ns, split_len, oc.ptr())
                    .unwrap();
                let got: Vec<u32> = g.download(&om, words).unwrap();
                let want: Vec<u32> = g.download(&oc, words).unwrap();
                assert!(
                    got == want,
                    "hd {hd} len {len} {ns} x {split_len}: attn_merge differs from attn_combine"
                );
            }
            // The one-token path's output against a direct f64 softmax.
            let n_split = 33;
            let part = poisoned(&g, nh * n_split * (hd + 2));
            let out = poisoned(&g, words);
            let (q0, k0, v0, p0, s0, b0) = args(qb.ptr());
            g.attn_one(
                1,
                q0,
                k0,
                v0,
                p0,
                s0,
                b0,
                max_blocks,
                bt,
                nh,
                nkv,
                hd,
                n_split,
                part.ptr(),
            )
            .unwrap();
            g.attn_merge(1, part.ptr(), p0, nh, hd, n_split, 0, out.ptr())
                .unwrap();
            let got: Vec<f32> = g.download(&out, words).unwrap();
            let scale = 1.0 / (hd as f64).sqrt();
            let mut want = Vec::with_capacity(words);
            for h in 0..nh {
                let kvh = h / (nh / nkv);
                let row = |p: usize| {
                    let b = btab[seq_of as usize * max_blocks + p / bt] as usize;
                    (b * bt + p % bt) * kv_row + kvh * hd
                };
                let s: Vec<f64> = (0..len)
                    .map(|p| {
                        (0..hd)
                            .map(|d| {
                                f16::from_f32(q[h * hd + d]).to_f64()
                                    * f16::from_bits(kh[row(p) + d]).to_f64()
                            })
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..hd {
                    want.push(
                        (0..len)
                            .map(|p| e[p] / z * f16::from_bits(vh[row(p) + d]).to_f64())
                            .sum::<f64>(),
                    );
                }
            }
            let e = rel_err(&got, &want);
            eprintln!("attn_one hd {hd} len {len}: relative error {e:.2e}");
            assert!(
                e < 2e-3,
                "hd {hd} len {len}: one-token attention off f64 by {e:.2e}"
            );
        }
    }
}

/// v9: the many-sequence attention that merges its own slices (`attn_batchm`, the last block of
/// each token and KV head to finish) gives attn_batch + attn_combine's output bit for bit, for
/// tokens of many lengths (shorter than one tile, partial tiles, fewer tiles than splits) in one
/// launch, twice on the same counters (a graph replay), which it leaves zeroed.
#[test]
fn batch_attention_merge_equals_batch_then_combine() {
    let Some(g) = gpu_or_skip("attn_batchm") else {
        return;
    };
    let mut r = rng("attn_batchm");
    for hd in cuda::kernels::PREFILL_HEAD_DIMS {
        let (nh, nkv, bt) = (24usize, 8usize, 16usize);
        let (max_blocks, n_seq) = (48usize, 6usize);
        let n_blocks = n_seq * max_blocks;
        let kv_row = nkv * hd;
        let (kh, vh, btab) = paged_kv(&mut r, n_blocks, bt, kv_row);
        let n = 21;
        let seq: Vec<i32> = (0..n).map(|_| r.gen_range(0..n_seq as i32)).collect();
        let pos: Vec<i32> = (0..n)
            .map(|i| match i {
                0 => 0,
                1 => 63,
                2 => 64,
                _ => r.gen_range(1..max_blocks * bt) as i32,
            })
            .collect();
        let q = randn(&mut r, n * nh * hd, 1.0);
        let up16 = |d: &[u16]| g.upload(d).unwrap();
        let (kb, vb, tb) = (up16(&kh), up16(&vh), g.upload(&btab).unwrap());
        let (qb, pb, sb) = (
            g.upload(&q).unwrap(),
            g.upload(&pos).unwrap(),
            g.upload(&seq).unwrap(),
        );
        let words = n * nh * hd;
        let cnt = g.alloc_zeroed(n * nkv * 4).unwrap();
        for n_split in [1usize, 3, 9, 13] {
            let pw = n * nh * n_split * (hd + 2);
            let (pa, pm) = (poisoned(&g, pw), poisoned(&g, pw));
            g.attn_batch(
                n,
                qb.ptr(),
                kb.ptr(),
                vb.ptr(),
                pb.ptr(),
                sb.ptr(),
                tb.ptr(),
                max_blocks,
                bt,
                nh,
                nkv,
                hd,
                n_split,
                pa.ptr(),
            )
            .unwrap();
            // Session 11: the other loader form writes the same partial results.
            let wp = g.attn_wp.get();
            g.attn_wp.set(!wp);
            let po = poisoned(&g, pw);
            g.attn_batch(
                n,
                qb.ptr(),
                kb.ptr(),
                vb.ptr(),
                pb.ptr(),
                sb.ptr(),
                tb.ptr(),
                max_blocks,
                bt,
                nh,
                nkv,
                hd,
                n_split,
                po.ptr(),
            )
            .unwrap();
            let (ours, other): (Vec<u32>, Vec<u32>) =
                (g.download(&pa, pw).unwrap(), g.download(&po, pw).unwrap());
            let bad = ours.iter().zip(&other).filter(|(a, b)| a != b).count();
            assert_eq!(
                bad, 0,
                "hd {hd} splits {n_split}: attn_wp={} differs in {bad} of {pw} partial words",
                !wp
            );
            g.attn_wp.set(wp);
            let oc = poisoned(&g, words);
            g.attn_combine(n, pa.ptr(), pb.ptr(), nh, hd, n_split, 0, oc.ptr())
                .unwrap();
            let want: Vec<u32> = g.download(&oc, words).unwrap();
            if n_split == 1 {
                // Session 11: one split writes attn_combine's rows itself, in either loader form.
                for wp in [true, false] {
                    let w0 = g.attn_wp.get();
                    g.attn_wp.set(wp);
                    let od = poisoned(&g, words);
                    g.attn_batch_direct(
                        n,
                        (qb.ptr(), kb.ptr(), vb.ptr()),
                        (pb.ptr(), sb.ptr(), tb.ptr(), max_blocks, bt),
                        nh,
                        nkv,
                        hd,
                        od.ptr(),
                    )
                    .unwrap();
                    g.attn_wp.set(w0);
                    let got: Vec<u32> = g.download(&od, words).unwrap();
                    let bad = got.iter().zip(&want).filter(|(a, b)| a != b).count();
                    assert_eq!(
                        bad, 0,
                        "hd {hd} attn_wp={wp}: {bad} of {words} direct outputs differ from \
                         attn_batch + attn_combine"
                    );
                }
            }
            for replay in 0..2 {
                let om = poisoned(&g, words);
                g.attn_batch_merge(
                    n,
                    (qb.ptr(), kb.ptr(), vb.ptr()),
                    (pb.ptr(), sb.ptr(), tb.ptr(), max_blocks, bt),
                    nh,
                    nkv,
                    hd,
                    n_split,
                    pm.ptr(),
                    om.ptr(),
                    cnt.ptr(),
                )
                .unwrap();
                let got: Vec<u32> = g.download(&om, words).unwrap();
                let bad = got.iter().zip(&want).filter(|(a, b)| a != b).count();
                assert_eq!(
                    bad, 0,
                    "hd {hd} splits {n_split} replay {replay}: {bad} of {words} merged outputs \
                     differ from attn_batch + attn_combine"
                );
                let left: Vec<u32> = g.download(&cnt, n * nkv).unwrap();
                assert!(
                    left.iter().all(|&c| c == 0),
                    "hd {hd} splits {n_split}: counters left non-zero: {left:?}"
                );
            }
        }
    }
}

/// v7: the prompt path's warp-quantizing kernels (`rms_norm_w`, `act_f16_w`, prefill.cu) give
/// the bits of the block kernels they replace: RMSNorm within the same ulps of
/// `cpu::ops::rms_norm` and bit-identical to `rms_norm`; SwiGLU bit-identical to the CPU's; the
/// f16 operands, int8 values and scales bit-identical to `quantize_act` / `quantize_act_f16`
/// (themselves bit-identical to the CPU's quantizer). Both activation formats and plain f16,
/// a width that is not a whole 256-element group (Q8_0 blocks), planted ties and zero groups.
#[test]
fn warp_quantized_operands_match_block_kernels() {
    let Some(g) = gpu_or_skip("warp_operands") else {
        return;
    };
    let mut r = rng("warp_operands");
    let rows = 37usize;
    for (n, fmts) in [
        (
            3072usize,
            vec![None, Some(ActFormat::Q8x32), Some(ActFormat::Q8K)],
        ),
        (576, vec![None, Some(ActFormat::Q8x32)]),
    ] {
        let w = randn(&mut r, n, 1.0);
        let wb = g.upload(&w).unwrap();
        let mut x = randn(&mut r, rows * n, 2.0);
        x[256..512].iter_mut().for_each(|v| *v = 0.0);
        x[n + 3] = 9.5;
        x[n + 200] = -9.5;
        let xb = g.upload(&x).unwrap();
        for fmt in fmts {
            // RMSNorm: the block kernel's output, f16 operand, int8 values and scales.
            let (outa, outb) = (poisoned(&g, rows * n), poisoned(&g, rows * n));
            let (ha, hb) = (
                g.upload(&vec![0xffffu16; rows * n]).unwrap(),
                g.upload(&vec![0x1234u16; rows * n]).unwrap(),
            );
            let (qa, da) = act_bufs(&g, rows, n);
            let (qb, db) = act_bufs(&g, rows, n);
            g.rms_norm(
                xb.ptr(),
                0,
                wb.ptr(),
                n,
                1e-5,
                rows,
                outa.ptr(),
                ha.ptr(),
                fmt.map(|f| (f, qa.ptr(), da.ptr())),
            )
            .unwrap();
            g.rms_norm_w(
                xb.ptr(),
                wb.ptr(),
                n,
                1e-5,
                rows,
                outb.ptr(),
                hb.ptr(),
                fmt.map(|f| (f, qb.ptr(), db.ptr())),
            )
            .unwrap();
            let (a, b): (Vec<u32>, Vec<u32>) = (
                g.download(&outa, rows * n).unwrap(),
                g.download(&outb, rows * n).unwrap(),
            );
            assert_eq!(a, b, "n {n} {fmt:?}: rms_norm_w output");
            let mut c = vec![0f32; n];
            let got: Vec<f32> = g.download(&outb, rows * n).unwrap();
            for t in 0..rows {
                cpu::ops::rms_norm(&x[t * n..(t + 1) * n], &w, 1e-5, &mut c);
                for (i, (&a, &b)) in got[t * n..(t + 1) * n].iter().zip(&c).enumerate() {
                    let d = (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs();
                    assert!(d <= 4, "n {n} row {t} element {i}: {a} vs cpu {b}");
                }
            }
            let (a, b): (Vec<u16>, Vec<u16>) = (
                g.download(&ha, rows * n).unwrap(),
                g.download(&hb, rows * n).unwrap(),
            );
            assert_eq!(a, b, "n {n} {fmt:?}: rms_norm_w f16 operand");
            if fmt.is_some() {
                let (a, b): (Vec<u8>, Vec<u8>) = (
                    g.download(&qa, rows * n).unwrap(),
                    g.download(&qb, rows * n).unwrap(),
                );
                assert_eq!(a, b, "n {n} {fmt:?}: rms_norm_w int8 values");
                let nd = act_bytes(rows, n).1 / 4;
                let (a, b): (Vec<u32>, Vec<u32>) =
                    (g.download(&da, nd).unwrap(), g.download(&db, nd).unwrap());
                assert_eq!(a, b, "n {n} {fmt:?}: rms_norm_w scales and sums");
            }

            // The plain operand conversion, then SwiGLU with the operand.
            let (ha, hb) = (
                g.upload(&vec![0xffffu16; rows * n]).unwrap(),
                g.upload(&vec![0x1234u16; rows * n]).unwrap(),
            );
            match fmt {
                Some(f) => g.quantize_act_f16(xb.ptr(), rows, n, f, ha.ptr()).unwrap(),
                None => g.to_f16(xb.ptr(), rows * n, ha.ptr()).unwrap(),
            }
            g.act_f16_w(xb.ptr(), 0, rows, n, fmt, hb.ptr()).unwrap();
            if let Some(f) = fmt {
                let (qa, da) = act_bufs(&g, rows, n);
                let (qb, db) = act_bufs(&g, rows, n);
                g.quantize_act(xb.ptr(), rows, n, f, qa.ptr(), da.ptr())
                    .unwrap();
                g.act_quant_w(xb.ptr(), 0, rows, n, fmt, qb.ptr(), db.ptr(), 0)
                    .unwrap();
                let (a, b): (Vec<u8>, Vec<u8>) = (
                    g.download(&qa, rows * n).unwrap(),
                    g.download(&qb, rows * n).unwrap(),
                );
                assert_eq!(a, b, "n {n} {fmt:?}: act_quant_w int8 values");
                let nd = act_bytes(rows, n).1 / 4;
                let (a, b): (Vec<u32>, Vec<u32>) =
                    (g.download(&da, nd).unwrap(), g.download(&db, nd).unwrap());
                assert_eq!(a, b, "n {n} {fmt:?}: act_quant_w scales and sums");
            }
            let (a, b): (Vec<u16>, Vec<u16>) = (
                g.download(&ha, rows * n).unwrap(),
                g.download(&hb, rows * n).unwrap(),
            );
            assert_eq!(a, b, "n {n} {fmt:?}: act_f16_w operand");

            let up = randn(&mut r, rows * n, 3.0);
            let mut want = x.clone();
            quant::dot::ggml::swiglu_isa(Isa::Scalar, &mut want, &up);
            let (gd, ud) = (g.upload(&x).unwrap(), g.upload(&up).unwrap());
            let hs = g.upload(&vec![0x1234u16; rows * n]).unwrap();
            g.act_f16_w(gd.ptr(), ud.ptr(), rows, n, fmt, hs.ptr())
                .unwrap();
            let got: Vec<f32> = g.download(&gd, rows * n).unwrap();
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{fmt:?} swiglu element {i}: {a} vs cpu {b}"
                );
            }
            let hw = g.upload(&vec![0xffffu16; rows * n]).unwrap();
            match fmt {
                Some(f) => g.quantize_act_f16(gd.ptr(), rows, n, f, hw.ptr()).unwrap(),
                None => g.to_f16(gd.ptr(), rows * n, hw.ptr()).unwrap(),
            }
            let (a, b): (Vec<u16>, Vec<u16>) = (
                g.download(&hw, rows * n).unwrap(),
                g.download(&hs, rows * n).unwrap(),
            );
            assert_eq!(a, b, "n {n} {fmt:?}: act_f16_w SwiGLU operand");
        }
    }
}

/// v7: the wide one-token product (`mvw_*`, the down projection) that quantizes its f32
/// activation itself gives the bits of `quantize_act` followed by the same kernel reading the
/// quantized activation, and agrees with the CPU's scalar `vec_dot` on the CPU's own quantized
/// activations (every quantized type; plain and accumulating; a partial last block of rows).
#[test]
fn wide_product_prep_equals_quantize_then_product() {
    let Some(g) = gpu_or_skip("wide_product") else {
        return;
    };
    let mut r = rng("wide_product");
    let cols = 8192usize;
    for &(ty, name) in QTYPES {
        let fmt = act_format(ty).unwrap();
        let rows = r.gen_range(41..90usize);
        let (q, _) = quantized(ty, &randn(&mut r, rows * cols, 0.5));
        let w = g.upload(&q).unwrap();
        let rb = q.len() / rows;
        let x = randn(&mut r, cols, 1.0);
        let mut buf = quant::dot::ActBuf::new();
        quant::dot::quantize_acts_with_isa(ty, &x, 1, cols, &mut buf, Isa::Scalar).unwrap();
        let a = buf.row(0).unwrap();
        let want: Vec<f64> = (0..rows)
            .map(|rr| {
                quant::dot::vec_dot(ty, &q[rr * rb..(rr + 1) * rb], a, cols, Isa::Scalar).unwrap()
                    as f64
            })
            .collect();
        let xb = g.upload(&x).unwrap();
        let (qb, db) = act_bufs(&g, 1, cols);
        g.quantize_act(xb.ptr(), 1, cols, fmt, qb.ptr(), db.ptr())
            .unwrap();
        for acc in [false, true] {
            let y0 = randn(&mut r, rows, 1.0);
            let (y1, y2) = (g.upload(&y0).unwrap(), g.upload(&y0).unwrap());
            g.matvec_q_wide(ty, w.ptr(), rows, cols, qb.ptr(), db.ptr(), y1.ptr(), acc)
                .unwrap();
            g.matvec_q_wide_prep(ty, w.ptr(), rows, cols, xb.ptr(), y2.ptr(), acc)
                .unwrap();
            let a: Vec<u32> = g.download(&y1, rows).unwrap();
            let b: Vec<u32> = g.download(&y2, rows).unwrap();
            assert_eq!(
                a, b,
                "{name} {rows}x{cols} accumulate={acc}: fused vs unfused"
            );
            let got: Vec<f32> = g.download(&y2, rows).unwrap();
            let w2: Vec<f64> = want
                .iter()
                .zip(&y0)
                .map(|(v, &b)| if acc { v + b as f64 } else { *v })
                .collect();
            let e = rel_err(&got, &w2);
            assert!(
                e < 5e-6,
                "{name} {rows}x{cols} accumulate={acc}: relative error {e:e}"
            );
        }
    }
}

/// One f16 product on quantized weights ([`Gpu::matmul_f16w`]) with its own workspace.
#[allow(clippy::too_many_arguments)]
fn run_mmf(
    g: &Gpu,
    ty: GgmlType,
    w: &DevBuf,
    rows: usize,
    cols: usize,
    xh: &DevBuf,
    n: usize,
    y: &DevBuf,
    acc: bool,
) -> cuda::kernels::MmfPlan {
    let p = cuda::kernels::mmf_plan(g.sms as usize, ty, rows, cols, n, g.mmf_warps.get());
    run_split_k(g, &p, rows, n, acc, |ws, cnt, a| {
        g.matmul_f16w(ty, w.ptr(), rows, cols, xh.ptr(), n, y.ptr(), a, ws, cnt)
            .map_err(|e| e.to_string())
    });
    p
}

/// Run a split-K product laid out by `p` through `launch(ws, cnt, accumulate)`: plain twice
/// (its row-tile counters must be left at zero for the next launch), accumulating once; then
/// check the counters.
fn run_split_k(
    g: &Gpu,
    p: &cuda::kernels::MmfPlan,
    rows: usize,
    n: usize,
    acc: bool,
    launch: impl Fn(u64, u64, bool) -> Result<(), String>,
) {
    let ws = g.alloc(p.ws_floats(rows, n).max(1) * 4).unwrap();
    let cnt = g.alloc_zeroed(p.tiles * 4).unwrap();
    for _ in 0..if acc { 1 } else { 2 } {
        launch(ws.ptr(), cnt.ptr(), acc).unwrap();
    }
    let left: Vec<u32> = g.download(&cnt, p.tiles).unwrap();
    assert!(
        left.iter().all(|&c| c == 0),
        "row-tile counters not left at zero"
    );
}

#[test]
fn matmul_f16w_matches_f16_reference_and_cublas() {
    let Some(g) = gpu_or_skip("matmul_f16w") else {
        return;
    };
    let mut r = rng("matmul_f16w");
    for &(ty, name) in QTYPES {
        // Odd row counts (partial row tiles); 70 rows of 2048 split K 16 ways; the two types of
        // the 3B file also at a head-like 34,000 rows (one K slice, several activation chunks).
        let mut shapes = vec![(301usize, 512usize), (70, 2048)];
        if matches!(ty, GgmlType::Q4K | GgmlType::Q6K) {
            shapes.push((34_000, 2048));
        }
        for (rows, cols) in shapes {
            let (q, _) = quantized(ty, &randn(&mut r, rows * cols, 0.5));
            let w = g.upload(&q).unwrap();
            // The f16 weights the cuBLAS path multiplies: dequant_f16's copy.
            let wh = g.alloc(rows * cols * 2).unwrap();
            g.dequant_f16(ty, w.ptr(), rows, cols, wh.ptr()).unwrap();
            let w16: Vec<u16> = g.download(&wh, rows * cols).unwrap();
            let w64: Vec<f64> = w16.iter().map(|&b| f16::from_bits(b).to_f64()).collect();
            // f64 reference on every row of the small shapes, every 97th of the big one.
            let check: Vec<usize> = if rows > 1000 {
                (0..rows).step_by(97).collect()
            } else {
                (0..rows).collect()
            };
            // Both block sizes; Q4_K and Q6_K also with the conversion-unit decode.
            let kq = matches!(ty, GgmlType::Q4K | GgmlType::Q6K);
            for (n, warps, fast) in [9usize, 17, 33, 64].into_iter().flat_map(|n| {
                [(n, 4usize, true), (n, 8, true), (n, 8, false)]
                    .into_iter()
                    .filter(move |c| c.2 || kq)
            }) {
                g.mmf_warps.set(warps);
                g.mmf_fast.set(fast);
                // One-hot activations: each product is one weight, exactly (this checks the
                // decode and the k order bit for bit against the f16 copy).
                let cols_hot: Vec<usize> = (0..n).map(|_| r.gen_range(0..cols)).collect();
                let mut hot = vec![0u16; n * cols];
                for (t, &c) in cols_hot.iter().enumerate() {
                    hot[t * cols + c] = f16::ONE.to_bits();
                }
                let xh = g.upload(&hot).unwrap();
                let y = poisoned(&g, n * rows);
                let p = run_mmf(&g, ty, &w, rows, cols, &xh, n, &y, false);
                let got: Vec<f32> = g.download(&y, n * rows).unwrap();
                for t in 0..n {
                    for rr in 0..rows {
                        let want = f16::from_bits(w16[rr * cols + cols_hot[t]]).to_f32();
                        let a = got[t * rows + rr];
                        // (== rather than bits: a -0 weight sums to +0 with the zeros.)
                        assert!(
                            a == want,
                            "{name} {rows}x{cols} n={n} fast={fast} {p:?}: one-hot token {t} \
                             row {rr}: {a} against the f16 copy's {want}"
                        );
                    }
                }
                // Random activations against f64 sums of the same f16 operands, plain and
                // accumulating, and against cuBLAS on the f16 copy.
                let x: Vec<u16> = randn(&mut r, n * cols, 1.0)
                    .iter()
                    .map(|&v| f16::from_f32(v).to_bits())
                    .collect();
                let x64: Vec<f64> = x.iter().map(|&b| f16::from_bits(b).to_f64()).collect();
                let xh = g.upload(&x).unwrap();
                let y0 = randn(&mut r, n * rows, 1.0);
                let y = poisoned(&g, n * rows);
                run_mmf(&g, ty, &w, rows, cols, &xh, n, &y, false);
                let got: Vec<f32> = g.download(&y, n * rows).unwrap();
                let ya = g.upload(&y0).unwrap();
                run_mmf(&g, ty, &w, rows, cols, &xh, n, &ya, true);
                let got_acc: Vec<f32> = g.download(&ya, n * rows).unwrap();
                let (mut g1, mut g2, mut w1, mut w2) = (vec![], vec![], vec![], vec![]);
                for t in 0..n {
                    for &rr in &check {
                        let wr = &w64[rr * cols..(rr + 1) * cols];
                        let xr = &x64[t * cols..(t + 1) * cols];
                        let s: f64 = wr.iter().zip(xr).map(|(a, b)| a * b).sum();
                        let mag: f64 = wr.iter().zip(xr).map(|(a, b)| (a * b).abs()).sum();
                        let i = t * rows + rr;
                        // f32 sums of `cols` exact products: within cols * 2^-24 of the
                        // magnitude in the worst case, far less in practice.
                        assert!(
                            (got[i] as f64 - s).abs() <= 2e-5 * mag + 1e-30,
                            "{name} {rows}x{cols} n={n} warps {warps}: token {t} row {rr}: {} \
                             against {s}",
                            got[i]
                        );
                        g1.push(got[i]);
                        w1.push(s);
                        g2.push(got_acc[i]);
                        w2.push(s + y0[i] as f64);
                    }
                }
                // f32 sums of up to 2048 terms: ~sqrt(2048) * 2^-24 = 3e-6 in norm.
                let (e1, e2) = (rel_err(&g1, &w1), rel_err(&g2, &w2));
                assert!(
                    e1 < 1e-5 && e2 < 1e-5,
                    "{name} {rows}x{cols} n={n} warps {warps}: relative error {e1:e} \
                     (accumulating {e2:e})"
                );
                if g.has_blas() {
                    let yc = poisoned(&g, n * rows);
                    g.gemm_f16(wh.ptr(), xh.ptr(), yc.ptr(), rows, n, cols, 0.0)
                        .unwrap();
                    let blas: Vec<f32> = g.download(&yc, n * rows).unwrap();
                    let b64: Vec<f64> = blas.iter().map(|&v| v as f64).collect();
                    let e = rel_err(&got, &b64);
                    assert!(
                        e < 1e-5,
                        "{name} {rows}x{cols} n={n}: relative difference to cuBLAS {e:e}"
                    );
                }
            }
        }
    }
}

/// v9: `attn_merge_q` writes `attn_merge`'s output bit for bit and the int8 values and scales
/// `quantize_act` writes from that output, in both activation formats, for head sizes 64 and
/// 128 (four and two heads per block), 1 to 40 slices of token-length contexts.
#[test]
fn merge_with_quantization_equals_merge_then_quantize() {
    let Some(g) = gpu_or_skip("attn_merge_q") else {
        return;
    };
    let mut r = rng("attn_merge_q");
    for hd in cuda::kernels::PREFILL_HEAD_DIMS {
        let (nh, nkv, bt) = (24usize, 8usize, 16usize);
        let max_blocks = 170;
        let kv_row = nkv * hd;
        let n_blocks = max_blocks;
        let (kh, vh, btab) = paged_kv(&mut r, n_blocks, bt, kv_row);
        let (kb, vb) = (g.upload(&kh).unwrap(), g.upload(&vh).unwrap());
        let tb = g.upload(&btab).unwrap();
        let sb = g.upload(&[0i32]).unwrap();
        let words = nh * hd;
        for len in [1usize, 130, r.gen_range(2000..2700)] {
            let pb = g.upload(&[len as i32 - 1]).unwrap();
            let qv = g.upload(&randn(&mut r, words, 1.0)).unwrap();
            for n_split in [1usize, 7, 33, 40] {
                let part = poisoned(&g, nh * n_split * (hd + 2));
                g.attn_one(
                    1,
                    qv.ptr(),
                    kb.ptr(),
                    vb.ptr(),
                    pb.ptr(),
                    sb.ptr(),
                    tb.ptr(),
                    max_blocks,
                    bt,
                    nh,
                    nkv,
                    hd,
                    n_split,
                    part.ptr(),
                )
                .unwrap();
                let want = poisoned(&g, words);
                g.attn_merge(1, part.ptr(), pb.ptr(), nh, hd, n_split, 0, want.ptr())
                    .unwrap();
                for fmt in [ActFormat::Q8K, ActFormat::Q8x32] {
                    let (qa, da) = act_bufs(&g, 1, words);
                    g.quantize_act(want.ptr(), 1, words, fmt, qa.ptr(), da.ptr())
                        .unwrap();
                    let got = poisoned(&g, words);
                    let (qg, dg) = act_bufs(&g, 1, words);
                    g.attn_merge_q(
                        1,
                        part.ptr(),
                        pb.ptr(),
                        nh,
                        hd,
                        n_split,
                        0,
                        got.ptr(),
                        fmt,
                        qg.ptr(),
                        dg.ptr(),
                    )
                    .unwrap();
                    let what = format!("hd {hd} len {len} splits {n_split} {fmt:?}");
                    let w: Vec<u32> = g.download(&want, words).unwrap();
                    let o: Vec<u32> = g.download(&got, words).unwrap();
                    assert!(w == o, "{what}: output differs from attn_merge");
                    let (qn, dn) = act_bytes(1, words);
                    let (a, b): (Vec<u8>, Vec<u8>) =
                        (g.download(&qa, qn).unwrap(), g.download(&qg, qn).unwrap());
                    assert!(a == b, "{what}: int8 values differ from quantize_act");
                    let (a, b): (Vec<u8>, Vec<u8>) =
                        (g.download(&da, dn).unwrap(), g.download(&dg, dn).unwrap());
                    assert!(a == b, "{what}: scales differ from quantize_act");
                }
            }
        }
    }
}

/// v10: RoPE and the KV write reading Q/K/V from one fused product's rows (Q/K/V side by side,
/// rotated Q to its own buffer) give the bits of `rope_store` on dense Q, K and V buffers.
#[test]
fn rope_store_rows_on_fused_rows_equals_dense_rope_store() {
    let Some(g) = gpu_or_skip("rope_store_rows") else {
        return;
    };
    let mut r = rng("rope_store_rows");
    let (nh, nkv, hd, n) = (6, 2, 64, 7);
    let (qd, kvd) = (nh * hd, nkv * hd);
    let width = qd + 2 * kvd;
    let rows = 12;
    for (style, n_rot, with_bias) in [
        (model::RopeStyle::Normal, hd, false),
        (model::RopeStyle::Neox, hd / 2, true),
    ] {
        let params = cuda::kernels::RopeParams::new(n_rot, 500000.0, 1.0, 0);
        let fused = randn(&mut r, n * width, 1.0);
        let part = |o: usize, w: usize| -> Vec<f32> {
            (0..n)
                .flat_map(|t| fused[t * width + o..t * width + o + w].to_vec())
                .collect()
        };
        let (q, k, v) = (part(0, qd), part(qd, kvd), part(qd + kvd, kvd));
        let bias: Vec<DevBuf> = [qd, kvd, kvd]
            .iter()
            .map(|&w| g.upload(&randn(&mut r, w, 0.1)).unwrap())
            .collect();
        let bp = if with_bias {
            [bias[0].ptr(), bias[1].ptr(), bias[2].ptr()]
        } else {
            [0; 3]
        };
        let pos: Vec<i32> = (0..n).map(|_| r.gen_range(0..5000)).collect();
        let slot: Vec<i32> = vec![9, 2, 7, 0, 4, 11, 5];
        let (pb, sb) = (g.upload(&pos).unwrap(), g.upload(&slot).unwrap());
        let up = |d: &[f32]| g.upload(d).unwrap();
        let (qb, kb, vb, fb) = (up(&q), up(&k), up(&v), up(&fused));
        let caches = || {
            (
                g.upload(&vec![0x7e00u16; rows * kvd]).unwrap(),
                g.upload(&vec![0x7e00u16; rows * kvd]).unwrap(),
            )
        };
        let ((kc0, vc0), (kc1, vc1)) = (caches(), caches());
        let neox = style == model::RopeStyle::Neox;
        g.rope_store(
            n,
            qb.ptr(),
            kb.ptr(),
            vb.ptr(),
            bp,
            pb.ptr(),
            sb.ptr(),
            &params,
            nh,
            nkv,
            hd,
            neox,
            kc0.ptr(),
            vc0.ptr(),
        )
        .unwrap();
        let qo = poisoned(&g, n * qd);
        let io = cuda::kernels::RopeRows {
            q_out: qo.ptr(),
            q_stride: width,
            kv_stride: width,
        };
        g.rope_store_rows(
            n,
            fb.ptr(),
            fb.at(qd * 4),
            fb.at((qd + kvd) * 4),
            bp,
            pb.ptr(),
            sb.ptr(),
            &params,
            nh,
            nkv,
            hd,
            neox,
            kc1.ptr(),
            vc1.ptr(),
            io,
        )
        .unwrap();
        let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        assert_eq!(
            bits(g.download(&qb, n * qd).unwrap()),
            bits(g.download(&qo, n * qd).unwrap()),
            "{style:?}: rotated Q"
        );
        assert_eq!(
            bits(g.download(&fb, n * width).unwrap()),
            bits(fused.clone()),
            "{style:?}: the fused rows are only read"
        );
        for (a, b, what) in [(&kc0, &kc1, "K cache"), (&vc0, &vc1, "V cache")] {
            let a: Vec<u16> = g.download(a, rows * kvd).unwrap();
            let b: Vec<u16> = g.download(b, rows * kvd).unwrap();
            assert_eq!(a, b, "{style:?}: {what}");
        }
        // A stride below the row width is a typed error, not a launch.
        let bad = cuda::kernels::RopeRows {
            q_out: qo.ptr(),
            q_stride: qd - 1,
            kv_stride: width,
        };
        assert!(g
            .rope_store_rows(
                n,
                fb.ptr(),
                fb.at(qd * 4),
                fb.at((qd + kvd) * 4),
                bp,
                pb.ptr(),
                sb.ptr(),
                &params,
                nh,
                nkv,
                hd,
                neox,
                kc1.ptr(),
                vc1.ptr(),
                bad,
            )
            .is_err());
    }
}

/// v10: the SwiGLU + f16 operand kernel on one fused gate/up product's rows (gate then up in
/// each row) gives the bits of `act_f16_w` on dense gate and up buffers, and writes the same
/// SwiGLU back into the gate halves.
#[test]
fn act_f16_strided_on_fused_rows_equals_dense() {
    let Some(g) = gpu_or_skip("act_f16_strided") else {
        return;
    };
    let mut r = rng("act_f16_strided");
    let (rows, ff) = (37usize, 3072usize);
    let fused = randn(&mut r, rows * 2 * ff, 2.0);
    let part = |o: usize| -> Vec<f32> {
        (0..rows)
            .flat_map(|t| fused[t * 2 * ff + o..t * 2 * ff + o + ff].to_vec())
            .collect()
    };
    let (gate, upv) = (part(0), part(ff));
    for fmt in [None, Some(ActFormat::Q8x32), Some(ActFormat::Q8K)] {
        let (gb, ub, fb) = (
            g.upload(&gate).unwrap(),
            g.upload(&upv).unwrap(),
            g.upload(&fused).unwrap(),
        );
        let ha = g.upload(&vec![0xffffu16; rows * ff]).unwrap();
        let hb = g.upload(&vec![0x1234u16; rows * ff]).unwrap();
        g.act_f16_w(gb.ptr(), ub.ptr(), rows, ff, fmt, ha.ptr())
            .unwrap();
        g.act_f16_strided(fb.ptr(), fb.at(ff * 4), rows, ff, 2 * ff, fmt, hb.ptr())
            .unwrap();
        let a: Vec<u16> = g.download(&ha, rows * ff).unwrap();
        let b: Vec<u16> = g.download(&hb, rows * ff).unwrap();
        assert_eq!(a, b, "{fmt:?}: f16 operand");
        let sw: Vec<f32> = g.download(&gb, rows * ff).unwrap();
        let fw: Vec<f32> = g.download(&fb, rows * 2 * ff).unwrap();
        for t in 0..rows {
            let (x, y) = (&sw[t * ff..(t + 1) * ff], &fw[t * 2 * ff..t * 2 * ff + ff]);
            assert!(
                x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
                "{fmt:?}: SwiGLU written back, row {t}"
            );
            assert!(
                fw[t * 2 * ff + ff..(t + 1) * 2 * ff]
                    .iter()
                    .zip(&upv[t * ff..(t + 1) * ff])
                    .all(|(p, q)| p.to_bits() == q.to_bits()),
                "{fmt:?}: up halves untouched, row {t}"
            );
        }
    }
    let hb = g.alloc(rows * ff * 2).unwrap();
    let fb = g.upload(&fused).unwrap();
    assert!(g
        .act_f16_strided(fb.ptr(), fb.at(ff * 4), rows, ff, ff - 4, None, hb.ptr())
        .is_err());
}

/// v10: the cuBLASLt products (each shape's fastest heuristic candidate, kept even where
/// cublasGemmEx was faster) against the f64 sum of the same f16 operands and against
/// cublasGemmEx, plain and accumulating, at batched-decode token counts.
#[test]
fn gemm_lt_matches_reference_and_gemm_ex() {
    let Some(g) = gpu_or_skip("gemm_lt") else {
        return;
    };
    if !g.has_blas() || !g.lt_wants(16) {
        eprintln!(
            "SKIPPED gemm_lt: {}",
            g.lt_missing
                .clone()
                .unwrap_or_else(|| "cuBLASLt switched off".into())
        );
        return;
    }
    g.lt_force.set(true);
    let mut r = rng("gemm_lt");
    for (m, n, k) in [(640, 16, 512), (1000, 48, 768), (3072, 64, 1024)] {
        let w = randn(&mut r, m * k, 0.5);
        let x = randn(&mut r, n * k, 1.0);
        let wh: Vec<u16> = w.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
        let xh: Vec<u16> = x.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
        let (wb, xb) = (g.upload(&wh).unwrap(), g.upload(&xh).unwrap());
        let mut dot = vec![0f64; n * m];
        for t in 0..n {
            for rr in 0..m {
                dot[t * m + rr] = (0..k)
                    .map(|c| {
                        f16::from_bits(wh[rr * k + c]).to_f64()
                            * f16::from_bits(xh[t * k + c]).to_f64()
                    })
                    .sum();
            }
        }
        for acc in [false, true] {
            let c0 = randn(&mut r, n * m, 1.0);
            let want: Vec<f64> = dot
                .iter()
                .zip(&c0)
                .map(|(d, &c)| d + if acc { c as f64 } else { 0.0 })
                .collect();
            let beta = if acc { 1.0 } else { 0.0 };
            let mut outs = Vec::new();
            for lt in [true, false] {
                g.lt_on.set(lt);
                let cb = g.upload(&c0).unwrap();
                g.gemm_f16(wb.ptr(), xb.ptr(), cb.ptr(), m, n, k, beta)
                    .unwrap();
                let got: Vec<f32> = g.download(&cb, n * m).unwrap();
                let e = rel_err(&got, &want);
                assert!(e < 1e-5, "m {m} n {n} k {k} acc {acc} lt {lt}: error {e:e}");
                outs.push(got);
            }
            let ex: Vec<f64> = outs[1].iter().map(|&v| v as f64).collect();
            let e = rel_err(&outs[0], &ex);
            assert!(
                e < 1e-5,
                "m {m} n {n} k {k} acc {acc}: cuBLASLt vs GemmEx {e:e}"
            );
        }
    }
    g.lt_on.set(true);
    let t = g.gemm_tunings();
    eprintln!("gemm_lt tunings: {t:?}");
    assert_eq!(t.len(), 6, "one tuning per shape");
    assert!(
        t.iter().all(|t| t.candidates == 0 || t.lt_kept),
        "forced shapes keep a cuBLASLt candidate"
    );
    assert!(
        t.iter().any(|t| t.candidates > 0),
        "the heuristic offered no candidate for any shape"
    );
}

/// v10: the one-token Q6_K product by half super-blocks (`mv6_q6_k`) and the wide-row product
/// one warp per row (`mvd_*`, 8192 columns) against the CPU's scalar `vec_dot` (the same
/// integer sums per 128 elements / unit, float sums in another order), the 64-register
/// `mvr4_*` and the prefetching `mvqp_*` bit-identical to `mvr_*` / `mvq_*_1`, and the
/// one-wave `mvr` launches (several row pairs per warp, L2 prefetch ahead) bit-identical to
/// the one-pair-per-warp launches, plain, accumulating and SwiGLU, and (session 17) blocks of
/// 1 to 4 warps ([`Gpu::mvr_warps`], SwiGLU blocks of 8 to 5: [`Gpu::mvr_warps_glu`])
/// bit-identical to blocks of 8. Grids capped at 2 and 5
/// blocks make every warp take several steps (and leave partial last steps), and row counts
/// leave partial row groups; every output checked written (poisoned buffers).
#[test]
fn q6_half_and_wave_products_match_cpu_scalar_vec_dot() {
    let Some(g) = gpu_or_skip("q6_half_wave") else {
        return;
    };
    let mut r = rng("q6_half_wave");
    for &(rows, cols) in &[
        (37usize, 768usize),
        (130, 3072),
        (9, 4096),
        (301, 256),
        (37, 8192),
    ] {
        let (qb, db, buf) = q8k_token(&g, &randn(&mut r, cols, 1.0));
        for ty in [GgmlType::Q6K, GgmlType::Q4K] {
            let (q, _) = quantized(ty, &randn(&mut r, rows * cols, 0.5));
            let (qu, _) = quantized(ty, &randn(&mut r, rows * cols, 0.5));
            let (w, wu) = (g.upload(&q).unwrap(), g.upload(&qu).unwrap());
            let want = cpu_rows(ty, &q, rows, cols, &buf);
            let y0 = randn(&mut r, rows, 1.0);
            // (wave, cap, q6_half, mvr4 + mvqp, warps per block): the first is the reference
            // of the mvr and mvq bits.
            let mut plain: Option<(Vec<u32>, Vec<u32>, Vec<u32>)> = None;
            for (wave, cap, q6h, lb4, nw) in [
                (false, 0usize, false, false, 8usize),
                (true, 0, false, false, 8),
                (true, 2, false, false, 8),
                (true, 5, false, false, 8),
                (false, 0, false, true, 8),
                (true, 3, false, true, 8),
                (false, 0, false, false, 4),
                (false, 0, false, true, 1),
                (true, 0, false, false, 3),
                (true, 2, false, true, 2),
                (false, 0, true, false, 8),
                (true, 2, true, false, 8),
                (true, 5, true, false, 8),
            ] {
                if q6h && ty != GgmlType::Q6K {
                    continue;
                }
                g.wave.set(wave);
                g.wave_cap.set(cap);
                g.q6_half.set(q6h);
                g.mvr_lb4.set(lb4);
                g.mvq_pf.set(lb4);
                g.mvr_warps.set(nw);
                g.mvr_warps_glu.set(9 - nw);
                let y = poisoned(&g, rows);
                g.matvec_q(
                    ty,
                    w.ptr(),
                    rows,
                    cols,
                    qb.ptr(),
                    db.ptr(),
                    1,
                    y.ptr(),
                    false,
                )
                .unwrap();
                let got: Vec<f32> = g.download(&y, rows).unwrap();
                let e = rel_err(&got, &want);
                let case = format!(
                    "{ty} {rows}x{cols} wave={wave} cap={cap} q6_half={q6h} lb4={lb4} warps={nw} \
                     (SwiGLU {})",
                    9 - nw
                );
                assert!(e < 5e-6, "{case}: relative error {e:e}");
                let ya = g.upload(&y0).unwrap();
                g.matvec_q(
                    ty,
                    w.ptr(),
                    rows,
                    cols,
                    qb.ptr(),
                    db.ptr(),
                    1,
                    ya.ptr(),
                    true,
                )
                .unwrap();
                let acc: Vec<f32> = g.download(&ya, rows).unwrap();
                let want2: Vec<f64> = want.iter().zip(&y0).map(|(a, &b)| a + b as f64).collect();
                let e = rel_err(&acc, &want2);
                assert!(e < 5e-6, "{case} accumulate: relative error {e:e}");
                if q6h {
                    continue;
                }
                let ys = poisoned(&g, rows);
                g.matvec_q_swiglu(
                    ty,
                    w.ptr(),
                    wu.ptr(),
                    rows,
                    cols,
                    qb.ptr(),
                    db.ptr(),
                    1,
                    ys.ptr(),
                )
                .unwrap();
                let glu: Vec<f32> = g.download(&ys, rows).unwrap();
                assert!(
                    glu.iter().all(|v| v.is_finite()),
                    "{case} swiglu: unwritten rows"
                );
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
                let now = (bits(&got), bits(&acc), bits(&glu));
                match &plain {
                    None => plain = Some(now),
                    Some(p) => assert!(*p == now, "{case}: not the one-pair-per-warp bits"),
                }
            }
            // Session 17: the block-per-row product (rows wider than mvr takes) with fewer
            // threads per block: another reduction order, within the CPU tolerance.
            if !g.mvr_fits(cols) {
                g.mvq_pf.set(true);
                for th in [64usize, 32] {
                    g.mvqp_threads.set(th);
                    let y = poisoned(&g, rows);
                    g.matvec_q(
                        ty,
                        w.ptr(),
                        rows,
                        cols,
                        qb.ptr(),
                        db.ptr(),
                        1,
                        y.ptr(),
                        false,
                    )
                    .unwrap();
                    let got: Vec<f32> = g.download(&y, rows).unwrap();
                    let e = rel_err(&got, &want);
                    assert!(
                        e < 5e-6,
                        "{ty} {rows}x{cols} mvqp with {th} threads: relative error {e:e}"
                    );
                }
                g.mvqp_threads.set(0);
                g.mvq_pf.set(false);
            }
        }
    }
    g.wave.set(false);
    g.wave_cap.set(0);
    g.q6_half.set(false);
    g.mvr_lb4.set(false);
    g.mvq_pf.set(false);
    g.mvr_warps.set(8);
    g.mvr_warps_glu.set(8);
}

/// Session 19: the one-token products that stage their rows in shared memory before the PDL
/// wait (`mvsm_*`: Q4_K, Q5_K and the Q6_KA copies) give the `mvr` kernels' bits where those
/// take the rows (at most 4096 columns), and the CPU's scalar `vec_dot` within 5e-6 everywhere
/// (the down projection's 8192 columns too, where the form without staging is `mvqp`), plain,
/// accumulating and with the sums of squares; partial row pairs and blocks of 1 to 16 pairs,
/// every output checked written (poisoned buffers).
#[test]
fn staged_products_equal_mvr_products_and_cpu_scalar_vec_dot() {
    let Some(g) = gpu_or_skip("mvsm") else {
        return;
    };
    if !g.pdl.get() {
        eprintln!("SKIPPED mvsm: the staged products need programmatic dependent launch");
        return;
    }
    let mut r = rng("mvsm");
    let slots = cuda::kernels::RMS_SLOTS;
    // Every width, the down projection's too.
    g.mvsm_cols.set(usize::MAX);
    let prep0 = g.mvsm_prep.get();
    g.q6_half.set(false);
    g.warp_rows.set(false);
    g.mvr_lb4.set(true);
    for &(rows, cols) in &[
        (3072usize, 3072usize),
        (301, 3072),
        (37, 256),
        (9, 4096),
        (3072, 8192),
        (5, 8192),
        (4001, 1024),
    ] {
        let x = randn(&mut r, cols, 1.0);
        let (qb, db, buf) = q8k_token(&g, &x);
        let xb = g.upload(&x).unwrap();
        for ty in [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
            let what = format!("{ty} {rows}x{cols}");
            let (q, _) = quantized(ty, &randn(&mut r, rows * cols, 0.5));
            let w = g.upload(&q).unwrap();
            let pad = (ty == GgmlType::Q6K).then(|| g.pad_q6k(w.ptr(), rows, cols).unwrap());
            let want = cpu_rows(ty, &q, rows, cols, &buf);
            let y0 = randn(&mut r, rows, 1.0);
            let want_acc: Vec<f64> = want.iter().zip(&y0).map(|(a, &b)| a + b as f64).collect();
            for acc in [false, true] {
                let run = |staged: bool, ss: u64| -> (Vec<f32>, bool) {
                    g.mvsm.set(staged);
                    let y = if acc {
                        g.upload(&y0).unwrap()
                    } else {
                        poisoned(&g, rows)
                    };
                    let took = match &pad {
                        Some(p) => g.matvec_q6ka_ss(
                            ty,
                            p.ptr(),
                            rows,
                            cols,
                            qb.ptr(),
                            db.ptr(),
                            1,
                            y.ptr(),
                            acc,
                            ss,
                        ),
                        None => g.matvec_q_ss(
                            ty,
                            w.ptr(),
                            rows,
                            cols,
                            qb.ptr(),
                            db.ptr(),
                            1,
                            y.ptr(),
                            acc,
                            ss,
                        ),
                    }
                    .unwrap();
                    (g.download(&y, rows).unwrap(), took)
                };
                let (plain, _) = run(false, 0);
                let (staged, _) = run(true, 0);
                let e = rel_err(&staged, if acc { &want_acc } else { &want });
                assert!(e < 5e-6, "{what} accumulate={acc}: relative error {e:e}");
                if g.mvr_fits(cols) {
                    if let Some(i) = plain
                        .iter()
                        .zip(&staged)
                        .position(|(a, b)| a.to_bits() != b.to_bits())
                    {
                        panic!(
                            "{what} accumulate={acc}: row {i}: staged {} mvr {}",
                            staged[i], plain[i]
                        );
                    }
                }
                let ss = g.upload(&vec![0f64; slots]).unwrap();
                let (y1, took) = run(true, ss.ptr());
                assert!(took, "{what}: sums of squares not taken");
                assert_eq!(
                    y1.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    staged.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{what} accumulate={acc}: rows with and without the sums of squares"
                );
                assert_slots_hold_squares(&g, &ss, &y1, &what);
                // Session 20: the staged form quantizing its f32 activation itself gives the
                // bits of the staged form on quantize_act's bytes, squares included.
                g.mvsm_prep.set(true);
                if pad.is_none() && cols <= 4096 {
                    assert!(
                        g.mvsm_prep_fits(ty, rows, cols),
                        "{what}: the prep form fits"
                    );
                    let y = if acc {
                        g.upload(&y0).unwrap()
                    } else {
                        poisoned(&g, rows)
                    };
                    let ss2 = g.upload(&vec![0f64; slots]).unwrap();
                    let took = g
                        .matvec_q_staged_prep(
                            ty,
                            w.ptr(),
                            rows,
                            cols,
                            xb.ptr(),
                            y.ptr(),
                            acc,
                            ss2.ptr(),
                        )
                        .unwrap();
                    assert!(took, "{what}: prep form, sums of squares not taken");
                    let y2: Vec<f32> = g.download(&y, rows).unwrap();
                    if let Some(i) = y1
                        .iter()
                        .zip(&y2)
                        .position(|(a, b)| a.to_bits() != b.to_bits())
                    {
                        panic!(
                            "{what} accumulate={acc}: row {i}: prep {} staged {}",
                            y2[i], y1[i]
                        );
                    }
                    assert_slots_hold_squares(&g, &ss2, &y2, &what);
                } else {
                    let y = poisoned(&g, rows);
                    assert!(
                        g.matvec_q_staged_prep(ty, w.ptr(), rows, cols, xb.ptr(), y.ptr(), acc, 0)
                            .is_err(),
                        "{what}: the prep form takes Q4_K and Q5_K up to 4096 columns"
                    );
                }
                g.mvsm_prep.set(false);
                let switched_off = !matches!(ty, GgmlType::Q6K) && cols <= 4096;
                if switched_off {
                    let y = poisoned(&g, rows);
                    assert!(
                        g.matvec_q_staged_prep(ty, w.ptr(), rows, cols, xb.ptr(), y.ptr(), acc, 0)
                            .is_err(),
                        "{what}: the prep form switched off"
                    );
                }
                g.mvsm_prep.set(prep0);
            }
        }
    }
    g.mvsm.set(true);
    g.mvsm_cols.set(4096);
}

/// v11: the one-token RMSNorm a warp per group (`rms_norm1`) gives `rms_norm`'s bits (f32 row,
/// int8 values and scales in both formats, f16 operand), and the many-block argmax
/// (`argmax_mb`) the single-block kernel's index (planted maxima, ties: the lowest index, NaN
/// never wins), launch after launch (its counters reset themselves).
#[test]
fn rms_norm1_and_argmax_mb_equal_the_block_kernels() {
    let Some(g) = gpu_or_skip("rms1") else {
        return;
    };
    let mut r = rng("rms1");
    for n in [256usize, 768, 3072, 4096] {
        assert!(Gpu::rms1_fits(n));
        let mut x = randn(&mut r, n, 2.0);
        // A few outliers, as real residual rows have.
        for _ in 0..3 {
            let i = r.gen_range(0..n);
            x[i] *= 40.0;
        }
        let w = randn(&mut r, n, 1.0);
        let (xb, wb) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
        for fmt in [None, Some(ActFormat::Q8x32), Some(ActFormat::Q8K)] {
            let mut outs = Vec::new();
            for one in [false, true] {
                let out = poisoned(&g, n);
                let oh = g.upload(&vec![0xffffu16; n]).unwrap();
                let (qb, db) = act_bufs(&g, 1, n);
                let quant = fmt.map(|f| (f, qb.ptr(), db.ptr()));
                if one {
                    g.rms_norm1(xb.ptr(), wb.ptr(), n, 1e-5, out.ptr(), oh.ptr(), quant)
                        .unwrap();
                } else {
                    g.rms_norm(
                        xb.ptr(),
                        0,
                        wb.ptr(),
                        n,
                        1e-5,
                        1,
                        out.ptr(),
                        oh.ptr(),
                        quant,
                    )
                    .unwrap();
                }
                let o: Vec<u32> = g.download(&out, n).unwrap();
                let h: Vec<u16> = g.download(&oh, n).unwrap();
                let (q, d): (Vec<i8>, Vec<u32>) = if fmt.is_some() {
                    (
                        g.download(&qb, n).unwrap(),
                        g.download(&db, n / 16).unwrap(),
                    )
                } else {
                    (Vec::new(), Vec::new())
                };
                outs.push((o, h, q, d));
            }
            let (a, b) = (&outs[0], &outs[1]);
            assert_eq!(a.0, b.0, "n={n} {fmt:?}: normalized row");
            assert_eq!(a.1, b.1, "n={n} {fmt:?}: f16 operand");
            assert_eq!(a.2, b.2, "n={n} {fmt:?}: int8 values");
            assert_eq!(a.3, b.3, "n={n} {fmt:?}: scales");
        }
    }
    assert!(!Gpu::rms1_fits(100) && !Gpu::rms1_fits(8192));
    let b = g.upload(&[0f32; 256]).unwrap();
    assert!(g
        .rms_norm1(b.ptr(), b.ptr(), 100, 1e-5, b.ptr(), 0, None)
        .is_err());

    let mb0 = g.argmax_mb.get();
    for (nr, nv) in [(3usize, 128_256usize), (2, 1000), (5, 5000), (1, 40_000)] {
        for rep in 0..2 {
            let mut l = randn(&mut r, nr * nv, 3.0);
            let mut want = Vec::new();
            for row in 0..nr {
                let at = r.gen_range(0..nv);
                let big = 100.0 + row as f32;
                l[row * nv + at] = big;
                // A tie after it (the lower index wins) and a NaN (never wins).
                let tie = r.gen_range(at..nv);
                l[row * nv + tie] = big;
                let nan = r.gen_range(0..nv);
                if nan != at && nan != tie {
                    l[row * nv + nan] = f32::NAN;
                }
                want.push(at as i32);
            }
            let lb = g.upload(&l).unwrap();
            for mb in [false, true] {
                g.argmax_mb.set(mb);
                let ob = g.upload(&vec![-1i32; nr]).unwrap();
                g.argmax_rows(lb.ptr(), nv, nr, ob.ptr()).unwrap();
                let got: Vec<i32> = g.download(&ob, nr).unwrap();
                assert_eq!(
                    got, want,
                    "{nr} rows of {nv}, many blocks {mb}, launch {rep}"
                );
            }
        }
    }
    g.argmax_mb.set(mb0);
}

fn run_mmk(
    g: &Gpu,
    w: &DevBuf,
    (rows, cols): (usize, usize),
    (xq, ds): (&DevBuf, &DevBuf),
    n: usize,
    y: &DevBuf,
    acc: bool,
) -> cuda::kernels::MmfPlan {
    let p = cuda::kernels::mmk_plan(g.sms as usize, rows, cols, n);
    run_split_k(g, &p, rows, n, acc, |ws, cnt, a| {
        g.matmul_q4k_mmk(
            w.ptr(),
            rows,
            cols,
            xq.ptr(),
            ds.ptr(),
            n,
            y.ptr(),
            a,
            ws,
            cnt,
        )
        .map_err(|e| e.to_string())
    });
    p
}

/// Session 10: the Q4_K tensor-core products of batched decode in the CPU's integer order
/// (`mmk_q4_k_*`) against the CPU's scalar `vec_dot` on the CPU's own Q8_K activations, and
/// their raw operand (`act_raw_w`: the int8 values as f16, the scales and sums) against the
/// CPU's quantization bit for bit. Row counts that leave partial 16-row tiles, K split over
/// blocks (70 x 2048), several activation chunks in one slice (a head-like 20,000 x 2048),
/// 9..64 tokens, plain and accumulating, large activations (sums of products near 2^24).
#[test]
fn mmk_q4k_matches_cpu_scalar_vec_dot() {
    let Some(g) = gpu_or_skip("mmk_q4k") else {
        return;
    };
    let mut r = rng("mmk_q4k");
    let ty = GgmlType::Q4K;
    for (rows, cols) in [
        (301usize, 512usize),
        (70, 2048),
        (3072, 3072),
        (20_000, 2048),
    ] {
        let (q, _) = quantized(ty, &randn(&mut r, rows * cols, 0.5));
        let w = g.upload(&q).unwrap();
        let rb = q.len() / rows;
        let check: Vec<usize> = if rows > 4000 {
            (0..rows).step_by(37).collect()
        } else {
            (0..rows).collect()
        };
        for n in [9usize, 17, 33, 64] {
            let mut x = randn(&mut r, n * cols, 1.0);
            // One token with a few outliers: its other values quantize to small integers.
            for i in 0..4 {
                x[r.gen_range(0..cols)] = if i % 2 == 0 { 40.0 } else { -40.0 };
            }
            let mut buf = quant::dot::ActBuf::new();
            quant::dot::quantize_acts_with_isa(ty, &x, n, cols, &mut buf, Isa::Scalar).unwrap();
            let xb = g.upload(&x).unwrap();
            let xq = g.alloc(n * cols * 2).unwrap();
            let (_, dsb) = act_bufs(&g, n, cols);
            g.act_raw_w(xb.ptr(), 0, n, cols, ActFormat::Q8K, dsb.ptr(), xq.ptr())
                .unwrap();
            // The raw operand: each f16 is the CPU's int8 value; d and the sums of 16 as
            // quantize_act writes them.
            let hq: Vec<u16> = g.download(&xq, n * cols).unwrap();
            let hd: Vec<f32> = g.download(&dsb, n * cols / 32 * 2).unwrap();
            for t in 0..n {
                let row = buf.row(t).unwrap();
                for b in 0..cols / 256 {
                    let blk = &row[b * 292..(b + 1) * 292];
                    let d = f32::from_le_bytes(blk[0..4].try_into().unwrap());
                    for k in 0..256 {
                        let want = blk[4 + k] as i8 as f32;
                        let got = f16::from_bits(hq[t * cols + b * 256 + k]).to_f32();
                        assert!(
                            got == want,
                            "raw operand token {t} element {}: {got} against {want}",
                            b * 256 + k
                        );
                    }
                    for u in 0..8 {
                        let i = t * cols / 32 + b * 8 + u;
                        let lo =
                            i16::from_le_bytes(blk[260 + 4 * u..262 + 4 * u].try_into().unwrap());
                        let hi =
                            i16::from_le_bytes(blk[262 + 4 * u..264 + 4 * u].try_into().unwrap());
                        let bits = hd[2 * i + 1].to_bits();
                        assert!(
                            hd[2 * i] == d
                                && bits as u16 as i16 == lo
                                && (bits >> 16) as u16 as i16 == hi,
                            "raw operand scales, token {t} unit {}",
                            b * 8 + u
                        );
                    }
                }
            }
            let mut want = vec![0f64; n * rows];
            for t in 0..n {
                let a = buf.row(t).unwrap();
                for &rr in &check {
                    want[t * rows + rr] =
                        quant::dot::vec_dot(ty, &q[rr * rb..(rr + 1) * rb], a, cols, Isa::Scalar)
                            .unwrap() as f64;
                }
            }
            let y = poisoned(&g, n * rows);
            let p = run_mmk(&g, &w, (rows, cols), (&xq, &dsb), n, &y, false);
            let got: Vec<f32> = g.download(&y, n * rows).unwrap();
            let y0 = randn(&mut r, n * rows, 1.0);
            let ya = g.upload(&y0).unwrap();
            run_mmk(&g, &w, (rows, cols), (&xq, &dsb), n, &ya, true);
            let got_acc: Vec<f32> = g.download(&ya, n * rows).unwrap();
            let (mut g1, mut g2, mut w1, mut w2) = (vec![], vec![], vec![], vec![]);
            for t in 0..n {
                for &rr in &check {
                    let i = t * rows + rr;
                    g1.push(got[i]);
                    w1.push(want[i]);
                    g2.push(got_acc[i]);
                    w2.push(want[i] + y0[i] as f64);
                }
            }
            // The same integer sums as the CPU per super-block; only the float scaling and
            // the order of the super-blocks' additions differ (as matvec_q's bound).
            let (e1, e2) = (rel_err(&g1, &w1), rel_err(&g2, &w2));
            assert!(
                e1 < 5e-6 && e2 < 5e-6,
                "{rows}x{cols} n={n} {p:?}: relative error {e1:e} (accumulating {e2:e})"
            );
        }
    }
}

/// A second handle on the same device (another actor, or a model loaded beside a running one)
/// is made while the first handle's stream is capturing a graph, on another thread as actors
/// do: making it must succeed (session 10: cudarc's event tracking synchronized the shared
/// context on a handle's first stream, which failed with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED),
/// and the first handle must come out of its capture with a graph or an invalidated capture
/// (loading kernels may invalidate it; the backend then runs that step eagerly), and stay
/// usable.
#[test]
fn a_second_handle_is_made_while_the_first_captures() {
    let Some(a) = gpu_or_skip("second_handle") else {
        return;
    };
    let x = g_upload_rand(&a);
    let h = a.alloc(1024 * 2).unwrap();
    a.stream
        .begin_capture(
            cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        )
        .unwrap();
    a.to_f16(x.ptr(), 1024, h.ptr()).unwrap();
    let b = std::thread::spawn(|| {
        Gpu::new(0)
            .map(|g| g.name.clone())
            .map_err(|e| e.to_string())
    })
    .join()
    .unwrap();
    let graph = a
        .stream
        .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
    let name = b.unwrap_or_else(|e| panic!("second handle during a capture: {e}"));
    assert!(!name.is_empty());
    match graph {
        Ok(g) => g.expect("a graph").launch().unwrap(),
        Err(e) => assert_eq!(
            e.0,
            cudarc::driver::sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
            "capture ended with {e:?}"
        ),
    }
    // The first handle still works: an eager conversion, checked.
    a.to_f16(x.ptr(), 1024, h.ptr()).unwrap();
    a.sync().unwrap();
    let got: Vec<u16> = a.download(&h, 1024).unwrap();
    let xs: Vec<f32> = a.download(&x, 1024).unwrap();
    for (i, (&g, &v)) in got.iter().zip(&xs).enumerate() {
        assert_eq!(
            g,
            f16::from_f32(v).to_bits(),
            "element {i} after the capture"
        );
    }
}

fn g_upload_rand(g: &Gpu) -> DevBuf {
    let mut r = rng("second_handle");
    g.upload(&randn(&mut r, 1024, 1.0)).unwrap()
}

/// Session 15's streaming-read probes (probe.cu) read every byte of their range exactly once:
/// the XOR of the blocks' results equals the XOR of the random words on the CPU, for sizes that
/// leave partial chunks and blocks, with and without the L2 prefetch, launch after launch.
#[test]
fn read_probes_read_every_word_once() {
    let Some(g) = gpu_or_skip("read_probes") else {
        return;
    };
    let mut r = rng("read_probes");
    for words in [4usize, 4 * 33, 4 * 1000 + 4 * 17, 4 * 300_001] {
        let data: Vec<u32> = (0..words).map(|_| r.gen()).collect();
        let want = data.iter().fold(0u32, |a, &w| a ^ w);
        let buf = g.upload(&data).unwrap();
        let out = g.alloc_zeroed(4 * 65536).unwrap();
        for probe in cuda::kernels::PROBES {
            for pf in [false, true] {
                let blocks = g
                    .probe_read(probe, buf.ptr(), 4 * words, out.ptr(), pf)
                    .unwrap();
                let got: Vec<u32> = g.download(&out, blocks).unwrap();
                let x = got.iter().fold(0u32, |a, &w| a ^ w);
                assert_eq!(
                    x, want,
                    "{probe} prefetch={pf} {words} words ({blocks} blocks)"
                );
            }
        }
    }
    // A size that is not a multiple of 16 bytes is refused, not read past.
    let buf = g.alloc_zeroed(64).unwrap();
    assert!(g
        .probe_read("probe_ld4", buf.ptr(), 40, buf.ptr(), false)
        .is_err());
}

/// Session 16: a one-token product that writes the residual row (accumulating, as the output
/// and down projections do) adds the row's new squares into the RMSNorm slots, and the norm
/// taken from those slots (`rms_norm_ss`) equals the norm that sums the row itself, bit for bit:
/// the normalized row, its f16 operand and its quantization. The launch also zeroes the next
/// slot set. Both one-token product families (`mvr` up to 4096 columns, `mvqp` past it), the
/// 3B file's types and widths and the SmolLM2 file's.
#[test]
fn rms_norm_from_product_partial_sums_equals_the_row_sum() {
    let Some(g) = gpu_or_skip("rms_ss") else {
        return;
    };
    let mut r = rng("rms_ss");
    let slots = cuda::kernels::RMS_SLOTS;
    let cases = [
        (GgmlType::Q4K, 3072usize, 3072usize),
        (GgmlType::Q4K, 3072, 8192),
        (GgmlType::Q6K, 3072, 8192),
        (GgmlType::Q4_1, 576, 576),
        (GgmlType::Q4_1, 576, 1536),
    ];
    for &(ty, e, cols) in &cases {
        let what = format!("{ty} {e}x{cols}");
        let fmt = act_format(ty).unwrap();
        let (q, _) = quantized(ty, &randn(&mut r, e * cols, 0.5));
        let w = g.upload(&q).unwrap();
        let a = randn(&mut r, cols, 1.0);
        let ab = g.upload(&a).unwrap();
        let (qb, db) = act_bufs(&g, 1, cols);
        g.quantize_act(ab.ptr(), 1, cols, fmt, qb.ptr(), db.ptr())
            .unwrap();
        let mut x0 = randn(&mut r, e, 2.0);
        for _ in 0..3 {
            let i = r.gen_range(0..e);
            x0[i] *= 40.0;
        }
        let xb = g.upload(&x0).unwrap();
        let mut init = vec![0f64; slots];
        init.extend(std::iter::repeat_n(123.5f64, slots));
        let ss = g.upload(&init).unwrap();
        let wrote = g
            .matvec_q_ss(
                ty,
                w.ptr(),
                e,
                cols,
                qb.ptr(),
                db.ptr(),
                1,
                xb.ptr(),
                true,
                ss.ptr(),
            )
            .unwrap();
        let expect = g.mvr_fits(cols) || g.pdl.get();
        assert_eq!(wrote, expect, "{what}: which kernels take the slots");
        if !wrote {
            eprintln!("SKIPPED rms_ss {what}: no kernel here adds up squares");
            continue;
        }
        let x1: Vec<f32> = g.download(&xb, e).unwrap();
        assert!(x1.iter().all(|v| v.is_finite()), "{what}: product output");
        let sums: Vec<f64> = g.download(&ss, slots).unwrap();
        let want: f64 = x1.iter().map(|&v| v as f64 * v as f64).sum();
        let got: f64 = sums.iter().sum();
        assert!(
            (got - want).abs() <= 1e-12 * want,
            "{what}: slots sum to {got}, the row's squares to {want}"
        );
        // A product's output that moved from x0 (the product really ran).
        assert!(
            x1.iter().zip(&x0).any(|(a, b)| a != b),
            "{what}: row unchanged"
        );
        let nw = g.upload(&randn(&mut r, e, 1.0)).unwrap();
        for quant in [None, Some(fmt)] {
            let mut outs = Vec::new();
            for from_slots in [false, true] {
                let out = poisoned(&g, e);
                let oh = g.upload(&vec![0xffffu16; e]).unwrap();
                let (oq, od) = act_bufs(&g, 1, e);
                let qa = quant.map(|f| (f, oq.ptr(), od.ptr()));
                if from_slots {
                    g.rms_norm_ss(
                        xb.ptr(),
                        0,
                        nw.ptr(),
                        e,
                        1e-5,
                        1,
                        out.ptr(),
                        oh.ptr(),
                        qa,
                        ss.ptr(),
                        ss.at(slots * 8),
                        false,
                    )
                    .unwrap();
                } else {
                    g.rms_norm(xb.ptr(), 0, nw.ptr(), e, 1e-5, 1, out.ptr(), oh.ptr(), qa)
                        .unwrap();
                }
                let o: Vec<u32> = g.download(&out, e).unwrap();
                let h: Vec<u16> = g.download(&oh, e).unwrap();
                let (qd, dd): (Vec<i8>, Vec<u32>) = if quant.is_some() {
                    let (qn, dn) = act_bytes(1, e);
                    (
                        g.download(&oq, qn).unwrap(),
                        g.download(&od, dn / 4).unwrap(),
                    )
                } else {
                    (Vec::new(), Vec::new())
                };
                outs.push((o, h, qd, dd));
            }
            let (p, s) = (&outs[0], &outs[1]);
            assert_eq!(p.0, s.0, "{what} {quant:?}: normalized row");
            assert_eq!(p.1, s.1, "{what} {quant:?}: f16 operand");
            assert_eq!(p.2, s.2, "{what} {quant:?}: int8 values");
            assert_eq!(p.3, s.3, "{what} {quant:?}: scales");
            // Session 34: the warp-per-group form (`rms_norm1s`, no f16 operand) gives the
            // block form's normalized row and quantization, also in the permuted layout.
            let Some(f) = quant.filter(|_| Gpu::rms1_fits(e)) else {
                continue;
            };
            let perms: &[bool] = if f == ActFormat::Q8K {
                &[false, true]
            } else {
                &[false]
            };
            for &perm in perms {
                let mut got = Vec::new();
                for warp in [false, true] {
                    let out = poisoned(&g, e);
                    let (oq, od) = act_bufs(&g, 1, e);
                    let z = g.upload(&vec![7.5f64; slots]).unwrap();
                    let qa = (f, oq.ptr(), od.ptr());
                    if warp {
                        g.rms_norm1s(
                            xb.ptr(),
                            nw.ptr(),
                            e,
                            1e-5,
                            out.ptr(),
                            qa,
                            ss.ptr(),
                            z.ptr(),
                            perm,
                        )
                        .unwrap();
                    } else {
                        g.rms_norm_ss(
                            xb.ptr(),
                            0,
                            nw.ptr(),
                            e,
                            1e-5,
                            1,
                            out.ptr(),
                            0,
                            Some(qa),
                            ss.ptr(),
                            z.ptr(),
                            perm,
                        )
                        .unwrap();
                    }
                    let zs: Vec<f64> = g.download(&z, slots).unwrap();
                    assert!(
                        zs.iter().all(|&v| v == 0.0),
                        "{what} {f:?} perm={perm} warp={warp}: slot set not zeroed"
                    );
                    let (qn, dn) = act_bytes(1, e);
                    let o: Vec<u32> = g.download(&out, e).unwrap();
                    let qd: Vec<i8> = g.download(&oq, qn).unwrap();
                    let dd: Vec<u32> = g.download(&od, dn / 4).unwrap();
                    got.push((o, qd, dd));
                }
                let (b, w) = (&got[0], &got[1]);
                assert_eq!(b.0, p.0, "{what} {f:?} perm={perm}: block form's row");
                assert_eq!(
                    w.0, b.0,
                    "{what} {f:?} perm={perm}: warp form's normalized row"
                );
                assert_eq!(
                    w.1, b.1,
                    "{what} {f:?} perm={perm}: warp form's int8 values"
                );
                assert_eq!(w.2, b.2, "{what} {f:?} perm={perm}: warp form's scales");
            }
        }
        let after: Vec<f64> = g.download(&ss, 2 * slots).unwrap();
        assert!(
            after[slots..].iter().all(|&v| v == 0.0),
            "{what}: the next slot set was not zeroed"
        );
        assert_eq!(&after[..slots], &sums[..], "{what}: the read set changed");
    }
    // One row only: several rows have no single slot set.
    let b = g.upload(&[1f32; 512]).unwrap();
    let wn = g.upload(&[1f32; 256]).unwrap();
    let o = poisoned(&g, 512);
    let ss = g.upload(&vec![0f64; slots]).unwrap();
    assert!(g
        .rms_norm_ss(
            b.ptr(),
            0,
            wn.ptr(),
            256,
            1e-5,
            2,
            o.ptr(),
            0,
            None,
            ss.ptr(),
            0,
            false,
        )
        .is_err());
}

/// Session 16: the half-unit Q4_K SwiGLU product (`mvh_swiglu_q4_k`) on the permuted activation
/// that `rms_norm_ss` writes with `perm`: the permuted int8 values are the plain ones moved by
/// whole sub-blocks (scales unchanged); the product's outputs equal the unit-per-lane kernel's within
/// float-order rounding and the CPU's scalar `vec_dot`s within its tolerance; its fused
/// quantization of the down projection's activation is `quantize_act` of its own outputs, with
/// the group counters left zero. Widths of 1, 9 and 12 super-blocks (the last step partly
/// past the row for 9).
#[test]
fn half_unit_swiglu_matches_unit_kernel_and_cpu() {
    let Some(g) = gpu_or_skip("mvh") else {
        return;
    };
    let mut r = rng("mvh");
    let ty = GgmlType::Q4K;
    let cnt = g.alloc_zeroed(64 * 1024).unwrap();
    // 3072 and 2048 (then 1024 and 4096 below): session 33's cursor-free mvps<S> forms too.
    for &(rows, cols) in &[
        (768usize, 3072usize),
        (512, 2304),
        (256, 256),
        (512, 2048),
        (256, 1024),
        (256, 4096),
    ] {
        let what = format!("{rows}x{cols}");
        assert!(g.mvh_fits(ty, cols) || !g.mvh.get());
        let (q, _) = quantized(ty, &randn(&mut r, rows * cols, 0.5));
        let (qu, _) = quantized(ty, &randn(&mut r, rows * cols, 0.5));
        let (w, wu) = (g.upload(&q).unwrap(), g.upload(&qu).unwrap());
        let x = randn(&mut r, cols, 2.0);
        let nw = randn(&mut r, cols, 1.0);
        let (xb, nwb) = (g.upload(&x).unwrap(), g.upload(&nw).unwrap());
        let xn = poisoned(&g, cols);
        let (qa, da) = act_bufs(&g, 1, cols);
        let (qp, dp) = act_bufs(&g, 1, cols);
        let f = ActFormat::Q8K;
        g.rms_norm(
            xb.ptr(),
            0,
            nwb.ptr(),
            cols,
            1e-5,
            1,
            xn.ptr(),
            0,
            Some((f, qa.ptr(), da.ptr())),
        )
        .unwrap();
        g.rms_norm_ss(
            xb.ptr(),
            0,
            nwb.ptr(),
            cols,
            1e-5,
            1,
            xn.ptr(),
            0,
            Some((f, qp.ptr(), dp.ptr())),
            0,
            0,
            true,
        )
        .unwrap();
        let (qn, dn) = act_bytes(1, cols);
        let plain: Vec<i8> = g.download(&qa, qn).unwrap();
        let perm: Vec<i8> = g.download(&qp, qn).unwrap();
        for (c, &v) in plain.iter().enumerate().take(cols) {
            let j = (c / 32) % 8;
            let p = (c / 256) * 256 + (j % 2) * 128 + (j / 2) * 32 + c % 32;
            assert_eq!(perm[p], v, "{what}: permuted value of element {c}");
        }
        let (d1, d2): (Vec<u32>, Vec<u32>) = (
            g.download(&da, dn / 4).unwrap(),
            g.download(&dp, dn / 4).unwrap(),
        );
        assert_eq!(d1, d2, "{what}: scales and sums keep their order");
        // The CPU's products on the same quantized activation (its plain layout).
        let xv: Vec<f32> = g.download(&xn, cols).unwrap();
        let mut buf = quant::dot::ActBuf::new();
        quant::dot::quantize_acts_with_isa(ty, &xv, 1, cols, &mut buf, Isa::Scalar).unwrap();
        let rb = q.len() / rows;
        let dot = |wq: &[u8], rr: usize| {
            quant::dot::vec_dot(
                ty,
                &wq[rr * rb..(rr + 1) * rb],
                buf.row(0).unwrap(),
                cols,
                Isa::Scalar,
            )
            .unwrap() as f64
        };
        let want: Vec<f64> = (0..rows)
            .map(|rr| {
                let (a, b) = (dot(&q, rr), dot(&qu, rr));
                a / (1.0 + (-a).exp()) * b
            })
            .collect();
        let run = |half: bool| {
            let y = poisoned(&g, rows);
            let (qb, db) = act_bufs(&g, 1, rows);
            let dq = Some(OutQuant {
                fmt: f,
                cnt: cnt.ptr(),
                qs: qb.ptr(),
                ds: db.ptr(),
            });
            if half {
                g.matvec_q_swiglu_half(
                    w.ptr(),
                    wu.ptr(),
                    rows,
                    cols,
                    qp.ptr(),
                    dp.ptr(),
                    y.ptr(),
                    dq,
                )
                .unwrap();
            } else {
                g.matvec_q_swiglu_quant(
                    ty,
                    w.ptr(),
                    wu.ptr(),
                    rows,
                    cols,
                    qa.ptr(),
                    da.ptr(),
                    1,
                    y.ptr(),
                    dq,
                )
                .unwrap();
            }
            let c: Vec<u32> = g.download(&cnt, 16 * 1024).unwrap();
            assert!(
                c.iter().all(|&v| v == 0),
                "{what}: group counters left non-zero"
            );
            (y, qb, db)
        };
        let (yh, qh, dh) = run(true);
        let (yu, _, _) = run(false);
        // Session 29: the pipelined form gives the half-unit kernel's bits, at every row count
        // per warp (rows not a multiple of a block's rows included).
        let mvh_y: Vec<f32> = g.download(&yh, rows).unwrap();
        let saved = (g.mvp.get(), g.mvps.get());
        for (rpw, mvps) in [
            (1usize, false),
            (2, false),
            (3, false),
            (5, false),
            (1, true),
        ] {
            g.mvp.set(rpw);
            g.mvps.set(mvps);
            let yp = poisoned(&g, rows);
            g.matvec_q_swiglu_pipe(w.ptr(), wu.ptr(), rows, cols, qp.ptr(), dp.ptr(), yp.ptr())
                .unwrap();
            let got: Vec<f32> = g.download(&yp, rows).unwrap();
            let same = got
                .iter()
                .zip(&mvh_y)
                .filter(|(a, b)| a.to_bits() == b.to_bits())
                .count();
            assert_eq!(
                same, rows,
                "{what}: pipelined ({rpw} rows per warp, mvps {mvps}) vs half-unit bits"
            );
        }
        // A row count that leaves part of the last block's warps without a row: the rows
        // there are the same bits and nothing past them is written.
        let short = rows - 3;
        let yp = poisoned(&g, rows);
        g.matvec_q_swiglu_pipe(w.ptr(), wu.ptr(), short, cols, qp.ptr(), dp.ptr(), yp.ptr())
            .unwrap();
        let got: Vec<f32> = g.download(&yp, rows).unwrap();
        for (i, (a, b)) in got.iter().zip(&mvh_y).enumerate() {
            if i < short {
                assert_eq!(a.to_bits(), b.to_bits(), "{what}: {short} rows, row {i}");
            } else {
                assert!(a.is_nan(), "{what}: {short} rows wrote row {i}");
            }
        }
        g.mvps.set(saved.1);
        let saved = saved.0;
        g.mvp.set(0);
        assert!(g
            .matvec_q_swiglu_pipe(w.ptr(), wu.ptr(), rows, cols, qp.ptr(), dp.ptr(), yh.ptr())
            .is_err());
        g.mvp.set(saved);
        let got: Vec<f32> = g.download(&yh, rows).unwrap();
        let unit: Vec<f32> = g.download(&yu, rows).unwrap();
        let e = rel_err(&got, &want);
        assert!(e < 2e-5, "{what}: half-unit vs CPU relative error {e:e}");
        let unit64: Vec<f64> = unit.iter().map(|&v| v as f64).collect();
        let eu = rel_err(&got, &unit64);
        assert!(
            eu < 2e-6,
            "{what}: half-unit vs unit kernel relative error {eu:e}"
        );
        // The fused quantization is quantize_act of the product's own outputs.
        let (q2, d2) = act_bufs(&g, 1, rows);
        g.quantize_act(yh.ptr(), 1, rows, f, q2.ptr(), d2.ptr())
            .unwrap();
        let a: Vec<i8> = g.download(&qh, rows).unwrap();
        let b: Vec<i8> = g.download(&q2, rows).unwrap();
        assert_eq!(a, b, "{what}: down activation values");
        let a: Vec<u32> = g.download(&dh, rows / 16).unwrap();
        let b: Vec<u32> = g.download(&d2, rows / 16).unwrap();
        assert_eq!(a, b, "{what}: down activation scales");
    }
    // Not a multiple of 256 columns.
    let b = g.upload(&[0u8; 1024]).unwrap();
    assert!(g
        .matvec_q_swiglu_half(b.ptr(), b.ptr(), 256, 100, b.ptr(), b.ptr(), b.ptr(), None)
        .is_err());
}

/// The 16-byte aligned Q6_K copy ("Q6_KA", `pad_q6k`): its bytes are the host-side padding
/// (`pad_q6k_host`), and the one-token products on it (`mvr4_q6_ka` for rows the mvr kernels
/// take, the head's; `mvqp_q6_ka` for wider ones, the down projection's) give the Q6_K
/// kernels' outputs on the unpadded matrix bit for bit (plain and accumulating, several block
/// shapes), so the CPU's scalar `vec_dot` within the Q6_K tolerance; their sums of squares
/// add up to the row's; wrong arguments are typed errors.
#[test]
fn q6ka_products_equal_q6k_kernels_and_cpu_scalar_vec_dot() {
    let Some(g) = gpu_or_skip("q6ka") else {
        return;
    };
    let mut r = rng("q6ka");
    let slots = cuda::kernels::RMS_SLOTS;
    // The Q6_K twins: mvr4_q6_k and mvqp_q6_k (mvq_q6_k_1 without PDL); the staged form has
    // its own test.
    g.mvsm.set(false);
    g.q6_half.set(false);
    g.warp_rows.set(false);
    g.mvr_lb4.set(true);
    g.mvq_pf.set(true);
    let (q6u0, q6w0) = (g.q6u.get(), g.q6u_wide.get());
    for &(rows, cols) in &[
        (301usize, 3072usize),
        (64, 8192),
        (20001, 3072),
        (37, 256),
        (9, 4096),
        (130, 768),
        (5, 12288),
    ] {
        let what = format!("{rows}x{cols}");
        let ty = GgmlType::Q6K;
        let (qb, db, buf) = q8k_token(&g, &randn(&mut r, cols, 1.0));
        let (q, _) = quantized(ty, &randn(&mut r, rows * cols, 0.5));
        let w = g.upload(&q).unwrap();

        // Session 32: copies of one and of four blocks a slot.
        let what0 = what.clone();
        for gq in [1usize, 4] {
            g.q6a_g.set(gq);
            let what = format!("{what0} group={gq}");
            // (a) the device copy is the host-side padding.
            let gs = g.q6a_group(cols);
            assert_eq!(
                gs,
                if gq == 4 && cols % 1024 == 0 { 4 } else { 1 },
                "{what}"
            );
            let host = cuda::kernels::pad_q6k_host(&q, gs).unwrap();
            assert_eq!(
                host.len(),
                cuda::kernels::q6ka_bytes(rows, cols, gs),
                "{what}"
            );
            let pad = g.pad_q6k(w.ptr(), rows, cols).unwrap();
            assert_eq!(pad.bytes(), host.len(), "{what}: copy size");
            let got: Vec<u8> = g.download(&pad, host.len()).unwrap();
            if let Some(i) = got.iter().zip(&host).position(|(a, b)| a != b) {
                let slot = cuda::kernels::q6ka_slot_bytes(gs);
                panic!(
                    "{what}: padded byte {i} (slot {}, offset {}): gpu {} host {}",
                    i / slot,
                    i % slot,
                    got[i],
                    host[i]
                );
            }

            let want = cpu_rows(ty, &q, rows, cols, &buf);
            let y0 = randn(&mut r, rows, 1.0);
            let want_acc: Vec<f64> = want.iter().zip(&y0).map(|(a, &b)| a + b as f64).collect();
            let mvr = g.mvr_fits(cols);
            // mvr: (warps per block, one-wave grid); mvqp: threads per block (0: the row's units).
            let cases: Vec<(usize, bool, usize)> = if mvr {
                vec![(4, false, 0), (8, false, 0), (1, false, 0), (4, true, 0)]
            } else {
                vec![(4, false, 0), (4, false, 64), (4, false, 32)]
            };
            for (nw, wave, th) in cases {
                g.mvr_warps.set(nw);
                g.wave.set(wave);
                g.mvqp_threads.set(th);
                // Without PDL the Q6_K product is mvq_q6_k_1, whose block is the row's units.
                let twin = th == 0 || mvr || g.pdl.get();
                let case = format!("{what} mvr={mvr} warps={nw} wave={wave} threads={th}");
                for acc in [false, true] {
                    let run = |aligned: bool| -> Vec<f32> {
                        let y = if acc {
                            g.upload(&y0).unwrap()
                        } else {
                            poisoned(&g, rows)
                        };
                        if aligned {
                            g.matvec_q6ka(
                                ty,
                                pad.ptr(),
                                rows,
                                cols,
                                qb.ptr(),
                                db.ptr(),
                                1,
                                y.ptr(),
                                acc,
                            )
                        } else {
                            g.matvec_q(ty, w.ptr(), rows, cols, qb.ptr(), db.ptr(), 1, y.ptr(), acc)
                        }
                        .unwrap();
                        g.download(&y, rows).unwrap()
                    };
                    let plain = run(false);
                    // Session 20: the copy read with Q6_KA's and with Q6_KU's decoding.
                    for q6u in [false, true] {
                        g.q6u.set(q6u);
                        g.q6u_wide.set(q6u);
                        let aligned = run(true);
                        let e = rel_err(&aligned, if acc { &want_acc } else { &want });
                        assert!(
                            e < 5e-6,
                            "{case} q6u={q6u} accumulate={acc}: relative error {e:e}"
                        );
                        if twin {
                            if let Some(i) = plain
                                .iter()
                                .zip(&aligned)
                                .position(|(a, b)| a.to_bits() != b.to_bits())
                            {
                                panic!(
                                    "{case} q6u={q6u} accumulate={acc}: row {i}: copy {} Q6_K {}",
                                    aligned[i], plain[i]
                                );
                            }
                        }
                    }
                    g.q6u.set(q6u0);
                    g.q6u_wide.set(q6w0);
                }
            }
            g.mvr_warps.set(4);
            g.wave.set(false);
            g.mvqp_threads.set(0);

            // The sums of squares of the rows the product writes.
            let ss = g.upload(&vec![0f64; slots]).unwrap();
            let yb = g.upload(&y0).unwrap();
            let wrote = g
                .matvec_q6ka_ss(
                    ty,
                    pad.ptr(),
                    rows,
                    cols,
                    qb.ptr(),
                    db.ptr(),
                    1,
                    yb.ptr(),
                    true,
                    ss.ptr(),
                )
                .unwrap();
            assert!(wrote, "{what}: sums of squares not taken");
            let y1: Vec<f32> = g.download(&yb, rows).unwrap();
            let e = rel_err(&y1, &want_acc);
            assert!(
                e < 5e-6,
                "{what} with sums of squares: relative error {e:e}"
            );
            assert_slots_hold_squares(&g, &ss, &y1, &what);
        }
        g.q6a_g.set(4);
    }

    // Typed errors, no launch.
    let b = g.upload(&[0u8; 4096]).unwrap();
    let (p, y) = (b.ptr(), b.at(2048));
    assert!(g.pad_q6k(p, 2, 300).is_err(), "columns not whole blocks");
    assert!(g.pad_q6k_into(p + 1, 1, 256, y).is_err(), "odd source");
    assert!(g.pad_q6k_into(p, 1, 256, y + 8).is_err(), "unaligned copy");
    assert!(cuda::kernels::pad_q6k_host(&[0u8; 211], 1).is_err());
    assert!(
        cuda::kernels::pad_q6k_host(&[0u8; 420], 4).is_err(),
        "half a group"
    );
    assert!(
        cuda::kernels::pad_q6k_host(&[0u8; 210], 2).is_err(),
        "two blocks a slot"
    );
    let fails = |ty: GgmlType, w: u64, cols: usize, nt: usize| {
        g.matvec_q6ka(ty, w, 1, cols, p, p, nt, y, false).is_err()
    };
    assert!(fails(GgmlType::Q6K, p, 300, 1), "columns not whole blocks");
    assert!(fails(GgmlType::Q6K, p, 256, 2), "two tokens");
    assert!(fails(GgmlType::Q4K, p, 256, 1), "not Q6_K");
    assert!(fails(GgmlType::Q6K, p + 2, 256, 1), "unaligned weights");
    g.sync().unwrap();
}

/// Session 21: the one-token wide product that quantizes its f32 activation on a thread block
/// cluster (`mvqc_*`, [`Gpu::matvec_q_cluster`]) gives the bits of `quantize_act` followed by
/// the block-per-row product on the quantized row (`mvqp_*`, on the Q6_KA copy for Q6_K as the
/// backend runs it): every quantized type, plain and accumulating, with and without the RMS
/// slots, row counts that leave the last cluster partly empty, and 32-element blocks whose rows
/// end inside a 256-element group; and it agrees with the CPU's scalar `vec_dot` on the CPU's
/// own quantized activation.
#[test]
fn cluster_product_equals_quantize_then_product() {
    let Some(g) = gpu_or_skip("cluster_product") else {
        return;
    };
    if g.cc.0 < 9 || !g.pdl.get() {
        eprintln!(
            "SKIPPED cluster_product: needs sm_90 and PDL (cc {:?})",
            g.cc
        );
        return;
    }
    let mut r = rng("cluster_product");
    let slots = cuda::kernels::RMS_SLOTS;
    g.warp_rows.set(false);
    g.q6_half.set(false);
    g.mvq_pf.set(true);
    g.down_cl.set(true);
    // The cluster product runs mvqp's row code: the reference is mvqp, not the early-decoded
    // form the block-per-row products take by default since session 30 (`Gpu::mvqe`).
    let e0 = g.mvqe.get();
    g.mvqe.set(false);
    for &(ty, name) in QTYPES {
        let fmt = act_format(ty).unwrap();
        let widths: &[usize] = if fmt == ActFormat::Q8K {
            &[8192, 11008]
        } else {
            &[8192, 8224]
        };
        for &cols in widths {
            // The 3B model's down projection (3072 x 8192, Q4_K and Q6_K) as well as odd sizes.
            let rows = if cols == 8192 && matches!(ty, GgmlType::Q4K | GgmlType::Q6K) {
                3072
            } else {
                r.gen_range(41..90usize)
            };
            let (q, _) = quantized(ty, &randn(&mut r, rows * cols, 0.5));
            let w = g.upload(&q).unwrap();
            let q6a = if ty == GgmlType::Q6K {
                Some(g.pad_q6k(w.ptr(), rows, cols).unwrap())
            } else {
                None
            };
            let wp = q6a.as_ref().map_or(w.ptr(), |b| b.ptr());
            assert!(
                g.mvqc_takes(ty, rows, cols, q6a.is_some()),
                "{name} {rows}x{cols}: the cluster product does not take it"
            );
            let mut x = randn(&mut r, cols, 1.0);
            for _ in 0..3 {
                let i = r.gen_range(0..cols);
                x[i] *= 30.0;
            }
            let mut buf = quant::dot::ActBuf::new();
            quant::dot::quantize_acts_with_isa(ty, &x, 1, cols, &mut buf, Isa::Scalar).unwrap();
            let want = cpu_rows(ty, &q, rows, cols, &buf);
            let xb = g.upload(&x).unwrap();
            let (qb, db) = act_bufs(&g, 1, cols);
            g.quantize_act(xb.ptr(), 1, cols, fmt, qb.ptr(), db.ptr())
                .unwrap();
            for acc in [false, true] {
                for with_ss in [false, true] {
                    let what = format!("{name} {rows}x{cols} accumulate={acc} slots={with_ss}");
                    let y0 = randn(&mut r, rows, 1.0);
                    let y1 = if acc {
                        g.upload(&y0).unwrap()
                    } else {
                        poisoned(&g, rows)
                    };
                    let s1 = g.upload(&vec![0f64; slots]).unwrap();
                    let sp = |s: &DevBuf| if with_ss { s.ptr() } else { 0 };
                    let took_ref = match &q6a {
                        Some(a) => g.matvec_q6ka_ss(
                            ty,
                            a.ptr(),
                            rows,
                            cols,
                            qb.ptr(),
                            db.ptr(),
                            1,
                            y1.ptr(),
                            acc,
                            sp(&s1),
                        ),
                        None => g.matvec_q_ss(
                            ty,
                            w.ptr(),
                            rows,
                            cols,
                            qb.ptr(),
                            db.ptr(),
                            1,
                            y1.ptr(),
                            acc,
                            sp(&s1),
                        ),
                    }
                    .unwrap();
                    assert_eq!(took_ref, with_ss, "{what}: block-per-row product's slots");
                    let a: Vec<u32> = g.download(&y1, rows).unwrap();
                    // Blocks per cluster, and blocks per multiprocessor looping over the rows
                    // (0: a block per row).
                    for (cl, per_sm) in [(8u32, 0usize), (4, 0), (1, 0), (8, 1), (2, 3)] {
                        g.mvqc_cluster.set(cl);
                        g.mvqc_per_sm.set(per_sm);
                        let what = format!("{what} cluster={cl} per_sm={per_sm}");
                        let (y2, s2) = if acc {
                            (
                                g.upload(&y0).unwrap(),
                                g.upload(&vec![0f64; slots]).unwrap(),
                            )
                        } else {
                            (poisoned(&g, rows), g.upload(&vec![0f64; slots]).unwrap())
                        };
                        let took = g
                            .matvec_q_cluster(
                                ty,
                                q6a.is_some(),
                                wp,
                                rows,
                                cols,
                                xb.ptr(),
                                y2.ptr(),
                                acc,
                                sp(&s2),
                            )
                            .unwrap();
                        assert_eq!(took, with_ss, "{what}: cluster product's slots");
                        let b: Vec<u32> = g.download(&y2, rows).unwrap();
                        if let Some(i) = a.iter().zip(&b).position(|(p, q)| p != q) {
                            panic!(
                                "{what}: row {i}: cluster {} quantize-then-product {}",
                                f32::from_bits(b[i]),
                                f32::from_bits(a[i])
                            );
                        }
                        if with_ss {
                            let got: Vec<f32> = g.download(&y2, rows).unwrap();
                            assert_slots_hold_squares(&g, &s2, &got, &what);
                        }
                    }
                    g.mvqc_cluster.set(cuda::kernels::MVQC_CLUSTER);
                    g.mvqc_per_sm.set(0);
                    let got: Vec<f32> = g.download(&y1, rows).unwrap();
                    let w2: Vec<f64> = want
                        .iter()
                        .zip(&y0)
                        .map(|(v, &b)| if acc { v + b as f64 } else { *v })
                        .collect();
                    let e = rel_err(&got, &w2);
                    assert!(e < 5e-6, "{what}: relative error {e:e} against the CPU");
                }
            }
        }
    }
    // Switched off, the product refuses (the backend then quantizes and runs mvqp).
    g.down_cl.set(false);
    assert!(!g.mvqc_takes(GgmlType::Q4K, 64, 8192, false));
    g.down_cl.set(true);
    g.mvqe.set(e0);
}

/// Session 21: the GPU's top-k of each logits row (`Gpu::top_k_rows`) is the sampler's own list
/// (`runtime::sampling::top_k`: ids and logit bits, NaN as -inf), on fresh rows full of ties,
/// with NaN, infinities and both zeros, for vocabularies of one slice and of many, k from 1 to
/// the most it takes; and it refuses a k it does not take.
#[test]
fn top_k_rows_equal_the_samplers_lists() {
    let Some(g) = gpu_or_skip("top_k_rows") else {
        return;
    };
    let mut r = rng("top_k_rows");
    for &(n, k) in &[
        (128_256usize, 40usize),
        (128_256, 256),
        (49_152, 1),
        (49_152, 64),
        (5000, 200),
        (300, 255),
        (4096, 40),
    ] {
        assert!(Gpu::top_k_fits(n, k), "n {n} k {k}");
        let rows = 3usize;
        let mut x = randn(&mut r, rows * n, 4.0);
        for v in x.iter_mut() {
            // A coarse grid: many equal logits, ordered by id.
            *v = (*v * 4.0).round() / 4.0;
        }
        for _ in 0..rows * 6 {
            let i = r.gen_range(0..rows * n);
            x[i] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0][r.gen_range(0..5)];
        }
        let xb = g.upload(&x).unwrap();
        let got = g.top_k_rows(xb.ptr(), n, rows, k).unwrap();
        assert_eq!(got.len(), rows);
        for (row, list) in got.iter().enumerate() {
            let want = runtime::sampling::top_k(&x[row * n..(row + 1) * n], k);
            let bits = |l: &[(u32, f32)]| -> Vec<(u32, u32)> {
                l.iter().map(|&(i, v)| (i, v.to_bits())).collect()
            };
            assert_eq!(bits(list), bits(&want), "n {n} k {k} row {row}");
        }
    }
    for &(n, k) in &[(100usize, 0usize), (100, 100), (200_000, 257)] {
        assert!(!Gpu::top_k_fits(n, k));
        let xb = g.upload(&vec![0f32; n]).unwrap();
        assert!(g.top_k_rows(xb.ptr(), n, 1, k).is_err(), "n {n} k {k}");
    }
}

/// decode.cu's topk_key, mirrored: the logit's bits made order-preserving (NaN as -inf) in the
/// high word, `u32::MAX - id` in the low word.
fn topk_key_host(v: f32, id: u32) -> u64 {
    let v = if v.is_nan() { f32::NEG_INFINITY } else { v };
    let b = v.to_bits();
    let o = if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    };
    ((o as u64) << 32) | (u32::MAX - id) as u64
}

/// Without a GPU: the top-k kernels' keys, sorted descending as their bitonic sort leaves them
/// and decoded by `kernels::topk_key_decode`, are the sampler's own list (order and bits) on
/// rows with ties, NaN, infinities and both zeros.
#[test]
fn top_k_keys_sort_and_decode_to_the_samplers_lists() {
    let mut r = rng("top_k_keys");
    for case in 0..50 {
        let n = [10usize, 300, 5000][case % 3];
        let mut x: Vec<f32> = randn(&mut r, n, 4.0)
            .into_iter()
            .map(|v| (v * 2.0).round() / 2.0)
            .collect();
        for _ in 0..case % 7 {
            let i = r.gen_range(0..n);
            x[i] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0][r.gen_range(0..5)];
        }
        let k = r.gen_range(1..n);
        let mut keys: Vec<u64> = x
            .iter()
            .enumerate()
            .map(|(i, &v)| topk_key_host(v, i as u32))
            .collect();
        keys.sort_unstable_by(|a, b| b.cmp(a));
        let got: Vec<(u32, u32)> = keys[..k]
            .iter()
            .map(|&key| {
                let (i, v) = cuda::kernels::topk_key_decode(key);
                (i, v.to_bits())
            })
            .collect();
        let want: Vec<(u32, u32)> = runtime::sampling::top_k(&x, k)
            .into_iter()
            .map(|(i, v)| (i, v.to_bits()))
            .collect();
        assert_eq!(got, want, "case {case}: n {n} k {k}");
    }
}

/// Exact mode's products (`ex_matmul` on the GPU's own quantized activations) equal the CPU
/// engine's scalar products bit for bit at the widths of real models (576 to 8192 columns),
/// every quantized type, both orders, 1 to 70 tokens (Q4_K's groups of 4 and its leftovers).
#[test]
fn exact_products_on_the_gpu_equal_the_cpu_products() {
    use cuda::exact::{ExactOps, GpuExact};
    use quant::dot::{self, Pool, SumOrder};
    let Some(g) = gpu_or_skip("exact_products_gpu") else {
        return;
    };
    let mut r = rng("exact_products_gpu");
    let pool = Pool::new(1).unwrap();
    let mut ops = GpuExact {
        gpu: &g,
        embd: (0, GgmlType::F32, 0),
        bufs: Vec::new(),
    };
    let rows = 24usize;
    let max_tok = 70usize;
    let max_cols = 8192usize;
    let bufs = ops
        .alloc(&[
            4 * max_tok * max_cols,
            max_tok * max_cols,
            max_tok * max_cols / 32 * 8,
            4 * max_tok * rows,
            4 * 8 * (max_cols / 32) * max_tok * 3,
        ])
        .unwrap();
    let mut bad = Vec::new();
    for &(ty, _) in QTYPES {
        for cols in [576usize, 2048, 3072, 8192] {
            if !cols.is_multiple_of(ty.block_size()) {
                continue;
            }
            let wf: Vec<f32> = (0..rows * cols)
                .map(|_| r.gen_range(-1.0f32..1.0))
                .collect();
            let w = quant::quantize_to_vec(ty, &wf).unwrap();
            let wd = g.upload(&w).unwrap();
            for n_tok in [1usize, 4, 6, 64, 70] {
                let x: Vec<f32> = (0..n_tok * cols)
                    .map(|_| r.gen_range(-2.0f32..2.0) * if r.gen_bool(0.05) { 8.0 } else { 1.0 })
                    .collect();
                for order in SumOrder::ALL {
                    let mut want = vec![0f32; n_tok * rows];
                    dot::matmul_f32_ordered(ty, &w, rows, cols, &x, n_tok, &mut want, &pool, order)
                        .unwrap();
                    let xb: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
                    ops.write(bufs[0], &xb).unwrap();
                    let fmt = act_format(ty).unwrap();
                    ops.quantize(bufs[0], n_tok, cols, fmt, bufs[1], bufs[2])
                        .unwrap();
                    let mm = cuda::exact::MatMul {
                        ty,
                        order,
                        w: wd.ptr(),
                        rows,
                        cols,
                    };
                    // A scratch of a few rows' integers, so the rows go in several chunks.
                    let part = (bufs[4], 4 * 8 * (cols / 32) * n_tok * 3);
                    cuda::exact::matmul(&ops, &mm, n_tok, bufs[1], bufs[2], part, bufs[3]).unwrap();
                    let mut got = vec![0u8; 4 * n_tok * rows];
                    ops.read(bufs[3], &mut got).unwrap();
                    let differ = got
                        .chunks_exact(4)
                        .zip(&want)
                        .filter(|(c, w)| {
                            u32::from_le_bytes([c[0], c[1], c[2], c[3]]) != w.to_bits()
                        })
                        .count();
                    if differ > 0 {
                        bad.push(format!(
                            "{ty} {cols} cols {n_tok} tokens {order:?}: {differ} differ"
                        ));
                    }
                }
            }
        }
    }
    assert!(
        bad.is_empty(),
        "exact products differ from the CPU's:\n{}",
        bad.join("\n")
    );
}

/// Session 30: the block-per-row one-token products with each thread's units decoded before the
/// PDL wait (`mvqe_*`, `Gpu::mvqe`) give `mvqp_*`'s bits on fresh random rows of every K-quant
/// type (Q6_K also on its aligned copies, with Q6_KA's and Q6_KU's decoding) and (session 32) of
/// every type with 32-element blocks, plain, accumulating
/// and adding the squares of the outputs, at widths from one super-block to the down
/// projection's 8192 columns; rows too wide for it still run `mvqp_*`.
#[test]
fn early_decoded_block_products_equal_mvqp() {
    let Some(g) = gpu_or_skip("mvqe") else {
        return;
    };
    if !g.pdl.get() {
        eprintln!("SKIPPED mvqe: the block-per-row kernels run without PDL here");
        return;
    }
    let mut r = rng("mvqe");
    let slots = cuda::kernels::RMS_SLOTS;
    g.mvsm.set(false);
    g.q6_half.set(false);
    g.warp_rows.set(false);
    g.mvr_lb4.set(true);
    g.mvq_pf.set(true);
    // The mvr kernels would take rows up to 4096 columns: off, so every width here runs the
    // block-per-row kernels.
    let (e0, mvr0, pd0) = (g.mvqe.get(), g.mvr.get(), g.mvpd.get());
    g.mvr.set(false);
    // Session 36's warp-per-row forms would take some of these rows: off, so mvqe runs.
    let qw0 = g.mvqw.get();
    g.mvpd.set(false);
    g.mvqw.set(false);
    let (q6u0, q6w0) = (g.q6u.get(), g.q6u_wide.get());
    // Session 32: the 32-element block types too (their activation in blocks of 32).
    let types = [
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::Q3K,
        GgmlType::Q2K,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
    ];
    for ty in types {
        for &(rows, cols) in &[(300usize, 8192usize), (77, 4096), (33, 256), (5, 12288)] {
            let what = format!("{ty:?} {rows}x{cols}");
            let xb = g.upload(&randn(&mut r, cols, 1.0)).unwrap();
            let (qb, db) = act_bufs(&g, 1, cols);
            g.quantize_act(
                xb.ptr(),
                1,
                cols,
                act_format(ty).unwrap(),
                qb.ptr(),
                db.ptr(),
            )
            .unwrap();
            let (q, _) = quantized(ty, &randn(&mut r, rows * cols, 0.5));
            let w = g.upload(&q).unwrap();
            let pad = (ty == GgmlType::Q6K).then(|| g.pad_q6k(w.ptr(), rows, cols).unwrap());
            let y0 = randn(&mut r, rows, 1.0);
            for acc in [false, true] {
                for q6u in [false, true] {
                    if q6u && pad.is_none() {
                        continue;
                    }
                    g.q6u.set(q6u);
                    g.q6u_wide.set(q6u);
                    let run = |early: bool, aligned: bool| -> (Vec<f32>, Vec<f64>) {
                        g.mvqe.set(early);
                        let y = if acc {
                            g.upload(&y0).unwrap()
                        } else {
                            poisoned(&g, rows)
                        };
                        let ss = g.upload(&vec![0f64; slots]).unwrap();
                        let (qs, ds) = (qb.ptr(), db.ptr());
                        match (&pad, aligned) {
                            (Some(p), true) => g.matvec_q6ka_ss(
                                ty,
                                p.ptr(),
                                rows,
                                cols,
                                qs,
                                ds,
                                1,
                                y.ptr(),
                                acc,
                                ss.ptr(),
                            ),
                            _ => g.matvec_q_ss(
                                ty,
                                w.ptr(),
                                rows,
                                cols,
                                qs,
                                ds,
                                1,
                                y.ptr(),
                                acc,
                                ss.ptr(),
                            ),
                        }
                        .unwrap();
                        (
                            g.download(&y, rows).unwrap(),
                            g.download(&ss, slots).unwrap(),
                        )
                    };
                    for aligned in [false, true] {
                        if aligned && pad.is_none() {
                            continue;
                        }
                        let case = format!("{what} q6u={q6u} aligned={aligned} accumulate={acc}");
                        let (yp, sp) = run(false, aligned);
                        let (ye, se) = run(true, aligned);
                        assert!(yp.iter().all(|v| v.is_finite()), "{case}: mvqp not finite");
                        if let Some(i) = yp
                            .iter()
                            .zip(&ye)
                            .position(|(a, b)| a.to_bits() != b.to_bits())
                        {
                            panic!("{case}: row {i}: mvqe {} mvqp {}", ye[i], yp[i]);
                        }
                        // The slots take f64 atomics in arrival order: equal up to that.
                        let sum = |s: &[f64]| s.iter().sum::<f64>();
                        let (a, b) = (sum(&sp), sum(&se));
                        let want: f64 = yp.iter().map(|&v| v as f64 * v as f64).sum();
                        assert!(
                            (a - b).abs() <= 1e-12 * a.abs() && (a - want).abs() <= 1e-9 * want,
                            "{case}: sums of squares {b} (mvqe) {a} (mvqp), rows {want}"
                        );
                    }
                }
            }
            g.q6u.set(q6u0);
            g.q6u_wide.set(q6w0);
        }
    }
    g.mvqe.set(e0);
    g.mvr.set(mvr0);
    g.mvpd.set(pd0);
    g.mvqw.set(qw0);
}

/// Session 36: the one-token down projection as a warp per row, Q4_K with each lane's weights
/// in registers before the PDL wait (`mvpd<S>_q4_k`, `Gpu::mvpd`) and every K-quant `mvqe`
/// runs, the aligned Q6_K copies with both decodings among them, with each lane's units decoded
/// before it (`mvqw_*`, `Gpu::mvqw`), give `mvqe`'s bits on fresh random rows of every width
/// they take (4 to 8 four-super-block steps; row counts that leave a block part full), plain,
/// accumulating and adding the squares of the outputs.
#[test]
fn warp_row_down_products_equal_mvqe() {
    let Some(g) = gpu_or_skip("mvpd") else {
        return;
    };
    if !g.pdl.get() {
        eprintln!("SKIPPED mvpd: the block-per-row kernels run without PDL here");
        return;
    }
    let mut r = rng("mvpd");
    let slots = cuda::kernels::RMS_SLOTS;
    let saved = (
        g.mvsm.get(),
        g.mvr.get(),
        g.mvqe.get(),
        g.mvpd.get(),
        g.mvqw.get(),
        g.warp_rows.get(),
        g.mvq_pf.get(),
        g.q6_half.get(),
        (g.q6u.get(), g.q6u_wide.get()),
    );
    g.mvsm.set(false);
    g.mvr.set(false);
    g.warp_rows.set(false);
    g.q6_half.set(false);
    g.mvq_pf.set(true);
    g.mvqe.set(true);
    for ty in [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
        for &(rows, cols) in &[
            (300usize, 8192usize),
            (77, 4096),
            (45, 5120),
            (9, 6144),
            (130, 7168),
        ] {
            let what = format!("{ty:?} {rows}x{cols}");
            let xb = g.upload(&randn(&mut r, cols, 1.0)).unwrap();
            let (qb, db) = act_bufs(&g, 1, cols);
            g.quantize_act(
                xb.ptr(),
                1,
                cols,
                act_format(ty).unwrap(),
                qb.ptr(),
                db.ptr(),
            )
            .unwrap();
            let (q, _) = quantized(ty, &randn(&mut r, rows * cols, 0.5));
            let w = g.upload(&q).unwrap();
            let pad = (ty == GgmlType::Q6K).then(|| g.pad_q6k(w.ptr(), rows, cols).unwrap());
            let y0 = randn(&mut r, rows, 1.0);
            for acc in [false, true] {
                for (aligned, q6u) in [(false, false), (true, false), (true, true)] {
                    if aligned && pad.is_none() {
                        continue;
                    }
                    g.q6u.set(q6u);
                    g.q6u_wide.set(q6u);
                    let name = if aligned {
                        g.q6a_name(cols, q6u).to_string()
                    } else {
                        let q = cuda::kernels::QTYPES.iter().find(|q| q.0 == ty);
                        q.expect("a quantized type").1.to_string()
                    };
                    let run = |pd: bool, qw: bool| -> (Vec<f32>, Vec<f64>) {
                        g.mvpd.set(pd);
                        g.mvqw.set(qw);
                        let y = if acc {
                            g.upload(&y0).unwrap()
                        } else {
                            poisoned(&g, rows)
                        };
                        let ss = g.upload(&vec![0f64; slots]).unwrap();
                        let (qs, ds) = (qb.ptr(), db.ptr());
                        let wrote = match (&pad, aligned) {
                            (Some(p), true) => g.matvec_q6ka_ss(
                                ty,
                                p.ptr(),
                                rows,
                                cols,
                                qs,
                                ds,
                                1,
                                y.ptr(),
                                acc,
                                ss.ptr(),
                            ),
                            _ => g.matvec_q_ss(
                                ty,
                                w.ptr(),
                                rows,
                                cols,
                                qs,
                                ds,
                                1,
                                y.ptr(),
                                acc,
                                ss.ptr(),
                            ),
                        }
                        .unwrap();
                        assert!(wrote, "{what}: the sums of squares were added");
                        (
                            g.download(&y, rows).unwrap(),
                            g.download(&ss, slots).unwrap(),
                        )
                    };
                    let (ye, se) = run(false, false);
                    assert!(ye.iter().all(|v| v.is_finite()), "{what}: mvqe not finite");
                    let mut modes = vec![("mvqw", false, true)];
                    if ty == GgmlType::Q4K {
                        modes.push(("mvpd", true, false));
                    }
                    for (form, pd, qw) in modes {
                        let case = format!("{what} {form} {name} accumulate={acc}");
                        g.mvpd.set(pd);
                        g.mvqw.set(qw);
                        let taken = if pd {
                            g.mvpd_steps(ty, cols).is_some()
                        } else {
                            g.mvqw_takes(&name, cols)
                        };
                        assert!(taken, "{case}: the warp-per-row kernel is taken");
                        let (yw, sw) = run(pd, qw);
                        if let Some(i) = ye
                            .iter()
                            .zip(&yw)
                            .position(|(a, b)| a.to_bits() != b.to_bits())
                        {
                            panic!("{case}: row {i}: {form} {} mvqe {}", yw[i], ye[i]);
                        }
                        // The slots take f64 atomics in arrival order: equal up to that.
                        let sum = |s: &[f64]| s.iter().sum::<f64>();
                        let (a, b) = (sum(&se), sum(&sw));
                        let want: f64 = ye.iter().map(|&v| v as f64 * v as f64).sum();
                        assert!(
                            (a - b).abs() <= 1e-12 * a.abs() && (a - want).abs() <= 1e-9 * want,
                            "{case}: sums of squares {b} ({form}) {a} (mvqe), rows {want}"
                        );
                    }
                }
            }
        }
    }
    g.mvsm.set(saved.0);
    g.mvr.set(saved.1);
    g.mvqe.set(saved.2);
    g.mvpd.set(saved.3);
    g.mvqw.set(saved.4);
    g.warp_rows.set(saved.5);
    g.mvq_pf.set(saved.6);
    g.q6_half.set(saved.7);
    g.q6u.set(saved.8 .0);
    g.q6u_wide.set(saved.8 .1);
}
