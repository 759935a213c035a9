//! Scalar reference kernels: activation quantization and one dot product per weight type.
//!
//! These define the results every SIMD path must reproduce. Activation quantizers follow ggml's
//! x86 code exactly (so quantized activations are bit-identical to ggml's on AVX2 machines):
//! `Q8_0`/`Q8_1` scale by `127 / amax` and round half to even; `Q8_1` stores
//! `s = f16(d * sum(q))` with the unrounded f32 `d`; `Q8_K` follows `quantize_row_q8_K_ref`.
//!
//! Dot products do the integer work exactly and combine it in f32 in the order of operations of
//! ggml's x86 kernels (see `Lanes8` for the 32-element types), so that they round as llama.cpp
//! does; the `*_block` functions are the references of the whole-block order of the 32-element
//! types ([`super::SumOrder::Block`], `BlockSums`). Inputs are
//! byte slices holding whole blocks (callers check lengths); blocks are copied out with
//! unaligned reads, so no alignment is required.

use crate::blocks::*;
use half::f16;

/// Copy the blocks out of `bytes` (a whole number of `T`s).
#[inline(always)]
fn blocks<T: Block>(bytes: &[u8]) -> impl Iterator<Item = T> + '_ {
    bytes.chunks_exact(std::mem::size_of::<T>()).map(|c| {
        // SAFETY: `chunks_exact` yields exactly `size_of::<T>()` bytes; `Block` types are plain
        // data valid for every bit pattern; `read_unaligned` has no alignment requirement.
        unsafe { std::ptr::read_unaligned(c.as_ptr() as *const T) }
    })
}

/// Store `b` into `dst` (exactly one block long).
#[inline(always)]
fn put<T: Block>(b: &T, dst: &mut [u8]) {
    dst.copy_from_slice(blocks_as_bytes(std::slice::from_ref(b)));
}

/// Largest absolute value (0 for an empty slice; NaNs are skipped).
#[inline]
fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// Quantize `x` (a multiple of 32 long) into `Q8_0` blocks in `y` (34 bytes per block).
pub fn quantize_row_q8_0(x: &[f32], y: &mut [u8]) {
    for (xb, yb) in x.chunks_exact(QK).zip(y.chunks_exact_mut(34)) {
        let am = amax(xb);
        let d = am / 127.0;
        let id = if am != 0.0 { 127.0 / am } else { 0.0 };
        let mut b = BlockQ8_0 {
            d: f16::from_f32(d),
            qs: [0; QK],
        };
        for (q, v) in b.qs.iter_mut().zip(xb) {
            *q = (v * id).round_ties_even() as i8;
        }
        put(&b, yb);
    }
}

/// Quantize `x` (a multiple of 32 long) into `Q8_1` blocks in `y` (36 bytes per block).
pub fn quantize_row_q8_1(x: &[f32], y: &mut [u8]) {
    for (xb, yb) in x.chunks_exact(QK).zip(y.chunks_exact_mut(36)) {
        let am = amax(xb);
        let d = am / 127.0;
        let id = if am != 0.0 { 127.0 / am } else { 0.0 };
        let mut b = BlockQ8_1 {
            d: f16::from_f32(d),
            s: f16::ZERO,
            qs: [0; QK],
        };
        let mut sum = 0i32;
        for (q, v) in b.qs.iter_mut().zip(xb) {
            *q = (v * id).round_ties_even() as i8;
            sum += *q as i32;
        }
        b.s = f16::from_f32(d * sum as f32);
        put(&b, yb);
    }
}

