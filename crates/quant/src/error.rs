//! The one error type of this crate.

use gguf::GgmlType;

/// Why a (de)quantization request was refused. Every variant names the tensor type and the lengths
/// involved, so a caller can report which tensor was bad without extra context.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// The element count is not a whole number of blocks of `ty`.
    #[error("{ty}: {n} elements is not a multiple of the block size {block_size}")]
    NotBlockMultiple {
        ty: GgmlType,
        n: usize,
        block_size: usize,
    },
    /// A buffer's length does not match the element count.
    #[error("{ty}: {buffer} buffer holds {got} bytes but {n} elements need {expected}")]
    BufferSize {
        ty: GgmlType,
        /// `"source"` or `"destination"`.
        buffer: &'static str,
        n: usize,
        expected: usize,
        got: usize,
    },
    /// The element count overflows the byte size computation.
    #[error("{ty}: {n} elements overflow the addressable byte size")]
    TooLarge { ty: GgmlType, n: usize },
    /// The type does not support the requested operation (e.g. quantizing to an integer type).
    #[error("{ty}: {op} is not supported for this type")]
    Unsupported { ty: GgmlType, op: &'static str },
}
