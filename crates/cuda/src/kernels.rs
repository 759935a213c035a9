//! Typed launch wrappers, one per kernel family of `kernels/*.cu`. Each mirrors its kernel's C
//! signature; the backend and the kernel tests both go through these.

use gguf::GgmlType;

use crate::device::{DevBuf, Gpu};
use crate::error::CudaError;
use crate::kargs;

/// The weight types with GPU kernels, in the order of the kernel table (`FOR_EACH_TYPE` in
/// quant.cu lists the same names in the same order).
pub const TYPES: &[(GgmlType, &str)] = &[
    (GgmlType::F32, "f32"),
    (GgmlType::F16, "f16"),
    (GgmlType::BF16, "bf16"),
    (GgmlType::Q4_0, "q4_0"),
    (GgmlType::Q4_1, "q4_1"),
    (GgmlType::Q5_0, "q5_0"),
    (GgmlType::Q5_1, "q5_1"),
    (GgmlType::Q8_0, "q8_0"),
    (GgmlType::Q2K, "q2_k"),
    (GgmlType::Q3K, "q3_k"),
    (GgmlType::Q4K, "q4_k"),
    (GgmlType::Q5K, "q5_k"),
    (GgmlType::Q6K, "q6_k"),
];

/// Token-count buckets of the matrix-vector kernels (a kernel for bucket B takes 1..=B tokens).
pub const MV_NT: [usize; 4] = [1, 2, 4, 8];
/// Most tokens one matrix-vector launch handles.
pub const MV_MAX_NT: usize = 8;
const PER_TYPE: usize = 2 + 2 * MV_NT.len() + 2;
/// The quantized weight types, in the order of `FOR_EACH_QTYPE` in matvec_q.cu: each has
/// integer-dot matrix-vector kernels over quantized activations.
pub const QTYPES: &[(GgmlType, &str)] = &[
    (GgmlType::Q4_0, "q4_0"),
    (GgmlType::Q4_1, "q4_1"),
    (GgmlType::Q5_0, "q5_0"),
    (GgmlType::Q5_1, "q5_1"),
    (GgmlType::Q8_0, "q8_0"),
    (GgmlType::Q2K, "q2_k"),
    (GgmlType::Q3K, "q3_k"),
    (GgmlType::Q4K, "q4_k"),
    (GgmlType::Q5K, "q5_k"),
    (GgmlType::Q6K, "q6_k"),
];
const PER_QTYPE: usize = 2 * MV_NT.len();

/// How activations are quantized for the integer matrix-vector kernels (matvec_q.cu), matching
/// the CPU backend's `quant::dot::act_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActFormat {
    /// Blocks of 32 with an f16-rounded scale and sum: the CPU's `Q8_0` / `Q8_1` numbers.
    Q8x32 = 1,
    /// Super-blocks of 256 with an f32 scale and sums of 16: the CPU's `Q8_K`.
    Q8K = 2,
}

impl ActFormat {
    /// Elements per scale group the row length must be a multiple of.
    pub fn block(self) -> usize {
        match self {
            ActFormat::Q8x32 => 32,
            ActFormat::Q8K => 256,
        }
    }
}

/// The `RopeArgs` of matvec_q.cu: what a one-token Q/K/V launch needs to finish rope_store's
/// work itself.
#[repr(C)]
struct RopeArgs {
    pos: u64,
    slot: u64,
    factors: u64,
    theta_scale: f32,
    freq_scale: f32,
    n_rot: i32,
    hd: i32,
    kv_row: i32,
    pad: i32,
    kc: u64,
    vc: u64,
}

/// A Q/K/V launch's row counts and width as the kernels take them.
fn qkv_ints(rows: [usize; 3], cols: usize) -> Result<([i32; 3], i32), CudaError> {
    Ok((
        [
            i32_of(rows[0], "rows")?,
            i32_of(rows[1], "rows")?,
            i32_of(rows[2], "rows")?,
        ],
        i32_of(cols, "cols")?,
    ))
}

/// [`RopeArgs`] for Q/K/V rows `rows` (heads of `hd`, K and V rows `kv_row` wide in the cache),
/// checked.
#[allow(clippy::too_many_arguments)]
fn rope_args(
    rope: &RopeParams,
    rows: [usize; 3],
    pos: u64,
    slot: u64,
    hd: usize,
    kv_row: usize,
    kc: u64,
    vc: u64,
) -> Result<RopeArgs, CudaError> {
    if rope.n_rot > hd
        || !rope.n_rot.is_multiple_of(2)
        || !hd.is_multiple_of(2)
        || kv_row == 0
        || !rows[0].is_multiple_of(hd)
        || !rows[1].is_multiple_of(hd)
        || !rows[2].is_multiple_of(hd)
        || rows[1].max(rows[2]) > kv_row
    {
        return Err(CudaError::Arg(format!(
            "fused Q/K/V + RoPE: rows {rows:?}, head size {hd}, {} rotated",
            rope.n_rot
        )));
    }
    Ok(RopeArgs {
        pos,
        slot,
        factors: rope.factors,
        theta_scale: rope.theta_scale,
        freq_scale: rope.freq_scale,
        n_rot: rope.n_rot as i32,
        hd: i32_of(hd, "head size")?,
        kv_row: i32_of(kv_row, "KV row")?,
        pad: 0,
        kc,
        vc,
    })
}

/// Where a one-token SwiGLU product also quantizes its output row (the down projection's
/// activation) inside its launch, to the bytes [`Gpu::quantize_act`] would write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutQuant {
    pub fmt: ActFormat,
    /// `ceil(rows / 256)` zeroed u32 group counters; the kernel leaves them zeroed.
    pub cnt: u64,
    /// The int8 values and the scales written.
    pub qs: u64,
    pub ds: u64,
}

impl OutQuant {
    /// The kernel's (`qfmt`, counters, values, scales) arguments.
    fn args(q: Option<OutQuant>) -> (i32, u64, u64, u64) {
        q.map_or((0, 0, 0, 0), |q| (q.fmt as i32, q.cnt, q.qs, q.ds))
    }
}

/// The activation format of a weight type's integer kernels; `None` for float weights (they
/// take f32 activations, as on the CPU).
pub fn act_format(ty: GgmlType) -> Option<ActFormat> {
    use GgmlType::*;
    match ty {
        Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 => Some(ActFormat::Q8x32),
        Q2K | Q3K | Q4K | Q5K | Q6K => Some(ActFormat::Q8K),
        _ => None,
    }
}

/// Bytes of the quantized activations of `rows x cols` (int8 values, then a float2 per 32).
pub fn act_bytes(rows: usize, cols: usize) -> (usize, usize) {
    (rows * cols, rows * (cols / 32) * 8)
}

const OPS: &[&str] = &[
    "rms_norm",
    "rope_store",
    "swiglu",
    "to_f16",
    "argmax_rows",
    "attn_combine",
    "attn_partial_d2",
    "attn_partial_d3",
    "attn_partial_d4",
    "attn_partial_d8",
    "quantize_act",
    "attn_prefill_d2",
    "attn_prefill_d4",
    "swiglu_q",
    "attn_decode_d2",
    "attn_decode_d4",
    "l2_prefetch",
    "kv_prefetch",
];
const K_RMS_NORM: usize = 0;
const K_ROPE_STORE: usize = 1;
const K_SWIGLU: usize = 2;
const K_TO_F16: usize = 3;
const K_ARGMAX: usize = 4;
const K_ATTN_COMBINE: usize = 5;
const K_ATTN_PARTIAL: usize = 6;
const K_QUANTIZE_ACT: usize = 10;
const K_ATTN_PREFILL: usize = 11;
const K_SWIGLU_Q: usize = 13;
const K_ATTN_DECODE: usize = 14;
const K_KV_PREFETCH: usize = 17;
/// Units of 32 weights each thread of an `mvqe_*` block decodes before its wait (`MVQE_U` in
/// matvec_q.cu).
pub const MVQE_UNITS: usize = 2;
/// Row widths, in four-super-block steps of 1024 columns, the warp-per-row Q4_K down
/// projection `mvpd<S>_q4_k` is built for (session 36, [`Gpu::mvpd`]): the rows `mvqe` runs at
/// 128 threads.
pub const MVPD_STEPS: std::ops::RangeInclusive<usize> = 4..=8;
/// Kernel name parts of the warp-per-row `mvqw_*` products (session 36, [`Gpu::mvqw`]): the
/// K-quants `mvqe` runs on, and the aligned Q6_K copies.
pub const MVQW_TYPES: [&str; 7] = ["q4_k", "q5_k", "q6_k", "q6_ka", "q6_ku", "q6_ka4", "q6_ku4"];
/// Most splits [`Gpu::attn_merge`] merges (`AM_MAXS` in attn_batch.cu).
pub const ATTN_MERGE_MAX_SPLIT: usize = 1024;
/// Head sizes the tensor-core prefill attention ([`Gpu::attn_prefill`]) is built for.
pub const PREFILL_HEAD_DIMS: [usize; 2] = [64, 128];
/// Where [`Gpu::rope_store_rows`] reads Q, K and V rows and writes the rotated Q.
#[derive(Clone, Copy, Debug)]
pub struct RopeRows {
    /// Rotated Q, rows of `n_head * head_dim` floats (may be the input Q: in place).
    pub q_out: u64,
    /// Floats from one input Q row to the next.
    pub q_stride: usize,
    /// Floats from one input K (and V) row to the next.
    pub kv_stride: usize,
}

/// Rotation parameters of [`Gpu::rope_store`], the same numbers `cpu::ops::Rope` is built from.
#[derive(Clone, Copy, Debug)]
pub struct RopeParams {
    /// Device array of `n_rot / 2` frequency factors (Llama 3 `rope_freqs`), or 0 for none.
    pub factors: u64,
    /// `base^(-2 / n_rot)`: the angle of pair `i + 1` is the angle of pair `i` times this.
    pub theta_scale: f32,
    /// Linear position scaling (1 / scaling factor).
    pub freq_scale: f32,
    /// Rotated dimensions of each head.
    pub n_rot: usize,
}

impl RopeParams {
    /// Parameters for a rotation over `n_rot` dimensions with frequency base `base`.
    pub fn new(n_rot: usize, base: f32, freq_scale: f32, factors: u64) -> RopeParams {
        RopeParams {
            factors,
            theta_scale: base.powf(-2.0 / n_rot as f32),
            freq_scale,
            n_rot,
        }
    }
}

/// Head sizes the attention kernel is built for (32 x its lane width).
pub const HEAD_DIMS: [usize; 4] = [64, 96, 128, 256];

/// Every kernel name, in kernel-table order.
pub fn all_kernel_names() -> Vec<String> {
    let mut v = Vec::new();
    for (_, t) in TYPES {
        v.push(format!("get_rows_{t}"));
        v.push(format!("dequant_f16_{t}"));
        for nt in MV_NT {
            v.push(format!("matvec_{t}_{nt}"));
        }
        for nt in MV_NT {
            v.push(format!("matvec_swiglu_{t}_{nt}"));
        }
        v.push(format!("matvec_r4_{t}"));
        v.push(format!("matvec_r2_{t}"));
    }
    v.extend(OPS.iter().map(|s| s.to_string()));
    for (_, t) in QTYPES {
        for nt in MV_NT {
            v.push(format!("mvq_{t}_{nt}"));
        }
        for nt in MV_NT {
            v.push(format!("mvq_swiglu_{t}_{nt}"));
        }
    }
    for (_, t) in QTYPES {
        v.push(format!("mvr_{t}"));
        v.push(format!("mvr_swiglu_{t}"));
        v.push(format!("mvr_rope_{t}"));
    }
    for (_, t) in QTYPES {
        for nb in MMQ_NB {
            v.push(format!("mmq_{t}_{nb}"));
        }
    }
    v.push("rms_norm_w".into());
    for (_, t) in QTYPES {
        v.push(format!("mvw_{t}"));
    }
    v.push("act_quant_w".into());
    v.push("attn_batch_d2".into());
    v.push("attn_batch_d4".into());
    v.push("attn_one_d2".into());
    v.push("attn_one_d4".into());
    v.push("attn_batchw_d2".into());
    v.push("attn_batchw_d4".into());
    v.push("attn_onew_d2".into());
    v.push("attn_onew_d4".into());
    v.push("attn_batchm_d2".into());
    v.push("attn_batchm_d4".into());
    v.push("attn_merge".into());
    for (_, t) in QTYPES {
        for nt in MMF_NT {
            v.push(format!("mmf_{t}_{nt}"));
        }
    }
    for nt in MMF_NT {
        v.push(format!("mmk_q4_k_{nt}"));
    }
    v.push("attn_merge_q".into());
    for (a, b) in QKV_PAIRS {
        let name = |t: GgmlType| QTYPES.iter().find(|q| q.0 == t).map_or("", |q| q.1);
        v.push(format!("mvr_rope2_{}_{}", name(a), name(b)));
    }
    v.push("mv6_q6_k".into());
    v.push("rms_norm1".into());
    v.push("pdl_hop".into());
    v.push("rms_norm1s".into());
    v.push("quantize_act1".into());
    v.push("argmax_mb".into());
    for (_, t) in QTYPES {
        v.push(format!("mvd_{t}"));
    }
    for (_, t) in QTYPES {
        v.push(format!("mvr4_{t}"));
    }
    for (a, b) in QKV_PAIRS {
        let name = |t: GgmlType| QTYPES.iter().find(|q| q.0 == t).map_or("", |q| q.1);
        v.push(format!("mvr4_rope2_{}_{}", name(a), name(b)));
        // Session 20: V from its Q6_KA copy, Q6_KU's decoding.
        v.push(format!("mvr_rope2_{}_q6_ku", name(a)));
        v.push(format!("mvr4_rope2_{}_q6_ku", name(a)));
        v.push(format!("mvr_rope2_{}_q6_ku4", name(a)));
        v.push(format!("mvr4_rope2_{}_q6_ku4", name(a)));
    }
    for (_, t) in QTYPES {
        v.push(format!("mvqp_{t}"));
        v.push(format!("mvqe_{t}"));
    }
    v.extend(PROBES.iter().map(|s| s.to_string()));
    v.push("mvh_swiglu_q4_k".into());
    v.push("mvp3_swiglu_q4_k".into());
    for st in MVPD_STEPS {
        v.push(format!("mvpd{st}_q4_k"));
    }
    for t in MVQW_TYPES {
        v.push(format!("mvqw_{t}"));
    }
    for st in 1..=4 {
        v.push(format!("mvps{st}_swiglu_q4_k"));
        for vt in ["q4_k", "q6_k", "q6_ku", "q6_ku4"] {
            v.push(format!("mvpq{st}_q4_k_{vt}"));
        }
    }
    for (_, t) in QTYPES {
        v.push(format!("mvrp_{t}"));
        v.push(format!("mvrp_swiglu_{t}"));
        v.push(format!("mvrp_rope_{t}"));
    }
    // The one-token Q6_K products on the 16-byte aligned copies ([`Gpu::pad_q6k`]).
    for t in Q6A_TYPES {
        v.push(format!("mvr4_{t}"));
        v.push(format!("mvqp_{t}"));
        v.push(format!("mvqe_{t}"));
    }
    v.push("q6k_pad".into());
    for t in MVSM_TYPES {
        v.push(format!("mvsm_{t}"));
        v.push(format!("mvsmp_{t}"));
    }
    // Session 21: the one-token wide products that quantize their activation on a cluster.
    for (_, t) in QTYPES {
        v.push(format!("mvqc_{t}"));
    }
    for t in Q6A_TYPES {
        v.push(format!("mvqc_{t}"));
    }
    v.push("topk_slice".into());
    v.push("topk_merge".into());
    // Session 23: exact mode (crate::exact).
    v.extend(crate::exact::KERNELS.iter().map(|k| format!("ex_{k}")));
    v
}

/// The `mvsm_*` kernels' types (session 19: blocks of 16-byte multiples, so staged rows stay
/// aligned): Q4_K, Q5_K and the Q6_KA copies (with Q6_KA's and, session 20, Q6_KU's decoding;
/// session 32, of one or four blocks a slot).
pub const MVSM_TYPES: [&str; 6] = ["q4_k", "q5_k", "q6_ka", "q6_ku", "q6_ka4", "q6_ku4"];

/// The kernel names of the aligned Q6_K copies' decodings: Q6_KA and Q6_KU (session 20) of one
/// block a slot, and of four (session 32, [`Gpu::q6a_g`]).
pub const Q6A_TYPES: [&str; 4] = ["q6_ka", "q6_ku", "q6_ka4", "q6_ku4"];

/// The most weight bytes one `mvsm_*` block stages in shared memory (its dynamic allocation;
/// the H200 allows 227 KiB per block).
pub const MVSM_MAX_BYTES: usize = 200 * 1024;

/// Largest k [`Gpu::top_k_rows`] selects.
pub const TOPK_MAX: usize = 256;
/// Most keys one `topk_merge` block sorts in shared memory (128 KiB).
pub const TOPK_MERGE_MAX: usize = 16384;

/// Logits per `topk_slice` block: 4096 (32 KiB of keys), or the row's length rounded up to a
/// power of two when shorter.
fn topk_slice(n: usize) -> usize {
    n.next_power_of_two().clamp(2, 4096)
}

/// `(token, logit)` of a `topk_*` key: the logit's order-preserving bits in the high word,
/// `u32::MAX - id` in the low word (decode.cu's topk_key).
pub fn topk_key_decode(key: u64) -> (u32, f32) {
    let o = (key >> 32) as u32;
    let bits = if o & 0x8000_0000 != 0 {
        o & 0x7fff_ffff
    } else {
        !o
    };
    (u32::MAX - key as u32, f32::from_bits(bits))
}

/// Blocks per thread block cluster of the `mvqc_*` products (session 21, [`Gpu::down_cl`]): the
/// portable maximum, so each block quantizes an eighth of the row.
pub const MVQC_CLUSTER: u32 = 8;

/// Widest row an `mvqc_*` product quantizes into shared memory (cols + cols / 4 bytes).
pub const MVQC_MAX_COLS: usize = 16384;

/// Bytes of a Q6_K super-block (256 weights) in GGUF.
pub const Q6K_BLOCK_BYTES: usize = 210;
/// Bytes of a slot of `g` Q6_K blocks (1 or 4) in the 16-byte aligned copy ("Q6_KA",
/// [`Gpu::pad_q6k`]): the blocks' ql runs, their qh runs, their scales and their d, then zeros
/// up to a multiple of 16 (224 for one block, 848 for four).
pub fn q6ka_slot_bytes(g: usize) -> usize {
    (Q6K_BLOCK_BYTES * g).div_ceil(16) * 16
}

/// Bytes of the aligned copy of a `rows x cols` Q6_K matrix in slots of `g` blocks (`cols` a
/// multiple of 256 `g`).
pub fn q6ka_bytes(rows: usize, cols: usize, g: usize) -> usize {
    rows * (cols / (256 * g)) * q6ka_slot_bytes(g)
}

