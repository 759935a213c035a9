//! AVX-512 (F/BW/VL/VNNI) kernels: multi-row × multi-token tiles on 512-bit registers.
//!
//! A tile keeps `R × T` accumulators in registers. Each weight block is unpacked once and used
//! for `T` tokens; each activation block is loaded once and used for `R` rows.
//!
//! Legacy types (32-element blocks) work on pairs of blocks (64 bytes = one register):
//! `vpdpbusd` multiplies the *unsigned* stored values by the signed activations; types with an
//! offset (`Q4_0`: 8, `Q5_0`: 16, `Q8_0`: 128 after flipping the sign bit) seed the integer
//! accumulator with `-offset * sum(y)` (computed once per token), so the integer result is
//! exactly the signed dot product. Block scales are converted eight at a time.
//!
//! K-quants work per 256-element super-block in four 64-element chunks: `vpmaddubsw` (unsigned
//! values × activations, pairs to i16, no overflow for ≤ 6-bit values) then `vpdpwssd` with the
//! sub-block scales accumulates the scaled sums in i32; the mins (or the value offset of
//! `Q3_K`/`Q6_K`) come from the activation's 16-element sums (`bsums`).

// Tiles index several parallel register arrays (rows × tokens) by the same loop counter; that
// reads better than zipped iterators and unrolls into plain register code.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use gguf::GgmlType;

use super::kernels::{packed16, tile_dispatch, toks_dispatch, Kernel, Tile, TileFn};
use super::SumOrder;

/// Horizontal sum of 16 lanes.
#[target_feature(enable = "avx512f")]
#[inline]
fn hsum(v: __m512) -> f32 {
    _mm512_reduce_add_ps(v)
}

/// # Safety
/// `p` valid for 32 bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn ld256(p: *const u8) -> __m256i {
    // SAFETY: caller's contract.
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// 32 bytes at `p0` then 32 at `p1`.
///
/// # Safety
/// `p0`, `p1` valid for 32 bytes each.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn ld2x256(p0: *const u8, p1: *const u8) -> __m512i {
    // SAFETY: caller's contract.
    unsafe { _mm512_inserti64x4::<1>(_mm512_castsi256_si512(ld256(p0)), ld256(p1)) }
}

// ---- legacy (32-element) types --------------------------------------------------------------

/// What differs between the legacy weight types.
trait Legacy {
    /// Weight block bytes.
    const WB: usize;
    /// Activation block bytes (34 for Q8_0, 36 for Q8_1).
    const AB: usize;
    /// Offset of the quants in the activation block.
    const AQ: usize;
    /// Value offset subtracted from the unsigned stored value (0 for types with a min).
    const OFF: u8;
    /// Whether the type has a min (`x = d q + m`), paired with the activation's `s`.
    const MIN: bool;
    /// Two consecutive blocks' values as 64 unsigned bytes in element order.
    ///
    /// # Safety
    /// `x0`, `x1` point at whole weight blocks; AVX-512 F/BW/VL available.
    unsafe fn unpack(x0: *const u8, x1: *const u8) -> __m512i;
}

/// 16 nibbles at `p0` and 16 at `p1` as 64 bytes: low nibbles then high nibbles of each.
///
/// # Safety
/// `p0`, `p1` valid for 16 bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn nibbles2(p0: *const u8, p1: *const u8) -> __m512i {
    // SAFETY: caller's contract.
    let (a, b) = unsafe {
        (
            _mm256_broadcastsi128_si256(_mm_loadu_si128(p0 as *const __m128i)),
            _mm256_broadcastsi128_si256(_mm_loadu_si128(p1 as *const __m128i)),
        )
    };
    let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b);
    let z = _mm512_srlv_epi64(z, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4));
    _mm512_and_si512(z, _mm512_set1_epi8(0x0f))
}

/// Add 16 to every byte whose bit is set in the two little-endian u32 masks at `h0`, `h1`.
///
/// # Safety
/// `h0`, `h1` valid for 4 bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn add_fifth_bits(q: __m512i, h0: *const u8, h1: *const u8) -> __m512i {
    // SAFETY: caller's contract.
    let (a, b) = unsafe {
        (
            std::ptr::read_unaligned(h0 as *const u32) as u64,
            std::ptr::read_unaligned(h1 as *const u32) as u64,
        )
    };
    _mm512_mask_add_epi8(q, a | (b << 32), q, _mm512_set1_epi8(16))
}

struct Q4_0;
impl Legacy for Q4_0 {
    const WB: usize = 18;
    const AB: usize = 34;
    const AQ: usize = 2;
    const OFF: u8 = 8;
    const MIN: bool = false;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn unpack(x0: *const u8, x1: *const u8) -> __m512i {
        // SAFETY: whole blocks: quants at +2..+18.
        unsafe { nibbles2(x0.add(2), x1.add(2)) }
    }
}

struct Q4_1;
impl Legacy for Q4_1 {
    const WB: usize = 20;
    const AB: usize = 36;
    const AQ: usize = 4;
    const OFF: u8 = 0;
    const MIN: bool = true;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn unpack(x0: *const u8, x1: *const u8) -> __m512i {
        // SAFETY: whole blocks: quants at +4..+20.
        unsafe { nibbles2(x0.add(4), x1.add(4)) }
    }
}

struct Q5_0;
impl Legacy for Q5_0 {
    const WB: usize = 22;
    const AB: usize = 34;
    const AQ: usize = 2;
    const OFF: u8 = 16;
    const MIN: bool = false;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn unpack(x0: *const u8, x1: *const u8) -> __m512i {
        // SAFETY: whole blocks: high bits at +2..+6, quants at +6..+22.
        unsafe { add_fifth_bits(nibbles2(x0.add(6), x1.add(6)), x0.add(2), x1.add(2)) }
    }
}

struct Q5_1;
impl Legacy for Q5_1 {
    const WB: usize = 24;
    const AB: usize = 36;
    const AQ: usize = 4;
    const OFF: u8 = 0;
    const MIN: bool = true;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn unpack(x0: *const u8, x1: *const u8) -> __m512i {
        // SAFETY: whole blocks: high bits at +4..+8, quants at +8..+24.
        unsafe { add_fifth_bits(nibbles2(x0.add(8), x1.add(8)), x0.add(4), x1.add(4)) }
    }
}

struct Q8_0;
impl Legacy for Q8_0 {
    const WB: usize = 34;
    const AB: usize = 34;
    const AQ: usize = 2;
    const OFF: u8 = 128;
    const MIN: bool = false;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn unpack(x0: *const u8, x1: *const u8) -> __m512i {
        // Flipping the sign bit maps signed q to q + 128 as unsigned.
        // SAFETY: whole blocks: quants at +2..+34.
        unsafe { _mm512_xor_si512(ld2x256(x0.add(2), x1.add(2)), _mm512_set1_epi8(-128)) }
    }
}

/// ggml's `hsum_float_8` of the 8 lanes of one half of `v` (`hi`: lanes 8..16).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
fn hsum8_half(v: __m512, hi: bool) -> f32 {
    let h = if hi {
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)))
    } else {
        _mm512_castps512_ps256(v)
    };
    let q = _mm_add_ps(_mm256_extractf128_ps::<1>(h), _mm256_castps256_ps128(h));
    let p = _mm_add_ps(q, _mm_movehl_ps(q, q));
    _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)))
}

/// An `R × T` tile of a legacy type, in the order of operations of ggml's `vec_dot` (and of
/// llamafile's Q8_0 tinyBLAS kernel, which has the same order): per (row, token) eight f32
/// lanes, lane `j` holding the 4-byte group `j` of each block's integer dot; per block
/// `lane = fma(d_w * d_y, isum_j, lane)`; types with a min add `m * s` into a separate scalar
/// by fma; at the end `hsum_float_8(lanes) + summs` (see `scalar::dot_q4_1`). Two
/// (row, token) pairs share one 512-bit register: the two tokens of a row, or for one token
/// two rows.
///
/// Written with plain loops over small arrays (no closures, which would not inherit the
/// target features and so could not inline the intrinsics); LLVM unrolls them and keeps the
/// arrays in registers.
///
/// # Safety
/// The [`Tile`] contract with `R == t.rows`, `T == t.toks`; AVX-512 F/BW/VL/VNNI and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn legacy_tile<L: Legacy, const R: usize, const T: usize>(t: &Tile) {
    let nb = t.nb;
    let mut wrow = [t.w; R];
    for (r, p) in wrow.iter_mut().enumerate() {
        *p = t.w.wrapping_add(r * t.w_stride);
    }
    let mut arow = [t.a; T];
    for (k, p) in arow.iter_mut().enumerate() {
        *p = t.a.wrapping_add(k * t.a_stride);
    }
    let zi = _mm512_setzero_si512();
    let zf = _mm512_setzero_ps();
    // Pair c holds (row, token) combos 2c and 2c + 1 (combo i = (i / T, i % T)); an odd last
    // combo is paired with itself.
    let npairs = (R * T).div_ceil(2);
    let mut acc = [zf; 8];
    let mut summs = [[0f32; T]; R];
    for b in 0..nb {
        // SAFETY: block b exists in every row and token of the tile (b < nb), so every
        // pointer formed below stays inside its row.
        unsafe {
            let mut y = [_mm256_setzero_si256(); T];
            let mut dy = [0f32; T];
            let mut sy = [0f32; T];
            for k in 0..T {
                let y0 = arow[k].add(b * L::AB);
                y[k] = ld256(y0.add(L::AQ));
                dy[k] = f16_at(y0, 0);
                if L::MIN {
                    sy[k] = f16_at(y0, 1);
                }
            }
            for c in 0..npairs {
                let (i0, i1) = (2 * c, (2 * c + 1).min(R * T - 1));
                let (r0, k0, r1, k1) = (i0 / T, i0 % T, i1 / T, i1 % T);
                let x0 = wrow[r0].add(b * L::WB);
                let x1 = wrow[r1].add(b * L::WB);
                let q = L::unpack(x0, x1);
                let yy = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(y[k0]), y[k1]);
                let seed = if L::OFF != 0 {
                    _mm512_sub_epi32(
                        zi,
                        _mm512_dpbusd_epi32(zi, _mm512_set1_epi8(L::OFF as i8), yy),
                    )
                } else {
                    zi
                };
                let i = _mm512_dpbusd_epi32(seed, q, yy);
                let (dw0, dw1) = (f16_at(x0, 0), f16_at(x1, 0));
                let dd = _mm512_mask_blend_ps(
                    0xff00,
                    _mm512_set1_ps(dw0 * dy[k0]),
                    _mm512_set1_ps(dw1 * dy[k1]),
                );
                let slot = &mut acc[c];
                *slot = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(i), *slot);
                if L::MIN {
                    summs[r0][k0] = f16_at(x0, 1).mul_add(sy[k0], summs[r0][k0]);
                    if i1 != i0 {
                        summs[r1][k1] = f16_at(x1, 1).mul_add(sy[k1], summs[r1][k1]);
                    }
                }
            }
        }
    }
    for c in 0..npairs {
        let (i0, i1) = (2 * c, 2 * c + 1);
        for (i, hi) in [(i0, false), (i1, true)] {
            if i >= R * T {
                continue;
            }
            let (r, k) = (i / T, i % T);
            let s = hsum8_half(acc[c], hi) + summs[r][k];
            // SAFETY: output (k, r) is inside the tile.
            unsafe { *t.out.add(k * t.out_stride + r) = s };
        }
    }
}

macro_rules! legacy_kernel {
    ($name:ident, $ty:ty) => {
        /// # Safety
        /// The [`Tile`] contract; AVX-512 available.
        unsafe fn $name(t: &Tile) {
            #[inline(always)]
            unsafe fn f<const R: usize, const T: usize>(t: &Tile) {
                // SAFETY: forwarded; `tile_dispatch` passes R == rows, T == toks.
                unsafe { legacy_tile::<$ty, R, T>(t) }
            }
            // SAFETY: forwarded.
            unsafe { tile_dispatch!(t, f, 4, [1, 2], 4) }
        }
    };
}
legacy_kernel!(t_q4_0, Q4_0);
legacy_kernel!(t_q4_1, Q4_1);
legacy_kernel!(t_q5_0, Q5_0);
legacy_kernel!(t_q5_1, Q5_1);
legacy_kernel!(t_q8_0, Q8_0);

