//! K-quant quantizers (Q2_K ... Q6_K, Q8_K), without an importance matrix.
//!
//! The algorithms are those of ggml's `quantize_row_q*_K_ref` (which `llama_model_quantize` runs
//! when no imatrix is given): per sub-block a scale (and min) is fitted by a weighted
//! least-squares search, the sub-block scales are themselves quantized against a super-block f16
//! scale, and finally every element is re-quantized with the scale actually stored. Every float
//! operation is kept in ggml's order (and unfused) so the bytes match llama.cpp's exactly.

// Index loops mirror the block layouts (element i of group j is x[16 * j + i]) more plainly than
// iterator chains would.
#![allow(clippy::needless_range_loop)]

use half::f16;

use crate::blocks::*;
use crate::dequant::get_scale_min_k4;
use crate::float16::round_f16;

/// Below this magnitude a group counts as all zero.
const GROUP_MAX_EPS: f32 = 1e-15;

/// Round to the nearest integer, ties to even, for |x| < 2^22.
///
/// Adding 1.5 * 2^23 leaves the rounded integer in the low mantissa bits (the FPU's own
/// round-to-nearest-even does the rounding); ggml rounds this way, so outside the range the
/// result is ggml's too.
#[inline(always)]
pub fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0;
    (v.to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

#[inline(always)]
fn f16_field(x: f32) -> f16 {
    f16::from_f32(x)
}

/// Fit `x ≈ scale * L + min` (L in 0..=nmax, min <= 0) minimizing the weighted error, trying
/// `nstep + 1` candidate inverse scales around `nmax / (max - min)`. Returns `(scale, -min)`;
/// `l` receives the levels.
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> (f32, f32) {
    let n = x.len();
    let mut laux = [0u8; 32];
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l[..n].fill(0);
        return (0.0, -min);
    }
    let err = |diff: f32| if use_mad { diff.abs() } else { diff * diff };
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = q as u8;
        let diff = scale * l[i] as f32 + min - x[i];
        best_error += weights[i] * err(diff);
    }
    if nstep < 1 {
        return (scale, -min);
    }
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = q as u8;
            let w = weights[i];
            let lf = q as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * err(diff);
            }
            if cur_error < best_error {
                l[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Symmetric fit `x ≈ scale * (L - nmax)` with weights `x²` (ggml's `make_qx_quants` with
/// `rmse_type = 1` and no importance weights), searching 18 inverse scales around `nmax / max`.
/// `l` receives `level + nmax` in `0..2*nmax`.
fn make_qx_quants_rmse1(nmax: i32, x: &[f32], l: &mut [i8]) -> f32 {
    let n = x.len();
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l[..n].fill(0);
        return 0.0;
    }
    let mut iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for i in 0..n {
        let q = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l[i] = (q + nmax) as i8;
        let w = x[i] * x[i];
        let qf = q as f32;
        sumlx += w * x[i] * qf;
        suml2 += w * qf * qf;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9i32..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for &v in x {
            let qf = nearest_int(iscale * v).clamp(-nmax, nmax - 1) as f32;
            let w = v * v;
            sumlx += w * v * qf;
            suml2 += w * qf * qf;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for i in 0..n {
                let q = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
                l[i] = (q + nmax) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Symmetric 3-bit fit with iterative per-element refinement (ggml's `make_q3_quants` with
/// `do_rmse`). `l` receives `level + nmax`.
fn make_q3_quants(nmax: i32, x: &[f32], l: &mut [i8]) -> f32 {
    let n = x.len();
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l[..n].fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for i in 0..n {
        let q = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l[i] = q as i8;
        let w = x[i] * x[i];
        let qf = q as f32;
        sumlx += w * x[i] * qf;
        suml2 += w * qf * qf;
    }
    for _ in 0..5 {
        let mut n_changed = 0;
        for i in 0..n {
            let w = x[i] * x[i];
            let li = l[i] as f32;
            let mut slx = sumlx - w * x[i] * li;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * li * li;
                let new_l = nearest_int(x[i] * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != l[i] as i32 {
                    let nf = new_l as f32;
                    slx += w * x[i] * nf;
                    sl2 += w * nf * nf;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed += 1;
                    }
                }
            }
        }
        if n_changed == 0 {
            break;
        }
    }
    for v in l[..n].iter_mut() {
        *v += nmax as i8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// Pack 256 2-bit values: byte `32h + l` holds elements `128h + l + 32k` at bit `2k`.
fn pack_2bit(l: &[u8; QK_K], qs: &mut [u8; QK_K / 4]) {
    for h in 0..2 {
        for i in 0..32 {
            let j = 128 * h + i;
            qs[32 * h + i] = l[j] | (l[j + 32] << 2) | (l[j + 64] << 4) | (l[j + 96] << 6);
        }
    }
}

/// Q2_K: 16 groups of 16, each with a 4-bit scale and 4-bit min (weighted by |x|, absolute error).
pub fn quantize_block_q2_k(x: &[f32; QK_K]) -> BlockQ2K {
    const Q4SCALE: f32 = 15.0;
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; 16];
    let mut mins = [0f32; 16];
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..16 {
        let xs = &x[16 * j..16 * j + 16];
        let mut weights = [0f32; 16];
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = v.abs();
        }
        let (s, m) = make_qkx2_quants(
            3,
            xs,
            &weights,
            &mut l[16 * j..16 * j + 16],
            -0.5,
            0.1,
            15,
            true,
        );
        scales[j] = s;
        mins[j] = m;
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    let mut block = BlockQ2K {
        scales: [0; 16],
        qs: [0; QK_K / 4],
        d: f16_field(0.0),
        dmin: f16_field(0.0),
    };
    if max_scale > 0.0 {
        let iscale = Q4SCALE / max_scale;
        for (sc, &s) in block.scales.iter_mut().zip(&scales) {
            *sc = nearest_int(iscale * s) as u8;
        }
        block.d = f16_field(max_scale / Q4SCALE);
    }
    if max_min > 0.0 {
        let iscale = Q4SCALE / max_min;
        for (sc, &m) in block.scales.iter_mut().zip(&mins) {
            *sc |= (nearest_int(iscale * m) << 4) as u8;
        }
        block.dmin = f16_field(max_min / Q4SCALE);
    }
    let (d_all, dmin_all) = (block.d.to_f32(), block.dmin.to_f32());
    for j in 0..16 {
        let d = d_all * (block.scales[j] & 0x0f) as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dmin_all * (block.scales[j] >> 4) as f32;
        for i in 16 * j..16 * j + 16 {
            l[i] = nearest_int((x[i] + dm) / d).clamp(0, 3) as u8;
        }
    }
    pack_2bit(&l, &mut block.qs);
    block
}

/// Q3_K: 16 groups of 16 with signed 6-bit scales; the third bit of each level goes to `hmask`.
pub fn quantize_block_q3_k(x: &[f32; QK_K]) -> BlockQ3K {
    let mut l = [0i8; QK_K];
    let mut scales = [0f32; 16];
    let (mut amax, mut max_scale) = (0f32, 0f32);
    for j in 0..16 {
        scales[j] = make_q3_quants(4, &x[16 * j..16 * j + 16], &mut l[16 * j..16 * j + 16]);
        if scales[j].abs() > amax {
            amax = scales[j].abs();
            max_scale = scales[j];
        }
    }
    let mut block = BlockQ3K {
        hmask: [0; QK_K / 8],
        qs: [0; QK_K / 4],
        scales: [0; 12],
        d: f16_field(0.0),
    };
    if max_scale != 0.0 {
        let iscale = -32.0 / max_scale;
        for (j, &s) in scales.iter().enumerate() {
            let q = ((nearest_int(iscale * s) as i8).clamp(-32, 31) + 32) as u8;
            if j < 8 {
                block.scales[j] = q & 0x0f;
            } else {
                block.scales[j - 8] |= (q & 0x0f) << 4;
            }
            block.scales[j % 4 + 8] |= (q >> 4) << (2 * (j / 4));
        }
        block.d = f16_field(1.0 / iscale);
    }
    let d_all = block.d.to_f32();
    let stored = crate::dequant::q3_k_scales(&block.scales);
    for j in 0..16 {
        let d = d_all * stored[j] as f32;
        if d == 0.0 {
            continue;
        }
        for i in 16 * j..16 * j + 16 {
            l[i] = (nearest_int(x[i] / d).clamp(-4, 3) + 4) as i8;
        }
    }
    // High bit of element j goes to hmask[j % 32], bit j / 32.
    let mut low = [0u8; QK_K];
    for (j, (&q, lo)) in l.iter().zip(low.iter_mut()).enumerate() {
        let mut q = q as u8;
        if q > 3 {
            block.hmask[j % 32] |= 1 << (j / 32);
            q -= 4;
        }
        *lo = q;
    }
    pack_2bit(&low, &mut block.qs);
    block
}

/// Pack Q4_K/Q5_K's eight 6-bit scales and mins into 12 bytes.
fn pack_scale_min_k4(ls: &[u8; 8], lm: &[u8; 8]) -> [u8; K_SCALE_SIZE] {
    let mut s = [0u8; K_SCALE_SIZE];
    for j in 0..8 {
        if j < 4 {
            s[j] = ls[j];
            s[j + 4] = lm[j];
        } else {
            s[j + 4] = (ls[j] & 0x0f) | ((lm[j] & 0x0f) << 4);
            s[j - 4] |= (ls[j] >> 4) << 6;
            s[j] |= (lm[j] >> 4) << 6;
        }
    }
    s
}

/// The common part of Q4_K and Q5_K: fit 8 sub-blocks of 32, quantize their scales and mins to 6
/// bits, and re-quantize every element with the stored values. Returns levels, d, dmin, scales.
fn quantize_k4_common(
    x: &[f32; QK_K],
    nmax: i32,
    rmin: f32,
    nstep: i32,
) -> ([u8; QK_K], f16, f16, [u8; K_SCALE_SIZE]) {
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        let mut weights = [0f32; 32];
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        let (s, m) = make_qkx2_quants(
            nmax,
            xs,
            &weights,
            &mut l[32 * j..32 * j + 32],
            rmin,
            0.1,
            nstep,
            false,
        );
        scales[j] = s;
        mins[j] = m;
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let (mut ls, mut lm) = ([0u8; 8], [0u8; 8]);
    for j in 0..8 {
        // ggml stores the rounded value into a byte before capping it, so a negative value wraps.
        ls[j] = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        lm[j] = (nearest_int(inv_min * mins[j]) as u8).min(63);
    }
    let packed = pack_scale_min_k4(&ls, &lm);
    let d = f16_field(max_scale / 63.0);
    let dmin = f16_field(max_min / 63.0);
    let (d_all, dmin_all) = (d.to_f32(), dmin.to_f32());
    for j in 0..8 {
        let (sc, m) = get_scale_min_k4(j, &packed);
        let dj = d_all * sc as f32;
        if dj == 0.0 {
            continue;
        }
        let dm = dmin_all * m as f32;
        for i in 32 * j..32 * j + 32 {
            l[i] = nearest_int((x[i] + dm) / dj).clamp(0, nmax) as u8;
        }
    }
    (l, d, dmin, packed)
}

/// Q4_K: 8 sub-blocks of 32 with 6-bit scales and mins.
pub fn quantize_block_q4_k(x: &[f32; QK_K]) -> BlockQ4K {
    let (l, d, dmin, scales) = quantize_k4_common(x, 15, -1.0, 20);
    let mut qs = [0u8; QK_K / 2];
    for c in 0..4 {
        for i in 0..32 {
            qs[32 * c + i] = l[64 * c + i] | (l[64 * c + 32 + i] << 4);
        }
    }
    BlockQ4K {
        d,
        dmin,
        scales,
        qs,
    }
}

/// Q5_K: Q4_K with 32 levels; the fifth bit of each level goes to `qh`.
pub fn quantize_block_q5_k(x: &[f32; QK_K]) -> BlockQ5K {
    let (l, d, dmin, scales) = quantize_k4_common(x, 31, -0.5, 15);
    let mut qs = [0u8; QK_K / 2];
    let mut qh = [0u8; QK_K / 8];
    for c in 0..4 {
        let (m1, m2) = (1u8 << (2 * c), 2u8 << (2 * c));
        for i in 0..32 {
            let mut l1 = l[64 * c + i];
            if l1 > 15 {
                l1 -= 16;
                qh[i] |= m1;
            }
            let mut l2 = l[64 * c + 32 + i];
            if l2 > 15 {
                l2 -= 16;
                qh[i] |= m2;
            }
            qs[32 * c + i] = l1 | (l2 << 4);
        }
    }
    BlockQ5K {
        d,
        dmin,
        scales,
        qh,
        qs,
    }
}

/// Q6_K: 16 groups of 16 with signed 8-bit scales and 6-bit levels.
pub fn quantize_block_q6_k(x: &[f32; QK_K]) -> BlockQ6K {
    let mut l = [0i8; QK_K];
    let mut scales = [0f32; 16];
    let (mut max_abs_scale, mut max_scale) = (0f32, 0f32);
    for ib in 0..16 {
        let s = make_qx_quants_rmse1(32, &x[16 * ib..16 * ib + 16], &mut l[16 * ib..16 * ib + 16]);
        scales[ib] = s;
        if s.abs() > max_abs_scale {
            max_abs_scale = s.abs();
            max_scale = s;
        }
    }
    let mut block = BlockQ6K {
        ql: [0; QK_K / 2],
        qh: [0; QK_K / 4],
        scales: [0; 16],
        d: f16_field(0.0),
    };
    if max_abs_scale < GROUP_MAX_EPS {
        return block;
    }
    let iscale = -128.0 / max_scale;
    block.d = f16_field(1.0 / iscale);
    for (sc, &s) in block.scales.iter_mut().zip(&scales) {
        *sc = nearest_int(iscale * s).min(127) as i8;
    }
    let d_all = block.d.to_f32();
    for j in 0..16 {
        let d = d_all * block.scales[j] as f32;
        if d == 0.0 {
            continue;
        }
        for i in 16 * j..16 * j + 16 {
            l[i] = (nearest_int(x[i] / d).clamp(-32, 31) + 32) as i8;
        }
    }
    for h in 0..2 {
        for i in 0..32 {
            let j = 128 * h + i;
            let (q1, q2, q3, q4) = (
                l[j] as u8,
                l[j + 32] as u8,
                l[j + 64] as u8,
                l[j + 96] as u8,
            );
            block.ql[64 * h + i] = (q1 & 0x0f) | ((q3 & 0x0f) << 4);
            block.ql[64 * h + i + 32] = (q2 & 0x0f) | ((q4 & 0x0f) << 4);
            block.qh[32 * h + i] =
                (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
    block
}

/// Q8_K: `d = max / -127` (f32), `q = nearest(x / d)`, plus sums of each 16 levels.
pub fn quantize_block_q8_k(x: &[f32; QK_K]) -> BlockQ8K {
    let mut block = BlockQ8K {
        d: 0.0,
        qs: [0; QK_K],
        bsums: [0; 16],
    };
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        return block;
    }
    let iscale = -127.0 / max;
    for (q, &v) in block.qs.iter_mut().zip(x.iter()) {
        *q = nearest_int(iscale * v).min(127) as i8;
    }
    for (s, g) in block.bsums.iter_mut().zip(block.qs.chunks_exact(16)) {
        *s = g.iter().map(|&q| q as i16).sum();
    }
    block.d = 1.0 / iscale;
    block
}

/// The value ggml stores for an f16 field, for tests and callers reasoning about rounding.
pub fn stored_f16(x: f32) -> f32 {
    round_f16(x)
}
