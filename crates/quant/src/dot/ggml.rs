//! Float primitives of attention and SwiGLU in exactly the order of operations of ggml's CPU
//! backend as llama.cpp builds it on x86-64 with AVX-512 (the reference our tests compare
//! against), so that the engine's rounding matches llama.cpp's bit for bit:
//!
//! - [`expf`]: ggml's vector `expf` (`ggml_v_expf`, AVX-512 variant: a degree-5 polynomial and
//!   `scalef`), used by its softmax and SiLU; not the libm `expf`.
//! - [`swiglu`]: `silu(g) * u` with that `expf` in 16-lane chunks, libm `expf` on the tail.
//! - [`softmax`]: max, `expf(x - max)` in 16-lane chunks, each chunk's sum by
//!   `_mm512_reduce_add_ps` added into an f64, then a multiply by `(float)(1.0 / sum)`.
//! - [`dot_f16`]: llamafile's tinyBLAS f16 kernel as ggml's batched `mul_mat` runs it for
//!   `K·Q` and `V·softmax`: 16 lanes, lane `i` a fused multiply-add chain over elements
//!   `i, i + 16, ...`, then the lanes reduced by [`reduce16`].
//!
//! Every function has a scalar form (the reference, with `f32::mul_add` for each fused
//! multiply-add), an AVX-512 form, an AVX2 form (the 16 lanes as two `__m256`) and a NEON form
//! (aarch64: the 16 lanes as four `float32x4_t`); all are bit-identical, and the tests check
//! that.

use half::f16;

use super::{best_isa, Isa};

/// `_mm512_reduce_add_ps` as GCC expands it: halves, quarters, then pairs.
#[inline(always)]
pub fn reduce16(v: &[f32; 16]) -> f32 {
    let mut h = [0f32; 8];
    for i in 0..8 {
        h[i] = v[8 + i] + v[i];
    }
    let q = [h[4] + h[0], h[5] + h[1], h[6] + h[2], h[7] + h[3]];
    (q[0] + q[2]) + (q[1] + q[3])
}

const R: f32 = f32::from_bits(0x4b40_0000); // 0x1.8p23
const LOG2E: f32 = f32::from_bits(0x3fb8_aa3b); // 0x1.715476p+0
const LN2_HI: f32 = f32::from_bits(0x3f31_7200); // 0x1.62e4p-1
const LN2_LO: f32 = f32::from_bits(0x35bf_be8e); // 0x1.7f7d1cp-20
const P5: f32 = f32::from_bits(0x3c07_2010); // 0x1.0e4020p-7
const P4: f32 = f32::from_bits(0x3d2b_9f17); // 0x1.573e2ep-5
const P3: f32 = f32::from_bits(0x3e2a_af33); // 0x1.555e66p-3
const P2: f32 = f32::from_bits(0x3eff_fedb); // 0x1.fffdb6p-2
const P1: f32 = f32::from_bits(0x3f7f_fff6); // 0x1.ffffecp-1

/// ggml's vector `expf` on one value (the scalar reference of the 16-lane form).
#[inline(always)]
pub fn expf(x: f32) -> f32 {
    let z = x.mul_add(LOG2E, R);
    let n = z - R;
    let b = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let u = b * b;
    let j = P5
        .mul_add(b, P4)
        .mul_add(u, P3.mul_add(b, P2))
        .mul_add(u, P1.mul_add(b, 1.0));
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    // scalef(j, n) = j * 2^n with one rounding; n is an integer here, |n| <= 192, and the
    // product is exact in f64.
    (j as f64 * (n as f64).exp2()) as f32
}

/// `g[i] = silu(g[i]) * u[i]` as ggml's `ggml_vec_swiglu_f32` computes it.
pub fn swiglu(g: &mut [f32], u: &[f32]) {
    swiglu_isa(best_isa(), g, u)
}

/// [`swiglu`] on the given level (`Scalar` is the reference); the caller checks availability.
pub fn swiglu_isa(isa: Isa, g: &mut [f32], u: &[f32]) {
    let n = g.len().min(u.len());
    let body = n & !15;
    match isa {
        // SAFETY: the level is available (caller's contract); both pointers cover `body`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::swiglu_512(g.as_mut_ptr(), u.as_ptr(), body) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86_256::swiglu_256(g.as_mut_ptr(), u.as_ptr(), body) },
        // SAFETY: as above (NEON is baseline on aarch64).
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { arm::swiglu(g.as_mut_ptr(), u.as_ptr(), body) },
        _ => {
            for (gv, &uv) in g[..body].iter_mut().zip(&u[..body]) {
                let x = *gv;
                *gv = (x / (1.0 + expf(0.0 - x))) * uv;
            }
        }
    }
    for (gv, &uv) in g[body..n].iter_mut().zip(&u[body..n]) {
        let x = *gv;
        *gv = x / (1.0 + (-x).exp()) * uv;
    }
}

/// In-place softmax of `x` as ggml's `soft_max` computes a row (after its scaling): the row is
/// treated as padded with `-inf` to a multiple of 16, as llama.cpp's KV length always is.
pub fn softmax(x: &mut [f32]) {
    softmax_isa(best_isa(), x)
}

