//! Which type each tensor gets when a model is quantized: llama.cpp's rules
//! (`llama_tensor_get_type` and `tensor_type_fallback` in src/llama-quant.cpp), restated for the file
//! types this project can produce, for a model quantized from F32 without an importance matrix.

use gguf::GgmlType;

use crate::error::ModelError;
use crate::names::{self, split_layer_name};

/// A llama.cpp file type (`enum llama_ftype`, written as `general.file_type`): the default tensor
/// type plus the rules that deviate from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum FileType {
    AllF32 = 0,
    MostlyF16 = 1,
    MostlyQ4_0 = 2,
    MostlyQ4_1 = 3,
    MostlyQ8_0 = 7,
    MostlyQ5_0 = 8,
    MostlyQ5_1 = 9,
    MostlyQ4_K_S = 14,
    MostlyQ4_K_M = 15,
    MostlyQ5_K_S = 16,
    MostlyQ5_K_M = 17,
    MostlyQ6_K = 18,
    MostlyBF16 = 32,
}

impl FileType {
    /// Every file type this module implements.
    pub const ALL: [FileType; 13] = [
        FileType::AllF32,
        FileType::MostlyF16,
        FileType::MostlyBF16,
        FileType::MostlyQ4_0,
        FileType::MostlyQ4_1,
        FileType::MostlyQ5_0,
        FileType::MostlyQ5_1,
        FileType::MostlyQ8_0,
        FileType::MostlyQ4_K_S,
        FileType::MostlyQ4_K_M,
        FileType::MostlyQ5_K_S,
        FileType::MostlyQ5_K_M,
        FileType::MostlyQ6_K,
    ];

    /// The `general.file_type` number.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// The file type for a `general.file_type` number.
    pub fn from_id(id: u32) -> Option<FileType> {
        FileType::ALL.iter().copied().find(|f| f.id() == id)
    }

    /// The name `llama-quantize` takes, lower-cased (`q4_k_m`).
    pub fn name(self) -> &'static str {
        match self {
            FileType::AllF32 => "f32",
            FileType::MostlyF16 => "f16",
            FileType::MostlyBF16 => "bf16",
            FileType::MostlyQ4_0 => "q4_0",
            FileType::MostlyQ4_1 => "q4_1",
            FileType::MostlyQ5_0 => "q5_0",
            FileType::MostlyQ5_1 => "q5_1",
            FileType::MostlyQ8_0 => "q8_0",
            FileType::MostlyQ4_K_S => "q4_k_s",
            FileType::MostlyQ4_K_M => "q4_k_m",
            FileType::MostlyQ5_K_S => "q5_k_s",
            FileType::MostlyQ5_K_M => "q5_k_m",
            FileType::MostlyQ6_K => "q6_k",
        }
    }

    /// The type most tensors get (`llama_ftype_get_default_type`).
    pub fn default_type(self) -> GgmlType {
        match self {
            FileType::AllF32 => GgmlType::F32,
            FileType::MostlyF16 => GgmlType::F16,
            FileType::MostlyBF16 => GgmlType::BF16,
            FileType::MostlyQ4_0 => GgmlType::Q4_0,
            FileType::MostlyQ4_1 => GgmlType::Q4_1,
            FileType::MostlyQ5_0 => GgmlType::Q5_0,
            FileType::MostlyQ5_1 => GgmlType::Q5_1,
            FileType::MostlyQ8_0 => GgmlType::Q8_0,
            FileType::MostlyQ4_K_S | FileType::MostlyQ4_K_M => GgmlType::Q4K,
            FileType::MostlyQ5_K_S | FileType::MostlyQ5_K_M => GgmlType::Q5K,
            FileType::MostlyQ6_K => GgmlType::Q6K,
        }
    }

    /// The file type llama.cpp records for a file whose matrices are all `ty` (its `--pure` mode),
    /// if there is one.
    pub fn for_pure(ty: GgmlType) -> Option<FileType> {
        Some(match ty {
            GgmlType::F32 => FileType::AllF32,
            GgmlType::F16 => FileType::MostlyF16,
            GgmlType::BF16 => FileType::MostlyBF16,
            GgmlType::Q4_0 => FileType::MostlyQ4_0,
            GgmlType::Q4_1 => FileType::MostlyQ4_1,
            GgmlType::Q5_0 => FileType::MostlyQ5_0,
            GgmlType::Q5_1 => FileType::MostlyQ5_1,
            GgmlType::Q8_0 => FileType::MostlyQ8_0,
            // llama-quantize takes `Q4_K` and `Q5_K` as aliases of the `_M` mixtures.
            GgmlType::Q4K => FileType::MostlyQ4_K_M,
            GgmlType::Q5K => FileType::MostlyQ5_K_M,
            GgmlType::Q6K => FileType::MostlyQ6_K,
            _ => return None,
        })
    }
}

