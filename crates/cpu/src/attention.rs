//! Attention of one token over its sequence's paged f16 KV cache, for every query head that
//! shares one KV head (a GQA group), in the float order of llama.cpp's CPU backend, so that
//! logits stay bit-identical to llama.cpp's (issue 3) and a sequence decodes to the same
//! tokens alone or batched (`server/tests/batched_exact.rs`).
//!
//! The order per query head (see `quant::dot::ggml` for the primitives):
//! - the query rounded to f16; each score the f16 dot of key and query, times the scale:
//!   [`Order::Vec64`] (a one-token chunk, ggml's `ggml_vec_dot_f16`: four 16-lane
//!   accumulators, `(a0 + a2) + (a1 + a3)`, then `_mm512_reduce_add_ps`'s tree) or
//!   [`Order::Tiny16`] (a token of a longer chunk, llamafile's tinyBLAS: one 16-lane
//!   accumulator, the same tree);
//! - ggml's softmax of the scores;
//! - the weights rounded to f16, each meeting its value row in a fused multiply-add into lane
//!   `j % 64` (`Vec64`) or `j % 16` (`Tiny16`) of position `j`, the lanes reduced at the end
//!   by the same trees, element by element.
//!
//! [`attend_reference`] computes exactly that one position and one head at a time: the scalar
//! reference. The AVX-512 form computes the same operations, but many positions per
//! instruction: a key row is converted from f16 once for all the group's heads, the 16-lane
//! partial sums of 16 positions are reduced together by a transpose-and-add that pairs the
//! lanes exactly as the per-position tree does, and each value row is converted once per
//! group and meets every head's weight. The tests check the two bit for bit.

use half::f16;
use quant::dot::{ggml, Isa};

/// Which of ggml's f16 dot orders a token's attention follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Order {
    /// `ggml_vec_dot_f16`: what llama.cpp's one-token `mul_mat` runs (a decode step).
    Vec64,
    /// llamafile's tinyBLAS f16 kernel: a token of a chunk of several (prefill).
    Tiny16,
}

impl Order {
    /// Accumulator lanes of the `V · p` product (position `j` in lane `j % lanes`).
    fn lanes(self) -> usize {
        match self {
            Order::Vec64 => 64,
            Order::Tiny16 => 16,
        }
    }
}

/// One layer's KV cache as attention reads it: rows of `row` f16 values (every KV head of one
/// position), `block_tokens` rows per block.
pub(crate) struct KvLayer<'a> {
    pub k: &'a [f16],
    pub v: &'a [f16],
    pub row: usize,
    pub block_tokens: usize,
}

/// What one attention call reads: a KV head of a sequence, the first `len` positions.
pub(crate) struct Span<'a> {
    /// The sequence's block table.
    pub blocks: &'a [u32],
    pub kv_head: usize,
    pub head_dim: usize,
    pub len: usize,
    pub scale: f32,
    pub order: Order,
}

/// Per-thread buffers of [`attend`], kept between calls.
#[derive(Default)]
pub(crate) struct AttnScratch {
    /// Element offset of each position's key (and value) row of the KV head.
    offs: Vec<usize>,
    /// Scores, then weights: one row per head.
    scores: Vec<f32>,
    /// Lane accumulators of the reference's `V · p`.
    lanes: Vec<f32>,
}

/// Fill `s.offs` with the element offset of each position of `sp` in the cache; false when
/// the block table or the cache is too short for `sp` (nothing is read then).
fn offsets(kv: &KvLayer<'_>, sp: &Span<'_>, s: &mut AttnScratch) -> bool {
    s.offs.clear();
    let (bt, row) = (kv.block_tokens, kv.row);
    let base = sp.kv_head * sp.head_dim;
    'blocks: for &b in sp.blocks {
        for t in 0..bt {
            if s.offs.len() == sp.len {
                break 'blocks;
            }
            s.offs.push((b as usize * bt + t) * row + base);
        }
    }
    let end = s.offs.iter().max().map_or(0, |&o| o + sp.head_dim);
    s.offs.len() == sp.len && base + sp.head_dim <= row && end <= kv.k.len() && end <= kv.v.len()
}

