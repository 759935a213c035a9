//! AVX2 + FMA + F16C kernels: activation quantizers (also used by the AVX-512 level: they are
//! bandwidth-trivial) and one row-by-token dot product per weight type, in the style of ggml's
//! x86 code: unpack a block to bytes, `maddubs` against the activation bytes, scale in f32.
//!
//! Every function here is `unsafe` with `#[target_feature]`: callers guarantee the features
//! (checked by [`super::Isa::available`]) and the pointer contract of [`Tile`].

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use gguf::GgmlType;

use super::f32ops::x86 as f32x86;
use super::kernels::{quantize_row_blocks, BlockQuantizers, Kernel, Tile, TileFn};
use super::scalar::{q3k_scales, tiled_step};
use super::SumOrder;

// ---- small helpers --------------------------------------------------------------------------

/// The four f16 values at `p..p + 8` (any alignment) as f32.
///
/// Scale fields are converted with `vcvtph2ps` reading memory directly, written as inline
/// assembly: given an intrinsic, LLVM narrows the load to a 16-bit insert into whatever
/// register it picks (often the running accumulator), a false dependency that serialized whole
/// dot-product loops.
///
/// # Safety
/// `p` valid for 8 bytes; F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn f16x4(p: *const u8) -> __m128 {
    let r: __m128;
    // SAFETY: reads 8 bytes at `p` (caller's contract); F16C is enabled for this function; no
    // stack use, flags untouched, no side effects beyond the output register.
    unsafe {
        std::arch::asm!(
            "vcvtph2ps {r}, qword ptr [{p}]",
            p = in(reg) p,
            r = lateout(xmm_reg) r,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    r
}

/// Lane `i` of `v`.
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn lane(v: __m128, i: usize) -> f32 {
    let mut a = [0f32; 4];
    // SAFETY: `a` is 16 writable bytes.
    unsafe { _mm_storeu_ps(a.as_mut_ptr(), v) };
    a[i & 3]
}

/// # Safety
/// `p` valid for 4 bytes.
#[inline(always)]
pub(crate) unsafe fn rd_f32(p: *const u8) -> f32 {
    // SAFETY: caller's contract.
    unsafe { std::ptr::read_unaligned(p as *const f32) }
}

/// # Safety
/// `p` valid for 32 bytes.
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) unsafe fn ld256(p: *const u8) -> __m256i {
    // SAFETY: caller's contract; loadu has no alignment requirement.
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// # Safety
/// `p` valid for 16 bytes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn ld128(p: *const u8) -> __m128i {
    // SAFETY: caller's contract.
    unsafe { _mm_loadu_si128(p as *const __m128i) }
}

#[target_feature(enable = "avx2")]
#[inline]
fn hsum_f32(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[target_feature(enable = "avx2")]
#[inline]
fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// 32 nibbles of a legacy block as bytes: low nibbles (elements 0..16) then high (16..32).
///
/// # Safety
/// `p` valid for 16 bytes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn nibbles32(p: *const u8) -> __m256i {
    // SAFETY: caller's contract.
    let q = unsafe { ld128(p) };
    let both = _mm256_set_m128i(_mm_srli_epi16::<4>(q), q);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0f))
}

/// Byte j = 0xFF where bit j of the little-endian u32 at `p` is set, else 0.
///
/// # Safety
/// `p` valid for 4 bytes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn bits32(p: *const u8) -> __m256i {
    // SAFETY: caller's contract.
    let v = unsafe { std::ptr::read_unaligned(p as *const u32) } as i32;
    // Byte j takes byte j/8 of the word, then keeps bit j%8.
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(v),
        _mm256_setr_epi64x(
            0,
            0x0101_0101_0101_0101,
            0x0202_0202_0202_0202,
            0x0303_0303_0303_0303,
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit)
}

/// Shift every 16-bit lane right by `n` (a run-time count: AVX2 has no per-lane 16-bit shifts).
#[target_feature(enable = "avx2")]
#[inline]
fn srl16(v: __m256i, n: i16) -> __m256i {
    _mm256_srl_epi16(v, _mm_cvtsi32_si128(n as i32))
}

/// Shift every 16-bit lane left by `n`.
#[target_feature(enable = "avx2")]
#[inline]
fn sll16(v: __m256i, n: i16) -> __m256i {
    _mm256_sll_epi16(v, _mm_cvtsi32_si128(n as i32))
}

/// Pairwise products of unsigned bytes `u` and signed bytes `s`, summed to 8 i32 lanes.
#[target_feature(enable = "avx2")]
#[inline]
fn dot_us8(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

/// Signed × signed bytes summed to 8 i32 lanes: `|x| * (y * sign(x))` keeps `maddubs` usable.
#[target_feature(enable = "avx2")]
#[inline]
fn dot_ss8(x: __m256i, y: __m256i) -> __m256i {
    dot_us8(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x))
}

/// Shuffle mask that broadcasts 16-bit element `lo` over the low 128-bit lane and `hi` over the
/// high lane (of a register holding the same 8 i16 in both lanes).
#[target_feature(enable = "avx2")]
#[inline]
fn i16_pick(lo: usize, hi: usize) -> __m256i {
    let w = |k: usize| (((2 * k + 1) << 8) | (2 * k)) as i16;
    _mm256_set_m128i(_mm_set1_epi16(w(hi)), _mm_set1_epi16(w(lo)))
}

// ---- activation quantizers ------------------------------------------------------------------

/// Quantize one row; `y` is exactly one activation row of `act_ty` for `x`.
pub(crate) fn quantize_row(act_ty: GgmlType, x: &[f32], y: &mut [u8]) {
    let q = BlockQuantizers {
        q8: q8_block,
        q8k: q8k_block,
    };
    // SAFETY: AVX2 is available (callers only take this path when `Isa::Avx2` or `Isa::Avx512`
    // is).
    unsafe { quantize_row_blocks(act_ty, x, y, q) }
}

/// Pack 4×8 i32 (elements in order) into 32 i8 (values fit without saturation).
#[target_feature(enable = "avx2")]
#[inline]
fn pack_i32x32(i0: __m256i, i1: __m256i, i2: __m256i, i3: __m256i) -> __m256i {
    // packs works per 128-bit lane; the permute restores element order.
    let a = _mm256_packs_epi32(i0, i1);
    let b = _mm256_packs_epi32(i2, i3);
    let c = _mm256_packs_epi16(a, b);
    _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// One `Q8_0` block (or `Q8_1` with `with_sum`) from 32 floats.
///
/// # Safety
/// `x` valid for 32 floats, `y` for 34 (36 with `with_sum`) bytes; AVX2/F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_block(x: *const f32, y: *mut u8, with_sum: bool) {
    // SAFETY: caller's contract for all loads and stores.
    unsafe {
        let v = [
            _mm256_loadu_ps(x),
            _mm256_loadu_ps(x.add(8)),
            _mm256_loadu_ps(x.add(16)),
            _mm256_loadu_ps(x.add(24)),
        ];
        let sign = _mm256_set1_ps(-0.0);
        let mut m = _mm256_andnot_ps(sign, v[0]);
        for vi in &v[1..] {
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, *vi));
        }
        let m4 = _mm_max_ps(_mm256_extractf128_ps::<1>(m), _mm256_castps256_ps128(m));
        let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        let am = _mm_cvtss_f32(m4);
        let d = am / 127.0;
        let id = _mm256_set1_ps(if am != 0.0 { 127.0 / am } else { 0.0 });
        let q = v.map(|vi| {
            _mm256_cvtps_epi32(_mm256_round_ps::<
                { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
            >(_mm256_mul_ps(vi, id)))
        });
        let dh =
            _mm_extract_epi16::<0>(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(d))) as u16;
        std::ptr::write_unaligned(y as *mut u16, dh);
        let qs = if with_sum {
            let sum = hsum_i32(_mm256_add_epi32(
                _mm256_add_epi32(q[0], q[1]),
                _mm256_add_epi32(q[2], q[3]),
            ));
            let s = d * sum as f32;
            let sh =
                _mm_extract_epi16::<0>(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(s)))
                    as u16;
            std::ptr::write_unaligned(y.add(2) as *mut u16, sh);
            y.add(4)
        } else {
            y.add(2)
        };
        _mm256_storeu_si256(qs as *mut __m256i, pack_i32x32(q[0], q[1], q[2], q[3]));
    }
}

