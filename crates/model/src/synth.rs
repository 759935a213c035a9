//! Synthetic models: the real architecture and hyper-parameters of a published model, random
//! weights, quantized by this project's own quantizers and written as GGUF that llama.cpp loads.
//!
//! The weights are random but scaled so that activations stay O(1) through every block and the
//! logits come out with a standard deviation of about 3 ([`LOGIT_STD`]), so a forward pass is numerically like a
//! real one (no NaN/inf, a softmax that is neither flat nor one-hot). Speed is real; text is not.
//!
//! Every tensor is generated in fixed-size chunks of rows, each from its own random stream keyed by
//! (seed, tensor name, chunk index): the bytes of the file depend on the seed only, not on the
//! number of threads.

use std::path::{Path, PathBuf};

use gguf::{Array, GgmlType, GgufFile, Metadata, StreamingWriter, TensorDecl, Value};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use crate::config::{Arch, ModelConfig, RopeScaling, RopeScalingKind};
use crate::error::ModelError;
use crate::mixture::{MixtureContext, QuantScheme};
use crate::names::{self, split_layer_name, LayerTensor};
use crate::weights::expected_tensors;

/// Llama 3's RoPE frequency adjustment (`rope_scaling.rope_type = "llama3"` in the Hugging Face
/// config), which llama.cpp's converter turns into `rope_freqs.weight`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Rope {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

/// The published hyper-parameters of a model family member.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PresetSpec {
    /// `--preset` name.
    pub name: &'static str,
    /// The model it reproduces (Hugging Face id).
    pub hf_id: &'static str,
    pub arch: Arch,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub n_ff: usize,
    /// Vocabulary size of the real model (the synthetic one takes the size of the vocabulary it copies).
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub llama3_rope: Option<Llama3Rope>,
    /// Output projection tied to the token embedding.
    pub tied: bool,
    /// Biases on Q/K/V.
    pub qkv_bias: bool,
    /// Where the default vocabulary comes from, relative to the cache folder (`.cache/`).
    pub default_vocab: &'static str,
    /// The repo script that fetches [`PresetSpec::default_vocab`] and the default chat template.
    pub vocab_script: &'static str,
    /// The model's chat template, relative to the cache folder, for presets whose default vocabulary
    /// file carries none (llama.cpp's `ggml-vocab-llama-bpe.gguf`).
    pub default_chat_template: Option<&'static str>,
}

/// A synthetic-model preset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Preset {
    Smollm2_135m,
    Llama32_1b,
    Llama32_3b,
    Llama31_8b,
    Qwen25_05b,
}

const LLAMA32_ROPE: Llama3Rope = Llama3Rope {
    factor: 32.0,
    low_freq_factor: 1.0,
    high_freq_factor: 4.0,
    original_max_position_embeddings: 8192,
};

const LLAMA31_ROPE: Llama3Rope = Llama3Rope {
    factor: 8.0,
    ..LLAMA32_ROPE
};

impl Preset {
    /// Every preset.
    pub const ALL: [Preset; 5] = [
        Preset::Smollm2_135m,
        Preset::Llama32_1b,
        Preset::Llama32_3b,
        Preset::Llama31_8b,
        Preset::Qwen25_05b,
    ];

