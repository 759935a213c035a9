//! The one error type of this crate. Every variant raised while reading names the field and the
//! absolute byte offset in the file where the problem was found.

use crate::types::GgmlType;
use std::path::PathBuf;

/// What went wrong reading, validating, querying or writing a GGUF file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// The operating system refused an open, map, read or write.
    #[error("I/O error{}: {source}", path.as_ref().map(|p| format!(" on {}", p.display())).unwrap_or_default())]
    Io {
        path: Option<PathBuf>,
        #[source]
        source: std::io::Error,
    },

    /// A fixed-size field runs past the end of the file.
    #[error("truncated file: {field} at byte {offset} needs {needed} bytes, but the file is {file_size} bytes long")]
    Truncated {
        field: String,
        offset: u64,
        needed: u64,
        file_size: u64,
    },

    /// The first four bytes are not `GGUF`.
    #[error("bad magic at byte 0: expected \"GGUF\", found {found:02x?}")]
    BadMagic { found: [u8; 4] },

    /// A version other than 2 or 3.
    #[error("unsupported GGUF version {version} at byte {offset} (supported: 2, 3){}", endian_hint(*version))]
    UnsupportedVersion { version: u32, offset: u64 },

    /// A metadata value type id GGUF does not define.
    #[error("unknown value type {type_id} for {field} at byte {offset}")]
    UnknownValueType {
        field: String,
        offset: u64,
        type_id: u32,
    },

    /// A tensor type id this crate does not know (e.g. the IQ types, or garbage).
    #[error("unknown tensor type {type_id} for tensor '{tensor}' at byte {offset}")]
    UnknownTensorType {
        tensor: String,
        offset: u64,
        type_id: u32,
    },

    /// A declared count or length that cannot fit in the bytes left in the file. Raised before
    /// anything is allocated for it.
    #[error("{field} at byte {offset}: {count} {unit} need at least {needed} bytes, but only {available} remain")]
    CountOverrun {
        field: String,
        offset: u64,
        count: u64,
        unit: &'static str,
        needed: u128,
        available: u64,
    },

    /// A string whose bytes are not UTF-8. `offset` is the first bad byte.
    #[error("invalid UTF-8 in {field} at byte {offset}")]
    InvalidUtf8 { field: String, offset: u64 },

    /// A bool stored as something other than 0 or 1.
    #[error("invalid bool {byte} in {field} at byte {offset} (expected 0 or 1)")]
    InvalidBool {
        field: String,
        offset: u64,
        byte: u8,
    },

    /// Arrays nested deeper than the reader accepts.
    #[error("{field} at byte {offset}: arrays nested deeper than {max_depth} levels")]
    NestingTooDeep {
        field: String,
        offset: u64,
        max_depth: usize,
    },

    /// More than `GGUF_MAX_DIMS` (4) dimensions.
    #[error("tensor '{tensor}' at byte {offset}: {n_dims} dimensions (at most 4 allowed)")]
    TooManyDims {
        tensor: String,
        offset: u64,
        n_dims: u32,
    },

    /// The element count or byte size of a tensor overflows (or a dimension exceeds `i64::MAX`).
    #[error("tensor '{tensor}' at byte {offset}: shape {dims:?} overflows ({what})")]
    ElementCountOverflow {
        tensor: String,
        offset: u64,
        dims: Vec<u64>,
        what: &'static str,
    },

    /// A key of length zero (llama.cpp rejects these too).
    #[error("kv[{index}]: empty key at byte {offset}")]
    EmptyKey { index: u64, offset: u64 },

    /// A key that appears twice.
    #[error("duplicate key '{key}' at byte {offset}")]
    DuplicateKey { key: String, offset: u64 },

    /// A tensor name that appears twice.
    #[error("duplicate tensor name '{name}' at byte {offset}")]
    DuplicateTensor { name: String, offset: u64 },

    /// `general.alignment` is not a non-zero power of two stored as u32.
    #[error("general.alignment at byte {offset}: {detail}")]
    BadAlignment { offset: u64, detail: String },

    /// A tensor's data offset is not a multiple of the file's alignment.
    #[error("tensor '{tensor}': data offset {tensor_offset} (field at byte {offset}) is not a multiple of the alignment {alignment}")]
    MisalignedTensor {
        tensor: String,
        offset: u64,
        tensor_offset: u64,
        alignment: u64,
    },

    /// Two tensors share bytes. `offset` is where `tensor`'s info stores its data offset; `start` and
    /// `end` are absolute byte positions.
    #[error("tensor '{tensor}' (data offset field at byte {offset}) occupies bytes {start}..{end}, overlapping tensor '{other}' at bytes {other_start}..{other_end}")]
    TensorOverlap {
        tensor: String,
        offset: u64,
        start: u64,
        end: u64,
        other: String,
        other_start: u64,
        other_end: u64,
    },

    /// A tensor's data lies (partly) beyond the end of the file. `offset` is where its info stores its
    /// data offset; `start`/`end` are absolute byte positions (as u128: they may exceed u64).
    #[error("tensor '{tensor}' (data offset field at byte {offset}): data at bytes {start}..{end} lies beyond the end of the file ({file_size} bytes)")]
    TensorOutOfBounds {
        tensor: String,
        offset: u64,
        start: u128,
        end: u128,
        file_size: u64,
    },

    /// A shape that the type cannot store: the row length (dims\[0\]) is not a whole number of blocks.
    #[error("tensor '{tensor}' at byte {offset}: row length {row} is not a multiple of the {ty} block size {block_size}")]
    TensorShapeMismatch {
        tensor: String,
        offset: u64,
        ty: GgmlType,
        row: u64,
        block_size: u64,
    },

    /// A metadata key a caller required is absent.
    #[error("metadata key '{key}' is missing")]
    KeyMissing { key: String },

    /// A metadata key has a type the caller cannot use.
    #[error("metadata key '{key}' has type {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },

    /// An integer metadata value does not fit the type the caller asked for.
    #[error("metadata key '{key}' = {value} does not fit in {target}")]
    OutOfRange {
        key: String,
        target: &'static str,
        value: String,
    },

    /// Writer: the bytes given for a tensor do not match its declared shape and type.
    #[error("tensor '{tensor}': {got} bytes given, but its shape and type need {expected}")]
    TensorDataSize {
        tensor: String,
        expected: u64,
        got: u64,
    },

    /// Writer: a tensor supplied out of the declared order, or the file finished with tensors missing.
    #[error("streaming writer: expected {expected}, got {got}")]
    TensorOrder { expected: String, got: String },

    /// Writer: a declaration or value that cannot be written (duplicate name, bad shape, bad alignment).
    #[error("cannot write GGUF: {reason}")]
    InvalidWrite { reason: String },
}

