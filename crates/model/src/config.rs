//! Hyper-parameters of a Llama-family model, read from GGUF metadata the way llama.cpp reads them
//! (`llama_model::load_hparams` and the per-architecture `load_arch_hparams`).

use gguf::{GgufFile, Metadata, Value};

use crate::error::ModelError;
use crate::names;

/// An architecture this project runs. All are decoder-only transformers with RMSNorm, RoPE,
/// grouped-query attention and a SwiGLU feed-forward block; they differ in the details below.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    /// `llama`: Llama 2/3/3.1/3.2, SmolLM/SmolLM2, Mistral 7B. Rotates adjacent pairs.
    Llama,
    /// `qwen2`: Qwen2/Qwen2.5. Biases on Q/K/V; rotates the two halves of each head (NeoX style).
    Qwen2,
}

impl Arch {
    /// The `general.architecture` strings this project accepts.
    pub const SUPPORTED: &'static [&'static str] = &["llama", "qwen2"];

    /// The `general.architecture` string, which is also the metadata key prefix.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
        }
    }

    /// The architecture for a `general.architecture` string.
    pub fn from_name(name: &str) -> Result<Arch, ModelError> {
        match name {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            other => Err(ModelError::UnsupportedArch {
                found: other.to_owned(),
                supported: Arch::SUPPORTED,
            }),
        }
    }

    /// How this architecture pairs dimensions for RoPE (`llama_model_rope_type` in llama.cpp).
    pub fn rope_style(self) -> RopeStyle {
        match self {
            Arch::Llama => RopeStyle::Normal,
            Arch::Qwen2 => RopeStyle::Neox,
        }
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Which dimensions of a head RoPE rotates together.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeStyle {
    /// Pairs `(x[2i], x[2i+1])` (llama.cpp `LLAMA_ROPE_TYPE_NORM`).
    Normal,
    /// Pairs `(x[i], x[i + n_rot/2])` (llama.cpp `LLAMA_ROPE_TYPE_NEOX`).
    Neox,
}

/// Context-extension scheme recorded in `{arch}.rope.scaling.type`. Llama 3's scheme is not
/// expressed here but by the `rope_freqs.weight` tensor ([`ModelConfig::rope_freqs`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeScalingKind {
    /// No scaling (`none`, or `linear` with factor 1, llama.cpp's default).
    None,
    /// Positions divided by `factor` (llama.cpp `freq_scale = 1 / factor`).
    Linear,
}

/// RoPE scaling as the metadata states it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeScaling {
    /// The scheme.
    pub kind: RopeScalingKind,
    /// `{arch}.rope.scaling.factor` (1.0 when absent or 0).
    pub factor: f32,
    /// `{arch}.rope.scaling.original_context_length`, or the training context when absent.
    pub original_ctx: usize,
}

/// Hyper-parameters of one model: everything a forward pass needs besides the weights.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Architecture.
    pub arch: Arch,
    /// `general.name`, if present.
    pub name: Option<String>,
    /// Transformer blocks (`{arch}.block_count`).
    pub n_layer: usize,
    /// Residual stream width (`{arch}.embedding_length`).
    pub n_embd: usize,
    /// Query heads (`{arch}.attention.head_count`).
    pub n_head: usize,
    /// Key/value heads (`{arch}.attention.head_count_kv`, default `n_head`).
    pub n_head_kv: usize,
    /// Width of one head (`{arch}.attention.key_length`, default `n_embd / n_head`).
    pub head_dim: usize,
    /// Feed-forward hidden width (`{arch}.feed_forward_length`).
    pub n_ff: usize,
    /// Vocabulary size: rows of `token_embd.weight`.
    pub n_vocab: usize,
    /// Context length the model was trained with (`{arch}.context_length`).
    pub n_ctx_train: usize,
    /// RMSNorm epsilon (`{arch}.attention.layer_norm_rms_epsilon`).
    pub rms_norm_eps: f32,
    /// RoPE base frequency theta (`{arch}.rope.freq_base`, default 10000).
    pub rope_freq_base: f32,
    /// Dimensions of each head that RoPE rotates (`{arch}.rope.dimension_count`); equals `head_dim`
    /// for every architecture here.
    pub n_rot: usize,
    /// Pairing of rotated dimensions.
    pub rope_style: RopeStyle,
    /// Linear scaling, if any.
    pub rope_scaling: RopeScaling,
    /// Whether `rope_freqs.weight` (Llama 3 frequency factors, `n_rot/2` floats dividing each
    /// frequency) is present.
    pub rope_freqs: bool,
    /// No `output.weight`: the LM head reuses `token_embd.weight`.
    pub tied_output: bool,
    /// Q/K/V projections carry biases (`blk.N.attn_{q,k,v}.bias`).
    pub qkv_bias: bool,
    /// `general.file_type` (llama.cpp's `llama_ftype`), if present.
    pub file_type: Option<u32>,
}

