//! GGUF: a validating reader (memory-mapped or from owned bytes) and writers (in-memory and streaming).
//!
//! ```
//! use gguf::{GgmlType, GgufFile, GgufWriter};
//! let mut w = GgufWriter::new();
//! w.add_kv("general.architecture", "llama").add_kv("llama.block_count", 2u32);
//! w.add_tensor_f32("t", &[2, 2], &[1.0, 2.0, 3.0, 4.0])?;
//! let f = GgufFile::from_bytes(w.to_bytes()?)?;
//! assert_eq!(f.metadata().architecture()?, "llama");
//! assert_eq!(f.metadata().get_u32("llama.block_count")?, 2);
//! let t = f.tensor("t").unwrap();
//! assert_eq!((t.ty, t.n_bytes()), (GgmlType::F32, 16));
//! assert_eq!(f.tensor_data(t).len(), 16);
//! # Ok::<(), gguf::GgufError>(())
//! ```
pub mod error;
pub mod reader;
pub mod types;
pub mod value;
pub mod writer;

pub use error::{ErrorKind, GgufError};
pub use reader::{
    GgufFile, TensorInfo, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGML_MAX_NAME, MAX_ARRAY_DEPTH,
    MAX_DIMS,
};
pub use types::GgmlType;
pub use value::{Array, Metadata, Value, ValueType};
pub use writer::{GgufWriter, StreamingWriter, TensorDecl, TensorSink, WRITE_VERSION};