/// [`softmax`] on the given level; the caller checks availability.
pub fn softmax_isa(isa: Isa, x: &mut [f32]) {
    if x.is_empty() {
        return;
    }
    let mut max = f32::NEG_INFINITY;
    for &v in x.iter() {
        max = if v > max { v } else { max };
    }
    let mut sum = 0f64;
    let mut chunks = x.chunks_mut(16);
    for c in &mut chunks {
        let mut e = [f32::NEG_INFINITY; 16];
        e[..c.len()].copy_from_slice(c);
        let s = match isa {
            // SAFETY: the level is available (caller's contract).
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { x86::exp_sub_512(&mut e, max) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { x86_256::exp_sub_256(&mut e, max) },
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => arm::exp_sub(&mut e, max),
            _ => {
                for v in e.iter_mut() {
                    *v = expf(*v - max);
                }
                reduce16(&e)
            }
        };
        sum += s as f64;
        c.copy_from_slice(&e[..c.len()]);
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `sum(a[i] * b[i])` of two f16 vectors in tinyBLAS's order (see the module docs). A length
/// that is not a multiple of 16 has its tail added sequentially at the end (tinyBLAS refuses
/// such shapes; no Llama head size has one).
pub fn dot_f16(a: &[f16], b: &[f16]) -> f32 {
    dot_f16_isa(best_isa(), a, b)
}

/// [`dot_f16`] on the given level; the caller checks availability.
pub fn dot_f16_isa(isa: Isa, a: &[f16], b: &[f16]) -> f32 {
    let n = a.len().min(b.len());
    let body = n & !15;
    let mut s = match isa {
        // SAFETY: the level is available (caller's contract); both pointers cover `body`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe {
            x86::dot_f16_512(a.as_ptr() as *const u16, b.as_ptr() as *const u16, body)
        },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe {
            x86_256::dot_f16_256(a.as_ptr() as *const u16, b.as_ptr() as *const u16, body)
        },
        // SAFETY: as above.
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe {
            arm::dot_f16(a.as_ptr() as *const u16, b.as_ptr() as *const u16, body)
        },
        _ => {
            let mut acc = [0f32; 16];
            for (ca, cb) in a[..body].chunks_exact(16).zip(b[..body].chunks_exact(16)) {
                for i in 0..16 {
                    acc[i] = ca[i].to_f32().mul_add(cb[i].to_f32(), acc[i]);
                }
            }
            reduce16(&acc)
        }
    };
    for (x, y) in a[body..n].iter().zip(&b[body..n]) {
        s = x.to_f32().mul_add(y.to_f32(), s);
    }
    s
}

/// `sum(a[i] * b[i])` of two f16 vectors as ggml's `ggml_vec_dot_f16` computes it (the path of
/// its single-token `mul_mat`, which llamafile's kernel refuses): four 16-lane accumulators
/// over 64-element steps (element `i` of a step in accumulator `(i / 16) % 4`, lane `i % 16`),
/// reduced by [`reduce_lanes64`]; a tail past the last whole step summed in f64.
pub fn dot_f16_vec(a: &[f16], b: &[f16]) -> f32 {
    dot_f16_vec_isa(best_isa(), a, b)
}

/// [`dot_f16_vec`] on the given level; the caller checks availability.
pub fn dot_f16_vec_isa(isa: Isa, a: &[f16], b: &[f16]) -> f32 {
    let n = a.len().min(b.len());
    let body = n & !63;
    let r = match isa {
        // SAFETY: the level is available (caller's contract); both pointers cover `body`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe {
            x86::dot_f16_vec_512(a.as_ptr() as *const u16, b.as_ptr() as *const u16, body)
        },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe {
            x86_256::dot_f16_vec_256(a.as_ptr() as *const u16, b.as_ptr() as *const u16, body)
        },
        // SAFETY: as above.
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe {
            arm::dot_f16_vec(a.as_ptr() as *const u16, b.as_ptr() as *const u16, body)
        },
        _ => {
            let mut acc = [0f32; 64];
            for (ca, cb) in a[..body].chunks_exact(64).zip(b[..body].chunks_exact(64)) {
                for i in 0..64 {
                    acc[i] = ca[i].to_f32().mul_add(cb[i].to_f32(), acc[i]);
                }
            }
            reduce64(&acc)
        }
    };
    let mut s = r as f64;
    for (x, y) in a[body..n].iter().zip(&b[body..n]) {
        s += (x.to_f32() * y.to_f32()) as f64;
    }
    s as f32
}

/// ggml's `GGML_F32x16_REDUCE` of four 16-lane accumulators stored one after another:
/// `(x0 + x2) + (x1 + x3)` lane-wise, then [`reduce16`].
#[inline(always)]
pub fn reduce64(acc: &[f32; 64]) -> f32 {
    let mut v = [0f32; 16];
    for (l, o) in v.iter_mut().enumerate() {
        *o = (acc[l] + acc[32 + l]) + (acc[16 + l] + acc[48 + l]);
    }
    reduce16(&v)
}

/// `out[d] = reduce64(lanes[0][d], ..., lanes[63][d])` for 64 accumulator rows of `out.len()`
/// each (the single-token `V · p` of [`dot_f16_vec`]'s order: KV position `j` in row `j % 64`).
pub fn reduce_lanes64(lanes: &[f32], out: &mut [f32]) {
    let n = out.len();
    if lanes.len() < 64 * n {
        for (d, o) in out.iter_mut().enumerate() {
            let mut v = [0f32; 64];
            for (i, x) in v.iter_mut().enumerate() {
                *x = lanes.get(i * n + d).copied().unwrap_or(0.0);
            }
            *o = reduce64(&v);
        }
        return;
    }
    // The same per-element tree as `reduce64`, computed for 16 elements at a time with
    // contiguous loads (each element's additions in the same order, so bit for bit equal).
    let row = |i: usize, d0: usize| &lanes[i * n + d0..i * n + d0 + 16];
    let mut d0 = 0;
    while d0 + 16 <= n {
        let mut v = [[0f32; 16]; 16];
        for (l, vl) in v.iter_mut().enumerate() {
            let (a, b, c, e) = (
                row(l, d0),
                row(32 + l, d0),
                row(16 + l, d0),
                row(48 + l, d0),
            );
            for k in 0..16 {
                vl[k] = (a[k] + b[k]) + (c[k] + e[k]);
            }
        }
        reduce16_columns(&v, &mut out[d0..d0 + 16]);
        d0 += 16;
    }
    for (d, o) in out.iter_mut().enumerate().skip(d0) {
        let mut v = [0f32; 64];
        for (i, x) in v.iter_mut().enumerate() {
            *x = lanes[i * n + d];
        }
        *o = reduce64(&v);
    }
}

/// `out[k] = reduce16(v[0][k], ..., v[15][k])` for 16 columns at once.
#[inline(always)]
fn reduce16_columns(v: &[[f32; 16]; 16], out: &mut [f32]) {
    let mut h = [[0f32; 16]; 8];
    for (i, hi) in h.iter_mut().enumerate() {
        for k in 0..16 {
            hi[k] = v[8 + i][k] + v[i][k];
        }
    }
    for (k, o) in out.iter_mut().enumerate().take(16) {
        let q = [
            h[4][k] + h[0][k],
            h[5][k] + h[1][k],
            h[6][k] + h[2][k],
            h[7][k] + h[3][k],
        ];
        *o = (q[0] + q[2]) + (q[1] + q[3]);
    }
}

/// One step of tinyBLAS's `V · p` in lane form: `acc[d] = fma(v[d], p, acc[d])`. The caller
/// keeps 16 such accumulator rows, uses row `j % 16` for KV position `j`, and finishes with
/// [`reduce_lanes`].
pub fn fma_f16_row(acc: &mut [f32], p: f32, v: &[f16]) {
    fma_f16_row_isa(best_isa(), acc, p, v)
}

/// [`fma_f16_row`] on the given level; the caller checks availability.
pub fn fma_f16_row_isa(isa: Isa, acc: &mut [f32], p: f32, v: &[f16]) {
    let n = acc.len().min(v.len());
    match isa {
        // SAFETY: the level is available (caller's contract); both pointers cover `n`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe {
            x86::fma_f16_row_512(acc.as_mut_ptr(), p, v.as_ptr() as *const u16, n)
        },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe {
            x86_256::fma_f16_row_256(acc.as_mut_ptr(), p, v.as_ptr() as *const u16, n)
        },
        // SAFETY: as above.
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { arm::fma_f16_row(acc.as_mut_ptr(), p, v.as_ptr() as *const u16, n) },
        _ => {
            for (a, x) in acc[..n].iter_mut().zip(&v[..n]) {
                *a = x.to_f32().mul_add(p, *a);
            }
        }
    }
}

