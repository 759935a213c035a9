//! aarch64 NEON kernels: activation quantizers and a product kernel per weight type (one weight
//! row against up to four tokens, each weight block unpacked once for all of them).
//!
//! Every quantized type reproduces its scalar reference ([`super::scalar`]) bit for bit: the
//! integer work is exact in i32 lanes, and the f32 steps are the reference's own, in its order
//! (the eight `Lanes8` lanes of the 32-element types are two `float32x4_t` accumulators whose
//! lane `j` takes the dot of elements `4j..4j+4`, exactly what `sdot` / the widening
//! multiply-and-pairwise-add below compute per lane). So a model's logits on NEON equal the
//! scalar level's, and the scalar level follows llama.cpp's x86 order. Float weights (`F32`,
//! `F16`, `BF16`) sum in a different order than the reference (four vector accumulators) and
//! agree within the tolerance the agreement tests state.
//!
//! NEON itself is part of every aarch64 CPU. The 8-bit dot-product instruction (`sdot`,
//! FEAT_DotProd: Cortex-A76 and later, Neoverse N1/V1, Apple M1 and later) is detected at run
//! time; each kernel exists in two forms, `DP = true` (one `sdot` per 16 bytes) and `DP = false`
//! (`smull`/`smull2` then two pairwise adds), which give the same i32 lanes. `sdot` is written as
//! inline assembly because its intrinsic (`vdotq_s32`) is not yet stable Rust.
//!
//! Every function here is `unsafe`: callers keep the pointer contract of [`Tile`].

use std::arch::aarch64::*;
use std::marker::PhantomData;
use std::sync::OnceLock;

use gguf::GgmlType;
use half::f16;

use super::kernels::{quantize_row_blocks, BlockQuantizers, Kernel, Tile, TileFn};
use super::scalar::{k4_scale_min, q3k_scales, tiled_step};
use super::SumOrder;

// ---- small helpers --------------------------------------------------------------------------

/// Whether this CPU has the 8-bit dot-product instructions (`sdot`), detected once.
pub(crate) fn has_dotprod() -> bool {
    static DP: OnceLock<bool> = OnceLock::new();
    *DP.get_or_init(|| {
        std::arch::is_aarch64_feature_detected!("dotprod")
            && std::env::var("CROSSOVER_NEON_DOTPROD").map_or(true, |v| v != "0")
    })
}

/// The f16 at `p` (any alignment) as f32 (exact).
///
/// # Safety
/// `p` valid for 2 bytes.
#[inline(always)]
unsafe fn h2f(p: *const u8) -> f32 {
    // SAFETY: caller's contract.
    f16::from_bits(unsafe { std::ptr::read_unaligned(p as *const u16) }).to_f32()
}

/// # Safety
/// `p` valid for 4 bytes.
#[inline(always)]
unsafe fn rd_f32(p: *const u8) -> f32 {
    // SAFETY: caller's contract.
    unsafe { std::ptr::read_unaligned(p as *const f32) }
}

/// # Safety
/// `p` valid for 16 bytes.
#[inline(always)]
unsafe fn ld_u8(p: *const u8) -> uint8x16_t {
    // SAFETY: caller's contract; `ld1` has no alignment requirement.
    unsafe { vld1q_u8(p) }
}

/// # Safety
/// `p` valid for 16 bytes.
#[inline(always)]
unsafe fn ld_s8(p: *const u8) -> int8x16_t {
    // SAFETY: caller's contract.
    unsafe { vld1q_s8(p as *const i8) }
}

/// `acc + g` where lane `j` of `g` is the exact sum of the products of bytes `4j..4j+4` of `a`
/// and `b` (signed). `DP`: one `sdot`; else `smull`/`smull2` to i16, pairwise to i32, pairwise
/// again: the same lanes.
#[inline(always)]
fn dot4<const DP: bool>(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    if DP {
        let mut r = acc;
        // SAFETY: `sdot` reads and writes registers only; `DP` kernels are chosen only where
        // `has_dotprod()` (run-time detection) said the instruction exists.
        unsafe {
            std::arch::asm!(
                ".arch_extension dotprod",
                "sdot {r:v}.4s, {a:v}.16b, {b:v}.16b",
                r = inout(vreg) r,
                a = in(vreg) a,
                b = in(vreg) b,
                options(pure, nomem, nostack, preserves_flags),
            );
        }
        r
    } else {
        // |a_i * b_i| <= 2^14 fits i16; the widening pairwise add sums two of them in i32.
        // SAFETY: plain NEON (baseline on aarch64).
        unsafe {
            let lo = vpaddlq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(b)));
            let hi = vpaddlq_s16(vmull_high_s8(a, b));
            vaddq_s32(acc, vpaddq_s32(lo, hi))
        }
    }
}

/// The exact integer dot of 16 signed bytes.
#[inline(always)]
fn idot16<const DP: bool>(a: int8x16_t, b: int8x16_t) -> i32 {
    // SAFETY: plain NEON.
    unsafe { vaddvq_s32(dot4::<DP>(vdupq_n_s32(0), a, b)) }
}

/// The exact integer dot of 32 signed bytes (two 16-byte halves each).
#[inline(always)]
fn idot32<const DP: bool>(a0: int8x16_t, a1: int8x16_t, b0: int8x16_t, b1: int8x16_t) -> i32 {
    // SAFETY: plain NEON.
    unsafe { vaddvq_s32(dot4::<DP>(dot4::<DP>(vdupq_n_s32(0), a0, b0), a1, b1)) }
}

