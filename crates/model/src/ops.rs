//! The operations of one forward pass, listed with their types and shapes, so a backend can say
//! which it runs natively and which it would fall back on (`crossover audit`).

use gguf::GgmlType;

use crate::config::{ModelConfig, RopeStyle};
use crate::weights::ModelWeights;

/// What an operation computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// Rows of the token embedding for the input ids (dequantized to f32).
    GetRows,
    /// `x / rms(x) * w`.
    RmsNorm,
    /// `W x` for a weight matrix `W` (`[k, n]`, ggml order) and activations `[k, n_tokens]`.
    MatMul,
    /// Adds a bias vector to every column.
    AddBias,
    /// Rotary position embedding on Q or K ([`Op::rope_style`] says which pairing).
    Rope,
    /// Causal grouped-query attention of `n_tokens` queries over `n_kv` cached keys/values, in the
    /// KV cache type: scores, softmax, weighted sum.
    Attention,
    /// Writes the new keys/values into the cache (converting f32 to the cache type).
    KvStore,
    /// Residual addition.
    Add,
    /// `silu(gate) * up`.
    SwiGlu,
}

impl OpKind {
    /// Lower-case name (`mat_mul`, `rms_norm`...).
    pub fn name(self) -> &'static str {
        match self {
            OpKind::GetRows => "get_rows",
            OpKind::RmsNorm => "rms_norm",
            OpKind::MatMul => "mat_mul",
            OpKind::AddBias => "add_bias",
            OpKind::Rope => "rope",
            OpKind::Attention => "attention",
            OpKind::KvStore => "kv_store",
            OpKind::Add => "add",
            OpKind::SwiGlu => "swiglu",
        }
    }
}

/// One operation of a forward pass.
#[derive(Clone, Debug, PartialEq)]
pub struct OpDesc {
    /// What it computes.
    pub kind: OpKind,
    /// The block it belongs to (`None` for the embedding and the head).
    pub layer: Option<usize>,
    /// The weight it reads (`blk.3.attn_q.weight`), or a label for weight-less ops
    /// (`blk.3.attn_residual`).
    pub name: String,
    /// Type of the weight it reads; for attention and the KV store the cache type; otherwise F32.
    pub ty: GgmlType,
    /// Shapes of the operands (ggml order: fastest dimension first), weight first where there is one.
    pub inputs: Vec<Vec<u64>>,
    /// Shape of the result.
    pub output: Vec<u64>,
    /// For [`OpKind::Rope`]: which dimensions are paired.
    pub rope_style: Option<RopeStyle>,
}

impl OpDesc {
    fn new(kind: OpKind, layer: Option<usize>, name: String, ty: GgmlType) -> OpDesc {
        OpDesc {
            kind,
            layer,
            name,
            ty,
            inputs: Vec::new(),
            output: Vec::new(),
            rope_style: None,
        }
    }

    fn shapes(mut self, inputs: Vec<Vec<u64>>, output: Vec<u64>) -> OpDesc {
        self.inputs = inputs;
        self.output = output;
        self
    }
}

