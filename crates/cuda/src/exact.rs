//! Exact mode: the CPU backend's forward pass on the GPU, float operation by float operation, so
//! the GPU's logits are the CPU backend's bit for bit (`CROSSOVER_CUDA_EXACT=1`,
//! [`crate::CudaOptions::exact`]).
//!
//! Why: on random-weight models any rounding difference flips near-tied top-1 picks, so two
//! correct engines agree on only ~0.95 of decisive rows (docs/perf/cuda.md); and with the
//! coordinator moving requests between backends by load, a user who needs the same greedy text
//! whichever backend served it can have it. The price is speed: every kernel here computes one
//! output per thread in the CPU's order (crates/cuda/kernels/exact.cu), no tensor cores, no
//! graphs.
//!
//! What the CPU fixes and this mirrors (crates/cpu/src/forward.rs): each layer runs its tokens
//! in slices of at most 64 that never mix summation orders; a product's tokens left over from
//! groups of 4 take Q4_K's gemv order; a one-token chunk's attention takes ggml's
//! `vec_dot_f16` order, a longer chunk's tinyBLAS's; the prompt and decode orders of the
//! 32-element block types come from each chunk ([`order_for`]). The embedding rows are
//! dequantized and the RoPE angles computed on the host with the CPU's own code.
//!
//! The driver ([`forward`]) is written against [`ExactOps`], which the GPU implements with
//! launches and [`host::HostExact`] with the same kernel source compiled for the host
//! (build.rs), so the tests run the whole exact forward pass against the CPU engine without a
//! GPU.

use gguf::GgmlType;
use model::{ModelConfig, Rope, RopeStyle};
use quant::dot::SumOrder;
use runtime::{BackendError, SeqId, Want};

use crate::error::CudaError;
use crate::kernels::ActFormat;

/// Tokens per slice of a layer (the CPU engine's `FFN_TOKENS`).
pub const SLICE_TOKENS: usize = 64;

/// Lanes reserved per (token, head) for `V . p` (the larger of the two orders).
const LANES: usize = 64;

/// The CPU engine's rule for a chunk's product order (`cpu::forward::Model::order_for`): a
/// prompt of at least [`runtime::backend::SHORT_PROMPT`] tokens takes the prompt order, a
/// shorter one and generated tokens the decode order; a chunk that does not say is judged by
/// its length.
pub fn order_for(
    orders: (SumOrder, SumOrder),
    prompt_len: Option<usize>,
    n_tokens: usize,
) -> SumOrder {
    match prompt_len {
        Some(n) if n >= runtime::backend::SHORT_PROMPT => orders.0,
        Some(_) => orders.1,
        None if n_tokens > 1 => orders.0,
        None => orders.1,
    }
}

/// Parse `CROSSOVER_CUDA_EXACT`: unset, empty or `0`: off; `1` or `auto`: the CPU engine's
/// default orders (llama.cpp's for long prompts, whole-block sums for decode); `ggml` or
/// `block`: that order everywhere (as `CROSSOVER_CPU_ORDER` sets the CPU engine's).
pub fn orders_from_env() -> Result<Option<(SumOrder, SumOrder)>, CudaError> {
    let v = match std::env::var("CROSSOVER_CUDA_EXACT") {
        Ok(v) => v,
        Err(_) => return Ok(None),
    };
    let t = v.trim();
    if t.is_empty() || t == "0" {
        return Ok(None);
    }
    if t == "1" || t.eq_ignore_ascii_case("auto") {
        return Ok(Some(AUTO_ORDERS));
    }
    match SumOrder::from_name(t) {
        Some(o) => Ok(Some((o, o))),
        None => Err(CudaError::Arg(format!(
            "CROSSOVER_CUDA_EXACT={v}: expected 0, 1, auto, ggml or block"
        ))),
    }
}

/// The CPU engine's default (prompt, decode) orders (`cpu::AUTO_ORDERS`).
pub const AUTO_ORDERS: (SumOrder, SumOrder) = (SumOrder::Ggml, SumOrder::Block);

/// One weight matrix as the exact kernels read it: GGUF rows at address `w`.
#[derive(Clone, Copy, Debug)]
pub struct ExactMat {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub w: u64,
}

/// One block's tensors (addresses of f32 vectors and [`ExactMat`]s).
#[derive(Clone, Debug)]
pub struct ExactLayer {
    pub attn_norm: u64,
    pub ffn_norm: u64,
    pub wq: ExactMat,
    pub wk: ExactMat,
    pub wv: ExactMat,
    pub wo: ExactMat,
    pub gate: ExactMat,
    pub up: ExactMat,
    pub down: ExactMat,
    pub bq: Option<u64>,
    pub bk: Option<u64>,
    pub bv: Option<u64>,
}