/// Byte `j` of the 32 bytes (two halves) is 0xFF where bit `j` of the little-endian u32 at `p`
/// is set, else 0.
///
/// # Safety
/// `p` valid for 4 bytes.
#[inline(always)]
unsafe fn bits32(p: *const u8) -> (uint8x16_t, uint8x16_t) {
    // SAFETY: caller's contract; the rest is plain NEON.
    unsafe {
        let v = vreinterpretq_u8_u32(vdupq_n_u32(std::ptr::read_unaligned(p as *const u32)));
        // Byte j takes byte j / 8 of the word, then keeps bit j % 8.
        const IDX_LO: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1];
        const IDX_HI: [u8; 16] = [2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3];
        const BIT: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
        let bit = vld1q_u8(BIT.as_ptr());
        let lo = vtstq_u8(vqtbl1q_u8(v, vld1q_u8(IDX_LO.as_ptr())), bit);
        let hi = vtstq_u8(vqtbl1q_u8(v, vld1q_u8(IDX_HI.as_ptr())), bit);
        (lo, hi)
    }
}

// ---- activation quantizers (bit-identical to the scalar references) -------------------------

/// Quantize one row; `y` is exactly one activation row of `act_ty` for `x`.
pub(crate) fn quantize_row(act_ty: GgmlType, x: &[f32], y: &mut [u8]) {
    let q = BlockQuantizers {
        q8: q8_block,
        q8k: q8k_block,
    };
    // SAFETY: NEON is baseline on aarch64.
    unsafe { quantize_row_blocks(act_ty, x, y, q) }
}

/// Four i32 vectors (16 values each in range) narrowed to 16 i8 with saturation.
#[inline(always)]
fn narrow16(a: int32x4_t, b: int32x4_t, c: int32x4_t, d: int32x4_t) -> int8x16_t {
    // SAFETY: plain NEON.
    unsafe {
        let lo = vcombine_s16(vqmovn_s32(a), vqmovn_s32(b));
        let hi = vcombine_s16(vqmovn_s32(c), vqmovn_s32(d));
        vcombine_s8(vqmovn_s16(lo), vqmovn_s16(hi))
    }
}

/// One `Q8_0` block (or `Q8_1` with `with_sum`) from 32 floats: `scalar::quantize_row_q8_0`'s
/// operations (`amax` ignoring NaN as `f32::max` does, `127 / amax`, round half to even).
///
/// # Safety
/// `x` valid for 32 floats, `y` for 34 (36 with `with_sum`) bytes.
unsafe fn q8_block(x: *const f32, y: *mut u8, with_sum: bool) {
    // SAFETY: caller's contract for all loads and stores.
    unsafe {
        let v: [float32x4_t; 8] = std::array::from_fn(|k| vld1q_f32(x.add(4 * k)));
        let mut m = vdupq_n_f32(0.0);
        for vi in v {
            m = vmaxnmq_f32(m, vabsq_f32(vi));
        }
        let am = vmaxnmvq_f32(m);
        let d = am / 127.0;
        let id = if am != 0.0 { 127.0 / am } else { 0.0 };
        let q: [int32x4_t; 8] = v.map(|vi| vcvtnq_s32_f32(vmulq_n_f32(vi, id)));
        std::ptr::write_unaligned(y as *mut u16, f16::from_f32(d).to_bits());
        let qs = if with_sum {
            let s4 = vaddq_s32(
                vaddq_s32(vaddq_s32(q[0], q[1]), vaddq_s32(q[2], q[3])),
                vaddq_s32(vaddq_s32(q[4], q[5]), vaddq_s32(q[6], q[7])),
            );
            let sum = vaddvq_s32(s4);
            let s = f16::from_f32(d * sum as f32).to_bits();
            std::ptr::write_unaligned(y.add(2) as *mut u16, s);
            y.add(4)
        } else {
            y.add(2)
        };
        vst1q_s8(qs as *mut i8, narrow16(q[0], q[1], q[2], q[3]));
        vst1q_s8(qs.add(16) as *mut i8, narrow16(q[4], q[5], q[6], q[7]));
    }
}

/// One `Q8_K` block from 256 floats: `scalar::quantize_row_q8_k`'s operations (the first
/// element of largest magnitude, with its sign, maps to -127).
///
/// # Safety
/// `x` valid for 256 floats, `y` for 292 bytes.
unsafe fn q8k_block(x: *const f32, y: *mut u8) {
    // SAFETY: caller's contract for all loads and stores.
    unsafe {
        let mut m = vdupq_n_f32(0.0);
        for i in 0..64 {
            m = vmaxnmq_f32(m, vabsq_f32(vld1q_f32(x.add(4 * i))));
        }
        let am = vmaxnmvq_f32(m);
        if am == 0.0 || am.is_nan() {
            // As the reference (which never raises its maximum above 0 in either case).
            std::ptr::write_bytes(y, 0, 292);
            return;
        }
        let mut max = am;
        for i in 0..256 {
            let v = *x.add(i);
            if v.abs() == am {
                max = v;
                break;
            }
        }
        let iscale = -127.0 / max;
        let cap = vdupq_n_s32(127);
        let qs = y.add(4);
        let bsums = y.add(260);
        for g in 0..16 {
            let q: [int32x4_t; 4] = std::array::from_fn(|k| {
                let v = vld1q_f32(x.add(16 * g + 4 * k));
                vminq_s32(vcvtnq_s32_f32(vmulq_n_f32(v, iscale)), cap)
            });
            vst1q_s8(qs.add(16 * g) as *mut i8, narrow16(q[0], q[1], q[2], q[3]));
            let s = vaddvq_s32(vaddq_s32(vaddq_s32(q[0], q[1]), vaddq_s32(q[2], q[3])));
            std::ptr::write_unaligned(bsums.add(2 * g) as *mut i16, s as i16);
        }
        std::ptr::write_unaligned(y as *mut f32, 1.0 / iscale);
    }
}