fn endian_hint(version: u32) -> &'static str {
    if matches!(version.swap_bytes(), 1..=3) {
        " (this looks like a big-endian file, which is not supported)"
    } else {
        ""
    }
}

/// A coarse classification of [`GgufError`], stable for tests and manifests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    Io,
    Truncated,
    BadMagic,
    UnsupportedVersion,
    UnknownValueType,
    UnknownTensorType,
    CountOverrun,
    InvalidUtf8,
    InvalidBool,
    NestingTooDeep,
    TooManyDims,
    ElementCountOverflow,
    EmptyKey,
    DuplicateKey,
    DuplicateTensor,
    BadAlignment,
    MisalignedTensor,
    TensorOverlap,
    TensorOutOfBounds,
    TensorShapeMismatch,
    KeyMissing,
    WrongType,
    OutOfRange,
    TensorDataSize,
    TensorOrder,
    InvalidWrite,
}

impl ErrorKind {
    /// Every kind, for parsing manifests.
    pub const ALL: [ErrorKind; 26] = [
        ErrorKind::Io,
        ErrorKind::Truncated,
        ErrorKind::BadMagic,
        ErrorKind::UnsupportedVersion,
        ErrorKind::UnknownValueType,
        ErrorKind::UnknownTensorType,
        ErrorKind::CountOverrun,
        ErrorKind::InvalidUtf8,
        ErrorKind::InvalidBool,
        ErrorKind::NestingTooDeep,
        ErrorKind::TooManyDims,
        ErrorKind::ElementCountOverflow,
        ErrorKind::EmptyKey,
        ErrorKind::DuplicateKey,
        ErrorKind::DuplicateTensor,
        ErrorKind::BadAlignment,
        ErrorKind::MisalignedTensor,
        ErrorKind::TensorOverlap,
        ErrorKind::TensorOutOfBounds,
        ErrorKind::TensorShapeMismatch,
        ErrorKind::KeyMissing,
        ErrorKind::WrongType,
        ErrorKind::OutOfRange,
        ErrorKind::TensorDataSize,
        ErrorKind::TensorOrder,
        ErrorKind::InvalidWrite,
    ];