/// A model as the exact forward pass reads it.
#[derive(Clone, Debug)]
pub struct ExactModel {
    pub cfg: ModelConfig,
    pub layers: Vec<ExactLayer>,
    pub output_norm: u64,
    pub output: ExactMat,
    /// The rotation the CPU engine builds from the same numbers.
    pub rope: Rope,
    /// Per layer, the f16 K and V caches: rows of `n_embd_kv` per slot, slot = block *
    /// `block_tokens` + offset.
    pub kc: Vec<u64>,
    pub vc: Vec<u64>,
    pub block_tokens: usize,
    /// (prompt, decode) orders of the 32-element block types.
    pub orders: (SumOrder, SumOrder),
}

/// Why a model cannot run in exact mode (a typed refusal at load, never a silent difference).
pub fn check_model(cfg: &ModelConfig, mats: &[(&str, GgmlType)]) -> Result<(), String> {
    for (name, ty) in mats {
        if ex_type(*ty).is_none() {
            return Err(format!(
                "tensor {name} is {ty}: exact mode mirrors the CPU's quantized products only \
                 (its float-weight products have no fixed order)"
            ));
        }
    }
    if !cfg.n_ff.is_multiple_of(16) {
        return Err(format!(
            "feed-forward width {} is not a multiple of 16 (the CPU's SwiGLU tail takes libm's expf)",
            cfg.n_ff
        ));
    }
    if cfg.n_rot > cfg.head_dim || !cfg.n_rot.is_multiple_of(2) {
        return Err(format!(
            "rotated dimensions {} of a {}-wide head",
            cfg.n_rot, cfg.head_dim
        ));
    }
    Ok(())
}

/// exact.cu's code for a weight type.
fn ex_type(ty: GgmlType) -> Option<i32> {
    use GgmlType::*;
    match ty {
        Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q2K | Q3K | Q4K | Q5K | Q6K => Some(ty as i32),
        _ => None,
    }
}

/// One chunk of a step, as the forward pass needs it.
#[derive(Clone, Debug)]
pub struct ExChunk<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    pub start_pos: usize,
    pub want: Want,
    pub prompt_len: Option<usize>,
    /// The sequence's block table (KV blocks in position order).
    pub blocks: &'a [u32],
}

impl<'a> ExChunk<'a> {
    /// The chunks of `batch`, each with its sequence's block table from `alloc`.
    pub fn of(batch: &'a runtime::StepBatch, alloc: &'a runtime::kv::BlockAllocator) -> Vec<Self> {
        batch
            .chunks
            .iter()
            .map(|c| ExChunk {
                seq: c.seq,
                tokens: &c.tokens,
                start_pos: c.start_pos,
                want: c.want,
                prompt_len: c.prompt_len,
                blocks: alloc.blocks(c.seq),
            })
            .collect()
    }
}