    /// The published hyper-parameters (from each model's `config.json`).
    pub fn spec(self) -> PresetSpec {
        match self {
            Preset::Smollm2_135m => PresetSpec {
                name: "smollm2-135m",
                hf_id: "HuggingFaceTB/SmolLM2-135M-Instruct",
                arch: Arch::Llama,
                n_layer: 30,
                n_embd: 576,
                n_head: 9,
                n_head_kv: 3,
                n_ff: 1536,
                n_vocab: 49152,
                n_ctx_train: 8192,
                rms_norm_eps: 1e-5,
                rope_theta: 100000.0,
                llama3_rope: None,
                tied: true,
                qkv_bias: false,
                default_vocab: "models/smollm2-135m-instruct-q4_1.gguf",
                vocab_script: "scripts/fetch_model.sh",
                default_chat_template: None,
            },
            Preset::Llama32_1b => PresetSpec {
                name: "llama-3.2-1b",
                hf_id: "meta-llama/Llama-3.2-1B-Instruct",
                arch: Arch::Llama,
                n_layer: 16,
                n_embd: 2048,
                n_head: 32,
                n_head_kv: 8,
                n_ff: 8192,
                n_vocab: 128256,
                n_ctx_train: 131072,
                rms_norm_eps: 1e-5,
                rope_theta: 500000.0,
                llama3_rope: Some(LLAMA32_ROPE),
                tied: true,
                qkv_bias: false,
                default_vocab: "vocab/ggml-vocab-llama-bpe.gguf",
                vocab_script: "scripts/fetch_vocabs.sh",
                default_chat_template: Some(
                    "vocab/templates/meta-llama-Llama-3.2-3B-Instruct.jinja",
                ),
            },
            Preset::Llama32_3b => PresetSpec {
                name: "llama-3.2-3b",
                hf_id: "meta-llama/Llama-3.2-3B-Instruct",
                arch: Arch::Llama,
                n_layer: 28,
                n_embd: 3072,
                n_head: 24,
                n_head_kv: 8,
                n_ff: 8192,
                n_vocab: 128256,
                n_ctx_train: 131072,
                rms_norm_eps: 1e-5,
                rope_theta: 500000.0,
                llama3_rope: Some(LLAMA32_ROPE),
                tied: true,
                qkv_bias: false,
                default_vocab: "vocab/ggml-vocab-llama-bpe.gguf",
                vocab_script: "scripts/fetch_vocabs.sh",
                default_chat_template: Some(
                    "vocab/templates/meta-llama-Llama-3.2-3B-Instruct.jinja",
                ),
            },
            Preset::Llama31_8b => PresetSpec {
                name: "llama-3.1-8b",
                hf_id: "meta-llama/Llama-3.1-8B-Instruct",
                arch: Arch::Llama,
                n_layer: 32,
                n_embd: 4096,
                n_head: 32,
                n_head_kv: 8,
                n_ff: 14336,
                n_vocab: 128256,
                n_ctx_train: 131072,
                rms_norm_eps: 1e-5,
                rope_theta: 500000.0,
                llama3_rope: Some(LLAMA31_ROPE),
                tied: false,
                qkv_bias: false,
                default_vocab: "vocab/ggml-vocab-llama-bpe.gguf",
                vocab_script: "scripts/fetch_vocabs.sh",
                default_chat_template: Some(
                    "vocab/templates/meta-llama-Llama-3.1-8B-Instruct.jinja",
                ),
            },
            Preset::Qwen25_05b => PresetSpec {
                name: "qwen2.5-0.5b",
                hf_id: "Qwen/Qwen2.5-0.5B-Instruct",
                arch: Arch::Qwen2,
                n_layer: 24,
                n_embd: 896,
                n_head: 14,
                n_head_kv: 2,
                n_ff: 4864,
                n_vocab: 151936,
                n_ctx_train: 32768,
                rms_norm_eps: 1e-6,
                rope_theta: 1000000.0,
                llama3_rope: None,
                tied: true,
                qkv_bias: true,
                default_vocab: "vocab/ggml-vocab-qwen2.gguf",
                vocab_script: "scripts/fetch_vocabs.sh",
                default_chat_template: None,
            },
        }
    }