/// Sum the 8 lanes of each half of four vectors (`v[p]`: lanes 0..8 the 8 group sums of one
/// (row, token) pair member, lanes 8..16 of the other), exactly (integer adds): lane `p` of
/// the result is the low half's total of `v[p]`, lane `4 + p` the high half's.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
fn halves_total4(v: &[__m512i; 4]) -> __m256i {
    // Within each 128-bit lane L: a = [v0 (l0+l2), v1 (l0+l2), v0 (l1+l3), v1 (l1+l3)].
    let a = _mm512_add_epi32(
        _mm512_unpacklo_epi32(v[0], v[1]),
        _mm512_unpackhi_epi32(v[0], v[1]),
    );
    let c = _mm512_add_epi32(
        _mm512_unpacklo_epi32(v[2], v[3]),
        _mm512_unpackhi_epi32(v[2], v[3]),
    );
    // e: 128-bit lane L holds the total of lane L of v0, v1, v2, v3.
    let e = _mm512_add_epi32(_mm512_unpacklo_epi64(a, c), _mm512_unpackhi_epi64(a, c));
    // Lanes 0 + 1 (the low half) and 2 + 3 (the high half).
    let lo = _mm512_shuffle_i32x4::<0b10_00_10_00>(e, e);
    let hi = _mm512_shuffle_i32x4::<0b11_01_11_01>(e, e);
    _mm512_castsi512_si256(_mm512_add_epi32(lo, hi))
}

/// An `R × T` tile of a legacy type (GGUF layout) in the whole-block order
/// ([`super::SumOrder::Block`], `scalar::dot_q4_1_block`): the integer work of
/// [`legacy_tile`] (two (row, token) pairs per register, 8 group sums each), then per block the
/// exact totals of up to 8 pairs gathered into one vector ([`halves_total4`]) and one
/// `acc = fma(d_w * d_y, isum, acc)` for all of them; the min terms a scalar fma chain per
/// (row, token); at the end `acc + summs`.
///
/// # Safety
/// The [`Tile`] contract with `R == t.rows`, `T == t.toks`, `R * T <= 8`; AVX-512
/// F/BW/VL/VNNI and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn legacy_tile_block<L: Legacy, const R: usize, const T: usize>(t: &Tile) {
    let nb = t.nb;
    let mut wrow = [t.w; R];
    for (r, p) in wrow.iter_mut().enumerate() {
        *p = t.w.wrapping_add(r * t.w_stride);
    }
    let mut arow = [t.a; T];
    for (k, p) in arow.iter_mut().enumerate() {
        *p = t.a.wrapping_add(k * t.a_stride);
    }
    let zi = _mm512_setzero_si512();
    // Pair c holds (row, token) combos 2c and 2c + 1 (combo i = (i / T, i % T)); an odd last
    // combo is paired with itself. Combo 2c's total lands in lane c, 2c + 1's in lane 4 + c.
    let npairs = (R * T).div_ceil(2);
    let mut acc = _mm256_setzero_ps();
    let mut summs = [[0f32; T]; R];
    for b in 0..nb {
        // SAFETY: block b exists in every row and token of the tile (b < nb), so every
        // pointer formed below stays inside its row.
        unsafe {
            let mut y = [_mm256_setzero_si256(); T];
            let mut dy = [0f32; T];
            let mut sy = [0f32; T];
            for k in 0..T {
                let y0 = arow[k].add(b * L::AB);
                y[k] = ld256(y0.add(L::AQ));
                dy[k] = f16_at(y0, 0);
                if L::MIN {
                    sy[k] = f16_at(y0, 1);
                }
            }
            let mut iv = [zi; 4];
            let mut dd = [0f32; 8];
            for c in 0..npairs {
                let (i0, i1) = (2 * c, (2 * c + 1).min(R * T - 1));
                let (r0, k0, r1, k1) = (i0 / T, i0 % T, i1 / T, i1 % T);
                let x0 = wrow[r0].add(b * L::WB);
                let x1 = wrow[r1].add(b * L::WB);
                let q = L::unpack(x0, x1);
                let yy = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(y[k0]), y[k1]);
                let seed = if L::OFF != 0 {
                    _mm512_sub_epi32(
                        zi,
                        _mm512_dpbusd_epi32(zi, _mm512_set1_epi8(L::OFF as i8), yy),
                    )
                } else {
                    zi
                };
                iv[c] = _mm512_dpbusd_epi32(seed, q, yy);
                dd[c] = f16_at(x0, 0) * dy[k0];
                dd[4 + c] = f16_at(x1, 0) * dy[k1];
                if L::MIN {
                    summs[r0][k0] = f16_at(x0, 1).mul_add(sy[k0], summs[r0][k0]);
                    if i1 != i0 {
                        summs[r1][k1] = f16_at(x1, 1).mul_add(sy[k1], summs[r1][k1]);
                    }
                }
            }
            let isum = _mm256_cvtepi32_ps(halves_total4(&iv));
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(dd.as_ptr()), isum, acc);
        }
    }
    let mut lanes = [0f32; 8];
    // SAFETY: `lanes` holds 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    for i in 0..R * T {
        let (r, k) = (i / T, i % T);
        let lane = if i % 2 == 0 { i / 2 } else { 4 + i / 2 };
        // SAFETY: output (k, r) is inside the tile.
        unsafe { *t.out.add(k * t.out_stride + r) = lanes[lane] + summs[r][k] };
    }
}

macro_rules! legacy_block_kernel {
    ($name:ident, $ty:ty) => {
        /// # Safety
        /// The [`Tile`] contract; AVX-512 available.
        unsafe fn $name(t: &Tile) {
            #[inline(always)]
            unsafe fn f<const R: usize, const T: usize>(t: &Tile) {
                // SAFETY: forwarded; `tile_dispatch` passes R == rows, T == toks (R * T <= 8).
                unsafe { legacy_tile_block::<$ty, R, T>(t) }
            }
            // SAFETY: forwarded.
            unsafe { tile_dispatch!(t, f, 4, [1, 2], 4) }
        }
    };
}
legacy_block_kernel!(b_q4_0, Q4_0);
legacy_block_kernel!(b_q4_1, Q4_1);
legacy_block_kernel!(b_q5_0, Q5_0);
legacy_block_kernel!(b_q5_1, Q5_1);
legacy_block_kernel!(b_q8_0, Q8_0);

// ---- legacy types, many tokens: tokens across the lanes -------------------------------------

/// Tokens per vector of the wide legacy tiles.
pub(crate) const WIDE_LANES: usize = 16;
/// Bytes per (16-token group, block) of the transposed activations ([`wide_acts`]): the 8
/// four-byte groups of the 16 tokens' quants (`[j][t]`, 512 bytes), their `d` (16 f32), their
/// `s` (Q8_1; 16 f32), and minus the sum of each four-byte group (`[j][t]`, 16 i32 each).
pub(crate) const WIDE_BLOCK: usize = 512 + 64 + 64 + 512;

/// Lay out Q8_0/Q8_1 activation rows (`arb` bytes apart, `n_tokens` of them, `nb` blocks each)
/// for the wide legacy tiles: groups of [`WIDE_LANES`] tokens (the last padded with zeros), each
/// group `nb` blocks of [`WIDE_BLOCK`] bytes.
pub(crate) fn wide_acts(
    a: &[u8],
    arb: usize,
    n_tokens: usize,
    nb: usize,
    min: bool,
    out: &mut Vec<Line64>,
) {
    let groups = n_tokens.div_ceil(WIDE_LANES);
    let bytes = groups * nb * WIDE_BLOCK;
    out.clear();
    out.resize(bytes.div_ceil(64), Line64([0; 64]));
    // SAFETY: `out` holds at least `bytes` bytes; `Line64` is plain bytes.
    let o = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, bytes) };
    let (ab, aq) = if min { (36, 4) } else { (34, 2) };
    for t in 0..n_tokens {
        let (g, lane) = (t / WIDE_LANES, t % WIDE_LANES);
        let row = &a[t * arb..t * arb + nb * ab];
        for b in 0..nb {
            let y = &row[b * ab..(b + 1) * ab];
            let ob = &mut o[(g * nb + b) * WIDE_BLOCK..(g * nb + b + 1) * WIDE_BLOCK];
            for j in 0..8 {
                let q = &y[aq + 4 * j..aq + 4 * j + 4];
                ob[64 * j + 4 * lane..64 * j + 4 * lane + 4].copy_from_slice(q);
                let sum: i32 = q.iter().map(|&v| v as i8 as i32).sum();
                let at = 640 + 64 * j + 4 * lane;
                ob[at..at + 4].copy_from_slice(&(-sum).to_le_bytes());
            }
            let d = half::f16::from_le_bytes([y[0], y[1]]).to_f32();
            ob[512 + 4 * lane..512 + 4 * lane + 4].copy_from_slice(&d.to_le_bytes());
            if min {
                let s = half::f16::from_le_bytes([y[2], y[3]]).to_f32();
                ob[576 + 4 * lane..576 + 4 * lane + 4].copy_from_slice(&s.to_le_bytes());
            }
        }
    }
}

/// A tile of one weight row × up to 32 tokens of a legacy type, the tokens in the 16 lanes of
/// one or two vectors (`NV`) over transposed activations ([`wide_acts`]). Per (row, token) the
/// float operations are those of [`legacy_tile`] (and `scalar::dot_q4_1` ...): lane `j`
/// accumulates `fma(d_w * d_y, isum_j, lane_j)` block by block, the min term its own fma chain,
/// then ggml's `hsum_float_8` plus the min sum; here lane `j` of every (row, token) sits in
/// vector `j`, one token per lane, so every step is a plain vector operation. The weight row's
/// four-byte groups are broadcast from a small buffer (a load, no shuffle); offsets
/// (`Q4_0`/`Q5_0`/`Q8_0`) seed each group's integer sum with `-offset * sum(y)`.
///
/// # Safety
/// The [`Tile`] contract with `t.rows == 1`, `t.toks <= 16 * NV`, `t.a` at the first of `NV`
/// consecutive token groups of transposed activations of `t.nb` blocks each.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn wide_tile<L: Legacy, const NV: usize>(t: &Tile) {
    let gstride = t.nb * WIDE_BLOCK;
    let zf = _mm512_setzero_ps();
    let mut acc = [[zf; 8]; NV];
    let mut summs = [zf; NV];
    let mut wq = Line64([0; 64]);
    let shift = _mm_cvtsi32_si128(match L::OFF {
        8 => 3,
        16 => 4,
        128 => 7,
        _ => 0,
    });
    for b in 0..t.nb {
        // SAFETY: block b of the row and of every token group exist by the tile contract.
        unsafe {
            let x = t.w.add(b * L::WB);
            // The block's 32 values as unsigned bytes in element order (the low half of a
            // two-block unpack of the same block).
            let q = _mm512_castsi512_si256(L::unpack(x, x));
            _mm256_store_si256(wq.0.as_mut_ptr() as *mut __m256i, q);
            let dw = _mm512_set1_ps(f16_at(x, 0));
            let mw = if L::MIN {
                _mm512_set1_ps(f16_at(x, 1))
            } else {
                zf
            };
            for v in 0..NV {
                let yb = t.a.add(v * gstride + b * WIDE_BLOCK);
                let dy = _mm512_loadu_ps(yb.add(512) as *const f32);
                let dd = _mm512_mul_ps(dw, dy);
                if L::MIN {
                    let sy = _mm512_loadu_ps(yb.add(576) as *const f32);
                    summs[v] = _mm512_fmadd_ps(mw, sy, summs[v]);
                }
                for j in 0..8 {
                    let w = bcast32(wq.0.as_ptr().add(4 * j));
                    let seed = if L::OFF != 0 {
                        let ns = _mm512_loadu_si512(yb.add(640 + 64 * j) as *const __m512i);
                        _mm512_sll_epi32(ns, shift)
                    } else {
                        _mm512_setzero_si512()
                    };
                    let y = _mm512_loadu_si512(yb.add(64 * j) as *const __m512i);
                    let i = _mm512_dpbusd_epi32(seed, w, y);
                    acc[v][j] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(i), acc[v][j]);
                }
            }
        }
    }
    for v in 0..NV {
        let a = &acc[v];
        let h = [
            _mm512_add_ps(a[4], a[0]),
            _mm512_add_ps(a[5], a[1]),
            _mm512_add_ps(a[6], a[2]),
            _mm512_add_ps(a[7], a[3]),
        ];
        let s = _mm512_add_ps(
            _mm512_add_ps(_mm512_add_ps(h[0], h[2]), _mm512_add_ps(h[1], h[3])),
            summs[v],
        );
        let mut lanes = [0f32; 16];
        // SAFETY: `lanes` holds 16 floats.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), s) };
        let n = t.toks.saturating_sub(v * WIDE_LANES).min(WIDE_LANES);
        for (k, &val) in lanes.iter().enumerate().take(n) {
            // SAFETY: output (16 v + k, 0) is inside the tile (16 v + k < toks).
            unsafe { *t.out.add((v * WIDE_LANES + k) * t.out_stride) = val };
        }
    }
}