macro_rules! exact_kernels {
    ($( $name:ident / $host:ident ( $($arg:ident : $ty:ty),* ) ;)*) => {
        /// exact.cu's kernels (launched as `ex_<name>`).
        pub const KERNELS: &[&str] = &[$(stringify!($name)),*];

        /// What the exact forward pass runs: exact.cu's kernels over `n` threads (one output
        /// each), the activation quantizer (bit-identical to the CPU's), and memory. Addresses
        /// are device addresses on the GPU and host addresses on the host.
        pub trait ExactOps {
            $(
                #[allow(clippy::too_many_arguments)]
                fn $name(&self, n: usize, $($arg: $ty),*) -> Result<(), CudaError>;
            )*
            /// Quantize `rows` rows of `n` floats at `x` for the integer products: int8
            /// values at `qs`, a float2 per 32 at `ds` (crates/cuda's `quantize_act` layout).
            fn quantize(&self, x: u64, rows: usize, n: usize, fmt: ActFormat, qs: u64, ds: u64)
                -> Result<(), CudaError>;
            /// The f32 embedding rows of `ids`, one after another at `out`.
            fn embed(&self, ids: &[u32], out: u64) -> Result<(), CudaError>;
            /// Buffers of at least `bytes` each, valid until the next `alloc` or drop.
            fn alloc(&mut self, sizes: &[usize]) -> Result<Vec<u64>, CudaError>;
            fn write(&self, dst: u64, data: &[u8]) -> Result<(), CudaError>;
            fn read(&self, src: u64, out: &mut [u8]) -> Result<(), CudaError>;
            fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError>;
        }

        #[cfg(exact_host)]
        mod ffi {
            // The host build of exact.cu (build.rs). Pointer parameters are declared as u64: on
            // the 64-bit targets this builds for, a pointer and a 64-bit integer argument are
            // passed the same way.
            extern "C" {
                $( pub fn $host(n: i64, $($arg: $ty),*); )*
            }
        }

        /// The GPU side: each kernel over `n` threads in blocks of 256.
        impl ExactOps for GpuExact<'_> {
            $(
                fn $name(&self, n: usize, $($arg: $ty),*) -> Result<(), CudaError> {
                    if n == 0 {
                        return Ok(());
                    }
                    let id = self.gpu.kernel_id(concat!("ex_", stringify!($name)))?;
                    let nn = n as i64;
                    let blocks = u32::try_from(n.div_ceil(256))
                        .map_err(|_| CudaError::Arg(format!("{n} threads in one exact launch")))?;
                    self.gpu.launch_id(id, (blocks, 1, 1), (256, 1, 1), crate::kargs![nn, $($arg),*])
                }
            )*
            fn quantize(&self, x: u64, rows: usize, n: usize, fmt: ActFormat, qs: u64, ds: u64)
                -> Result<(), CudaError> {
                self.gpu.quantize_act(x, rows, n, fmt, qs, ds)
            }
            fn embed(&self, ids: &[u32], out: u64) -> Result<(), CudaError> {
                self.embed_rows(ids, out)
            }
            fn alloc(&mut self, sizes: &[usize]) -> Result<Vec<u64>, CudaError> {
                self.bufs.clear();
                for &s in sizes {
                    self.bufs.push(self.gpu.alloc(s.max(8))?);
                }
                Ok(self.bufs.iter().map(|b| b.ptr()).collect())
            }
            fn write(&self, dst: u64, data: &[u8]) -> Result<(), CudaError> {
                self.gpu.write_addr(dst, data)
            }
            fn read(&self, src: u64, out: &mut [u8]) -> Result<(), CudaError> {
                self.gpu.read_addr(src, out)
            }
            fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
                self.gpu.copy_dtod(dst, src, bytes)
            }
        }

        #[cfg(exact_host)]
        impl ExactOps for host::HostExact {
            $(
                fn $name(&self, n: usize, $($arg: $ty),*) -> Result<(), CudaError> {
                    // SAFETY: the driver passes addresses of live buffers (this executor's
                    // allocations, the model's vectors and the mapped file) sized for `n`
                    // threads of the kernel, which is plain C reading and writing them.
                    unsafe { ffi::$host(n as i64, $($arg),*) };
                    Ok(())
                }
            )*
            fn quantize(&self, x: u64, rows: usize, n: usize, fmt: ActFormat, qs: u64, ds: u64)
                -> Result<(), CudaError> {
                self.quantize_rows(x, rows, n, fmt, qs, ds)
            }
            fn embed(&self, ids: &[u32], out: u64) -> Result<(), CudaError> {
                self.embed_rows(ids, out)
            }
            fn alloc(&mut self, sizes: &[usize]) -> Result<Vec<u64>, CudaError> {
                Ok(self.alloc_bufs(sizes))
            }
            fn write(&self, dst: u64, data: &[u8]) -> Result<(), CudaError> {
                // SAFETY: `dst` is a live host buffer of at least `data.len()` bytes (driver).
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst as *mut u8, data.len()) };
                Ok(())
            }
            fn read(&self, src: u64, out: &mut [u8]) -> Result<(), CudaError> {
                // SAFETY: as above.
                unsafe { std::ptr::copy_nonoverlapping(src as *const u8, out.as_mut_ptr(), out.len()) };
                Ok(())
            }
            fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
                // SAFETY: as above; the driver never copies a range onto itself.
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
                Ok(())
            }
        }
    };
}