/// The operations of a forward pass over `n_tokens` new tokens with `n_kv` positions in the cache
/// afterwards (`n_kv >= n_tokens`; equal for a prefill from empty), with a KV cache of `kv_type`,
/// producing logits for the last token only (as generation does).
pub fn ops(
    cfg: &ModelConfig,
    w: &ModelWeights,
    n_tokens: u64,
    n_kv: u64,
    kv_type: GgmlType,
) -> Vec<OpDesc> {
    let t = n_tokens;
    let e = cfg.n_embd as u64;
    let q = cfg.n_embd_q() as u64;
    let kv = cfg.n_embd_kv() as u64;
    let hd = cfg.head_dim as u64;
    let ff = cfg.n_ff as u64;
    let f32 = GgmlType::F32;
    let mut v = Vec::new();

    v.push(
        OpDesc::new(
            OpKind::GetRows,
            None,
            w.token_embd.name.clone(),
            w.token_embd.ty,
        )
        .shapes(vec![w.token_embd.dims.clone(), vec![t]], vec![e, t]),
    );
    for (i, l) in w.layers.iter().enumerate() {
        let li = Some(i);
        let label = |s: &str| format!("blk.{i}.{s}");
        v.push(
            OpDesc::new(
                OpKind::RmsNorm,
                li,
                l.attn_norm.name.clone(),
                l.attn_norm.ty,
            )
            .shapes(vec![vec![e, t], vec![e]], vec![e, t]),
        );
        let proj = [
            (&l.attn_q, &l.attn_q_bias, q, cfg.n_head as u64),
            (&l.attn_k, &l.attn_k_bias, kv, cfg.n_head_kv as u64),
            (&l.attn_v, &l.attn_v_bias, kv, cfg.n_head_kv as u64),
        ];
        for (k, (wt, bias, n_out, heads)) in proj.into_iter().enumerate() {
            v.push(
                OpDesc::new(OpKind::MatMul, li, wt.name.clone(), wt.ty)
                    .shapes(vec![wt.dims.clone(), vec![e, t]], vec![n_out, t]),
            );
            if let Some(b) = bias {
                v.push(
                    OpDesc::new(OpKind::AddBias, li, b.name.clone(), b.ty)
                        .shapes(vec![vec![n_out, t], b.dims.clone()], vec![n_out, t]),
                );
            }
            if k < 2 {
                let mut r = OpDesc::new(
                    OpKind::Rope,
                    li,
                    label(if k == 0 { "rope_q" } else { "rope_k" }),
                    w.rope_freqs.as_ref().map_or(f32, |r| r.ty),
                )
                .shapes(vec![vec![hd, heads, t]], vec![hd, heads, t]);
                r.rope_style = Some(cfg.rope_style);
                v.push(r);
            }
        }
        v.push(
            OpDesc::new(OpKind::KvStore, li, label("kv_store"), kv_type)
                .shapes(vec![vec![kv, t], vec![kv, t]], vec![kv, n_kv]),
        );
        v.push(
            OpDesc::new(OpKind::Attention, li, label("attention"), kv_type).shapes(
                vec![
                    vec![hd, cfg.n_head as u64, t],
                    vec![hd, cfg.n_head_kv as u64, n_kv],
                    vec![hd, cfg.n_head_kv as u64, n_kv],
                ],
                vec![q, t],
            ),
        );
        v.push(
            OpDesc::new(
                OpKind::MatMul,
                li,
                l.attn_output.name.clone(),
                l.attn_output.ty,
            )
            .shapes(vec![l.attn_output.dims.clone(), vec![q, t]], vec![e, t]),
        );
        v.push(
            OpDesc::new(OpKind::Add, li, label("attn_residual"), f32)
                .shapes(vec![vec![e, t], vec![e, t]], vec![e, t]),
        );
        v.push(
            OpDesc::new(OpKind::RmsNorm, li, l.ffn_norm.name.clone(), l.ffn_norm.ty)
                .shapes(vec![vec![e, t], vec![e]], vec![e, t]),
        );
        for wt in [&l.ffn_gate, &l.ffn_up] {
            v.push(
                OpDesc::new(OpKind::MatMul, li, wt.name.clone(), wt.ty)
                    .shapes(vec![wt.dims.clone(), vec![e, t]], vec![ff, t]),
            );
        }
        v.push(
            OpDesc::new(OpKind::SwiGlu, li, label("swiglu"), f32)
                .shapes(vec![vec![ff, t], vec![ff, t]], vec![ff, t]),
        );
        v.push(
            OpDesc::new(OpKind::MatMul, li, l.ffn_down.name.clone(), l.ffn_down.ty)
                .shapes(vec![l.ffn_down.dims.clone(), vec![ff, t]], vec![e, t]),
        );
        v.push(
            OpDesc::new(OpKind::Add, li, label("ffn_residual"), f32)
                .shapes(vec![vec![e, t], vec![e, t]], vec![e, t]),
        );
    }
    v.push(
        OpDesc::new(
            OpKind::RmsNorm,
            None,
            w.output_norm.name.clone(),
            w.output_norm.ty,
        )
        .shapes(vec![vec![e, 1], vec![e]], vec![e, 1]),
    );
    let nv = cfg.n_vocab as u64;
    v.push(
        OpDesc::new(OpKind::MatMul, None, w.output.name.clone(), w.output.ty)
            .shapes(vec![w.output.dims.clone(), vec![e, 1]], vec![nv, 1]),
    );
    v
}
