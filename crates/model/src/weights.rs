//! The weights of a model, located and checked against its configuration before anything runs.

use std::collections::HashSet;

use gguf::{GgmlType, GgufFile, TensorInfo};

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::names::{self, split_layer_name, LayerTensor};

/// Types a weight matrix (or the token embedding) may be stored in.
pub const MATRIX_TYPES: &[GgmlType] = &[
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

/// Types a vector (norm weight, bias, rope frequency factors) may be stored in. llama.cpp never
/// quantizes 1-D tensors, so F32 is all that real files contain.
pub const VECTOR_TYPES: &[GgmlType] = &[GgmlType::F32];

/// The tensors of one transformer block.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerWeights {
    /// `[n_embd]`
    pub attn_norm: TensorInfo,
    /// `[n_embd, n_head * head_dim]`
    pub attn_q: TensorInfo,
    /// `[n_embd, n_head_kv * head_dim]`
    pub attn_k: TensorInfo,
    /// `[n_embd, n_head_kv * head_dim]`
    pub attn_v: TensorInfo,
    /// `[n_head * head_dim, n_embd]`
    pub attn_output: TensorInfo,
    /// `[n_head * head_dim]`, when [`ModelConfig::qkv_bias`].
    pub attn_q_bias: Option<TensorInfo>,
    /// `[n_head_kv * head_dim]`, when [`ModelConfig::qkv_bias`].
    pub attn_k_bias: Option<TensorInfo>,
    /// `[n_head_kv * head_dim]`, when [`ModelConfig::qkv_bias`].
    pub attn_v_bias: Option<TensorInfo>,
    /// `[n_embd]`
    pub ffn_norm: TensorInfo,
    /// `[n_embd, n_ff]`
    pub ffn_gate: TensorInfo,
    /// `[n_embd, n_ff]`
    pub ffn_up: TensorInfo,
    /// `[n_ff, n_embd]`
    pub ffn_down: TensorInfo,
}

impl LayerWeights {
    /// The tensor in a given role, if present.
    pub fn get(&self, t: LayerTensor) -> Option<&TensorInfo> {
        match t {
            LayerTensor::AttnNorm => Some(&self.attn_norm),
            LayerTensor::AttnQ => Some(&self.attn_q),
            LayerTensor::AttnK => Some(&self.attn_k),
            LayerTensor::AttnV => Some(&self.attn_v),
            LayerTensor::AttnOutput => Some(&self.attn_output),
            LayerTensor::AttnQBias => self.attn_q_bias.as_ref(),
            LayerTensor::AttnKBias => self.attn_k_bias.as_ref(),
            LayerTensor::AttnVBias => self.attn_v_bias.as_ref(),
            LayerTensor::FfnNorm => Some(&self.ffn_norm),
            LayerTensor::FfnGate => Some(&self.ffn_gate),
            LayerTensor::FfnUp => Some(&self.ffn_up),
            LayerTensor::FfnDown => Some(&self.ffn_down),
        }
    }
}

/// Every tensor a forward pass reads, each with its shape and type checked against the
/// [`ModelConfig`]. Holds the tensor-table entries (offsets into the file's data section), not the
/// data: read bytes with [`GgufFile::tensor_data`].
#[derive(Clone, Debug, PartialEq)]
pub struct ModelWeights {
    /// `[n_embd, n_vocab]`
    pub token_embd: TensorInfo,
    /// `[n_embd]`
    pub output_norm: TensorInfo,
    /// `[n_embd, n_vocab]`: `output.weight`, or the token embedding when tied.
    pub output: TensorInfo,
    /// `[n_rot / 2]` Llama 3 frequency factors, when present.
    pub rope_freqs: Option<TensorInfo>,
    /// One entry per block.
    pub layers: Vec<LayerWeights>,
}

/// The expected shape (ggml order) of a per-layer tensor.
pub fn layer_tensor_shape(cfg: &ModelConfig, t: LayerTensor) -> Vec<u64> {
    let e = cfg.n_embd as u64;
    let q = cfg.n_embd_q() as u64;
    let kv = cfg.n_embd_kv() as u64;
    let ff = cfg.n_ff as u64;
    match t {
        LayerTensor::AttnNorm | LayerTensor::FfnNorm => vec![e],
        LayerTensor::AttnQ => vec![e, q],
        LayerTensor::AttnK | LayerTensor::AttnV => vec![e, kv],
        LayerTensor::AttnOutput => vec![q, e],
        LayerTensor::AttnQBias => vec![q],
        LayerTensor::AttnKBias | LayerTensor::AttnVBias => vec![kv],
        LayerTensor::FfnGate | LayerTensor::FfnUp => vec![e, ff],
        LayerTensor::FfnDown => vec![ff, e],
    }
}

/// Whether a per-layer tensor is a vector (norm or bias) rather than a matrix.
fn is_vector(t: LayerTensor) -> bool {
    matches!(t, LayerTensor::AttnNorm | LayerTensor::FfnNorm) || t.is_bias()
}

