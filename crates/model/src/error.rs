//! The error type of this crate.

use gguf::GgmlType;

/// Why a GGUF file cannot be read as a model this project runs, or why a synthetic model cannot be
/// made. Every variant names the key, tensor or file concerned.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// The GGUF layer reported a problem (missing key, wrong value type, I/O, malformed file).
    #[error(transparent)]
    Gguf(#[from] gguf::GgufError),

    /// `general.architecture` names an architecture this project cannot run.
    #[error("unsupported architecture '{found}' (supported: {})", supported.join(", "))]
    UnsupportedArch {
        found: String,
        supported: &'static [&'static str],
    },

    /// A metadata value is present and well-typed but makes no sense (zero heads, a head count that
    /// does not divide, a negative epsilon...).
    #[error("invalid metadata {key} = {value}: {why}")]
    InvalidValue {
        key: String,
        value: String,
        why: String,
    },

    /// A rope scaling type this project does not implement.
    #[error("unsupported rope scaling '{found}' in {key} (supported: none, linear, and llama3-style rope_freqs.weight)")]
    UnsupportedRopeScaling { key: String, found: String },

    /// A tensor the architecture needs is absent.
    #[error("missing tensor '{name}' ({why})")]
    MissingTensor { name: String, why: String },

    /// A tensor has a shape other than the hyper-parameters imply.
    #[error(
        "tensor '{name}' has shape {found:?}, expected {expected:?} (ggml order: row length first)"
    )]
    TensorShape {
        name: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },

    /// A tensor is stored in a type this project cannot compute with in that role.
    #[error(
        "tensor '{name}' has type {ty}, which is not supported for {role} (supported: {})",
        list_types(supported)
    )]
    UnsupportedTensorType {
        name: String,
        ty: GgmlType,
        role: &'static str,
        supported: &'static [GgmlType],
    },

    /// The file mixes layouts this project does not run (e.g. fused `attn_qkv`, biases on some layers
    /// only, a tensor from a layer beyond `block_count`).
    #[error("unsupported tensor layout: {0}")]
    UnsupportedLayout(String),

    /// An unknown `--quant` name.
    #[error("unknown quantization '{found}' (supported: {supported})")]
    UnknownQuant { found: String, supported: String },

    /// An unknown synthetic preset name.
    #[error("unknown preset '{found}' (supported: {supported})")]
    UnknownPreset { found: String, supported: String },

    /// A synthetic model's vocabulary source is missing or unusable.
    #[error("vocabulary {path}: {why}")]
    Vocab { path: String, why: String },

    /// The quantizer refused a tensor.
    #[error("quantizing tensor '{name}' to {ty}: {source}")]
    Quant {
        name: String,
        ty: GgmlType,
        #[source]
        source: quant::QuantError,
    },

    /// A synthetic-model option is out of range.
    #[error("invalid option {option}: {why}")]
    InvalidOption { option: &'static str, why: String },
}

fn list_types(types: &[GgmlType]) -> String {
    types
        .iter()
        .map(|t| t.name())
        .collect::<Vec<_>>()
        .join(", ")
}