    /// The `--preset` name.
    pub fn name(self) -> &'static str {
        self.spec().name
    }

    /// The preset for a `--preset` name.
    pub fn from_name(name: &str) -> Result<Preset, ModelError> {
        let l = name.to_ascii_lowercase();
        Preset::ALL
            .iter()
            .copied()
            .find(|p| p.name() == l)
            .ok_or_else(|| ModelError::UnknownPreset {
                found: name.to_owned(),
                supported: Preset::ALL.map(Preset::name).join(", "),
            })
    }

    /// The configuration of this preset with `n_vocab` tokens, shrunk as `shrink` says.
    pub fn config(self, n_vocab: usize, shrink: &Shrink) -> Result<ModelConfig, ModelError> {
        let s = self.spec();
        let head_dim = s.n_embd / s.n_head;
        let div = shrink.heads_div.max(1);
        if s.n_head_kv % div != 0 {
            return Err(ModelError::InvalidOption {
                option: "heads-div",
                why: format!(
                    "{div} does not divide the {} key/value heads of {}",
                    s.n_head_kv, s.name
                ),
            });
        }
        let n_head = s.n_head / div;
        let n_head_kv = s.n_head_kv / div;
        // Keep the feed-forward width a whole number of 32-element blocks.
        let n_ff = if div == 1 {
            s.n_ff
        } else {
            (s.n_ff / div).div_ceil(32) * 32
        };
        let n_layer = shrink.layers.unwrap_or(s.n_layer);
        if n_layer == 0 {
            return Err(ModelError::InvalidOption {
                option: "layers",
                why: "a model needs at least one block".into(),
            });
        }
        if n_vocab == 0 {
            return Err(ModelError::InvalidOption {
                option: "vocab",
                why: "the vocabulary is empty".into(),
            });
        }
        Ok(ModelConfig {
            arch: s.arch,
            name: Some(format!("synthetic {}", s.name)),
            n_layer,
            n_embd: if div == 1 {
                s.n_embd
            } else {
                n_head * head_dim
            },
            n_head,
            n_head_kv,
            head_dim,
            n_ff,
            n_vocab,
            n_ctx_train: s.n_ctx_train,
            rms_norm_eps: s.rms_norm_eps,
            rope_freq_base: s.rope_theta,
            n_rot: head_dim,
            rope_style: s.arch.rope_style(),
            rope_scaling: RopeScaling {
                kind: RopeScalingKind::None,
                factor: 1.0,
                original_ctx: s.n_ctx_train,
            },
            rope_freqs: s.llama3_rope.is_some(),
            tied_output: s.tied,
            qkv_bias: s.qkv_bias,
            file_type: None,
        })
    }
}

/// Test-only reductions of a preset, so tests can build every architecture in seconds. The
/// defaults change nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Shrink {
    /// Number of blocks instead of the preset's.
    pub layers: Option<usize>,
    /// Divide the query and key/value head counts (and the feed-forward width) by this, keeping the
    /// head size and the grouped-query ratio. 0 or 1: unchanged.
    pub heads_div: usize,
}

/// Where the synthetic model's tokenizer comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VocabSource {
    /// Copy every `tokenizer.*` key of this GGUF file (a real model or a `ggml-vocab-*.gguf`).
    File(PathBuf),
    /// A generated byte-level BPE vocabulary: the 256 bytes plus BOS and EOS, no merges. Loads in
    /// llama.cpp; meant for small test models that need no real text.
    ByteLevel,
}

/// Everything [`synth_to_file`] needs.
#[derive(Clone, Debug)]
pub struct SynthOptions {
    pub preset: Preset,
    pub scheme: QuantScheme,
    /// Seed of every random stream.
    pub seed: u64,
    pub vocab: VocabSource,
    /// A Jinja chat template to store as `tokenizer.chat_template` (replacing the vocabulary's).
    pub chat_template: Option<String>,
    pub shrink: Shrink,
    /// Worker threads (0: one per core).
    pub threads: usize,
}

/// Progress of [`synth_to_file`], reported after each piece of data written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SynthProgress {
    /// Index of the tensor being written.
    pub tensor: usize,
    /// Number of tensors.
    pub n_tensors: usize,
    /// Name of the tensor being written.
    pub name: String,
    /// Tensor data bytes written so far, over all tensors.
    pub bytes_done: u64,
    /// Tensor data bytes in the whole file.
    pub bytes_total: u64,
}

/// What [`synth_to_file`] wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthReport {
    /// The model's configuration (as [`ModelConfig::from_gguf`] will read it back).
    pub config: ModelConfig,
    /// Every tensor with its type and shape, in file order.
    pub tensors: Vec<TensorDecl>,
    /// File size in bytes.
    pub file_bytes: u64,
}

/// The tensors, types and metadata of a synthetic model, without the data: what
/// [`synth_to_file`] will write.
#[derive(Clone, Debug)]
pub struct SynthPlan {
    pub config: ModelConfig,
    pub metadata: Metadata,
    pub tensors: Vec<TensorDecl>,
}