/// One `Q8_K` block from 256 floats.
///
/// # Safety
/// `x` valid for 256 floats, `y` for 292 bytes; AVX2 available.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8k_block(x: *const f32, y: *mut u8) {
    // SAFETY: caller's contract for all loads and stores.
    unsafe {
        let sign = _mm256_set1_ps(-0.0);
        let mut m = _mm256_setzero_ps();
        for i in 0..32 {
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x.add(8 * i))));
        }
        let m4 = _mm_max_ps(_mm256_extractf128_ps::<1>(m), _mm256_castps256_ps128(m));
        let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        let am = _mm_cvtss_f32(m4);
        if am == 0.0 {
            // As the scalar reference: an all-zero block.
            std::ptr::write_bytes(y, 0, 292);
            return;
        }
        // The first element whose magnitude is the maximum, with its sign (as the reference).
        let amv = _mm256_set1_ps(am);
        let mut max = am;
        for i in 0..32 {
            let e = _mm256_cmp_ps::<_CMP_EQ_OQ>(
                _mm256_andnot_ps(sign, _mm256_loadu_ps(x.add(8 * i))),
                amv,
            );
            let mask = _mm256_movemask_ps(e);
            if mask != 0 {
                max = *x.add(8 * i + mask.trailing_zeros() as usize);
                break;
            }
        }
        let iscale = -127.0 / max;
        let is = _mm256_set1_ps(iscale);
        let cap = _mm256_set1_epi32(127);
        let qs = y.add(4);
        let bsums = y.add(260);
        for g in 0..8 {
            let q: [__m256i; 4] = std::array::from_fn(|k| {
                let v = _mm256_loadu_ps(x.add(32 * g + 8 * k));
                let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                    _mm256_mul_ps(is, v),
                );
                _mm256_min_epi32(_mm256_cvtps_epi32(r), cap)
            });
            _mm256_storeu_si256(
                qs.add(32 * g) as *mut __m256i,
                pack_i32x32(q[0], q[1], q[2], q[3]),
            );
            let s0 = hsum_i32(_mm256_add_epi32(q[0], q[1])) as i16;
            let s1 = hsum_i32(_mm256_add_epi32(q[2], q[3])) as i16;
            std::ptr::write_unaligned(bsums.add(4 * g) as *mut i16, s0);
            std::ptr::write_unaligned(bsums.add(4 * g + 2) as *mut i16, s1);
        }
        std::ptr::write_unaligned(y as *mut f32, 1.0 / iscale);
    }
}

// ---- 32-element block types: tiles of rows × tokens, in either summation order ------------

/// One 32-element block type's weights as bytes (their integer dot with an activation block,
/// [`pair_dot`], is 8 i32 lanes, lane `j` the 4 products of elements `4j..4j+4`: ggml's
/// `vec_dot` lanes; their sum is the whole-block order's exact integer), and its scale fields.
trait BlockDot {
    /// Weight and activation block bytes.
    const WB: usize;
    const AB: usize;
    /// Whether the type has a min (`m` at byte 2 of the weight block, `s` of the `Q8_1` block).
    const MIN: bool;
    /// Whether [`BlockDot::unpack`] gives signed bytes (else unsigned).
    const SIGNED: bool;
    /// The block's 32 values as bytes, in element order.
    ///
    /// # Safety
    /// `x` points at a whole weight block; AVX2 available.
    unsafe fn unpack(x: *const u8) -> __m256i;
}

/// The integer dot of unpacked weights `q` ([`BlockDot::unpack`]) and activation quants `y`.
#[target_feature(enable = "avx2")]
#[inline]
fn pair_dot<B: BlockDot + ?Sized>(q: __m256i, y: __m256i) -> __m256i {
    if B::SIGNED {
        dot_ss8(q, y)
    } else {
        dot_us8(q, y)
    }
}

struct B4_0;
impl BlockDot for B4_0 {
    const WB: usize = 18;
    const AB: usize = 34;
    const MIN: bool = false;
    const SIGNED: bool = true;
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn unpack(x: *const u8) -> __m256i {
        // SAFETY: whole block (quants at +2).
        unsafe { _mm256_sub_epi8(nibbles32(x.add(2)), _mm256_set1_epi8(8)) }
    }
}

struct B4_1;
impl BlockDot for B4_1 {
    const WB: usize = 20;
    const AB: usize = 36;
    const MIN: bool = true;
    const SIGNED: bool = false;
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn unpack(x: *const u8) -> __m256i {
        // SAFETY: whole block (quants at +4).
        unsafe { nibbles32(x.add(4)) }
    }
}

struct B5_0;
impl BlockDot for B5_0 {
    const WB: usize = 22;
    const AB: usize = 34;
    const MIN: bool = false;
    const SIGNED: bool = true;
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn unpack(x: *const u8) -> __m256i {
        // Without the fifth bit the value is q - 16: OR-ing 0xF0 into a nibble makes exactly
        // that signed byte.
        // SAFETY: whole block (high bits at +2, quants at +6).
        unsafe {
            let hi = _mm256_andnot_si256(bits32(x.add(2)), _mm256_set1_epi8(0xF0u8 as i8));
            _mm256_or_si256(nibbles32(x.add(6)), hi)
        }
    }
}

struct B5_1;
impl BlockDot for B5_1 {
    const WB: usize = 24;
    const AB: usize = 36;
    const MIN: bool = true;
    const SIGNED: bool = false;
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn unpack(x: *const u8) -> __m256i {
        // SAFETY: whole block (high bits at +4, quants at +8).
        unsafe {
            let hi = _mm256_and_si256(bits32(x.add(4)), _mm256_set1_epi8(0x10));
            _mm256_or_si256(nibbles32(x.add(8)), hi)
        }
    }
}

struct B8_0;
impl BlockDot for B8_0 {
    const WB: usize = 34;
    const AB: usize = 34;
    const MIN: bool = false;
    const SIGNED: bool = true;
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn unpack(x: *const u8) -> __m256i {
        // SAFETY: whole block (quants at +2).
        unsafe { ld256(x.add(2)) }
    }
}