// ---- the 32-element block types -------------------------------------------------------------

/// How one weight block of a 32-element type unpacks: its quants as two 16-byte halves
/// (elements 0..16 and 16..32; signed, or unsigned below 32 for types with a min) and where its
/// fields and its activation block's lie.
trait Legacy {
    /// Weight and activation block bytes.
    const WB: usize;
    const AB: usize;
    /// Whether the type has a min (`m` at byte 2 of the weight block, `s` at byte 2 of the
    /// `Q8_1` block).
    const MIN: bool;
    /// The 32 quants.
    ///
    /// # Safety
    /// `x` points at a whole weight block.
    unsafe fn quants(x: *const u8) -> (int8x16_t, int8x16_t);
}

/// Low nibbles (elements 0..16) and high nibbles (16..32) of the 16 bytes at `p`.
///
/// # Safety
/// `p` valid for 16 bytes.
#[inline(always)]
unsafe fn nibbles(p: *const u8) -> (uint8x16_t, uint8x16_t) {
    // SAFETY: caller's contract.
    unsafe {
        let q = ld_u8(p);
        (vandq_u8(q, vdupq_n_u8(0x0f)), vshrq_n_u8::<4>(q))
    }
}

struct L4_0;
impl Legacy for L4_0 {
    const WB: usize = 18;
    const AB: usize = 34;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn quants(x: *const u8) -> (int8x16_t, int8x16_t) {
        // SAFETY: whole block (quants at +2).
        unsafe {
            let (lo, hi) = nibbles(x.add(2));
            let eight = vdupq_n_s8(8);
            (
                vsubq_s8(vreinterpretq_s8_u8(lo), eight),
                vsubq_s8(vreinterpretq_s8_u8(hi), eight),
            )
        }
    }
}

struct L4_1;
impl Legacy for L4_1 {
    const WB: usize = 20;
    const AB: usize = 36;
    const MIN: bool = true;
    #[inline(always)]
    unsafe fn quants(x: *const u8) -> (int8x16_t, int8x16_t) {
        // SAFETY: whole block (quants at +4).
        unsafe {
            let (lo, hi) = nibbles(x.add(4));
            (vreinterpretq_s8_u8(lo), vreinterpretq_s8_u8(hi))
        }
    }
}

struct L5_0;
impl Legacy for L5_0 {
    const WB: usize = 22;
    const AB: usize = 34;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn quants(x: *const u8) -> (int8x16_t, int8x16_t) {
        // SAFETY: whole block (high bits at +2, quants at +6).
        unsafe {
            let (b0, b1) = bits32(x.add(2));
            let (lo, hi) = nibbles(x.add(6));
            // Without the fifth bit the value is q - 16: OR-ing 0xF0 into the nibble makes
            // exactly that signed byte; with it, q itself (16..31) minus 16 is the nibble.
            let f0 = vdupq_n_u8(0xF0);
            (
                vreinterpretq_s8_u8(vorrq_u8(lo, vbicq_u8(f0, b0))),
                vreinterpretq_s8_u8(vorrq_u8(hi, vbicq_u8(f0, b1))),
            )
        }
    }
}

struct L5_1;
impl Legacy for L5_1 {
    const WB: usize = 24;
    const AB: usize = 36;
    const MIN: bool = true;
    #[inline(always)]
    unsafe fn quants(x: *const u8) -> (int8x16_t, int8x16_t) {
        // SAFETY: whole block (high bits at +4, quants at +8).
        unsafe {
            let (b0, b1) = bits32(x.add(4));
            let (lo, hi) = nibbles(x.add(8));
            let h = vdupq_n_u8(0x10);
            (
                vreinterpretq_s8_u8(vorrq_u8(lo, vandq_u8(h, b0))),
                vreinterpretq_s8_u8(vorrq_u8(hi, vandq_u8(h, b1))),
            )
        }
    }
}

struct L8_0;
impl Legacy for L8_0 {
    const WB: usize = 34;
    const AB: usize = 34;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn quants(x: *const u8) -> (int8x16_t, int8x16_t) {
        // SAFETY: whole block (quants at +2).
        unsafe { (ld_s8(x.add(2)), ld_s8(x.add(18))) }
    }
}

/// One weight row against `T` activation rows (`stride` bytes apart, `T` <= 4): each weight
/// block is unpacked once for all `T` rows, and every (row, token) result is the reference's,
/// computed in its order.
trait RowDot {
    /// # Safety
    /// `w`: one row of `nb` weight blocks; `a`: `T` activation rows of `nb` blocks each,
    /// `stride` bytes apart; with `DP` forms, a CPU with `sdot`.
    unsafe fn dot<const T: usize>(nb: usize, w: *const u8, a: *const u8, stride: usize)
        -> [f32; T];
}

/// `scalar::Lanes8`'s final sum: `((h0 + h2) + (h1 + h3)) + summs`, `h_j = lane_{j+4} + lane_j`.
#[inline(always)]
fn lanes8_finish(lo: float32x4_t, hi: float32x4_t, summs: f32) -> f32 {
    // SAFETY: plain NEON.
    unsafe {
        let h = vaddq_f32(hi, lo);
        let (h0, h1, h2, h3) = (
            vgetq_lane_f32::<0>(h),
            vgetq_lane_f32::<1>(h),
            vgetq_lane_f32::<2>(h),
            vgetq_lane_f32::<3>(h),
        );
        ((h0 + h2) + (h1 + h3)) + summs
    }
}