/// Largest dimension accepted from metadata: bigger values are corrupt and would only overflow
/// later size arithmetic.
const MAX_DIM: u64 = 1 << 24;

impl ModelConfig {
    /// Reads the hyper-parameters of a Llama-family model: metadata first, then the presence and
    /// size of a few tensors (`token_embd.weight` gives the vocabulary size; `output.weight`,
    /// `rope_freqs.weight` and `blk.0.attn_q.bias` are optional features).
    ///
    /// Shapes of the weights are checked by [`crate::ModelWeights::from_gguf`], not here.
    pub fn from_gguf(file: &GgufFile) -> Result<ModelConfig, ModelError> {
        let md = file.metadata();
        let arch = Arch::from_name(md.get_str("general.architecture")?)?;
        let p = arch.name();
        let key = |s: &str| format!("{p}.{s}");

        let n_layer = dim(md, &key("block_count"))?;
        let n_embd = dim(md, &key("embedding_length"))?;
        let n_ff = per_layer_dim(md, &key("feed_forward_length"), n_layer)?;
        let head_key = key("attention.head_count");
        let n_head = per_layer_dim(md, &head_key, n_layer)?;
        let kv_key = key("attention.head_count_kv");
        let n_head_kv = if md.contains_key(&kv_key) {
            per_layer_dim(md, &kv_key, n_layer)?
        } else {
            n_head
        };
        if n_head % n_head_kv != 0 {
            return Err(invalid(
                &kv_key,
                n_head_kv,
                format!("must divide {head_key} = {n_head}"),
            ));
        }

        let kl_key = key("attention.key_length");
        let head_dim = if md.contains_key(&kl_key) {
            dim(md, &kl_key)?
        } else {
            if n_embd % n_head != 0 {
                return Err(invalid(
                    &head_key,
                    n_head,
                    format!("does not divide embedding_length {n_embd} and {kl_key} is absent"),
                ));
            }
            n_embd / n_head
        };
        let vl_key = key("attention.value_length");
        if md.contains_key(&vl_key) {
            let v = dim(md, &vl_key)?;
            if v != head_dim {
                return Err(invalid(
                    &vl_key,
                    v,
                    format!("must equal the key length {head_dim} for {p}"),
                ));
            }
        }
        let rot_key = key("rope.dimension_count");
        let n_rot = if md.contains_key(&rot_key) {
            dim(md, &rot_key)?
        } else {
            head_dim
        };
        if n_rot != head_dim {
            // llama.cpp asserts this for both graphs (`n_embd_head == n_rot`).
            return Err(invalid(
                &rot_key,
                n_rot,
                format!("must equal the head size {head_dim} for {p}"),
            ));
        }

        let n_ctx_train = dim(md, &key("context_length"))?;
        let eps_key = key("attention.layer_norm_rms_epsilon");
        let rms_norm_eps = md.get_f32(&eps_key)?;
        if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0 && rms_norm_eps < 1.0) {
            return Err(invalid(&eps_key, rms_norm_eps, "must be in (0, 1)".into()));
        }
        let base_key = key("rope.freq_base");
        let rope_freq_base = opt_f32(md, &base_key)?.unwrap_or(10000.0);
        if !(rope_freq_base.is_finite() && rope_freq_base > 1.0) {
            return Err(invalid(&base_key, rope_freq_base, "must be > 1".into()));
        }
        let rope_scaling = rope_scaling(md, p, n_ctx_train)?;