/// Every tensor a model with this configuration has, with its shape, in the order llama.cpp's
/// converter writes them (global tensors first, then block by block).
pub fn expected_tensors(cfg: &ModelConfig) -> Vec<(String, Vec<u64>)> {
    let e = cfg.n_embd as u64;
    let v = cfg.n_vocab as u64;
    let mut out = vec![(names::TOKEN_EMBD.to_owned(), vec![e, v])];
    if cfg.rope_freqs {
        out.push((names::ROPE_FREQS.to_owned(), vec![cfg.n_rot as u64 / 2]));
    }
    for i in 0..cfg.n_layer {
        for t in LayerTensor::ALL {
            if t.is_bias() && !cfg.qkv_bias {
                continue;
            }
            out.push((t.name(i), layer_tensor_shape(cfg, t)));
        }
    }
    out.push((names::OUTPUT_NORM.to_owned(), vec![e]));
    if !cfg.tied_output {
        out.push((names::OUTPUT.to_owned(), vec![e, v]));
    }
    out
}

impl ModelWeights {
    /// Locates every tensor `cfg` calls for and checks its shape and type. Also rejects tensors the
    /// forward pass would not read (a fused `attn_qkv`, an output bias, a block beyond
    /// `block_count`...), since ignoring one would silently compute a different model.
    pub fn from_gguf(cfg: &ModelConfig, file: &GgufFile) -> Result<ModelWeights, ModelError> {
        let get = |name: &str, shape: Vec<u64>, vector: bool, why: &str| {
            let t = file.tensor(name).ok_or_else(|| ModelError::MissingTensor {
                name: name.to_owned(),
                why: why.to_owned(),
            })?;
            check(t, &shape, vector)?;
            Ok::<TensorInfo, ModelError>(t.clone())
        };
        let e = cfg.n_embd as u64;
        let v = cfg.n_vocab as u64;
        let token_embd = get(names::TOKEN_EMBD, vec![e, v], false, "token embedding")?;
        let output_norm = get(names::OUTPUT_NORM, vec![e], true, "final norm")?;
        let output = if cfg.tied_output {
            token_embd.clone()
        } else {
            get(names::OUTPUT, vec![e, v], false, "output projection")?
        };
        let rope_freqs = if cfg.rope_freqs {
            let half = cfg.n_rot as u64 / 2;
            Some(get(names::ROPE_FREQS, vec![half], true, "rope factors")?)
        } else {
            None
        };

        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let l = |t: LayerTensor| {
                get(
                    &t.name(i),
                    layer_tensor_shape(cfg, t),
                    is_vector(t),
                    &format!("block {i} of {}", cfg.n_layer),
                )
            };
            let bias = |t: LayerTensor| -> Result<Option<TensorInfo>, ModelError> {
                if cfg.qkv_bias {
                    l(t).map(Some)
                } else {
                    Ok(None)
                }
            };
            layers.push(LayerWeights {
                attn_norm: l(LayerTensor::AttnNorm)?,
                attn_q: l(LayerTensor::AttnQ)?,
                attn_k: l(LayerTensor::AttnK)?,
                attn_v: l(LayerTensor::AttnV)?,
                attn_output: l(LayerTensor::AttnOutput)?,
                attn_q_bias: bias(LayerTensor::AttnQBias)?,
                attn_k_bias: bias(LayerTensor::AttnKBias)?,
                attn_v_bias: bias(LayerTensor::AttnVBias)?,
                ffn_norm: l(LayerTensor::FfnNorm)?,
                ffn_gate: l(LayerTensor::FfnGate)?,
                ffn_up: l(LayerTensor::FfnUp)?,
                ffn_down: l(LayerTensor::FfnDown)?,
            });
        }

        let known: HashSet<String> = expected_tensors(cfg).into_iter().map(|(n, _)| n).collect();
        for t in file.tensors() {
            if known.contains(&t.name) {
                continue;
            }
            let why = match split_layer_name(&t.name) {
                Some((i, _)) if i >= cfg.n_layer => {
                    format!(
                        "tensor '{}' belongs to block {i}, but block_count is {}",
                        t.name, cfg.n_layer
                    )
                }
                Some((_, s)) if LayerTensor::from_suffix(s).is_some_and(LayerTensor::is_bias) => {
                    format!("tensor '{}' is a bias, but block 0 has none", t.name)
                }
                _ => format!(
                    "tensor '{}' is not part of the {} forward pass this project runs",
                    t.name, cfg.arch
                ),
            };
            return Err(ModelError::UnsupportedLayout(why));
        }

        Ok(ModelWeights {
            token_embd,
            output_norm,
            output,
            rope_freqs,
            layers,
        })
    }

    /// Bytes of weight data a forward pass reads (the tied output counted once).
    pub fn n_bytes(&self) -> u64 {
        let mut n = self.token_embd.n_bytes() + self.output_norm.n_bytes();
        if self.output != self.token_embd {
            n += self.output.n_bytes();
        }
        n += self.rope_freqs.as_ref().map_or(0, TensorInfo::n_bytes);
        for l in &self.layers {
            n += LayerTensor::ALL
                .iter()
                .filter_map(|&t| l.get(t))
                .map(TensorInfo::n_bytes)
                .sum::<u64>();
        }
        n
    }
}

fn check(t: &TensorInfo, shape: &[u64], vector: bool) -> Result<(), ModelError> {
    if t.dims != shape {
        return Err(ModelError::TensorShape {
            name: t.name.clone(),
            expected: shape.to_vec(),
            found: t.dims.clone(),
        });
    }
    let (supported, role) = if vector {
        (VECTOR_TYPES, "a vector (norm, bias, rope factors)")
    } else {
        (MATRIX_TYPES, "a weight matrix")
    };
    if !supported.contains(&t.ty) {
        return Err(ModelError::UnsupportedTensorType {
            name: t.name.clone(),
            ty: t.ty,
            role,
            supported,
        });
    }
    Ok(())
}