/// A 32-element type in llama.cpp's order (`scalar::Lanes8`): lane `j` of `lo` / `hi` (lanes
/// 0..4 / 4..8) takes `fma(d_w * d_y, isum_j, lane)` block by block, the min terms
/// `summs = fma(m_w, s_y, summs)`.
struct Ggml<B, const DP: bool>(PhantomData<B>);

impl<B: Legacy, const DP: bool> RowDot for Ggml<B, DP> {
    #[inline(always)]
    unsafe fn dot<const T: usize>(
        nb: usize,
        w: *const u8,
        a: *const u8,
        stride: usize,
    ) -> [f32; T] {
        let qo = B::AB - 32;
        // SAFETY: block i of each row lies within the caller's ranges; the rest is plain NEON.
        unsafe {
            let mut lo = [vdupq_n_f32(0.0); T];
            let mut hi = [vdupq_n_f32(0.0); T];
            let mut summs = [0f32; T];
            for i in 0..nb {
                let x = w.add(B::WB * i);
                let (q0, q1) = B::quants(x);
                let dx = h2f(x);
                for k in 0..T {
                    let y = a.add(k * stride + B::AB * i);
                    if B::MIN {
                        summs[k] = h2f(x.add(2)).mul_add(h2f(y.add(2)), summs[k]);
                    }
                    let d = dx * h2f(y);
                    let z = vdupq_n_s32(0);
                    let i0 = dot4::<DP>(z, q0, ld_s8(y.add(qo)));
                    let i1 = dot4::<DP>(z, q1, ld_s8(y.add(qo + 16)));
                    lo[k] = vfmaq_n_f32(lo[k], vcvtq_f32_s32(i0), d);
                    hi[k] = vfmaq_n_f32(hi[k], vcvtq_f32_s32(i1), d);
                }
            }
            std::array::from_fn(|k| lanes8_finish(lo[k], hi[k], summs[k]))
        }
    }
}

/// A 32-element type in the whole-block order (`scalar::BlockSums`): per block the exact i32
/// sum, `acc = fma(d_w * d_y, isum, acc)`; the min terms their own chain; `acc + summs`.
struct Whole<B, const DP: bool>(PhantomData<B>);

impl<B: Legacy, const DP: bool> RowDot for Whole<B, DP> {
    #[inline(always)]
    unsafe fn dot<const T: usize>(
        nb: usize,
        w: *const u8,
        a: *const u8,
        stride: usize,
    ) -> [f32; T] {
        let qo = B::AB - 32;
        let (mut acc, mut summs) = ([0f32; T], [0f32; T]);
        // SAFETY: as in `Ggml::dot`.
        unsafe {
            for i in 0..nb {
                let x = w.add(B::WB * i);
                let (q0, q1) = B::quants(x);
                let dx = h2f(x);
                for k in 0..T {
                    let y = a.add(k * stride + B::AB * i);
                    let isum = idot32::<DP>(q0, q1, ld_s8(y.add(qo)), ld_s8(y.add(qo + 16)));
                    acc[k] = (dx * h2f(y)).mul_add(isum as f32, acc[k]);
                    if B::MIN {
                        summs[k] = h2f(x.add(2)).mul_add(h2f(y.add(2)), summs[k]);
                    }
                }
            }
        }
        std::array::from_fn(|k| acc[k] + summs[k])
    }
}

// ---- K-quants (Q8_K activations: d f32 at 0, qs at 4, bsums i16 at 260) ---------------------

/// The `bsums` entry `sb` of the Q8_K block at `y`.
///
/// # Safety
/// `y` a whole Q8_K block, `sb < 16`.
#[inline(always)]
unsafe fn bsum(y: *const u8, sb: usize) -> i32 {
    // SAFETY: caller's contract.
    unsafe { std::ptr::read_unaligned(y.add(260 + 2 * sb) as *const i16) as i32 }
}

/// `Q2_K` · `Q8_K` (`scalar::dot_q2_k`).
struct Q2Kd<const DP: bool>;

impl<const DP: bool> RowDot for Q2Kd<DP> {
    #[inline(always)]
    unsafe fn dot<const T: usize>(
        nb: usize,
        w: *const u8,
        a: *const u8,
        stride: usize,
    ) -> [f32; T] {
        let mut sum = [0f32; T];
        // SAFETY: block i of each row lies within the caller's ranges.
        unsafe {
            let m3 = vdupq_n_u8(3);
            for i in 0..nb {
                let x = w.add(84 * i);
                let y0 = a.add(292 * i);
                let sc = std::slice::from_raw_parts(x, 16);
                let mut isum = [0i32; T];
                for h in 0..2 {
                    let q0 = ld_u8(x.add(16 + 32 * h));
                    let q1 = ld_u8(x.add(16 + 32 * h + 16));
                    for s in 0..4 {
                        // Element e = 128h + 32s + l: bits 2s of qs[32h + l]; sub-block e / 16.
                        let sh = vdupq_n_s8(-2 * s as i8);
                        let a0 = vreinterpretq_s8_u8(vandq_u8(vshlq_u8(q0, sh), m3));
                        let a1 = vreinterpretq_s8_u8(vandq_u8(vshlq_u8(q1, sh), m3));
                        let yo = 4 + 128 * h + 32 * s;
                        let sb = 8 * h + 2 * s;
                        let (s0, s1) = ((sc[sb] & 0x0f) as i32, (sc[sb + 1] & 0x0f) as i32);
                        for (k, is) in isum.iter_mut().enumerate() {
                            let yq = y0.add(k * stride + yo);
                            *is += s0 * idot16::<DP>(a0, ld_s8(yq))
                                + s1 * idot16::<DP>(a1, ld_s8(yq.add(16)));
                        }
                    }
                }
                let (d, dmin) = (h2f(x.add(80)), h2f(x.add(82)));
                for k in 0..T {
                    let y = y0.add(k * stride);
                    let mut msum = 0i32;
                    for (sb, &s) in sc.iter().enumerate() {
                        msum += (s >> 4) as i32 * bsum(y, sb);
                    }
                    sum[k] = tiled_step(sum[k], isum[k], Some((dmin, msum)), d, rd_f32(y));
                }
            }
        }
        sum
    }
}