fn check_q6ka_cols(cols: usize, g: usize, what: &str) -> Result<(), CudaError> {
    if !matches!(g, 1 | 4) {
        return Err(CudaError::Arg(format!(
            "{what}: {g} blocks a slot (1 or 4)"
        )));
    }
    if cols == 0 || !cols.is_multiple_of(256 * g) {
        return Err(CudaError::Arg(format!(
            "{what}: {cols} columns is not a positive multiple of {} (Q6_K super-blocks, {g} a \
             slot)",
            256 * g
        )));
    }
    Ok(())
}

/// The aligned copy of Q6_K blocks on the host in slots of `g` blocks (whole 210-byte blocks,
/// row after row, their count a multiple of `g`, rows of a multiple of `g` blocks): the bytes
/// [`Gpu::pad_q6k`] writes.
pub fn pad_q6k_host(src: &[u8], g: usize) -> Result<Vec<u8>, CudaError> {
    if !matches!(g, 1 | 4) || !src.len().is_multiple_of(Q6K_BLOCK_BYTES * g) {
        return Err(CudaError::Arg(format!(
            "Q6_KA copy on the host: {} bytes is not whole groups of {g} {Q6K_BLOCK_BYTES}-byte \
             Q6_K blocks",
            src.len()
        )));
    }
    let slot = q6ka_slot_bytes(g);
    let mut out = vec![0u8; src.len() / (Q6K_BLOCK_BYTES * g) * slot];
    for (o, grp) in out
        .chunks_exact_mut(slot)
        .zip(src.chunks_exact(Q6K_BLOCK_BYTES * g))
    {
        for (k, b) in grp.chunks_exact(Q6K_BLOCK_BYTES).enumerate() {
            o[128 * k..128 * k + 128].copy_from_slice(&b[..128]);
            o[128 * g + 64 * k..128 * g + 64 * k + 64].copy_from_slice(&b[128..192]);
            o[192 * g + 16 * k..192 * g + 16 * k + 16].copy_from_slice(&b[192..208]);
            o[208 * g + 2 * k..208 * g + 2 * k + 2].copy_from_slice(&b[208..210]);
        }
    }
    Ok(out)
}

/// (Q/K type, V type) pairs of the one-launch mixed Q/K/V kernels (`mvr_rope2_*`,
/// `FOR_EACH_QKV_PAIR` in matvec_q.cu).
pub const QKV_PAIRS: [(GgmlType, GgmlType); 2] = [
    (GgmlType::Q4K, GgmlType::Q6K),
    (GgmlType::Q5K, GgmlType::Q6K),
];

/// Token tiles of 8 of the f16 tensor-core products on quantized weights (`mmf_<type>_<nt>`,
/// mmf.cu).
pub const MMF_NT: [usize; 3] = [2, 4, 8];
/// Rows one warp of those products owns (`MMF_MT` tiles of 16 in mmf.cu).
const MMF_WARP_ROWS: usize = 32;
/// Shared memory a block of 8 warps may take (a block of 4 takes half: two fit a multiprocessor).
const MMF_SMEM: usize = 225 * 1024;
/// Most K slices of one product.
const MMF_MAX_SLICES: usize = 16;

/// How [`Gpu::matmul_f16w`] lays out one product: token tiles of 8 (`nt`), units (32 columns)
/// per K slice and per shared-memory load of the activations, K slices, and the dynamic
/// shared memory of a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmfPlan {
    /// Warps per block (32 rows each).
    pub warps: usize,
    /// Token tiles of 8 (one of [`MMF_NT`]).
    pub nt: usize,
    /// Units of 32 columns per K slice (a multiple of 8).
    pub per: usize,
    /// Units per shared-memory load of the activations (a multiple of 8).
    pub chunk: usize,
    /// K slices (blocks along K; over 1, partial sums go through the workspace).
    pub slices: usize,
    /// Row tiles (blocks along the rows).
    pub tiles: usize,
    /// Dynamic shared memory of a block in bytes.
    pub smem: usize,
}

impl MmfPlan {
    /// Floats of workspace the product needs for `n` tokens (0 with one K slice).
    pub fn ws_floats(&self, rows: usize, n: usize) -> usize {
        if self.slices > 1 {
            self.slices * n * rows
        } else {
            0
        }
    }
}

/// The layout of a `rows x cols` product of `n` tokens (9..=64) on `sms` multiprocessors with
/// blocks of `warps` warps (4 or 8): enough K slices that the blocks fill the chip about twice
/// over (8 warps: once).
pub fn mmf_plan(
    sms: usize,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    n: usize,
    warps: usize,
) -> MmfPlan {
    let warps = if warps >= 8 { 8 } else { 4 };
    plan_tiles(
        sms,
        ty,
        rows,
        cols,
        n,
        warps,
        MMF_WARP_ROWS,
        0,
        8 / warps,
        MMF_MAX_SLICES,
    )
}

/// Rows one warp of the Q4_K integer-order products owns (`MMK_WR` in mmf.cu).
const MMK_WARP_ROWS: usize = 16;
/// Shared memory those products take per (super-block of the chunk, token) beyond the
/// activations: the min operand (32 bytes) and the token's scale.
const MMK_TABLE: usize = 36;

/// [`mmf_plan`] for [`Gpu::matmul_q4k_mmk`]: blocks of 8 warps of 16 rows, two blocks per
/// multiprocessor (the kernels are built for 128 registers).
pub fn mmk_plan(sms: usize, rows: usize, cols: usize, n: usize) -> MmfPlan {
    // Switches for measuring (CROSSOVER_CUDA_MMK_WARPS 4 or 8, CROSSOVER_CUDA_MMK_SLICES: most
    // K slices), read once.
    static KNOBS: std::sync::OnceLock<(usize, usize)> = std::sync::OnceLock::new();
    let &(warps, cap) = KNOBS.get_or_init(|| {
        let v = |k: &str, d: usize| {
            std::env::var(k)
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(d)
        };
        (
            v("CROSSOVER_CUDA_MMK_WARPS", 8),
            v("CROSSOVER_CUDA_MMK_SLICES", MMF_MAX_SLICES),
        )
    });
    let warps = if warps <= 4 { 4 } else { 8 };
    plan_tiles(
        sms,
        GgmlType::Q4K,
        rows,
        cols,
        n,
        warps,
        MMK_WARP_ROWS,
        MMK_TABLE,
        16 / warps,
        cap,
    )
}

/// The common layout rule: `per_sm` blocks of `warps` warps (each `warp_rows` rows) per
/// multiprocessor share its shared memory; the activations take what the two weight stages of
/// every warp leave, in chunks of whole super-blocks; `table` bytes per super-block and token
/// go beside them; at most `max_slices` K slices.
#[allow(clippy::too_many_arguments)]
fn plan_tiles(
    sms: usize,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    n: usize,
    warps: usize,
    warp_rows: usize,
    table: usize,
    per_sm: usize,
    max_slices: usize,
) -> MmfPlan {
    // One warp's stage buffer (`MmfStage<T, WR>::WS` in mmf.cu): 8 units of its rows, copied 16
    // bytes at a time where blocks are 16-byte aligned, else as 4-byte words plus one.
    let (bb, upb) = (ty.type_size(), (ty.block_size() / 32).max(1));
    let bytes = 8 / upb * bb;
    let cp = if bb.is_multiple_of(16) { 16 } else { 4 };
    let nw = bytes.div_ceil(cp) + usize::from(cp == 4);
    let wbuf = warp_rows * (nw * cp).div_ceil(16) * 16;
    let nt = MMF_NT
        .iter()
        .copied()
        .find(|&b| n <= 8 * b)
        .unwrap_or(MMF_NT[MMF_NT.len() - 1]);
    let units = (cols / 32).max(1);
    let tiles = rows.div_ceil(warp_rows * warps).max(1);
    let act = (MMF_SMEM / per_sm).saturating_sub(2 * warps * wbuf + 8 * nt * 64);
    // Per unit of the chunk: 8 nt token rows of 64 bytes and an eighth of the table.
    let chunk = (act * 8 / (8 * nt * (8 * 64 + table)) / 8 * 8).max(8);
    let resident = sms * per_sm;
    let want = ((resident + tiles / 2) / tiles).clamp(1, max_slices.clamp(1, MMF_MAX_SLICES));
    let per = (units.div_ceil(want).div_ceil(8) * 8).max(8);
    let slices = units.div_ceil(per);
    let chunk = chunk.min(per);
    MmfPlan {
        warps,
        nt,
        per,
        chunk,
        slices,
        tiles,
        smem: 8 * nt * (chunk * 64 + 64) + chunk / 8 * 8 * nt * table + 2 * warps * wbuf,
    }
}

/// Whether [`Gpu::matmul_f16w`] has kernels for a weight type.
pub fn mmf_supports(ty: GgmlType) -> bool {
    qtype_index(ty).is_ok()
}

/// Token tiles of 8 per block of the tensor-core integer GEMM kernels (`mmq_<type>_<nb>`,
/// mmq.cu).
pub const MMQ_NB: [usize; 3] = [2, 4, 8];
/// Most tokens a step may have for its products to take [`Gpu::matmul_q`] (decode steps of
/// many sequences); longer steps (prompts) take cuBLAS, which wins there.
pub const MMQ_MAX_N: usize = 64;

/// The one-token, two-rows-per-warp form of [`mvq_id`]'s kernels (`mvr_*`).
fn mvr_id(ty: GgmlType, glu: bool) -> Result<usize, CudaError> {
    Ok(TYPES.len() * PER_TYPE
        + OPS.len()
        + QTYPES.len() * PER_QTYPE
        + qtype_index(ty)? * 3
        + glu as usize)
}

fn qtype_index(ty: GgmlType) -> Result<usize, CudaError> {
    QTYPES
        .iter()
        .position(|(t, _)| *t == ty)
        .ok_or_else(|| CudaError::Arg(format!("no integer matrix-vector kernel for {ty}")))
}

fn mvq_id(ty: GgmlType, glu: bool, nt: usize) -> Result<usize, CudaError> {
    Ok(TYPES.len() * PER_TYPE
        + OPS.len()
        + qtype_index(ty)? * PER_QTYPE
        + if glu { MV_NT.len() } else { 0 }
        + nt_bucket(nt)?)
}

/// Warps per block of the one-token `mvr_*` kernels (two rows per warp) that prepare their own
/// activation: the block size (256 threads) that makes their RMSNorm sum the squares in
/// rms_norm's order. Launches on quantized activations take [`Gpu::mvr_warps`].
const MVR_WARPS: usize = 8;
/// Widest activation row an `mvr_*` launch prepares in shared memory (`MVR_PREP_MAX` in
/// matvec_q.cu).
const MVR_PREP_MAX: usize = 4096;

/// Rows per block of the wide one-token product (`MVW_ROWS` in matvec_q.cu).
const MVW_ROWS: usize = 8;
/// Widest rows of the wide one-token product (`MVW_MAX` in matvec_q.cu).
const MVW_MAX_COLS: usize = 16384;

/// An f32 activation row that a one-token product normalizes (optionally) and quantizes in its
/// own launch, rather than reading activations [`Gpu::quantize_act`] or [`Gpu::rms_norm`]
/// quantized before it.
#[derive(Clone, Copy, Debug)]
pub struct ActPrep {
    /// The row (f32, the product's `cols` wide).
    pub x: u64,
    /// RMSNorm weight (f32, `cols`), or 0 to quantize `x` as it is.
    pub norm: u64,
    /// RMSNorm epsilon.
    pub eps: f32,
}

/// Where an `mvr_*` launch finds its activation.
enum ActIn {
    Quantized { qs: u64, ds: u64 },
    Prep(ActPrep),
}

impl ActIn {
    /// Kernel arguments (qs, ds, px, pw, eps).
    fn args(&self) -> (u64, u64, u64, u64, f32) {
        match *self {
            ActIn::Quantized { qs, ds } => (qs, ds, 0, 0, 0.0),
            ActIn::Prep(p) => (0, 0, p.x, p.norm, p.eps),
        }
    }
}

fn check_prep(act: &ActIn, cols: usize) -> Result<(), CudaError> {
    if let ActIn::Prep(p) = act {
        if cols > MVR_PREP_MAX || p.x == 0 {
            return Err(CudaError::Arg(format!(
                "a product preparing its own activation: {cols} columns (at most {MVR_PREP_MAX})"
            )));
        }
    }
    Ok(())
}
/// Widest rows the one-token products send to the `mvr_*` kernels ([`Gpu::mvr_fits`]).
const MVR_MAX_COLS: usize = 4096;
/// Rows per warp of the half-super-block Q6_K kernel (`MV6_ROWS` in matvec_q.cu).
const MV6_ROWS: usize = 4;
/// Rows (one per warp) per block of the one-token wide-row kernel (`MVD_WARPS` in matvec_q.cu).
pub const MVD_WARPS: usize = 4;

/// Threads per row of the integer matrix-vector kernels: one 32-element unit per thread per
/// step, at most 128, whole warps.
fn mvq_threads(cols: usize) -> u32 {
    ((cols / 32).div_ceil(32) * 32).clamp(32, 128) as u32
}

fn type_index(ty: GgmlType) -> Result<usize, CudaError> {
    TYPES
        .iter()
        .position(|(t, _)| *t == ty)
        .ok_or_else(|| CudaError::Arg(format!("no GPU kernel for tensor type {ty}")))
}

/// Whether a weight type has GPU kernels.
pub fn supports(ty: GgmlType) -> bool {
    type_index(ty).is_ok()
}

fn op(k: usize) -> usize {
    TYPES.len() * PER_TYPE + k
}

fn nt_bucket(nt: usize) -> Result<usize, CudaError> {
    MV_NT
        .iter()
        .position(|&b| nt <= b)
        .ok_or_else(|| CudaError::Arg(format!("{nt} tokens in one matrix-vector launch (max 8)")))
}

fn check_cols(ty: GgmlType, cols: usize) -> Result<(), CudaError> {
    let be = ty.block_size().max(32);
    if cols == 0 || !cols.is_multiple_of(be) {
        return Err(CudaError::Arg(format!(
            "{cols} columns is not a multiple of {be} ({ty} kernels decode 32-element units of whole blocks)"
        )));
    }
    Ok(())
}

/// Rows per warp of the one-token matrix-vector kernel: more rows share each activation load, as
/// long as the matrix still spreads over the whole GPU.
pub fn mv_rows_per_warp(rows: usize, nt: usize) -> usize {
    match (nt, rows) {
        (1, r) if r >= 8192 => 4,
        (1, r) if r >= 2048 => 2,
        _ => 1,
    }
}

/// Bytes of a `rows x cols` matrix of `ty`.
pub fn matrix_bytes(ty: GgmlType, rows: usize, cols: usize) -> usize {
    ty.bytes_for(cols as u64).unwrap_or(0) as usize * rows
}

fn i32_of(v: usize, what: &str) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Arg(format!("{what} = {v} does not fit in i32")))
}

fn u32_of(v: usize, what: &str) -> Result<u32, CudaError> {
    u32::try_from(v).map_err(|_| CudaError::Arg(format!("{what} = {v} does not fit in u32")))
}

impl Gpu {
    /// `out[i, :] = w[ids[i], :]` as f32 for `n` ids (device i32 array `ids`).
    pub fn get_rows(
        &self,
        ty: GgmlType,
        w: u64,
        cols: usize,
        ids: u64,
        n: usize,
        out: u64,
    ) -> Result<(), CudaError> {
        check_cols(ty, cols)?;
        let k = type_index(ty)? * PER_TYPE;
        let c = i32_of(cols, "cols")?;
        self.launch_id(
            k,
            (u32_of(n, "rows")?, 1, 1),
            (128, 1, 1),
            kargs![w, c, ids, out],
        )
    }

    /// Dequantize a whole `rows x cols` matrix to f16 (row-major) into `out`.
    pub fn dequant_f16(
        &self,
        ty: GgmlType,
        w: u64,
        rows: usize,
        cols: usize,
        out: u64,
    ) -> Result<(), CudaError> {
        check_cols(ty, cols)?;
        let k = type_index(ty)? * PER_TYPE + 1;
        let units = rows * cols / 32;
        let blocks = units.div_ceil(256).min(self.sms as usize * 32) as u32;
        let (r, c) = (rows as i64, i32_of(cols, "cols")?);
        self.launch_id(k, (blocks, 1, 1), (256, 1, 1), kargs![w, r, c, out])
    }

