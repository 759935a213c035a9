//! Block layouts, byte for byte as `ggml-common.h` lays them out. Each struct is `#[repr(C)]`, has
//! alignment 1 or 2 as on disk, and a compile-time size check against `GgmlType::type_size`.

use half::f16;

/// Elements per block of the K-quants.
pub const QK_K: usize = 256;
/// Elements per block of the legacy quants.
pub const QK: usize = 32;
/// Bytes of packed 6-bit scales/mins in Q4_K and Q5_K (and Q3_K's scales).
pub const K_SCALE_SIZE: usize = 12;

macro_rules! assert_size {
    ($t:ty, $n:expr) => {
        const _: () = assert!(std::mem::size_of::<$t>() == $n);
    };
}

/// Q4_0: `x = d * (q - 8)`, q in 0..16; low nibbles hold elements 0..16, high nibbles 16..32.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; QK / 2],
}
assert_size!(BlockQ4_0, 18);

/// Q4_1: `x = d * q + m`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; QK / 2],
}
assert_size!(BlockQ4_1, 20);

/// Q5_0: `x = d * (q - 16)`, the fifth bit of element j in bit j of `qh` (little-endian u32).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ5_0 {
    pub d: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}
assert_size!(BlockQ5_0, 22);

/// Q5_1: `x = d * q + m`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ5_1 {
    pub d: f16,
    pub m: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}
assert_size!(BlockQ5_1, 24);

/// Q8_0: `x = d * q`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK],
}
assert_size!(BlockQ8_0, 34);

/// Q8_1: like Q8_0 plus `s = d * sum(qs)` (used for activations against Q4_1/Q5_1).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ8_1 {
    pub d: f16,
    pub s: f16,
    pub qs: [i8; QK],
}
assert_size!(BlockQ8_1, 36);

/// Q2_K: 16 sub-blocks of 16; each scale byte holds a 4-bit scale (low) and 4-bit min (high).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ2K {
    pub scales: [u8; QK_K / 16],
    pub qs: [u8; QK_K / 4],
    pub d: f16,
    pub dmin: f16,
}
assert_size!(BlockQ2K, 84);

/// Q3_K: 2 low bits in `qs`, the high bit in `hmask`, 16 6-bit scales packed in 12 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ3K {
    pub hmask: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 4],
    pub scales: [u8; 12],
    pub d: f16,
}
assert_size!(BlockQ3K, 110);

/// Q4_K: 8 sub-blocks of 32, 6-bit scales and mins packed in 12 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; K_SCALE_SIZE],
    pub qs: [u8; QK_K / 2],
}
assert_size!(BlockQ4K, 144);

/// Q5_K: Q4_K plus one high bit per element in `qh`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; K_SCALE_SIZE],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}
assert_size!(BlockQ5K, 176);

/// Q6_K: 4 low bits in `ql`, 2 high bits in `qh`, 16 signed 8-bit scales.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: f16,
}
assert_size!(BlockQ6K, 210);

/// Q8_K: activations for K-quant dot products; `bsums` are sums of each 16 `qs`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
}
assert_size!(BlockQ8K, 292);

/// Reinterpret raw bytes as a slice of blocks. Returns `None` when the length is not a whole
/// number of blocks or the pointer is not aligned for `T`.
pub fn cast_blocks<T: Block>(bytes: &[u8]) -> Option<&[T]> {
    let sz = std::mem::size_of::<T>();
    if !bytes.len().is_multiple_of(sz)
        || !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
    {
        return None;
    }
    // SAFETY: every `Block` type is repr(C) of plain integers/f16 (any bit pattern is valid);
    // length and alignment were checked above.
    Some(unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const T, bytes.len() / sz) })
}

/// Mutable counterpart of [`cast_blocks`].
pub fn cast_blocks_mut<T: Block>(bytes: &mut [u8]) -> Option<&mut [T]> {
    let sz = std::mem::size_of::<T>();
    if !bytes.len().is_multiple_of(sz)
        || !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
    {
        return None;
    }
    // SAFETY: as in `cast_blocks`; the borrow is unique.
    Some(unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr() as *mut T, bytes.len() / sz) })
}

/// View blocks as bytes.
pub fn blocks_as_bytes<T: Block>(blocks: &[T]) -> &[u8] {
    // SAFETY: Block types have no padding (sizes asserted above) and are plain data.
    unsafe {
        std::slice::from_raw_parts(blocks.as_ptr() as *const u8, std::mem::size_of_val(blocks))
    }
}

/// Marker for the plain-data block structs above.
///
/// # Safety
/// Implementors must be `repr(C)`, without padding, and valid for every bit pattern.
pub unsafe trait Block: Copy + 'static {
    /// Elements per block.
    const ELEMS: usize;
}

macro_rules! impl_block {
    ($($t:ty => $n:expr),*) => { $(
        // SAFETY: see the trait's contract; each struct above satisfies it.
        unsafe impl Block for $t { const ELEMS: usize = $n; }
    )* };
}
impl_block!(BlockQ4_0 => QK, BlockQ4_1 => QK, BlockQ5_0 => QK, BlockQ5_1 => QK, BlockQ8_0 => QK,
    BlockQ8_1 => QK, BlockQ2K => QK_K, BlockQ3K => QK_K, BlockQ4K => QK_K, BlockQ5K => QK_K,
    BlockQ6K => QK_K, BlockQ8K => QK_K);
