//! Dequantization of every supported tensor type to f32.
//!
//! Each `dequantize_block_*` follows ggml's `dequantize_row_*` arithmetic operation for operation
//! (same products, same order, no fused multiply-add), so results are bit-identical to ggml and to
//! the `gguf` Python package, whose numpy code evaluates the same expressions.

use gguf::GgmlType;
use rayon::prelude::*;

use crate::blocks::*;
use crate::error::QuantError;
use crate::float16::{bf16_bytes_to_f32, f16_bytes_to_f32, f16_to_f32};
use crate::raw::{arrays_mut, read_block};

/// Inputs at least this many elements long are split across rayon's thread pool.
pub const PAR_MIN_ELEMS: usize = 1 << 16;
/// Elements per parallel work item: a multiple of every block size.
pub(crate) const PAR_CHUNK_ELEMS: usize = 1 << 15;

/// Whether [`dequantize`] handles `ty`.
pub fn can_dequantize(ty: GgmlType) -> bool {
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

/// Bytes `n` elements of `ty` take, or the error explaining why `n` does not fit the type.
pub(crate) fn bytes_needed(ty: GgmlType, n: usize) -> Result<usize, QuantError> {
    let bs = ty.block_size();
    if !n.is_multiple_of(bs) {
        return Err(QuantError::NotBlockMultiple {
            ty,
            n,
            block_size: bs,
        });
    }
    (n / bs)
        .checked_mul(ty.type_size())
        .ok_or(QuantError::TooLarge { ty, n })
}

/// Dequantize `src`, holding exactly `dst.len()` elements of `ty`, into `dst`.
///
/// Large inputs (at least [`PAR_MIN_ELEMS`]) are split on block boundaries across rayon's pool;
/// the result does not depend on the split.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    check(ty, src, dst)?;
    if dst.len() >= PAR_MIN_ELEMS {
        let chunk_bytes = bytes_needed(ty, PAR_CHUNK_ELEMS)?;
        src.par_chunks(chunk_bytes)
            .zip(dst.par_chunks_mut(PAR_CHUNK_ELEMS))
            .for_each(|(s, d)| dequantize_checked(ty, s, d));
    } else {
        dequantize_checked(ty, src, dst);
    }
    Ok(())
}

/// [`dequantize`] on the calling thread only (for callers that already run in parallel).
pub fn dequantize_serial(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    check(ty, src, dst)?;
    dequantize_checked(ty, src, dst);
    Ok(())
}

/// Dequantize `n` elements of `ty` from `src` into a new vector.
pub fn dequantize_to_vec(ty: GgmlType, src: &[u8], n: usize) -> Result<Vec<f32>, QuantError> {
    let mut out = vec![0f32; n];
    dequantize(ty, src, &mut out)?;
    Ok(out)
}

fn check(ty: GgmlType, src: &[u8], dst: &[f32]) -> Result<(), QuantError> {
    if !can_dequantize(ty) {
        return Err(QuantError::Unsupported {
            ty,
            op: "dequantize",
        });
    }
    let expected = bytes_needed(ty, dst.len())?;
    if src.len() != expected {
        return Err(QuantError::BufferSize {
            ty,
            buffer: "source",
            n: dst.len(),
            expected,
            got: src.len(),
        });
    }
    Ok(())
}