/// Elements generated per random stream (and per parallel task): the unit of determinism.
const CHUNK_ELEMS: usize = 1 << 18;

/// Builds the plan: configuration from the preset and vocabulary, each tensor's type from the
/// quantization scheme, and the metadata (`general.*`, hyper-parameters, tokenizer).
pub fn plan(opts: &SynthOptions) -> Result<SynthPlan, ModelError> {
    let tokenizer = match &opts.vocab {
        VocabSource::File(p) => tokenizer_from_file(p, opts.preset)?,
        VocabSource::ByteLevel => byte_level_tokenizer(),
    };
    let n_vocab = match tokenizer
        .get("tokenizer.ggml.tokens")
        .and_then(Value::as_array)
    {
        Some(a) => a.len(),
        None => 0,
    };
    let mut config = opts.preset.config(n_vocab, &opts.shrink)?;
    let ftype = opts.scheme.file_type();
    config.file_type = ftype.map(|f| f.id());

    let mut md = Metadata::new();
    md.insert("general.architecture", config.arch.name());
    md.insert("general.type", "model");
    md.insert(
        "general.name",
        config.name.clone().unwrap_or_else(|| "synthetic".into()),
    );
    if let Some(f) = ftype {
        md.insert("general.file_type", f.id());
    }
    md.insert("general.quantization_version", 2u32);
    config.write_metadata(&mut md);
    for (k, v) in tokenizer.iter() {
        md.insert(k, v.clone());
    }
    if let Some(t) = &opts.chat_template {
        md.insert("tokenizer.chat_template", t.as_str());
    }
    md.insert("crossover.synth.preset", opts.preset.name());
    md.insert("crossover.synth.seed", opts.seed);
    md.insert("crossover.synth.quant", opts.scheme.label());

    let tensors = tensor_plan(&config, opts.scheme);
    for t in &tensors {
        if !quant::can_quantize(t.ty) {
            return Err(ModelError::InvalidOption {
                option: "quant",
                why: format!(
                    "{} needs {} for '{}', which this project cannot quantize to",
                    opts.scheme.label(),
                    t.ty,
                    t.name
                ),
            });
        }
    }
    Ok(SynthPlan {
        config,
        metadata: md,
        tensors,
    })
}

/// Every tensor of a model with this configuration, in file order, with the type `scheme` gives it.
pub fn tensor_plan(config: &ModelConfig, scheme: QuantScheme) -> Vec<TensorDecl> {
    let ctx = MixtureContext::for_config(config);
    expected_tensors(config)
        .into_iter()
        .map(|(name, dims)| {
            let ty = scheme.tensor_type(&name, &dims, &ctx);
            TensorDecl { name, dims, ty }
        })
        .collect()
}

/// Writes a synthetic model to `out` (through a temporary file renamed at the end, so a failed
/// or interrupted run leaves no half-written model), reporting progress to `progress`.
pub fn synth_to_file(
    opts: &SynthOptions,
    out: &Path,
    progress: &mut (dyn FnMut(&SynthProgress) + Send),
) -> Result<SynthReport, ModelError> {
    let plan = plan(opts)?;
    let mut tmp = out.as_os_str().to_owned();
    tmp.push(".partial");
    let tmp = PathBuf::from(tmp);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(opts.threads)
        .build()
        .map_err(|e| ModelError::InvalidOption {
            option: "threads",
            why: e.to_string(),
        })?;
    let result = pool.install(|| write_plan(&plan, opts, &tmp, progress));
    if result.is_err() {
        // Best effort: the error being returned matters more than a failed cleanup.
        let _ = std::fs::remove_file(&tmp);
    }
    let file_bytes = result?;
    std::fs::rename(&tmp, out).map_err(|e| gguf::GgufError::Io {
        path: Some(out.to_path_buf()),
        source: e,
    })?;
    Ok(SynthReport {
        config: plan.config,
        tensors: plan.tensors,
        file_bytes,
    })
}