/// Quantize `x` (a multiple of 256 long) into `Q8_K` blocks in `y` (292 bytes per block).
pub fn quantize_row_q8_k(x: &[f32], y: &mut [u8]) {
    for (xb, yb) in x.chunks_exact(QK_K).zip(y.chunks_exact_mut(292)) {
        let mut b = BlockQ8K {
            d: 0.0,
            qs: [0; QK_K],
            bsums: [0; QK_K / 16],
        };
        // The signed value of the first element of largest magnitude: its sign makes it map to
        // exactly -127.
        let mut am = 0f32;
        let mut max = 0f32;
        for &v in xb {
            if v.abs() > am {
                am = v.abs();
                max = v;
            }
        }
        if am != 0.0 {
            let iscale = -127.0 / max;
            for (q, v) in b.qs.iter_mut().zip(xb) {
                *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
            }
            for (s, qs) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
                *s = qs.iter().map(|&q| q as i16).sum();
            }
            b.d = 1.0 / iscale;
        }
        put(&b, yb);
    }
}

/// Copy f32 activations into their byte form (little-endian, native on every supported target).
pub fn quantize_row_f32(x: &[f32], y: &mut [u8]) {
    for (v, d) in x.iter().zip(y.chunks_exact_mut(4)) {
        d.copy_from_slice(&v.to_le_bytes());
    }
}

/// Unpack the 32 4-bit values of a legacy block: low nibbles are elements 0..16, high 16..32.
#[inline(always)]
fn nibbles(qs: &[u8; 16]) -> [i8; 32] {
    let mut q = [0i8; 32];
    for j in 0..16 {
        q[j] = (qs[j] & 0x0f) as i8;
        q[j + 16] = (qs[j] >> 4) as i8;
    }
    q
}

/// Add the fifth bits (`qh` bit j belongs to element j) to 4-bit values.
#[inline(always)]
fn add_high_bits(q: &mut [i8; 32], qh: [u8; 4]) {
    let h = u32::from_le_bytes(qh);
    for (j, v) in q.iter_mut().enumerate() {
        *v |= (((h >> j) & 1) << 4) as i8;
    }
}

/// How the per-block integer sums of a 32-element block type become one f32 result: the two
/// summation orders of [`super::SumOrder`]. `block` takes one block's quants (weights already
/// as signed values, or unsigned for types with a min) and activation quants with
/// `d = d_w * d_y` (an f32 product of the two f16 scales); `min` takes one block's `m_w`, `s_y`.
trait Combine {
    fn new() -> Self;
    fn block(&mut self, q: &[i8; 32], y: &[i8; 32], d: f32);
    fn min(&mut self, m: f32, s: f32);
    fn finish(&self) -> f32;
}

/// The order of operations of ggml's x86 `vec_dot` for the 32-element block types (and of
/// llamafile's Q8_0 kernel, the same): eight f32 lanes, lane `j` accumulating, block by block,
/// `fma(d_w * d_y, isum_j, lane)` where `isum_j` is the integer dot of the block's elements
/// `4j..4j+4`; then ggml's `hsum_float_8` (halves, then pairs) plus the separately fma-summed
/// min terms `m * s`. Matching it makes our products bit-identical to llama.cpp's
/// ([`super::SumOrder::Ggml`]).
struct Lanes8 {
    acc: [f32; 8],
    summs: f32,
}

impl Combine for Lanes8 {
    fn new() -> Lanes8 {
        Lanes8 {
            acc: [0.0; 8],
            summs: 0.0,
        }
    }

    #[inline(always)]
    fn block(&mut self, q: &[i8; 32], y: &[i8; 32], d: f32) {
        for (j, a) in self.acc.iter_mut().enumerate() {
            let i: i32 = (4 * j..4 * j + 4).map(|e| q[e] as i32 * y[e] as i32).sum();
            *a = d.mul_add(i as f32, *a);
        }
    }

    #[inline(always)]
    fn min(&mut self, m: f32, s: f32) {
        self.summs = m.mul_add(s, self.summs);
    }

    fn finish(&self) -> f32 {
        let a = &self.acc;
        let h = [a[4] + a[0], a[5] + a[1], a[6] + a[2], a[7] + a[3]];
        ((h[0] + h[2]) + (h[1] + h[3])) + self.summs
    }
}