/// An `R × T` tile of a 32-element block type: each weight block is unpacked once for the
/// tile's `T` tokens and each activation block loaded once for its `R` rows; per
/// (row, token) the float operations are the scalar references', in their order: `GGML`
/// ggml's `vec_dot` (`scalar::dot_q4_1` and its siblings: eight f32 lanes, `lane =
/// fma(d_w * d_y, isum_j, lane)`, `hsum_float_8` at the end), else the whole-block order
/// (`scalar::dot_q4_1_block`: `acc = fma(d_w * d_y, isum, acc)` with the exact block sum);
/// the min terms `summs = fma(m_w, s_y, summs)`; the result plus `summs`.
///
/// # Safety
/// The [`Tile`] contract with `R == t.rows`, `T == t.toks`; AVX2/FMA/F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // `r` and `k` index several arrays in step
unsafe fn legacy_tile<B: BlockDot, const R: usize, const T: usize, const GGML: bool>(t: &Tile) {
    let mut wrow = [t.w; R];
    for (r, p) in wrow.iter_mut().enumerate() {
        *p = t.w.wrapping_add(r * t.w_stride);
    }
    let mut arow = [t.a; T];
    for (k, p) in arow.iter_mut().enumerate() {
        *p = t.a.wrapping_add(k * t.a_stride);
    }
    let mut lanes = [[_mm256_setzero_ps(); T]; R];
    let mut acc = [[0f32; T]; R];
    let mut summs = [[0f32; T]; R];
    for b in 0..t.nb {
        // SAFETY: block b exists in every row and token of the tile (b < t.nb); 8 bytes from
        // the start of a block are inside it.
        unsafe {
            let mut y = [_mm256_setzero_si256(); T];
            let mut fy = [_mm_setzero_ps(); T];
            for k in 0..T {
                let y0 = arow[k].add(b * B::AB);
                y[k] = ld256(y0.add(B::AB - 32));
                fy[k] = f16x4(y0);
            }
            for r in 0..R {
                let x = wrow[r].add(b * B::WB);
                let fx = f16x4(x);
                let q = B::unpack(x);
                for k in 0..T {
                    let i = pair_dot::<B>(q, y[k]);
                    if GGML {
                        let d = _mm256_broadcastss_ps(_mm_mul_ss(fx, fy[k]));
                        lanes[r][k] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(i), lanes[r][k]);
                    } else {
                        let d = lane(fx, 0) * lane(fy[k], 0);
                        acc[r][k] = d.mul_add(hsum_i32(i) as f32, acc[r][k]);
                    }
                    if B::MIN {
                        summs[r][k] = lane(fx, 1).mul_add(lane(fy[k], 1), summs[r][k]);
                    }
                }
            }
        }
    }
    for r in 0..R {
        for k in 0..T {
            let v = if GGML {
                hsum_f32(lanes[r][k])
            } else {
                acc[r][k]
            };
            // SAFETY: output (k, r) is inside the tile.
            unsafe { *t.out.add(k * t.out_stride + r) = v + summs[r][k] };
        }
    }
}

/// The tile functions of a 32-element type: `R` rows × 2-4 tokens through [`legacy_tile`];
/// one token (and rows short of `R`) row by row, so a one-token product reads each weight row
/// start to end in address order (rows read side by side from memory were 2-3x slower here,
/// as for the K-quants, [`K_CHUNK`]).
macro_rules! legacy_kernel {
    ($name:ident, $ty:ty, $ggml:expr, $mr:literal) => {
        /// # Safety
        /// The [`Tile`] contract; AVX2/FMA/F16C available.
        unsafe fn $name(t: &Tile) {
            #[inline(always)]
            unsafe fn f<const R: usize, const T: usize>(t: &Tile) {
                // SAFETY: forwarded; the caller passes R == rows, T == toks.
                unsafe { legacy_tile::<$ty, R, T, { $ggml }>(t) }
            }
            // SAFETY: forwarded: every call covers rows and tokens inside the tile.
            unsafe {
                if t.rows == $mr && t.toks > 1 {
                    match t.toks {
                        2 => f::<$mr, 2>(t),
                        3 => f::<$mr, 3>(t),
                        4 => f::<$mr, 4>(t),
                        _ => debug_assert!(false, "tile with {} tokens", t.toks),
                    }
                } else {
                    for r in 0..t.rows {
                        let s = t.row(r);
                        match t.toks {
                            1 => f::<1, 1>(&s),
                            2 => f::<1, 2>(&s),
                            3 => f::<1, 3>(&s),
                            4 => f::<1, 4>(&s),
                            _ => debug_assert!(false, "tile with {} tokens", t.toks),
                        }
                    }
                }
            }
        }
    };
}
legacy_kernel!(t_q4_0, B4_0, true, 1);
legacy_kernel!(t_q4_1, B4_1, true, 2);
legacy_kernel!(t_q5_0, B5_0, true, 1);
legacy_kernel!(t_q5_1, B5_1, true, 2);
legacy_kernel!(t_q8_0, B8_0, true, 1);
legacy_kernel!(t_q4_0_block, B4_0, false, 1);
legacy_kernel!(t_q4_1_block, B4_1, false, 2);
legacy_kernel!(t_q5_0_block, B5_0, false, 1);
legacy_kernel!(t_q5_1_block, B5_1, false, 2);
legacy_kernel!(t_q8_0_block, B8_0, false, 1);

// ---- K-quants: exact integer sums per super-block, the scalar references' float steps -------

/// The integer work of one K-quant super-block against its Q8_K block: two vectors of 8 i32
/// lanes whose lane sums are the block's exact `isum` (scales included) and `msum` (the min
/// terms; zero for types without mins), as `scalar::dot_q*_k` define them.
trait KSums {
    /// Weight block bytes, and the byte offsets of its f16 `d` and (for types with mins) `dmin`.
    const WB: usize;
    const D: usize;
    const DMIN: usize;
    /// How the float side combines a super-block's sums.
    const STEP: KStep;
    /// # Safety
    /// `x`: one whole weight block; `y`: one whole Q8_K block; AVX2 available.
    unsafe fn sums(x: *const u8, y: *const u8) -> (__m256i, __m256i);
}

/// The float step per super-block, per (row, token), in the order of the scalar reference.
#[derive(Clone, Copy, PartialEq, Eq)]
enum KStep {
    /// `scalar::tiled_step` without a min term (`Q3_K`, `Q6_K`).
    Tiled,
    /// `scalar::tiled_step` with `dmin * msum` (`Q2_K`, `Q5_K`).
    TiledMin,
    /// `scalar::dot_q4_k_gemv`: `acc = fma(isum, d * d_y, acc)`, `accm = fma(msum, dmin * d_y,
    /// accm)`, the result `acc - accm`.
    Gemv,
}

/// Bytes `q * 32 + (0..32)` of `y`'s quants (`q` a 32-element sub-block of the Q8_K block).
///
/// # Safety
/// `y`: one whole Q8_K block, `q < 8`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn q8k_quants(y: *const u8, q: usize) -> __m256i {
    // SAFETY: quants start at byte 4 of the block; 32 bytes of sub-block q lie inside it.
    unsafe { ld256(y.add(4 + 32 * q)) }
}