/// [`wide_tile`] in the whole-block order ([`super::SumOrder::Block`]): per (row, token) and
/// block, the eight `vpdpbusd` of the block chain into one integer sum (offset types add
/// `-offset * sum(y)` of the whole block), then one `acc = fma(d_w * d_y, isum, acc)`; the min
/// term its own fma chain; at the end `acc + summs` (`scalar::dot_q4_1_block`).
///
/// # Safety
/// As [`wide_tile`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn wide_tile_block<L: Legacy, const NV: usize>(t: &Tile) {
    let gstride = t.nb * WIDE_BLOCK;
    let zf = _mm512_setzero_ps();
    let zi = _mm512_setzero_si512();
    let mut acc = [zf; NV];
    let mut summs = [zf; NV];
    let mut wq = Line64([0; 64]);
    let shift = _mm_cvtsi32_si128(match L::OFF {
        8 => 3,
        16 => 4,
        128 => 7,
        _ => 0,
    });
    for b in 0..t.nb {
        // SAFETY: block b of the row and of every token group exist by the tile contract.
        unsafe {
            let x = t.w.add(b * L::WB);
            let q = _mm512_castsi512_si256(L::unpack(x, x));
            _mm256_store_si256(wq.0.as_mut_ptr() as *mut __m256i, q);
            let dw = _mm512_set1_ps(f16_at(x, 0));
            let mw = if L::MIN {
                _mm512_set1_ps(f16_at(x, 1))
            } else {
                zf
            };
            for v in 0..NV {
                let yb = t.a.add(v * gstride + b * WIDE_BLOCK);
                let dy = _mm512_loadu_ps(yb.add(512) as *const f32);
                let dd = _mm512_mul_ps(dw, dy);
                if L::MIN {
                    let sy = _mm512_loadu_ps(yb.add(576) as *const f32);
                    summs[v] = _mm512_fmadd_ps(mw, sy, summs[v]);
                }
                let mut i = zi;
                let mut ns = zi;
                for j in 0..8 {
                    let w = bcast32(wq.0.as_ptr().add(4 * j));
                    let y = _mm512_loadu_si512(yb.add(64 * j) as *const __m512i);
                    i = _mm512_dpbusd_epi32(i, w, y);
                    if L::OFF != 0 {
                        let n = _mm512_loadu_si512(yb.add(640 + 64 * j) as *const __m512i);
                        ns = _mm512_add_epi32(ns, n);
                    }
                }
                if L::OFF != 0 {
                    i = _mm512_add_epi32(i, _mm512_sll_epi32(ns, shift));
                }
                acc[v] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(i), acc[v]);
            }
        }
    }
    for v in 0..NV {
        let s = _mm512_add_ps(acc[v], summs[v]);
        let mut lanes = [0f32; 16];
        // SAFETY: `lanes` holds 16 floats.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), s) };
        let n = t.toks.saturating_sub(v * WIDE_LANES).min(WIDE_LANES);
        for (k, &val) in lanes.iter().enumerate().take(n) {
            // SAFETY: output (16 v + k, 0) is inside the tile (16 v + k < toks).
            unsafe { *t.out.add((v * WIDE_LANES + k) * t.out_stride) = val };
        }
    }
}

/// The 4 bytes at `p` in every 32-bit lane, as a load-port broadcast (`vpbroadcastd` from
/// memory). Inline assembly because LLVM otherwise rebuilds the broadcast from a register with
/// two shuffles, which crowds the one shuffle port the tile's other work needs.
///
/// # Safety
/// `p` valid for 4 bytes; AVX-512 F available.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn bcast32(p: *const u8) -> __m512i {
    let v: __m512i;
    // SAFETY: reads 4 bytes at `p` (caller's contract); an instruction of an enabled feature.
    unsafe {
        std::arch::asm!(
            "vpbroadcastd {v}, dword ptr [{p}]",
            v = out(zmm_reg) v,
            p = in(reg) p,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    v
}

macro_rules! wide_kernel {
    ($name:ident, $tile:ident, $ty:ty) => {
        /// # Safety
        /// The [`Tile`] contract of [`wide_tile`] (rows run one by one).
        unsafe fn $name(t: &Tile) {
            for r in 0..t.rows {
                let s = t.row(r);
                // SAFETY: forwarded, one row at a time.
                unsafe {
                    if s.toks > WIDE_LANES {
                        $tile::<$ty, 2>(&s)
                    } else {
                        $tile::<$ty, 1>(&s)
                    }
                }
            }
        }
    };
}
wide_kernel!(w_q4_0, wide_tile, Q4_0);
wide_kernel!(w_q4_1, wide_tile, Q4_1);
wide_kernel!(w_q5_0, wide_tile, Q5_0);
wide_kernel!(w_q5_1, wide_tile, Q5_1);
wide_kernel!(w_q8_0, wide_tile, Q8_0);
wide_kernel!(wb_q4_0, wide_tile_block, Q4_0);
wide_kernel!(wb_q4_1, wide_tile_block, Q4_1);
wide_kernel!(wb_q5_0, wide_tile_block, Q5_0);
wide_kernel!(wb_q5_1, wide_tile_block, Q5_1);
wide_kernel!(wb_q8_0, wide_tile_block, Q8_0);

/// The wide kernel of a legacy type (tokens across lanes, over [`wide_acts`]) in summation
/// order `order`, for products of many tokens; `None` for other types.
pub(crate) fn wide_kernel(ty: GgmlType, order: SumOrder) -> Option<Kernel> {
    use GgmlType::*;
    let block = order == SumOrder::Block;
    let tile: TileFn = match ty {
        Q4_0 if block => wb_q4_0,
        Q4_1 if block => wb_q4_1,
        Q5_0 if block => wb_q5_0,
        Q5_1 if block => wb_q5_1,
        Q8_0 if block => wb_q8_0,
        Q4_0 => w_q4_0,
        Q4_1 => w_q4_1,
        Q5_0 => w_q5_0,
        Q5_1 => w_q5_1,
        Q8_0 => w_q8_0,
        _ => return None,
    };
    Some(Kernel {
        mr: 4,
        nt: 2 * WIDE_LANES,
        mr1: 4,
        exact_rows: false,
        tile,
    })
}

// ---- K-quants -------------------------------------------------------------------------------

/// One row's super-block, prepared: scale `d`, min scale `dmin` (types with mins), the 16 i16
/// multipliers of the activation's 16 `bsums` for the correction (mins, or scales for the
/// value offset), and the sub-block scales as i16: scales 0..8 repeated in every 128-bit lane
/// of `sc_lo`, scales 8..16 (types with 16 scales) likewise in `sc_hi`, so that one in-lane
/// byte shuffle places a chunk's scales (see [`chunk_scales`]).
#[derive(Clone, Copy)]
struct Prep {
    d: f32,
    dmin: f32,
    m16: __m256i,
    sc_lo: __m512i,
    sc_hi: __m512i,
}

/// `sc_lo`/`sc_hi` of a [`Prep`] from 16 i16 scales.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
fn lane_scales(sc: __m256i) -> (__m512i, __m512i) {
    (
        _mm512_broadcast_i32x4(_mm256_castsi256_si128(sc)),
        _mm512_broadcast_i32x4(_mm256_extracti128_si256::<1>(sc)),
    )
}

impl Prep {
    // SAFETY: all-zero bits are a valid value of every field (plain floats and vectors).
    const ZERO: Prep = unsafe { std::mem::zeroed() };
}

trait KQuant {
    /// Block bytes.
    const WB: usize;
    /// Types whose stored values carry an offset (`Q3_K`: 4, `Q6_K`: 32) subtract
    /// `2^OFFSET_SHIFT * sum(scale * bsum)` from the integer sum; 0 means the type has mins,
    /// subtracted as `dmin * d_y * sum(min * bsum)` in f32.
    const OFFSET_SHIFT: i32;
    /// # Safety
    /// `x` points at a whole block; AVX-512 F/BW/VL and F16C available.
    unsafe fn prep(x: *const u8) -> Prep;
    /// Chunk `c` (elements 64c..64c+64) as unsigned bytes, and the i16 scale for each of the 32
    /// byte pairs `vpmaddubsw` produces.
    ///
    /// # Safety
    /// As `prep`; `c < 4`.
    unsafe fn chunk(x: *const u8, p: &Prep, c: usize) -> (__m512i, __m512i);
}

/// f16 lane `i` of the 8 bytes at `p`, as f32 (see [`super::avx2::f16x4`] for why 8 bytes).
///
/// # Safety
/// `p` valid for 8 bytes; F16C available.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
#[inline]
unsafe fn f16_at(p: *const u8, i: usize) -> f32 {
    // SAFETY: caller's contract.
    super::avx2::lane(unsafe { super::avx2::f16x4(p) }, i)
}

/// `acc + pairwise(a * b)` (i16 pairs summed into i32 lanes), as one `vpdpwssd`. Written as
/// inline assembly because LLVM otherwise re-associates the accumulation chain into
/// `vpmaddwd` + `vpaddd`, one more micro-op per use in the hottest loop.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
fn dpwssd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
    let mut acc = acc;
    // SAFETY: a register-only instruction of an enabled feature; no memory, stack or flags.
    unsafe {
        std::arch::asm!(
            "vpdpwssd {acc}, {a}, {b}",
            acc = inout(zmm_reg) acc,
            a = in(zmm_reg) a,
            b = in(zmm_reg) b,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    acc
}

/// `vpshufb` controls placing a chunk's scales (elements 64c..64c+64; 128-bit lane j of the
/// 32 i16 pair sums covers elements 64c + 16j .. + 16): `[0][c % 2]` for 16 per-16-element
/// scales (lane j takes scale 4c + j, from the 8 of `sc_lo` or `sc_hi` holding it), `[1][c]` for
/// 8 per-32-element scales (lanes 0-1 take scale 2c, lanes 2-3 scale 2c + 1).
static SCALE_SHUF: [[[u8; 64]; 4]; 2] = {
    let mut t = [[[0u8; 64]; 4]; 2];
    let mut c = 0;
    while c < 4 {
        let mut b = 0;
        while b < 64 {
            let lane = b / 16;
            let i16 = [(4 * c + lane) % 8, 2 * c + lane / 2];
            let mut k = 0;
            while k < 2 {
                t[k][c][b] = (2 * i16[k] + b % 2) as u8;
                k += 1;
            }
            b += 1;
        }
        c += 1;
    }
    t
};

/// The i16 scale of each of chunk `c`'s 32 pair sums, for scales that each cover `per` = 16
/// or 32 elements.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
fn chunk_scales(p: &Prep, c: usize, per: usize) -> __m512i {
    let c = c & 3;
    let (tab, src) = if per == 32 {
        (&SCALE_SHUF[1][c], p.sc_lo)
    } else {
        (&SCALE_SHUF[0][c], if c < 2 { p.sc_lo } else { p.sc_hi })
    };
    // SAFETY: `tab` is 64 readable bytes.
    let ctrl = unsafe { _mm512_loadu_si512(tab.as_ptr() as *const __m512i) };
    _mm512_shuffle_epi8(src, ctrl)
}

/// The low (`hi = false`) or high nibble of every byte.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
fn nib(v: __m512i, hi: bool) -> __m512i {
    let v = if hi { _mm512_srli_epi16::<4>(v) } else { v };
    _mm512_and_si512(v, _mm512_set1_epi8(0x0f))
}

struct Q2K;
impl KQuant for Q2K {
    const WB: usize = 84;
    const OFFSET_SHIFT: i32 = 0;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    #[inline]
    unsafe fn prep(x: *const u8) -> Prep {
        // SAFETY: whole block: scales at 0..16, d at 80, dmin at 82 (read as bytes 76..84).
        unsafe {
            let s = _mm_loadu_si128(x as *const __m128i);
            let sc = _mm256_cvtepu8_epi16(_mm_and_si128(s, _mm_set1_epi8(0x0f)));
            let mn =
                _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(s), _mm_set1_epi8(0x0f)));
            let (sc_lo, sc_hi) = lane_scales(sc);
            Prep {
                d: f16_at(x.add(76), 2),
                dmin: f16_at(x.add(76), 3),
                m16: mn,
                sc_lo,
                sc_hi,
            }
        }
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn chunk(x: *const u8, p: &Prep, c: usize) -> (__m512i, __m512i) {
        // Elements 128h + 32s + l are bits 2s of qs[32h + l]: chunk c = (h, s in {2c', 2c'+1}).
        let (h, s0) = (c / 2, 2 * (c % 2));
        // SAFETY: whole block: quants at 16..80.
        let q = unsafe { _mm512_broadcast_i64x4(ld256(x.add(16 + 32 * h))) };
        let sh = _mm512_mask_set1_epi16(
            _mm512_set1_epi16(2 * s0 as i16),
            0xffff_0000,
            2 * s0 as i16 + 2,
        );
        let q = _mm512_and_si512(_mm512_srlv_epi16(q, sh), _mm512_set1_epi8(3));
        (q, chunk_scales(p, c, 16))
    }
}

struct Q3K;
impl KQuant for Q3K {
    const WB: usize = 110;
    const OFFSET_SHIFT: i32 = 2;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    #[inline]
    unsafe fn prep(x: *const u8) -> Prep {
        // SAFETY: whole block: scales at 96..108 (read as 94..110), d at 108 (read as 102..110).
        unsafe {
            let sc = _mm256_cvtepi8_epi16(q3k_scales(x.add(94)));
            let (sc_lo, sc_hi) = lane_scales(sc);
            Prep {
                d: f16_at(x.add(102), 3),
                dmin: 0.0,
                m16: sc,
                sc_lo,
                sc_hi,
            }
        }
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn chunk(x: *const u8, p: &Prep, c: usize) -> (__m512i, __m512i) {
        // Elements 128h + 32s + l: bits 2s of qs[32h + l] (qs at 32), plus 4 where bit 4h + s
        // of hmask[l] is set (stored value q + 4).
        let (h, s0) = (c / 2, 2 * (c % 2));
        // SAFETY: whole block: hmask at 0..32, quants at 32..96.
        let (q, hm) = unsafe {
            (
                _mm512_broadcast_i64x4(ld256(x.add(32 + 32 * h))),
                _mm512_broadcast_i64x4(ld256(x)),
            )
        };
        let sh = _mm512_mask_set1_epi16(
            _mm512_set1_epi16(2 * s0 as i16),
            0xffff_0000,
            2 * s0 as i16 + 2,
        );
        let q = _mm512_and_si512(_mm512_srlv_epi16(q, sh), _mm512_set1_epi8(3));
        let b = 4 * h + s0;
        let bits = _mm512_mask_set1_epi8(
            _mm512_set1_epi8((1u8 << b) as i8),
            0xffff_ffff_0000_0000,
            (1u8 << (b + 1)) as i8,
        );
        let k = _mm512_test_epi8_mask(hm, bits);
        let q = _mm512_mask_add_epi8(q, k, q, _mm512_set1_epi8(4));
        (q, chunk_scales(p, c, 16))
    }
}

/// The 8 six-bit scales and 8 mins packed in the 12 bytes at `p` (Q4_K/Q5_K), unpacked to
/// bytes `[sc0..sc8, m0..m8]` with shuffles (the scalar form is [`super::scalar::k4_scale_min`]).
///
/// # Safety
/// `p` valid for 16 bytes (the 12 packed bytes and 4 more of the block).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn k4_scales(p: *const u8) -> __m128i {
    // SAFETY: caller's contract.
    let v = unsafe { _mm_loadu_si128(p as *const __m128i) };
    // Lanes 0..4: s[0..4] & 63 (scales 0-3); 8..12: s[4..8] & 63 (mins 0-3);
    // 4..8: (s[8..12] & 15) | (s[0..4] >> 6) << 4 (scales 4-7);
    // 12..16: (s[8..12] >> 4) | (s[4..8] >> 6) << 4 (mins 4-7).
    let a = _mm_shuffle_epi8(
        v,
        _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11),
    );
    let t = _mm_and_si128(
        a,
        _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0),
    );
    let h = _mm_and_si128(
        _mm_srli_epi16::<4>(a),
        _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15),
    );
    let b = _mm_shuffle_epi8(
        v,
        _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7),
    );
    // Bits 6-7 of each byte to bits 4-5 (the bits shifted in from the next byte are masked).
    let u = _mm_and_si128(_mm_srli_epi16::<2>(b), _mm_set1_epi8(0x30));
    _mm_or_si128(_mm_or_si128(t, h), u)
}