    /// snake_case name, as used in `tests/malformed/manifest.json`.
    pub fn as_str(self) -> &'static str {
        use ErrorKind::*;
        match self {
            Io => "io",
            Truncated => "truncated",
            BadMagic => "bad_magic",
            UnsupportedVersion => "unsupported_version",
            UnknownValueType => "unknown_value_type",
            UnknownTensorType => "unknown_tensor_type",
            CountOverrun => "count_overrun",
            InvalidUtf8 => "invalid_utf8",
            InvalidBool => "invalid_bool",
            NestingTooDeep => "nesting_too_deep",
            TooManyDims => "too_many_dims",
            ElementCountOverflow => "element_count_overflow",
            EmptyKey => "empty_key",
            DuplicateKey => "duplicate_key",
            DuplicateTensor => "duplicate_tensor",
            BadAlignment => "bad_alignment",
            MisalignedTensor => "misaligned_tensor",
            TensorOverlap => "tensor_overlap",
            TensorOutOfBounds => "tensor_out_of_bounds",
            TensorShapeMismatch => "tensor_shape_mismatch",
            KeyMissing => "key_missing",
            WrongType => "wrong_type",
            OutOfRange => "out_of_range",
            TensorDataSize => "tensor_data_size",
            TensorOrder => "tensor_order",
            InvalidWrite => "invalid_write",
        }
    }

    /// Parses [`ErrorKind::as_str`]'s output.
    pub fn from_name(s: &str) -> Option<ErrorKind> {
        ErrorKind::ALL.iter().copied().find(|k| k.as_str() == s)
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl GgufError {
    /// This error's kind.
    pub fn kind(&self) -> ErrorKind {
        use GgufError as E;
        match self {
            E::Io { .. } => ErrorKind::Io,
            E::Truncated { .. } => ErrorKind::Truncated,
            E::BadMagic { .. } => ErrorKind::BadMagic,
            E::UnsupportedVersion { .. } => ErrorKind::UnsupportedVersion,
            E::UnknownValueType { .. } => ErrorKind::UnknownValueType,
            E::UnknownTensorType { .. } => ErrorKind::UnknownTensorType,
            E::CountOverrun { .. } => ErrorKind::CountOverrun,
            E::InvalidUtf8 { .. } => ErrorKind::InvalidUtf8,
            E::InvalidBool { .. } => ErrorKind::InvalidBool,
            E::NestingTooDeep { .. } => ErrorKind::NestingTooDeep,
            E::TooManyDims { .. } => ErrorKind::TooManyDims,
            E::ElementCountOverflow { .. } => ErrorKind::ElementCountOverflow,
            E::EmptyKey { .. } => ErrorKind::EmptyKey,
            E::DuplicateKey { .. } => ErrorKind::DuplicateKey,
            E::DuplicateTensor { .. } => ErrorKind::DuplicateTensor,
            E::BadAlignment { .. } => ErrorKind::BadAlignment,
            E::MisalignedTensor { .. } => ErrorKind::MisalignedTensor,
            E::TensorOverlap { .. } => ErrorKind::TensorOverlap,
            E::TensorOutOfBounds { .. } => ErrorKind::TensorOutOfBounds,
            E::TensorShapeMismatch { .. } => ErrorKind::TensorShapeMismatch,
            E::KeyMissing { .. } => ErrorKind::KeyMissing,
            E::WrongType { .. } => ErrorKind::WrongType,
            E::OutOfRange { .. } => ErrorKind::OutOfRange,
            E::TensorDataSize { .. } => ErrorKind::TensorDataSize,
            E::TensorOrder { .. } => ErrorKind::TensorOrder,
            E::InvalidWrite { .. } => ErrorKind::InvalidWrite,
        }
    }

    /// The absolute byte offset in the file the error points at, when it has one.
    pub fn offset(&self) -> Option<u64> {
        use GgufError as E;
        match self {
            E::BadMagic { .. } => Some(0),
            E::Truncated { offset, .. }
            | E::UnsupportedVersion { offset, .. }
            | E::UnknownValueType { offset, .. }
            | E::UnknownTensorType { offset, .. }
            | E::CountOverrun { offset, .. }
            | E::InvalidUtf8 { offset, .. }
            | E::InvalidBool { offset, .. }
            | E::NestingTooDeep { offset, .. }
            | E::TooManyDims { offset, .. }
            | E::ElementCountOverflow { offset, .. }
            | E::EmptyKey { offset, .. }
            | E::DuplicateKey { offset, .. }
            | E::DuplicateTensor { offset, .. }
            | E::BadAlignment { offset, .. }
            | E::MisalignedTensor { offset, .. }
            | E::TensorOverlap { offset, .. }
            | E::TensorOutOfBounds { offset, .. }
            | E::TensorShapeMismatch { offset, .. } => Some(*offset),
            _ => None,
        }
    }

    pub(crate) fn io(path: Option<&std::path::Path>, source: std::io::Error) -> GgufError {
        GgufError::Io {
            path: path.map(|p| p.to_path_buf()),
            source,
        }
    }
}