    /// `y[t, :] (+)= W x[t, :]` for `nt <= 8` tokens; `accumulate` adds into `y`.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec(
        &self,
        ty: GgmlType,
        w: u64,
        rows: usize,
        cols: usize,
        x: u64,
        nt: usize,
        y: u64,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        let r = mv_rows_per_warp(rows, nt);
        self.matvec_r(ty, w, rows, cols, x, nt, y, accumulate, r)
    }

    /// [`Gpu::matvec`] with `r` rows per warp (1 for any `nt`; 2 or 4 for `nt == 1`).
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_r(
        &self,
        ty: GgmlType,
        w: u64,
        rows: usize,
        cols: usize,
        x: u64,
        nt: usize,
        y: u64,
        accumulate: bool,
        r: usize,
    ) -> Result<(), CudaError> {
        check_cols(ty, cols)?;
        let base = type_index(ty)? * PER_TYPE;
        let k = match (r, nt) {
            (1, _) => base + 2 + nt_bucket(nt)?,
            (4, 1) => base + 2 + 2 * MV_NT.len(),
            (2, 1) => base + 2 + 2 * MV_NT.len() + 1,
            _ => {
                return Err(CudaError::Arg(format!(
                    "{r} rows per warp with {nt} tokens (kernels: 1 for any, 2 or 4 for one token)"
                )))
            }
        };
        let (rr, c, n, a) = (
            i32_of(rows, "rows")?,
            i32_of(cols, "cols")?,
            nt as i32,
            accumulate as i32,
        );
        let grid = u32_of(rows.div_ceil(4 * r), "rows")?;
        self.launch_id(k, (grid, 1, 1), (128, 1, 1), kargs![w, rr, c, x, n, y, a])
    }

    /// `y[t, :] = silu(Wg x[t, :]) * (Wu x[t, :])` for `nt <= 8` tokens; both matrices `ty`.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_swiglu(
        &self,
        ty: GgmlType,
        wg: u64,
        wu: u64,
        rows: usize,
        cols: usize,
        x: u64,
        nt: usize,
        y: u64,
    ) -> Result<(), CudaError> {
        check_cols(ty, cols)?;
        let k = type_index(ty)? * PER_TYPE + 2 + MV_NT.len() + nt_bucket(nt)?;
        let (r, c, n) = (i32_of(rows, "rows")?, i32_of(cols, "cols")?, nt as i32);
        let grid = u32_of(rows.div_ceil(4), "rows")?;
        self.launch_id(k, (grid, 1, 1), (128, 1, 1), kargs![wg, wu, r, c, x, n, y])
    }

    /// RMSNorm of `n_rows` rows of width `n`: row `i` of `out` normalizes row `rows[i]` of `x`
    /// (`rows` = 0: row `i`). `quant` (format, int8 values, scales; either pointer may be 0)
    /// also quantizes each output row for the integer kernels. `out_h` (0 = none) gets the rows
    /// as f16: with `quant`, the quantized values `f16(d * q)` (as [`Gpu::quantize_act_f16`]),
    /// else a plain f16 copy.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
        &self,
        x: u64,
        rows: u64,
        w: u64,
        n: usize,
        eps: f32,
        n_rows: usize,
        out: u64,
        out_h: u64,
        quant: Option<(ActFormat, u64, u64)>,
    ) -> Result<(), CudaError> {
        self.rms_norm_ss(x, rows, w, n, eps, n_rows, out, out_h, quant, 0, 0, false)
    }

    /// [`Gpu::rms_norm`] of one row (`rows` = 0, `n_rows` = 1) whose sum of squares is read from
    /// the [`RMS_SLOTS`] f64 partial sums at `ss` (session 16: added by the products that
    /// wrote `x`, [`Gpu::matvec_q_ss`]) instead of being taken from the row; `ss` = 0 takes it
    /// from the row. `ssz` (may be 0): [`RMS_SLOTS`] doubles the launch zeroes for the next
    /// product to add into. The same bits as [`Gpu::rms_norm`] whenever the f64 sums are exact
    /// (every square is; their sum of a 3072-wide row nearly always).
    /// `perm` stores the Q8_K int8 values in the permuted layout the half-unit SwiGLU product
    /// reads ([`Gpu::matvec_q_swiglu_half`]; `ACT_PERM` in matvec_q.cu; Q8_K only, no f16
    /// operand).
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_ss(
        &self,
        x: u64,
        rows: u64,
        w: u64,
        n: usize,
        eps: f32,
        n_rows: usize,
        out: u64,
        out_h: u64,
        quant: Option<(ActFormat, u64, u64)>,
        ss: u64,
        ssz: u64,
        perm: bool,
    ) -> Result<(), CudaError> {
        if (ss != 0 || ssz != 0) && (rows != 0 || n_rows != 1) {
            return Err(CudaError::Arg(format!(
                "RMSNorm from partial sums of squares takes one row ({n_rows} given)"
            )));
        }
        if perm && (out_h != 0 || !matches!(quant, Some((ActFormat::Q8K, ..)))) {
            return Err(CudaError::Arg(
                "permuted activation layout: Q8_K values only, no f16 operand".into(),
            ));
        }
        let nn = i32_of(n, "width")?;
        let (fmt, qs, ds) = match quant {
            Some((f, q, d)) => {
                if !n.is_multiple_of(f.block()) {
                    return Err(CudaError::Arg(format!(
                        "{n} columns is not a multiple of {} ({f:?} activations)",
                        f.block()
                    )));
                }
                (f as i32, q, d)
            }
            None => (0i32, 0u64, 0u64),
        };
        // Enough blocks to fill the chip (8 per SM), each row summed as few times as that allows:
        // a decode step's row gets a block per 256 elements, a 512-token prompt's rows 3 each
        // (v5a's one block per row from 32 rows on left 64-row steps 64 blocks: 19 us a norm).
        let chunks = (8 * self.sms as usize)
            .div_ceil(n_rows.max(1))
            .clamp(1, n.div_ceil(256));
        let fq = fmt | ((perm as i32) << 9);
        self.launch_id(
            op(K_RMS_NORM),
            (u32_of(n_rows, "rows")?, u32_of(chunks, "chunks")?, 1),
            (256, 1, 1),
            kargs![x, rows, w, nn, eps, out, out_h, fq, qs, ds, ss, ssz],
        )
    }

    /// Quantize `rows` rows of `n` f32 activations (`x`) into int8 values `qs` and scales `ds`
    /// (see matvec_q.cu), bit-identical to the CPU backend's `quant::dot::quantize_acts`.
    pub fn quantize_act(
        &self,
        x: u64,
        rows: usize,
        n: usize,
        fmt: ActFormat,
        qs: u64,
        ds: u64,
    ) -> Result<(), CudaError> {
        self.quantize_act_to(x, rows, n, fmt, qs, ds, 0)
    }

    /// Quantize `rows` rows of `n` f32 activations exactly as [`Gpu::quantize_act`] does and
    /// write the values the integer products stand for, `f16(d * q)`, to `out` (f16, row after
    /// row): the GEMM path's activation operand, so cuBLAS multiplies the CPU backend's
    /// quantized activations (up to f16 rounding) rather than the raw ones.
    pub fn quantize_act_f16(
        &self,
        x: u64,
        rows: usize,
        n: usize,
        fmt: ActFormat,
        out: u64,
    ) -> Result<(), CudaError> {
        self.quantize_act_to(x, rows, n, fmt, 0, 0, out)
    }

    #[allow(clippy::too_many_arguments)]
    fn quantize_act_to(
        &self,
        x: u64,
        rows: usize,
        n: usize,
        fmt: ActFormat,
        qs: u64,
        ds: u64,
        xh: u64,
    ) -> Result<(), CudaError> {
        if n == 0 || !n.is_multiple_of(fmt.block()) {
            return Err(CudaError::Arg(format!(
                "{n} columns is not a multiple of {} ({fmt:?} activations)",
                fmt.block()
            )));
        }
        let (nn, f) = (i32_of(n, "width")?, fmt as i32);
        if rows == 1 && xh == 0 && self.quant1.get() && Self::rms1_fits(n) {
            // Session 35: one row as a warp per 256-element group (the same bytes).
            return self.launch_id(
                self.kernel_id("quantize_act1")?,
                (u32_of(n / 256, "groups")?, 1, 1),
                (32, 1, 1),
                kargs![x, nn, f, qs, ds],
            );
        }
        self.launch_id(
            op(K_QUANTIZE_ACT),
            (u32_of(rows, "rows")?, u32_of(n.div_ceil(256), "chunks")?, 1),
            (256, 1, 1),
            kargs![x, nn, f, qs, ds, xh],
        )
    }

    /// Ask L2 for the cached K and V rows of one sequence that a later one-token step's
    /// attention reads (`kc`, `vc`: one layer's cache; rows `0 .. tok_pos[0]` of token 0's
    /// sequence through its block table), from the main stream: the successor starts at once,
    /// and the kernel waits for its predecessor before it exits (session 30). `evict_last`
    /// marks the lines L2::evict_last. A hint only: nothing is written.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_prefetch(
        &self,
        (kc, vc): (u64, u64),
        (tok_pos, tok_seq, btab, max_blocks, block_tokens): (u64, u64, u64, usize, usize),
        row_bytes: usize,
        evict_last: bool,
        blocks: usize,
    ) -> Result<(), CudaError> {
        if !row_bytes.is_multiple_of(16) {
            return Err(CudaError::Arg(format!(
                "KV prefetch: a {row_bytes}-byte cache row is not a multiple of 16 bytes"
            )));
        }
        let (mb, bt, rb, pol) = (
            i32_of(max_blocks, "max_blocks")?,
            i32_of(block_tokens, "block_tokens")?,
            i32_of(row_bytes, "KV row bytes")?,
            evict_last as i32,
        );
        self.launch_id(
            op(K_KV_PREFETCH),
            (u32_of(blocks.max(1), "blocks")?, 1, 1),
            (32, 1, 1),
            kargs![kc, vc, tok_pos, tok_seq, btab, mb, bt, rb, pol],
        )
    }

    /// `y[t, :] (+)= W x[t, :]` for `nt <= 8` tokens whose activations were quantized by
    /// [`Gpu::quantize_act`] (or [`Gpu::rms_norm`]) in `act_format(ty)`: integer dot products.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_q(
        &self,
        ty: GgmlType,
        w: u64,
        rows: usize,
        cols: usize,
        qs: u64,
        ds: u64,
        nt: usize,
        y: u64,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        self.matvec_q_ss(ty, w, rows, cols, qs, ds, nt, y, accumulate, 0)
            .map(|_| ())
    }

    /// [`Gpu::matvec_q`] that, for one token (`nt` = 1) on the kernels that take it (`mvr*`
    /// and `mvqp_*`), also adds the squares of the `rows` outputs it writes into the
    /// [`RMS_SLOTS`] f64 partial sums at `ss` (session 16: the sum of squares of the residual
    /// row for [`Gpu::rms_norm_ss`]; the slots must hold zeros or earlier partial sums of the
    /// same row). Returns whether it did (false: `ss` was 0 or the chosen kernel does not take
    /// it, and the slots are untouched).
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_q_ss(
        &self,
        ty: GgmlType,
        w: u64,
        rows: usize,
        cols: usize,
        qs: u64,
        ds: u64,
        nt: usize,
        y: u64,
        accumulate: bool,
        ss: u64,
    ) -> Result<bool, CudaError> {
        check_cols(ty, cols)?;
        let sm_name = match ty {
            GgmlType::Q4K => Some("q4_k"),
            GgmlType::Q5K => Some("q5_k"),
            _ => None,
        };
        if let (1, Some(name)) = (nt, sm_name) {
            let rb = matrix_bytes(ty, 1, cols);
            if let Some(ppb) = self.mvsm_pairs(rows, cols, rb) {
                return self
                    .mvsm_launch(name, w, rows, cols, rb, ppb, (qs, ds), y, accumulate, ss)
                    .map(|_| ss != 0);
            }
        }
        if nt == 1 && self.q6_half_fits(ty, cols) {
            return self
                .matvec_q6_half(w, rows, cols, qs, ds, y, accumulate)
                .map(|_| false);
        }
        if nt == 1 && self.mvr_fits(cols) {
            let act = ActIn::Quantized { qs, ds };
            return self
                .mvr_multi_ss(ty, &[(w, rows, y)], cols, act, accumulate, ss)
                .map(|_| ss != 0);
        }
        if nt == 1 && self.warp_rows.get() {
            return self
                .matvec_q_warp(ty, w, rows, cols, qs, ds, y, accumulate)
                .map(|_| false);
        }
        let (rr, c, n, a) = (
            i32_of(rows, "rows")?,
            i32_of(cols, "cols")?,
            nt as i32,
            accumulate as i32,
        );
        if nt == 1 && self.pdl.get() && self.mvq_pf.get() {
            let t = QTYPES[qtype_index(ty)?].1;
            let th = self.mvqp_block(cols);
            let form = self.mvqp_form(cols, th);
            if let Some(st) = self.mvpd_steps(ty, cols) {
                // Session 36: a warp per row, its weights in registers before the wait
                // (mvqe's bits).
                const NW: usize = 4;
                return self
                    .launch_id(
                        self.kernel_id(&format!("mvpd{st}_q4_k"))?,
                        (u32_of(rows.div_ceil(NW), "rows")?, 1, 1),
                        (32 * NW as u32, 1, 1),
                        kargs![w, rr, qs, ds, y, a, ss],
                    )
                    .map(|_| ss != 0);
            }
            // v10: the same kernel asking L2 for its row before its wait (`mvqp_*`); session
            // 30: or with its units decoded before the wait (`mvqe_*`, the same bits).
            return self
                .mvqe_launch(t, form, th, w, rows, cols, (qs, ds), y, accumulate, ss)
                .map(|_| ss != 0);
        }
        let k = mvq_id(ty, false, nt)?;
        self.launch_id(
            k,
            (u32_of(rows, "rows")?, 1, 1),
            (mvq_threads(cols), 1, 1),
            kargs![w, rr, c, qs, ds, n, y, a],
        )
        .map(|_| false)
    }

    /// The block-per-row one-token kernel family for rows `cols` wide at `th` threads:
    /// `mvqe` (session 30: units decoded before the wait; [`Gpu::mvqe`], at most
    /// [`MVQE_UNITS`] units per thread) or `mvqp`.
    fn mvqp_form(&self, cols: usize, th: u32) -> &'static str {
        let units = cols / 32;
        if self.mvqe.get() && th <= 128 && units <= MVQE_UNITS * th as usize {
            "mvqe"
        } else {
            "mvqp"
        }
    }

    /// The steps S of the `mvpd<S>_q4_k` kernel that takes a one-token block-per-row product
    /// of `ty` rows `cols` wide (session 36, [`Gpu::mvpd`]): Q4_K rows of S whole
    /// four-super-block steps where `mvqe` runs 128 threads, whose bits it gives; None: the
    /// block-per-row kernel.
    pub fn mvpd_steps(&self, ty: GgmlType, cols: usize) -> Option<usize> {
        let st = cols / 1024;
        let th = self.mvqp_block(cols);
        let form = self.mvqp_form(cols, th);
        (self.mvpd.get()
            && self.pdl.get()
            && self.mvq_pf.get()
            && ty == GgmlType::Q4K
            && form == "mvqe"
            && th == 128
            && cols.is_multiple_of(1024)
            && MVPD_STEPS.contains(&st))
        .then_some(st)
    }

    /// Threads per block of an `mvqp_*` launch on rows `cols` wide ([`Gpu::mvqp_threads`]).
    fn mvqp_block(&self, cols: usize) -> u32 {
        match self.mvqp_threads.get() {
            0 => mvq_threads(cols),
            t => (t as u32).clamp(32, mvq_threads(cols)) / 32 * 32,
        }
    }

    /// The blocks per slot of the aligned copy of a Q6_K matrix of `cols` columns: 4 where
    /// [`Gpu::q6a_g`] asks for four and `cols` is a multiple of 1024, else 1.
    pub fn q6a_group(&self, cols: usize) -> usize {
        if self.q6a_g.get() == 4 && cols.is_multiple_of(1024) {
            4
        } else {
            1
        }
    }

    /// The kernel name part of the aligned copy of a Q6_K matrix of `cols` columns read with
    /// Q6_KA's decoding or (`unsigned`) Q6_KU's: `q6_ka`, `q6_ku`, `q6_ka4` or `q6_ku4`.
    pub fn q6a_name(&self, cols: usize, unsigned: bool) -> &'static str {
        let i = 2 * (self.q6a_group(cols) == 4) as usize + unsigned as usize;
        Q6A_TYPES[i]
    }

    /// A 16-byte aligned copy ("Q6_KA") of the `rows x cols` Q6_K matrix at `src` (2-byte
    /// aligned) for the one-token products [`Gpu::matvec_q6ka_ss`]: its blocks in slots of
    /// [`Gpu::q6a_group`] blocks ([`pad_q6k_host`]'s bytes; 16/15 of the matrix for one block a
    /// slot, 106/105 for four). Queued on the stream (`q6k_pad`); `src` must live until it has
    /// run.
    pub fn pad_q6k(&self, src: u64, rows: usize, cols: usize) -> Result<DevBuf, CudaError> {
        let g = self.q6a_group(cols);
        check_q6ka_cols(cols, g, "Q6_KA copy")?;
        let dst = self.alloc(q6ka_bytes(rows, cols, g))?;
        self.pad_q6k_into(src, rows, cols, dst.ptr())?;
        Ok(dst)
    }

    /// [`Gpu::pad_q6k`] into `dst` (16-byte aligned, [`q6ka_bytes`] long).
    pub fn pad_q6k_into(
        &self,
        src: u64,
        rows: usize,
        cols: usize,
        dst: u64,
    ) -> Result<(), CudaError> {
        let g = self.q6a_group(cols);
        check_q6ka_cols(cols, g, "Q6_KA copy")?;
        if !src.is_multiple_of(2) || !dst.is_multiple_of(16) {
            return Err(CudaError::Arg(format!(
                "Q6_KA copy: source {src:#x} (2-byte aligned) to {dst:#x} (16-byte aligned)"
            )));
        }
        let blocks = rows * (cols / 256);
        if blocks == 0 {
            return Ok(());
        }
        // One thread per 16 bytes of the copy.
        let chunks = blocks / g * (q6ka_slot_bytes(g) / 16);
        let grid = chunks.div_ceil(256).min(self.sms as usize * 32);
        let (b, gi) = (blocks as i64, g as i32);
        self.launch_id(
            self.kernel_id("q6k_pad")?,
            (u32_of(grid, "blocks")?, 1, 1),
            (256, 1, 1),
            kargs![src, b, dst, gi],
        )
    }

    /// [`Gpu::matvec_q6ka_ss`] without the sums of squares, as [`Gpu::matvec_q`].
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_q6ka(
        &self,
        ty: GgmlType,
        w: u64,
        rows: usize,
        cols: usize,
        qs: u64,
        ds: u64,
        nt: usize,
        y: u64,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        self.matvec_q6ka_ss(ty, w, rows, cols, qs, ds, nt, y, accumulate, 0)
            .map(|_| ())
    }

    /// Row pairs per block of an `mvsm_*` launch of `rows` rows `rb` bytes each, one block
    /// per multiprocessor, when [`Gpu::mvsm`] is on, PDL is on (the staging overlaps the wait
    /// only then), the rows are at most [`Gpu::mvsm_cols`] wide, a block's rows fit
    /// [`MVSM_MAX_BYTES`] and the rows stay 16-byte aligned.
    fn mvsm_pairs(&self, rows: usize, cols: usize, rb: usize) -> Option<usize> {
        if !self.mvsm.get()
            || !self.pdl.get()
            || cols > self.mvsm_cols.get()
            || !rb.is_multiple_of(16)
            || rows == 0
        {
            return None;
        }
        let ppb = rows.div_ceil(2).div_ceil(self.sms as usize);
        (2 * ppb * rb <= MVSM_MAX_BYTES).then_some(ppb)
    }

    /// Whether [`Gpu::matvec_q_staged_prep`] takes a one-token product of `ty` (`rows` x
    /// `cols`): [`Gpu::mvsm_prep`] on, Q4_K or Q5_K, whole 256-element groups of at most
    /// `MVR_PREP_MAX` columns, and rows the staged products take ([`Gpu::mvsm_pairs`]).
    pub fn mvsm_prep_fits(&self, ty: GgmlType, rows: usize, cols: usize) -> bool {
        self.mvsm_prep.get()
            && matches!(ty, GgmlType::Q4K | GgmlType::Q5K)
            && cols.is_multiple_of(256)
            && cols <= MVR_PREP_MAX
            && self
                .mvsm_pairs(rows, cols, matrix_bytes(ty, 1, cols))
                .is_some()
    }

    /// Session 20: one token's `y (+)= W x` (and the squares into `ss` when not 0) by
    /// `mvsmp_<type>`, the staged product that quantizes its f32 activation `px` itself (a
    /// warp per 256-element group into shared memory: quantize_act's bytes), so the product
    /// needs no quantization launch before it: the bits of [`Gpu::matvec_q_ss`] on
    /// [`Gpu::quantize_act`]'s output (Q8_K). Only where [`Gpu::mvsm_prep_fits`]; returns
    /// whether `ss` was added to.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_q_staged_prep(
        &self,
        ty: GgmlType,
        w: u64,
        rows: usize,
        cols: usize,
        px: u64,
        y: u64,
        accumulate: bool,
        ss: u64,
    ) -> Result<bool, CudaError> {
        check_cols(ty, cols)?;
        let rb = matrix_bytes(ty, 1, cols);
        let ppb = match (
            self.mvsm_prep_fits(ty, rows, cols),
            self.mvsm_pairs(rows, cols, rb),
        ) {
            (true, Some(p)) => p,
            _ => {
                return Err(CudaError::Arg(format!(
                    "staged product preparing its activation: {ty} {rows}x{cols} (Q4_K or Q5_K, \
                     whole 256-column groups up to {MVR_PREP_MAX}, staged rows, switched on)"
                )))
            }
        };
        if !w.is_multiple_of(16) || !px.is_multiple_of(16) {
            return Err(CudaError::Arg(format!(
                "staged product preparing its activation: weights at {w:#x} or activation at \
                 {px:#x} not 16-byte aligned"
            )));
        }
        let name = if ty == GgmlType::Q4K { "q4_k" } else { "q5_k" };
        let (rr, c, a, p) = (
            i32_of(rows, "rows")?,
            i32_of(cols, "cols")?,
            accumulate as i32,
            i32_of(ppb, "row pairs")?,
        );
        let blocks = rows.div_ceil(2 * ppb);
        let threads = 32 * ppb.min(16) as u32;
        self.launch_id_smem(
            self.kernel_id(&format!("mvsmp_{name}"))?,
            (u32_of(blocks, "rows")?, 1, 1),
            (threads, 1, 1),
            u32_of(2 * ppb * rb, "staged bytes")?,
            kargs![w, rr, c, px, y, a, p, ss],
        )
        .map(|_| ss != 0)
    }

    /// One token's `y (+)= W x` (and the squares into `ss` when not 0) by `mvsm_<name>` with
    /// `ppb` row pairs per block ([`Gpu::mvsm_pairs`]): the bits of the `mvr` kernels.
    #[allow(clippy::too_many_arguments)]
    fn mvsm_launch(
        &self,
        name: &str,
        w: u64,
        rows: usize,
        cols: usize,
        rb: usize,
        ppb: usize,
        act: (u64, u64),
        y: u64,
        accumulate: bool,
        ss: u64,
    ) -> Result<(), CudaError> {
        if !w.is_multiple_of(16) {
            return Err(CudaError::Arg(format!(
                "staged product: weights at {w:#x}, not 16-byte aligned"
            )));
        }
        let (qs, ds) = act;
        let (rr, c, a, p) = (
            i32_of(rows, "rows")?,
            i32_of(cols, "cols")?,
            accumulate as i32,
            i32_of(ppb, "row pairs")?,
        );
        let blocks = rows.div_ceil(2 * ppb);
        let threads = 32 * ppb.min(16) as u32;
        self.launch_id_smem(
            self.kernel_id(&format!("mvsm_{name}"))?,
            (u32_of(blocks, "rows")?, 1, 1),
            (threads, 1, 1),
            u32_of(2 * ppb * rb, "staged bytes")?,
            kargs![w, rr, c, qs, ds, y, a, p, ss],
        )
    }

    /// Whether a one-token product of `ty` (`rows` x `cols`; `q6a`: on its Q6_KA copy) whose
    /// activation is not quantized yet takes [`Gpu::matvec_q_cluster`] (session 21): where
    /// [`Gpu::matvec_q_ss`] / [`Gpu::matvec_q6ka_ss`] would run the block-per-row `mvqp_*`
    /// kernel (rows wider than the `mvr` kernels take, with PDL and its L2 prefetch), on sm_90
    /// and later, [`Gpu::down_cl`] on, at most [`MVQC_MAX_COLS`] columns.
    pub fn mvqc_takes(&self, ty: GgmlType, rows: usize, cols: usize, q6a: bool) -> bool {
        let Some(f) = act_format(ty) else {
            return false;
        };
        let rb = if q6a {
            q6ka_bytes(1, cols, self.q6a_group(cols))
        } else {
            matrix_bytes(ty, 1, cols)
        };
        self.down_cl.get()
            && self.cc.0 >= 9
            && self.pdl.get()
            && self.mvq_pf.get()
            && !self.warp_rows.get()
            && !self.q6_half_fits(ty, cols)
            && !self.mvr_fits(cols)
            && (!q6a || ty == GgmlType::Q6K)
            && rows > 0
            && cols.is_multiple_of(f.block())
            && cols <= MVQC_MAX_COLS
            && self.mvsm_pairs(rows, cols, rb).is_none()
    }

    /// One token's `y (+)= W x` on rows too wide for the `mvr` kernels (the down projection),
    /// `x` an f32 row: the product quantizes it in `fmt` itself, each block of a cluster of
    /// [`MVQC_CLUSTER`] an eighth of it into all eight blocks' shared memory (`mvqc_*`, session
    /// 21), then runs `mvqp_*`'s row product on that copy: the bits of [`Gpu::quantize_act`]
    /// followed by [`Gpu::matvec_q_ss`] (or, `q6a`, [`Gpu::matvec_q6ka_ss`] on the Q6_KA copy
    /// `w`), without the quantization's launch. Adds the outputs' squares into the slot set
    /// `ss` unless it is 0; returns whether it did. See [`Gpu::mvqc_takes`].
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_q_cluster(
        &self,
        ty: GgmlType,
        q6a: bool,
        w: u64,
        rows: usize,
        cols: usize,
        x: u64,
        y: u64,
        accumulate: bool,
        ss: u64,
    ) -> Result<bool, CudaError> {
        check_cols(ty, cols)?;
        let fmt = act_format(ty)
            .ok_or_else(|| CudaError::Arg(format!("cluster product: weights of type {ty}")))?;
        if !self.mvqc_takes(ty, rows, cols, q6a) {
            return Err(CudaError::Arg(format!(
                "cluster product: {rows} x {cols} {ty} (switched off, before sm_90, without \
                 PDL, or a shape another one-token kernel takes)"
            )));
        }
        if x == 0 {
            return Err(CudaError::Arg("cluster product: no activation row".into()));
        }
        let t = if q6a {
            self.q6a_name(cols, self.q6u.get() && self.q6u_wide.get())
        } else {
            QTYPES[qtype_index(ty)?].1
        };
        let (rr, c, f, a) = (
            i32_of(rows, "rows")?,
            i32_of(cols, "cols")?,
            fmt as i32,
            accumulate as i32,
        );
        let cl = self.mvqc_cluster.get().clamp(1, MVQC_CLUSTER) as usize;
        let per_row = rows.div_ceil(cl) * cl;
        let blocks = match self.mvqc_per_sm.get() {
            0 => per_row,
            k => (k * self.sms as usize).div_ceil(cl).max(1) * cl,
        }
        .min(per_row);
        self.launch_id_cluster(
            self.kernel_id(&format!("mvqc_{t}"))?,
            (u32_of(blocks, "rows")?, 1, 1),
            (self.mvqp_block(cols), 1, 1),
            u32_of(cols + cols / 32 * 8, "activation bytes")?,
            cl as u32,
            kargs![w, rr, c, x, f, y, a, ss],
        )
        .map(|_| ss != 0)
    }

    /// [`Gpu::matvec_q_ss`] for one token (`nt` = 1) on the Q6_KA copy `w` ([`Gpu::pad_q6k`])
    /// of a Q6_K matrix; `ty` is the copied matrix's type (Q6_K), so the arguments are
    /// [`Gpu::matvec_q_ss`]'s. Rows the `mvr` kernels take ([`Gpu::mvr_fits`]: the output
    /// head) run `mvr4_q6_ka`, wider ones (the down projection) `mvqp_q6_ka` with
    /// [`Gpu::mvqp_threads`]: the bits of `mvr4_q6_k` / `mvr_q6_k` and of `mvqp_q6_k` /
    /// `mvq_q6_k_1` on the unpadded matrix. [`Gpu::q6_half`] and [`Gpu::warp_rows`] are not
    /// followed (other kernels with other sums), nor [`Gpu::mvr_lb4`] off (the 64-register
    /// build only) or PDL off (the prefetching form only). Returns whether `ss` was added to
    /// (whenever it is not 0).
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_q6ka_ss(
        &self,
        ty: GgmlType,
        w: u64,
        rows: usize,
        cols: usize,
        qs: u64,
        ds: u64,
        nt: usize,
        y: u64,
        accumulate: bool,
        ss: u64,
    ) -> Result<bool, CudaError> {
        if ty != GgmlType::Q6K {
            return Err(CudaError::Arg(format!(
                "Q6_KA product: weights of type {ty} (the aligned copy holds Q6_K)"
            )));
        }
        check_q6ka_cols(cols, self.q6a_group(cols), "Q6_KA product")?;
        if nt != 1 {
            return Err(CudaError::Arg(format!(
                "Q6_KA product: {nt} tokens (its kernels take one)"
            )));
        }
        if !w.is_multiple_of(16) {
            return Err(CudaError::Arg(format!(
                "Q6_KA product: weights at {w:#x}, not 16-byte aligned"
            )));
        }
        let rb = q6ka_bytes(1, cols, self.q6a_group(cols));
        // Session 20: Q6_KU's decoding of the same copy (the same bits) unless switched off.
        let t = self.q6a_name(cols, self.q6u.get());
        if let Some(ppb) = self.mvsm_pairs(rows, cols, rb) {
            return self
                .mvsm_launch(t, w, rows, cols, rb, ppb, (qs, ds), y, accumulate, ss)
                .map(|_| ss != 0);
        }
        if self.mvr_fits(cols) {
            let act = ActIn::Quantized { qs, ds };
            let segs = [(w, rows, y)];
            Self::check_mvr_segs(&segs, cols, &act, ss)?;
            return self
                .mvr_launch(
                    self.kernel_id(&format!("mvr4_{t}"))?,
                    &segs,
                    cols,
                    act,
                    accumulate,
                    ss,
                )
                .map(|_| ss != 0);
        }
        let t = if self.q6u_wide.get() {
            t
        } else {
            self.q6a_name(cols, false)
        };
        let th = self.mvqp_block(cols);
        let form = self.mvqp_form(cols, th);
        self.mvqe_launch(t, form, th, w, rows, cols, (qs, ds), y, accumulate, ss)
            .map(|_| ss != 0)
    }

    /// A one-token block-per-row product (`form`: `mvqp` or `mvqe`, at `th` threads) of type
    /// name `t`, or the warp-per-row `mvqw_<t>` where [`Gpu::mvqw_takes`] (mvqe's bits).
    #[allow(clippy::too_many_arguments)]
    fn mvqe_launch(
        &self,
        t: &str,
        form: &str,
        th: u32,
        w: u64,
        rows: usize,
        cols: usize,
        (qs, ds): (u64, u64),
        y: u64,
        accumulate: bool,
        ss: u64,
    ) -> Result<(), CudaError> {
        let (rr, c, a) = (
            i32_of(rows, "rows")?,
            i32_of(cols, "cols")?,
            accumulate as i32,
        );
        if self.mvqw_takes(t, cols) {
            const NW: usize = 4;
            return self.launch_id(
                self.kernel_id(&format!("mvqw_{t}"))?,
                (u32_of(rows.div_ceil(NW), "rows")?, 1, 1),
                (32 * NW as u32, 1, 1),
                kargs![w, rr, c, qs, ds, y, a, ss],
            );
        }
        self.launch_id(
            self.kernel_id(&format!("{form}_{t}"))?,
            (u32_of(rows, "rows")?, 1, 1),
            (th, 1, 1),
            kargs![w, rr, c, qs, ds, y, a, ss],
        )
    }

    /// Whether a one-token block-per-row product of type name `t` (a [`MVQW_TYPES`] entry)
    /// on rows `cols` wide runs as the warp-per-row `mvqw_<t>` (session 36, [`Gpu::mvqw`]):
    /// where `mvqe` would run it at 128 threads, whose bits it gives.
    pub fn mvqw_takes(&self, t: &str, cols: usize) -> bool {
        let th = self.mvqp_block(cols);
        self.mvqw.get()
            && self.pdl.get()
            && self.mvq_pf.get()
            && MVQW_TYPES.contains(&t)
            && th == 128
            && self.mvqp_form(cols, th) == "mvqe"
            && cols / 32 <= 256
    }

    /// One token's `y (+)= W x` with one warp per row (`mvd_*`, v10: the down projection's
    /// 8192-column rows; blocks of [`MVD_WARPS`] rows, so every row of a layer's down is
    /// resident at once), activations quantized as for [`Gpu::matvec_q`]. The integer sums per
    /// unit of the CPU's scalar `vec_dot`, summed in another order.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_q_warp(
        &self,
        ty: GgmlType,
        w: u64,
        rows: usize,
        cols: usize,
        qs: u64,
        ds: u64,
        y: u64,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        check_cols(ty, cols)?;
        let name = QTYPES
            .iter()
            .find(|(t, _)| *t == ty)
            .map(|(_, n)| format!("mvd_{n}"))
            .ok_or_else(|| CudaError::Arg(format!("no integer matrix-vector kernel for {ty}")))?;
        let (rr, c, a, pf) = (
            i32_of(rows, "rows")?,
            i32_of(cols, "cols")?,
            accumulate as i32,
            self.pdl.get() as i32,
        );
        self.launch_id(
            self.kernel_id(&name)?,
            (u32_of(rows.div_ceil(MVD_WARPS), "rows")?, 1, 1),
            (32 * MVD_WARPS as u32, 1, 1),
            kargs![w, rr, c, qs, ds, y, a, pf],
        )
    }

    /// `y[t, :] (+)= W x[t, :]` for any number of tokens `n` on the tensor cores (int8 `mma`),
    /// activations quantized as for [`Gpu::matvec_q`]: the batched-decode product (9..64
    /// tokens). Blocks take 64 rows and 16, 32 or 64 tokens, the widest token tile that still
    /// gives two blocks per multiprocessor.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_q(
        &self,
        ty: GgmlType,
        w: u64,
        rows: usize,
        cols: usize,
        qs: u64,
        ds: u64,
        n: usize,
        y: u64,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        let blocks = |nb: usize| rows.div_ceil(64) * n.div_ceil(8 * nb);
        let nb = [8usize, 4]
            .into_iter()
            .find(|&nb| n > 4 * nb && blocks(nb) >= 2 * self.sms as usize)
            .unwrap_or(2);
        self.matmul_q_nb(ty, w, rows, cols, qs, ds, n, y, accumulate, nb)
    }

    /// [`Gpu::matmul_q`] with blocks of `8 * nb` tokens (`nb` one of [`MMQ_NB`]).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_q_nb(
        &self,
        ty: GgmlType,
        w: u64,
        rows: usize,
        cols: usize,
        qs: u64,
        ds: u64,
        n: usize,
        y: u64,
        accumulate: bool,
        nb: usize,
    ) -> Result<(), CudaError> {
        check_cols(ty, cols)?;
        let t = QTYPES
            .iter()
            .find(|(q, _)| *q == ty)
            .map(|(_, name)| *name)
            .ok_or_else(|| CudaError::Arg(format!("no integer GEMM kernel for {ty}")))?;
        if !MMQ_NB.contains(&nb) {
            return Err(CudaError::Arg(format!(
                "token tile {nb} (kernels: {MMQ_NB:?})"
            )));
        }
        if n == 0 || rows == 0 {
            return Ok(());
        }
        let k = self.kernel_id(&format!("mmq_{t}_{nb}"))?;
        let (rr, c, nn, a) = (
            i32_of(rows, "rows")?,
            i32_of(cols, "cols")?,
            i32_of(n, "tokens")?,
            accumulate as i32,
        );
        // mmq.cu's shared memory: decoded weights (64 rows of 272 bytes), unit parameters (16
        // bytes each), then two stages of activations (272 bytes per token), their scales and
        // the raw weight bytes (mmq_rawb per row).
        let ntok = 8 * nb;
        let rawb = ((8 / (ty.block_size() / 32)) * ty.type_size() + 4).div_ceil(16) * 16;
        let smem = 64 * 272 + 64 * 8 * 16 + 2 * (ntok * 272 + ntok * 8 * 8 + 64 * rawb);
        self.launch_id_smem(
            k,
            (
                u32_of(n.div_ceil(8 * nb), "token tiles")?,
                u32_of(rows.div_ceil(64), "row tiles")?,
                1,
            ),
            (128, 1, 1),
            u32_of(smem, "shared memory")?,
            kargs![w, rr, c, qs, ds, nn, y, a],
        )
    }

    /// `y[t, :] (+)= W16 x16[t, :]` for 1..=64 tokens on the tensor cores (f16 `mma`, f32
    /// sums), reading the quantized weights: `W16` is exactly what [`Gpu::dequant_f16`] writes
    /// (the cuBLAS path's weight copy) and `xh` the same f16 operand that path multiplies
    /// (`n` rows of `cols` halves), so only the order of the f32 sums differs from
    /// [`Gpu::gemm_f16`] on the copy. `ws` holds [`MmfPlan::ws_floats`] floats and `cnt` one
    /// zeroed `u32` per row tile ([`MmfPlan::tiles`]; the kernel leaves them zeroed); both may be
    /// 0 when the plan has one K slice.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_f16w(
        &self,
        ty: GgmlType,
        w: u64,
        rows: usize,
        cols: usize,
        xh: u64,
        n: usize,
        y: u64,
        accumulate: bool,
        ws: u64,
        cnt: u64,
    ) -> Result<(), CudaError> {
        check_cols(ty, cols)?;
        let t = QTYPES[qtype_index(ty)?].1;
        if n == 0 || rows == 0 {
            return Ok(());
        }
        if n > 8 * MMF_NT[MMF_NT.len() - 1] {
            return Err(CudaError::Arg(format!(
                "{n} tokens in one f16 product on quantized weights (max 64)"
            )));
        }
        let p = mmf_plan(self.sms as usize, ty, rows, cols, n, self.mmf_warps.get());
        if p.slices > 1 && (ws == 0 || cnt == 0) {
            return Err(CudaError::Arg(format!(
                "{rows}x{cols} product of {n} tokens takes {} K slices: needs a workspace",
                p.slices
            )));
        }
        let k = self.kernel_id(&format!("mmf_{t}_{}", p.nt))?;
        let (rr, c, nn, a, per, ch, fast) = (
            i32_of(rows, "rows")?,
            i32_of(cols, "cols")?,
            i32_of(n, "tokens")?,
            accumulate as i32,
            i32_of(p.per, "units per slice")?,
            i32_of(p.chunk, "units per chunk")?,
            self.mmf_fast.get() as i32,
        );
        self.launch_plan(
            k,
            &p,
            kargs![w, rr, c, xh, nn, y, a, per, ch, ws, cnt, fast],
        )
    }

    /// Launch a product laid out by `p` ([`mmf_plan`], [`mmk_plan`]): row tiles by K slices.
    fn launch_plan(
        &self,
        k: usize,
        p: &MmfPlan,
        args: &mut [*mut std::ffi::c_void],
    ) -> Result<(), CudaError> {
        self.launch_id_smem(
            k,
            (
                u32_of(p.tiles, "row tiles")?,
                u32_of(p.slices, "K slices")?,
                1,
            ),
            (32 * p.warps as u32, 1, 1),
            u32_of(p.smem, "shared memory")?,
            args,
        )
    }

    /// `y[t, :] (+)= W x[t, :]` for a Q4_K matrix and 1..=64 tokens on the tensor cores in the
    /// CPU's integer order (`mmk_q4_k_<nt>`, mmf.cu): `xq` is the f16 operand of
    /// [`Gpu::act_raw_w`] (the Q8_K values themselves, `n` rows of `cols` halves) and `ds` its
    /// scales and sums; per super-block the products form the CPU's integer sums exactly and
    /// scale them in f32. `ws` holds [`MmfPlan::ws_floats`] floats of [`mmk_plan`] and `cnt` one
    /// zeroed `u32` per row tile (left zeroed); both may be 0 when the plan has one K slice.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_q4k_mmk(
        &self,
        w: u64,
        rows: usize,
        cols: usize,
        xq: u64,
        ds: u64,
        n: usize,
        y: u64,
        accumulate: bool,
        ws: u64,
        cnt: u64,
    ) -> Result<(), CudaError> {
        check_cols(GgmlType::Q4K, cols)?;
        if n == 0 || rows == 0 {
            return Ok(());
        }
        if n > 8 * MMF_NT[MMF_NT.len() - 1] {
            return Err(CudaError::Arg(format!(
                "{n} tokens in one Q4_K tensor-core product (max 64)"
            )));
        }
        let p = mmk_plan(self.sms as usize, rows, cols, n);
        if p.slices > 1 && (ws == 0 || cnt == 0) {
            return Err(CudaError::Arg(format!(
                "{rows}x{cols} product of {n} tokens takes {} K slices: needs a workspace",
                p.slices
            )));
        }
        let k = self.kernel_id(&format!("mmk_q4_k_{}", p.nt))?;
        let (rr, c, nn, a, per, ch) = (
            i32_of(rows, "rows")?,
            i32_of(cols, "cols")?,
            i32_of(n, "tokens")?,
            accumulate as i32,
            i32_of(p.per, "units per slice")?,
            i32_of(p.chunk, "units per chunk")?,
        );
        self.launch_plan(k, &p, kargs![w, rr, c, xq, ds, nn, y, a, per, ch, ws, cnt])
    }

    /// [`Gpu::rms_norm`] of `n_rows` consecutive rows (no row list) for prompt-sized steps:
    /// one block per row, the quantization a warp per 256-element group (no block barriers);
    /// the same bits as [`Gpu::rms_norm`]. `n` must be a multiple of 32.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_w(
        &self,
        x: u64,
        w: u64,
        n: usize,
        eps: f32,
        n_rows: usize,
        out: u64,
        out_h: u64,
        quant: Option<(ActFormat, u64, u64)>,
    ) -> Result<(), CudaError> {
        self.rms_norm_w_launch(x, w, n, eps, n_rows, out, out_h, quant, false)
    }

    /// [`Gpu::rms_norm_w`] writing [`Gpu::act_raw_w`]'s operand: `xq` the quantized values
    /// themselves (f16), `ds` their scales and sums.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_w_raw(
        &self,
        x: u64,
        w: u64,
        n: usize,
        eps: f32,
        n_rows: usize,
        out: u64,
        fmt: ActFormat,
        xq: u64,
        ds: u64,
    ) -> Result<(), CudaError> {
        self.rms_norm_w_launch(x, w, n, eps, n_rows, out, xq, Some((fmt, 0, ds)), true)
    }

    #[allow(clippy::too_many_arguments)]
    fn rms_norm_w_launch(
        &self,
        x: u64,
        w: u64,
        n: usize,
        eps: f32,
        n_rows: usize,
        out: u64,
        out_h: u64,
        quant: Option<(ActFormat, u64, u64)>,
        raw: bool,
    ) -> Result<(), CudaError> {
        let (fmt, qs, ds) = match quant {
            Some((f, q, d)) => (f as i32 | if raw { 256 } else { 0 }, q, d),
            None => (0i32, 0u64, 0u64),
        };
        let blk = quant.map_or(32, |q| q.0.block().max(32));
        if n == 0 || !n.is_multiple_of(blk) {
            return Err(CudaError::Arg(format!(
                "rms_norm_w: {n} columns is not a multiple of {blk}"
            )));
        }
        let chunks = if n_rows <= MMQ_MAX_N {
            n.div_ceil(2048)
        } else {
            1
        };
        let nn = i32_of(n, "width")?;
        self.launch_id(
            self.kernel_id("rms_norm_w")?,
            // Session 10: for decode steps (<= 64 rows, fewer blocks than SMs), the row's
            // 256-element groups over ceil(n / 2048) blocks (a warp per group), each block
            // summing the whole row's squares as every other does (the same bits); prompts
            // keep a block per row (the repeated sums cost them more than the spread gains).
            (u32_of(n_rows, "rows")?, u32_of(chunks, "chunks")?, 1),
            (256, 1, 1),
            kargs![x, w, nn, eps, out, out_h, fmt, qs, ds],
        )
    }

    /// The f16 GEMM operand `xh` of `rows` rows of `x` (`n` columns, a multiple of 32):
    /// quantized in `fmt` as [`Gpu::quantize_act_f16`] does (same bits), or plain f16 for
    /// `None`; with `u` != 0, `x = silu(x) * u` first (written back to `x`, as
    /// [`Gpu::swiglu_f16`]). A warp per 256-element group.
    pub fn act_f16_w(
        &self,
        x: u64,
        u: u64,
        rows: usize,
        n: usize,
        fmt: Option<ActFormat>,
        xh: u64,
    ) -> Result<(), CudaError> {
        self.act_quant_w(x, u, rows, n, fmt, 0, 0, xh)
    }

    /// [`Gpu::act_f16_w`] on rows of `x` and `u` that lie `stride` floats apart (v10: the gate
    /// and up halves of one fused product's rows); `xh` is dense. The SwiGLU is written back
    /// into `x`'s rows.
    #[allow(clippy::too_many_arguments)]
    pub fn act_f16_strided(
        &self,
        x: u64,
        u: u64,
        rows: usize,
        n: usize,
        stride: usize,
        fmt: Option<ActFormat>,
        xh: u64,
    ) -> Result<(), CudaError> {
        if stride < n {
            return Err(CudaError::Arg(format!(
                "act_f16_strided: row stride {stride} below the width {n}"
            )));
        }
        self.act_quant_launch(x, u, rows, n, fmt, 0, 0, xh, stride, false)
    }

    /// [`Gpu::act_f16_w`] that also (or only: `xh` = 0) writes the int8 values `qs` and scales
    /// `ds` of [`Gpu::quantize_act`] (same bytes; either may be 0).
    #[allow(clippy::too_many_arguments)]
    pub fn act_quant_w(
        &self,
        x: u64,
        u: u64,
        rows: usize,
        n: usize,
        fmt: Option<ActFormat>,
        qs: u64,
        ds: u64,
        xh: u64,
    ) -> Result<(), CudaError> {
        self.act_quant_launch(x, u, rows, n, fmt, qs, ds, xh, n, false)
    }

    /// The operand of [`Gpu::matmul_q4k_mmk`]: rows of `x` (SwiGLU with `u` first when `u` is
    /// not 0, as [`Gpu::act_f16_w`]) quantized in `fmt`, the f16 operand `xq` holding the int8
    /// values themselves and `ds` the scales and sums ([`Gpu::quantize_act`]'s `ds`).
    #[allow(clippy::too_many_arguments)]
    pub fn act_raw_w(
        &self,
        x: u64,
        u: u64,
        rows: usize,
        n: usize,
        fmt: ActFormat,
        ds: u64,
        xq: u64,
    ) -> Result<(), CudaError> {
        self.act_quant_launch(x, u, rows, n, Some(fmt), 0, ds, xq, n, true)
    }

    #[allow(clippy::too_many_arguments)]
    fn act_quant_launch(
        &self,
        x: u64,
        u: u64,
        rows: usize,
        n: usize,
        fmt: Option<ActFormat>,
        qs: u64,
        ds: u64,
        xh: u64,
        stride: usize,
        raw: bool,
    ) -> Result<(), CudaError> {
        let blk = fmt.map_or(32, |f| f.block().max(32));
        if n == 0 || !n.is_multiple_of(blk) {
            return Err(CudaError::Arg(format!(
                "act_f16_w: {n} columns is not a multiple of {blk}"
            )));
        }
        if !stride.is_multiple_of(4) {
            // Rows are read as float4.
            return Err(CudaError::Arg(format!(
                "act_f16_w: row stride {stride} is not a multiple of 4"
            )));
        }
        // ACT_RAW (matvec_q.cu): the f16 operand holds the int8 values themselves.
        let raw = if raw && fmt.is_some() { 256 } else { 0 };
        // Session 10: decode steps (<= 64 rows) in blocks of 4 warps (a 64 x 3072 operand over
        // 768 blocks instead of 128); prompts keep 8.
        let warps = if rows <= MMQ_MAX_N { 4 } else { 8 };
        let (nn, f) = (i32_of(n, "width")?, fmt.map_or(0, |f| f as i32) | raw);
        let xs = stride as i64;
        self.launch_id(
            self.kernel_id("act_quant_w")?,
            (
                u32_of(rows, "rows")?,
                u32_of(n.div_ceil(256 * warps), "chunks")?,
                1,
            ),
            (32 * warps as u32, 1, 1),
            kargs![x, u, nn, f, qs, ds, xh, xs],
        )
    }

    /// Decode attention for many sequences ([`Gpu::attn_decode`]'s arithmetic and partial
    /// results): block (t, kvh, s) walks split `s` of `n_split` equal parts (whole 64-position
    /// tiles) of token `t`'s own context with the next tile's K/V copy in flight (cp.async,
    /// two shared-memory stages). Merge with [`Gpu::attn_combine`] and `split_len` 0. With
    /// [`Gpu::attn_wp`] (the default) and cache blocks of a multiple of 16 positions, each warp
    /// copies its own 16 rows of a tile from one cache block (`attn_batchw_*`, session 11; the
    /// same bits).
    #[allow(clippy::too_many_arguments)]
    pub fn attn_batch(
        &self,
        n: usize,
        q: u64,
        kc: u64,
        vc: u64,
        tok_pos: u64,
        tok_seq: u64,
        btab: u64,
        max_blocks: usize,
        block_tokens: usize,
        n_head: usize,
        n_kv: usize,
        hd: usize,
        n_split: usize,
        part: u64,
    ) -> Result<(), CudaError> {
        let (g, kv) = (
            (q, kc, vc),
            (tok_pos, tok_seq, btab, max_blocks, block_tokens),
        );
        self.attn_split(n, g, kv, n_head, n_kv, hd, n_split, part, false, None, 0)
    }

    /// [`Gpu::attn_batch`] over one split that writes the merged output `out` (`n x
    /// n_head*hd` floats) itself, the bits [`Gpu::attn_combine`] makes of its partial results
    /// (session 11: steps whose tokens and KV heads fill the GPU need no combine launch).
    #[allow(clippy::too_many_arguments)]
    pub fn attn_batch_direct(
        &self,
        n: usize,
        (q, kc, vc): (u64, u64, u64),
        (tok_pos, tok_seq, btab, max_blocks, block_tokens): (u64, u64, u64, usize, usize),
        n_head: usize,
        n_kv: usize,
        hd: usize,
        out: u64,
    ) -> Result<(), CudaError> {
        let (g, kv) = (
            (q, kc, vc),
            (tok_pos, tok_seq, btab, max_blocks, block_tokens),
        );
        self.attn_split(n, g, kv, n_head, n_kv, hd, 1, 0, false, None, out)
    }

    /// [`Gpu::attn_one`] over one split that writes the merged output `out` itself, the bits
    /// [`Gpu::attn_merge`] / [`Gpu::attn_merge_q`] make of its one partial result (session 18:
    /// one-token steps whose context is a single 64-position tile need no merge launch).
    #[allow(clippy::too_many_arguments)]
    pub fn attn_one_direct(
        &self,
        n: usize,
        (q, kc, vc): (u64, u64, u64),
        (tok_pos, tok_seq, btab, max_blocks, block_tokens): (u64, u64, u64, usize, usize),
        n_head: usize,
        n_kv: usize,
        hd: usize,
        out: u64,
    ) -> Result<(), CudaError> {
        let (g, kv) = (
            (q, kc, vc),
            (tok_pos, tok_seq, btab, max_blocks, block_tokens),
        );
        self.attn_split(n, g, kv, n_head, n_kv, hd, 1, 0, true, None, out)
    }

    /// [`Gpu::attn_batch`] followed by [`Gpu::attn_combine`] (`split_len` 0) in one launch
    /// (v9): the last block of each (token, KV head) to finish merges its heads' slices into
    /// `merged` (`n x n_head*hd` floats) with attn_combine's operations in its order, the same
    /// bits. `cnt` holds one zeroed `u32` per (token, KV head), left zeroed.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_batch_merge(
        &self,
        n: usize,
        (q, kc, vc): (u64, u64, u64),
        (tok_pos, tok_seq, btab, max_blocks, block_tokens): (u64, u64, u64, usize, usize),
        n_head: usize,
        n_kv: usize,
        hd: usize,
        n_split: usize,
        part: u64,
        merged: u64,
        cnt: u64,
    ) -> Result<(), CudaError> {
        let (g, kv) = (
            (q, kc, vc),
            (tok_pos, tok_seq, btab, max_blocks, block_tokens),
        );
        let m = Some((merged, cnt));
        self.attn_split(n, g, kv, n_head, n_kv, hd, n_split, part, false, m, 0)
    }

    /// [`Gpu::attn_batch`] for steps in which every K/V row of each token's context but its own
    /// position's was written before the step (one-token decode steps; v8): the first two
    /// tiles' copies are issued before waiting for the kernel before it (which writes the own
    /// row), so they overlap that kernel's tail under programmatic dependent launch. Same
    /// values, same bits as [`Gpu::attn_batch`].
    #[allow(clippy::too_many_arguments)]
    pub fn attn_one(
        &self,
        n: usize,
        q: u64,
        kc: u64,
        vc: u64,
        tok_pos: u64,
        tok_seq: u64,
        btab: u64,
        max_blocks: usize,
        block_tokens: usize,
        n_head: usize,
        n_kv: usize,
        hd: usize,
        n_split: usize,
        part: u64,
    ) -> Result<(), CudaError> {
        let (g, kv) = (
            (q, kc, vc),
            (tok_pos, tok_seq, btab, max_blocks, block_tokens),
        );
        self.attn_split(n, g, kv, n_head, n_kv, hd, n_split, part, true, None, 0)
    }

    #[allow(clippy::too_many_arguments)]
    fn attn_split(
        &self,
        n: usize,
        (q, kc, vc): (u64, u64, u64),
        (tok_pos, tok_seq, btab, max_blocks, block_tokens): (u64, u64, u64, usize, usize),
        n_head: usize,
        n_kv: usize,
        hd: usize,
        n_split: usize,
        part: u64,
        early: bool,
        merge: Option<(u64, u64)>,
        direct: u64,
    ) -> Result<(), CudaError> {
        if direct != 0 && (n_split != 1 || merge.is_some()) {
            return Err(CudaError::Arg(format!(
                "attention output written directly over {n_split} splits"
            )));
        }
        let d = PREFILL_HEAD_DIMS
            .iter()
            .position(|&h| h == hd)
            .ok_or_else(|| CudaError::Arg(format!("head size {hd} (mma kernels: 64, 128)")))?;
        if n_kv == 0 || !n_head.is_multiple_of(n_kv) || n_head / n_kv > 8 {
            return Err(CudaError::Arg(format!(
                "{n_head} query heads over {n_kv} KV heads (at most 8 per KV head)"
            )));
        }
        let scale = 1.0f32 / (hd as f32).sqrt();
        let (mb, bt, nh, nk) = (
            i32_of(max_blocks, "max_blocks")?,
            i32_of(block_tokens, "block_tokens")?,
            n_head as i32,
            n_kv as i32,
        );
        // Two stages of K and V tiles (64 rows of hd + 8 halves each).
        let smem = (2 * 2 * 64 * (hd + 8) * 2) as u32;
        let grid = (
            u32_of(n, "tokens")?,
            n_kv as u32,
            u32_of(n_split, "splits")?,
        );
        // Separate entry points (v9): the early path's registers cost the wide steps a block
        // per SM when both lived in one kernel.
        // Session 11: the warp-private loaders (same bits) where `attn_wp` is on.
        // (Their loaders take a warp's 16 rows from one cache block.)
        let wp = self.attn_wp.get() && block_tokens.is_multiple_of(16);
        let name = match (early, merge, wp) {
            (true, _, false) => ["attn_one_d2", "attn_one_d4"][d],
            (true, _, true) => ["attn_onew_d2", "attn_onew_d4"][d],
            (false, Some(_), _) => ["attn_batchm_d2", "attn_batchm_d4"][d],
            (false, None, false) => ["attn_batch_d2", "attn_batch_d4"][d],
            (false, None, true) => ["attn_batchw_d2", "attn_batchw_d4"][d],
        };
        let k = self.kernel_id(name)?;
        match merge {
            Some((mg, mc)) if !early => self.launch_id_smem(
                k,
                grid,
                (128, 1, 1),
                smem,
                kargs![q, kc, vc, tok_pos, tok_seq, btab, mb, bt, nh, nk, scale, part, mg, mc],
            ),
            _ => self.launch_id_smem(
                k,
                grid,
                (128, 1, 1),
                smem,
                kargs![q, kc, vc, tok_pos, tok_seq, btab, mb, bt, nh, nk, scale, part, direct],
            ),
        }
    }

    /// One token's Q, K and V products (`w`, `rows`: matrices of type `ty`; any may have 0 rows,
    /// so a V of another type takes a second launch) in one launch that also does
    /// [`Gpu::rope_store`]'s work for models without biases and with adjacent rotation pairs:
    /// Q rotated into `yq`, K rotated and V written as f16 to row `slot[0]` (rows of `kv_row`)
    /// of the caches `kc`/`vc`, at position `pos[0]` (device i32 arrays). Same arithmetic as
    /// rope_store, so the same bits.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_q_qkv_rope(
        &self,
        ty: GgmlType,
        w: [u64; 3],
        rows: [usize; 3],
        cols: usize,
        qs: u64,
        ds: u64,
        yq: u64,
        rope: &RopeParams,
        pos: u64,
        slot: u64,
        hd: usize,
        kv_row: usize,
        kc: u64,
        vc: u64,
    ) -> Result<(), CudaError> {
        let a = ActIn::Quantized { qs, ds };
        self.qkv_rope(
            ty, None, w, rows, cols, a, yq, rope, pos, slot, hd, kv_row, kc, vc,
        )
    }

    /// [`Gpu::matvec_q_qkv_rope`] on the f32 row `prep` names: each block normalizes and
    /// quantizes it itself (bit for bit what [`Gpu::rms_norm`] with quantization writes), so
    /// the RMSNorm needs no launch (v7).
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_q_qkv_rope_prep(
        &self,
        ty: GgmlType,
        w: [u64; 3],
        rows: [usize; 3],
        cols: usize,
        prep: &ActPrep,
        yq: u64,
        rope: &RopeParams,
        pos: u64,
        slot: u64,
        hd: usize,
        kv_row: usize,
        kc: u64,
        vc: u64,
    ) -> Result<(), CudaError> {
        let a = ActIn::Prep(*prep);
        self.qkv_rope(
            ty, None, w, rows, cols, a, yq, rope, pos, slot, hd, kv_row, kc, vc,
        )
    }

    /// [`Gpu::matvec_q_qkv_rope`] for a V of type `tv` other than Q and K's `ty` (v9: Q4_K_M
    /// files store half the layers' V as Q6_K), in one launch rather than two: the pairs
    /// [`Gpu::qkv_mixed_fits`] names; the same bits as the two single-type launches.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_q_qkv_rope_mixed(
        &self,
        ty: GgmlType,
        tv: GgmlType,
        v_copy: bool,
        w: [u64; 3],
        rows: [usize; 3],
        cols: usize,
        qs: u64,
        ds: u64,
        yq: u64,
        rope: &RopeParams,
        pos: u64,
        slot: u64,
        hd: usize,
        kv_row: usize,
        kc: u64,
        vc: u64,
    ) -> Result<(), CudaError> {
        if !Self::qkv_mixed_fits(ty, tv) {
            return Err(CudaError::Arg(format!(
                "no one-launch Q/K/V kernel for Q/K of {ty} and V of {tv}"
            )));
        }
        check_cols(tv, cols)?;
        if v_copy && (tv != GgmlType::Q6K || !w[2].is_multiple_of(16)) {
            return Err(CudaError::Arg(format!(
                "mixed Q/K/V launch: V of {tv} at {:#x} is not a 16-byte aligned Q6_KA copy",
                w[2]
            )));
        }
        let a = ActIn::Quantized { qs, ds };
        self.qkv_rope(
            ty,
            Some((tv, v_copy)),
            w,
            rows,
            cols,
            a,
            yq,
            rope,
            pos,
            slot,
            hd,
            kv_row,
            kc,
            vc,
        )
    }

    /// The V part of the `mvpq<S>_q4_k_<v>` kernel name for a one-token Q/K/V launch ([`Gpu::mvpq`]
    /// on, Q/K of Q4_K on a quantized activation, rows of 1024 to 4096 columns in steps of
    /// 1024, Q and K in whole rotation pairs; V of Q4_K, Q6_K or its aligned copy), or `None`
    /// for the `mvr` kernels.
    fn mvpq_form(
        &self,
        ty: GgmlType,
        tv: Option<(GgmlType, bool)>,
        act: &ActIn,
        rows: [usize; 3],
        cols: usize,
    ) -> Option<&'static str> {
        if !self.mvpq.get()
            || ty != GgmlType::Q4K
            || !matches!(act, ActIn::Quantized { .. })
            || !cols.is_multiple_of(1024)
            || cols > 4096
            || !rows[0].is_multiple_of(2)
            || !rows[1].is_multiple_of(2)
        {
            return None;
        }
        match tv {
            None => Some("q4_k"),
            Some((GgmlType::Q6K, true)) => Some(self.q6a_name(cols, true)),
            Some((GgmlType::Q6K, false)) => Some("q6_k"),
            Some(_) => None,
        }
    }

    /// Whether [`Gpu::matvec_q_qkv_rope_mixed`] has a kernel for Q/K of `ty` and V of `tv`.
    pub fn qkv_mixed_fits(ty: GgmlType, tv: GgmlType) -> bool {
        QKV_PAIRS.contains(&(ty, tv))
    }

    #[allow(clippy::too_many_arguments)]
    fn qkv_rope(
        &self,
        ty: GgmlType,
        tv: Option<(GgmlType, bool)>,
        w: [u64; 3],
        rows: [usize; 3],
        cols: usize,
        act: ActIn,
        yq: u64,
        rope: &RopeParams,
        pos: u64,
        slot: u64,
        hd: usize,
        kv_row: usize,
        kc: u64,
        vc: u64,
    ) -> Result<(), CudaError> {
        check_cols(ty, cols)?;
        check_prep(&act, cols)?;
        if !self.mvr_fits(cols) {
            return Err(CudaError::Arg(format!(
                "fused Q/K/V + RoPE: {cols} columns (at most {MVR_MAX_COLS})"
            )));
        }
        let rp = rope_args(rope, rows, pos, slot, hd, kv_row, kc, vc)?;
        let (w0, w1, w2) = (w[0], w[1], w[2]);
        let ([r0, r1, r2], c) = qkv_ints(rows, cols)?;
        let pf = self.mvr_flags();
        let total = rows[0] + rows[1] + rows[2];
        let (qs, ds, px, pw, eps) = act.args();
        if let Some(v) = self.mvpq_form(ty, tv, &act, rows, cols) {
            // Session 33: a warp per Q4_K rotation pair, its weights in registers before the
            // wait (`mvpq<S>_q4_k_<v>`); V of another type on the unit code in the same launch.
            let id = self.kernel_id(&format!("mvpq{}_q4_k_{v}", cols / 1024))?;
            return self.launch_id(
                id,
                (u32_of(total.div_ceil(8), "rows")?, 1, 1),
                (128, 1, 1),
                kargs![w0, w1, w2, r0, r1, r2, qs, ds, yq, rp],
            );
        }
        if let Some((tv, v_copy)) = tv {
            let name = |t: GgmlType| QTYPES.iter().find(|q| q.0 == t).map(|q| q.1);
            // Session 20: V from its Q6_KA copy takes Q6_KU's decoding (Q6_K's bits).
            let vname = if v_copy {
                Some(self.q6a_name(cols, true))
            } else {
                name(tv)
            };
            let (Some(a), Some(b), ActIn::Quantized { .. }) = (name(ty), vname, &act) else {
                return Err(CudaError::Arg(format!(
                    "mixed Q/K/V launch of {ty} and {tv}"
                )));
            };
            if !(rows[0] + rows[1]).is_multiple_of(2) {
                return Err(CudaError::Arg(format!("mixed Q/K/V launch: rows {rows:?}")));
            }
            let lb = if self.mvr_lb4.get() { "mvr4" } else { "mvr" };
            let id = self.kernel_id(&format!("{lb}_rope2_{a}_{b}"))?;
            let nw = self.mvr_block(&act, false);
            let (blocks, loops) = self.mvr_grid(id, total.div_ceil(2 * nw), &act, nw)?;
            return self.launch_id(
                id,
                (u32_of(blocks, "rows")?, 1, 1),
                (32 * nw as u32, 1, 1),
                kargs![w0, w1, w2, r0, r1, r2, c, qs, ds, yq, pf, rp, loops],
            );
        }
        let id = match act {
            ActIn::Prep(_) => {
                self.kernel_id(&format!("mvrp_rope_{}", QTYPES[qtype_index(ty)?].1))?
            }
            ActIn::Quantized { .. } => mvr_id(ty, false)? + 2,
        };
        let nw = self.mvr_block(&act, false);
        let (blocks, loops) = self.mvr_grid(id, total.div_ceil(2 * nw), &act, nw)?;
        self.launch_id(
            id,
            (u32_of(blocks, "rows")?, 1, 1),
            (32 * nw as u32, 1, 1),
            kargs![w0, w1, w2, r0, r1, r2, c, qs, ds, yq, pf, rp, px, pw, eps, loops],
        )
    }

    /// The `prefetch` argument of the `mvr_*` kernels: bit 0, ask L2 for the block's weights
    /// before the wait (under programmatic dependent launch). Bit 1 is free: v9's first weights
    /// decoded into registers before the wait were removed in session 17 (off by default, its
    /// code alone cost the kernels 64-136 registers, docs/perf/cuda.md).
    ///
    /// Bit 2 (v10, [`Gpu::wave`]): the launch's grid is sized to what is resident at once
    /// (`mvr_grid`); the block asks L2 for its first two steps only and each warp for
    /// its rows two steps ahead.
    fn mvr_flags(&self) -> i32 {
        let pdl = self.pdl.get();
        pdl as i32 | ((self.wave.get() as i32) << 2)
    }

    /// Blocks and row pairs per warp of an `mvr` launch (kernel `id`) that needs `blocks`
    /// blocks at one pair per warp: launches that prepare their own activation (every block
    /// reads the whole f32 row) take several pairs per warp, down to about
    /// [`Gpu::prep_blocks`] blocks per SM; with [`Gpu::wave`] (v10) the others take as many
    /// pairs per warp as fit the blocks of `nw` warps resident at once, so the launch runs as
    /// one wave.
    fn mvr_grid(
        &self,
        id: usize,
        blocks: usize,
        act: &ActIn,
        nw: usize,
    ) -> Result<(usize, i32), CudaError> {
        let loops = match act {
            ActIn::Quantized { .. } if self.wave.get() => {
                blocks.div_ceil(self.resident_blocks(id, nw)?).max(1)
            }
            ActIn::Quantized { .. } => 1,
            ActIn::Prep(_) => blocks
                .div_ceil(self.prep_blocks.get().max(1) * self.sms as usize)
                .max(1),
        };
        Ok((blocks.div_ceil(loops), i32_of(loops, "row steps")?))
    }

    /// Blocks of `nw` warps of kernel `id` the GPU holds at once (at least 1), or
    /// [`Gpu::wave_cap`] when set.
    fn resident_blocks(&self, id: usize, nw: usize) -> Result<usize, CudaError> {
        let cap = self.wave_cap.get();
        if cap > 0 {
            return Ok(cap);
        }
        Ok((self.blocks_per_sm(id, 32 * nw as u32)? * self.sms as usize).max(1))
    }

    /// Warps per block of a one-token `mvr` launch on `act`: [`Gpu::mvr_warps`] (plain and
    /// Q/K/V) or [`Gpu::mvr_warps_glu`] (SwiGLU), 1 to 8, for quantized activations;
    /// [`MVR_WARPS`] for those the launch prepares itself.
    fn mvr_block(&self, act: &ActIn, glu: bool) -> usize {
        let warps = if glu {
            &self.mvr_warps_glu
        } else {
            &self.mvr_warps
        };
        match act {
            ActIn::Quantized { .. } => warps.get().clamp(1, MVR_WARPS),
            ActIn::Prep(_) => MVR_WARPS,
        }
    }

    /// One token's `y (+)= W x` for a Q6_K matrix with the half-super-block kernel
    /// (`mv6_q6_k`, v10: each half's bytes loaded once, four rows per warp, the grid sized to
    /// what is resident at once), activations quantized as for [`Gpu::matvec_q`] (Q8_K). The
    /// same integer sums per 128 elements as the CPU's scalar `vec_dot`, summed in another
    /// order. `cols` a multiple of 256.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_q6_half(
        &self,
        w: u64,
        rows: usize,
        cols: usize,
        qs: u64,
        ds: u64,
        y: u64,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        check_cols(GgmlType::Q6K, cols)?;
        let id = self.kernel_id("mv6_q6_k")?;
        let groups = rows.div_ceil(MV6_ROWS);
        let blocks = groups.div_ceil(MVR_WARPS);
        let loops = blocks.div_ceil(self.resident_blocks(id, MVR_WARPS)?).max(1);
        let (rr, c, a, pf, l) = (
            i32_of(rows, "rows")?,
            i32_of(cols, "cols")?,
            accumulate as i32,
            self.pdl.get() as i32,
            i32_of(loops, "row steps")?,
        );
        self.launch_id(
            id,
            (u32_of(blocks.div_ceil(loops), "rows")?, 1, 1),
            (32 * MVR_WARPS as u32, 1, 1),
            kargs![w, rr, c, qs, ds, y, a, pf, l],
        )
    }

    /// Whether one-token products of a `ty` matrix with `cols` columns take
    /// [`Gpu::matvec_q6_half`] ([`Gpu::q6_half`] on, Q6_K, the `mvr` widths).
    pub fn q6_half_fits(&self, ty: GgmlType, cols: usize) -> bool {
        self.q6_half.get() && ty == GgmlType::Q6K && self.mvr_fits(cols)
    }

    /// Whether one-token products of rows `cols` wide take the `mvr_*` kernels: on the H200 they
    /// beat the block-per-row kernels up to 4096 columns (Q/K/V, O, gate/up, the output head of
    /// the 3B model) and lose on 8192-wide rows (down: 15.4 against 9.4 us, docs/perf/cuda.md v6).
    pub fn mvr_fits(&self, cols: usize) -> bool {
        self.mvr.get() && cols <= MVR_MAX_COLS
    }

    /// Whether one-token products of rows `cols` wide can prepare their own activation
    /// ([`ActPrep`]: RMSNorm and quantization inside the product's launch, v7).
    /// Whether the half-unit one-token SwiGLU product ([`Gpu::matvec_q_swiglu_half`],
    /// session 16) takes gate and up matrices of type `ty`, `cols` wide.
    pub fn mvh_fits(&self, ty: GgmlType, cols: usize) -> bool {
        self.mvh.get() && ty == GgmlType::Q4K && cols > 0 && cols.is_multiple_of(256)
    }

    /// Whether the pipelined half-unit SwiGLU product ([`Gpu::matvec_q_swiglu_pipe`], session
    /// 29) takes gate and up matrices of type `ty`, `cols` wide.
    pub fn mvp_fits(&self, ty: GgmlType, cols: usize) -> bool {
        self.mvp.get() > 0 && ty == GgmlType::Q4K && cols > 0 && cols.is_multiple_of(256)
    }

    /// [`Gpu::matvec_q_swiglu_half`]'s product and bits (no fused quantization) with its loads
    /// pipelined across rows (`mvp3_swiglu_q4_k`, session 29): each warp walks [`Gpu::mvp`]'s
    /// rows per warp as one stream of four-super-block steps, the weights of the next two steps
    /// in registers while one is computed, the first three loaded before the PDL wait (a whole
    /// 3072-column row). Only where [`Gpu::mvp_fits`].
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_q_swiglu_pipe(
        &self,
        wg: u64,
        wu: u64,
        rows: usize,
        cols: usize,
        qs: u64,
        ds: u64,
        y: u64,
    ) -> Result<(), CudaError> {
        let rpw = self.mvp.get();
        if !cols.is_multiple_of(256) || cols == 0 || rpw == 0 {
            return Err(CudaError::Arg(format!(
                "pipelined SwiGLU product: {cols} columns (Q4_K: a multiple of 256), {rpw} rows \
                 per warp (at least 1)"
            )));
        }
        const NW: usize = 4;
        if rpw == 1 && self.mvps.get() && cols.is_multiple_of(1024) && cols <= 4096 {
            // Session 33: the cursor-free form for rows of whole four-super-block steps.
            let name = format!("mvps{}_swiglu_q4_k", cols / 1024);
            let r = i32_of(rows, "rows")?;
            return self.launch_id(
                self.kernel_id(&name)?,
                (u32_of(rows.div_ceil(NW), "rows")?, 1, 1),
                (32 * NW as u32, 1, 1),
                kargs![wg, wu, r, qs, ds, y],
            );
        }
        let (r, c, pf, rw) = (
            i32_of(rows, "rows")?,
            i32_of(cols, "cols")?,
            self.pdl.get() as i32,
            i32_of(rpw, "rows per warp")?,
        );
        self.launch_id(
            self.kernel_id("mvp3_swiglu_q4_k")?,
            (u32_of(rows.div_ceil(NW * rpw), "rows")?, 1, 1),
            (32 * NW as u32, 1, 1),
            kargs![wg, wu, r, c, qs, ds, y, pf, rw],
        )
    }

    /// One token's `y = silu(Wg x) * (Wu x)` for Q4_K `wg`, `wu` with the half-unit kernel
    /// (`mvh_swiglu_q4_k`, session 16) on an activation quantized to Q8_K in the permuted
    /// layout ([`Gpu::rms_norm_ss`] with `perm`): the per-sub-block values of
    /// [`Gpu::matvec_q_swiglu_quant`], summed in another order; `quant` as there. Only where
    /// [`Gpu::mvh_fits`].
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_q_swiglu_half(
        &self,
        wg: u64,
        wu: u64,
        rows: usize,
        cols: usize,
        qs: u64,
        ds: u64,
        y: u64,
        quant: Option<OutQuant>,
    ) -> Result<(), CudaError> {
        if !cols.is_multiple_of(256) || cols == 0 {
            return Err(CudaError::Arg(format!(
                "half-unit SwiGLU product: {cols} columns (Q4_K: a multiple of 256)"
            )));
        }
        if let Some(OutQuant { fmt: f, .. }) = quant {
            if !rows.is_multiple_of(f.block()) {
                return Err(CudaError::Arg(format!(
                    "fused quantization of a SwiGLU product: {rows} rows ({f:?}: a multiple of {})",
                    f.block()
                )));
            }
        }
        let (r, c, pf) = (
            i32_of(rows, "rows")?,
            i32_of(cols, "cols")?,
            self.pdl.get() as i32,
        );
        let (qf, qc, qq, qd) = OutQuant::args(quant);
        self.launch_id(
            self.kernel_id("mvh_swiglu_q4_k")?,
            (u32_of(rows.div_ceil(MVR_WARPS), "rows")?, 1, 1),
            (32 * MVR_WARPS as u32, 1, 1),
            kargs![wg, wu, r, c, qs, ds, y, pf, qf, qc, qq, qd],
        )
    }

    pub fn mvr_prep_fits(&self, cols: usize) -> bool {
        self.mvr_fits(cols) && cols <= MVR_PREP_MAX
    }

    /// One token's `y_i (+)= W_i x` for up to three matrices of type `ty` with `cols` columns
    /// each (`segs`: weights, rows, output), in one launch of the two-rows-per-warp kernel: the
    /// layer's Q, K and V products share one launch and one activation (quantized by
    /// [`Gpu::quantize_act`] or [`Gpu::rms_norm`] in `act_format(ty)`).
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_q_multi(
        &self,
        ty: GgmlType,
        segs: &[(u64, usize, u64)],
        cols: usize,
        qs: u64,
        ds: u64,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        self.mvr_multi(ty, segs, cols, ActIn::Quantized { qs, ds }, accumulate)
    }

    fn mvr_multi(
        &self,
        ty: GgmlType,
        segs: &[(u64, usize, u64)],
        cols: usize,
        act: ActIn,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        self.mvr_multi_ss(ty, segs, cols, act, accumulate, 0)
    }

    /// [`Gpu::mvr_multi`]; `ss` != 0 (one matrix only) adds the outputs' squares into the
    /// [`RMS_SLOTS`] partial sums there ([`Gpu::matvec_q_ss`]).
    fn mvr_multi_ss(
        &self,
        ty: GgmlType,
        segs: &[(u64, usize, u64)],
        cols: usize,
        act: ActIn,
        accumulate: bool,
        ss: u64,
    ) -> Result<(), CudaError> {
        check_cols(ty, cols)?;
        Self::check_mvr_segs(segs, cols, &act, ss)?;
        let id = match act {
            ActIn::Prep(_) => self.kernel_id(&format!("mvrp_{}", QTYPES[qtype_index(ty)?].1))?,
            ActIn::Quantized { .. } if self.mvr_lb4.get() => {
                self.kernel_id(&format!("mvr4_{}", QTYPES[qtype_index(ty)?].1))?
            }
            ActIn::Quantized { .. } => mvr_id(ty, false)?,
        };
        self.mvr_launch(id, segs, cols, act, accumulate, ss)
    }

    fn check_mvr_segs(
        segs: &[(u64, usize, u64)],
        cols: usize,
        act: &ActIn,
        ss: u64,
    ) -> Result<(), CudaError> {
        if ss != 0 && segs.len() != 1 {
            return Err(CudaError::Arg(format!(
                "sums of squares from {} matrices in one launch (one row takes one)",
                segs.len()
            )));
        }
        check_prep(act, cols)?;
        if segs.is_empty() || segs.len() > 3 {
            return Err(CudaError::Arg(format!(
                "{} matrices in one matrix-vector launch (1 to 3)",
                segs.len()
            )));
        }
        Ok(())
    }

    /// The launch of [`Gpu::mvr_multi_ss`] on kernel `id` (a plain `mvr*` / `mvrp_*` form; the
    /// arguments checked by `check_mvr_segs`).
    fn mvr_launch(
        &self,
        id: usize,
        segs: &[(u64, usize, u64)],
        cols: usize,
        act: ActIn,
        accumulate: bool,
        ss: u64,
    ) -> Result<(), CudaError> {
        let mut w = [0u64; 3];
        let mut r = [0i32; 3];
        let mut y = [0u64; 3];
        for (i, &(wi, ri, yi)) in segs.iter().enumerate() {
            w[i] = wi;
            r[i] = i32_of(ri, "rows")?;
            y[i] = yi;
        }
        let total: usize = segs.iter().map(|s| s.1).sum();
        let (c, a, pf) = (i32_of(cols, "cols")?, accumulate as i32, self.mvr_flags());
        let (w0, w1, w2, r0, r1, r2, y0, y1, y2) =
            (w[0], w[1], w[2], r[0], r[1], r[2], y[0], y[1], y[2]);
        let (qs, ds, px, pw, eps) = act.args();
        let nw = self.mvr_block(&act, false);
        let (blocks, loops) = self.mvr_grid(id, total.div_ceil(2 * nw), &act, nw)?;
        self.launch_id(
            id,
            (u32_of(blocks, "rows")?, 1, 1),
            (32 * nw as u32, 1, 1),
            kargs![w0, w1, w2, r0, r1, r2, c, qs, ds, y0, y1, y2, a, pf, px, pw, eps, loops, ss],
        )
    }

    /// One token's `y (+)= W x` on the f32 row `prep` names, normalized (when it has a norm
    /// weight) and quantized inside the launch exactly as [`Gpu::rms_norm`] /
    /// [`Gpu::quantize_act`] would (v7: the output projection quantizes the attention output
    /// itself). Only where [`Gpu::mvr_prep_fits`] `cols`.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_q_prep(
        &self,
        ty: GgmlType,
        w: u64,
        rows: usize,
        cols: usize,
        prep: &ActPrep,
        y: u64,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        self.mvr_multi(ty, &[(w, rows, y)], cols, ActIn::Prep(*prep), accumulate)
    }

    /// `y[t, :] = silu(Wg x[t, :]) * (Wu x[t, :])` with integer dot products (see
    /// [`Gpu::matvec_q`]); both matrices `ty`.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_q_swiglu(
        &self,
        ty: GgmlType,
        wg: u64,
        wu: u64,
        rows: usize,
        cols: usize,
        qs: u64,
        ds: u64,
        nt: usize,
        y: u64,
    ) -> Result<(), CudaError> {
        self.matvec_q_swiglu_quant(ty, wg, wu, rows, cols, qs, ds, nt, y, None)
    }

    /// [`Gpu::matvec_q_swiglu`] for one token that also quantizes its output row `y` for the
    /// next integer product, as [`Gpu::quantize_act`] would (same bytes), inside the same
    /// launch: `quant` = (format, `ceil(rows / 256)` zeroed u32 counters, which the kernel
    /// leaves zeroed, int8 values, scales). Only where [`Gpu::mvr_fits`] `cols`.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_q_swiglu_quant(
        &self,
        ty: GgmlType,
        wg: u64,
        wu: u64,
        rows: usize,
        cols: usize,
        qs: u64,
        ds: u64,
        nt: usize,
        y: u64,
        quant: Option<OutQuant>,
    ) -> Result<(), CudaError> {
        check_cols(ty, cols)?;
        if let Some(OutQuant { fmt: f, .. }) = quant {
            if nt != 1 || !self.mvr_fits(cols) || !rows.is_multiple_of(f.block()) {
                return Err(CudaError::Arg(format!(
                    "fused quantization of a SwiGLU product: {nt} tokens, {rows} rows, {cols} \
                     columns ({f:?}; one token, rows a multiple of {}, mvr kernels)",
                    f.block()
                )));
            }
        }
        if nt == 1 && self.mvr_fits(cols) {
            let act = ActIn::Quantized { qs, ds };
            return self.mvr_swiglu(ty, wg, wu, rows, cols, act, y, quant);
        }
        let k = mvq_id(ty, true, nt)?;
        let (r, c, n) = (i32_of(rows, "rows")?, i32_of(cols, "cols")?, nt as i32);
        self.launch_id(
            k,
            (u32_of(rows, "rows")?, 1, 1),
            (mvq_threads(cols), 1, 1),
            kargs![wg, wu, r, c, qs, ds, n, y],
        )
    }

    /// One token's `y = silu(Wg x) * (Wu x)` on the f32 row `prep` names, normalized and
    /// quantized inside the launch exactly as [`Gpu::rms_norm`] with quantization would (v7: the
    /// FFN's RMSNorm needs no launch). Only where [`Gpu::mvr_prep_fits`] `cols`.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_q_swiglu_prep(
        &self,
        ty: GgmlType,
        wg: u64,
        wu: u64,
        rows: usize,
        cols: usize,
        prep: &ActPrep,
        y: u64,
    ) -> Result<(), CudaError> {
        check_cols(ty, cols)?;
        self.mvr_swiglu(ty, wg, wu, rows, cols, ActIn::Prep(*prep), y, None)
    }

    #[allow(clippy::too_many_arguments)]
    fn mvr_swiglu(
        &self,
        ty: GgmlType,
        wg: u64,
        wu: u64,
        rows: usize,
        cols: usize,
        act: ActIn,
        y: u64,
        quant: Option<OutQuant>,
    ) -> Result<(), CudaError> {
        check_prep(&act, cols)?;
        let (r, c, pf) = (
            i32_of(rows, "rows")?,
            i32_of(cols, "cols")?,
            self.mvr_flags(),
        );
        let (qs, ds, px, pw, eps) = act.args();
        let id = match act {
            ActIn::Prep(_) => {
                self.kernel_id(&format!("mvrp_swiglu_{}", QTYPES[qtype_index(ty)?].1))?
            }
            ActIn::Quantized { .. } => mvr_id(ty, true)?,
        };
        let nw = self.mvr_block(&act, true);
        let (blocks, loops) = self.mvr_grid(id, rows.div_ceil(nw), &act, nw)?;
        let (qf, qc, qq, qd) = OutQuant::args(quant);
        self.launch_id(
            id,
            (u32_of(blocks, "rows")?, 1, 1),
            (32 * nw as u32, 1, 1),
            kargs![wg, wu, r, c, qs, ds, y, pf, qf, qc, qq, qd, px, pw, eps, loops],
        )
    }

    /// One token's `y (+)= W x` over wide rows (the down projection) with the block-wide
    /// kernel (`mvw_*`, v7: each thread one unit of each of 8 rows, then a block reduction), on
    /// activations quantized by [`Gpu::quantize_act`] in `act_format(ty)`.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_q_wide(
        &self,
        ty: GgmlType,
        w: u64,
        rows: usize,
        cols: usize,
        qs: u64,
        ds: u64,
        y: u64,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        self.mvw(ty, w, rows, cols, qs, ds, 0, y, accumulate)
    }

    /// [`Gpu::matvec_q_wide`] on the f32 activation `x`, quantized inside the launch exactly as
    /// [`Gpu::quantize_act`] would (v7: the down projection needs no quantization launch).
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_q_wide_prep(
        &self,
        ty: GgmlType,
        w: u64,
        rows: usize,
        cols: usize,
        x: u64,
        y: u64,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        if x == 0 {
            return Err(CudaError::Arg("wide product: no activation row".into()));
        }
        self.mvw(ty, w, rows, cols, 0, 0, x, y, accumulate)
    }

    /// Whether [`Gpu::matvec_q_wide`] takes rows `cols` wide (at most 16384 columns).
    pub fn mvw_fits(&self, cols: usize) -> bool {
        cols <= MVW_MAX_COLS
    }

    #[allow(clippy::too_many_arguments)]
    fn mvw(
        &self,
        ty: GgmlType,
        w: u64,
        rows: usize,
        cols: usize,
        qs: u64,
        ds: u64,
        x: u64,
        y: u64,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        check_cols(ty, cols)?;
        qtype_index(ty)?;
        if cols > MVW_MAX_COLS {
            return Err(CudaError::Arg(format!(
                "wide product: {cols} columns (at most {MVW_MAX_COLS})"
            )));
        }
        let (r, c, a, pf) = (
            i32_of(rows, "rows")?,
            i32_of(cols, "cols")?,
            accumulate as i32,
            self.pdl.get() as i32,
        );
        let name = format!("mvw_{}", QTYPES[qtype_index(ty)?].1);
        self.launch_id(
            self.kernel_id(&name)?,
            (u32_of(rows.div_ceil(MVW_ROWS), "rows")?, 1, 1),
            (256, 1, 1),
            kargs![w, r, c, qs, ds, x, y, a, pf],
        )
    }

    /// Biases, RoPE and the KV-cache write for `n` tokens (see rope_store in ops.cu).
    #[allow(clippy::too_many_arguments)]
    pub fn rope_store(
        &self,
        n: usize,
        q: u64,
        k: u64,
        v: u64,
        bias: [u64; 3],
        pos: u64,
        slot: u64,
        rope: &RopeParams,
        n_head: usize,
        n_kv: usize,
        hd: usize,
        neox: bool,
        kc: u64,
        vc: u64,
    ) -> Result<(), CudaError> {
        let io = RopeRows {
            q_out: q,
            q_stride: n_head * hd,
            kv_stride: n_kv * hd,
        };
        self.rope_store_rows(
            n, q, k, v, bias, pos, slot, rope, n_head, n_kv, hd, neox, kc, vc, io,
        )
    }

    /// [`Gpu::rope_store`] with Q, K and V read from rows `io` says (v10: one fused Q/K/V
    /// product's rows hold all three) and the rotated Q written densely to `io.q_out`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_store_rows(
        &self,
        n: usize,
        q: u64,
        k: u64,
        v: u64,
        bias: [u64; 3],
        pos: u64,
        slot: u64,
        rope: &RopeParams,
        n_head: usize,
        n_kv: usize,
        hd: usize,
        neox: bool,
        kc: u64,
        vc: u64,
        io: RopeRows,
    ) -> Result<(), CudaError> {
        if rope.n_rot > hd || !rope.n_rot.is_multiple_of(2) || hd > 256 {
            return Err(CudaError::Arg(format!(
                "RoPE over {} of {hd} dimensions (even, <= head size <= 256)",
                rope.n_rot
            )));
        }
        let (nh, nk, h, nx) = (n_head as i32, n_kv as i32, hd as i32, neox as i32);
        let (fac, ts, fs, nr) = (
            rope.factors,
            rope.theta_scale,
            rope.freq_scale,
            rope.n_rot as i32,
        );
        let [bq, bk, bv] = bias;
        if io.q_stride < n_head * hd || io.kv_stride < n_kv * hd {
            return Err(CudaError::Arg(format!(
                "rope_store: row strides {} / {} below the Q / KV widths {} / {}",
                io.q_stride,
                io.kv_stride,
                n_head * hd,
                n_kv * hd
            )));
        }
        let (qo, qs, kvs) = (
            io.q_out,
            i32_of(io.q_stride, "Q row stride")?,
            i32_of(io.kv_stride, "KV row stride")?,
        );
        self.launch_id(
            op(K_ROPE_STORE),
            (u32_of(n, "tokens")?, 1, 1),
            (256, 1, 1),
            kargs![
                q, k, v, bq, bk, bv, pos, slot, fac, ts, fs, nr, nh, nk, h, nx, kc, vc, qo, qs, kvs
            ],
        )
    }

    /// `g = silu(g) * u` over `n` elements.
    pub fn swiglu(&self, g: u64, u: u64, n: usize) -> Result<(), CudaError> {
        let blocks = n.div_ceil(256).min(self.sms as usize * 16) as u32;
        let nn = n as i64;
        self.launch_id(op(K_SWIGLU), (blocks, 1, 1), (256, 1, 1), kargs![g, u, nn])
    }

    /// `g = silu(g) * u` over `rows` rows of `n`, also writing `xh`, the f16 GEMM operand of the
    /// result: `f16(d * q)` of its quantization in `fmt` (as [`Gpu::quantize_act_f16`]), or
    /// plain f16 for `None`.
    pub fn swiglu_f16(
        &self,
        g: u64,
        u: u64,
        rows: usize,
        n: usize,
        fmt: Option<ActFormat>,
        xh: u64,
    ) -> Result<(), CudaError> {
        if let Some(f) = fmt {
            if !n.is_multiple_of(f.block()) {
                return Err(CudaError::Arg(format!(
                    "{n} columns is not a multiple of {} ({f:?} activations)",
                    f.block()
                )));
            }
        }
        let (nn, f) = (i32_of(n, "width")?, fmt.map_or(0, |f| f as i32));
        self.launch_id(
            op(K_SWIGLU_Q),
            (u32_of(rows, "rows")?, u32_of(n.div_ceil(256), "chunks")?, 1),
            (256, 1, 1),
            kargs![g, u, nn, f, xh],
        )
    }

    /// f32 to f16 over `n` elements.
    pub fn to_f16(&self, x: u64, n: usize, out: u64) -> Result<(), CudaError> {
        let blocks = n.div_ceil(256).min(self.sms as usize * 16) as u32;
        let nn = n as i64;
        self.launch_id(
            op(K_TO_F16),
            (blocks, 1, 1),
            (256, 1, 1),
            kargs![x, nn, out],
        )
    }

    /// Index of the largest element of each of `rows` rows of width `n` (i32 per row).
    pub fn argmax_rows(&self, x: u64, n: usize, rows: usize, out: u64) -> Result<(), CudaError> {
        let nn = i32_of(n, "width")?;
        if self.argmax_mb.get() && rows > 0 {
            return self.argmax_many(x, n, rows, out);
        }
        self.launch_id(
            op(K_ARGMAX),
            (u32_of(rows, "rows")?, 1, 1),
            (1024, 1, 1),
            kargs![x, nn, out],
        )
    }

    /// Whether [`Gpu::top_k_rows`] takes rows of `n` logits with `k`: 1 <= k <= [`TOPK_MAX`],
    /// k < n, and the slices' best lists fit one merge ([`TOPK_MERGE_MAX`] keys).
    pub fn top_k_fits(n: usize, k: usize) -> bool {
        (1..=TOPK_MAX).contains(&k)
            && k < n
            && (n.div_ceil(topk_slice(n)) * k).next_power_of_two() <= TOPK_MERGE_MAX
    }

    /// Session 21: the `k` best logits of each of `rows` rows of `n` at `x`, on the GPU
    /// (`topk_slice`, `topk_merge`, decode.cu: keys sorted in shared memory), as
    /// `runtime::sampling::top_k` lists them: `(token, logit)`, descending, the lower id first
    /// among equals, NaN as negative infinity. `rows * k` keys are copied back (waits for the
    /// stream). Only where [`Gpu::top_k_fits`].
    pub fn top_k_rows(
        &self,
        x: u64,
        n: usize,
        rows: usize,
        k: usize,
    ) -> Result<Vec<Vec<(u32, f32)>>, CudaError> {
        if !Self::top_k_fits(n, k) {
            return Err(CudaError::Arg(format!(
                "top-k of rows of {n}: k = {k} (1 to {TOPK_MAX}, below the row length)"
            )));
        }
        if rows == 0 {
            return Ok(Vec::new());
        }
        let slice = topk_slice(n);
        let ns = n.div_ceil(slice);
        let m = (ns * k).next_power_of_two();
        let need = rows * ns * k + rows * k;
        let ws = {
            let mut w = self.topk_ws.borrow_mut();
            if w.as_ref().is_none_or(|w| w.1 < need) {
                *w = Some((self.alloc(need * 8)?, need));
            }
            w.as_ref()
                .map(|w| w.0.ptr())
                .ok_or_else(|| CudaError::Arg("top-k scratch".into()))?
        };
        let out = ws + (rows * ns * k * 8) as u64;
        let (nn, sl, kk, mm, nsi) = (
            i32_of(n, "width")?,
            i32_of(slice, "slice")?,
            i32_of(k, "k")?,
            i32_of(m, "merge keys")?,
            i32_of(ns, "slices")?,
        );
        self.launch_id_smem(
            self.kernel_id("topk_slice")?,
            (ns as u32, u32_of(rows, "rows")?, 1),
            (512, 1, 1),
            u32_of(slice * 8, "slice bytes")?,
            kargs![x, nn, sl, kk, ws],
        )?;
        self.launch_id_smem(
            self.kernel_id("topk_merge")?,
            (u32_of(rows, "rows")?, 1, 1),
            (512, 1, 1),
            u32_of(m * 8, "merge bytes")?,
            kargs![ws, nsi, kk, mm, out],
        )?;
        let mut keys = vec![0u64; rows * k];
        {
            let w = self.topk_ws.borrow();
            let buf = w
                .as_ref()
                .map(|w| &w.0)
                .ok_or_else(|| CudaError::Arg("top-k scratch".into()))?;
            self.read(buf, rows * ns * k * 8, &mut keys)?;
        }
        Ok(keys
            .chunks_exact(k)
            .map(|r| r.iter().map(|&key| topk_key_decode(key)).collect())
            .collect())
    }

    /// [`Gpu::argmax_rows`] with up to 64 blocks per row (`argmax_mb`, v11): each block the
    /// best of its columns, the last block of a row to finish the row's result (the same index:
    /// the largest value, the lowest index among equals, NaN never).
    fn argmax_many(&self, x: u64, n: usize, rows: usize, out: u64) -> Result<(), CudaError> {
        const P_MAX: usize = 64;
        let p = n.div_ceil(2048).clamp(1, P_MAX);
        let per = n.div_ceil(p);
        let (pv, pi, cnt) = {
            let mut ws = self.argmax_ws.borrow_mut();
            if ws.as_ref().is_none_or(|w| w.3 < rows) {
                *ws = Some((
                    self.alloc(rows * P_MAX * 4)?,
                    self.alloc(rows * P_MAX * 4)?,
                    self.alloc_zeroed(rows * 4)?,
                    rows,
                ));
            }
            let w = ws
                .as_ref()
                .ok_or_else(|| CudaError::Arg("argmax scratch".into()))?;
            (w.0.ptr(), w.1.ptr(), w.2.ptr())
        };
        let (nn, pp) = (i32_of(n, "width")?, i32_of(per, "columns per block")?);
        self.launch_id(
            self.kernel_id("argmax_mb")?,
            (u32_of(rows, "rows")?, p as u32, 1),
            (256, 1, 1),
            kargs![x, nn, pp, pv, pi, cnt, out],
        )
    }

    /// Whether [`Gpu::rms_norm1`] takes rows of `n` columns.
    pub fn rms1_fits(n: usize) -> bool {
        n > 0 && n.is_multiple_of(256) && n <= 4096
    }

    /// [`Gpu::rms_norm`] of one row (`rows` = 0, one output row) as one warp per 256-element
    /// group (`rms_norm1`, v11: no block barrier): the same bits. Only where
    /// [`Gpu::rms1_fits`] `n`.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm1(
        &self,
        x: u64,
        w: u64,
        n: usize,
        eps: f32,
        out: u64,
        out_h: u64,
        quant: Option<(ActFormat, u64, u64)>,
    ) -> Result<(), CudaError> {
        if !Self::rms1_fits(n) {
            return Err(CudaError::Arg(format!(
                "rms_norm1: {n} columns (a multiple of 256, at most 4096)"
            )));
        }
        let (fmt, qs, ds) = match quant {
            Some((f, q, d)) => (f as i32, q, d),
            None => (0i32, 0u64, 0u64),
        };
        let nn = i32_of(n, "width")?;
        self.launch_id(
            self.kernel_id("rms_norm1")?,
            (u32_of(n / 256, "groups")?, 1, 1),
            (32, 1, 1),
            kargs![x, w, nn, eps, out, out_h, fmt, qs, ds],
        )
    }

    /// Session 34: [`Gpu::rms_norm_ss`] of one row whose sum of squares is in the slot set `ss`
    /// (non-zero), quantized (`quant`; Q8_K in the permuted layout with `perm`), as
    /// one warp per 256-element group (`rms_norm1s`: no block barrier): the same bits. Zeroes the
    /// slot set `ssz` (may be 0). Only where [`Gpu::rms1_fits`] `n`.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm1s(
        &self,
        x: u64,
        w: u64,
        n: usize,
        eps: f32,
        out: u64,
        quant: (ActFormat, u64, u64),
        ss: u64,
        ssz: u64,
        perm: bool,
    ) -> Result<(), CudaError> {
        if !Self::rms1_fits(n) || ss == 0 {
            return Err(CudaError::Arg(format!(
                "rms_norm1s: {n} columns (a multiple of 256, at most 4096), slot sums at {ss:#x}"
            )));
        }
        let (f, qs, ds) = quant;
        if perm && f != ActFormat::Q8K {
            return Err(CudaError::Arg(format!(
                "rms_norm1s: permuted {f:?} activations (Q8_K only)"
            )));
        }
        let fq = f as i32 | ((perm as i32) << 9);
        let nn = i32_of(n, "width")?;
        self.launch_id(
            self.kernel_id("rms_norm1s")?,
            (u32_of(n / 256, "groups")?, 1, 1),
            (32, 1, 1),
            kargs![x, w, nn, eps, out, fq, qs, ds, ss, ssz],
        )
    }

    /// Split-K attention: partial results of `n_split` context slices of `split_len` positions.
    /// `part` holds `n * n_head * n_split * (hd + 2)` floats.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_partial(
        &self,
        n: usize,
        q: u64,
        kc: u64,
        vc: u64,
        tok_pos: u64,
        tok_seq: u64,
        btab: u64,
        max_blocks: usize,
        block_tokens: usize,
        n_head: usize,
        n_kv: usize,
        hd: usize,
        n_split: usize,
        split_len: usize,
        part: u64,
    ) -> Result<(), CudaError> {
        let d = HEAD_DIMS
            .iter()
            .position(|&h| h == hd)
            .ok_or_else(|| CudaError::Arg(format!("head size {hd} (kernels: 64, 96, 128, 256)")))?;
        if n_kv == 0 || !n_head.is_multiple_of(n_kv) || n_head / n_kv > 8 {
            return Err(CudaError::Arg(format!(
                "{n_head} query heads over {n_kv} KV heads (at most 8 per KV head)"
            )));
        }
        let scale = 1.0f32 / (hd as f32).sqrt();
        let (mb, bt, nh, nk, sl) = (
            i32_of(max_blocks, "max_blocks")?,
            i32_of(block_tokens, "block_tokens")?,
            n_head as i32,
            n_kv as i32,
            i32_of(split_len, "split_len")?,
        );
        self.launch_id(
            op(K_ATTN_PARTIAL + d),
            (
                u32_of(n, "tokens")?,
                n_kv as u32,
                u32_of(n_split, "splits")?,
            ),
            (128, 1, 1),
            kargs![q, kc, vc, tok_pos, tok_seq, btab, mb, bt, nh, nk, scale, sl, part],
        )
    }

    /// Tensor-core attention for one sequence chunk of `t` tokens (step rows `t0..t0+t`) at
    /// positions `p0..p0+t`, whose keys and values, earlier positions included, are in the
    /// paged cache; `btab_row` is that sequence's block table. Writes `out[t0 + i, h*hd + d]`.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_prefill(
        &self,
        q: u64,
        kc: u64,
        vc: u64,
        btab_row: u64,
        block_tokens: usize,
        t0: usize,
        t: usize,
        p0: usize,
        n_head: usize,
        n_kv: usize,
        hd: usize,
        out: u64,
    ) -> Result<(), CudaError> {
        let d = PREFILL_HEAD_DIMS
            .iter()
            .position(|&h| h == hd)
            .ok_or_else(|| CudaError::Arg(format!("head size {hd} (prefill kernels: 64, 128)")))?;
        if n_kv == 0 || !n_head.is_multiple_of(n_kv) {
            return Err(CudaError::Arg(format!(
                "{n_head} query heads over {n_kv} KV heads"
            )));
        }
        if t == 0 {
            return Ok(());
        }
        let scale = 1.0f32 / (hd as f32).sqrt();
        let (bt, t0i, ti, p0i, nh, nk) = (
            i32_of(block_tokens, "block_tokens")?,
            i32_of(t0, "t0")?,
            i32_of(t, "tokens")?,
            i32_of(p0, "p0")?,
            n_head as i32,
            n_kv as i32,
        );
        self.launch_id(
            op(K_ATTN_PREFILL + d),
            (u32_of(t.div_ceil(64), "tiles")?, n_head as u32, 1),
            (128, 1, 1),
            kargs![q, kc, vc, btab_row, bt, t0i, ti, p0i, nh, nk, scale, out],
        )
    }

    /// [`Gpu::attn_partial`] on the tensor cores (head sizes 64 and 128): the query heads that
    /// share a KV head are the rows of one mma tile, so each K/V row is read once for all of
    /// them; same partial-result format, merged by [`Gpu::attn_combine`].
    #[allow(clippy::too_many_arguments)]
    pub fn attn_decode(
        &self,
        n: usize,
        q: u64,
        kc: u64,
        vc: u64,
        tok_pos: u64,
        tok_seq: u64,
        btab: u64,
        max_blocks: usize,
        block_tokens: usize,
        n_head: usize,
        n_kv: usize,
        hd: usize,
        n_split: usize,
        split_len: usize,
        part: u64,
    ) -> Result<(), CudaError> {
        self.attn_decode_merge(
            n,
            q,
            kc,
            vc,
            tok_pos,
            tok_seq,
            btab,
            max_blocks,
            block_tokens,
            n_head,
            n_kv,
            hd,
            n_split,
            split_len,
            part,
            None,
        )
    }

    /// [`Gpu::attn_decode`] that also merges the splits, as [`Gpu::attn_combine`] would (same
    /// bits), inside the same launch: `merge` = (output `[n, n_head * hd]`, `n * n_kv` zeroed
    /// u32 counters, which the kernel leaves zeroed). The last block of each (token, KV head)
    /// to finish does the merge (v7).
    #[allow(clippy::too_many_arguments)]
    pub fn attn_decode_merge(
        &self,
        n: usize,
        q: u64,
        kc: u64,
        vc: u64,
        tok_pos: u64,
        tok_seq: u64,
        btab: u64,
        max_blocks: usize,
        block_tokens: usize,
        n_head: usize,
        n_kv: usize,
        hd: usize,
        n_split: usize,
        split_len: usize,
        part: u64,
        merge: Option<(u64, u64)>,
    ) -> Result<(), CudaError> {
        let (merged, cnt) = merge.unwrap_or((0, 0));
        let d = PREFILL_HEAD_DIMS
            .iter()
            .position(|&h| h == hd)
            .ok_or_else(|| CudaError::Arg(format!("head size {hd} (mma kernels: 64, 128)")))?;
        if n_kv == 0 || !n_head.is_multiple_of(n_kv) || n_head / n_kv > 8 {
            return Err(CudaError::Arg(format!(
                "{n_head} query heads over {n_kv} KV heads (at most 8 per KV head)"
            )));
        }
        let scale = 1.0f32 / (hd as f32).sqrt();
        let (mb, bt, nh, nk, sl) = (
            i32_of(max_blocks, "max_blocks")?,
            i32_of(block_tokens, "block_tokens")?,
            n_head as i32,
            n_kv as i32,
            i32_of(split_len, "split_len")?,
        );
        self.launch_id(
            op(K_ATTN_DECODE + d),
            (
                u32_of(n, "tokens")?,
                n_kv as u32,
                u32_of(n_split, "splits")?,
            ),
            (128, 1, 1),
            kargs![q, kc, vc, tok_pos, tok_seq, btab, mb, bt, nh, nk, scale, sl, part, merged, cnt],
        )
    }

    /// Merge the split results into `out[t, h*hd + d]`: for token `t`, the first
    /// `ceil((tok_pos[t] + 1) / split_len)` of the `n_split` slices.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_combine(
        &self,
        n: usize,
        part: u64,
        tok_pos: u64,
        n_head: usize,
        hd: usize,
        n_split: usize,
        split_len: usize,
        out: u64,
    ) -> Result<(), CudaError> {
        self.attn_combine_q(n, part, tok_pos, n_head, hd, n_split, split_len, out, None)
    }

    /// [`Gpu::attn_combine`]'s merge with the same bits (v8: the loads of up to 64 slices
    /// issued together rather than 8 at a time); at most [`ATTN_MERGE_MAX_SPLIT`] splits.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_merge(
        &self,
        n: usize,
        part: u64,
        tok_pos: u64,
        n_head: usize,
        hd: usize,
        n_split: usize,
        split_len: usize,
        out: u64,
    ) -> Result<(), CudaError> {
        if n_split > ATTN_MERGE_MAX_SPLIT || hd > 256 || !hd.is_multiple_of(32) {
            return Err(CudaError::Arg(format!(
                "attn_merge of {n_split} splits of head size {hd} (at most \
                 {ATTN_MERGE_MAX_SPLIT} splits, head sizes multiples of 32 up to 256)"
            )));
        }
        let (nh, h, ns, sl) = (
            n_head as i32,
            hd as i32,
            i32_of(n_split, "splits")?,
            i32_of(split_len, "split_len")?,
        );
        self.launch_id(
            self.kernel_id("attn_merge")?,
            (u32_of(n, "tokens")?, n_head as u32, 1),
            (hd as u32, 1, 1),
            kargs![part, tok_pos, nh, h, ns, sl, out],
        )
    }

    /// [`Gpu::attn_merge`] (the same output bits) that also quantizes each output row
    /// (`n_head * hd` wide) in `fmt` for the output projection's integer product, as
    /// [`Gpu::quantize_act`] would (the same bytes), in the same launch (v9): a block per 256
    /// outputs, so no counters. Head sizes that divide 256, rows a multiple of 256.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_merge_q(
        &self,
        n: usize,
        part: u64,
        tok_pos: u64,
        n_head: usize,
        hd: usize,
        n_split: usize,
        split_len: usize,
        out: u64,
        fmt: ActFormat,
        qs: u64,
        ds: u64,
    ) -> Result<(), CudaError> {
        if !Self::attn_merge_q_fits(n_head, hd, n_split) {
            return Err(CudaError::Arg(format!(
                "attn_merge_q of {n_split} splits of {n_head} heads of {hd} (at most \
                 {ATTN_MERGE_MAX_SPLIT} splits, head sizes 32..256 dividing 256, rows a \
                 multiple of 256)"
            )));
        }
        let (nh, h, ns, sl, f) = (
            n_head as i32,
            hd as i32,
            i32_of(n_split, "splits")?,
            i32_of(split_len, "split_len")?,
            fmt as i32,
        );
        self.launch_id(
            self.kernel_id("attn_merge_q")?,
            (u32_of(n, "tokens")?, (n_head * hd / 256) as u32, 1),
            (256, 1, 1),
            kargs![part, tok_pos, nh, h, ns, sl, out, f, qs, ds],
        )
    }

    /// Whether [`Gpu::attn_merge_q`] takes `n_head` heads of `hd` merged from `n_split` slices.
    pub fn attn_merge_q_fits(n_head: usize, hd: usize, n_split: usize) -> bool {
        n_split <= ATTN_MERGE_MAX_SPLIT
            && (32..=256).contains(&hd)
            && 256 % hd == 0
            && (n_head * hd).is_multiple_of(256)
    }

    /// [`Gpu::attn_combine`] that also quantizes each output row (`n_head * hd` wide) for the
    /// output projection's integer product, as [`Gpu::quantize_act`] would (same bytes), in
    /// the same launch: `quant` = (format, `n * ceil(n_head * hd / 256)` zeroed u32 counters,
    /// left zeroed, int8 values, scales). Head sizes that divide 256 or are multiples of it.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_combine_q(
        &self,
        n: usize,
        part: u64,
        tok_pos: u64,
        n_head: usize,
        hd: usize,
        n_split: usize,
        split_len: usize,
        out: u64,
        quant: Option<(ActFormat, u64, u64, u64)>,
    ) -> Result<(), CudaError> {
        let (qf, qc, qq, qd) = match quant {
            Some((f, c, q, d)) => {
                let w = n_head * hd;
                if !(256 % hd == 0 || hd.is_multiple_of(256)) || !w.is_multiple_of(f.block()) {
                    return Err(CudaError::Arg(format!(
                        "fused quantization of {n_head} heads of {hd} ({f:?})"
                    )));
                }
                (f as i32, c, q, d)
            }
            None => (0, 0, 0, 0),
        };
        let (nh, h, ns, sl) = (
            n_head as i32,
            hd as i32,
            i32_of(n_split, "splits")?,
            i32_of(split_len, "split_len")?,
        );
        self.launch_id(
            op(K_ATTN_COMBINE),
            (u32_of(n, "tokens")?, n_head as u32, 1),
            (hd as u32, 1, 1),
            kargs![part, tok_pos, nh, h, ns, sl, out, qf, qc, qq, qd],
        )
    }

    /// Streaming-read probe (probe.cu, session 15): read `bytes` (a multiple of 16) at `p` with
    /// probe `name` ([`PROBES`]) over the blocks resident at once, and write the XOR of every
    /// 32-bit word each block read to `out[block]` (returns the block count, so the caller knows
    /// how many words `out` needs). `prefetch`: each block first asks L2 for its range.
    pub fn probe_read(
        &self,
        name: &str,
        p: u64,
        bytes: usize,
        out: u64,
        prefetch: bool,
    ) -> Result<usize, CudaError> {
        if !PROBES.contains(&name) {
            return Err(CudaError::Arg(format!("no read probe {name} ({PROBES:?})")));
        }
        if !bytes.is_multiple_of(16) {
            return Err(CudaError::Arg(format!(
                "{bytes} bytes is not a multiple of 16"
            )));
        }
        let id = self.kernel_id(name)?;
        let n16 = bytes / 16;
        let resident = self.blocks_per_sm(id, 256)? * self.sms as usize;
        // Whole 32-word chunks per block (probe_cp's unit), no empty block.
        let per = n16.div_ceil(resident).div_ceil(32).max(1) * 32;
        let blocks = n16.div_ceil(per).max(1);
        let (n, pb, pf) = (n16 as i64, per as i64, prefetch as i32);
        self.launch_id(
            id,
            (u32_of(blocks, "blocks")?, 1, 1),
            (256, 1, 1),
            kargs![p, n, pb, out, pf],
        )?;
        Ok(blocks)
    }
}