struct KQ2;
impl KSums for KQ2 {
    const WB: usize = 84;
    const D: usize = 80;
    const DMIN: usize = 82;
    const STEP: KStep = KStep::TiledMin;
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn sums(x: *const u8, y: *const u8) -> (__m256i, __m256i) {
        let m3 = _mm256_set1_epi8(3);
        // SAFETY: every read lies inside the two blocks.
        unsafe {
            let sm = ld128(x);
            let mins =
                _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(sm), _mm_set1_epi8(0x0f)));
            let msum = _mm256_madd_epi16(mins, ld256(y.add(260)));
            let sc = _mm256_cvtepu8_epi16(_mm_and_si128(sm, _mm_set1_epi8(0x0f)));
            let halves = [
                _mm256_permute2x128_si256::<0x00>(sc, sc),
                _mm256_permute2x128_si256::<0x11>(sc, sc),
            ];
            let mut sumi = _mm256_setzero_si256();
            for (h, scales) in halves.iter().enumerate() {
                let bits = ld256(x.add(16 + 32 * h));
                for s in 0..4 {
                    let q = _mm256_and_si256(srl16(bits, 2 * s as i16), m3);
                    let p = _mm256_maddubs_epi16(q, q8k_quants(y, 4 * h + s));
                    let scale = _mm256_shuffle_epi8(*scales, i16_pick(2 * s, 2 * s + 1));
                    sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(scale, p));
                }
            }
            (sumi, msum)
        }
    }
}

struct KQ3;
impl KSums for KQ3 {
    const WB: usize = 110;
    const D: usize = 108;
    const DMIN: usize = 108;
    const STEP: KStep = KStep::Tiled;
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn sums(x: *const u8, y: *const u8) -> (__m256i, __m256i) {
        let m3 = _mm256_set1_epi8(3);
        let m4 = _mm256_set1_epi8(4);
        // SAFETY: every read lies inside the two blocks.
        unsafe {
            let packed: [u8; 12] = std::ptr::read_unaligned(x.add(96) as *const [u8; 12]);
            let sc8 = q3k_scales(&packed);
            let sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(sc8.as_ptr() as *const __m128i));
            // Values are stored as q + 4 in 0..8 (low 2 bits, plus 4 when the hmask bit is
            // set); the offset comes back as 4 * sum(scale * bsum).
            let corr = _mm256_slli_epi32::<2>(_mm256_madd_epi16(sc, ld256(y.add(260))));
            let halves = [
                _mm256_permute2x128_si256::<0x00>(sc, sc),
                _mm256_permute2x128_si256::<0x11>(sc, sc),
            ];
            let hbits = ld256(x);
            let mut sumi = _mm256_setzero_si256();
            for (h, scales) in halves.iter().enumerate() {
                let bits = ld256(x.add(32 + 32 * h));
                for s in 0..4 {
                    let lo = _mm256_and_si256(srl16(bits, 2 * s as i16), m3);
                    // Bit 4h+s of each hmask byte, moved to bit 2.
                    let b = (4 * h + s) as i16;
                    let hb = if b >= 2 {
                        srl16(hbits, b - 2)
                    } else {
                        sll16(hbits, 2 - b)
                    };
                    let q = _mm256_or_si256(lo, _mm256_and_si256(hb, m4));
                    let p = _mm256_maddubs_epi16(q, q8k_quants(y, 4 * h + s));
                    let scale = _mm256_shuffle_epi8(*scales, i16_pick(2 * s, 2 * s + 1));
                    sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(scale, p));
                }
            }
            (_mm256_sub_epi32(sumi, corr), _mm256_setzero_si256())
        }
    }
}

struct KQ6;
impl KSums for KQ6 {
    const WB: usize = 210;
    const D: usize = 208;
    const DMIN: usize = 208;
    const STEP: KStep = KStep::Tiled;
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn sums(x: *const u8, y: *const u8) -> (__m256i, __m256i) {
        let m4 = _mm256_set1_epi8(0x0f);
        let m3 = _mm256_set1_epi8(3);
        // SAFETY: every read lies inside the two blocks.
        unsafe {
            let sc = _mm256_cvtepi8_epi16(ld128(x.add(192)));
            // Values are stored as q + 32 in 0..64; the offset returns as 32 * sum(sc * bsum).
            let corr = _mm256_slli_epi32::<5>(_mm256_madd_epi16(sc, ld256(y.add(260))));
            let halves = [
                _mm256_permute2x128_si256::<0x00>(sc, sc),
                _mm256_permute2x128_si256::<0x11>(sc, sc),
            ];
            let mut sumi = _mm256_setzero_si256();
            for (h, scales) in halves.iter().enumerate() {
                let l0 = ld256(x.add(64 * h));
                let l1 = ld256(x.add(64 * h + 32));
                let hb = ld256(x.add(128 + 32 * h));
                let lows = [
                    _mm256_and_si256(l0, m4),
                    _mm256_and_si256(l1, m4),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(l0), m4),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(l1), m4),
                ];
                for (s, lo) in lows.iter().enumerate() {
                    let hi = _mm256_and_si256(srl16(hb, 2 * s as i16), m3);
                    let q = _mm256_or_si256(*lo, _mm256_slli_epi16::<4>(hi));
                    let p = _mm256_maddubs_epi16(q, q8k_quants(y, 4 * h + s));
                    let scale = _mm256_shuffle_epi8(*scales, i16_pick(2 * s, 2 * s + 1));
                    sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(scale, p));
                }
            }
            (_mm256_sub_epi32(sumi, corr), _mm256_setzero_si256())
        }
    }
}

/// Scales (bytes 0..8) and mins (bytes 8..16) of a Q4_K/Q5_K block as one vector, from its 12
/// packed bytes at `p` (the layout `scalar::k4_scale_min` reads), with 32-bit word operations:
/// words 0 and 1 hold the low 6 bits of scales 0..4 and mins 0..4; word 2 the low 4 bits of
/// scales and mins 4..8; the top 2 bits of words 0 and 1 the high bits of scales and mins 4..8.
/// Built in registers: bytes assembled on the stack and loaded as one vector stall the load.
///
/// # Safety
/// `p` valid for 12 bytes; AVX2 available.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn k4_unpack(p: *const u8) -> __m128i {
    // SAFETY: caller's contract (three unaligned words).
    let w = |i: usize| unsafe { std::ptr::read_unaligned(p.add(4 * i) as *const u32) };
    let (w0, w1, w2) = (w(0), w(1), w(2));
    let (m6, m4, m2) = (0x3f3f_3f3fu32, 0x0f0f_0f0fu32, 0x0303_0303u32);
    let scales_lo = w0 & m6;
    let scales_hi = (w2 & m4) | (((w0 >> 6) & m2) << 4);
    let mins_lo = w1 & m6;
    let mins_hi = ((w2 >> 4) & m4) | (((w1 >> 6) & m2) << 4);
    _mm_setr_epi32(
        scales_lo as i32,
        scales_hi as i32,
        mins_lo as i32,
        mins_hi as i32,
    )
}

