//! f32 helpers for attention over an f16 KV cache: dot products, `y += a * x` from f16, and a
//! vectorized `exp` for softmax. Each has a scalar reference and AVX2/AVX-512 and NEON
//! versions; the plain functions use [`best_isa`], the `*_isa` ones take the level explicitly
//! (for tests).
//!
//! Slices of different lengths are a caller bug: the functions debug-assert equal lengths and
//! otherwise use the shorter one, never reading or writing out of bounds.

use half::f16;

use super::{best_isa, DotError, Isa};

/// `sum(a[i] * b[i])`.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    dispatch_dot_f32(best_isa(), a, b)
}

/// `sum(a[i] * b[i])` with `b` in f16 (a key row of the KV cache).
pub fn dot_f32_f16(a: &[f32], b: &[f16]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    dispatch_dot_f32_f16(best_isa(), a, b)
}

/// `y[i] += a * x[i]` with `x` in f16 (a value row of the KV cache).
pub fn axpy_f16(y: &mut [f32], a: f32, x: &[f16]) {
    debug_assert_eq!(y.len(), x.len());
    dispatch_axpy_f16(best_isa(), y, a, x)
}

/// `x[i] = exp(x[i])`, within 2 ulp of `f32::exp` for results above 1e-37 (smaller results
/// may flush to zero).
pub fn exp_inplace(x: &mut [f32]) {
    dispatch_exp(best_isa(), x)
}

/// `exp` of one value ([`exp_inplace`]'s scalar form, for convenience).
pub fn exp_f32(x: f32) -> f32 {
    x.exp()
}

/// In-place softmax: `x[i] = exp(x[i] - max) / sum`. Entries of `-inf` (masked positions)
/// become 0. An empty slice is left alone; an all `-inf` slice becomes all zeros.
pub fn softmax_inplace(x: &mut [f32]) {
    let isa = best_isa();
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if max == f32::NEG_INFINITY {
        x.fill(0.0);
        return;
    }
    x.iter_mut().for_each(|v| *v -= max);
    dispatch_exp(isa, x);
    let sum: f32 = x.iter().sum();
    if sum > 0.0 {
        let inv = 1.0 / sum;
        x.iter_mut().for_each(|v| *v *= inv);
    }
}

fn check(isa: Isa) -> Result<(), DotError> {
    if isa.available() {
        Ok(())
    } else {
        Err(DotError::IsaUnavailable { isa })
    }
}

/// [`dot_f32`] on the given level.
pub fn dot_f32_isa(isa: Isa, a: &[f32], b: &[f32]) -> Result<f32, DotError> {
    check(isa)?;
    Ok(dispatch_dot_f32(isa, a, b))
}

/// [`dot_f32_f16`] on the given level.
pub fn dot_f32_f16_isa(isa: Isa, a: &[f32], b: &[f16]) -> Result<f32, DotError> {
    check(isa)?;
    Ok(dispatch_dot_f32_f16(isa, a, b))
}

/// [`axpy_f16`] on the given level.
pub fn axpy_f16_isa(isa: Isa, y: &mut [f32], a: f32, x: &[f16]) -> Result<(), DotError> {
    check(isa)?;
    dispatch_axpy_f16(isa, y, a, x);
    Ok(())
}

/// [`exp_inplace`] on the given level (`Scalar` is `f32::exp`).
pub fn exp_inplace_isa(isa: Isa, x: &mut [f32]) -> Result<(), DotError> {
    check(isa)?;
    dispatch_exp(isa, x);
    Ok(())
}

// ---- scalar references ----------------------------------------------------------------------

fn dot_f32_scalar(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn dot_f32_f16_scalar(a: &[f32], b: &[f16]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y.to_f32()).sum()
}

fn axpy_f16_scalar(y: &mut [f32], a: f32, x: &[f16]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x.to_f32());
}

fn exp_scalar(x: &mut [f32]) {
    x.iter_mut().for_each(|v| *v = v.exp());
}