/// The 16 signed scales of a Q3_K block (the scalar form is [`super::scalar::q3k_scales`]), from the
/// 16 bytes at `p`: two bytes before the 12 packed scale bytes, then the scales, then `d`.
///
/// # Safety
/// `p` valid for 16 bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn q3k_scales(p: *const u8) -> __m128i {
    // SAFETY: caller's contract.
    let v = unsafe { _mm_loadu_si128(p as *const __m128i) };
    // Low 4 bits: s[0..8] low nibbles for scales 0-7, high nibbles for 8-15.
    let lo = _mm_shuffle_epi8(
        v,
        _mm_setr_epi8(2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5, 6, 7, 8, 9),
    );
    let lo = _mm_mask_blend_epi8(
        0xff00,
        _mm_and_si128(lo, _mm_set1_epi8(0x0f)),
        _mm_and_si128(_mm_srli_epi16::<4>(lo), _mm_set1_epi8(0x0f)),
    );
    // High 2 bits: bits 2g..2g+2 of s[8 + k] for scale 4g + k.
    let hi = _mm_shuffle_epi8(
        v,
        _mm_setr_epi8(
            10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13,
        ),
    );
    let hi = _mm_and_si128(
        _mm_srlv_epi16(hi, _mm_setr_epi16(0, 0, 2, 2, 4, 4, 6, 6)),
        _mm_set1_epi8(3),
    );
    let q = _mm_or_si128(lo, _mm_slli_epi16::<4>(hi));
    _mm_sub_epi8(q, _mm_set1_epi8(32))
}

/// Scales and mins of a Q4_K/Q5_K block, as 16 i16 (scales 0..8, mins 8..16).
///
/// # Safety
/// `x` points at a whole Q4_K/Q5_K block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
#[inline]
unsafe fn k45_prep(x: *const u8) -> Prep {
    // SAFETY: whole block: d at 0, dmin at 2, packed scales at 4..16.
    unsafe {
        let ms = _mm256_cvtepu8_epi16(k4_scales(x.add(4)));
        // Each min covers two bsums: [m0, m0, m1, m1, ...].
        let m16 = _mm256_permutexvar_epi16(
            _mm256_setr_epi16(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15),
            ms,
        );
        Prep {
            d: f16_at(x, 0),
            dmin: f16_at(x, 1),
            m16,
            // Eight scales: only `sc_lo` is read.
            sc_lo: _mm512_broadcast_i32x4(_mm256_castsi256_si128(ms)),
            sc_hi: _mm512_setzero_si512(),
        }
    }
}

/// Q4_K/Q5_K chunk c: 32 bytes of quants hold elements 64c..64c+32 (low nibbles) and
/// 64c+32..64c+64 (high nibbles).
///
/// # Safety
/// `q` points at the block's 128 quant bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn k45_nibbles(q: *const u8, c: usize) -> __m512i {
    // SAFETY: caller's contract; c < 4.
    let v = unsafe { _mm512_broadcast_i64x4(ld256(q.add(32 * c))) };
    let v = _mm512_srlv_epi64(v, _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4));
    nib(v, false)
}