/// The integer sums of one Q4_K (or Q5_K with `HIGH`) super-block per pair of 32-element
/// sub-blocks `(2p, 2p + 1)`: vector `p` of the first result sums (over its lanes) to
/// `sum scale_j * (q_j . y_j)` over the pair; lane `p` of the second is `sum min_j * bsum_j`.
///
/// # Safety
/// `x`: one whole weight block; `y`: one whole Q8_K block; AVX2 available.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn q45_k_parts<const HIGH: bool>(x: *const u8, y: *const u8) -> ([__m256i; 4], __m128i) {
    let qoff = if HIGH { 48 } else { 16 };
    let m4 = _mm256_set1_epi8(0x0f);
    // SAFETY: every read lies inside the two blocks (caller's contract).
    unsafe {
        let ms = _mm256_cvtepu8_epi16(k4_unpack(x.add(4)));
        let bs = ld256(y.add(260));
        // Sums per 32-element sub-block, paired with the 8 mins: lane p = the pair's min sum.
        let bs32 = _mm_hadd_epi16(
            _mm256_castsi256_si128(bs),
            _mm256_extracti128_si256::<1>(bs),
        );
        let msum = _mm_madd_epi16(_mm256_extracti128_si256::<1>(ms), bs32);
        let scales = _mm256_permute2x128_si256::<0x00>(ms, ms);
        let hbits = if HIGH {
            ld256(x.add(16))
        } else {
            _mm256_setzero_si256()
        };
        let mut pair = [_mm256_setzero_si256(); 4];
        for (j, sumi) in pair.iter_mut().enumerate() {
            let bits = ld256(x.add(qoff + 32 * j));
            let mut ql = _mm256_and_si256(bits, m4);
            let mut qh = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4);
            if HIGH {
                // Bits 2j and 2j+1 of each qh byte become +16.
                let b0 = _mm256_and_si256(srl16(hbits, 2 * j as i16), _mm256_set1_epi8(1));
                let b1 = _mm256_and_si256(srl16(hbits, 2 * j as i16 + 1), _mm256_set1_epi8(1));
                ql = _mm256_or_si256(ql, _mm256_slli_epi16::<4>(b0));
                qh = _mm256_or_si256(qh, _mm256_slli_epi16::<4>(b1));
            }
            let pl = _mm256_maddubs_epi16(ql, q8k_quants(y, 2 * j));
            let ph = _mm256_maddubs_epi16(qh, q8k_quants(y, 2 * j + 1));
            let sl = _mm256_shuffle_epi8(scales, i16_pick(2 * j, 2 * j));
            let sh = _mm256_shuffle_epi8(scales, i16_pick(2 * j + 1, 2 * j + 1));
            *sumi = _mm256_add_epi32(_mm256_madd_epi16(sl, pl), _mm256_madd_epi16(sh, ph));
        }
        (pair, msum)
    }
}

/// The whole super-block's sums of [`q45_k_parts`].
///
/// # Safety
/// As [`q45_k_parts`].
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn q45_k_sums<const HIGH: bool>(x: *const u8, y: *const u8) -> (__m256i, __m256i) {
    // SAFETY: forwarded.
    let (p, msum) = unsafe { q45_k_parts::<HIGH>(x, y) };
    let isum = _mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3]));
    (isum, _mm256_set_m128i(_mm_setzero_si128(), msum))
}

/// `Q4_K` in llama.cpp's repacked gemv order (`scalar::dot_q4_k_gemv`).
struct KQ4Gemv;
impl KSums for KQ4Gemv {
    const WB: usize = 144;
    const D: usize = 0;
    const DMIN: usize = 2;
    const STEP: KStep = KStep::Gemv;
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn sums(x: *const u8, y: *const u8) -> (__m256i, __m256i) {
        // SAFETY: forwarded.
        unsafe { q45_k_sums::<false>(x, y) }
    }
}

struct KQ5;
impl KSums for KQ5 {
    const WB: usize = 176;
    const D: usize = 0;
    const DMIN: usize = 2;
    const STEP: KStep = KStep::TiledMin;
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn sums(x: *const u8, y: *const u8) -> (__m256i, __m256i) {
        // SAFETY: forwarded.
        unsafe { q45_k_sums::<true>(x, y) }
    }
}

/// The f16 at `p` as f32.
///
/// # Safety
/// `p` valid for 2 bytes.
#[inline(always)]
pub(crate) unsafe fn rd_f16(p: *const u8) -> f32 {
    // SAFETY: caller's contract.
    half::f16::from_bits(unsafe { std::ptr::read_unaligned(p as *const u16) }).to_f32()
}

/// One weight row · one activation row of a K-quant in its scalar reference's order.
///
/// # Safety
/// `w`: `nb` weight blocks of `K`; `a`: `nb` Q8_K blocks; AVX2/FMA/F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_k<K: KSums>(nb: usize, w: *const u8, a: *const u8) -> f32 {
    let (mut acc, mut accm) = (0f32, 0f32);
    // SAFETY: block i of each row lies within the caller's ranges.
    unsafe {
        for i in 0..nb {
            let (x, y) = (w.add(K::WB * i), a.add(292 * i));
            let (isum, msum) = K::sums(x, y);
            let (isum, msum) = (hsum_i32(isum), hsum_i32(msum));
            let (d, yd) = (rd_f16(x.add(K::D)), rd_f32(y));
            match K::STEP {
                KStep::Tiled => acc = tiled_step(acc, isum, None, d, yd),
                KStep::TiledMin => {
                    let dmin = rd_f16(x.add(K::DMIN));
                    acc = tiled_step(acc, isum, Some((dmin, msum)), d, yd);
                }
                KStep::Gemv => {
                    acc = (isum as f32).mul_add(d * yd, acc);
                    accm = (msum as f32).mul_add(rd_f16(x.add(K::DMIN)) * yd, accm);
                }
            }
        }
    }
    acc - accm
}

/// Integer sums of 8 rows for a chunk of up to `N` blocks, written before they are read.
/// Left uninitialized: zeroing them cost a memset of 2-16 KB per 8-row group (5-7 % of an
/// AVX2 decode or prefill profile).
struct Slots<V: Copy, const N: usize>([[MaybeUninit<V>; 8]; N]);

impl<V: Copy, const N: usize> Slots<V, N> {
    #[inline(always)]
    fn new() -> Self {
        Self([[MaybeUninit::uninit(); 8]; N])
    }

    #[inline(always)]
    fn set(&mut self, i: usize, r: usize, v: V) {
        self.0[i][r] = MaybeUninit::new(v);
    }

    /// The 8 rows' values of block `i`.
    ///
    /// # Safety
    /// [`Slots::set`] has written every row of block `i`.
    #[inline(always)]
    unsafe fn rows(&self, i: usize) -> [V; 8] {
        // SAFETY: caller's contract.
        std::array::from_fn(|r| unsafe { self.0[i][r].assume_init() })
    }
}

/// Lane `r` = the lane sum of `v[r]` (exact: integer adds), for 8 vectors.
#[target_feature(enable = "avx2")]
#[inline]
fn reduce8(v: &[__m256i; 8]) -> __m256i {
    let h0 = _mm256_hadd_epi32(v[0], v[1]);
    let h1 = _mm256_hadd_epi32(v[2], v[3]);
    let h2 = _mm256_hadd_epi32(v[4], v[5]);
    let h3 = _mm256_hadd_epi32(v[6], v[7]);
    // Per 128-bit half: the partial sums of v[0..4] (g0) and v[4..8] (g1).
    let g0 = _mm256_hadd_epi32(h0, h1);
    let g1 = _mm256_hadd_epi32(h2, h3);
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(g0, g1),
        _mm256_permute2x128_si256::<0x31>(g0, g1),
    )
}