exact_kernels! {
    mm_int / ex_host_mm_int(ty: i32, order: i32, w: u64, row_bytes: i64, rows: i32, cols: i32, qs: u64, ds: u64, part: u64);
    mm_float / ex_host_mm_float(ty: i32, order: i32, w: u64, row_bytes: i64, rows: i32, cols: i32, ds: u64, tail_from: i32, part: u64, out_stride: i64, out: u64);
    rms_scale / ex_host_rms_scale(x: u64, n_cols: i32, eps: f32, scale: u64);
    rms_apply / ex_host_rms_apply(x: u64, w: u64, scale: u64, n_cols: i32, out: u64);
    add / ex_host_add(x: u64, y: u64, n_y: i64);
    swiglu / ex_host_swiglu(g: u64, u: u64);
    rope / ex_host_rope(x: u64, heads: i32, hd: i32, n_rot: i32, neox: i32, stride: i64, cs: u64);
    store_kv / ex_host_store_kv(k: u64, v: u64, slot: u64, row: i32, kc: u64, vc: u64);
    attn_scores / ex_host_attn_scores(q: u64, kc: u64, tok: u64, btab: u64, max_blocks: i32, bt: i32, n_head: i32, gqa: i32, hd: i32, row: i32, max_len: i32, scale: f32, sc: u64);
    attn_rowmax / ex_host_attn_rowmax(tok: u64, n_head: i32, max_len: i32, sc: u64, rowv: u64);
    attn_exp / ex_host_attn_exp(tok: u64, n_head: i32, max_len: i32, sc: u64, rowv: u64);
    attn_rowsum / ex_host_attn_rowsum(tok: u64, n_head: i32, max_len: i32, sc: u64, rowv: u64);
    attn_scale / ex_host_attn_scale(tok: u64, n_head: i32, max_len: i32, sc: u64, rowv: u64);
    attn_pv / ex_host_attn_pv(sc: u64, vc: u64, tok: u64, btab: u64, max_blocks: i32, bt: i32, n_head: i32, gqa: i32, hd: i32, row: i32, max_len: i32, lanes: u64);
    attn_reduce / ex_host_attn_reduce(lanes: u64, tok: u64, n_head: i32, hd: i32, out: u64);
}

/// The GPU's [`ExactOps`]: launches on `gpu`'s stream, scratch owned here.
pub struct GpuExact<'a> {
    pub gpu: &'a crate::Gpu,
    /// The embedding matrix (GGUF rows on the device) and its type.
    pub embd: (u64, GgmlType, usize),
    pub bufs: Vec<crate::DevBuf>,
}

impl GpuExact<'_> {
    /// Copy each id's GGUF row to the host, dequantize it there with the CPU's code, and write
    /// the f32 rows to `out`.
    fn embed_rows(&self, ids: &[u32], out: u64) -> Result<(), CudaError> {
        let (w, ty, cols) = self.embd;
        let rb = ty.bytes_for(cols as u64).unwrap_or(0) as usize;
        let mut raw = vec![0u8; rb];
        let mut rows = vec![0f32; ids.len() * cols];
        for (&id, dst) in ids.iter().zip(rows.chunks_exact_mut(cols)) {
            self.gpu.read_addr(w + id as u64 * rb as u64, &mut raw)?;
            quant::dequantize_serial(ty, &raw, dst).map_err(|e| CudaError::Arg(e.to_string()))?;
        }
        self.gpu.write_addr(out, as_bytes(&rows))
    }
}

/// The bytes of a slice of plain numbers.
fn as_bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: T is a plain number type (i32, u32, f32); any bit pattern is a valid u8.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// Scratch of the forward pass: addresses and the sizes they were made for.
pub struct ExactBufs {
    max_tokens: usize,
    max_len: usize,
    max_chunks: usize,
    max_blocks: usize,
    a: Vec<u64>,
}

/// Indices into [`ExactBufs::a`].
const B_X: usize = 0;
const B_XN: usize = 1;
const B_Q: usize = 2;
const B_K: usize = 3;
const B_V: usize = 4;
const B_ATT: usize = 5;
const B_O: usize = 6;
const B_G: usize = 7;
const B_U: usize = 8;
const B_AQ: usize = 9;
const B_AD: usize = 10;
const B_SCALE: usize = 11;
const B_CS: usize = 12;
const B_TOK: usize = 13;
const B_SLOT: usize = 14;
const B_BTAB: usize = 15;
const B_SC: usize = 16;
const B_LANES: usize = 17;
const B_HN: usize = 18;
const B_PART: usize = 19;
/// Per (token, head) row of scores: its maximum and 1 / sum (the split softmax, session 28).
const B_ROWV: usize = 20;

/// Bytes of the products' integer scratch (`B_PART`): the rows of one product go through in
/// chunks whose integers fit ([`matmul`]).
pub const PART_BYTES: usize = 64 << 20;