fn write_plan(
    plan: &SynthPlan,
    opts: &SynthOptions,
    path: &Path,
    progress: &mut (dyn FnMut(&SynthProgress) + Send),
) -> Result<u64, ModelError> {
    let mut bytes_total = 0u64;
    for t in &plan.tensors {
        bytes_total += t.n_bytes()?;
    }
    let mut w = StreamingWriter::create(path, &plan.metadata, plan.tensors.clone())?;
    let n_tensors = plan.tensors.len();
    let mut bytes_done = 0u64;
    // Enough chunks in flight to keep every thread busy, few enough to bound memory.
    let window = rayon::current_num_threads().max(1) * 2;
    for (ti, t) in plan.tensors.iter().enumerate() {
        let init = init_for(&plan.config, &t.name, opts)?;
        let row_len = t.dims.first().copied().unwrap_or(1) as usize;
        let n_rows = t.dims.iter().skip(1).product::<u64>() as usize;
        let rows_per_chunk = (CHUNK_ELEMS / row_len.max(1)).max(1);
        let n_chunks = n_rows.div_ceil(rows_per_chunk);
        let mut sink = w.begin_tensor(&t.name)?;
        let mut chunk = 0;
        while chunk < n_chunks {
            let end = (chunk + window).min(n_chunks);
            let pieces: Vec<Result<Vec<u8>, ModelError>> = (chunk..end)
                .into_par_iter()
                .map(|c| {
                    let r0 = c * rows_per_chunk;
                    let r1 = ((c + 1) * rows_per_chunk).min(n_rows);
                    let vals = init.generate(opts.seed, &t.name, c, r0 * row_len, r1 * row_len);
                    quantize(&t.name, t.ty, &vals)
                })
                .collect();
            for piece in pieces {
                let piece = piece?;
                std::io::Write::write_all(&mut sink, &piece).map_err(|e| gguf::GgufError::Io {
                    path: Some(path.to_path_buf()),
                    source: e,
                })?;
                bytes_done += piece.len() as u64;
            }
            chunk = end;
            progress(&SynthProgress {
                tensor: ti,
                n_tensors,
                name: t.name.clone(),
                bytes_done,
                bytes_total,
            });
        }
        sink.finish()?;
    }
    let file = w.finish()?;
    let f = file.into_inner().map_err(|e| gguf::GgufError::Io {
        path: Some(path.to_path_buf()),
        source: e.into_error(),
    })?;
    f.sync_all().map_err(|e| gguf::GgufError::Io {
        path: Some(path.to_path_buf()),
        source: e,
    })?;
    let len = f
        .metadata()
        .map_err(|e| gguf::GgufError::Io {
            path: Some(path.to_path_buf()),
            source: e,
        })?
        .len();
    Ok(len)
}

fn quantize(name: &str, ty: GgmlType, vals: &[f32]) -> Result<Vec<u8>, ModelError> {
    let n = ty
        .bytes_for(vals.len() as u64)
        .ok_or_else(|| ModelError::InvalidOption {
            option: "quant",
            why: format!(
                "{} values of '{name}' are not whole {ty} blocks",
                vals.len()
            ),
        })?;
    let mut out = vec![0u8; n as usize];
    quant::quantize_serial(ty, vals, &mut out).map_err(|source| ModelError::Quant {
        name: name.to_owned(),
        ty,
        source,
    })?;
    Ok(out)
}

/// Standard deviation of the logits: the output matrix (or the tied embedding) has
/// `LOGIT_STD / sqrt(n_embd)`, and its input (the final norm's output) has unit RMS. Large enough
/// that the top token usually stands clear of the next (as in real models: a peak near 15), small
/// enough that the softmax is not one-hot.
pub const LOGIT_STD: f32 = 3.0;

/// How a tensor's values are drawn.
#[derive(Clone, Debug, PartialEq)]
enum Init {
    /// Zero-mean, this standard deviation.
    Normal(f32),
    /// `1 + 0.1 z`: RMSNorm weights near one.
    NearOne,
    /// Fixed values (computed, not random).
    Values(Vec<f32>),
}