struct Q4K;
impl KQuant for Q4K {
    const WB: usize = 144;
    const OFFSET_SHIFT: i32 = 0;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    #[inline]
    unsafe fn prep(x: *const u8) -> Prep {
        // SAFETY: forwarded.
        unsafe { k45_prep(x) }
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn chunk(x: *const u8, p: &Prep, c: usize) -> (__m512i, __m512i) {
        // SAFETY: whole block: quants at 16..144.
        let q = unsafe { k45_nibbles(x.add(16), c) };
        (q, chunk_scales(p, c, 32))
    }
}

struct Q5K;
impl KQuant for Q5K {
    const WB: usize = 176;
    const OFFSET_SHIFT: i32 = 0;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    #[inline]
    unsafe fn prep(x: *const u8) -> Prep {
        // SAFETY: forwarded.
        unsafe { k45_prep(x) }
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn chunk(x: *const u8, p: &Prep, c: usize) -> (__m512i, __m512i) {
        // SAFETY: whole block: qh at 16..48, quants at 48..176.
        let (q, hb) = unsafe {
            (
                k45_nibbles(x.add(48), c),
                _mm512_broadcast_i64x4(ld256(x.add(16))),
            )
        };
        // Sub-block 2c (low half) takes bit 2c of qh[l], sub-block 2c+1 bit 2c+1.
        let bits = _mm512_mask_set1_epi8(
            _mm512_set1_epi8((1u8 << (2 * c)) as i8),
            0xffff_ffff_0000_0000,
            (1u8 << (2 * c + 1)) as i8,
        );
        let k = _mm512_test_epi8_mask(hb, bits);
        let q = _mm512_mask_add_epi8(q, k, q, _mm512_set1_epi8(16));
        (q, chunk_scales(p, c, 32))
    }
}

struct Q6K;
impl KQuant for Q6K {
    const WB: usize = 210;
    const OFFSET_SHIFT: i32 = 5;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    #[inline]
    unsafe fn prep(x: *const u8) -> Prep {
        // SAFETY: whole block: scales at 192..208, d at 208 (read as bytes 202..210).
        unsafe {
            let sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(x.add(192) as *const __m128i));
            let (sc_lo, sc_hi) = lane_scales(sc);
            Prep {
                d: f16_at(x.add(202), 3),
                dmin: 0.0,
                m16: sc,
                sc_lo,
                sc_hi,
            }
        }
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn chunk(x: *const u8, p: &Prep, c: usize) -> (__m512i, __m512i) {
        // Half h = c / 2 uses ql[64h..64h+64] and qh[32h..32h+32]. Chunk 2h holds elements
        // (s = 0: ql[l] low, s = 1: ql[l + 32] low), chunk 2h + 1 the high nibbles; the two high
        // bits of element (s, l) sit at 2s of qh[l].
        let (h, hi) = (c / 2, c % 2 == 1);
        // SAFETY: whole block: ql at 0..128, qh at 128..192.
        let (l, qh) = unsafe {
            (
                _mm512_loadu_si512(x.add(64 * h) as *const __m512i),
                _mm512_broadcast_i64x4(ld256(x.add(128 + 32 * h))),
            )
        };
        let lo = nib(l, hi);
        let s0 = if hi { 2 } else { 0 };
        let sh = _mm512_mask_set1_epi16(_mm512_set1_epi16(2 * s0), 0xffff_0000, 2 * s0 + 2);
        let hb = _mm512_and_si512(_mm512_srlv_epi16(qh, sh), _mm512_set1_epi8(3));
        let q = _mm512_or_si512(lo, _mm512_slli_epi16::<4>(hb));
        (q, chunk_scales(p, c, 16))
    }
}

/// An `R × T` tile of a K-quant (plain loops, as in [`legacy_tile`]).
///
/// # Safety
/// The [`Tile`] contract with `R == t.rows`, `T == t.toks`; AVX-512 F/BW/VL/VNNI and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn k_tile<K: KQuant, const R: usize, const T: usize, const MODE: u8>(t: &Tile) {
    let mut wrow = [t.w; R];
    for (r, p) in wrow.iter_mut().enumerate() {
        *p = t.w.wrapping_add(r * t.w_stride);
    }
    let mut arow = [t.a; T];
    for (k, p) in arow.iter_mut().enumerate() {
        *p = t.a.wrapping_add(k * t.a_stride);
    }
    let zi = _mm512_setzero_si512();
    // The float side follows llama.cpp's order exactly: exact integer sums, reduced
    // horizontally, then fmas, as its tiled K-quant matmul (MODE_TILED, `scalar::tiled_step`),
    // its repacked Q4_K gemm (MODE_PAIRS, `scalar::dot_q4_k`) or gemv (MODE_BLOCK,
    // `scalar::dot_q4_k_gemv`) combine them. The (row, token) combos of the tile (combo
    // i = r * T + k, at most 8) sit in the lanes of one 256-bit register, so each lane is its own
    // sequential chain, as in the scalar form.
    let mut acc = _mm256_setzero_ps();
    let mut accm = _mm256_setzero_ps();
    for b in 0..t.nb {
        // SAFETY: block b exists in every row and token of the tile.
        unsafe {
            let mut xs = [t.w; R];
            let mut prep = [Prep::ZERO; R];
            for r in 0..R {
                xs[r] = wrow[r].add(b * K::WB);
                prep[r] = K::prep(xs[r]);
            }
            let mut ys = [t.a; T];
            let mut yd = [0f32; T];
            for k in 0..T {
                ys[k] = arow[k].add(b * 292);
                yd[k] = std::ptr::read_unaligned(ys[k] as *const f32);
            }
            let (mut dv, mut mv, mut yv) = ([0f32; 8], [0f32; 8], [0f32; 8]);
            // Per-sub-block min (or offset) sums, 8 i32 lanes per combo.
            let mut ml = [_mm256_setzero_si256(); 8];
            for k in 0..T {
                let bs = ld256(ys[k].add(260));
                for r in 0..R {
                    ml[r * T + k] = _mm256_madd_epi16(prep[r].m16, bs);
                    dv[r * T + k] = prep[r].d;
                    mv[r * T + k] = prep[r].dmin;
                    yv[r * T + k] = yd[k];
                }
            }
            let dv = _mm256_loadu_ps(dv.as_ptr());
            let mv = _mm256_loadu_ps(mv.as_ptr());
            let yv = _mm256_loadu_ps(yv.as_ptr());
            // m_c: per combo, the min sum of chunk c (sub-block lanes 2c and 2c + 1).
            let m_c = chunk_sums(&ml);
            let mut isum = [zi; 8];
            for c in 0..4 {
                let mut y = [zi; T];
                for k in 0..T {
                    y[k] = _mm512_loadu_si512(ys[k].add(4 + 64 * c) as *const __m512i);
                }
                for r in 0..R {
                    let (q, s) = K::chunk(xs[r], &prep[r], c);
                    for k in 0..T {
                        let base = if MODE == MODE_PAIRS {
                            zi
                        } else {
                            isum[r * T + k]
                        };
                        isum[r * T + k] = dpwssd(base, _mm512_maddubs_epi16(q, y[k]), s);
                    }
                }
                if MODE == MODE_PAIRS {
                    let tot = _mm256_cvtepi32_ps(reduce8(&isum));
                    acc = _mm256_fmadd_ps(tot, _mm256_mul_ps(dv, yv), acc);
                    let m = _mm256_cvtepi32_ps(m_c[c]);
                    accm = _mm256_fmadd_ps(m, _mm256_mul_ps(mv, yv), accm);
                }
            }
            if MODE != MODE_PAIRS {
                let mut tot = reduce8(&isum);
                let mt = _mm256_add_epi32(
                    _mm256_add_epi32(m_c[0], m_c[1]),
                    _mm256_add_epi32(m_c[2], m_c[3]),
                );
                if K::OFFSET_SHIFT != 0 {
                    let sh = _mm_cvtsi32_si128(K::OFFSET_SHIFT);
                    tot = _mm256_sub_epi32(tot, _mm256_sll_epi32(mt, sh));
                }
                let tf = _mm256_cvtepi32_ps(tot);
                let mf = _mm256_cvtepi32_ps(mt);
                if MODE == MODE_BLOCK {
                    acc = _mm256_fmadd_ps(tf, _mm256_mul_ps(dv, yv), acc);
                    accm = _mm256_fmadd_ps(mf, _mm256_mul_ps(mv, yv), accm);
                } else {
                    let mut v = _mm256_mul_ps(tf, dv);
                    if K::OFFSET_SHIFT == 0 {
                        v = _mm256_fnmadd_ps(mv, mf, v);
                    }
                    acc = _mm256_fmadd_ps(v, yv, acc);
                }
            }
        }
    }
    let mut res = [0f32; 8];
    // SAFETY: `res` holds 8 floats.
    unsafe { _mm256_storeu_ps(res.as_mut_ptr(), _mm256_sub_ps(acc, accm)) };
    for r in 0..R {
        for k in 0..T {
            // SAFETY: output (k, r) is inside the tile.
            unsafe { *t.out.add(k * t.out_stride + r) = res[r * T + k] };
        }
    }
}

/// Lane `i` of the result: the sum of the 16 i32 lanes of `v[i]` (exact).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
fn reduce8(v: &[__m512i; 8]) -> __m256i {
    let pair = |a: __m512i, b: __m512i| {
        _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b))
    };
    let (t0, t1, t2, t3) = (
        pair(v[0], v[1]),
        pair(v[2], v[3]),
        pair(v[4], v[5]),
        pair(v[6], v[7]),
    );
    // Per 128-bit lane: partial sums of [v0, v1, v2, v3] (u0) and [v4 .. v7] (u1).
    let q = |a: __m512i, b: __m512i| {
        _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b))
    };
    let (u0, u1) = (q(t0, t1), q(t2, t3));
    let z = _mm512_add_epi32(
        _mm512_shuffle_i32x4::<0b10_00_10_00>(u0, u1),
        _mm512_shuffle_i32x4::<0b11_01_11_01>(u0, u1),
    );
    let w = _mm512_add_epi32(
        _mm512_shuffle_i32x4::<0b10_00_10_00>(z, z),
        _mm512_shuffle_i32x4::<0b11_01_11_01>(z, z),
    );
    _mm512_castsi512_si256(w)
}

/// `out[c]` lane `i`: lanes `2c` and `2c + 1` of `ml[i]` summed (the min sums of the two
/// 32-element sub-blocks of 64-element chunk `c`, per combo).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
fn chunk_sums(ml: &[__m256i; 8]) -> [__m256i; 4] {
    // h(a, b) = [a01, a23, b01, b23 | a45, a67, b45, b67]
    let h01 = _mm256_hadd_epi32(ml[0], ml[1]);
    let h23 = _mm256_hadd_epi32(ml[2], ml[3]);
    let h45 = _mm256_hadd_epi32(ml[4], ml[5]);
    let h67 = _mm256_hadd_epi32(ml[6], ml[7]);
    let mut out = [_mm256_setzero_si256(); 4];
    for (c, o) in out.iter_mut().enumerate() {
        let p = ((c / 2) * 4 + c % 2) as i32;
        let idx = _mm256_setr_epi32(p, p + 2, 8 + p, 10 + p, p, p + 2, 8 + p, 10 + p);
        let lo = _mm256_permutex2var_epi32(h01, idx, h23);
        let hi = _mm256_permutex2var_epi32(h45, idx, h67);
        *o = _mm256_blend_epi32::<0xf0>(lo, hi);
    }
    out
}

/// llama.cpp's tiled K-quant matmul order.
const MODE_TILED: u8 = 0;
/// Its repacked Q4_K gemm order (groups of 4 tokens).
const MODE_PAIRS: u8 = 1;
/// Its repacked Q4_K gemv order (the tokens left over from groups of 4).
const MODE_BLOCK: u8 = 2;

macro_rules! k_kernel {
    ($name:ident, $ty:ty, $mode:expr) => {
        /// # Safety
        /// The [`Tile`] contract; AVX-512 available.
        unsafe fn $name(t: &Tile) {
            #[inline(always)]
            unsafe fn f<const R: usize, const T: usize>(t: &Tile) {
                // SAFETY: forwarded; `tile_dispatch` passes R == rows, T == toks.
                unsafe { k_tile::<$ty, R, T, { $mode }>(t) }
            }
            // SAFETY: forwarded.
            unsafe { tile_dispatch!(t, f, 2, [1, 2, 3, 4], 4) }
        }
    };
}
k_kernel!(t_q2_k, Q2K, MODE_TILED);
k_kernel!(t_q3_k, Q3K, MODE_TILED);
k_kernel!(t_q4_k, Q4K, MODE_PAIRS);
k_kernel!(t_q4_k_gemv, Q4K, MODE_BLOCK);
k_kernel!(t_q5_k, Q5K, MODE_TILED);
k_kernel!(t_q6_k, Q6K, MODE_TILED);

/// The kernel for the tokens llama.cpp leaves over from groups of 4 ([`super::kernels::tail_kernel`]).
pub(crate) fn tail_kernel(ty: GgmlType) -> Option<Kernel> {
    match ty {
        GgmlType::Q4K => Some(Kernel {
            mr: 2,
            nt: 4,
            mr1: 4,
            exact_rows: false,
            tile: t_q4_k_gemv,
        }),
        _ => None,
    }
}

// ---- packed Q4_K (16 interleaved rows, see `super::packed`) ---------------------------------

/// A tile of 16 packed `Q4_K` rows × `T` tokens. Lane `r` of every vector belongs to row `r`;
/// per token, `vpdpbusd` of a weight vector (4 elements of each row) with 4 activation bytes
/// broadcast gives the 16 rows' partial sums; a sub-block's sum times its scale (`vpmulld`) is
/// added into the pair's (`PAIRS`) or the block's integer sum, exactly as the scalar references
/// add them. The float side per (row, token) is that of [`super::scalar::dot_q4_k`]
/// (`PAIRS`: one fma per pair of sub-blocks) or [`super::scalar::dot_q4_k_gemv`] (one per
/// super-block), lane by lane.
///
/// # Safety
/// The [`Tile`] contract with `t.rows == 16`, `T == t.toks`, `t.w` at the start of a packed
/// group of `t.nb` super-blocks; AVX-512 F/BW/VL/VNNI and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4k_x16<const T: usize, const PAIRS: bool>(t: &Tile) {
    let mut arow = [t.a; T];
    for (k, p) in arow.iter_mut().enumerate() {
        *p = t.a.wrapping_add(k * t.a_stride);
    }
    let zi = _mm512_setzero_si512();
    let m4 = _mm512_set1_epi8(0x0f);
    let mut acc = [_mm512_setzero_ps(); T];
    let mut accm = [_mm512_setzero_ps(); T];
    // Unpacked scales (bytes 0..128: sub-block j at 16 j, one byte per row) and mins (128..256).
    let mut sm = [Line64([0; 64]); 4];
    for b in 0..t.nb {
        // SAFETY: super-block b of the group (2304 bytes at x) and block b of every token's
        // activation row (292 bytes at ys[k]) exist by the tile contract.
        unsafe {
            let x = t.w.add(b * super::packed::Q4K_GROUP_BYTES);
            if T == 1 {
                prefetch_ahead(x, super::packed::Q4K_GROUP_BYTES);
            }
            let d = _mm512_cvtph_ps(ld256(x));
            let dmin = _mm512_cvtph_ps(ld256(x.add(32)));
            q4k_x16_scales(x, &mut sm);
            let smb = sm.as_ptr() as *const u8;
            let mut ys = [t.a; T];
            let mut dd = [_mm512_setzero_ps(); T];
            let mut dm = [_mm512_setzero_ps(); T];
            // Per token, the activation sums of sub-blocks (2p, 2p + 1) as i16 pairs in the
            // i32 lane p of `sp` (for `vpdpwssd` against the rows' min pairs).
            let mut sp = [[0i32; 8]; T];
            for k in 0..T {
                ys[k] = arow[k].add(b * 292);
                let yd = _mm512_set1_ps(std::ptr::read_unaligned(ys[k] as *const f32));
                dd[k] = _mm512_mul_ps(d, yd);
                dm[k] = _mm512_mul_ps(dmin, yd);
                let s = _mm256_madd_epi16(ld256(ys[k].add(260)), _mm256_set1_epi16(1));
                // Per 128-bit lane: [S0, S1, S2, S3] -> i16 [S0..S3, S0..S3]; lanes 0, 1 of the
                // low half are the pairs (S0, S1), (S2, S3), lanes 4, 5 (S4, S5), (S6, S7).
                let pk = _mm256_packs_epi32(s, s);
                _mm256_storeu_si256(sp[k].as_mut_ptr() as *mut __m256i, pk);
            }
            let mut isb = [zi; T];
            let mut msb = [zi; T];
            for p in 0..4 {
                let mut ip = [zi; T];
                for j in [2 * p, 2 * p + 1] {
                    let mut sj = [zi; T];
                    for q in 0..4 {
                        let v = _mm512_loadu_si512(x.add(256 + 64 * (4 * j + q)) as *const __m512i);
                        let w0 = _mm512_and_si512(v, m4);
                        let w1 = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
                        for k in 0..T {
                            let yq = ys[k].add(4 + 32 * j + 8 * q);
                            sj[k] = dpbusd_bcast2(sj[k], w0, w1, yq);
                        }
                    }
                    let sc =
                        _mm512_cvtepu8_epi32(_mm_loadu_si128(smb.add(16 * j) as *const __m128i));
                    for k in 0..T {
                        ip[k] = _mm512_add_epi32(ip[k], _mm512_mullo_epi32(sj[k], sc));
                    }
                }
                // Lane r: m_{2p} | m_{2p+1} << 16 of row r.
                let ma = _mm_loadu_si128(smb.add(128 + 32 * p) as *const __m128i);
                let mb = _mm_loadu_si128(smb.add(128 + 32 * p + 16) as *const __m128i);
                let mp = _mm512_cvtepu8_epi16(_mm256_set_m128i(
                    _mm_unpackhi_epi8(ma, mb),
                    _mm_unpacklo_epi8(ma, mb),
                ));
                let lane = [0usize, 1, 4, 5][p];
                for k in 0..T {
                    let ms = dpwssd_bcast(zi, mp, sp[k].as_ptr().add(lane) as *const u8);
                    if PAIRS {
                        acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ip[k]), dd[k], acc[k]);
                        accm[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ms), dm[k], accm[k]);
                    } else {
                        isb[k] = _mm512_add_epi32(isb[k], ip[k]);
                        msb[k] = _mm512_add_epi32(msb[k], ms);
                    }
                }
            }
            if !PAIRS {
                for k in 0..T {
                    acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isb[k]), dd[k], acc[k]);
                    accm[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(msb[k]), dm[k], accm[k]);
                }
            }
        }
    }
    for k in 0..T {
        // SAFETY: outputs (k, 0..16) are inside the tile.
        unsafe { _mm512_storeu_ps(t.out.add(k * t.out_stride), _mm512_sub_ps(acc[k], accm[k])) };
    }
}