/// `Q3_K` · `Q8_K` (`scalar::dot_q3_k`).
struct Q3Kd<const DP: bool>;

impl<const DP: bool> RowDot for Q3Kd<DP> {
    #[inline(always)]
    unsafe fn dot<const T: usize>(
        nb: usize,
        w: *const u8,
        a: *const u8,
        stride: usize,
    ) -> [f32; T] {
        let mut sum = [0f32; T];
        // SAFETY: block i of each row lies within the caller's ranges.
        unsafe {
            let m3 = vdupq_n_u8(3);
            let four = vdupq_n_u8(4);
            for i in 0..nb {
                let x = w.add(110 * i);
                let y0 = a.add(292 * i);
                let scales: &[u8; 12] = &*(x.add(96) as *const [u8; 12]);
                let sc = q3k_scales(scales);
                let hm0 = ld_u8(x);
                let hm1 = ld_u8(x.add(16));
                let mut isum = [0i32; T];
                for h in 0..2 {
                    let q0 = ld_u8(x.add(32 + 32 * h));
                    let q1 = ld_u8(x.add(32 + 32 * h + 16));
                    for s in 0..4 {
                        // Element e = 128h + 32s + l: 2 bits at 2s of qs[32h + l], high bit
                        // 4h + s of hmask[l]; the value is lo - 4 where that bit is clear.
                        let sh = vdupq_n_s8(-2 * s as i8);
                        let bit = vdupq_n_u8(1 << (4 * h + s));
                        let lo0 = vandq_u8(vshlq_u8(q0, sh), m3);
                        let lo1 = vandq_u8(vshlq_u8(q1, sh), m3);
                        let v0 =
                            vreinterpretq_s8_u8(vsubq_u8(lo0, vbicq_u8(four, vtstq_u8(hm0, bit))));
                        let v1 =
                            vreinterpretq_s8_u8(vsubq_u8(lo1, vbicq_u8(four, vtstq_u8(hm1, bit))));
                        let yo = 4 + 128 * h + 32 * s;
                        let sb = 8 * h + 2 * s;
                        let (s0, s1) = (sc[sb] as i32, sc[sb + 1] as i32);
                        for (k, is) in isum.iter_mut().enumerate() {
                            let yq = y0.add(k * stride + yo);
                            *is += s0 * idot16::<DP>(v0, ld_s8(yq))
                                + s1 * idot16::<DP>(v1, ld_s8(yq.add(16)));
                        }
                    }
                }
                let d = h2f(x.add(108));
                for k in 0..T {
                    let yd = rd_f32(y0.add(k * stride));
                    sum[k] = tiled_step(sum[k], isum[k], None, d, yd);
                }
            }
        }
        sum
    }
}

/// The 32 quants of sub-block `j` of a `Q4_K` (`HIGH = false`) or `Q5_K` block, as two
/// 16-byte halves, with the sub-block's scale and min.
///
/// # Safety
/// `x` a whole Q4_K/Q5_K block.
#[inline(always)]
unsafe fn q45_quants<const HIGH: bool>(
    x: *const u8,
    j: usize,
    scales: &[u8; 12],
) -> (int8x16_t, int8x16_t, i32, i32) {
    // SAFETY: caller's contract.
    unsafe {
        let (sc, m) = k4_scale_min(j, scales);
        // Sub-block j = 2c + half: nibble `half` of qs[32c .. 32c + 32].
        let (c, half) = (j / 2, j % 2);
        let qs = x.add(if HIGH { 48 } else { 16 } + 32 * c);
        let sh = vdupq_n_s8(-4 * half as i8);
        let mask = vdupq_n_u8(0x0f);
        let mut q0 = vandq_u8(vshlq_u8(ld_u8(qs), sh), mask);
        let mut q1 = vandq_u8(vshlq_u8(ld_u8(qs.add(16)), sh), mask);
        if HIGH {
            // The fifth bit of element l is bit j of qh[l].
            let bit = vdupq_n_u8(1 << j);
            let h = vdupq_n_u8(0x10);
            q0 = vorrq_u8(q0, vandq_u8(vtstq_u8(ld_u8(x.add(16)), bit), h));
            q1 = vorrq_u8(q1, vandq_u8(vtstq_u8(ld_u8(x.add(32)), bit), h));
        }
        (
            vreinterpretq_s8_u8(q0),
            vreinterpretq_s8_u8(q1),
            sc as i32,
            m as i32,
        )
    }
}

/// How a Q4_K / Q5_K row combines its sub-blocks' integer sums in f32.
#[derive(Clone, Copy, PartialEq, Eq)]
enum K45 {
    /// `scalar::dot_q4_k`: the scales applied per pair of sub-blocks into `acc` and `accm`.
    Q4Pairs,
    /// `scalar::dot_q4_k_gemv`: per super-block into `acc` and `accm`.
    Q4Gemv,
    /// `scalar::dot_q5_k`: per super-block through `tiled_step`.
    Q5,
}