impl ExactBufs {
    /// Scratch for steps of up to `max_tokens` tokens in `max_chunks` chunks, contexts of up to
    /// `max_len` positions in `max_blocks` blocks.
    pub fn new<O: ExactOps>(
        ops: &mut O,
        cfg: &ModelConfig,
        max_tokens: usize,
        max_chunks: usize,
        max_len: usize,
        max_blocks: usize,
    ) -> Result<ExactBufs, CudaError> {
        let (e, hd, nh) = (cfg.n_embd, cfg.head_dim, cfg.n_head);
        let (kvd, ff) = (cfg.n_embd_kv(), cfg.n_ff);
        let s = SLICE_TOKENS.min(max_tokens.max(1));
        let widest = e.max(nh * hd).max(ff);
        let f = 4;
        let sizes = [
            f * max_tokens * e,
            f * s * e,
            f * s * nh * hd,
            f * s * kvd,
            f * s * kvd,
            f * s * nh * hd,
            f * s * e,
            f * s * ff,
            f * s * ff,
            max_tokens.max(s) * widest,
            max_tokens.max(s) * widest / 32 * 8,
            f * max_tokens,
            f * max_tokens * cfg.n_rot,
            f * 4 * max_tokens,
            f * max_tokens,
            f * max_chunks * max_blocks,
            f * s * nh * max_len,
            f * s * nh * LANES * hd,
            f * max_tokens * e,
            PART_BYTES,
            f * 2 * s * nh,
        ];
        let a = ops.alloc(&sizes)?;
        Ok(ExactBufs {
            max_tokens,
            max_len,
            max_chunks,
            max_blocks,
            a,
        })
    }
}

fn i32_of(v: usize, what: &str) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Arg(format!("{what} {v} does not fit an i32")))
}

fn format_of(ty: GgmlType) -> Result<ActFormat, CudaError> {
    crate::kernels::act_format(ty)
        .ok_or_else(|| CudaError::Arg(format!("no exact product for tensor type {ty}")))
}

/// `out = x . m` for `n_tok` token rows at `x` (already quantized into the scratch operands when
/// `quantized` names the same activation and format), Q4_K's tail from `n_tok - n_tok % 4`.
#[allow(clippy::too_many_arguments)]
fn product<O: ExactOps>(
    ops: &O,
    b: &ExactBufs,
    quantized: &mut Option<(u64, ActFormat)>,
    m: &ExactMat,
    x: u64,
    n_tok: usize,
    order: SumOrder,
    out: u64,
) -> Result<(), CudaError> {
    let fmt = format_of(m.ty)?;
    if *quantized != Some((x, fmt)) {
        ops.quantize(x, n_tok, m.cols, fmt, b.a[B_AQ], b.a[B_AD])?;
        *quantized = Some((x, fmt));
    }
    let mm = MatMul {
        ty: m.ty,
        order,
        w: m.w,
        rows: m.rows,
        cols: m.cols,
    };
    matmul(
        ops,
        &mm,
        n_tok,
        b.a[B_AQ],
        b.a[B_AD],
        (b.a[B_PART], PART_BYTES),
        out,
    )
}

/// One matrix as exact.cu's products take it: `rows` rows of `cols` elements of `ty` at `w`
/// (GGUF layout), multiplied in the CPU backend's summation order `order`.
pub struct MatMul {
    pub ty: GgmlType,
    pub order: SumOrder,
    pub w: u64,
    pub rows: usize,
    pub cols: usize,
}

/// Integers per block of `ty` that the first pass stores in `order` (exact.cu's `ex_ints`):
/// Q4_K and Q5_K the scale and min sums of each of 4 sub-block pairs, Q2_K a block's scale
/// and min sums, Q3_K and Q6_K its sum; the 32-element types ggml's 8 lanes, or the block's
/// sum in the block order.
fn ints_per_block(ty: GgmlType, order: SumOrder) -> usize {
    use GgmlType::*;
    match (ty, order) {
        (Q4K | Q5K, _) => 8,
        (Q2K, _) => 2,
        (Q3K | Q6K, _) => 1,
        (_, SumOrder::Ggml) => 8,
        (_, SumOrder::Block) => 1,
    }
}