/// Whole-block integer sums ([`super::SumOrder::Block`], defined there): per block the exact
/// i32 sum of the 32 products, then one `acc = fma(d_w * d_y, isum, acc)`; the min terms their
/// own chain `summs = fma(m_w, s_y, summs)`; the result `acc + summs`.
struct BlockSums {
    acc: f32,
    summs: f32,
}

impl Combine for BlockSums {
    fn new() -> BlockSums {
        BlockSums {
            acc: 0.0,
            summs: 0.0,
        }
    }

    #[inline(always)]
    fn block(&mut self, q: &[i8; 32], y: &[i8; 32], d: f32) {
        // Exact: |sum| <= 32 * 128 * 128 < 2^24, so the conversion is exact too.
        let i: i32 = q.iter().zip(y).map(|(&a, &b)| a as i32 * b as i32).sum();
        self.acc = d.mul_add(i as f32, self.acc);
    }

    #[inline(always)]
    fn min(&mut self, m: f32, s: f32) {
        self.summs = m.mul_add(s, self.summs);
    }

    fn finish(&self) -> f32 {
        self.acc + self.summs
    }
}

fn q4_0<C: Combine>(w: &[u8], a: &[u8]) -> f32 {
    let mut l = C::new();
    for (x, y) in blocks::<BlockQ4_0>(w).zip(blocks::<BlockQ8_0>(a)) {
        let mut q = nibbles(&x.qs);
        q.iter_mut().for_each(|v| *v -= 8);
        l.block(&q, &y.qs, x.d.to_f32() * y.d.to_f32());
    }
    l.finish()
}

fn q4_1<C: Combine>(w: &[u8], a: &[u8]) -> f32 {
    let mut l = C::new();
    for (x, y) in blocks::<BlockQ4_1>(w).zip(blocks::<BlockQ8_1>(a)) {
        l.min(x.m.to_f32(), y.s.to_f32());
        l.block(&nibbles(&x.qs), &y.qs, x.d.to_f32() * y.d.to_f32());
    }
    l.finish()
}

fn q5_0<C: Combine>(w: &[u8], a: &[u8]) -> f32 {
    let mut l = C::new();
    for (x, y) in blocks::<BlockQ5_0>(w).zip(blocks::<BlockQ8_0>(a)) {
        let mut q = nibbles(&x.qs);
        add_high_bits(&mut q, x.qh);
        q.iter_mut().for_each(|v| *v -= 16);
        l.block(&q, &y.qs, x.d.to_f32() * y.d.to_f32());
    }
    l.finish()
}

fn q5_1<C: Combine>(w: &[u8], a: &[u8]) -> f32 {
    let mut l = C::new();
    for (x, y) in blocks::<BlockQ5_1>(w).zip(blocks::<BlockQ8_1>(a)) {
        let mut q = nibbles(&x.qs);
        add_high_bits(&mut q, x.qh);
        l.min(x.m.to_f32(), y.s.to_f32());
        l.block(&q, &y.qs, x.d.to_f32() * y.d.to_f32());
    }
    l.finish()
}

fn q8_0<C: Combine>(w: &[u8], a: &[u8]) -> f32 {
    let mut l = C::new();
    for (x, y) in blocks::<BlockQ8_0>(w).zip(blocks::<BlockQ8_0>(a)) {
        l.block(&x.qs, &y.qs, x.d.to_f32() * y.d.to_f32());
    }
    l.finish()
}

/// `Q4_0` weights · `Q8_0` activations (ggml's order).
pub fn dot_q4_0(w: &[u8], a: &[u8]) -> f32 {
    q4_0::<Lanes8>(w, a)
}

/// `Q4_1` weights · `Q8_1` activations (ggml's order).
pub fn dot_q4_1(w: &[u8], a: &[u8]) -> f32 {
    q4_1::<Lanes8>(w, a)
}