/// The f64 partial sums of squares of a one-token residual row (session 16: written by
/// [`Gpu::matvec_q_ss`], read by [`Gpu::rms_norm_ss`]); `RMS_SLOTS` in common.cu.
pub const RMS_SLOTS: usize = 128;

/// The streaming-read probes of probe.cu ([`Gpu::probe_read`]).
pub const PROBES: &[&str] = &["probe_ld1", "probe_ld4", "probe_ld8", "probe_cp"];

#[cfg(test)]
mod tests {
    use super::*;

    /// The slot count the kernels are compiled with is the one the host allocates.
    #[test]
    fn rms_slots_match_the_kernel_source() {
        let want = format!("#define RMS_SLOTS {RMS_SLOTS}\n");
        assert!(crate::compile::program_source().contains(&want));
        assert!(RMS_SLOTS.is_power_of_two() && RMS_SLOTS.is_multiple_of(32) && RMS_SLOTS <= 256);
    }

    /// The layouts the split-K product kernels rely on (mmf.cu): whole super-blocks per slice
    /// and per chunk, no empty slice, every row and token covered, and the blocks per SM the
    /// kernels are built for within an H100/H200 multiprocessor's 228 KB of shared memory (1 KB
    /// of it reserved per block).
    #[test]
    fn split_k_plans_fit_the_kernels() {
        let shapes = [
            (1024usize, 3072usize),
            (3072, 3072),
            (8192, 3072),
            (3072, 8192),
            (128_256, 3072),
            (70, 2048),
            (301, 512),
            (2048, 8192),
        ];
        for sms in [132usize, 114, 78, 16] {
            for &(rows, cols) in &shapes {
                for n in 9..=64 {
                    let mut plans = vec![(mmk_plan(sms, rows, cols, n), 16usize, 16 / 8)];
                    for w in [4usize, 8] {
                        plans.push((mmf_plan(sms, GgmlType::Q4K, rows, cols, n, w), 32, 8 / w));
                    }
                    for (p, warp_rows, per_sm) in plans {
                        let units = cols / 32;
                        let what = format!("{rows}x{cols} n={n} sms={sms}: {p:?}");
                        assert!(
                            p.per % 8 == 0 && p.chunk % 8 == 0 && p.chunk <= p.per,
                            "{what}"
                        );
                        assert!(p.slices * p.per >= units, "{what}: K not covered");
                        assert!((p.slices - 1) * p.per < units, "{what}: an empty slice");
                        assert!(
                            p.tiles * warp_rows * p.warps >= rows,
                            "{what}: rows not covered"
                        );
                        assert!(8 * p.nt >= n, "{what}: tokens not covered");
                        assert!(
                            per_sm * (p.smem + 1024) <= 228 * 1024 && p.smem <= 227 * 1024,
                            "{what}: {per_sm} blocks do not fit one multiprocessor"
                        );
                    }
                }
            }
        }
    }
}