        let embd = file
            .tensor(names::TOKEN_EMBD)
            .ok_or_else(|| ModelError::MissingTensor {
                name: names::TOKEN_EMBD.into(),
                why: "every model needs the token embedding".into(),
            })?;
        let n_vocab = match embd.dims.as_slice() {
            [w, v] if *w == n_embd as u64 && *v > 0 && *v <= MAX_DIM * 4 => *v as usize,
            other => {
                return Err(ModelError::TensorShape {
                    name: names::TOKEN_EMBD.into(),
                    expected: vec![n_embd as u64, 0],
                    found: other.to_vec(),
                })
            }
        };
        let vs_key = key("vocab_size");
        if md.contains_key(&vs_key) {
            let v = md.get_u64(&vs_key)?;
            if v != n_vocab as u64 {
                return Err(invalid(
                    &vs_key,
                    v,
                    format!("{} has {n_vocab} rows", names::TOKEN_EMBD),
                ));
            }
        }
        if let Some(tokens) = md.get("tokenizer.ggml.tokens").and_then(Value::as_array) {
            if tokens.len() != n_vocab {
                return Err(invalid(
                    "tokenizer.ggml.tokens",
                    format!("<{} tokens>", tokens.len()),
                    format!("{} has {n_vocab} rows", names::TOKEN_EMBD),
                ));
            }
        }

        let file_type = md.opt_u32("general.file_type")?;
        let name = md
            .get("general.name")
            .and_then(Value::as_str)
            .map(str::to_owned);