/// `Q5_0` weights · `Q8_0` activations (ggml's order).
pub fn dot_q5_0(w: &[u8], a: &[u8]) -> f32 {
    q5_0::<Lanes8>(w, a)
}

/// `Q5_1` weights · `Q8_1` activations (ggml's order).
pub fn dot_q5_1(w: &[u8], a: &[u8]) -> f32 {
    q5_1::<Lanes8>(w, a)
}

/// `Q8_0` weights · `Q8_0` activations (ggml's order).
pub fn dot_q8_0(w: &[u8], a: &[u8]) -> f32 {
    q8_0::<Lanes8>(w, a)
}

/// `Q4_0` weights · `Q8_0` activations, whole-block integer sums ([`super::SumOrder::Block`]).
pub fn dot_q4_0_block(w: &[u8], a: &[u8]) -> f32 {
    q4_0::<BlockSums>(w, a)
}

/// `Q4_1` weights · `Q8_1` activations, whole-block integer sums ([`super::SumOrder::Block`]).
pub fn dot_q4_1_block(w: &[u8], a: &[u8]) -> f32 {
    q4_1::<BlockSums>(w, a)
}

/// `Q5_0` weights · `Q8_0` activations, whole-block integer sums ([`super::SumOrder::Block`]).
pub fn dot_q5_0_block(w: &[u8], a: &[u8]) -> f32 {
    q5_0::<BlockSums>(w, a)
}

/// `Q5_1` weights · `Q8_1` activations, whole-block integer sums ([`super::SumOrder::Block`]).
pub fn dot_q5_1_block(w: &[u8], a: &[u8]) -> f32 {
    q5_1::<BlockSums>(w, a)
}