// ---- dispatch -------------------------------------------------------------------------------
// Callers pass an available `isa` (checked by `best_isa` or `check`).

fn dispatch_dot_f32(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    match isa {
        // SAFETY: the level is available; both slices hold `n` elements.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::dot_f32_512(a.as_ptr(), b.as_ptr(), n) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::dot_f32_256(a.as_ptr(), b.as_ptr(), n) },
        // SAFETY: as above.
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { super::neon::dot_f32(a.as_ptr(), b.as_ptr(), n) },
        _ => dot_f32_scalar(a, b),
    }
}

fn dispatch_dot_f32_f16(isa: Isa, a: &[f32], b: &[f16]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    match isa {
        // SAFETY: the level is available; both slices hold `n` elements.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::dot_f32_f16_512(a.as_ptr(), b.as_ptr() as *const u16, n) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::dot_f32_f16_256(a.as_ptr(), b.as_ptr() as *const u16, n) },
        // SAFETY: as above.
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { super::neon::dot_f32_f16(a.as_ptr(), b.as_ptr() as *const u16, n) },
        _ => dot_f32_f16_scalar(a, b),
    }
}

fn dispatch_axpy_f16(isa: Isa, y: &mut [f32], a: f32, x: &[f16]) {
    let n = y.len().min(x.len());
    let (y, x) = (&mut y[..n], &x[..n]);
    match isa {
        // SAFETY: the level is available; both slices hold `n` elements.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::axpy_f16_512(y.as_mut_ptr(), a, x.as_ptr() as *const u16, n) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::axpy_f16_256(y.as_mut_ptr(), a, x.as_ptr() as *const u16, n) },
        // SAFETY: as above.
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe {
            super::neon::axpy_f16(y.as_mut_ptr(), a, x.as_ptr() as *const u16, n)
        },
        _ => axpy_f16_scalar(y, a, x),
    }
}

fn dispatch_exp(isa: Isa, x: &mut [f32]) {
    match isa {
        // SAFETY: the level is available; the pointer covers `x.len()` elements.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::exp_512(x.as_mut_ptr(), x.len()) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::exp_256(x.as_mut_ptr(), x.len()) },
        // SAFETY: as above.
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { arm::exp(x.as_mut_ptr(), x.len()) },
        _ => exp_scalar(x),
    }
}

// The vector `exp`'s constants (the x86 and NEON forms): exp(x) = 2^n * exp(r),
// n = round(x / ln2), |r| <= ln2/2, exp(r) by its degree-7 Taylor polynomial (truncation error
// < 6e-9 relative). ln2 is split in two so n*ln2 is exact enough for |n| <= 128.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
mod exp_consts {
    pub const LOG2E: f32 = std::f32::consts::LOG2_E;
    pub const LN2_HI: f32 = 0.693_145_75;
    pub const LN2_LO: f32 = 1.428_606_8e-6;
    pub const C: [f32; 8] = [
        1.0,
        1.0,
        0.5,
        1.0 / 6.0,
        1.0 / 24.0,
        1.0 / 120.0,
        1.0 / 720.0,
        1.0 / 5040.0,
    ];
    /// Above this exp overflows f32.
    pub const X_MAX: f32 = 88.722_84;
    /// Below this the result would need an exponent under -126: flush to zero.
    pub const X_MIN: f32 = -87.336_54;
}

#[cfg(target_arch = "aarch64")]
pub(crate) mod arm {
    use std::arch::aarch64::*;

    use super::exp_consts::*;

