//! Scalar and slice conversions between `f32` and the two 16-bit float formats, rounding exactly
//! as ggml, numpy and the `gguf` Python package do.
//!
//! f16: IEEE binary16, round to nearest with ties to even, overflow to infinity, gradual underflow
//! (numpy's `astype(np.float16)` and ggml's `GGML_FP32_TO_FP16`). bf16: the top 16 bits of an f32,
//! round to nearest even; NaN is kept NaN by forcing the quiet bit (ggml's
//! `ggml_compute_fp32_to_bf16`, mirrored by `gguf.quants.BF16`).

use half::f16;

/// f16 bits to f32 (exact: every f16 is an f32).
#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// f32 to f16 bits, round to nearest even.
#[inline]
pub fn f32_to_f16(x: f32) -> u16 {
    f16::from_f32(x).to_bits()
}

/// bf16 bits to f32 (exact).
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// f32 to bf16 bits, round to nearest even; NaN stays NaN (quiet bit forced on, payload's top
/// bits kept), as ggml does, so a NaN never rounds into infinity.
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 0x40) as u16;
    }
    // Adding 0x7fff plus the lowest kept bit rounds half-way cases towards the even result; the
    // sum cannot overflow u64 and any carry moves into the exponent as rounding should.
    ((u as u64 + 0x7fff + ((u as u64 >> 16) & 1)) >> 16) as u16
}

/// Round `x` through f16 and back: the value an f16 field will hold.
#[inline]
pub fn round_f16(x: f32) -> f32 {
    f16_to_f32(f32_to_f16(x))
}

/// Convert little-endian f16 bytes to f32 values. `src.len()` must be `2 * dst.len()`; extra bytes
/// on either side are ignored (callers check sizes).
pub fn f16_bytes_to_f32(src: &[u8], dst: &mut [f32]) {
    for (b, d) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *d = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    }
}

/// Convert little-endian bf16 bytes to f32 values (see [`f16_bytes_to_f32`]).
pub fn bf16_bytes_to_f32(src: &[u8], dst: &mut [f32]) {
    for (b, d) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *d = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    }
}

/// Convert f32 values to little-endian f16 bytes.
pub fn f32_to_f16_bytes(src: &[f32], dst: &mut [u8]) {
    for (x, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
        d.copy_from_slice(&f32_to_f16(*x).to_le_bytes());
    }
}

/// Convert f32 values to little-endian bf16 bytes.
pub fn f32_to_bf16_bytes(src: &[f32], dst: &mut [u8]) {
    for (x, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
        d.copy_from_slice(&f32_to_bf16(*x).to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_ties_to_even_and_keeps_nan() {
        // 1 + 2^-8 is exactly half-way between two bf16 values; the even one is 1.0.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        // 1 + 3*2^-8 is half-way too; the even neighbour is above.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        // A NaN whose top half looks like infinity must stay NaN.
        let nan = f32::from_bits(0x7f80_0001);
        assert!(bf16_to_f32(f32_to_bf16(nan)).is_nan());
        assert_eq!(f32_to_bf16(f32::MAX), 0x7f80, "f32::MAX rounds to +inf");
    }

    #[test]
    fn f16_round_trip_of_every_finite_f16() {
        for bits in 0..=u16::MAX {
            let x = f16_to_f32(bits);
            if x.is_nan() {
                continue;
            }
            assert_eq!(f32_to_f16(x), bits, "bits {bits:#06x}");
        }
    }
}