/// `Q8_0` weights · `Q8_0` activations, whole-block integer sums ([`super::SumOrder::Block`]).
pub fn dot_q8_0_block(w: &[u8], a: &[u8]) -> f32 {
    q8_0::<BlockSums>(w, a)
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a `Q4_K`/`Q5_K` block.
#[inline(always)]
pub fn k4_scale_min(j: usize, s: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// The 16 signed scales (6-bit, offset by 32) of a `Q3_K` block.
#[inline(always)]
pub fn q3k_scales(s: &[u8; 12]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for k in 0..4 {
        let hi = s[8 + k];
        out[k] = ((s[k] & 0x0f) | ((hi & 3) << 4)) as i8 - 32;
        out[4 + k] = ((s[4 + k] & 0x0f) | (((hi >> 2) & 3) << 4)) as i8 - 32;
        out[8 + k] = ((s[k] >> 4) | (((hi >> 4) & 3) << 4)) as i8 - 32;
        out[12 + k] = ((s[4 + k] >> 4) | (((hi >> 6) & 3) << 4)) as i8 - 32;
    }
    out
}

/// `Q2_K` weights · `Q8_K` activations.
pub fn dot_q2_k(w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (x, y) in blocks::<BlockQ2K>(w).zip(blocks::<BlockQ8K>(a)) {
        let mut isum = 0i32;
        let mut msum = 0i32;
        for (sb, (&sc, &bs)) in x.scales.iter().zip(&y.bsums).enumerate() {
            // Element e = 128h + 32s + l sits in bits 2s of qs[32h + l]; sub-block sb = e / 16.
            let (h, s, l0) = (sb / 8, (sb % 8) / 2, (sb % 2) * 16);
            let mut d = 0i32;
            for l in l0..l0 + 16 {
                let q = (x.qs[32 * h + l] >> (2 * s)) & 3;
                d += q as i32 * y.qs[sb * 16 + l - l0] as i32;
            }
            isum += (sc & 0x0f) as i32 * d;
            msum += (sc >> 4) as i32 * bs as i32;
        }
        sum = tiled_step(sum, isum, Some((x.dmin.to_f32(), msum)), x.d.to_f32(), y.d);
    }
    sum
}

/// `Q3_K` weights · `Q8_K` activations.
pub fn dot_q3_k(w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (x, y) in blocks::<BlockQ3K>(w).zip(blocks::<BlockQ8K>(a)) {
        let sc = q3k_scales(&x.scales);
        let mut isum = 0i32;
        for (e, &yq) in y.qs.iter().enumerate() {
            // Element e = 128h + 32s + l: 2 bits at 2s of qs[32h + l], high bit 4h + s of hmask[l].
            let (h, s, l) = (e / 128, (e % 128) / 32, e % 32);
            let lo = (x.qs[32 * h + l] >> (2 * s)) & 3;
            let hi = (x.hmask[l] >> (4 * h + s)) & 1;
            let q = lo as i32 - if hi != 0 { 0 } else { 4 };
            isum += sc[e / 16] as i32 * q * yq as i32;
        }
        sum = tiled_step(sum, isum, None, x.d.to_f32(), y.d);
    }
    sum
}

/// `Q4_K` weights · `Q8_K` activations in the order of llama.cpp's repacked Q4_K gemv (the
/// tokens of a batch left over from groups of 4, and single-token decode): one fma per
/// super-block into the scale and the min accumulators.
pub fn dot_q4_k_gemv(w: &[u8], a: &[u8]) -> f32 {
    let (mut acc, mut accm) = (0f32, 0f32);
    for (x, y) in blocks::<BlockQ4K>(w).zip(blocks::<BlockQ8K>(a)) {
        let (mut isum, mut msum) = (0i32, 0i32);
        for j in 0..8 {
            let (sc, m) = k4_scale_min(j, &x.scales);
            let (c, half) = (j / 2, j % 2);
            let mut d = 0i32;
            for l in 0..32 {
                let q = (x.qs[32 * c + l] >> (4 * half)) & 0x0f;
                d += q as i32 * y.qs[32 * j + l] as i32;
            }
            isum += sc as i32 * d;
            msum += m as i32 * (y.bsums[2 * j] as i32 + y.bsums[2 * j + 1] as i32);
        }
        acc = (isum as f32).mul_add(x.d.to_f32() * y.d, acc);
        accm = (msum as f32).mul_add(x.dmin.to_f32() * y.d, accm);
    }
    acc - accm
}

/// `Q4_K` weights · `Q8_K` activations.
pub fn dot_q4_k(w: &[u8], a: &[u8]) -> f32 {
    // llama.cpp repacks Q4_K rows on x86 (q4_K_8x8) and its gemm applies the scales per pair
    // of sub-blocks: `acc = fma(isum, d * d_y, acc)`, the mins likewise into a second
    // accumulator, and the result is their difference.
    let (mut acc, mut accm) = (0f32, 0f32);
    for (x, y) in blocks::<BlockQ4K>(w).zip(blocks::<BlockQ8K>(a)) {
        let (dd, dm) = (x.d.to_f32() * y.d, x.dmin.to_f32() * y.d);
        for pair in 0..4 {
            let mut isum = 0i32;
            let mut msum = 0i32;
            for j in [2 * pair, 2 * pair + 1] {
                let (sc, m) = k4_scale_min(j, &x.scales);
                // Sub-block j = 2c + half: nibble `half` of qs[32c .. 32c + 32].
                let (c, half) = (j / 2, j % 2);
                let mut d = 0i32;
                for l in 0..32 {
                    let q = (x.qs[32 * c + l] >> (4 * half)) & 0x0f;
                    d += q as i32 * y.qs[32 * j + l] as i32;
                }
                isum += sc as i32 * d;
                msum += m as i32 * (y.bsums[2 * j] as i32 + y.bsums[2 * j + 1] as i32);
            }
            acc = (isum as f32).mul_add(dd, acc);
            accm = (msum as f32).mul_add(dm, accm);
        }
    }
    acc - accm
}

/// `Q5_K` weights · `Q8_K` activations.
pub fn dot_q5_k(w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (x, y) in blocks::<BlockQ5K>(w).zip(blocks::<BlockQ8K>(a)) {
        let mut isum = 0i32;
        let mut msum = 0i32;
        for j in 0..8 {
            let (sc, m) = k4_scale_min(j, &x.scales);
            let (c, half) = (j / 2, j % 2);
            let mut d = 0i32;
            for l in 0..32 {
                let lo = (x.qs[32 * c + l] >> (4 * half)) & 0x0f;
                let hi = (x.qh[l] >> j) & 1;
                d += (lo | (hi << 4)) as i32 * y.qs[32 * j + l] as i32;
            }
            isum += sc as i32 * d;
            msum += m as i32 * (y.bsums[2 * j] as i32 + y.bsums[2 * j + 1] as i32);
        }
        sum = tiled_step(sum, isum, Some((x.dmin.to_f32(), msum)), x.d.to_f32(), y.d);
    }
    sum
}

/// `Q6_K` weights · `Q8_K` activations.
pub fn dot_q6_k(w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (x, y) in blocks::<BlockQ6K>(w).zip(blocks::<BlockQ8K>(a)) {
        let mut isum = 0i32;
        for (e, &yq) in y.qs.iter().enumerate() {
            // Element e = 128h + 32s + l: its low 4 bits are nibble s>>1 of ql[64h + 32(s&1) + l]
            // (s = 0: ql[l] low, 1: ql[l+32] low, 2: ql[l] high, 3: ql[l+32] high), its high 2
            // bits sit at 2s of qh[32h + l].
            let (h, s, l) = (e / 128, (e % 128) / 32, e % 32);
            let lq = x.ql[64 * h + l + 32 * (s & 1)] >> (4 * (s >> 1));
            let hq = (x.qh[32 * h + l] >> (2 * s)) & 3;
            let q = ((lq & 0x0f) | (hq << 4)) as i32 - 32;
            isum += x.scales[e / 16] as i32 * q * yq as i32;
        }
        sum = tiled_step(sum, isum, None, x.d.to_f32(), y.d);
    }
    sum
}

/// Read little-endian f32s.
#[inline(always)]
fn f32s(b: &[u8]) -> impl Iterator<Item = f32> + '_ {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

/// Read little-endian 16-bit words.
#[inline(always)]
fn u16s(b: &[u8]) -> impl Iterator<Item = u16> + '_ {
    b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]))
}