/// The 6-bit scales and mins of the 16 rows of the packed `Q4_K` group block at `x`, unpacked
/// into `sm`: byte `16 j + r` is row `r`'s scale of sub-block `j`, byte `128 + 16 j + r` its
/// min. The scalar form is `scalar::k4_scale_min` of the 12 scale bytes `s` (bytes k = 0..4,
/// 4..8, 8..12 of the 16 rows in `z0`, `z1`, `z2`): sc_j = s[j] & 63 and m_j = s[j+4] & 63 for
/// j < 4; sc_j = (s[j+4] & 15) | (s[j-4] >> 6) << 4, m_j = (s[j+4] >> 4) | (s[j] >> 6) << 4.
///
/// # Safety
/// `x` at a packed `Q4_K` group block (2304 bytes); AVX-512 F/BW available.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(crate) unsafe fn q4k_x16_scales(x: *const u8, sm: &mut [Line64; 4]) {
    let m4 = _mm512_set1_epi8(0x0f);
    let c63 = _mm512_set1_epi8(63);
    let c30 = _mm512_set1_epi8(0x30);
    // SAFETY: the group block holds the 12 scale vectors' bytes at 64..256 (caller's
    // contract); `sm` holds 4 vectors.
    unsafe {
        let z0 = _mm512_loadu_si512(x.add(64) as *const __m512i);
        let z1 = _mm512_loadu_si512(x.add(128) as *const __m512i);
        let z2 = _mm512_loadu_si512(x.add(192) as *const __m512i);
        let sc_hi = _mm512_or_si512(
            _mm512_and_si512(z2, m4),
            _mm512_and_si512(_mm512_srli_epi16::<2>(z0), c30),
        );
        let m_hi = _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi16::<4>(z2), m4),
            _mm512_and_si512(_mm512_srli_epi16::<2>(z1), c30),
        );
        let smp = sm.as_mut_ptr() as *mut __m512i;
        _mm512_store_si512(smp, _mm512_and_si512(z0, c63));
        _mm512_store_si512(smp.add(1), sc_hi);
        _mm512_store_si512(smp.add(2), _mm512_and_si512(z1, c63));
        _mm512_store_si512(smp.add(3), m_hi);
    }
}

/// `acc + dot4(w0, bcast(p[0..4])) + dot4(w1, bcast(p[4..8]))` per i32 lane (`vpdpbusd`, `w`
/// unsigned, the activation bytes signed), the activation words broadcast from memory. Inline
/// assembly because LLVM otherwise loads each broadcast word through a general register and
/// the stack.
///
/// # Safety
/// `p` valid for 8 bytes; AVX-512 F and VNNI available.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn dpbusd_bcast2(acc: __m512i, w0: __m512i, w1: __m512i, p: *const u8) -> __m512i {
    let mut acc = acc;
    // SAFETY: reads 8 bytes at `p` (caller's contract); an instruction of an enabled feature.
    unsafe {
        std::arch::asm!(
            "vpdpbusd {acc}, {w0}, dword ptr [{p}]{{1to16}}",
            "vpdpbusd {acc}, {w1}, dword ptr [{p} + 4]{{1to16}}",
            acc = inout(zmm_reg) acc,
            w0 = in(zmm_reg) w0,
            w1 = in(zmm_reg) w1,
            p = in(reg) p,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    acc
}

/// `acc + pairwise(a * bcast(p[0..4]))` (i16 pairs, `vpdpwssd`), the word broadcast from memory.
///
/// # Safety
/// `p` valid for 4 bytes; AVX-512 F and VNNI available.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
pub(crate) unsafe fn dpwssd_bcast(acc: __m512i, a: __m512i, p: *const u8) -> __m512i {
    let mut acc = acc;
    // SAFETY: reads 4 bytes at `p` (caller's contract); an instruction of an enabled feature.
    unsafe {
        std::arch::asm!(
            "vpdpwssd {acc}, {a}, dword ptr [{p}]{{1to16}}",
            acc = inout(zmm_reg) acc,
            a = in(zmm_reg) a,
            p = in(reg) p,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    acc
}

/// The legacy types in the packed 16-row layout (`super::packed`): per group block, `d` of the
/// 16 rows (f16) at 0, `m` (types with a min) at 32, then the quants as vectors of 16 rows × 4
/// bytes from `QOFF` on: 4-bit types 4 vectors (vector `k`: low nibbles = group `k`, high =
/// group `k + 4`), `Q8_0` 8 vectors (group `j`, stored `q + 128`).
pub(crate) trait LegacyX16 {
    /// Bytes of one row's block (GGUF).
    const WB: usize;
    /// Activation block bytes (34 for Q8_0, 36 for Q8_1) and offset of its quants.
    const AB: usize;
    const AQ: usize;
    const MIN: bool;
    /// log2 of the value offset subtracted from the stored unsigned value (0: none).
    const OFF_SHIFT: i32;
    /// Offset of the quant vectors in the group block.
    const QOFF: usize;
    /// 8-bit quants (one vector per group) rather than nibbles.
    const Q8: bool;
}
pub(crate) struct X16Q4_0;
impl LegacyX16 for X16Q4_0 {
    const WB: usize = 18;
    const AB: usize = 34;
    const AQ: usize = 2;
    const MIN: bool = false;
    const OFF_SHIFT: i32 = 3;
    const QOFF: usize = 32;
    const Q8: bool = false;
}
pub(crate) struct X16Q4_1;
impl LegacyX16 for X16Q4_1 {
    const WB: usize = 20;
    const AB: usize = 36;
    const AQ: usize = 4;
    const MIN: bool = true;
    const OFF_SHIFT: i32 = 0;
    const QOFF: usize = 64;
    const Q8: bool = false;
}
pub(crate) struct X16Q8_0;
impl LegacyX16 for X16Q8_0 {
    const WB: usize = 34;
    const AB: usize = 34;
    const AQ: usize = 2;
    const MIN: bool = false;
    const OFF_SHIFT: i32 = 7;
    const QOFF: usize = 32;
    const Q8: bool = true;
}

/// A tile of 16 packed rows of a legacy type × `T` tokens, lane `r` = row `r`: per
/// (row, token) the float operations of ggml's `vec_dot` ([`legacy_tile`],
/// `scalar::dot_q4_1` ...): eight accumulators, `j` holding the 4-byte group `j` of every
/// block (`fma(d_w * d_y, isum_j, acc_j)`), the min term its own fma chain, then
/// `hsum_float_8` plus the min sum, all as vectors across the 16 rows.
///
/// # Safety
/// The [`Tile`] contract with `t.rows == 16`, `T == t.toks`, `t.w` at a packed group of `t.nb`
/// blocks; AVX-512 F/BW/VL/VNNI and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn legacy_x16<L: LegacyX16, const T: usize>(t: &Tile) {
    let zf = _mm512_setzero_ps();
    let zi = _mm512_setzero_si512();
    let m4 = _mm512_set1_epi8(0x0f);
    let gb = 16 * L::WB;
    let mut acc = [[zf; 8]; T];
    let mut summs = [zf; T];
    // Per token, minus offset times each group's activation sum (offset types).
    let mut seeds = [[0i32; 8]; T];
    for b in 0..t.nb {
        // SAFETY: group block b and every token's block b exist by the tile contract.
        unsafe {
            let x = t.w.add(b * gb);
            if T == 1 {
                prefetch_ahead(x, gb);
            }
            let dw = _mm512_cvtph_ps(ld256(x));
            let mw = if L::MIN {
                _mm512_cvtph_ps(ld256(x.add(32)))
            } else {
                zf
            };
            let mut ys = [t.a; T];
            let mut dd = [zf; T];
            for k in 0..T {
                ys[k] = t.a.add(k * t.a_stride + b * L::AB);
                let dy = f16_at(ys[k], 0);
                dd[k] = _mm512_mul_ps(dw, _mm512_set1_ps(dy));
                if L::MIN {
                    let sy = _mm512_set1_ps(f16_at(ys[k], 1));
                    summs[k] = _mm512_fmadd_ps(mw, sy, summs[k]);
                }
                if L::OFF_SHIFT != 0 {
                    let yq = ld256(ys[k].add(L::AQ));
                    let sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), yq);
                    let sh = _mm_cvtsi32_si128(L::OFF_SHIFT);
                    let neg = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_sll_epi32(sums, sh));
                    _mm256_storeu_si256(seeds[k].as_mut_ptr() as *mut __m256i, neg);
                }
            }
            let q = x.add(L::QOFF);
            for j in 0..8 {
                let w = if L::Q8 {
                    _mm512_loadu_si512(q.add(64 * j) as *const __m512i)
                } else {
                    let v = _mm512_loadu_si512(q.add(64 * (j % 4)) as *const __m512i);
                    if j < 4 {
                        _mm512_and_si512(v, m4)
                    } else {
                        _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4)
                    }
                };
                for k in 0..T {
                    let seed = if L::OFF_SHIFT != 0 {
                        bcast32(seeds[k].as_ptr().add(j) as *const u8)
                    } else {
                        zi
                    };
                    let yq = ys[k].add(L::AQ + 4 * j);
                    let i = dpbusd_bcast(seed, w, yq);
                    acc[k][j] = _mm512_fmadd_ps(dd[k], _mm512_cvtepi32_ps(i), acc[k][j]);
                }
            }
        }
    }
    for k in 0..T {
        let r = legacy_x16_finish(&acc[k], summs[k]);
        // SAFETY: outputs (k, 0..16) are inside the tile.
        unsafe { _mm512_storeu_ps(t.out.add(k * t.out_stride), r) };
    }
}

/// The end of a 16-row legacy dot product: ggml's `hsum_float_8` of the eight group
/// accumulators, `((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 + a3))`, plus the min sum, lane
/// by lane (shared by [`legacy_x16`] and the AMX kernel so both keep this order).
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn legacy_x16_finish(a: &[__m512; 8], summs: __m512) -> __m512 {
    let h = [
        _mm512_add_ps(a[4], a[0]),
        _mm512_add_ps(a[5], a[1]),
        _mm512_add_ps(a[6], a[2]),
        _mm512_add_ps(a[7], a[3]),
    ];
    _mm512_add_ps(
        _mm512_add_ps(_mm512_add_ps(h[0], h[2]), _mm512_add_ps(h[1], h[3])),
        summs,
    )
}

