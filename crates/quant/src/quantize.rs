//! Quantization from f32.
//!
//! The legacy block types (Q4_0 ... Q8_1) follow ggml's `quantize_row_*_ref`, which the `gguf`
//! Python package reproduces bit for bit; the K-quants live in [`crate::kquants`]. Blocks are
//! independent, so any split of the input across threads gives the same bytes.

use gguf::GgmlType;
use rayon::prelude::*;

use crate::blocks::*;
use crate::dequant::{bytes_needed, PAR_CHUNK_ELEMS, PAR_MIN_ELEMS};
use crate::error::QuantError;
use crate::float16::{f32_to_bf16_bytes, f32_to_f16, f32_to_f16_bytes};
use crate::kquants;
use crate::raw::{arrays, write_block};

/// Whether [`quantize`] can produce `ty`.
pub fn can_quantize(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16
            | BF16
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Q8_1
            | Q2K
            | Q3K
            | Q4K
            | Q5K
            | Q6K
            | Q8K
    )
}

/// Quantize `src` (consecutive rows; only its total length matters, as every type quantizes each
/// block on its own) into `dst`, which must be exactly `ty`'s size for `src.len()` elements.
///
/// Large inputs (at least [`PAR_MIN_ELEMS`]) are split on block boundaries across rayon's pool;
/// the bytes do not depend on the split.
pub fn quantize(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    check(ty, src, dst)?;
    if src.len() >= PAR_MIN_ELEMS {
        let chunk_bytes = bytes_needed(ty, PAR_CHUNK_ELEMS)?;
        src.par_chunks(PAR_CHUNK_ELEMS)
            .zip(dst.par_chunks_mut(chunk_bytes))
            .for_each(|(s, d)| quantize_checked(ty, s, d));
    } else {
        quantize_checked(ty, src, dst);
    }
    Ok(())
}

/// [`quantize`] on the calling thread only (for callers that already run in parallel).
pub fn quantize_serial(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    check(ty, src, dst)?;
    quantize_checked(ty, src, dst);
    Ok(())
}

/// Quantize `src` into a new byte vector.
pub fn quantize_to_vec(ty: GgmlType, src: &[f32]) -> Result<Vec<u8>, QuantError> {
    let mut out = vec![0u8; bytes_needed(ty, src.len())?];
    quantize(ty, src, &mut out)?;
    Ok(out)
}

fn check(ty: GgmlType, src: &[f32], dst: &[u8]) -> Result<(), QuantError> {
    if !can_quantize(ty) {
        return Err(QuantError::Unsupported { ty, op: "quantize" });
    }
    let expected = bytes_needed(ty, src.len())?;
    if dst.len() != expected {
        return Err(QuantError::BufferSize {
            ty,
            buffer: "destination",
            n: src.len(),
            expected,
            got: dst.len(),
        });
    }
    Ok(())
}

/// Sizes were checked by the caller.
fn quantize_checked(ty: GgmlType, src: &[f32], dst: &mut [u8]) {
    use GgmlType::*;
    match ty {
        F32 => {
            for (x, d) in src.iter().zip(dst.chunks_exact_mut(4)) {
                d.copy_from_slice(&x.to_le_bytes());
            }
        }
        F16 => f32_to_f16_bytes(src, dst),
        BF16 => f32_to_bf16_bytes(src, dst),
        Q4_0 => each_block::<BlockQ4_0, 32>(src, dst, quantize_block_q4_0),
        Q4_1 => each_block::<BlockQ4_1, 32>(src, dst, quantize_block_q4_1),
        Q5_0 => each_block::<BlockQ5_0, 32>(src, dst, quantize_block_q5_0),
        Q5_1 => each_block::<BlockQ5_1, 32>(src, dst, quantize_block_q5_1),
        Q8_0 => each_block::<BlockQ8_0, 32>(src, dst, quantize_block_q8_0),
        Q8_1 => each_block::<BlockQ8_1, 32>(src, dst, quantize_block_q8_1),
        Q2K => each_block::<BlockQ2K, 256>(src, dst, kquants::quantize_block_q2_k),
        Q3K => each_block::<BlockQ3K, 256>(src, dst, kquants::quantize_block_q3_k),
        Q4K => each_block::<BlockQ4K, 256>(src, dst, kquants::quantize_block_q4_k),
        Q5K => each_block::<BlockQ5K, 256>(src, dst, kquants::quantize_block_q5_k),
        Q6K => each_block::<BlockQ6K, 256>(src, dst, kquants::quantize_block_q6_k),
        Q8K => each_block::<BlockQ8K, 256>(src, dst, kquants::quantize_block_q8_k),
        // `check` refused these already.
        I8 | I16 | I32 | I64 | F64 => {}
    }
}

#[inline(always)]
fn each_block<T: Block, const N: usize>(src: &[f32], dst: &mut [u8], f: fn(&[f32; N]) -> T) {
    debug_assert_eq!(T::ELEMS, N);
    for (x, c) in arrays::<N>(src).zip(dst.chunks_exact_mut(std::mem::size_of::<T>())) {
        write_block(&f(x), c);
    }
}