/// `F32` weights · f32 activations.
pub fn dot_f32w(w: &[u8], a: &[u8]) -> f32 {
    f32s(w).zip(f32s(a)).map(|(x, y)| x * y).sum()
}

/// `F16` weights · f32 activations.
pub fn dot_f16w(w: &[u8], a: &[u8]) -> f32 {
    u16s(w)
        .zip(f32s(a))
        .map(|(x, y)| f16::from_bits(x).to_f32() * y)
        .sum()
}

/// `BF16` weights · f32 activations.
pub fn dot_bf16w(w: &[u8], a: &[u8]) -> f32 {
    u16s(w)
        .zip(f32s(a))
        .map(|(x, y)| f32::from_bits((x as u32) << 16) * y)
        .sum()
}

/// One super-block of llama.cpp's tiled K-quant matmul (ggml-cpu/tiled, taken for batches of
/// 8+ rows): the exact integer sum times the weight scale (minus `dmin * msum` by one fused
/// multiply-add for types with mins), then `acc = fma(r, d_y, acc)` (GCC contracts its
/// multiply and add).
#[inline(always)]
pub(crate) fn tiled_step(acc: f32, isum: i32, min: Option<(f32, i32)>, d: f32, dy: f32) -> f32 {
    let mut r = isum as f32 * d;
    if let Some((dmin, msum)) = min {
        r = (-dmin).mul_add(msum as f32, r);
    }
    r.mul_add(dy, acc)
}