/// How to choose each tensor's type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantScheme {
    /// llama.cpp's rules for a file type (what `llama-quantize MODEL OUT q4_k_m` does).
    Mixture(FileType),
    /// Every matrix in one type, only falling back where a row length does not fit the block size
    /// (what `llama-quantize --pure` does).
    Pure(GgmlType),
}

/// The single tensor types [`QuantScheme::parse`] accepts as pure schemes.
pub const PURE_TYPES: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

impl QuantScheme {
    /// Parses a `--quant` name. A llama.cpp file-type name (`f16`, `q4_0`, `q8_0`, `q4_k_m`,
    /// `q6_k`...) selects that mixture, as `llama-quantize` would apply it; a type name that is not a
    /// file type (`q4_k`, `q5_k`, `q2_k`, `q3_k`) selects that type for every matrix. `pure` forces
    /// the single-type reading of any type name (`q4_0 --pure`: even `output.weight` in Q4_0).
    pub fn parse(name: &str, pure: bool) -> Result<QuantScheme, ModelError> {
        let l = name.to_ascii_lowercase();
        if pure {
            if let Some(t) = GgmlType::from_name(&l).filter(|t| PURE_TYPES.contains(t)) {
                return Ok(QuantScheme::Pure(t));
            }
        } else if let Some(f) = FileType::ALL.iter().copied().find(|f| f.name() == l) {
            return Ok(QuantScheme::Mixture(f));
        } else if let Some(t) = GgmlType::from_name(&l).filter(|t| PURE_TYPES.contains(t)) {
            return Ok(QuantScheme::Pure(t));
        }
        Err(ModelError::UnknownQuant {
            found: name.to_owned(),
            supported: QuantScheme::names(pure).join(", "),
        })
    }

    /// The names [`QuantScheme::parse`] accepts.
    pub fn names(pure: bool) -> Vec<String> {
        let mut v: Vec<String> = Vec::new();
        if !pure {
            v.extend(FileType::ALL.iter().map(|f| f.name().to_owned()));
        }
        for t in PURE_TYPES {
            let n = t.name().to_ascii_lowercase();
            if !v.contains(&n) {
                v.push(n);
            }
        }
        v
    }

    /// The `general.file_type` to record.
    pub fn file_type(self) -> Option<FileType> {
        match self {
            QuantScheme::Mixture(f) => Some(f),
            QuantScheme::Pure(t) => FileType::for_pure(t),
        }
    }

    /// A short name for messages and file names (`q4_k_m`, `pure q4_K`).
    pub fn label(self) -> String {
        match self {
            QuantScheme::Mixture(f) => f.name().to_owned(),
            QuantScheme::Pure(t) => format!("pure {t}"),
        }
    }

    /// The type of tensor `name` with shape `dims` (ggml order) in a model of `n_layer` blocks,
    /// quantized from F32. `tied` says the model has no `output.weight` (the token embedding then
    /// follows the output's rule); `llm_type_70b` says llama.cpp classifies the model as 70B (its
    /// attn_v then gets more bits).
    pub fn tensor_type(self, name: &str, dims: &[u64], ctx: &MixtureContext) -> GgmlType {
        // tensor_allows_quantization: only matrices named *weight, never norms. Everything else
        // stays as the converter wrote it, which is F32 for every 1-D tensor.
        let n_dims = dims.iter().rposition(|&d| d > 1).map_or(1, |i| i + 1);
        if n_dims < 2 || !name.ends_with("weight") || name.contains("_norm.weight") {
            return GgmlType::F32;
        }
        let (default, ftype, pure) = match self {
            QuantScheme::Mixture(f) => (f.default_type(), f, false),
            QuantScheme::Pure(t) => (t, FileType::for_pure(t).unwrap_or(FileType::AllF32), true),
        };
        if !default.is_quantized() {
            return default;
        }
        let mut ty = default;
        if !pure {
            ty = mixture_type(ftype, ty, name, dims, ctx);
        }
        fallback(ty, dims.first().copied().unwrap_or(0))
    }
}

/// The facts about a model that llama.cpp's rules look at besides the tensor itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MixtureContext {
    /// Blocks in the model.
    pub n_layer: usize,
    /// No `output.weight`.
    pub tied: bool,
    /// llama.cpp's `LLM_TYPE_70B` (llama: 80 blocks with grouped-query attention; qwen2: 80 blocks).
    pub llm_type_70b: bool,
}