/// `out[d] = reduce16(lanes[0][d], ..., lanes[15][d])` for 16 accumulator rows of
/// `out.len()` each, stored one after another in `lanes`.
pub fn reduce_lanes(lanes: &[f32], out: &mut [f32]) {
    let n = out.len();
    debug_assert!(lanes.len() >= 16 * n);
    let mut d0 = 0;
    if lanes.len() >= 16 * n {
        // 16 elements at a time with contiguous loads, each element's tree unchanged.
        while d0 + 16 <= n {
            let mut v = [[0f32; 16]; 16];
            for (l, vl) in v.iter_mut().enumerate() {
                vl.copy_from_slice(&lanes[l * n + d0..l * n + d0 + 16]);
            }
            reduce16_columns(&v, &mut out[d0..d0 + 16]);
            d0 += 16;
        }
    }
    for (d, o) in out.iter_mut().enumerate().skip(d0) {
        let mut v = [0f32; 16];
        for (i, x) in v.iter_mut().enumerate() {
            *x = lanes.get(i * n + d).copied().unwrap_or(0.0);
        }
        *o = reduce16(&v);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::*;

    /// [`reduce16`] on a register: the same tree, in the same order.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn reduce(v: __m512) -> f32 {
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        let h = _mm256_add_ps(hi, _mm512_castps512_ps256(v));
        let q = _mm_add_ps(_mm256_extractf128_ps::<1>(h), _mm256_castps256_ps128(h));
        // [q0 + q2, q1 + q3, ..]
        let p = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)))
    }

    /// ggml's `ggml_v_expf` (AVX-512 form), instruction for instruction.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn expf16(x: __m512) -> __m512 {
        let r = _mm512_set1_ps(R);
        let z = _mm512_fmadd_ps(x, _mm512_set1_ps(LOG2E), r);
        let n = _mm512_sub_ps(z, r);
        let b = _mm512_fnmadd_ps(
            n,
            _mm512_set1_ps(LN2_LO),
            _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x),
        );
        let d = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(n), _mm512_set1_ps(192.0));
        let u = _mm512_mul_ps(b, b);
        let j = _mm512_fmadd_ps(
            _mm512_fmadd_ps(
                _mm512_fmadd_ps(_mm512_set1_ps(P5), b, _mm512_set1_ps(P4)),
                u,
                _mm512_fmadd_ps(_mm512_set1_ps(P3), b, _mm512_set1_ps(P2)),
            ),
            u,
            _mm512_fmadd_ps(_mm512_set1_ps(P1), b, _mm512_set1_ps(1.0)),
        );
        let res = _mm512_scalef_ps(j, n);
        if d == 0 {
            return res;
        }
        let zero = _mm512_setzero_ps();
        let alt = _mm512_mask_blend_ps(
            _mm512_cmp_ps_mask::<_CMP_LE_OQ>(n, zero),
            _mm512_set1_ps(f32::INFINITY),
            zero,
        );
        _mm512_mask_blend_ps(d, res, alt)
    }

    /// # Safety
    /// AVX-512 F available; `g` and `u` valid for `n` elements, `n % 16 == 0`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn swiglu_512(g: *mut f32, u: *const f32, n: usize) {
        let one = _mm512_set1_ps(1.0);
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n, inside both buffers.
            unsafe {
                let x = _mm512_loadu_ps(g.add(i));
                let e = expf16(_mm512_sub_ps(_mm512_setzero_ps(), x));
                let s = _mm512_div_ps(x, _mm512_add_ps(one, e));
                _mm512_storeu_ps(g.add(i), _mm512_mul_ps(s, _mm512_loadu_ps(u.add(i))));
            }
            i += 16;
        }
    }

    /// `e = expf(e - max)` in place; returns the chunk's sum by [`reduce`].
    ///
    /// # Safety
    /// AVX-512 F available.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn exp_sub_512(e: &mut [f32; 16], max: f32) -> f32 {
        // SAFETY: `e` holds 16 floats.
        unsafe {
            let v = expf16(_mm512_sub_ps(
                _mm512_loadu_ps(e.as_ptr()),
                _mm512_set1_ps(max),
            ));
            _mm512_storeu_ps(e.as_mut_ptr(), v);
            reduce(v)
        }
    }

    /// # Safety
    /// AVX-512 F available; `a`, `b` valid for `n` f16 values, `n % 16 == 0`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_f16_512(a: *const u16, b: *const u16, n: usize) -> f32 {
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n, inside both vectors.
            unsafe {
                let x = _mm512_cvtph_ps(_mm256_loadu_si256(a.add(i) as *const __m256i));
                let y = _mm512_cvtph_ps(_mm256_loadu_si256(b.add(i) as *const __m256i));
                acc = _mm512_fmadd_ps(x, y, acc);
            }
            i += 16;
        }
        reduce(acc)
    }

    /// # Safety
    /// AVX-512 F available; `a`, `b` valid for `n` f16 values, `n % 64 == 0`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_f16_vec_512(a: *const u16, b: *const u16, n: usize) -> f32 {
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i + 64 <= n {
            for (j, s) in acc.iter_mut().enumerate() {
                // SAFETY: i + 64 <= n, inside both vectors.
                unsafe {
                    let p = i + 16 * j;
                    let x = _mm512_cvtph_ps(_mm256_loadu_si256(a.add(p) as *const __m256i));
                    let y = _mm512_cvtph_ps(_mm256_loadu_si256(b.add(p) as *const __m256i));
                    *s = _mm512_fmadd_ps(x, y, *s);
                }
            }
            i += 64;
        }
        let x0 = _mm512_add_ps(acc[0], acc[2]);
        let x1 = _mm512_add_ps(acc[1], acc[3]);
        reduce(_mm512_add_ps(x0, x1))
    }

    /// # Safety
    /// AVX-512 F available; `acc` and `v` valid for `n` elements.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma_f16_row_512(acc: *mut f32, p: f32, v: *const u16, n: usize) {
        let pv = _mm512_set1_ps(p);
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n, inside both buffers.
            unsafe {
                let x = _mm512_cvtph_ps(_mm256_loadu_si256(v.add(i) as *const __m256i));
                let a = _mm512_loadu_ps(acc.add(i));
                _mm512_storeu_ps(acc.add(i), _mm512_fmadd_ps(x, pv, a));
            }
            i += 16;
        }
        while i < n {
            // SAFETY: i < n.
            unsafe {
                let x = half::f16::from_bits(*v.add(i)).to_f32();
                *acc.add(i) = x.mul_add(p, *acc.add(i));
            }
            i += 1;
        }
    }
}