        Ok(ModelConfig {
            arch,
            name,
            n_layer,
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
            n_ff,
            n_vocab,
            n_ctx_train,
            rms_norm_eps,
            rope_freq_base,
            n_rot,
            rope_style: arch.rope_style(),
            rope_scaling,
            rope_freqs: file.tensor(names::ROPE_FREQS).is_some(),
            tied_output: file.tensor(names::OUTPUT).is_none(),
            qkv_bias: file
                .tensor(&crate::names::LayerTensor::AttnQBias.name(0))
                .is_some(),
            file_type,
        })
    }

    /// Width of all query heads together (`n_head * head_dim`).
    pub fn n_embd_q(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Width of all key (or value) heads together (`n_head_kv * head_dim`).
    pub fn n_embd_kv(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// Query heads per key/value head.
    pub fn n_gqa(&self) -> usize {
        self.n_head / self.n_head_kv.max(1)
    }

    /// The factor positions are multiplied by before RoPE (llama.cpp's `freq_scale`).
    pub fn rope_freq_scale(&self) -> f32 {
        match self.rope_scaling.kind {
            RopeScalingKind::None => 1.0,
            RopeScalingKind::Linear => 1.0 / self.rope_scaling.factor,
        }
    }

    /// Bytes of a KV cache holding `n_ctx` positions of every layer, `elem_bytes` per element
    /// (2 for f16).
    pub fn kv_cache_bytes(&self, n_ctx: usize, elem_bytes: usize) -> u64 {
        2 * self.n_layer as u64 * n_ctx as u64 * self.n_embd_kv() as u64 * elem_bytes as u64
    }

    /// Writes the hyper-parameter keys (`{arch}.*`) the way llama.cpp's converter does, so that
    /// [`ModelConfig::from_gguf`] and llama.cpp read back this configuration.
    pub fn write_metadata(&self, md: &mut Metadata) {
        let p = self.arch.name();
        md.insert(format!("{p}.block_count"), self.n_layer as u32);
        md.insert(format!("{p}.context_length"), self.n_ctx_train as u32);
        md.insert(format!("{p}.embedding_length"), self.n_embd as u32);
        md.insert(format!("{p}.feed_forward_length"), self.n_ff as u32);
        md.insert(format!("{p}.attention.head_count"), self.n_head as u32);
        md.insert(
            format!("{p}.attention.head_count_kv"),
            self.n_head_kv as u32,
        );
        md.insert(format!("{p}.rope.freq_base"), self.rope_freq_base);
        md.insert(
            format!("{p}.attention.layer_norm_rms_epsilon"),
            self.rms_norm_eps,
        );
        if self.head_dim * self.n_head != self.n_embd {
            md.insert(format!("{p}.attention.key_length"), self.head_dim as u32);
            md.insert(format!("{p}.attention.value_length"), self.head_dim as u32);
        }
        if self.arch == Arch::Llama {
            md.insert(format!("{p}.vocab_size"), self.n_vocab as u32);
        }
        md.insert(format!("{p}.rope.dimension_count"), self.n_rot as u32);
        if self.rope_scaling.kind == RopeScalingKind::Linear {
            md.insert(format!("{p}.rope.scaling.type"), "linear");
            md.insert(format!("{p}.rope.scaling.factor"), self.rope_scaling.factor);
            md.insert(
                format!("{p}.rope.scaling.original_context_length"),
                self.rope_scaling.original_ctx as u32,
            );
        }
    }
}

fn invalid(key: &str, value: impl std::fmt::Display, why: String) -> ModelError {
    ModelError::InvalidValue {
        key: key.to_owned(),
        value: value.to_string(),
        why,
    }
}

/// A required positive dimension.
fn dim(md: &Metadata, key: &str) -> Result<usize, ModelError> {
    let v = md.get_u64(key)?;
    check_dim(key, v)
}

fn check_dim(key: &str, v: u64) -> Result<usize, ModelError> {
    if v == 0 || v > MAX_DIM {
        return Err(invalid(key, v, format!("must be in 1..={MAX_DIM}")));
    }
    usize::try_from(v).map_err(|_| invalid(key, v, "does not fit in usize".into()))
}

/// A dimension llama.cpp allows to be per layer (`get_key_or_arr`): a scalar, or an array of
/// `n_layer` values, which this project accepts only when they are all equal.
fn per_layer_dim(md: &Metadata, key: &str, n_layer: usize) -> Result<usize, ModelError> {
    let v = md.require(key)?;
    let Some(arr) = v.as_array() else {
        return dim(md, key);
    };
    if arr.len() != n_layer {
        return Err(invalid(
            key,
            format!("<array of {}>", arr.len()),
            format!("a per-layer array must have block_count = {n_layer} entries"),
        ));
    }
    let mut first = None;
    for (i, x) in arr.iter().enumerate() {
        let n = x
            .as_int()
            .and_then(|n| u64::try_from(n).ok())
            .ok_or_else(|| {
                invalid(
                    &format!("{key}[{i}]"),
                    format!("{x:?}"),
                    "must be a non-negative integer".into(),
                )
            })?;
        let n = check_dim(&format!("{key}[{i}]"), n)?;
        match first {
            None => first = Some(n),
            Some(f) if f != n => {
                return Err(ModelError::UnsupportedLayout(format!(
                    "{key} differs between layers ({f} in layer 0, {n} in layer {i})"
                )))
            }
            Some(_) => {}
        }
    }
    first.ok_or_else(|| invalid(key, "[]", "empty per-layer array".into()))
}

fn opt_f32(md: &Metadata, key: &str) -> Result<Option<f32>, ModelError> {
    Ok(md.opt_f32(key)?)
}

fn rope_scaling(md: &Metadata, p: &str, n_ctx_train: usize) -> Result<RopeScaling, ModelError> {
    let type_key = format!("{p}.rope.scaling.type");
    let kind_name = match md.get(&type_key) {
        None => "linear",
        Some(_) => md.get_str(&type_key)?,
    };
    let factor_key = format!("{p}.rope.scaling.factor");
    let old_key = format!("{p}.rope.scale_linear");
    let factor = match opt_f32(md, &factor_key)? {
        Some(f) => f,
        None => opt_f32(md, &old_key)?.unwrap_or(0.0),
    };
    // llama.cpp treats a factor of 0 as "unset".
    let factor = if factor == 0.0 { 1.0 } else { factor };
    if !(factor.is_finite() && factor > 0.0) {
        return Err(invalid(&factor_key, factor, "must be > 0".into()));
    }
    let kind = match kind_name {
        "none" => RopeScalingKind::None,
        "linear" if factor == 1.0 => RopeScalingKind::None,
        "linear" => RopeScalingKind::Linear,
        other => {
            return Err(ModelError::UnsupportedRopeScaling {
                key: type_key,
                found: other.to_owned(),
            })
        }
    };
    let orig_key = format!("{p}.rope.scaling.original_context_length");
    let original_ctx = if md.contains_key(&orig_key) {
        dim(md, &orig_key)?
    } else {
        n_ctx_train
    };
    Ok(RopeScaling {
        kind,
        factor,
        original_ctx,
    })
}