/// `out[t * m.rows + r] = row r of m . token t` for `n_tok` tokens quantized at (`qs`, `ds`),
/// Q4_K's gemv order from `n_tok - n_tok % 4` on: exact.cu's two passes (the integers of every
/// block in parallel, then the float walk per row) over chunks of rows whose integers fit
/// `part` (an address and its bytes).
pub fn matmul<O: ExactOps>(
    ops: &O,
    m: &MatMul,
    n_tok: usize,
    qs: u64,
    ds: u64,
    (part, part_bytes): (u64, usize),
    out: u64,
) -> Result<(), CudaError> {
    if n_tok == 0 || m.rows == 0 {
        return Ok(());
    }
    let ty = ex_type(m.ty).ok_or_else(|| CudaError::Arg(format!("type {}", m.ty)))?;
    let order = match m.order {
        SumOrder::Ggml => 0,
        SumOrder::Block => 1,
    };
    let row_bytes =
        m.ty.bytes_for(m.cols as u64)
            .ok_or_else(|| CudaError::Arg(format!("{} columns of {}", m.cols, m.ty)))?
            as i64;
    let k = ints_per_block(m.ty, m.order);
    let nb = m.cols / m.ty.block_size();
    let per_row = 4 * k * nb * n_tok;
    let chunk = (part_bytes / per_row.max(1)).min(m.rows);
    if chunk == 0 {
        return Err(CudaError::Arg(format!(
            "{n_tok} tokens of {} columns: one row's integers ({per_row} bytes) exceed the scratch",
            m.cols
        )));
    }
    let tail = i32_of(n_tok - n_tok % 4, "tokens")?;
    let cols = i32_of(m.cols, "columns")?;
    let mut r0 = 0;
    while r0 < m.rows {
        let rows = chunk.min(m.rows - r0);
        let w = m.w + (r0 as u64) * row_bytes as u64;
        let ri = i32_of(rows, "rows")?;
        ops.mm_int(
            n_tok * rows * nb,
            ty,
            order,
            w,
            row_bytes,
            ri,
            cols,
            qs,
            ds,
            part,
        )?;
        ops.mm_float(
            n_tok * rows,
            ty,
            order,
            w,
            row_bytes,
            ri,
            cols,
            ds,
            tail,
            part,
            m.rows as i64,
            out + 4 * r0 as u64,
        )?;
        r0 += rows;
    }
    Ok(())
}

/// `out[r] = rms_norm(x[r]) * w` for `rows` rows of `cols`.
#[allow(clippy::too_many_arguments)]
fn norm<O: ExactOps>(
    ops: &O,
    b: &ExactBufs,
    x: u64,
    w: u64,
    rows: usize,
    cols: usize,
    eps: f32,
    out: u64,
) -> Result<(), CudaError> {
    let c = i32_of(cols, "columns")?;
    ops.rms_scale(rows, x, c, eps, b.a[B_SCALE])?;
    ops.rms_apply(rows * cols, x, w, b.a[B_SCALE], c, out)
}