/// `Q4_K` / `Q5_K` · `Q8_K` in the order `MODE` names (a [`K45`] as its index).
struct Q45K<const MODE: u8, const DP: bool>;

impl<const MODE: u8, const DP: bool> Q45K<MODE, DP> {
    const MODE: K45 = match MODE {
        0 => K45::Q4Pairs,
        1 => K45::Q4Gemv,
        _ => K45::Q5,
    };
}

impl<const MODE: u8, const DP: bool> RowDot for Q45K<MODE, DP> {
    #[inline(always)]
    unsafe fn dot<const T: usize>(
        nb: usize,
        w: *const u8,
        a: *const u8,
        stride: usize,
    ) -> [f32; T] {
        let mode = Self::MODE;
        let high = mode == K45::Q5;
        let wb = if high { 176 } else { 144 };
        let (mut acc, mut accm) = ([0f32; T], [0f32; T]);
        // SAFETY: block i of each row lies within the caller's ranges.
        unsafe {
            for i in 0..nb {
                let x = w.add(wb * i);
                let y0 = a.add(292 * i);
                let scales: &[u8; 12] = &*(x.add(4) as *const [u8; 12]);
                let (xd, xm) = (h2f(x), h2f(x.add(2)));
                // Per token: the integer sums of the current pair (or whole block).
                let (mut isum, mut msum) = ([0i32; T], [0i32; T]);
                for j in 0..8 {
                    let (q0, q1, sc, m) = if high {
                        q45_quants::<true>(x, j, scales)
                    } else {
                        q45_quants::<false>(x, j, scales)
                    };
                    for k in 0..T {
                        let y = y0.add(k * stride);
                        let yq = y.add(4 + 32 * j);
                        let d = idot32::<DP>(q0, q1, ld_s8(yq), ld_s8(yq.add(16)));
                        isum[k] += sc * d;
                        msum[k] += m * (bsum(y, 2 * j) + bsum(y, 2 * j + 1));
                    }
                    if mode == K45::Q4Pairs && j % 2 == 1 {
                        for k in 0..T {
                            let yd = rd_f32(y0.add(k * stride));
                            acc[k] = (isum[k] as f32).mul_add(xd * yd, acc[k]);
                            accm[k] = (msum[k] as f32).mul_add(xm * yd, accm[k]);
                            isum[k] = 0;
                            msum[k] = 0;
                        }
                    }
                }
                for k in 0..T {
                    let yd = rd_f32(y0.add(k * stride));
                    match mode {
                        K45::Q4Pairs => {}
                        K45::Q4Gemv => {
                            acc[k] = (isum[k] as f32).mul_add(xd * yd, acc[k]);
                            accm[k] = (msum[k] as f32).mul_add(xm * yd, accm[k]);
                        }
                        K45::Q5 => {
                            acc[k] = tiled_step(acc[k], isum[k], Some((xm, msum[k])), xd, yd);
                        }
                    }
                }
            }
        }
        std::array::from_fn(|k| if high { acc[k] } else { acc[k] - accm[k] })
    }
}

/// `Q6_K` · `Q8_K` (`scalar::dot_q6_k`).
struct Q6Kd<const DP: bool>;

impl<const DP: bool> RowDot for Q6Kd<DP> {
    #[inline(always)]
    unsafe fn dot<const T: usize>(
        nb: usize,
        w: *const u8,
        a: *const u8,
        stride: usize,
    ) -> [f32; T] {
        let mut sum = [0f32; T];
        // SAFETY: block i of each row lies within the caller's ranges.
        unsafe {
            let m4 = vdupq_n_u8(0x0f);
            let m3 = vdupq_n_u8(3);
            let off = vdupq_n_u8(32);
            for i in 0..nb {
                let x = w.add(210 * i);
                let y0 = a.add(292 * i);
                let sc = x.add(192) as *const i8;
                let mut isum = [0i32; T];
                for h in 0..2 {
                    let qh0 = ld_u8(x.add(128 + 32 * h));
                    let qh1 = ld_u8(x.add(128 + 32 * h + 16));
                    for s in 0..4 {
                        // Element e = 128h + 32s + l: low 4 bits are nibble s >> 1 of
                        // ql[64h + 32(s & 1) + l], high 2 bits at 2s of qh[32h + l]; value - 32.
                        let ql = x.add(64 * h + 32 * (s & 1));
                        let nsh = vdupq_n_s8(-4 * (s >> 1) as i8);
                        let hsh = vdupq_n_s8(-2 * s as i8);
                        let l0 = vandq_u8(vshlq_u8(ld_u8(ql), nsh), m4);
                        let l1 = vandq_u8(vshlq_u8(ld_u8(ql.add(16)), nsh), m4);
                        let h0 = vshlq_n_u8::<4>(vandq_u8(vshlq_u8(qh0, hsh), m3));
                        let h1 = vshlq_n_u8::<4>(vandq_u8(vshlq_u8(qh1, hsh), m3));
                        let v0 = vreinterpretq_s8_u8(vsubq_u8(vorrq_u8(l0, h0), off));
                        let v1 = vreinterpretq_s8_u8(vsubq_u8(vorrq_u8(l1, h1), off));
                        let yo = 4 + 128 * h + 32 * s;
                        let sb = 8 * h + 2 * s;
                        let (s0, s1) = (*sc.add(sb) as i32, *sc.add(sb + 1) as i32);
                        for (k, is) in isum.iter_mut().enumerate() {
                            let yq = y0.add(k * stride + yo);
                            *is += s0 * idot16::<DP>(v0, ld_s8(yq))
                                + s1 * idot16::<DP>(v1, ld_s8(yq.add(16)));
                        }
                    }
                }
                let d = h2f(x.add(208));
                for k in 0..T {
                    let yd = rd_f32(y0.add(k * stride));
                    sum[k] = tiled_step(sum[k], isum[k], None, d, yd);
                }
            }
        }
        sum
    }
}