/// The f16 at byte `off` of block `i` of rows `0..8` (`stride` bytes apart), as 8 f32 lanes.
///
/// # Safety
/// The 8 rows hold block `i`; F16C available.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn gather_f16(w: *const u8, stride: usize, off: usize) -> __m256 {
    let mut h = [0u16; 8];
    for (r, v) in h.iter_mut().enumerate() {
        // SAFETY: caller's contract.
        *v = unsafe { std::ptr::read_unaligned(w.add(r * stride + off) as *const u16) };
    }
    // SAFETY: `h` is 16 readable bytes.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(h.as_ptr() as *const __m128i) })
}

/// Rows of at most this many super-blocks are read row after row by the 8-row K-quant
/// products (the group's bytes in address order: one stream the prefetchers follow), their
/// integer sums kept, then the float steps run block by block in order; longer rows are read
/// block by block across the 8 rows (eight streams advancing together). Measured on the
/// output head's shape (128,256 x 2,048, AVX2, 2 threads): 18.8 -> 6.1 ms for Q6_K, 8.4 -> 4.9
/// ms for Q4_K; reading long rows in chunks of 16 blocks instead was 2-2.4x slower from memory.
const K_CHUNK: usize = 16;

/// Blocks per chunk for rows of `nb` blocks (see [`K_CHUNK`]).
#[inline(always)]
fn k_chunk(nb: usize) -> usize {
    if nb <= K_CHUNK {
        nb
    } else {
        1
    }
}

/// Eight weight rows · one activation row of a K-quant: lane `r` carries row `r`'s
/// accumulators through exactly [`dot_k`]'s steps, so each output is [`dot_k`]'s bits.
///
/// # Safety
/// `w`: 8 rows of `nb` blocks, `stride` bytes apart; `a`: `nb` Q8_K blocks; `out`: 8 f32.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_k8<K: KSums>(nb: usize, w: *const u8, stride: usize, a: *const u8, out: *mut f32) {
    let (mut acc, mut accm) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut is = Slots::<__m256i, K_CHUNK>::new();
    let mut ms = Slots::<__m256i, K_CHUNK>::new();
    // SAFETY: block i of each row lies within the caller's ranges.
    unsafe {
        let mut c0 = 0;
        while c0 < nb {
            let c1 = (c0 + k_chunk(nb)).min(nb);
            for r in 0..8 {
                let row = w.add(r * stride);
                for i in c0..c1 {
                    let (bi, bm) = K::sums(row.add(K::WB * i), a.add(292 * i));
                    is.set(i - c0, r, bi);
                    ms.set(i - c0, r, bm);
                }
            }
            for i in c0..c1 {
                let (x, y) = (w.add(K::WB * i), a.add(292 * i));
                let isum = _mm256_cvtepi32_ps(reduce8(&is.rows(i - c0)));
                let d = gather_f16(x, stride, K::D);
                let yd = _mm256_set1_ps(rd_f32(y));
                match K::STEP {
                    KStep::Tiled => acc = _mm256_fmadd_ps(_mm256_mul_ps(isum, d), yd, acc),
                    KStep::TiledMin => {
                        let msum = _mm256_cvtepi32_ps(reduce8(&ms.rows(i - c0)));
                        let dmin = gather_f16(x, stride, K::DMIN);
                        let r = _mm256_fnmadd_ps(dmin, msum, _mm256_mul_ps(isum, d));
                        acc = _mm256_fmadd_ps(r, yd, acc);
                    }
                    KStep::Gemv => {
                        let msum = _mm256_cvtepi32_ps(reduce8(&ms.rows(i - c0)));
                        let dmin = gather_f16(x, stride, K::DMIN);
                        acc = _mm256_fmadd_ps(isum, _mm256_mul_ps(d, yd), acc);
                        accm = _mm256_fmadd_ps(msum, _mm256_mul_ps(dmin, yd), accm);
                    }
                }
            }
            c0 = c1;
        }
        _mm256_storeu_ps(out, _mm256_sub_ps(acc, accm));
    }
}

/// Per-pair integer sums of one Q4_K super-block for [`dot_q4_k`]: lane `p` of the first
/// result the scale sum of pair `p`, of the second its min sum.
///
/// # Safety
/// As [`q45_k_parts`].
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn q4_k_pairs(x: *const u8, y: *const u8) -> (__m128i, __m128i) {
    // SAFETY: forwarded.
    let (p, msum) = unsafe { q45_k_parts::<false>(x, y) };
    // Per 128-bit half: [pair 0, 1, 2, 3] partial sums; the two halves added.
    let h = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    let isum = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
    (isum, msum)
}

/// The four lanes of `v`.
#[target_feature(enable = "avx2")]
#[inline]
fn lanes_i32(v: __m128i) -> [i32; 4] {
    let mut a = [0i32; 4];
    // SAFETY: `a` is 16 writable bytes.
    unsafe { _mm_storeu_si128(a.as_mut_ptr() as *mut __m128i, v) };
    a
}

/// `Q4_K` in the order of `scalar::dot_q4_k` (llama.cpp's repacked gemm): one fused
/// multiply-add per pair of sub-blocks into the scale and the min accumulators.
///
/// # Safety
/// `w`: `nb` Q4_K blocks; `a`: `nb` Q8_K blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_k(nb: usize, w: *const u8, a: *const u8) -> f32 {
    let (mut acc, mut accm) = (0f32, 0f32);
    // SAFETY: block i of each row lies within the caller's ranges.
    unsafe {
        for i in 0..nb {
            let (x, y) = (w.add(144 * i), a.add(292 * i));
            let yd = rd_f32(y);
            let (d, dm) = (rd_f16(x) * yd, rd_f16(x.add(2)) * yd);
            let (isum, msum) = q4_k_pairs(x, y);
            let (isum, msum) = (lanes_i32(isum), lanes_i32(msum));
            for p in 0..4 {
                acc = (isum[p] as f32).mul_add(d, acc);
                accm = (msum[p] as f32).mul_add(dm, accm);
            }
        }
    }
    acc - accm
}

/// 4x4 transpose of 32-bit lanes: result `p` holds lane `p` of `v[0..4]`.
#[target_feature(enable = "avx2")]
#[inline]
fn transpose4(v: [__m128i; 4]) -> [__m128i; 4] {
    let t0 = _mm_unpacklo_epi32(v[0], v[1]);
    let t1 = _mm_unpacklo_epi32(v[2], v[3]);
    let t2 = _mm_unpackhi_epi32(v[0], v[1]);
    let t3 = _mm_unpackhi_epi32(v[2], v[3]);
    [
        _mm_unpacklo_epi64(t0, t1),
        _mm_unpackhi_epi64(t0, t1),
        _mm_unpacklo_epi64(t2, t3),
        _mm_unpackhi_epi64(t2, t3),
    ]
}