/// Run `chunks` (KV blocks already allocated for every position) and write the logits rows
/// they want to `logits` (rows of `n_vocab`, in order); returns how many.
/// Layers the forward pass runs: all, unless `CROSSOVER_EXACT_LAYERS=K` (a diagnostic: the
/// first K layers, then the output head, so two executors of exact mode can be compared layer by
/// layer; the logits are then no model's).
fn layer_limit() -> usize {
    std::env::var("CROSSOVER_EXACT_LAYERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(usize::MAX)
}

pub fn forward<O: ExactOps>(
    ops: &O,
    m: &ExactModel,
    b: &ExactBufs,
    chunks: &[ExChunk<'_>],
    logits: u64,
) -> Result<usize, BackendError> {
    let dev = |e: CudaError| BackendError::Device {
        backend: "cuda (exact)".into(),
        msg: e.to_string(),
    };
    let cfg = &m.cfg;
    let (e, hd, nh, nkv) = (cfg.n_embd, cfg.head_dim, cfg.n_head, cfg.n_head_kv);
    let (row, gqa, ff) = (cfg.n_embd_kv(), cfg.n_gqa(), cfg.n_ff);
    let bt = m.block_tokens;
    // Per token: chunk, position, order.
    let mut toks: Vec<(usize, usize, SumOrder)> = Vec::new();
    for (ci, c) in chunks.iter().enumerate() {
        let o = order_for(m.orders, c.prompt_len, c.tokens.len());
        toks.extend((0..c.tokens.len()).map(|i| (ci, c.start_pos + i, o)));
    }
    let n = toks.len();
    if n == 0 {
        return Ok(0);
    }
    let max_len = toks.iter().map(|t| t.1 + 1).max().unwrap_or(0);
    if n > b.max_tokens || chunks.len() > b.max_chunks || max_len > b.max_len {
        return Err(BackendError::BatchTooLarge {
            what: "tokens for the exact scratch",
            got: n,
            max: b.max_tokens,
        });
    }
    // Metadata for the whole step: per token {chunk, length, lanes, 0}, its cache slot, its
    // (cos, sin) pairs; per chunk its block table.
    let mut tok = Vec::with_capacity(4 * n);
    let mut slot = Vec::with_capacity(n);
    let mut cs = Vec::with_capacity(n * cfg.n_rot);
    let mut angles = Vec::new();
    for &(ci, pos, _) in &toks {
        let c = &chunks[ci];
        let blk = c
            .blocks
            .get(pos / bt)
            .copied()
            .ok_or(BackendError::KvFull {
                seq: c.seq,
                needed: 1,
                free: 0,
            })?;
        let lanes = if c.tokens.len() == 1 { 64 } else { 16 };
        tok.extend([ci as i32, (pos + 1) as i32, lanes, 0]);
        slot.push((blk as usize * bt + pos % bt) as i32);
        m.rope.angles(pos, &mut angles);
        for &(co, si) in &angles {
            cs.extend([co, si]);
        }
    }
    let mut btab = vec![0i32; chunks.len() * b.max_blocks];
    for (ci, c) in chunks.iter().enumerate() {
        if c.blocks.len() > b.max_blocks {
            return Err(BackendError::BatchTooLarge {
                what: "KV blocks of one sequence",
                got: c.blocks.len(),
                max: b.max_blocks,
            });
        }
        for (k, &blk) in c.blocks.iter().enumerate() {
            btab[ci * b.max_blocks + k] = blk as i32;
        }
    }
    let a = &b.a;
    ops.write(a[B_TOK], as_bytes(&tok)).map_err(dev)?;
    ops.write(a[B_SLOT], as_bytes(&slot)).map_err(dev)?;
    ops.write(a[B_CS], as_bytes(&cs)).map_err(dev)?;
    ops.write(a[B_BTAB], as_bytes(&btab)).map_err(dev)?;
    let ids: Vec<u32> = chunks
        .iter()
        .flat_map(|c| c.tokens.iter().copied())
        .collect();
    ops.embed(&ids, a[B_X]).map_err(dev)?;

    let run = || -> Result<(), CudaError> {
        let f = 4u64;
        let scale = 1.0 / (hd as f32).sqrt();
        let (hd_i, row_i, mb) = (
            i32_of(hd, "head size")?,
            i32_of(row, "KV row")?,
            i32_of(b.max_blocks, "blocks")?,
        );
        let (nh_i, gqa_i, bt_i) = (
            i32_of(nh, "heads")?,
            i32_of(gqa, "group")?,
            i32_of(bt, "block size")?,
        );
        let neox = i32::from(cfg.rope_style == RopeStyle::Neox);
        let n_rot = i32_of(cfg.n_rot, "rotated dimensions")?;
        for (li, l) in m.layers.iter().enumerate().take(layer_limit()) {
            let mut b0 = 0;
            while b0 < n {
                let order = toks[b0].2;
                let lim = (b0 + SLICE_TOKENS).min(n);
                let b1 = (b0 + 1..lim).find(|&j| toks[j].2 != order).unwrap_or(lim);
                let s = b1 - b0;
                let x = a[B_X] + f * (b0 * e) as u64;
                let (tk, sl, csl) = (
                    a[B_TOK] + f * (4 * b0) as u64,
                    a[B_SLOT] + f * b0 as u64,
                    a[B_CS] + f * (b0 * cfg.n_rot) as u64,
                );
                let mut qz = None;
                norm(ops, b, x, l.attn_norm, s, e, cfg.rms_norm_eps, a[B_XN])?;
                product(ops, b, &mut qz, &l.wq, a[B_XN], s, order, a[B_Q])?;
                product(ops, b, &mut qz, &l.wk, a[B_XN], s, order, a[B_K])?;
                product(ops, b, &mut qz, &l.wv, a[B_XN], s, order, a[B_V])?;
                for (bias, buf, width) in [
                    (l.bq, a[B_Q], nh * hd),
                    (l.bk, a[B_K], row),
                    (l.bv, a[B_V], row),
                ] {
                    if let Some(bb) = bias {
                        ops.add(s * width, buf, bb, width as i64)?;
                    }
                }
                let half = cfg.n_rot / 2;
                ops.rope(
                    s * nh * half,
                    a[B_Q],
                    nh_i,
                    hd_i,
                    n_rot,
                    neox,
                    (nh * hd) as i64,
                    csl,
                )?;
                ops.rope(
                    s * nkv * half,
                    a[B_K],
                    i32_of(nkv, "KV heads")?,
                    hd_i,
                    n_rot,
                    neox,
                    row as i64,
                    csl,
                )?;
                ops.store_kv(s * row, a[B_K], a[B_V], sl, row_i, m.kc[li], m.vc[li])?;
                let ml = (b0..b1).map(|t| toks[t].1 + 1).max().unwrap_or(1);
                let ml_i = i32_of(ml, "context")?;
                ops.attn_scores(
                    s * nh * ml,
                    a[B_Q],
                    m.kc[li],
                    tk,
                    a[B_BTAB],
                    mb,
                    bt_i,
                    nh_i,
                    gqa_i,
                    hd_i,
                    row_i,
                    ml_i,
                    scale,
                    a[B_SC],
                )?;
                // ggml's softmax of each row in four launches (session 28; one thread walking
                // the row took 12 % of a GPU decode step): the maximum, every exp in
                // parallel, the f64 sum of the 16-wide trees in order, the scaling.
                let rv = a[B_ROWV];
                ops.attn_rowmax(s * nh, tk, nh_i, ml_i, a[B_SC], rv)?;
                ops.attn_exp(s * nh * ml, tk, nh_i, ml_i, a[B_SC], rv)?;
                ops.attn_rowsum(s * nh, tk, nh_i, ml_i, a[B_SC], rv)?;
                ops.attn_scale(s * nh * ml, tk, nh_i, ml_i, a[B_SC], rv)?;
                ops.attn_pv(
                    s * nh * LANES * hd,
                    a[B_SC],
                    m.vc[li],
                    tk,
                    a[B_BTAB],
                    mb,
                    bt_i,
                    nh_i,
                    gqa_i,
                    hd_i,
                    row_i,
                    ml_i,
                    a[B_LANES],
                )?;
                ops.attn_reduce(s * nh * hd, a[B_LANES], tk, nh_i, hd_i, a[B_ATT])?;
                product(ops, b, &mut qz, &l.wo, a[B_ATT], s, order, a[B_O])?;
                ops.add(s * e, x, a[B_O], (s * e) as i64)?;
                norm(ops, b, x, l.ffn_norm, s, e, cfg.rms_norm_eps, a[B_XN])?;
                product(ops, b, &mut qz, &l.gate, a[B_XN], s, order, a[B_G])?;
                product(ops, b, &mut qz, &l.up, a[B_XN], s, order, a[B_U])?;
                ops.swiglu(s * ff, a[B_G], a[B_U])?;
                product(ops, b, &mut qz, &l.down, a[B_G], s, order, a[B_O])?;
                ops.add(s * e, x, a[B_O], (s * e) as i64)?;
                b0 = b1;
            }
        }
        Ok(())
    };
    run().map_err(dev)?;

    // The wanted rows: final norm, then the output head per run of rows of one order.
    let mut sel = Vec::new();
    let mut idx = 0;
    for c in chunks {
        for ti in 0..c.tokens.len() {
            let w = match c.want {
                Want::All => true,
                Want::Last => ti + 1 == c.tokens.len(),
                Want::None => false,
            };
            if w {
                sel.push(idx);
            }
            idx += 1;
        }
    }
    let head = || -> Result<(), CudaError> {
        let f = 4u64;
        for (r, &i) in sel.iter().enumerate() {
            ops.copy(
                a[B_HN] + f * (r * e) as u64,
                a[B_X] + f * (i * e) as u64,
                4 * e,
            )?;
        }
        norm(
            ops,
            b,
            a[B_HN],
            m.output_norm,
            sel.len(),
            e,
            cfg.rms_norm_eps,
            a[B_HN],
        )?;
        let nv = m.output.rows;
        let mut r0 = 0;
        while r0 < sel.len() {
            let order = toks[sel[r0]].2;
            let r1 = (r0 + 1..sel.len())
                .find(|&r| toks[sel[r]].2 != order)
                .unwrap_or(sel.len());
            let mut qz = None;
            product(
                ops,
                b,
                &mut qz,
                &m.output,
                a[B_HN] + f * (r0 * e) as u64,
                r1 - r0,
                order,
                logits + f * (r0 * nv) as u64,
            )?;
            r0 = r1;
        }
        Ok(())
    };
    head().map_err(dev)?;
    Ok(sel.len())
}

#[cfg(exact_host)]
pub mod host;