// ---- float weights (f32 activations; a different summation order than the reference) --------

/// `sum(w[i] * a[i])` over f32, four vector accumulators.
///
/// # Safety
/// `w`, `a` valid for `n` floats each.
pub(crate) unsafe fn dot_f32(w: *const f32, a: *const f32, n: usize) -> f32 {
    // SAFETY: every access is below `n`.
    unsafe {
        let mut acc = [vdupq_n_f32(0.0); 4];
        let mut i = 0;
        while i + 16 <= n {
            for (k, acc) in acc.iter_mut().enumerate() {
                let j = i + 4 * k;
                *acc = vfmaq_f32(*acc, vld1q_f32(w.add(j)), vld1q_f32(a.add(j)));
            }
            i += 16;
        }
        let mut s = vaddvq_f32(vaddq_f32(
            vaddq_f32(acc[0], acc[1]),
            vaddq_f32(acc[2], acc[3]),
        ));
        while i < n {
            s += *w.add(i) * *a.add(i);
            i += 1;
        }
        s
    }
}

/// Eight f16 values at `p` as two f32 vectors (exact).
///
/// # Safety
/// `p` valid for 8 u16.
#[inline(always)]
pub(crate) unsafe fn f16x8(p: *const u16) -> (float32x4_t, float32x4_t) {
    // SAFETY: caller's contract. `fcvtl` / `fcvtl2` (half to single) are baseline ARMv8; the
    // f16 lanes are reinterpreted from their bits.
    unsafe {
        let h = vld1q_u16(p);
        let lo: float32x4_t;
        let hi: float32x4_t;
        std::arch::asm!(
            "fcvtl {lo:v}.4s, {h:v}.4h",
            "fcvtl2 {hi:v}.4s, {h:v}.8h",
            h = in(vreg) h,
            lo = out(vreg) lo,
            hi = out(vreg) hi,
            options(pure, nomem, nostack, preserves_flags),
        );
        (lo, hi)
    }
}

/// `sum(h[i] * a[i])` with `h` in f16.
///
/// # Safety
/// `a` valid for `n` floats, `h` for `n` f16.
pub(crate) unsafe fn dot_f32_f16(a: *const f32, h: *const u16, n: usize) -> f32 {
    // SAFETY: every access is below `n`.
    unsafe {
        let mut acc = [vdupq_n_f32(0.0); 4];
        let mut i = 0;
        while i + 16 <= n {
            let (w0, w1) = f16x8(h.add(i));
            let (w2, w3) = f16x8(h.add(i + 8));
            acc[0] = vfmaq_f32(acc[0], w0, vld1q_f32(a.add(i)));
            acc[1] = vfmaq_f32(acc[1], w1, vld1q_f32(a.add(i + 4)));
            acc[2] = vfmaq_f32(acc[2], w2, vld1q_f32(a.add(i + 8)));
            acc[3] = vfmaq_f32(acc[3], w3, vld1q_f32(a.add(i + 12)));
            i += 16;
        }
        let mut s = vaddvq_f32(vaddq_f32(
            vaddq_f32(acc[0], acc[1]),
            vaddq_f32(acc[2], acc[3]),
        ));
        while i < n {
            s += f16::from_bits(*h.add(i)).to_f32() * *a.add(i);
            i += 1;
        }
        s
    }
}

/// `y[i] += c * h[i]` with `h` in f16 (the reference's rounding: a product, then a sum).
///
/// # Safety
/// `y` valid for `n` floats, `h` for `n` f16.
pub(crate) unsafe fn axpy_f16(y: *mut f32, c: f32, h: *const u16, n: usize) {
    // SAFETY: every access is below `n`.
    unsafe {
        let mut i = 0;
        while i + 8 <= n {
            let (x0, x1) = f16x8(h.add(i));
            let y0 = vaddq_f32(vld1q_f32(y.add(i)), vmulq_n_f32(x0, c));
            let y1 = vaddq_f32(vld1q_f32(y.add(i + 4)), vmulq_n_f32(x1, c));
            vst1q_f32(y.add(i), y0);
            vst1q_f32(y.add(i + 4), y1);
            i += 8;
        }
        while i < n {
            *y.add(i) += c * f16::from_bits(*h.add(i)).to_f32();
            i += 1;
        }
    }
}

/// # Safety
/// `w`: `n` bf16; `a`: `n` f32.
unsafe fn dot_bf16w(n: usize, w: *const u8, a: *const u8) -> f32 {
    let (w, a) = (w as *const u16, a as *const f32);
    // SAFETY: every access is below `n`.
    unsafe {
        let mut acc = [vdupq_n_f32(0.0); 2];
        let mut i = 0;
        while i + 8 <= n {
            let h = vld1q_u16(w.add(i));
            let lo = vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(h)));
            let hi = vreinterpretq_f32_u32(vshll_high_n_u16::<16>(h));
            acc[0] = vfmaq_f32(acc[0], lo, vld1q_f32(a.add(i)));
            acc[1] = vfmaq_f32(acc[1], hi, vld1q_f32(a.add(i + 4)));
            i += 8;
        }
        let mut s = vaddvq_f32(vaddq_f32(acc[0], acc[1]));
        while i < n {
            s += f32::from_bits((*w.add(i) as u32) << 16) * *a.add(i);
            i += 1;
        }
        s
    }
}