/// The element of largest magnitude, first one on ties (ggml keeps the sign: the scale is
/// chosen so that this element maps to the extreme negative level exactly).
#[inline]
fn signed_absmax(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

#[inline]
fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

#[inline]
fn inverse_or_zero(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

/// Q4_0: scale from the signed extreme value, `q = trunc(x / d + 8.5)` capped at 15.
pub fn quantize_block_q4_0(x: &[f32; QK]) -> BlockQ4_0 {
    let d = signed_absmax(x) / -8.0;
    let id = inverse_or_zero(d);
    let mut qs = [0u8; QK / 2];
    for (j, q) in qs.iter_mut().enumerate() {
        let x0 = ((x[j] * id + 8.5) as i32).clamp(0, 15) as u8;
        let x1 = ((x[j + QK / 2] * id + 8.5) as i32).clamp(0, 15) as u8;
        *q = x0 | (x1 << 4);
    }
    BlockQ4_0 {
        d: half::f16::from_bits(f32_to_f16(d)),
        qs,
    }
}

/// Q4_1: `d = (max - min) / 15`, `q = trunc((x - min) / d + 0.5)`.
pub fn quantize_block_q4_1(x: &[f32; QK]) -> BlockQ4_1 {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = inverse_or_zero(d);
    let mut qs = [0u8; QK / 2];
    for (j, q) in qs.iter_mut().enumerate() {
        let x0 = (((x[j] - min) * id + 0.5) as i32).clamp(0, 15) as u8;
        let x1 = (((x[j + QK / 2] - min) * id + 0.5) as i32).clamp(0, 15) as u8;
        *q = x0 | (x1 << 4);
    }
    BlockQ4_1 {
        d: half::f16::from_bits(f32_to_f16(d)),
        m: half::f16::from_bits(f32_to_f16(min)),
        qs,
    }
}

/// Q5_0: as Q4_0 with 32 levels (`d = max / -16`).
pub fn quantize_block_q5_0(x: &[f32; QK]) -> BlockQ5_0 {
    let d = signed_absmax(x) / -16.0;
    let id = inverse_or_zero(d);
    let mut qs = [0u8; QK / 2];
    let mut qh = 0u32;
    for (j, q) in qs.iter_mut().enumerate() {
        let x0 = ((x[j] * id + 16.5) as i32).clamp(0, 31) as u32;
        let x1 = ((x[j + QK / 2] * id + 16.5) as i32).clamp(0, 31) as u32;
        *q = ((x0 & 0x0f) | ((x1 & 0x0f) << 4)) as u8;
        qh |= ((x0 >> 4) & 1) << j;
        qh |= ((x1 >> 4) & 1) << (j + QK / 2);
    }
    BlockQ5_0 {
        d: half::f16::from_bits(f32_to_f16(d)),
        qh: qh.to_le_bytes(),
        qs,
    }
}

/// Q5_1: as Q4_1 with 32 levels.
pub fn quantize_block_q5_1(x: &[f32; QK]) -> BlockQ5_1 {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = inverse_or_zero(d);
    let mut qs = [0u8; QK / 2];
    let mut qh = 0u32;
    for (j, q) in qs.iter_mut().enumerate() {
        let x0 = (((x[j] - min) * id + 0.5) as i32).clamp(0, 31) as u32;
        let x1 = (((x[j + QK / 2] - min) * id + 0.5) as i32).clamp(0, 31) as u32;
        *q = ((x0 & 0x0f) | ((x1 & 0x0f) << 4)) as u8;
        qh |= ((x0 >> 4) & 1) << j;
        qh |= ((x1 >> 4) & 1) << (j + QK / 2);
    }
    BlockQ5_1 {
        d: half::f16::from_bits(f32_to_f16(d)),
        m: half::f16::from_bits(f32_to_f16(min)),
        qh: qh.to_le_bytes(),
        qs,
    }
}

#[inline]
fn absmax(x: &[f32]) -> f32 {
    x.iter()
        .fold(0f32, |a, &v| if a > v.abs() { a } else { v.abs() })
}

/// Q8_0: `d = absmax / 127`, `q = round(x / d)` (half away from zero, as C's `roundf`).
pub fn quantize_block_q8_0(x: &[f32; QK]) -> BlockQ8_0 {
    let d = absmax(x) / 127.0;
    let id = inverse_or_zero(d);
    let mut qs = [0i8; QK];
    for (q, &v) in qs.iter_mut().zip(x.iter()) {
        *q = (v * id).round() as i8;
    }
    BlockQ8_0 {
        d: half::f16::from_bits(f32_to_f16(d)),
        qs,
    }
}

/// Q8_1: Q8_0 plus `s = d * sum(q)`.
pub fn quantize_block_q8_1(x: &[f32; QK]) -> BlockQ8_1 {
    let d = absmax(x) / 127.0;
    let id = inverse_or_zero(d);
    let mut qs = [0i8; QK];
    let mut sum = 0i32;
    for (q, &v) in qs.iter_mut().zip(x.iter()) {
        *q = (v * id).round() as i8;
        sum += *q as i32;
    }
    BlockQ8_1 {
        d: half::f16::from_bits(f32_to_f16(d)),
        s: half::f16::from_bits(f32_to_f16(sum as f32 * d)),
        qs,
    }
}