/// Sizes were checked by the caller: `src` holds exactly `dst.len()` elements of a supported `ty`.
fn dequantize_checked(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    use GgmlType::*;
    match ty {
        F32 => {
            for (b, d) in src.chunks_exact(4).zip(dst.iter_mut()) {
                *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        F16 => f16_bytes_to_f32(src, dst),
        BF16 => bf16_bytes_to_f32(src, dst),
        Q4_0 => each_block::<BlockQ4_0, 32>(src, dst, dequantize_block_q4_0),
        Q4_1 => each_block::<BlockQ4_1, 32>(src, dst, dequantize_block_q4_1),
        Q5_0 => each_block::<BlockQ5_0, 32>(src, dst, dequantize_block_q5_0),
        Q5_1 => each_block::<BlockQ5_1, 32>(src, dst, dequantize_block_q5_1),
        Q8_0 => each_block::<BlockQ8_0, 32>(src, dst, dequantize_block_q8_0),
        Q8_1 => each_block::<BlockQ8_1, 32>(src, dst, dequantize_block_q8_1),
        Q2K => each_block::<BlockQ2K, 256>(src, dst, dequantize_block_q2_k),
        Q3K => each_block::<BlockQ3K, 256>(src, dst, dequantize_block_q3_k),
        Q4K => each_block::<BlockQ4K, 256>(src, dst, dequantize_block_q4_k),
        Q5K => each_block::<BlockQ5K, 256>(src, dst, dequantize_block_q5_k),
        Q6K => each_block::<BlockQ6K, 256>(src, dst, dequantize_block_q6_k),
        Q8K => each_block::<BlockQ8K, 256>(src, dst, dequantize_block_q8_k),
        // `check` refused these already.
        I8 | I16 | I32 | I64 | F64 => {}
    }
}

#[inline(always)]
fn each_block<T: Block, const N: usize>(src: &[u8], dst: &mut [f32], f: fn(&T, &mut [f32; N])) {
    debug_assert_eq!(T::ELEMS, N);
    for (c, y) in src
        .chunks_exact(std::mem::size_of::<T>())
        .zip(arrays_mut::<N>(dst))
    {
        f(&read_block::<T>(c), y);
    }
}

/// Q4_0 block: `d * (q - 8)`.
pub fn dequantize_block_q4_0(b: &BlockQ4_0, y: &mut [f32; QK]) {
    let d = b.d.to_f32();
    for j in 0..QK / 2 {
        let x0 = (b.qs[j] & 0x0f) as i32 - 8;
        let x1 = (b.qs[j] >> 4) as i32 - 8;
        y[j] = d * x0 as f32;
        y[j + QK / 2] = d * x1 as f32;
    }
}

/// Q4_1 block: `d * q + m`.
pub fn dequantize_block_q4_1(b: &BlockQ4_1, y: &mut [f32; QK]) {
    let d = b.d.to_f32();
    let m = b.m.to_f32();
    for j in 0..QK / 2 {
        y[j] = d * (b.qs[j] & 0x0f) as f32 + m;
        y[j + QK / 2] = d * (b.qs[j] >> 4) as f32 + m;
    }
}

/// Q5_0 block: `d * (q - 16)`, q's fifth bit from `qh`.
pub fn dequantize_block_q5_0(b: &BlockQ5_0, y: &mut [f32; QK]) {
    let d = b.d.to_f32();
    let qh = u32::from_le_bytes(b.qh);
    for j in 0..QK / 2 {
        let h0 = (((qh >> j) & 1) << 4) as u8;
        let h1 = (((qh >> (j + 16)) & 1) << 4) as u8;
        let x0 = ((b.qs[j] & 0x0f) | h0) as i32 - 16;
        let x1 = ((b.qs[j] >> 4) | h1) as i32 - 16;
        y[j] = d * x0 as f32;
        y[j + QK / 2] = d * x1 as f32;
    }
}

/// Q5_1 block: `d * q + m`, q's fifth bit from `qh`.
pub fn dequantize_block_q5_1(b: &BlockQ5_1, y: &mut [f32; QK]) {
    let d = b.d.to_f32();
    let m = b.m.to_f32();
    let qh = u32::from_le_bytes(b.qh);
    for j in 0..QK / 2 {
        let h0 = (((qh >> j) & 1) << 4) as u8;
        let h1 = (((qh >> (j + 16)) & 1) << 4) as u8;
        y[j] = d * ((b.qs[j] & 0x0f) | h0) as f32 + m;
        y[j + QK / 2] = d * ((b.qs[j] >> 4) | h1) as f32 + m;
    }
}

/// Q8_0 block: `d * q`.
pub fn dequantize_block_q8_0(b: &BlockQ8_0, y: &mut [f32; QK]) {
    let d = b.d.to_f32();
    for (o, &q) in y.iter_mut().zip(b.qs.iter()) {
        *o = q as f32 * d;
    }
}

/// Q8_1 block: `d * q` (the stored sum `s` only serves dot products).
pub fn dequantize_block_q8_1(b: &BlockQ8_1, y: &mut [f32; QK]) {
    let d = b.d.to_f32();
    for (o, &q) in y.iter_mut().zip(b.qs.iter()) {
        *o = q as f32 * d;
    }
}

/// Q2_K block: per 16 elements `d * (sc & 15) * q - dmin * (sc >> 4)`.
pub fn dequantize_block_q2_k(b: &BlockQ2K, y: &mut [f32; QK_K]) {
    let d = b.d.to_f32();
    let dmin = b.dmin.to_f32();
    // 16 groups of 16: group g covers elements 16g..16g+16; its 2-bit values sit in qs byte
    // (g / 8) * 32 + (g % 2) * 16 + l at shift 2 * ((g % 8) / 2).
    for (g, &sc) in b.scales.iter().enumerate() {
        let dl = d * (sc & 0x0f) as f32;
        let ml = dmin * (sc >> 4) as f32;
        let base = (g / 8) * 32 + (g % 2) * 16;
        let shift = 2 * ((g % 8) / 2);
        for l in 0..16 {
            let q = (b.qs[base + l] >> shift) & 3;
            y[16 * g + l] = dl * q as f32 - ml;
        }
    }
}

/// Unpack Q3_K's 16 6-bit scales (stored with a +32 offset) to signed values.
pub fn q3_k_scales(packed: &[u8; 12]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let low = if j < 8 {
            packed[j] & 0x0f
        } else {
            packed[j - 8] >> 4
        };
        let high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = (low | (high << 4)) as i8 - 32;
    }
    out
}

/// Q3_K block: `d * sc * (q - 4 * !hbit)` per 16 elements.
pub fn dequantize_block_q3_k(b: &BlockQ3K, y: &mut [f32; QK_K]) {
    let d = b.d.to_f32();
    let scales = q3_k_scales(&b.scales);
    // Element e = 128h + 32k + l (h half, k 2-bit plane, l in 0..32): low bits at qs[32h + l]
    // shift 2k; high bit at hmask[l] bit 4h + k; scale index e / 16.
    for (e, o) in y.iter_mut().enumerate() {
        let (h, k, l) = (e / 128, (e % 128) / 32, e % 32);
        let low = ((b.qs[32 * h + l] >> (2 * k)) & 3) as i8;
        let high = if b.hmask[l] & (1 << (4 * h + k)) != 0 {
            0
        } else {
            4
        };
        let dl = d * scales[e / 16] as f32;
        *o = dl * (low - high) as f32;
    }
}

/// Scale and min of sub-block `j` (0..8) from the 12-byte packing Q4_K and Q5_K share.
#[inline]
pub fn get_scale_min_k4(j: usize, q: &[u8; K_SCALE_SIZE]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Q4_K block: `d * sc * q - dmin * m` per 32 elements.
pub fn dequantize_block_q4_k(b: &BlockQ4K, y: &mut [f32; QK_K]) {
    let d = b.d.to_f32();
    let dmin = b.dmin.to_f32();
    for c in 0..4 {
        let (sc1, m1) = get_scale_min_k4(2 * c, &b.scales);
        let (sc2, m2) = get_scale_min_k4(2 * c + 1, &b.scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let q = &b.qs[32 * c..32 * c + 32];
        for l in 0..32 {
            y[64 * c + l] = d1 * (q[l] & 0x0f) as f32 - m1;
            y[64 * c + 32 + l] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

/// Q5_K block: Q4_K with a fifth bit per element from `qh`.
pub fn dequantize_block_q5_k(b: &BlockQ5K, y: &mut [f32; QK_K]) {
    let d = b.d.to_f32();
    let dmin = b.dmin.to_f32();
    for c in 0..4 {
        let (sc1, m1) = get_scale_min_k4(2 * c, &b.scales);
        let (sc2, m2) = get_scale_min_k4(2 * c + 1, &b.scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let (u1, u2) = (1u8 << (2 * c), 2u8 << (2 * c));
        let q = &b.qs[32 * c..32 * c + 32];
        for l in 0..32 {
            let h1 = if b.qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if b.qh[l] & u2 != 0 { 16 } else { 0 };
            y[64 * c + l] = d1 * ((q[l] & 0x0f) + h1) as f32 - m1;
            y[64 * c + 32 + l] = d2 * ((q[l] >> 4) + h2) as f32 - m2;
        }
    }
}

/// Q6_K block: `d * sc * (q - 32)` per 16 elements.
pub fn dequantize_block_q6_k(b: &BlockQ6K, y: &mut [f32; QK_K]) {
    let d = b.d.to_f32();
    for h in 0..2 {
        let ql = &b.ql[64 * h..64 * h + 64];
        let qh = &b.qh[32 * h..32 * h + 32];
        let sc = &b.scales[8 * h..8 * h + 8];
        let out = &mut y[128 * h..128 * h + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | (qh[l] & 3) << 4) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | ((qh[l] >> 2) & 3) << 4) as i32 - 32;
            let q3 = ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) as i32 - 32;
            out[l] = d * sc[is] as f32 * q1 as f32;
            out[l + 32] = d * sc[is + 2] as f32 * q2 as f32;
            out[l + 64] = d * sc[is + 4] as f32 * q3 as f32;
            out[l + 96] = d * sc[is + 6] as f32 * q4 as f32;
        }
    }
}

/// Q8_K block: `d * q` with an f32 scale.
pub fn dequantize_block_q8_k(b: &BlockQ8K, y: &mut [f32; QK_K]) {
    for (o, &q) in y.iter_mut().zip(b.qs.iter()) {
        *o = b.d * q as f32;
    }
}

/// f16 scale field to f32, for callers holding raw bits.
#[inline]
pub fn scale_to_f32(bits: u16) -> f32 {
    f16_to_f32(bits)
}