/// # Safety
/// `w`: `n` f32; `a`: `n` f32.
unsafe fn dot_f32w(n: usize, w: *const u8, a: *const u8) -> f32 {
    // SAFETY: forwarded.
    unsafe { dot_f32(w as *const f32, a as *const f32, n) }
}

/// # Safety
/// `w`: `n` f16; `a`: `n` f32.
unsafe fn dot_f16w(n: usize, w: *const u8, a: *const u8) -> f32 {
    // SAFETY: forwarded.
    unsafe { dot_f32_f16(a as *const f32, w as *const u16, n) }
}

// ---- tiles ------------------------------------------------------------------------------------

/// Float weights: each token by its own row-dot (no unpacking to share).
macro_rules! float_rowdot {
    ($name:ident, $f:ident) => {
        struct $name;
        impl RowDot for $name {
            #[inline(always)]
            unsafe fn dot<const T: usize>(
                nb: usize,
                w: *const u8,
                a: *const u8,
                stride: usize,
            ) -> [f32; T] {
                // SAFETY: forwarded: token k's row starts `k * stride` bytes in.
                std::array::from_fn(|k| unsafe { $f(nb, w, a.add(k * stride)) })
            }
        }
    };
}
float_rowdot!(F32W, dot_f32w);
float_rowdot!(F16W, dot_f16w);
float_rowdot!(BF16W, dot_bf16w);

/// Store one row's results for tokens `k..k + o.len()`.
///
/// # Safety
/// The [`Tile`] contract covers row `r` and those tokens.
#[inline(always)]
unsafe fn put(t: &Tile, r: usize, k: usize, o: &[f32]) {
    for (j, v) in o.iter().enumerate() {
        // SAFETY: caller's contract.
        unsafe { *t.out.add((k + j) * t.out_stride + r) = *v };
    }
}

/// Every (row, token) of a tile: per row, the tokens four at a time, then the rest.
///
/// # Safety
/// The [`Tile`] contract (and, with a `DP` form of `D`, a CPU with `sdot`).
unsafe fn tile<D: RowDot>(t: &Tile) {
    for r in 0..t.rows {
        // SAFETY: the tile contract covers row r and every token's row and output.
        unsafe {
            let w = t.w.add(r * t.w_stride);
            let mut k = 0;
            while k < t.toks {
                let a = t.a.add(k * t.a_stride);
                let n = (t.toks - k).min(4);
                match n {
                    4 => put(t, r, k, &D::dot::<4>(t.nb, w, a, t.a_stride)),
                    3 => put(t, r, k, &D::dot::<3>(t.nb, w, a, t.a_stride)),
                    2 => put(t, r, k, &D::dot::<2>(t.nb, w, a, t.a_stride)),
                    _ => put(t, r, k, &D::dot::<1>(t.nb, w, a, t.a_stride)),
                }
                k += n;
            }
        }
    }
}

fn tile_for<const DP: bool>(ty: GgmlType, order: SumOrder) -> Option<TileFn> {
    use GgmlType::*;
    let block = order == SumOrder::Block;
    Some(match ty {
        Q4_0 if block => tile::<Whole<L4_0, DP>>,
        Q4_1 if block => tile::<Whole<L4_1, DP>>,
        Q5_0 if block => tile::<Whole<L5_0, DP>>,
        Q5_1 if block => tile::<Whole<L5_1, DP>>,
        Q8_0 if block => tile::<Whole<L8_0, DP>>,
        Q4_0 => tile::<Ggml<L4_0, DP>>,
        Q4_1 => tile::<Ggml<L4_1, DP>>,
        Q5_0 => tile::<Ggml<L5_0, DP>>,
        Q5_1 => tile::<Ggml<L5_1, DP>>,
        Q8_0 => tile::<Ggml<L8_0, DP>>,
        Q2K => tile::<Q2Kd<DP>>,
        Q3K => tile::<Q3Kd<DP>>,
        Q4K => tile::<Q45K<0, DP>>,
        Q5K => tile::<Q45K<2, DP>>,
        Q6K => tile::<Q6Kd<DP>>,
        F32 => tile::<F32W>,
        F16 => tile::<F16W>,
        BF16 => tile::<BF16W>,
        _ => return None,
    })
}

fn kernel_of(tile: TileFn) -> Kernel {
    Kernel {
        mr: 4,
        nt: 4,
        mr1: 4,
        exact_rows: false,
        tile,
    }
}

/// The NEON kernel for `ty` in summation order `order` (the `sdot` form where the CPU has it).
pub(crate) fn kernel(ty: GgmlType, order: SumOrder) -> Option<Kernel> {
    let tile = if has_dotprod() {
        tile_for::<true>(ty, order)
    } else {
        tile_for::<false>(ty, order)
    }?;
    Some(kernel_of(tile))
}

/// The kernel for the tokens left over from groups of 4 where the reference rounds them
/// differently (`Q4_K`: `scalar::dot_q4_k_gemv`'s order), as `kernels::tail_kernel` says.
pub(crate) fn tail_kernel(ty: GgmlType) -> Option<Kernel> {
    if ty != GgmlType::Q4K {
        return None;
    }
    let tile: TileFn = if has_dotprod() {
        tile::<Q45K<1, true>>
    } else {
        tile::<Q45K<1, false>>
    };
    Some(kernel_of(tile))
}