/// [`dot_q4_k`] for eight rows at once, lane `r` carrying row `r` (bit-identical per row).
///
/// # Safety
/// As [`dot_k8`] for Q4_K.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_k8(nb: usize, w: *const u8, stride: usize, a: *const u8, out: *mut f32) {
    let (mut acc, mut accm) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut is = Slots::<__m128i, K_CHUNK>::new();
    let mut ms = Slots::<__m128i, K_CHUNK>::new();
    // SAFETY: block i of each row lies within the caller's ranges.
    unsafe {
        let mut c0 = 0;
        while c0 < nb {
            let c1 = (c0 + k_chunk(nb)).min(nb);
            for r in 0..8 {
                let row = w.add(r * stride);
                for i in c0..c1 {
                    let (bi, bm) = q4_k_pairs(row.add(144 * i), a.add(292 * i));
                    is.set(i - c0, r, bi);
                    ms.set(i - c0, r, bm);
                }
            }
            for i in c0..c1 {
                let (x, y) = (w.add(144 * i), a.add(292 * i));
                let (is, ms) = (is.rows(i - c0), ms.rows(i - c0));
                let yd = _mm256_set1_ps(rd_f32(y));
                let d = _mm256_mul_ps(gather_f16(x, stride, 0), yd);
                let dm = _mm256_mul_ps(gather_f16(x, stride, 2), yd);
                let (ilo, ihi) = (
                    transpose4([is[0], is[1], is[2], is[3]]),
                    transpose4([is[4], is[5], is[6], is[7]]),
                );
                let (mlo, mhi) = (
                    transpose4([ms[0], ms[1], ms[2], ms[3]]),
                    transpose4([ms[4], ms[5], ms[6], ms[7]]),
                );
                for p in 0..4 {
                    let isum = _mm256_cvtepi32_ps(_mm256_set_m128i(ihi[p], ilo[p]));
                    let msum = _mm256_cvtepi32_ps(_mm256_set_m128i(mhi[p], mlo[p]));
                    acc = _mm256_fmadd_ps(isum, d, acc);
                    accm = _mm256_fmadd_ps(msum, dm, accm);
                }
            }
            c0 = c1;
        }
        _mm256_storeu_ps(out, _mm256_sub_ps(acc, accm));
    }
}

/// [`q4_k_pairs`] of one Q4_K block against the blocks `ys` of `T` tokens: each weight vector
/// is unpacked once for all of them.
///
/// # Safety
/// `x`: one whole Q4_K block; each `ys[t]`: one whole Q8_K block; AVX2 available.
#[target_feature(enable = "avx2")]
#[inline]
#[allow(clippy::needless_range_loop)] // `j` also places the weight and activation bytes
unsafe fn q4_k_pairs_t<const T: usize>(
    x: *const u8,
    ys: &[*const u8; T],
) -> ([__m128i; T], [__m128i; T]) {
    let m4 = _mm256_set1_epi8(0x0f);
    let mut is = [_mm_setzero_si128(); T];
    let mut ms = [_mm_setzero_si128(); T];
    // SAFETY: every read lies inside the blocks (caller's contract).
    unsafe {
        let mn = _mm256_cvtepu8_epi16(k4_unpack(x.add(4)));
        let scales = _mm256_permute2x128_si256::<0x00>(mn, mn);
        let mins = _mm256_extracti128_si256::<1>(mn);
        let mut pair = [[_mm256_setzero_si256(); 4]; T];
        for j in 0..4 {
            let bits = ld256(x.add(16 + 32 * j));
            let ql = _mm256_and_si256(bits, m4);
            let qh = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4);
            let sl = _mm256_shuffle_epi8(scales, i16_pick(2 * j, 2 * j));
            let sh = _mm256_shuffle_epi8(scales, i16_pick(2 * j + 1, 2 * j + 1));
            for (t, y) in ys.iter().enumerate() {
                let pl = _mm256_maddubs_epi16(ql, q8k_quants(*y, 2 * j));
                let ph = _mm256_maddubs_epi16(qh, q8k_quants(*y, 2 * j + 1));
                pair[t][j] = _mm256_add_epi32(_mm256_madd_epi16(sl, pl), _mm256_madd_epi16(sh, ph));
            }
        }
        for (t, y) in ys.iter().enumerate() {
            let p = &pair[t];
            let h = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
            is[t] = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
            let bs = ld256(y.add(260));
            let bs32 = _mm_hadd_epi16(
                _mm256_castsi256_si128(bs),
                _mm256_extracti128_si256::<1>(bs),
            );
            ms[t] = _mm_madd_epi16(mins, bs32);
        }
    }
    (is, ms)
}

/// [`dot_q4_k8`] for `T` tokens at once (`a[t]` their activation rows, `out[t]` their 8
/// outputs), each weight block unpacked once for all of them; the same bits per token.
///
/// # Safety
/// As [`dot_q4_k8`] for each token.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_k8_t<const T: usize>(
    nb: usize,
    w: *const u8,
    stride: usize,
    a: &[*const u8; T],
    out: &[*mut f32; T],
) {
    let mut acc = [(_mm256_setzero_ps(), _mm256_setzero_ps()); T];
    let mut is: [Slots<__m128i, K_CHUNK>; T] = std::array::from_fn(|_| Slots::new());
    let mut ms: [Slots<__m128i, K_CHUNK>; T] = std::array::from_fn(|_| Slots::new());
    // SAFETY: block i of each row and token lies within the caller's ranges.
    unsafe {
        let mut c0 = 0;
        while c0 < nb {
            let c1 = (c0 + k_chunk(nb)).min(nb);
            for r in 0..8 {
                let row = w.add(r * stride);
                for i in c0..c1 {
                    let ys: [*const u8; T] = std::array::from_fn(|t| a[t].add(292 * i));
                    let (bi, bm) = q4_k_pairs_t::<T>(row.add(144 * i), &ys);
                    for t in 0..T {
                        is[t].set(i - c0, r, bi[t]);
                        ms[t].set(i - c0, r, bm[t]);
                    }
                }
            }
            for i in c0..c1 {
                let x = w.add(144 * i);
                let (dw, dmw) = (gather_f16(x, stride, 0), gather_f16(x, stride, 2));
                for t in 0..T {
                    let (is, ms) = (is[t].rows(i - c0), ms[t].rows(i - c0));
                    let yd = _mm256_set1_ps(rd_f32(a[t].add(292 * i)));
                    let (d, dm) = (_mm256_mul_ps(dw, yd), _mm256_mul_ps(dmw, yd));
                    let (ilo, ihi) = (
                        transpose4([is[0], is[1], is[2], is[3]]),
                        transpose4([is[4], is[5], is[6], is[7]]),
                    );
                    let (mlo, mhi) = (
                        transpose4([ms[0], ms[1], ms[2], ms[3]]),
                        transpose4([ms[4], ms[5], ms[6], ms[7]]),
                    );
                    let (ac, am) = &mut acc[t];
                    for p in 0..4 {
                        let isum = _mm256_cvtepi32_ps(_mm256_set_m128i(ihi[p], ilo[p]));
                        let msum = _mm256_cvtepi32_ps(_mm256_set_m128i(mhi[p], mlo[p]));
                        *ac = _mm256_fmadd_ps(isum, d, *ac);
                        *am = _mm256_fmadd_ps(msum, dm, *am);
                    }
                }
            }
            c0 = c1;
        }
        for t in 0..T {
            _mm256_storeu_ps(out[t], _mm256_sub_ps(acc[t].0, acc[t].1));
        }
    }
}