/// `acc + dot4(w, bcast(p[0..4]))` per i32 lane (`vpdpbusd`, `w` unsigned, the activation
/// bytes signed), the word broadcast from memory (see [`dpbusd_bcast2`]).
///
/// # Safety
/// `p` valid for 4 bytes; AVX-512 F and VNNI available.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn dpbusd_bcast(acc: __m512i, w: __m512i, p: *const u8) -> __m512i {
    let mut acc = acc;
    // SAFETY: reads 4 bytes at `p` (caller's contract); an instruction of an enabled feature.
    unsafe {
        std::arch::asm!(
            "vpdpbusd {acc}, {w}, dword ptr [{p}]{{1to16}}",
            acc = inout(zmm_reg) acc,
            w = in(zmm_reg) w,
            p = in(reg) p,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    acc
}

/// Bytes per block of the activation rows the whole-block packed kernels read ([`block_acts`]):
/// `d` as f32 at 0, the block's extra term at 4, the 32 quants at 8.
pub(crate) const BLOCK_ACT: usize = 40;
/// Offset of the quants in a [`BLOCK_ACT`] block.
pub(crate) const BLOCK_ACT_Q: usize = 8;

/// What [`block_acts`] stores at byte 4 of each block for the packed legacy type `ty`: `None`
/// when `ty` has no whole-block packed kernel; `Some(None)`: the `Q8_1` block's `s` as f32
/// (types with a min); `Some(Some(shift))`: the seed of the block's integer sum,
/// `-(sum(y) << shift)` as i32 (the value offset `2^shift` of the stored weights).
pub(crate) fn block_act_extra(ty: GgmlType) -> Option<Option<u32>> {
    match ty {
        GgmlType::Q4_0 => Some(Some(X16Q4_0::OFF_SHIFT as u32)),
        GgmlType::Q4_1 => Some(None),
        GgmlType::Q8_0 => Some(Some(X16Q8_0::OFF_SHIFT as u32)),
        _ => None,
    }
}

/// Lay out `n_tokens` Q8_0/Q8_1 activation rows (`arb` bytes apart, `nb` blocks each) for the
/// whole-block packed kernels of one weight type: per block [`BLOCK_ACT`] bytes, `d` converted
/// to f32, then `s` as f32 (`extra == None`, types with a min) or the integer seed
/// `-(sum(y) << shift)` (`extra == Some(shift)`), then the 32 quants. Done once per product, it
/// spares the kernels a conversion (and for offset types a sum) per token and block in every
/// 16-row group. Rows are `nb * BLOCK_ACT` bytes apart.
pub(crate) fn block_acts(
    a: &[u8],
    arb: usize,
    n_tokens: usize,
    nb: usize,
    extra: Option<u32>,
    out: &mut Vec<Line64>,
) {
    let bytes = n_tokens * nb * BLOCK_ACT;
    out.clear();
    out.resize(bytes.div_ceil(64), Line64([0; 64]));
    // SAFETY: `out` holds at least `bytes` bytes; `Line64` is plain bytes.
    let o = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, bytes) };
    block_act_rows(a, arb, nb, extra, o);
}

/// Tokens per pool item of [`block_acts_pool`].
const BLOCK_ACT_TOKENS: usize = 8;

/// [`block_acts`] with the tokens spread over `pool` when there are many (the same bytes): on
/// the calling thread alone it was ~1.4 % of the server's samples in the 64-stream load test,
/// the other threads waiting meanwhile.
pub(crate) fn block_acts_pool(
    a: &[u8],
    arb: usize,
    n_tokens: usize,
    nb: usize,
    extra: Option<u32>,
    out: &mut Vec<Line64>,
    pool: &super::Pool,
) {
    if n_tokens < 2 * BLOCK_ACT_TOKENS || pool.n_threads() == 1 {
        return block_acts(a, arb, n_tokens, nb, extra, out);
    }
    let bytes = n_tokens * nb * BLOCK_ACT;
    out.clear();
    out.resize(bytes.div_ceil(64), Line64([0; 64]));
    let rb = nb * BLOCK_ACT;
    let base = out.as_mut_ptr() as usize;
    pool.par_for(n_tokens.div_ceil(BLOCK_ACT_TOKENS), |i| {
        let t0 = i * BLOCK_ACT_TOKENS;
        let t1 = (t0 + BLOCK_ACT_TOKENS).min(n_tokens);
        // SAFETY: `out` holds `bytes` bytes (resized above, not touched again until `par_for`
        // returns); tokens t0..t1's rows (`rb` bytes each) belong to this item alone.
        let o =
            unsafe { std::slice::from_raw_parts_mut((base + t0 * rb) as *mut u8, (t1 - t0) * rb) };
        block_act_rows(&a[t0 * arb..], arb, nb, extra, o);
    });
}

/// The rows of [`block_acts`] for as many tokens as `o` holds rows (`nb * BLOCK_ACT` bytes
/// each), from `a`'s rows `arb` bytes apart.
fn block_act_rows(a: &[u8], arb: usize, nb: usize, extra: Option<u32>, o: &mut [u8]) {
    let (ab, aq) = if extra.is_none() { (36, 4) } else { (34, 2) };
    for (t, ot) in o.chunks_exact_mut(nb * BLOCK_ACT).enumerate() {
        let row = &a[t * arb..t * arb + nb * ab];
        for (y, ob) in row.chunks_exact(ab).zip(ot.chunks_exact_mut(BLOCK_ACT)) {
            let d = half::f16::from_le_bytes([y[0], y[1]]).to_f32();
            ob[0..4].copy_from_slice(&d.to_le_bytes());
            let q = &y[aq..aq + 32];
            match extra {
                None => {
                    let s = half::f16::from_le_bytes([y[2], y[3]]).to_f32();
                    ob[4..8].copy_from_slice(&s.to_le_bytes());
                }
                Some(shift) => {
                    let sum: i32 = q.iter().map(|&v| v as i8 as i32).sum();
                    ob[4..8].copy_from_slice(&(-(sum << shift)).to_le_bytes());
                }
            }
            ob[BLOCK_ACT_Q..BLOCK_ACT].copy_from_slice(q);
        }
    }
}

/// [`legacy_x16`] in the whole-block order ([`super::SumOrder::Block`]): with the 16 rows in
/// the lanes, the eight `vpdpbusd` of a block chain into one integer accumulator per token
/// (seeded with `-offset * sum(y)` of the whole block for offset types), then one conversion
/// and one `acc = fma(d_w * d_y, isum, acc)` per block for the 16 rows; the min term its own
/// fma chain; at the end `acc + summs` (`scalar::dot_q4_1_block`, lane by lane).
///
/// The activations are the rows of [`block_acts`] (`d`, `s` or the seed ready per block).
///
/// # Safety
/// As [`legacy_x16`], with `t.a` at rows of [`block_acts`] made for this type.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn legacy_x16_block<L: LegacyX16, const T: usize>(t: &Tile) {
    let zf = _mm512_setzero_ps();
    let zi = _mm512_setzero_si512();
    let m4 = _mm512_set1_epi8(0x0f);
    let gb = 16 * L::WB;
    let mut acc = [zf; T];
    let mut summs = [zf; T];
    for b in 0..t.nb {
        // SAFETY: group block b and every token's block b exist by the tile contract.
        unsafe {
            let x = t.w.add(b * gb);
            if T == 1 {
                prefetch_ahead(x, gb);
            }
            let dw = _mm512_cvtph_ps(ld256(x));
            let mw = if L::MIN {
                _mm512_cvtph_ps(ld256(x.add(32)))
            } else {
                zf
            };
            let mut ys = [t.a; T];
            let mut dd = [zf; T];
            let mut isum = [zi; T];
            for k in 0..T {
                ys[k] = t.a.add(k * t.a_stride + b * BLOCK_ACT);
                let dy = _mm512_set1_ps(std::ptr::read_unaligned(ys[k] as *const f32));
                dd[k] = _mm512_mul_ps(dw, dy);
                if L::MIN {
                    let sy = _mm512_set1_ps(std::ptr::read_unaligned(ys[k].add(4) as *const f32));
                    summs[k] = _mm512_fmadd_ps(mw, sy, summs[k]);
                }
                if L::OFF_SHIFT != 0 {
                    isum[k] =
                        _mm512_set1_epi32(std::ptr::read_unaligned(ys[k].add(4) as *const i32));
                }
            }
            let q = x.add(L::QOFF);
            for j in 0..8 {
                let w = if L::Q8 {
                    _mm512_loadu_si512(q.add(64 * j) as *const __m512i)
                } else {
                    let v = _mm512_loadu_si512(q.add(64 * (j % 4)) as *const __m512i);
                    if j < 4 {
                        _mm512_and_si512(v, m4)
                    } else {
                        _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4)
                    }
                };
                for k in 0..T {
                    isum[k] = dpbusd_bcast(isum[k], w, ys[k].add(BLOCK_ACT_Q + 4 * j));
                }
            }
            for k in 0..T {
                acc[k] = _mm512_fmadd_ps(dd[k], _mm512_cvtepi32_ps(isum[k]), acc[k]);
            }
        }
    }
    for k in 0..T {
        let r = _mm512_add_ps(acc[k], summs[k]);
        // SAFETY: outputs (k, 0..16) are inside the tile.
        unsafe { _mm512_storeu_ps(t.out.add(k * t.out_stride), r) };
    }
}

macro_rules! legacy_x16_kernel {
    ($name:ident, $ty:ty) => {
        /// # Safety
        /// The [`Tile`] contract of [`legacy_x16`].
        unsafe fn $name(t: &Tile) {
            // SAFETY: forwarded; the plan hands packed kernels whole 16-row groups only.
            unsafe { toks_dispatch!(t, [1, 2], |T| legacy_x16::<$ty, T>(t)) }
        }
    };
}
legacy_x16_kernel!(x16_q4_0, X16Q4_0);
legacy_x16_kernel!(x16_q4_1, X16Q4_1);
legacy_x16_kernel!(x16_q8_0, X16Q8_0);

/// Tokens per tile of the whole-block packed kernel: with one accumulator per token (not
/// eight), four tokens fit the registers and share each unpacked weight vector.
const X16_BLOCK_NT: usize = 4;

macro_rules! legacy_x16_block_kernel {
    ($name:ident, $ty:ty) => {
        /// # Safety
        /// The [`Tile`] contract of [`legacy_x16_block`].
        unsafe fn $name(t: &Tile) {
            // SAFETY: forwarded; the plan hands packed kernels whole 16-row groups only.
            unsafe { toks_dispatch!(t, [1, 2, 3, 4], |T| legacy_x16_block::<$ty, T>(t)) }
        }
    };
}
legacy_x16_block_kernel!(x16b_q4_0, X16Q4_0);
legacy_x16_block_kernel!(x16b_q4_1, X16Q4_1);
legacy_x16_block_kernel!(x16b_q8_0, X16Q8_0);

/// The packed kernel of a legacy type in summation order `order` (every token count: up to 2
/// tokens per tile in ggml's order, up to [`X16_BLOCK_NT`] in the whole-block order).
pub(crate) fn packed_legacy_kernel(ty: GgmlType, order: SumOrder) -> Option<Kernel> {
    let (tile, nt): (TileFn, usize) = match (ty, order) {
        (GgmlType::Q4_0, SumOrder::Ggml) => (x16_q4_0, 2),
        (GgmlType::Q4_1, SumOrder::Ggml) => (x16_q4_1, 2),
        (GgmlType::Q8_0, SumOrder::Ggml) => (x16_q8_0, 2),
        (GgmlType::Q4_0, SumOrder::Block) => (x16b_q4_0, X16_BLOCK_NT),
        (GgmlType::Q4_1, SumOrder::Block) => (x16b_q4_1, X16_BLOCK_NT),
        (GgmlType::Q8_0, SumOrder::Block) => (x16b_q8_0, X16_BLOCK_NT),
        _ => return None,
    };
    Some(packed16(tile, nt))
}

/// 64 bytes, aligned (scratch for unpacked scales).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Line64(pub [u8; 64]);

