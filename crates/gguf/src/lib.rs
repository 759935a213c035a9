//! GGUF: memory-mapped reader, writer, validation.
pub mod types;
pub use types::GgmlType;