/// The AVX2 forms (x86-64 without AVX-512, e.g. most desktop CPUs): the 16 lanes of the
/// references as two `__m256` (lanes 0..8, 8..16), the same operations lane by lane.
#[cfg(target_arch = "x86_64")]
mod x86_256 {
    use std::arch::x86_64::*;

    use super::*;

    /// [`reduce16`] of lanes 0..8 (`lo`) and 8..16 (`hi`): the same tree, in the same order.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn reduce(lo: __m256, hi: __m256) -> f32 {
        // h[i] = v[8 + i] + v[i]; q[i] = h[4 + i] + h[i]; (q0 + q2) + (q1 + q3).
        let h = _mm256_add_ps(hi, lo);
        let q = _mm_add_ps(_mm256_extractf128_ps::<1>(h), _mm256_castps256_ps128(h));
        let p = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)))
    }

    /// [`expf`] on eight lanes, operation for operation (fused where the reference fuses).
    /// `scalef(j, n)` is `j` times `2^n` built from its exponent bits for `-126 <= n <= 127`
    /// (one rounding, as the reference's exact f64 product rounded once); any other lane (and
    /// NaN) takes the scalar reference itself.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn expf8(x: __m256) -> __m256 {
        let r = _mm256_set1_ps(R);
        let z = _mm256_fmadd_ps(x, _mm256_set1_ps(LOG2E), r);
        let n = _mm256_sub_ps(z, r);
        let b = _mm256_fnmadd_ps(
            n,
            _mm256_set1_ps(LN2_LO),
            _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x),
        );
        let u = _mm256_mul_ps(b, b);
        let j = _mm256_fmadd_ps(
            _mm256_fmadd_ps(
                _mm256_fmadd_ps(_mm256_set1_ps(P5), b, _mm256_set1_ps(P4)),
                u,
                _mm256_fmadd_ps(_mm256_set1_ps(P3), b, _mm256_set1_ps(P2)),
            ),
            u,
            _mm256_fmadd_ps(_mm256_set1_ps(P1), b, _mm256_set1_ps(1.0)),
        );
        let ok = _mm256_and_ps(
            _mm256_cmp_ps::<_CMP_GE_OQ>(n, _mm256_set1_ps(-126.0)),
            _mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_set1_ps(127.0)),
        );
        let ni = _mm256_cvtps_epi32(_mm256_and_ps(ok, n));
        let pow = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            ni,
            _mm256_set1_epi32(127),
        )));
        let res = _mm256_mul_ps(j, pow);
        let m = _mm256_movemask_ps(ok);
        if m == 0xff {
            return res;
        }
        let mut o = [0f32; 8];
        let mut xs = [0f32; 8];
        // SAFETY: both arrays hold 8 floats.
        unsafe {
            _mm256_storeu_ps(o.as_mut_ptr(), res);
            _mm256_storeu_ps(xs.as_mut_ptr(), x);
        }
        for l in 0..8 {
            if m & (1 << l) == 0 {
                o[l] = expf(xs[l]);
            }
        }
        // SAFETY: `o` holds 8 floats.
        unsafe { _mm256_loadu_ps(o.as_ptr()) }
    }

    /// # Safety
    /// AVX2/FMA/F16C available; `g` and `u` valid for `n` elements, `n % 16 == 0`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn swiglu_256(g: *mut f32, u: *const f32, n: usize) {
        let one = _mm256_set1_ps(1.0);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n, inside both buffers.
            unsafe {
                let x = _mm256_loadu_ps(g.add(i));
                let e = expf8(_mm256_sub_ps(_mm256_setzero_ps(), x));
                let s = _mm256_div_ps(x, _mm256_add_ps(one, e));
                _mm256_storeu_ps(g.add(i), _mm256_mul_ps(s, _mm256_loadu_ps(u.add(i))));
            }
            i += 8;
        }
    }

    /// `e = expf(e - max)` in place; returns the chunk's sum by [`reduce16`]'s tree.
    ///
    /// # Safety
    /// AVX2/FMA/F16C available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn exp_sub_256(e: &mut [f32; 16], max: f32) -> f32 {
        let m = _mm256_set1_ps(max);
        // SAFETY: `e` holds 16 floats.
        unsafe {
            let lo = expf8(_mm256_sub_ps(_mm256_loadu_ps(e.as_ptr()), m));
            let hi = expf8(_mm256_sub_ps(_mm256_loadu_ps(e.as_ptr().add(8)), m));
            _mm256_storeu_ps(e.as_mut_ptr(), lo);
            _mm256_storeu_ps(e.as_mut_ptr().add(8), hi);
            reduce(lo, hi)
        }
    }

    /// Eight f16 values at `p` as f32.
    ///
    /// # Safety
    /// `p` valid for 8 values; F16C available.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn h8(p: *const u16) -> __m256 {
        // SAFETY: caller's contract.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p as *const __m128i) })
    }

    /// # Safety
    /// AVX2/FMA/F16C available; `a`, `b` valid for `n` f16 values, `n % 16 == 0`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f16_256(a: *const u16, b: *const u16, n: usize) -> f32 {
        let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n, inside both vectors.
            unsafe {
                lo = _mm256_fmadd_ps(h8(a.add(i)), h8(b.add(i)), lo);
                hi = _mm256_fmadd_ps(h8(a.add(i + 8)), h8(b.add(i + 8)), hi);
            }
            i += 16;
        }
        reduce(lo, hi)
    }

    /// # Safety
    /// AVX2/FMA/F16C available; `a`, `b` valid for `n` f16 values, `n % 64 == 0`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f16_vec_256(a: *const u16, b: *const u16, n: usize) -> f32 {
        // acc[k]: elements 8k..8k+8 of each 64-element step (lanes 8k..8k+8 of [`reduce64`]).
        let mut acc = [_mm256_setzero_ps(); 8];
        let mut i = 0;
        while i + 64 <= n {
            for (k, s) in acc.iter_mut().enumerate() {
                // SAFETY: i + 64 <= n, inside both vectors.
                unsafe {
                    let p = i + 8 * k;
                    *s = _mm256_fmadd_ps(h8(a.add(p)), h8(b.add(p)), *s);
                }
            }
            i += 64;
        }
        // [`reduce64`]: lane l of the 16 = (acc[l] + acc[32 + l]) + (acc[16 + l] + acc[48 + l]).
        let lo = _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6]));
        let hi = _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7]));
        reduce(lo, hi)
    }

    /// # Safety
    /// AVX2/FMA/F16C available; `acc` and `v` valid for `n` elements.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn fma_f16_row_256(acc: *mut f32, p: f32, v: *const u16, n: usize) {
        let pv = _mm256_set1_ps(p);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n, inside both buffers.
            unsafe {
                let a = _mm256_loadu_ps(acc.add(i));
                _mm256_storeu_ps(acc.add(i), _mm256_fmadd_ps(h8(v.add(i)), pv, a));
            }
            i += 8;
        }
        while i < n {
            // SAFETY: i < n.
            unsafe {
                let x = half::f16::from_bits(*v.add(i)).to_f32();
                *acc.add(i) = x.mul_add(p, *acc.add(i));
            }
            i += 1;
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod arm {
    use std::arch::aarch64::*;

    use super::*;
    use crate::dot::neon::f16x8;

    /// [`reduce16`] of the 16 lanes held as four vectors (lanes 0..4, 4..8, 8..12, 12..16):
    /// the same tree, in the same order.
    #[inline(always)]
    fn reduce(v: [float32x4_t; 4]) -> f32 {
        // SAFETY: plain NEON (baseline on aarch64).
        unsafe {
            // h[i] = v[8 + i] + v[i]; q[i] = h[4 + i] + h[i].
            let q = vaddq_f32(vaddq_f32(v[3], v[1]), vaddq_f32(v[2], v[0]));
            (vgetq_lane_f32::<0>(q) + vgetq_lane_f32::<2>(q))
                + (vgetq_lane_f32::<1>(q) + vgetq_lane_f32::<3>(q))
        }
    }

    /// [`expf`] on four lanes, operation for operation (fused where the reference fuses).
    /// `scalef(j, n)` is `j` times `2^n` built from its exponent bits for `-126 <= n <= 127`
    /// (one rounding, as the reference's exact f64 product rounded once); any other lane (and
    /// NaN) takes the scalar reference itself.
    #[inline(always)]
    fn expf4(x: float32x4_t) -> float32x4_t {
        // SAFETY: plain NEON.
        unsafe {
            let r = vdupq_n_f32(R);
            let z = vfmaq_n_f32(r, x, LOG2E);
            let n = vsubq_f32(z, r);
            let b = vfmsq_n_f32(vfmsq_n_f32(x, n, LN2_HI), n, LN2_LO);
            let u = vmulq_f32(b, b);
            let t1 = vfmaq_n_f32(vdupq_n_f32(P4), b, P5);
            let t2 = vfmaq_n_f32(vdupq_n_f32(P2), b, P3);
            let t4 = vfmaq_n_f32(vdupq_n_f32(1.0), b, P1);
            let j = vfmaq_f32(t4, vfmaq_f32(t2, t1, u), u);
            let ok = vandq_u32(
                vcgeq_f32(n, vdupq_n_f32(-126.0)),
                vcleq_f32(n, vdupq_n_f32(127.0)),
            );
            let ni = vcvtq_s32_f32(vbslq_f32(ok, n, vdupq_n_f32(0.0)));
            let pow = vreinterpretq_f32_s32(vshlq_n_s32::<23>(vaddq_s32(ni, vdupq_n_s32(127))));
            let res = vmulq_f32(j, pow);
            if vminvq_u32(ok) == u32::MAX {
                return res;
            }
            let mut o = [0f32; 4];
            let mut xs = [0f32; 4];
            let mut m = [0u32; 4];
            vst1q_f32(o.as_mut_ptr(), res);
            vst1q_f32(xs.as_mut_ptr(), x);
            vst1q_u32(m.as_mut_ptr(), ok);
            for l in 0..4 {
                if m[l] == 0 {
                    o[l] = expf(xs[l]);
                }
            }
            vld1q_f32(o.as_ptr())
        }
    }

    /// # Safety
    /// `g` and `u` valid for `n` elements, `n % 16 == 0`.
    pub unsafe fn swiglu(g: *mut f32, u: *const f32, n: usize) {
        let one = vdupq_n_f32(1.0);
        let zero = vdupq_n_f32(0.0);
        let mut i = 0;
        while i + 4 <= n {
            // SAFETY: i + 4 <= n, inside both buffers.
            unsafe {
                let x = vld1q_f32(g.add(i));
                let e = expf4(vsubq_f32(zero, x));
                let s = vdivq_f32(x, vaddq_f32(one, e));
                vst1q_f32(g.add(i), vmulq_f32(s, vld1q_f32(u.add(i))));
            }
            i += 4;
        }
    }

    /// `e = expf(e - max)` in place; returns the chunk's sum by [`reduce16`]'s tree.
    pub fn exp_sub(e: &mut [f32; 16], max: f32) -> f32 {
        // SAFETY: `e` holds 16 floats.
        unsafe {
            let p = e.as_mut_ptr();
            let v: [float32x4_t; 4] = std::array::from_fn(|k| {
                let r = expf4(vsubq_f32(vld1q_f32(p.add(4 * k)), vdupq_n_f32(max)));
                vst1q_f32(p.add(4 * k), r);
                r
            });
            reduce(v)
        }
    }

    /// # Safety
    /// `a`, `b` valid for `n` f16 values, `n % 16 == 0`.
    pub unsafe fn dot_f16(a: *const u16, b: *const u16, n: usize) -> f32 {
        let mut acc = [vdupq_n_f32(0.0); 4];
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n, inside both vectors.
            unsafe {
                let (x0, x1) = f16x8(a.add(i));
                let (x2, x3) = f16x8(a.add(i + 8));
                let (y0, y1) = f16x8(b.add(i));
                let (y2, y3) = f16x8(b.add(i + 8));
                acc[0] = vfmaq_f32(acc[0], x0, y0);
                acc[1] = vfmaq_f32(acc[1], x1, y1);
                acc[2] = vfmaq_f32(acc[2], x2, y2);
                acc[3] = vfmaq_f32(acc[3], x3, y3);
            }
            i += 16;
        }
        reduce(acc)
    }

    /// # Safety
    /// `a`, `b` valid for `n` f16 values, `n % 64 == 0`.
    pub unsafe fn dot_f16_vec(a: *const u16, b: *const u16, n: usize) -> f32 {
        // acc[4g + k]: lanes 4k..4k + 4 of 16-lane accumulator g.
        let mut acc = [vdupq_n_f32(0.0); 16];
        let mut i = 0;
        while i + 64 <= n {
            for h in 0..8 {
                // SAFETY: i + 64 <= n, inside both vectors.
                unsafe {
                    let (x0, x1) = f16x8(a.add(i + 8 * h));
                    let (y0, y1) = f16x8(b.add(i + 8 * h));
                    acc[2 * h] = vfmaq_f32(acc[2 * h], x0, y0);
                    acc[2 * h + 1] = vfmaq_f32(acc[2 * h + 1], x1, y1);
                }
            }
            i += 64;
        }
        // reduce64: lane l of (acc0 + acc2) + (acc1 + acc3), then reduce16.
        // SAFETY: plain NEON.
        let v: [float32x4_t; 4] = std::array::from_fn(|k| unsafe {
            vaddq_f32(
                vaddq_f32(acc[k], acc[8 + k]),
                vaddq_f32(acc[4 + k], acc[12 + k]),
            )
        });
        reduce(v)
    }

    /// # Safety
    /// `acc` and `v` valid for `n` elements.
    pub unsafe fn fma_f16_row(acc: *mut f32, p: f32, v: *const u16, n: usize) {
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n, inside both buffers.
            unsafe {
                let (x0, x1) = f16x8(v.add(i));
                let a0 = vld1q_f32(acc.add(i));
                let a1 = vld1q_f32(acc.add(i + 4));
                vst1q_f32(acc.add(i), vfmaq_n_f32(a0, x0, p));
                vst1q_f32(acc.add(i + 4), vfmaq_n_f32(a1, x1, p));
            }
            i += 8;
        }
        while i < n {
            // SAFETY: i < n.
            unsafe {
                let x = half::f16::from_bits(*v.add(i)).to_f32();
                *acc.add(i) = x.mul_add(p, *acc.add(i));
            }
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Rng(u64);
    impl Rng {
        fn f(&mut self) -> f32 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    /// The column-wise lane reductions equal the per-element trees bit for bit (whole blocks of
    /// 16 elements and a tail).
    #[test]
    fn lane_reductions_equal_their_per_element_trees() {
        let mut r = Rng(0x1a2b_3c4d);
        for n in [8usize, 16, 64, 72] {
            let lanes: Vec<f32> = (0..64 * n).map(|_| r.f() * 100.0).collect();
            let mut got = vec![0f32; n];
            reduce_lanes64(&lanes, &mut got);
            for (d, g) in got.iter().enumerate() {
                let v: [f32; 64] = std::array::from_fn(|i| lanes[i * n + d]);
                assert_eq!(
                    g.to_bits(),
                    reduce64(&v).to_bits(),
                    "64 lanes, n {n}, d {d}"
                );
            }
            reduce_lanes(&lanes[..16 * n], &mut got);
            for (d, g) in got.iter().enumerate() {
                let v: [f32; 16] = std::array::from_fn(|i| lanes[i * n + d]);
                assert_eq!(
                    g.to_bits(),
                    reduce16(&v).to_bits(),
                    "16 lanes, n {n}, d {d}"
                );
            }
        }
    }

    fn levels() -> Vec<Isa> {
        [Isa::Avx2, Isa::Avx512, Isa::Neon]
            .into_iter()
            .filter(|i| i.available())
            .collect()
    }

    #[test]
    fn expf_is_close_to_libm_and_simd_is_bit_identical() {
        let mut r = Rng(11);
        let mut xs: Vec<f32> = (0..4096).map(|_| r.f() * 110.0).collect();
        xs.extend([0.0, -0.0, 88.5, -103.0, -150.0, 200.0, f32::NEG_INFINITY]);
        for &x in &xs {
            let (a, b) = (expf(x), x.exp());
            if b.is_finite() && b > 1e-37 {
                assert!((a - b).abs() <= 4.0 * f32::EPSILON * b, "{x}: {a} vs {b}");
            }
        }
        assert_eq!(expf(f32::NEG_INFINITY), 0.0);
        for isa in levels() {
            let mut a = xs.clone();
            a.resize(a.len().div_ceil(16) * 16, 0.0);
            let mut b = a.clone();
            softmax_isa(Isa::Scalar, &mut a);
            softmax_isa(isa, &mut b);
            assert_eq!(a, b, "{isa:?} softmax");
        }
    }

    #[test]
    fn simd_forms_equal_the_scalar_reference_bit_for_bit() {
        let mut r = Rng(5);
        for isa in levels() {
            for n in [16usize, 64, 128, 200, 1536] {
                let g0: Vec<f32> = (0..n).map(|_| r.f() * 12.0).collect();
                let u: Vec<f32> = (0..n).map(|_| r.f() * 3.0).collect();
                let (mut a, mut b) = (g0.clone(), g0.clone());
                swiglu_isa(Isa::Scalar, &mut a, &u);
                swiglu_isa(isa, &mut b, &u);
                assert_eq!(a, b, "{isa:?} swiglu {n}");

                let x: Vec<f16> = (0..n).map(|_| f16::from_f32(r.f() * 4.0)).collect();
                let y: Vec<f16> = (0..n).map(|_| f16::from_f32(r.f() * 4.0)).collect();
                assert_eq!(
                    dot_f16_vec_isa(Isa::Scalar, &x, &y).to_bits(),
                    dot_f16_vec_isa(isa, &x, &y).to_bits(),
                    "{isa:?} dot_f16_vec {n}"
                );
                assert_eq!(
                    dot_f16_isa(Isa::Scalar, &x, &y).to_bits(),
                    dot_f16_isa(isa, &x, &y).to_bits(),
                    "{isa:?} dot_f16 {n}"
                );

                let mut s: Vec<f32> = (0..n).map(|_| r.f() * 30.0).collect();
                let mut t = s.clone();
                softmax_isa(Isa::Scalar, &mut s);
                softmax_isa(isa, &mut t);
                assert_eq!(s, t, "{isa:?} softmax {n}");
                let total: f64 = s.iter().map(|&v| v as f64).sum();
                assert!((total - 1.0).abs() < 1e-5);

                let p = r.f();
                let (mut a, mut b) = (g0.clone(), g0.clone());
                fma_f16_row_isa(Isa::Scalar, &mut a, p, &x);
                fma_f16_row_isa(isa, &mut b, p, &x);
                assert_eq!(a, b, "{isa:?} fma_f16_row {n}");
            }
        }
    }

    #[test]
    fn vec_dot_f16_order_agrees_with_its_lane_form() {
        let mut r = Rng(13);
        let n = 192;
        let x: Vec<f16> = (0..n).map(|_| f16::from_f32(r.f())).collect();
        let y: Vec<f16> = (0..n).map(|_| f16::from_f32(r.f())).collect();
        let exact: f64 = x.iter().zip(&y).map(|(a, b)| a.to_f64() * b.to_f64()).sum();
        let d = dot_f16_vec_isa(Isa::Scalar, &x, &y);
        assert!((d as f64 - exact).abs() < 1e-5);
        let mut lanes = vec![0f32; 64];
        for (j, (a, b)) in x.iter().zip(&y).enumerate() {
            fma_f16_row_isa(
                Isa::Scalar,
                &mut lanes[j % 64..j % 64 + 1],
                b.to_f32(),
                &[*a],
            );
        }
        let mut out = [0f32];
        reduce_lanes64(&lanes, &mut out);
        assert_eq!(out[0], d);
    }

    #[test]
    fn dot_f16_and_lanes_agree_with_plain_sums() {
        let mut r = Rng(9);
        let n = 96;
        let x: Vec<f16> = (0..n).map(|_| f16::from_f32(r.f())).collect();
        let y: Vec<f16> = (0..n).map(|_| f16::from_f32(r.f())).collect();
        let exact: f64 = x.iter().zip(&y).map(|(a, b)| a.to_f64() * b.to_f64()).sum();
        assert!((dot_f16_isa(Isa::Scalar, &x, &y) as f64 - exact).abs() < 1e-5);
        // The lane form of the same product (one element per "position").
        let mut lanes = vec![0f32; 16];
        for (j, (a, b)) in x.iter().zip(&y).enumerate() {
            fma_f16_row_isa(
                Isa::Scalar,
                &mut lanes[j % 16..j % 16 + 1],
                b.to_f32(),
                &[*a],
            );
        }
        let mut out = [0f32];
        reduce_lanes(&lanes, &mut out);
        assert_eq!(out[0], dot_f16_isa(Isa::Scalar, &x, &y));
    }
}