impl MixtureContext {
    /// The context for a model configuration.
    pub fn for_config(cfg: &crate::ModelConfig) -> MixtureContext {
        let llm_type_70b = cfg.n_layer == 80
            && match cfg.arch {
                crate::Arch::Llama => cfg.n_head != cfg.n_head_kv,
                crate::Arch::Qwen2 => true,
            };
        MixtureContext {
            n_layer: cfg.n_layer,
            tied: cfg.tied_output,
            llm_type_70b,
        }
    }
}

/// `use_more_bits` in llama-quant.cpp: the first and last eighth of the layers, and every third
/// layer in between, get more bits.
pub fn use_more_bits(i_layer: usize, n_layer: usize) -> bool {
    let (i, n) = (i_layer as i64, n_layer as i64);
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

fn mixture_type(
    ftype: FileType,
    mut ty: GgmlType,
    name: &str,
    dims: &[u64],
    ctx: &MixtureContext,
) -> GgmlType {
    use FileType::*;
    // The per-category counters of llama.cpp (i_attention_wv, i_ffn_down) count tensors in the
    // loader's order, which sorts by block number, one tensor per block: they equal the block index.
    let layer = split_layer_name(name).map_or(0, |(i, _)| i);
    let n = ctx.n_layer;
    let is_output = name == names::OUTPUT;
    let is_embd = name == names::TOKEN_EMBD;
    if is_output || (ctx.tied && is_embd) {
        let nx = dims.first().copied().unwrap_or(0);
        if nx % ty.block_size() as u64 != 0 {
            ty = GgmlType::Q8_0;
        } else if ty != GgmlType::Q8_0 {
            ty = GgmlType::Q6K;
        }
    } else if is_embd {
        // The untied token embedding keeps the default type for every file type here.
    } else if name.contains("attn_v.weight") {
        if matches!(ftype, MostlyQ4_K_M | MostlyQ5_K_M) && use_more_bits(layer, n) {
            ty = GgmlType::Q6K;
        } else if ftype == MostlyQ4_K_S && layer < 4 {
            ty = GgmlType::Q5K;
        }
        if ctx.llm_type_70b && matches!(ty, GgmlType::Q3K | GgmlType::Q4K) {
            ty = GgmlType::Q5K;
        }
    } else if name.contains("ffn_down") {
        if (ftype == MostlyQ4_K_M || ftype == MostlyQ5_K_M) && use_more_bits(layer, n) {
            ty = GgmlType::Q6K;
        } else if ftype == MostlyQ4_K_S && layer < n / 8 {
            ty = GgmlType::Q5K;
        }
    }
    ty
}

/// `tensor_type_fallback`: a row length that is not a whole number of blocks demotes a K-quant to a
/// 32-element type of about the same size, and anything that still does not fit to F16.
pub fn fallback(ty: GgmlType, row_len: u64) -> GgmlType {
    let bs = ty.block_size() as u64;
    if row_len % bs == 0 {
        return ty;
    }
    let alt = match ty {
        GgmlType::Q2K | GgmlType::Q3K => GgmlType::Q4_0,
        GgmlType::Q4K => GgmlType::Q5_0,
        GgmlType::Q5K => GgmlType::Q5_1,
        GgmlType::Q6K => GgmlType::Q8_0,
        other => other,
    };
    if row_len % alt.block_size() as u64 != 0 {
        GgmlType::F16
    } else {
        alt
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_names() {
        assert_eq!(
            QuantScheme::parse("Q4_K_M", false).unwrap(),
            QuantScheme::Mixture(FileType::MostlyQ4_K_M)
        );
        assert_eq!(
            QuantScheme::parse("q4_k", false).unwrap(),
            QuantScheme::Pure(GgmlType::Q4K)
        );
        assert_eq!(
            QuantScheme::parse("q4_0", true).unwrap(),
            QuantScheme::Pure(GgmlType::Q4_0)
        );
        assert!(QuantScheme::parse("q4_k_m", true).is_err());
        let e = QuantScheme::parse("iq2_xs", false).unwrap_err().to_string();
        assert!(e.contains("q4_k_m") && e.contains("iq2_xs"), "{e}");
    }

    #[test]
    fn fallback_chain() {
        assert_eq!(fallback(GgmlType::Q4K, 576), GgmlType::Q5_0);
        assert_eq!(fallback(GgmlType::Q6K, 576), GgmlType::Q8_0);
        assert_eq!(fallback(GgmlType::Q5K, 576), GgmlType::Q5_1);
        assert_eq!(fallback(GgmlType::Q4K, 512), GgmlType::Q4K);
        assert_eq!(fallback(GgmlType::Q4K, 100), GgmlType::F16);
        assert_eq!(fallback(GgmlType::Q4_0, 100), GgmlType::F16);
    }
}