impl Init {
    /// Elements `[from, to)` (flat index) of the tensor, from the random stream of chunk `chunk`.
    fn generate(&self, seed: u64, name: &str, chunk: usize, from: usize, to: usize) -> Vec<f32> {
        match self {
            Init::Values(v) => v.get(from..to).map(<[f32]>::to_vec).unwrap_or_default(),
            Init::Normal(std) => {
                let mut rng = stream(seed, name, chunk);
                (from..to).map(|_| std * std_normal(&mut rng)).collect()
            }
            Init::NearOne => {
                let mut rng = stream(seed, name, chunk);
                (from..to)
                    .map(|_| 1.0 + 0.1 * std_normal(&mut rng))
                    .collect()
            }
        }
    }
}

/// The scale of every weight, chosen so that each projection maps unit-RMS inputs to unit-RMS
/// outputs (std = 1/sqrt(fan_in)); the residual stream then grows like sqrt(2 * n_layer), and the
/// logits (final norm, then the output matrix) have a standard deviation of [`LOGIT_STD`].
fn init_for(cfg: &ModelConfig, name: &str, opts: &SynthOptions) -> Result<Init, ModelError> {
    let inv_sqrt = |n: usize| 1.0 / (n as f32).sqrt();
    if name == names::TOKEN_EMBD || name == names::OUTPUT {
        return Ok(Init::Normal(LOGIT_STD * inv_sqrt(cfg.n_embd)));
    }
    if name == names::OUTPUT_NORM {
        return Ok(Init::NearOne);
    }
    if name == names::ROPE_FREQS {
        let r = opts
            .preset
            .spec()
            .llama3_rope
            .ok_or_else(|| ModelError::InvalidOption {
                option: "preset",
                why: format!("{} has no llama3 rope scaling", opts.preset.name()),
            })?;
        return Ok(Init::Values(llama3_rope_factors(
            cfg.rope_freq_base,
            cfg.head_dim,
            &r,
        )));
    }
    let t = split_layer_name(name)
        .and_then(|(_, s)| LayerTensor::from_suffix(s))
        .ok_or_else(|| ModelError::UnsupportedLayout(format!("no initializer for '{name}'")))?;
    Ok(match t {
        LayerTensor::AttnNorm | LayerTensor::FfnNorm => Init::NearOne,
        LayerTensor::AttnQ | LayerTensor::AttnK | LayerTensor::AttnV => {
            Init::Normal(inv_sqrt(cfg.n_embd))
        }
        LayerTensor::AttnQBias | LayerTensor::AttnKBias | LayerTensor::AttnVBias => {
            Init::Normal(0.1)
        }
        LayerTensor::AttnOutput => Init::Normal(inv_sqrt(cfg.n_embd_q())),
        LayerTensor::FfnGate | LayerTensor::FfnUp => Init::Normal(inv_sqrt(cfg.n_embd)),
        LayerTensor::FfnDown => Init::Normal(inv_sqrt(cfg.n_ff)),
    })
}

/// `rope_freqs.weight` as llama.cpp's converter computes it for `rope_type = "llama3"`: one factor per
/// rotated pair, dividing that pair's frequency (1 for short wavelengths, `factor` for long ones,
/// smoothly interpolated between).
pub fn llama3_rope_factors(theta: f32, head_dim: usize, r: &Llama3Rope) -> Vec<f32> {
    let old = r.original_max_position_embeddings as f64;
    let low_wavelen = old / r.low_freq_factor as f64;
    let high_wavelen = old / r.high_freq_factor as f64;
    let factor = r.factor as f64;
    (0..head_dim / 2)
        .map(|i| {
            // The converter computes the frequencies in f32 (torch), then the rest in f64.
            let exponent = (2 * i) as f32 / head_dim as f32;
            let freq = 1.0f32 / theta.powf(exponent);
            let wavelen = 2.0 * std::f64::consts::PI / freq as f64;
            let f = if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (old / wavelen - r.low_freq_factor as f64)
                    / (r.high_freq_factor as f64 - r.low_freq_factor as f64);
                1.0 / ((1.0 - smooth) / factor + smooth)
            };
            f as f32
        })
        .collect()
}