    /// `exp` of four lanes: the x86 form's steps (`exp8`), with NaN kept NaN.
    #[inline(always)]
    fn exp4(x: float32x4_t) -> float32x4_t {
        // SAFETY: plain NEON (baseline on aarch64).
        unsafe {
            let big = vcgtq_f32(x, vdupq_n_f32(X_MAX));
            let tiny = vcltq_f32(x, vdupq_n_f32(X_MIN));
            let xc = vmaxq_f32(vminq_f32(x, vdupq_n_f32(X_MAX)), vdupq_n_f32(X_MIN));
            let n = vrndnq_f32(vmulq_n_f32(xc, LOG2E));
            let r = vfmsq_n_f32(xc, n, LN2_HI);
            let r = vfmsq_n_f32(r, n, LN2_LO);
            let mut p = vdupq_n_f32(C[7]);
            for c in C[..7].iter().rev() {
                p = vfmaq_f32(vdupq_n_f32(*c), p, r);
            }
            // n is in [-126, 128]: 2^n via the exponent field, split in two halves so that
            // n = 128 (only for xc = X_MAX, where p < 1) stays finite.
            let ni = vcvtnq_s32_f32(n);
            let half_n = vshrq_n_s32::<1>(ni);
            let bias = vdupq_n_s32(127);
            let s1 = vreinterpretq_f32_s32(vshlq_n_s32::<23>(vaddq_s32(half_n, bias)));
            let s2 =
                vreinterpretq_f32_s32(vshlq_n_s32::<23>(vaddq_s32(vsubq_s32(ni, half_n), bias)));
            let y = vmulq_f32(vmulq_f32(p, s1), s2);
            let y = vbslq_f32(big, vdupq_n_f32(f32::INFINITY), y);
            vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(y), tiny))
        }
    }

    /// # Safety
    /// `x` valid for `n` reads and writes.
    pub unsafe fn exp(x: *mut f32, n: usize) {
        let mut i = 0;
        // SAFETY: every access is below `n` (the tail goes through a buffer).
        unsafe {
            while i + 4 <= n {
                vst1q_f32(x.add(i), exp4(vld1q_f32(x.add(i))));
                i += 4;
            }
            if i < n {
                let mut buf = [0f32; 4];
                std::ptr::copy_nonoverlapping(x.add(i), buf.as_mut_ptr(), n - i);
                vst1q_f32(buf.as_mut_ptr(), exp4(vld1q_f32(buf.as_ptr())));
                std::ptr::copy_nonoverlapping(buf.as_ptr(), x.add(i), n - i);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    use super::exp_consts::*;

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn exp8(x: __m256) -> __m256 {
        let big = _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(X_MAX));
        let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(X_MIN));
        let xc = _mm256_max_ps(
            _mm256_min_ps(x, _mm256_set1_ps(X_MAX)),
            _mm256_set1_ps(X_MIN),
        );
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(xc, _mm256_set1_ps(LOG2E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), xc);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let mut p = _mm256_set1_ps(C[7]);
        for c in C[..7].iter().rev() {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
        }
        // n is in [-126, 128]: 2^n via the exponent field; n = 128 only for xc = X_MAX, where
        // p < 1 and the product is split to stay finite.
        let ni = _mm256_cvtps_epi32(n);
        let half_n = _mm256_srai_epi32::<1>(ni);
        let s1 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            half_n,
            _mm256_set1_epi32(127),
        )));
        let s2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_sub_epi32(ni, half_n),
            _mm256_set1_epi32(127),
        )));
        let y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
        let y = _mm256_blendv_ps(y, _mm256_set1_ps(f32::INFINITY), big);
        _mm256_andnot_ps(tiny, y)
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    fn exp16(x: __m512) -> __m512 {
        let big = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(X_MAX));
        let tiny = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(X_MIN));
        let xc = _mm512_max_ps(
            _mm512_min_ps(x, _mm512_set1_ps(X_MAX)),
            _mm512_set1_ps(X_MIN),
        );
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), xc);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut p = _mm512_set1_ps(C[7]);
        for c in C[..7].iter().rev() {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
        }
        // scalef computes p * 2^n without building the exponent by hand.
        let y = _mm512_scalef_ps(p, n);
        let y = _mm512_mask_blend_ps(big, y, _mm512_set1_ps(f32::INFINITY));
        _mm512_maskz_mov_ps(!tiny, y)
    }

    /// # Safety
    /// AVX2 and FMA available; `x` valid for `n` reads and writes.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_256(x: *mut f32, n: usize) {
        let mut i = 0;
        // SAFETY: every access is below `n`.
        unsafe {
            while i + 8 <= n {
                _mm256_storeu_ps(x.add(i), exp8(_mm256_loadu_ps(x.add(i))));
                i += 8;
            }
            if i < n {
                let mut buf = [0f32; 8];
                std::ptr::copy_nonoverlapping(x.add(i), buf.as_mut_ptr(), n - i);
                let v = exp8(_mm256_loadu_ps(buf.as_ptr()));
                _mm256_storeu_ps(buf.as_mut_ptr(), v);
                std::ptr::copy_nonoverlapping(buf.as_ptr(), x.add(i), n - i);
            }
        }
    }

    /// # Safety
    /// AVX-512F available; `x` valid for `n` reads and writes.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn exp_512(x: *mut f32, n: usize) {
        let mut i = 0;
        // SAFETY: every access is below `n` (the tail uses masked loads and stores).
        unsafe {
            while i + 16 <= n {
                _mm512_storeu_ps(x.add(i), exp16(_mm512_loadu_ps(x.add(i))));
                i += 16;
            }
            if i < n {
                let m: __mmask16 = (1u32 << (n - i)).wrapping_sub(1) as __mmask16;
                let v = exp16(_mm512_maskz_loadu_ps(m, x.add(i)));
                _mm512_mask_storeu_ps(x.add(i), m, v);
            }
        }
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// # Safety
    /// AVX2 and FMA available; `a`, `b` valid for `n` reads.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f32_256(a: *const f32, b: *const f32, n: usize) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: every access is below `n`.
        unsafe {
            while i + 32 <= n {
                for (k, acc) in acc.iter_mut().enumerate() {
                    let j = i + 8 * k;
                    *acc =
                        _mm256_fmadd_ps(_mm256_loadu_ps(a.add(j)), _mm256_loadu_ps(b.add(j)), *acc);
                }
                i += 32;
            }
            while i + 8 <= n {
                acc[0] =
                    _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)), acc[0]);
                i += 8;
            }
            let mut s = hsum256(_mm256_add_ps(
                _mm256_add_ps(acc[0], acc[1]),
                _mm256_add_ps(acc[2], acc[3]),
            ));
            while i < n {
                s += *a.add(i) * *b.add(i);
                i += 1;
            }
            s
        }
    }

    /// # Safety
    /// AVX-512F available; `a`, `b` valid for `n` reads.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_f32_512(a: *const f32, b: *const f32, n: usize) -> f32 {
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: every access is below `n` (the tail is masked).
        unsafe {
            while i + 64 <= n {
                for (k, acc) in acc.iter_mut().enumerate() {
                    let j = i + 16 * k;
                    *acc =
                        _mm512_fmadd_ps(_mm512_loadu_ps(a.add(j)), _mm512_loadu_ps(b.add(j)), *acc);
                }
                i += 64;
            }
            while i + 16 <= n {
                acc[0] =
                    _mm512_fmadd_ps(_mm512_loadu_ps(a.add(i)), _mm512_loadu_ps(b.add(i)), acc[0]);
                i += 16;
            }
            if i < n {
                let m: __mmask16 = (1u32 << (n - i)).wrapping_sub(1) as __mmask16;
                acc[1] = _mm512_fmadd_ps(
                    _mm512_maskz_loadu_ps(m, a.add(i)),
                    _mm512_maskz_loadu_ps(m, b.add(i)),
                    acc[1],
                );
            }
            _mm512_reduce_add_ps(_mm512_add_ps(
                _mm512_add_ps(acc[0], acc[1]),
                _mm512_add_ps(acc[2], acc[3]),
            ))
        }
    }

    /// # Safety
    /// AVX2, FMA, F16C available; `a`, `b` valid for `n` reads.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f32_f16_256(a: *const f32, b: *const u16, n: usize) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: every access is below `n`.
        unsafe {
            while i + 32 <= n {
                for (k, acc) in acc.iter_mut().enumerate() {
                    let j = i + 8 * k;
                    let h = _mm256_cvtph_ps(_mm_loadu_si128(b.add(j) as *const __m128i));
                    *acc = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(j)), h, *acc);
                }
                i += 32;
            }
            while i + 8 <= n {
                let h = _mm256_cvtph_ps(_mm_loadu_si128(b.add(i) as *const __m128i));
                acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), h, acc[0]);
                i += 8;
            }
            let mut s = hsum256(_mm256_add_ps(
                _mm256_add_ps(acc[0], acc[1]),
                _mm256_add_ps(acc[2], acc[3]),
            ));
            while i < n {
                s += *a.add(i) * _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(*b.add(i) as i32)));
                i += 1;
            }
            s
        }
    }

    /// # Safety
    /// AVX-512F available; `a`, `b` valid for `n` reads.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn dot_f32_f16_512(a: *const f32, b: *const u16, n: usize) -> f32 {
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: every access is below `n` (the tail is masked).
        unsafe {
            while i + 64 <= n {
                for (k, acc) in acc.iter_mut().enumerate() {
                    let j = i + 16 * k;
                    let h = _mm512_cvtph_ps(_mm256_loadu_si256(b.add(j) as *const __m256i));
                    *acc = _mm512_fmadd_ps(_mm512_loadu_ps(a.add(j)), h, *acc);
                }
                i += 64;
            }
            while i + 16 <= n {
                let h = _mm512_cvtph_ps(_mm256_loadu_si256(b.add(i) as *const __m256i));
                acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(a.add(i)), h, acc[0]);
                i += 16;
            }
            if i < n {
                let m: __mmask16 = (1u32 << (n - i)).wrapping_sub(1) as __mmask16;
                let h = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, b.add(i) as *const i16));
                acc[1] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a.add(i)), h, acc[1]);
            }
            _mm512_reduce_add_ps(_mm512_add_ps(
                _mm512_add_ps(acc[0], acc[1]),
                _mm512_add_ps(acc[2], acc[3]),
            ))
        }
    }

    /// # Safety
    /// AVX2, FMA, F16C available; `y`, `x` valid for `n` elements.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_f16_256(y: *mut f32, a: f32, x: *const u16, n: usize) {
        let av = _mm256_set1_ps(a);
        let mut i = 0;
        // SAFETY: every access is below `n`.
        unsafe {
            while i + 8 <= n {
                let h = _mm256_cvtph_ps(_mm_loadu_si128(x.add(i) as *const __m128i));
                _mm256_storeu_ps(y.add(i), _mm256_fmadd_ps(av, h, _mm256_loadu_ps(y.add(i))));
                i += 8;
            }
            while i < n {
                let h = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(*x.add(i) as i32)));
                *y.add(i) += a * h;
                i += 1;
            }
        }
    }

    /// # Safety
    /// AVX-512F/BW available; `y`, `x` valid for `n` elements.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn axpy_f16_512(y: *mut f32, a: f32, x: *const u16, n: usize) {
        let av = _mm512_set1_ps(a);
        let mut i = 0;
        // SAFETY: every access is below `n` (the tail is masked).
        unsafe {
            while i + 16 <= n {
                let h = _mm512_cvtph_ps(_mm256_loadu_si256(x.add(i) as *const __m256i));
                _mm512_storeu_ps(y.add(i), _mm512_fmadd_ps(av, h, _mm512_loadu_ps(y.add(i))));
                i += 16;
            }
            if i < n {
                let m: __mmask16 = (1u32 << (n - i)).wrapping_sub(1) as __mmask16;
                let h = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, x.add(i) as *const i16));
                let v = _mm512_fmadd_ps(av, h, _mm512_maskz_loadu_ps(m, y.add(i)));
                _mm512_mask_storeu_ps(y.add(i), m, v);
            }
        }
    }
}