/// The Q4_K tile (pair order): groups of 8 rows take all the tile's tokens at once when it has
/// 4 ([`dot_q4_k8_t`]), else one token at a time; leftover rows one by one.
///
/// # Safety
/// The [`Tile`] contract; AVX2/FMA/F16C available.
unsafe fn t_q4_k(t: &Tile) {
    if t.toks != 4 {
        // SAFETY: forwarded.
        unsafe { t_q4_k_each(t) };
        return;
    }
    // SAFETY: the tile contract covers every row, the 4 tokens and their outputs.
    unsafe {
        let a: [*const u8; 4] = std::array::from_fn(|k| t.a.add(k * t.a_stride));
        let mut r = 0;
        while r + K_ROWS <= t.rows {
            let out: [*mut f32; 4] = std::array::from_fn(|k| t.out.add(k * t.out_stride + r));
            dot_q4_k8_t::<4>(t.nb, t.w.add(r * t.w_stride), t.w_stride, &a, &out);
            r += K_ROWS;
        }
        for r in r..t.rows {
            for (k, ak) in a.iter().enumerate() {
                *t.out.add(k * t.out_stride + r) = dot_q4_k(t.nb, t.w.add(r * t.w_stride), *ak);
            }
        }
    }
}

/// # Safety
/// `w`: `n` f32; `a`: `n` f32.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f32w(n: usize, w: *const u8, a: *const u8) -> f32 {
    // SAFETY: forwarded.
    unsafe { f32x86::dot_f32_256(w as *const f32, a as *const f32, n) }
}

/// # Safety
/// `w`: `n` f16; `a`: `n` f32.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f16w(n: usize, w: *const u8, a: *const u8) -> f32 {
    // SAFETY: forwarded.
    unsafe { f32x86::dot_f32_f16_256(a as *const f32, w as *const u16, n) }
}

/// # Safety
/// `w`: `n` bf16; `a`: `n` f32.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_bf16w(n: usize, w: *const u8, a: *const u8) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 2];
    let mut i = 0;
    // SAFETY: every access is below `n`.
    unsafe {
        while i + 16 <= n {
            for (k, acc) in acc.iter_mut().enumerate() {
                let j = i + 8 * k;
                let h = _mm256_cvtepu16_epi32(ld128(w.add(2 * j)));
                let wf = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h));
                *acc = _mm256_fmadd_ps(wf, _mm256_loadu_ps((a as *const f32).add(j)), *acc);
            }
            i += 16;
        }
        let mut s = hsum_f32(_mm256_add_ps(acc[0], acc[1]));
        while i < n {
            let wb = std::ptr::read_unaligned(w.add(2 * i) as *const u16);
            s += f32::from_bits((wb as u32) << 16) * rd_f32(a.add(4 * i));
            i += 1;
        }
        s
    }
}

// ---- tiles ------------------------------------------------------------------------------------

macro_rules! row_tile {
    ($name:ident, $dot:expr) => {
        /// # Safety
        /// The [`Tile`] contract; AVX2/FMA/F16C available.
        unsafe fn $name(t: &Tile) {
            for r in 0..t.rows {
                for k in 0..t.toks {
                    // SAFETY: the tile contract covers row r, token k and output (k, r).
                    unsafe {
                        *t.out.add(k * t.out_stride + r) =
                            $dot(t.nb, t.w.add(r * t.w_stride), t.a.add(k * t.a_stride));
                    }
                }
            }
        }
    };
}
row_tile!(t_f32, dot_f32w);
row_tile!(t_f16, dot_f16w);
row_tile!(t_bf16, dot_bf16w);

/// Rows per K-quant tile: the eight lanes of [`dot_k8`] and [`dot_q4_k8`].
const K_ROWS: usize = 8;

macro_rules! k_tile {
    ($name:ident, $dot8:expr, $dot:expr) => {
        /// Rows in groups of [`K_ROWS`] through the 8-lane form, the rest one by one.
        ///
        /// # Safety
        /// The [`Tile`] contract; AVX2/FMA/F16C available.
        unsafe fn $name(t: &Tile) {
            for k in 0..t.toks {
                // SAFETY: the tile contract covers every row, token k and output (k, r).
                unsafe {
                    let a = t.a.add(k * t.a_stride);
                    let out = t.out.add(k * t.out_stride);
                    let mut r = 0;
                    while r + K_ROWS <= t.rows {
                        $dot8(t.nb, t.w.add(r * t.w_stride), t.w_stride, a, out.add(r));
                        r += K_ROWS;
                    }
                    for r in r..t.rows {
                        *out.add(r) = $dot(t.nb, t.w.add(r * t.w_stride), a);
                    }
                }
            }
        }
    };
}
k_tile!(t_q2_k, dot_k8::<KQ2>, dot_k::<KQ2>);
k_tile!(t_q3_k, dot_k8::<KQ3>, dot_k::<KQ3>);
k_tile!(t_q4_k_each, dot_q4_k8, dot_q4_k);
k_tile!(t_q4_k_gemv, dot_k8::<KQ4Gemv>, dot_k::<KQ4Gemv>);
k_tile!(t_q5_k, dot_k8::<KQ5>, dot_k::<KQ5>);
k_tile!(t_q6_k, dot_k8::<KQ6>, dot_k::<KQ6>);

/// The AVX2 kernel for `ty` in summation order `order`.
pub(crate) fn kernel(ty: GgmlType, order: SumOrder) -> Option<Kernel> {
    use GgmlType::*;
    let tile: TileFn = match ty {
        Q4_0 if order == SumOrder::Block => t_q4_0_block,
        Q4_1 if order == SumOrder::Block => t_q4_1_block,
        Q5_0 if order == SumOrder::Block => t_q5_0_block,
        Q5_1 if order == SumOrder::Block => t_q5_1_block,
        Q8_0 if order == SumOrder::Block => t_q8_0_block,
        F32 => t_f32,
        F16 => t_f16,
        BF16 => t_bf16,
        Q4_0 => t_q4_0,
        Q4_1 => t_q4_1,
        Q5_0 => t_q5_0,
        Q5_1 => t_q5_1,
        Q8_0 => t_q8_0,
        Q2K => t_q2_k,
        Q3K => t_q3_k,
        Q4K => t_q4_k,
        Q5K => t_q5_k,
        Q6K => t_q6_k,
        _ => return None,
    };
    // Rows per tile (several tokens) and per one-token tile: the K-quants' 8 lanes; the
    // 32-element types' tiles of 2 (unsigned values) or 1 (signed: two more registers per
    // row) rows × 4 tokens (`legacy_tile`; with 2 rows the signed types spill and ran at half
    // speed); float rows one by one.
    let (mr, mr1) = match ty {
        Q2K | Q3K | Q4K | Q5K | Q6K => (K_ROWS, K_ROWS),
        Q4_1 | Q5_1 => (2, 4),
        Q4_0 | Q5_0 | Q8_0 => (1, 4),
        _ => (4, 4),
    };
    Some(Kernel {
        mr,
        nt: 4,
        mr1,
        exact_rows: false,
        tile,
    })
}

/// The AVX2 kernel for the tokens of a product left over from groups of
/// [`super::kernels::GROUP_TOKENS`] (`super::kernels::tail_kernel`).
pub(crate) fn tail_kernel(ty: GgmlType) -> Option<Kernel> {
    match ty {
        GgmlType::Q4K => Some(Kernel {
            mr: K_ROWS,
            nt: 4,
            mr1: K_ROWS,
            exact_rows: false,
            tile: t_q4_k_gemv,
        }),
        _ => None,
    }
}