macro_rules! packed_kernel {
    ($name:ident, $pairs:expr) => {
        /// # Safety
        /// The [`Tile`] contract of [`q4k_x16`].
        unsafe fn $name(t: &Tile) {
            // SAFETY: forwarded; the plan hands packed kernels whole 16-row groups only.
            unsafe { toks_dispatch!(t, [1, 2, 3, 4], |T| q4k_x16::<T, { $pairs }>(t)) }
        }
    };
}
packed_kernel!(t_q4k_x16, true);
packed_kernel!(t_q4k_x16_gemv, false);

/// The packed `Q4_K` kernels: groups of 4 tokens (llama.cpp's gemm order) and the tokens left
/// over (its gemv order). Rows come in whole groups of 16.
pub(crate) fn packed_q4k_kernels() -> (Kernel, Kernel) {
    (packed16(t_q4k_x16, 4), packed16(t_q4k_x16_gemv, 4))
}

// ---- packed Q6_K (16 interleaved rows, see `super::packed`) ---------------------------------

/// A tile of 16 packed `Q6_K` rows × `T` tokens, lane `r` = row `r`. Per sub-block `j` and
/// token, the integer sum starts at `-32 * bsum_j` (the value offset, from the activation's
/// 16-element sums), `vpdpbusd` adds the unsigned 6-bit values times the activation bytes
/// (4 broadcast at a time), and the sum times the row's scale (`vpmulld`) goes into the
/// super-block's sum: exactly the scalar reference's integer. The float side per
/// (row, token) is [`super::scalar::dot_q6_k`]'s: `r = isum * d`, `acc = fma(r, d_y, acc)`
/// per super-block, lane by lane.
///
/// # Safety
/// The [`Tile`] contract with `t.rows == 16`, `T == t.toks`, `t.w` at the start of a packed
/// group of `t.nb` super-blocks; AVX-512 F/BW/VL/VNNI and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q6k_x16<const T: usize>(t: &Tile) {
    let zi = _mm512_setzero_si512();
    let m4 = _mm512_set1_epi8(0x0f);
    let m30 = _mm512_set1_epi8(0x30);
    let mut acc = [_mm512_setzero_ps(); T];
    // Per token, -32 times the activation sum of each of the 16 sub-blocks.
    let mut seeds = [[0i32; 16]; T];
    for b in 0..t.nb {
        // SAFETY: super-block b of the group (3360 bytes at x) and block b of every token's
        // activation row (292 bytes at ys[k]) exist by the tile contract.
        unsafe {
            let x = t.w.add(b * super::packed::Q6K_GROUP_BYTES);
            if T == 1 {
                prefetch_ahead(x, super::packed::Q6K_GROUP_BYTES);
            }
            let d = _mm512_cvtph_ps(ld256(x));
            let mut ys = [t.a; T];
            let mut dy = [_mm512_setzero_ps(); T];
            for k in 0..T {
                ys[k] = t.a.add(k * t.a_stride + b * 292);
                dy[k] = _mm512_set1_ps(std::ptr::read_unaligned(ys[k] as *const f32));
                let bs = _mm512_cvtepi16_epi32(ld256(ys[k].add(260)));
                let neg = _mm512_sub_epi32(zi, _mm512_slli_epi32::<5>(bs));
                _mm512_storeu_si512(seeds[k].as_mut_ptr() as *mut __m512i, neg);
            }
            let mut isum = [zi; T];
            for j in 0..16 {
                let sc =
                    _mm512_cvtepi8_epi32(_mm_loadu_si128(x.add(32 + 16 * j) as *const __m128i));
                let q = x.add(288 + 192 * j);
                let l0 = _mm512_loadu_si512(q as *const __m512i);
                let l1 = _mm512_loadu_si512(q.add(64) as *const __m512i);
                let hb = _mm512_loadu_si512(q.add(128) as *const __m512i);
                // Quarter k: low 4 bits from l0/l1 (low or high nibble), top 2 bits moved
                // from bits 2k of `hb` to bits 4..6 (16-bit shifts: the masked bits never
                // cross a byte).
                let w0 = _mm512_or_si512(
                    _mm512_and_si512(l0, m4),
                    _mm512_and_si512(_mm512_slli_epi16::<4>(hb), m30),
                );
                let w1 = _mm512_or_si512(
                    _mm512_and_si512(l1, m4),
                    _mm512_and_si512(_mm512_slli_epi16::<2>(hb), m30),
                );
                let w2 = _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(l0), m4),
                    _mm512_and_si512(hb, m30),
                );
                let w3 = _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(l1), m4),
                    _mm512_and_si512(_mm512_srli_epi16::<2>(hb), m30),
                );
                for k in 0..T {
                    let s = bcast32(seeds[k].as_ptr().add(j) as *const u8);
                    let yq = ys[k].add(4 + 16 * j);
                    let s = dpbusd_bcast2(s, w0, w1, yq);
                    let s = dpbusd_bcast2(s, w2, w3, yq.add(8));
                    isum[k] = _mm512_add_epi32(isum[k], _mm512_mullo_epi32(s, sc));
                }
            }
            for k in 0..T {
                let r = _mm512_mul_ps(_mm512_cvtepi32_ps(isum[k]), d);
                acc[k] = _mm512_fmadd_ps(r, dy[k], acc[k]);
            }
        }
    }
    for k in 0..T {
        // SAFETY: outputs (k, 0..16) are inside the tile.
        unsafe { _mm512_storeu_ps(t.out.add(k * t.out_stride), acc[k]) };
    }
}

/// # Safety
/// The [`Tile`] contract of [`q6k_x16`].
unsafe fn t_q6k_x16(t: &Tile) {
    // SAFETY: forwarded; the plan hands packed kernels whole 16-row groups only.
    unsafe { toks_dispatch!(t, [1, 2, 3, 4], |T| q6k_x16::<T>(t)) }
}

/// How far ahead of the group block being read a one-token product prefetches its weights.
/// A decode step streams every weight once, with little work per byte: the hardware
/// prefetchers alone left the packed one-token kernels at 9-10 GB/s on one core where a plain
/// read streams 16.5 (`examples/membw.rs`); prefetching 4 KiB ahead took them to 12-15 GB/s,
/// and two threads from 17-21 to 22-27 GB/s (`examples/packed_speed.rs`, 8192 x 2048, Q6_K,
/// Q4_K, Q8_0, Q4_1; 8 KiB measured the same or a little worse).
const PREFETCH_AHEAD: usize = 4096;

/// Ask for the `bytes` bytes [`PREFETCH_AHEAD`] past `x` (the packed group block being read)
/// to be brought into cache.
#[target_feature(enable = "avx512f")]
#[inline]
fn prefetch_ahead(x: *const u8, bytes: usize) {
    let p = x.wrapping_add(PREFETCH_AHEAD);
    let mut o = 0;
    while o < bytes {
        // A prefetch is a hint: it never faults, whatever the address (past the matrix's end
        // included).
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(o) as *const i8);
        o += 64;
    }
}

/// The packed `Q6_K` kernel (every token count; llama.cpp's tiled order per super-block).
/// Rows come in whole groups of 16.
pub(crate) fn packed_q6k_kernel() -> Kernel {
    packed16(t_q6k_x16, 4)
}

// ---- float weights (f32 activations) --------------------------------------------------------

/// How a float weight type's elements become f32.
trait FloatW {
    /// Bytes per element.
    const ES: usize;
    /// 16 elements at `p` (only the lanes in `m` are read; the others are 0).
    ///
    /// # Safety
    /// The masked lanes of `p` readable; AVX-512 F/BW available.
    unsafe fn load16(p: *const u8, m: __mmask16) -> __m512;
}

struct F32W;
impl FloatW for F32W {
    const ES: usize = 4;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn load16(p: *const u8, m: __mmask16) -> __m512 {
        // SAFETY: caller's contract.
        unsafe { _mm512_maskz_loadu_ps(m, p as *const f32) }
    }
}

struct F16W;
impl FloatW for F16W {
    const ES: usize = 2;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn load16(p: *const u8, m: __mmask16) -> __m512 {
        // SAFETY: caller's contract.
        _mm512_cvtph_ps(unsafe { _mm256_maskz_loadu_epi16(m, p as *const i16) })
    }
}

struct Bf16W;
impl FloatW for Bf16W {
    const ES: usize = 2;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn load16(p: *const u8, m: __mmask16) -> __m512 {
        // bf16 is the top half of an f32.
        // SAFETY: caller's contract.
        let h = unsafe { _mm256_maskz_loadu_epi16(m, p as *const i16) };
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }
}

/// An `R × T` tile of a float weight type against f32 activations (`t.nb` is the element
/// count).
///
/// # Safety
/// The [`Tile`] contract with `R == t.rows`, `T == t.toks`; AVX-512 F/BW/VL.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn float_tile<F: FloatW, const R: usize, const T: usize>(t: &Tile) {
    let n = t.nb;
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let mut i = 0;
    while i < n {
        let m: __mmask16 = if n - i >= 16 {
            0xffff
        } else {
            ((1u32 << (n - i)) - 1) as u16
        };
        // SAFETY: elements i..i+16 (masked to below n) exist in every row and token.
        unsafe {
            let mut x = [_mm512_setzero_ps(); T];
            for k in 0..T {
                x[k] = _mm512_maskz_loadu_ps(m, (t.a.add(k * t.a_stride) as *const f32).add(i));
            }
            for r in 0..R {
                let w = F::load16(t.w.add(r * t.w_stride + i * F::ES), m);
                for k in 0..T {
                    acc[r][k] = _mm512_fmadd_ps(w, x[k], acc[r][k]);
                }
            }
        }
        i += 16;
    }
    for r in 0..R {
        for k in 0..T {
            // SAFETY: output (k, r) is inside the tile.
            unsafe { *t.out.add(k * t.out_stride + r) = hsum(acc[r][k]) };
        }
    }
}

macro_rules! float_kernel {
    ($name:ident, $ty:ty) => {
        /// # Safety
        /// The [`Tile`] contract; AVX-512 available.
        unsafe fn $name(t: &Tile) {
            #[inline(always)]
            unsafe fn f<const R: usize, const T: usize>(t: &Tile) {
                // SAFETY: forwarded; `tile_dispatch` passes R == rows, T == toks.
                unsafe { float_tile::<$ty, R, T>(t) }
            }
            // SAFETY: forwarded.
            unsafe { tile_dispatch!(t, f, 2, [1, 2, 3, 4], 4) }
        }
    };
}
float_kernel!(t_f32, F32W);
float_kernel!(t_f16, F16W);
float_kernel!(t_bf16, Bf16W);

/// The AVX-512 kernel for `ty` in summation order `order`.
pub(crate) fn kernel(ty: GgmlType, order: SumOrder) -> Option<Kernel> {
    use GgmlType::*;
    let block = order == SumOrder::Block;
    // (tile, rows × tokens per prefill tile, rows per decode tile): sized so the accumulators
    // and the unpacked operands fit the 32 vector registers.
    let (tile, mr, nt, mr1): (TileFn, usize, usize, usize) = match ty {
        Q4_0 if block => (b_q4_0, 4, 2, 4),
        Q4_1 if block => (b_q4_1, 4, 2, 4),
        Q5_0 if block => (b_q5_0, 4, 2, 4),
        Q5_1 if block => (b_q5_1, 4, 2, 4),
        Q8_0 if block => (b_q8_0, 4, 2, 4),
        Q4_0 => (t_q4_0, 4, 2, 4),
        Q4_1 => (t_q4_1, 4, 2, 4),
        Q5_0 => (t_q5_0, 4, 2, 4),
        Q5_1 => (t_q5_1, 4, 2, 4),
        Q8_0 => (t_q8_0, 4, 2, 4),
        Q2K => (t_q2_k, 2, 4, 4),
        Q3K => (t_q3_k, 2, 4, 4),
        Q4K => (t_q4_k, 2, 4, 4),
        Q5K => (t_q5_k, 2, 4, 4),
        Q6K => (t_q6_k, 2, 4, 4),
        F32 => (t_f32, 4, 4, 4),
        F16 => (t_f16, 4, 4, 4),
        BF16 => (t_bf16, 4, 4, 4),
        _ => return None,
    };
    Some(Kernel {
        mr,
        nt,
        mr1,
        exact_rows: false,
        tile,
    })
}
