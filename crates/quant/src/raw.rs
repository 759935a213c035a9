//! Moving block structs in and out of unaligned byte buffers. Tensor data from a file is only as
//! aligned as the file says, so blocks are copied out rather than referenced in place.

use crate::blocks::{blocks_as_bytes, Block};

/// Copy one block out of `chunk`, which must be exactly one block long (callers obtain it from
/// `chunks_exact(size_of::<T>())`, so a mismatch is a bug in this crate, not bad input).
#[inline(always)]
pub(crate) fn read_block<T: Block>(chunk: &[u8]) -> T {
    assert_eq!(chunk.len(), std::mem::size_of::<T>());
    // SAFETY: `Block` types are plain data valid for every bit pattern; the length was checked
    // above, and `read_unaligned` places no alignment requirement on the source.
    unsafe { std::ptr::read_unaligned(chunk.as_ptr() as *const T) }
}

/// Copy one block into `chunk` (exactly one block long, as for [`read_block`]).
#[inline(always)]
pub(crate) fn write_block<T: Block>(block: &T, chunk: &mut [u8]) {
    chunk.copy_from_slice(blocks_as_bytes(std::slice::from_ref(block)));
}

/// Split `s` into fixed-size arrays of `N`. `s.len()` is a multiple of `N` at every call site; the
/// conversion of an exact chunk to an array never fails, so nothing is dropped.
#[inline(always)]
pub(crate) fn arrays_mut<const N: usize>(s: &mut [f32]) -> impl Iterator<Item = &mut [f32; N]> {
    s.chunks_exact_mut(N)
        .filter_map(|c| <&mut [f32; N]>::try_from(c).ok())
}

/// Shared-reference counterpart of [`arrays_mut`].
#[inline(always)]
pub(crate) fn arrays<const N: usize>(s: &[f32]) -> impl Iterator<Item = &[f32; N]> {
    s.chunks_exact(N)
        .filter_map(|c| <&[f32; N]>::try_from(c).ok())
}
