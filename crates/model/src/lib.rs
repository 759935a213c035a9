//! Llama-family model descriptions: hyper-parameters read from GGUF ([`ModelConfig`]), tensor names
//! ([`names`]), the weights located and shape-checked ([`ModelWeights`]), the operations of a forward
//! pass ([`ops`]), llama.cpp's quantization mixtures ([`mixture`]) and synthetic models ([`synth`]).

pub mod config;
pub mod error;
pub mod mixture;
pub mod names;
pub mod ops;
pub mod rope;
pub mod synth;
pub mod weights;

pub use config::{Arch, ModelConfig, RopeScaling, RopeScalingKind, RopeStyle};
pub use error::ModelError;
pub use mixture::{FileType, MixtureContext, QuantScheme};
pub use names::LayerTensor;
pub use ops::{ops, OpDesc, OpKind};
pub use rope::Rope;
pub use weights::{LayerWeights, ModelWeights, MATRIX_TYPES, VECTOR_TYPES};

/// A model file opened and checked: the parsed file, its configuration and its weights.
#[derive(Debug)]
pub struct Model {
    pub file: gguf::GgufFile,
    pub config: ModelConfig,
    pub weights: ModelWeights,
}

impl Model {
    /// Opens (memory-maps) a GGUF file and checks it is a model this project runs.
    pub fn open(path: impl AsRef<std::path::Path>) -> Result<Model, ModelError> {
        let file = gguf::GgufFile::open(path)?;
        Model::from_file(file)
    }

    /// Checks an already opened file.
    pub fn from_file(file: gguf::GgufFile) -> Result<Model, ModelError> {
        let config = ModelConfig::from_gguf(&file)?;
        let weights = ModelWeights::from_gguf(&config, &file)?;
        Ok(Model {
            file,
            config,
            weights,
        })
    }
}