/// The random stream of one chunk of one tensor.
fn stream(seed: u64, name: &str, chunk: usize) -> ChaCha8Rng {
    // FNV-1a over the name: stable across platforms and Rust versions (unlike std's hasher).
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    let mut state = seed ^ h.rotate_left(17) ^ (chunk as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut key = [0u8; 32];
    for part in key.chunks_exact_mut(8) {
        part.copy_from_slice(&splitmix64(&mut state).to_le_bytes());
    }
    ChaCha8Rng::from_seed(key)
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// An approximately standard normal value: the Irwin-Hall sum of four uniforms, rescaled. Plain
/// arithmetic (no transcendental functions), so the same on every platform, and bounded by
/// +-3.47, so no outlier weights.
fn std_normal(rng: &mut ChaCha8Rng) -> f32 {
    const SCALE: f32 = 1.0 / (1u32 << 24) as f32;
    let mut s = 0.0f32;
    for _ in 0..4 {
        s += (rng.next_u32() >> 8) as f32 * SCALE;
    }
    // Sum of 4 U(0,1): mean 2, variance 1/3.
    (s - 2.0) * 3.0f32.sqrt()
}

/// The `tokenizer.*` keys of a GGUF file.
fn tokenizer_from_file(path: &Path, preset: Preset) -> Result<Metadata, ModelError> {
    if !path.exists() {
        return Err(ModelError::Vocab {
            path: path.display().to_string(),
            why: format!(
                "not found (the default vocabulary of {} is fetched by {})",
                preset.name(),
                preset.spec().vocab_script
            ),
        });
    }
    let f = GgufFile::open(path)?;
    let mut md = Metadata::new();
    for (k, v) in f.metadata().iter() {
        if k.starts_with("tokenizer.") {
            md.insert(k, v.clone());
        }
    }
    match md.get("tokenizer.ggml.tokens").and_then(Value::as_array) {
        Some(a) if !a.is_empty() => Ok(md),
        _ => Err(ModelError::Vocab {
            path: path.display().to_string(),
            why: "has no tokenizer.ggml.tokens".into(),
        }),
    }
}

/// GPT-2's byte-to-character map: printable bytes map to themselves, the rest to U+0100 onwards.
fn gpt2_byte_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    if printable(b) {
        return char::from(b);
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).unwrap_or('?')
}

/// A byte-level BPE vocabulary: the 256 byte tokens, then BOS and EOS as control tokens.
fn byte_level_tokenizer() -> Metadata {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| gpt2_byte_char(b).to_string()).collect();
    let mut types = vec![1i32; 256];
    tokens.push("<|bos|>".into());
    types.push(3);
    tokens.push("<|eos|>".into());
    types.push(3);
    let mut md = Metadata::new();
    md.insert("tokenizer.ggml.model", "gpt2");
    md.insert("tokenizer.ggml.pre", "default");
    md.insert("tokenizer.ggml.tokens", Value::Array(Array::String(tokens)));
    md.insert("tokenizer.ggml.token_type", Value::Array(Array::I32(types)));
    md.insert(
        "tokenizer.ggml.merges",
        Value::Array(Array::String(Vec::new())),
    );
    md.insert("tokenizer.ggml.bos_token_id", 256u32);
    md.insert("tokenizer.ggml.eos_token_id", 257u32);
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_is_a_bijection_onto_distinct_chars() {
        let chars: std::collections::HashSet<char> = (0..=255u8).map(gpt2_byte_char).collect();
        assert_eq!(chars.len(), 256);
        assert_eq!(gpt2_byte_char(b'A'), 'A');
        assert_eq!(gpt2_byte_char(b' '), '\u{120}');
    }

    #[test]
    fn streams_differ_by_name_chunk_and_seed() {
        let a = stream(1, "x", 0).next_u64();
        assert_ne!(a, stream(2, "x", 0).next_u64());
        assert_ne!(a, stream(1, "y", 0).next_u64());
        assert_ne!(a, stream(1, "x", 1).next_u64());
        assert_eq!(a, stream(1, "x", 0).next_u64());
    }

    #[test]
    fn normal_has_unit_variance() {
        let mut rng = stream(7, "n", 0);
        let n = 200_000;
        let v: Vec<f32> = (0..n).map(|_| std_normal(&mut rng)).collect();
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "var {var}");
        assert!(v.iter().all(|x| x.abs() <= 3.5));
    }
}