/// Attention of the query heads `q` (`g` heads of `head_dim`, one after another) that share
/// KV head `sp.kv_head`, over positions `0..sp.len`: `out` (same shape as `q`) gets each head's
/// weighted sum of values. Runs the AVX-512 form where `isa` allows and the shape fits
/// (head size a multiple of 16, of 64 for [`Order::Vec64`], at most 256), else
/// [`attend_reference`]; the two are bit-identical.
pub(crate) fn attend(
    isa: Isa,
    kv: &KvLayer<'_>,
    sp: &Span<'_>,
    q: &[f32],
    out: &mut [f32],
    s: &mut AttnScratch,
) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && x86::attend(kv, sp, q, out, s) {
        return;
    }
    attend_reference(isa, kv, sp, q, out, s);
}

/// `dst[i] = src[i]` rounded to f16 (to nearest, ties to even: `f16::from_f32`), with
/// AVX-512 where `isa` allows.
pub(crate) fn to_f16(isa: Isa, dst: &mut [f16], src: &[f32]) {
    let n = dst.len().min(src.len());
    #[cfg(target_arch = "x86_64")]
    let done = match isa {
        Isa::Avx512 => {
            let body = n & !15;
            // SAFETY: AVX-512 F is available (`Isa::Avx512`); both slices hold `body` values.
            unsafe { x86::to_f16(dst.as_mut_ptr() as *mut u16, src.as_ptr(), body) };
            body
        }
        Isa::Avx2 => {
            let body = n & !7;
            // SAFETY: F16C is part of the AVX2 level; both slices hold `body` values.
            unsafe { x86::to_f16_256(dst.as_mut_ptr() as *mut u16, src.as_ptr(), body) };
            body
        }
        _ => 0,
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = {
        let _ = isa;
        0
    };
    for (d, &v) in dst[done..n].iter_mut().zip(&src[done..n]) {
        *d = f16::from_f32(v);
    }
}

/// The reference: one head and one position at a time, with `quant::dot::ggml`'s primitives
/// on level `isa` (their scalar forms with `Isa::Scalar`).
pub(crate) fn attend_reference(
    isa: Isa,
    kv: &KvLayer<'_>,
    sp: &Span<'_>,
    q: &[f32],
    out: &mut [f32],
    s: &mut AttnScratch,
) {
    let hd = sp.head_dim;
    let ok = offsets(kv, sp, s);
    debug_assert!(ok, "attention span outside the KV cache");
    let AttnScratch {
        offs,
        scores: sc,
        lanes,
    } = s;
    let nl = sp.order.lanes();
    for (qh, oh) in q.chunks_exact(hd).zip(out.chunks_exact_mut(hd)) {
        let qh: Vec<f16> = qh.iter().map(|&v| f16::from_f32(v)).collect();
        sc.clear();
        sc.extend(offs.iter().map(|&o| {
            let kr = &kv.k[o..o + hd];
            let d = match sp.order {
                Order::Vec64 => ggml::dot_f16_vec_isa(isa, kr, &qh),
                Order::Tiny16 => ggml::dot_f16_isa(isa, kr, &qh),
            };
            d * sp.scale
        }));
        ggml::softmax_isa(isa, sc);
        lanes.clear();
        lanes.resize(nl * hd, 0.0);
        for (j, (&p, &o)) in sc.iter().zip(offs.iter()).enumerate() {
            let l = j % nl;
            ggml::fma_f16_row_isa(
                isa,
                &mut lanes[l * hd..(l + 1) * hd],
                f16::from_f32(p).to_f32(),
                &kv.v[o..o + hd],
            );
        }
        match sp.order {
            Order::Vec64 => ggml::reduce_lanes64(lanes, oh),
            Order::Tiny16 => ggml::reduce_lanes(lanes, oh),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{offsets, AttnScratch, KvLayer, Order, Span};
    use quant::dot::{ggml, Isa};

    /// Heads per kernel call: the accumulators of four heads fit the 32 registers.
    const MAX_G: usize = 4;

    /// The AVX-512 form of [`super::attend`]; false (nothing written) when the shape is not
    /// one it handles.
    pub(super) fn attend(
        kv: &KvLayer<'_>,
        sp: &Span<'_>,
        q: &[f32],
        out: &mut [f32],
        s: &mut AttnScratch,
    ) -> bool {
        let hd = sp.head_dim;
        let nc = hd / 16;
        let shape_ok = hd.is_multiple_of(16)
            && match sp.order {
                Order::Vec64 => matches!(nc, 4 | 8 | 16),
                Order::Tiny16 => matches!(nc, 2 | 4 | 8 | 16),
            };
        if !shape_ok
            || hd == 0
            || q.len() != out.len()
            || !q.len().is_multiple_of(hd)
            || sp.len == 0
            || !offsets(kv, sp, s)
        {
            return false;
        }
        let g_all = q.len() / hd;
        let lp = sp.len.div_ceil(16) * 16;
        // Grown, never cleared: the kernel writes every score it reads (all `lp` of a row, the
        // padding included) before reading it, and clearing ~1.5 KB per call cost ~1.5 % of a
        // 64-sequence decode step.
        if s.scores.len() < MAX_G * lp {
            s.scores.resize(MAX_G * lp, 0.0);
        }
        let mut h0 = 0;
        while h0 < g_all {
            let g = (g_all - h0).min(MAX_G);
            let (qg, og) = (&q[h0 * hd..(h0 + g) * hd], &mut out[h0 * hd..(h0 + g) * hd]);
            let a = Args {
                k: kv.k.as_ptr() as *const u16,
                v: kv.v.as_ptr() as *const u16,
                offs: &s.offs,
                scale: sp.scale,
                q: qg,
                out: og,
                scores: &mut s.scores,
            };
            macro_rules! go {
                ($g:literal, $nc:literal) => {
                    // SAFETY: AVX-512 F is available (the caller checked `Isa::Avx512`);
                    // every offset plus the head size lies inside both caches (`offsets`);
                    // q and out hold $g heads of $nc * 16; scores holds MAX_G rows of lp.
                    unsafe {
                        match sp.order {
                            Order::Vec64 => kernel::<$g, $nc, true>(a),
                            Order::Tiny16 => kernel::<$g, $nc, false>(a),
                        }
                    }
                };
            }
            match (g, nc) {
                (1, 2) => go!(1, 2),
                (2, 2) => go!(2, 2),
                (3, 2) => go!(3, 2),
                (4, 2) => go!(4, 2),
                (1, 4) => go!(1, 4),
                (2, 4) => go!(2, 4),
                (3, 4) => go!(3, 4),
                (4, 4) => go!(4, 4),
                (1, 8) => go!(1, 8),
                (2, 8) => go!(2, 8),
                (3, 8) => go!(3, 8),
                (4, 8) => go!(4, 8),
                (1, 16) => go!(1, 16),
                (2, 16) => go!(2, 16),
                (3, 16) => go!(3, 16),
                _ => go!(4, 16),
            }
            h0 += g;
        }
        true
    }

    struct Args<'a> {
        k: *const u16,
        v: *const u16,
        offs: &'a [usize],
        scale: f32,
        q: &'a [f32],
        out: &'a mut [f32],
        scores: &'a mut [f32],
    }

    /// `G` heads of `NC * 16` elements; `V64`: [`Order::Vec64`], else [`Order::Tiny16`].
    ///
    /// # Safety
    /// AVX-512 F available; `k` and `v` valid for reads at `offs[j] .. offs[j] + NC * 16` for
    /// every `j`; `q` and `out` hold `G * NC * 16` values; `scores` holds at least
    /// `G * offs.len().div_ceil(16) * 16`.
    // The loops index several register arrays (heads x chunks, positions) by one counter.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx512f")]
    unsafe fn kernel<const G: usize, const NC: usize, const V64: bool>(a: Args<'_>) {
        let hd = NC * 16;
        let len = a.offs.len();
        let lp = len.div_ceil(16) * 16;
        debug_assert!(a.scores.len() >= G * lp && a.q.len() == G * hd && a.out.len() == G * hd);
        // The queries rounded to f16 (round to nearest even, as `f16::from_f32`).
        let mut qf = [[_mm512_setzero_ps(); NC]; G];
        for (h, qh) in qf.iter_mut().enumerate() {
            for (c, qc) in qh.iter_mut().enumerate() {
                // SAFETY: (h * NC + c) * 16 + 16 <= G * hd = q.len().
                let x = unsafe { _mm512_loadu_ps(a.q.as_ptr().add((h * NC + c) * 16)) };
                *qc = round_f16(x);
            }
        }
        let scale = _mm512_set1_ps(a.scale);
        let sp = a.scores.as_mut_ptr();
        // A batch's KV cache is far larger than the caches (64 sequences of SmolLM2 at 80
        // positions: 118 MB per step), and its rows are strided by the other KV heads, so the
        // loads stalled: each key row is fetched 16 positions ahead, each value row while its
        // key is used.
        for &o in &a.offs[..len.min(16)] {
            // SAFETY: prefetches do not fault; the address lies in the cache (contract).
            unsafe { prefetch_row::<_MM_HINT_T0>(a.k.add(o), hd) };
        }
        // Scores, 16 positions at a time.
        let mut j0 = 0;
        while j0 < len {
            let n = (len - j0).min(16);
            let mut part = [[_mm512_setzero_ps(); 16]; G];
            for jj in 0..n {
                // SAFETY: the key row of position j0 + jj lies inside the cache (contract).
                let kr = unsafe { a.k.add(*a.offs.get_unchecked(j0 + jj)) };
                // SAFETY: as above for the value row; the one 16 ahead is checked.
                unsafe {
                    prefetch_row::<_MM_HINT_T1>(a.v.add(*a.offs.get_unchecked(j0 + jj)), hd);
                    if let Some(&o) = a.offs.get(j0 + jj + 16) {
                        prefetch_row::<_MM_HINT_T0>(a.k.add(o), hd);
                    }
                }
                let mut acc = [[_mm512_setzero_ps(); 4]; G];
                for c in 0..NC {
                    // SAFETY: c * 16 + 16 <= hd, inside the row.
                    let kc = unsafe { load_f16(kr.add(c * 16)) };
                    let slot = if V64 { c % 4 } else { 0 };
                    for h in 0..G {
                        acc[h][slot] = _mm512_fmadd_ps(kc, qf[h][c], acc[h][slot]);
                    }
                }
                for h in 0..G {
                    part[h][jj] = if V64 {
                        _mm512_add_ps(
                            _mm512_add_ps(acc[h][0], acc[h][2]),
                            _mm512_add_ps(acc[h][1], acc[h][3]),
                        )
                    } else {
                        acc[h][0]
                    };
                }
            }
            for (h, ph) in part.iter().enumerate() {
                let r = _mm512_mul_ps(reduce16x16(ph), scale);
                // SAFETY: h * lp + j0 + 16 <= G * lp <= scores.len().
                unsafe { _mm512_storeu_ps(sp.add(h * lp + j0), r) };
            }
            j0 += 16;
        }
        // Softmax per head (ggml's), then the weights rounded to f16.
        for h in 0..G {
            let row = &mut a.scores[h * lp..h * lp + lp];
            ggml::softmax_isa(Isa::Avx512, &mut row[..len]);
            for c in row.chunks_exact_mut(16) {
                // SAFETY: 16 values.
                unsafe {
                    let x = _mm512_loadu_ps(c.as_ptr());
                    _mm512_storeu_ps(c.as_mut_ptr(), round_f16(x));
                }
            }
        }
        let p = a.scores.as_ptr();
        let o = a.out.as_mut_ptr();
        let nl = if V64 { 64 } else { 16 };
        // `V · p`, 16 elements of every head at a time. Lane `l` of an element is the chain of
        // fused multiply-adds over positions l, l + nl, ...: one lane of every head at once.
        // SAFETY (every `lane` call below): the contract of this function is `lane`'s, with
        // c < NC, and p holds G rows of lp >= len values.
        let lane = |c: usize, l: usize| unsafe { lane::<G>(a.v, a.offs, p, lp, c * 16, l, nl) };
        for c in 0..NC {
            // w[h][m]: lane m (Tiny16), or lanes m, 16 + m, 32 + m, 48 + m combined as
            // ggml's GGML_F32x16_REDUCE does (Vec64).
            let mut w = [[_mm512_setzero_ps(); 16]; G];
            for m in 0..16 {
                if V64 {
                    let (l0, l2) = (lane(c, m), lane(c, 32 + m));
                    let (l1, l3) = (lane(c, 16 + m), lane(c, 48 + m));
                    for h in 0..G {
                        w[h][m] =
                            _mm512_add_ps(_mm512_add_ps(l0[h], l2[h]), _mm512_add_ps(l1[h], l3[h]));
                    }
                } else {
                    let l0 = lane(c, m);
                    for h in 0..G {
                        w[h][m] = l0[h];
                    }
                }
            }
            for (h, wh) in w.iter().enumerate() {
                // SAFETY: h * hd + c * 16 + 16 <= G * hd = out.len().
                unsafe { _mm512_storeu_ps(o.add(h * hd + c * 16), reduce_columns(wh)) };
            }
        }
    }

    /// Lane `l` of elements `e .. e + 16` of every head's `V · p`: the fused multiply-adds of
    /// positions `l, l + nl, ...` in order, from zero.
    ///
    /// # Safety
    /// AVX-512 F available; `v` valid for reads at `offs[j] + e .. + 16` for every `j`; `p`
    /// valid for `G` rows of `lp >= offs.len()` values.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn lane<const G: usize>(
        v: *const u16,
        offs: &[usize],
        p: *const f32,
        lp: usize,
        e: usize,
        l: usize,
        nl: usize,
    ) -> [__m512; G] {
        let mut acc = [_mm512_setzero_ps(); G];
        let mut j = l;
        while j < offs.len() {
            // SAFETY: j < offs.len(); the rest is the contract.
            unsafe {
                let vc = load_f16(v.add(*offs.get_unchecked(j) + e));
                for (h, ah) in acc.iter_mut().enumerate() {
                    *ah = _mm512_fmadd_ps(vc, _mm512_set1_ps(*p.add(h * lp + j)), *ah);
                }
            }
            j += nl;
        }
        acc
    }

    /// # Safety
    /// AVX-512 F available; `dst` and `src` valid for `n` values, `n % 16 == 0`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn to_f16(dst: *mut u16, src: *const f32, n: usize) {
        let mut i = 0;
        while i < n {
            // SAFETY: i + 16 <= n (contract), inside both buffers.
            unsafe {
                let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                    _mm512_loadu_ps(src.add(i)),
                );
                _mm256_storeu_si256(dst.add(i) as *mut __m256i, h);
            }
            i += 16;
        }
    }

    /// [`to_f16`] for the AVX2 level (F16C): `n % 8 == 0`.
    ///
    /// # Safety
    /// F16C available; `dst` and `src` valid for `n` values.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn to_f16_256(dst: *mut u16, src: *const f32, n: usize) {
        let mut i = 0;
        while i < n {
            // SAFETY: i + 8 <= n (contract), inside both buffers.
            unsafe {
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(src.add(i)));
                _mm_storeu_si128(dst.add(i) as *mut __m128i, h);
            }
            i += 8;
        }
    }

    /// Ask for the cache lines of `n` f16 values at `p` (prefetches never fault).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn prefetch_row<const HINT: i32>(p: *const u16, n: usize) {
        let p = p as *const i8;
        let mut b = 0;
        while b < 2 * n {
            _mm_prefetch::<HINT>(p.wrapping_add(b));
            b += 64;
        }
        // The last line, when the row is not line-aligned.
        _mm_prefetch::<HINT>(p.wrapping_add(2 * n - 1));
    }

    /// 16 f16 values from `p` as f32.
    ///
    /// # Safety
    /// AVX-512 F available; `p` valid for 16 reads.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load_f16(p: *const u16) -> __m512 {
        // SAFETY: 16 values (contract).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }

    /// Each lane rounded to the nearest f16 (ties to even) and back.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn round_f16(x: __m512) -> __m512 {
        _mm512_cvtph_ps(_mm512_cvtps_ph::<
            { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
        >(x))
    }

    /// `r[j] = reduce16(v[j])` for 16 vectors: `_mm512_reduce_add_ps`'s tree (halves,
    /// quarters, pairs, then the two pair sums) applied to 16 vectors at once, each stage
    /// adding the same two partial sums of a vector as the per-vector tree does (addition is
    /// commutative bit for bit, so only the pairing matters).
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) fn reduce16x16(v: &[__m512; 16]) -> __m512 {
        // Halves: t[i] holds [v[2i][k] + v[2i][8 + k] for k < 8, then the same of v[2i + 1]].
        let mut t = [_mm512_setzero_ps(); 8];
        for (i, ti) in t.iter_mut().enumerate() {
            let (x, y) = (v[2 * i], v[2 * i + 1]);
            let lo = _mm512_shuffle_f32x4::<0x44>(x, y);
            let hi = _mm512_shuffle_f32x4::<0xEE>(x, y);
            *ti = _mm512_add_ps(lo, hi);
        }
        // Quarters: u[i], 128-bit part k: the four quarter sums q0..q3 of vector 4i + k.
        let mut u = [_mm512_setzero_ps(); 4];
        for (i, ui) in u.iter_mut().enumerate() {
            let (x, y) = (t[2 * i], t[2 * i + 1]);
            let lo = _mm512_shuffle_f32x4::<0x88>(x, y);
            let hi = _mm512_shuffle_f32x4::<0xDD>(x, y);
            *ui = _mm512_add_ps(lo, hi);
        }
        // Pairs: w[i], part k: [q0 + q2, q1 + q3] of vector 8i + k, then of 8i + 4 + k.
        let mut w = [_mm512_setzero_ps(); 2];
        for (i, wi) in w.iter_mut().enumerate() {
            let (x, y) = (_mm512_castps_pd(u[2 * i]), _mm512_castps_pd(u[2 * i + 1]));
            let lo = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
            let hi = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
            *wi = _mm512_add_ps(lo, hi);
        }
        // Last: part k holds the sums of vectors k, 4 + k, 8 + k, 12 + k.
        let lo = _mm512_shuffle_ps::<0b10_00_10_00>(w[0], w[1]);
        let hi = _mm512_shuffle_ps::<0b11_01_11_01>(w[0], w[1]);
        let r = _mm512_add_ps(lo, hi);
        // Vector j = 4a + k sits in lane 4k + a.
        let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_ps(idx, r)
    }

    /// Lane by lane, `reduce16` over the 16 vectors: the same tree per lane.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn reduce_columns(v: &[__m512; 16]) -> __m512 {
        let h: [__m512; 8] = std::array::from_fn(|i| _mm512_add_ps(v[8 + i], v[i]));
        let q: [__m512; 4] = std::array::from_fn(|i| _mm512_add_ps(h[4 + i], h[i]));
        _mm512_add_ps(_mm512_add_ps(q[0], q[2]), _mm512_add_ps(q[1], q[3]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            self.0 >> 33
        }
        /// Uniform in [-1, 1).
        fn f(&mut self) -> f32 {
            ((self.next() >> 7) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    fn seed() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    }

    /// The AVX-512 f16 rounding equals `f16::from_f32` on every kind of value: normal,
    /// subnormal and overflowing f16, ties, infinities.
    #[test]
    fn simd_f16_rounding_equals_the_scalar_one() {
        let s = seed();
        let mut r = Rng(s);
        let mut src: Vec<f32> = (0..4099)
            .map(|_| r.f() * (2f32).powi((r.next() % 60) as i32 - 30))
            .collect();
        // Exact ties between two f16 values, and values past the largest f16.
        src.extend([
            1.0 + 1.0 / 2048.0,
            1.0 + 3.0 / 2048.0,
            65504.0,
            65520.0,
            -70000.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -0.0,
            5.96e-8,
            2.98e-8,
        ]);
        let mut want = vec![f16::ZERO; src.len()];
        to_f16(Isa::Scalar, &mut want, &src);
        for isa in [Isa::Avx2, Isa::Avx512, Isa::Neon, best()] {
            if !isa.available() {
                continue;
            }
            let mut got = vec![f16::ONE; src.len()];
            to_f16(isa, &mut got, &src);
            for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{isa:?}: {} (seed {s})", src[i]);
            }
        }
    }

    fn best() -> Isa {
        quant::dot::best_isa()
    }

    /// The transpose-and-add reduction equals `_mm512_reduce_add_ps`'s per-vector tree bit for
    /// bit, on sums whose rounding depends on the pairing (magnitudes over 2^40).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn reduce16x16_pairs_lanes_as_the_per_vector_tree() {
        use std::arch::x86_64::*;
        if !Isa::Avx512.available() {
            return;
        }
        let s = seed();
        let mut r = Rng(s);
        for _ in 0..200 {
            let vals: [[f32; 16]; 16] = std::array::from_fn(|_| {
                std::array::from_fn(|_| r.f() * (2f32).powi((r.next() % 40) as i32))
            });
            let mut got = [0f32; 16];
            // SAFETY: AVX-512 F is available (checked above); 16 floats per load and store.
            unsafe {
                let v: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(vals[i].as_ptr()));
                _mm512_storeu_ps(got.as_mut_ptr(), x86::reduce16x16(&v));
            }
            for (j, g) in got.iter().enumerate() {
                assert_eq!(
                    g.to_bits(),
                    ggml::reduce16(&vals[j]).to_bits(),
                    "vector {j} (seed {s})"
                );
            }
        }
    }

    /// The AVX-512 form (and the NEON level's primitives) equal the scalar reference bit for
    /// bit: both orders, group sizes 1 to 6 (more than one kernel call), head sizes 32 to 256,
    /// lengths around the 16- and 64-position boundaries, blocks out of order.
    #[test]
    fn simd_attention_equals_the_scalar_reference() {
        let levels: Vec<Isa> = [Isa::Avx512, Isa::Neon]
            .into_iter()
            .filter(|i| i.available())
            .collect();
        if levels.is_empty() {
            println!("skipping: neither AVX-512 nor NEON on this CPU");
        }
        for isa in levels {
            attention_equals_the_scalar_reference(isa);
        }
    }

    fn attention_equals_the_scalar_reference(isa: Isa) {
        let s = seed();
        let mut r = Rng(s);
        let bt = 16;
        let n_blocks = 24;
        for (hd, n_kv) in [(64usize, 3usize), (128, 2), (32, 2), (256, 1)] {
            let row = hd * n_kv;
            let k: Vec<f16> = (0..n_blocks * bt * row)
                .map(|_| f16::from_f32(r.f() * 2.0))
                .collect();
            let v: Vec<f16> = (0..n_blocks * bt * row)
                .map(|_| f16::from_f32(r.f() * 3.0))
                .collect();
            let kv = KvLayer {
                k: &k,
                v: &v,
                row,
                block_tokens: bt,
            };
            let mut blocks: Vec<u32> = (0..n_blocks as u32).collect();
            for i in (1..blocks.len()).rev() {
                blocks.swap(i, r.next() as usize % (i + 1));
            }
            for order in [Order::Vec64, Order::Tiny16] {
                for len in [1usize, 7, 16, 17, 40, 63, 64, 65, 129, 200, 384] {
                    for g in [1usize, 3, 4, 6] {
                        let q: Vec<f32> = (0..g * hd).map(|_| r.f() * 2.5).collect();
                        let sp = Span {
                            blocks: &blocks,
                            kv_head: r.next() as usize % n_kv,
                            head_dim: hd,
                            len,
                            scale: 1.0 / (hd as f32).sqrt(),
                            order,
                        };
                        let mut want = vec![0f32; g * hd];
                        let mut got = vec![f32::NAN; g * hd];
                        let mut sc = AttnScratch::default();
                        attend_reference(Isa::Scalar, &kv, &sp, &q, &mut want, &mut sc);
                        attend(isa, &kv, &sp, &q, &mut got, &mut sc);
                        for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                            assert_eq!(
                                a.to_bits(),
                                b.to_bits(),
                                "{isa:?} {order:?} hd {hd} len {len} g {g} element {i}: {a} vs {b} (seed {s})"
                            );
                        }
                    }
                }
            }
        }
    }
}
