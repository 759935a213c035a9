//! The CUDA backend: a Llama-family forward pass over a paged f16 KV cache, on one GPU.
//!
//! Decode steps (one new token per sequence, up to 64 sequences) are replayed from CUDA graphs
//! captured per batch-size bucket (1, 2, 4, 8, 16, 24, 32, 48, 64): up to 8 sequences on the fused
//! dequantize+matvec kernels, more on cuBLAS GEMMs over f16 copies of the weights (or the
//! tensor-core integer GEMM, opt-in) and the pipelined many-sequence attention; every per-step
//! value those graphs read (token ids, positions, cache slots, block tables) lives in device
//! buffers refreshed before each replay. Prompt steps run eagerly with cuBLAS.

use std::path::Path;
use std::sync::Arc;

use gguf::{GgmlType, GgufFile, TensorInfo};
use model::{ModelConfig, ModelWeights, RopeStyle};
use runtime::kv::BlockAllocator;
use runtime::{
    Backend, BackendError, BackendInfo, KvStats, OpDesc, SeqId, StepBatch, StepOutput, Support,
    Want,
};

use crate::device::{DevBuf, Gpu};
use crate::error::CudaError;
use crate::exact;
use crate::host::{HostExec, HostMat, HostPlan};
use crate::kernels::{self, matrix_bytes, ActFormat, RopeParams, MMQ_MAX_N, MV_MAX_NT};

/// How f16 weight copies for the GEMM (prefill) path are kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmWeights {
    /// Every matrix also kept as f16 (fastest prefill; 2 bytes per weight of extra memory).
    Cached,
    /// Dequantized into one scratch buffer right before each GEMM.
    OnTheFly,
    /// Decide at load: cached when the copies take under half the free memory.
    Auto,
}

/// How to set up the CUDA backend.
#[derive(Clone, Debug)]
pub struct CudaOptions {
    /// Device index.
    pub device: usize,
    /// Most tokens one sequence may hold.
    pub ctx_size: usize,
    /// Sequences live at once (KV pool = ctx_size * max_seqs tokens).
    pub max_seqs: usize,
    /// Tokens per KV block.
    pub block_tokens: usize,
    /// Most tokens in one step.
    pub max_batch_tokens: usize,
    /// Replay decode steps from CUDA graphs (eager launches when false or when capture fails).
    pub graphs: bool,
    /// f16 weight copies for the GEMM path.
    pub gemm_weights: GemmWeights,
    /// Steps with more tokens than this use cuBLAS GEMMs (when present); smaller ones the fused
    /// matrix-vector kernels.
    pub gemm_min_tokens: usize,
    /// Matmuls run on the host instead (layer placement, or the missing-kernel test double).
    pub host: HostPlan,
    /// Exact mode ([`crate::exact`]): the CPU backend's forward pass op by op, logits bit for
    /// bit the CPU's, with these (prompt, decode) orders of the 32-element block types (the CPU
    /// backend's `prompt_order`/`decode_order`). `None`: `CROSSOVER_CUDA_EXACT` decides (off
    /// when unset).
    pub exact: Option<(quant::dot::SumOrder, quant::dot::SumOrder)>,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            device: 0,
            ctx_size: 4096,
            max_seqs: 8,
            block_tokens: 32,
            max_batch_tokens: 512,
            graphs: true,
            gemm_weights: GemmWeights::Auto,
            gemm_min_tokens: MV_MAX_NT,
            host: HostPlan::default(),
            exact: None,
        }
    }
}

struct Mat {
    name: String,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    q: DevBuf,
    f16: Option<DevBuf>,
    /// The f16 copy's address inside a layer's fused copy (v10: `Layer::qkv16`, `Layer::gu16`);
    /// 0 when the copy is `f16` or there is none.
    f16_at: u64,
    /// Multiplied on the host (`q` is then an empty placeholder unless the embedding lookup
    /// needs it).
    host: Option<HostMat>,
    /// Session 18: the 16-byte aligned copy of a Q6_K output head or down projection that
    /// one-token products read ([`Gpu::pad_q6k`], [`Gpu::q6a`]); the same values.
    q6a: Option<DevBuf>,
    /// Session 32: the blocks per slot that copy was made with ([`Gpu::q6a_group`]); the
    /// products read it only while the `Gpu` still launches that layout for these columns.
    q6a_group: usize,
}

impl Mat {
    /// Address of the f16 copy, wherever it lives.
    fn f16_ptr(&self) -> Option<u64> {
        match &self.f16 {
            Some(b) => Some(b.ptr()),
            None => (self.f16_at != 0).then_some(self.f16_at),
        }
    }
}

struct Layer {
    attn_norm: DevBuf,
    ffn_norm: DevBuf,
    wq: Mat,
    wk: Mat,
    wv: Mat,
    wo: Mat,
    bq: Option<DevBuf>,
    bk: Option<DevBuf>,
    bv: Option<DevBuf>,
    gate: Mat,
    up: Mat,
    down: Mat,
    /// v10: the f16 copies of Q, K and V as one `[Wq; Wk; Wv]` matrix (each matrix's copy is
    /// its rows), so a batched step's three products are one GEMM.
    qkv16: Option<DevBuf>,
    /// v10: gate and up as one `[Wgate; Wup]` f16 matrix.
    gu16: Option<DevBuf>,
}

/// The slot sets of [`Scratch::ss`].
const SS_ATTN: usize = 0;
const SS_FFN: usize = 1;

struct Scratch {
    x: DevBuf,
    xn: DevBuf,
    xh: DevBuf,
    /// Quantized activations for the integer matrix-vector kernels: int8 values and scales.
    aq: DevBuf,
    ad: DevBuf,
    /// Scales and sums of the raw operand in `xh` (the Q4_K tensor-core products', session 10).
    rd: DevBuf,
    /// A second pair, written by the SwiGLU product while it still reads the first.
    aq2: DevBuf,
    ad2: DevBuf,
    /// Zeroed group counters of the kernels that quantize their own output (every kernel leaves
    /// them zeroed).
    qcnt: DevBuf,
    /// Zeroed per-(token, KV head) counters of the split attention that merges its own slices
    /// (the kernel leaves them zeroed).
    acnt: DevBuf,
    /// Session 16: two sets of [`kernels::RMS_SLOTS`] f64 partial sums of squares of the
    /// one-token residual row: [`SS_ATTN`] filled by the down projection for the next attention
    /// norm, [`SS_FFN`] by the output projection for the FFN norm; each norm zeroes the other.
    ss: DevBuf,
    q: DevBuf,
    k: DevBuf,
    v: DevBuf,
    att: DevBuf,
    g: DevBuf,
    u: DevBuf,
    /// Outputs of the fused Q/K/V and gate/up products of batched steps (v10): rows of
    /// `qd + 2 kvd` and `2 ff` floats for up to 64 tokens.
    qkv: DevBuf,
    gu: DevBuf,
    part: DevBuf,
    hn: DevBuf,
    logits: DevBuf,
    argmax: DevBuf,
    wf16: Option<DevBuf>,
    /// Partial sums and zeroed row-tile counters of the split-K f16 products on quantized
    /// weights ([`Gpu::matmul_f16w`]).
    mmf_ws: DevBuf,
    mmf_cnt: DevBuf,
    host: std::cell::RefCell<HostExec>,
    /// A step's metadata in one buffer, one host-to-device copy per step (session 18; was six
    /// copies): token ids, positions, cache slots, sequence rows and wanted rows (`n` each at
    /// most), then the block tables. Where each part starts depends on the step's padded token
    /// count ([`MetaPtrs::layout`]), so a captured graph keeps its bucket's layout.
    meta: DevBuf,
}

/// Session 30: where one-token steps ask L2 for the next layer's cached K and V rows
/// ([`Gpu::kv_prefetch`]), meant to let the attention read them from L2 with the DRAM time paid
/// under the products before it. Measured slower in every form (the products keep HBM busy
/// while they stream; docs/perf/cuda.md "Session 30"), so off by default.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct KvPf {
    /// 0: off; 1: before the down projection of the layer before; 2: before its gate/up
    /// product.
    pub at: u8,
    /// Mark the lines L2::evict_last.
    pub evict_last: bool,
    /// Only graphs (or eager steps) whose context class reaches this many positions.
    pub min_len: usize,
    /// Prefetch blocks of 32 threads (0: 64).
    pub blocks: usize,
}

impl KvPf {
    /// `M[:MIN[:BLOCKS]]`: M = place (0, 1, 2) plus 4 for evict_last; MIN positions (default
    /// 1024); BLOCKS (default 64).
    pub fn parse(v: &str) -> Option<KvPf> {
        let mut it = v.split(':');
        let m: u8 = it.next()?.trim().parse().ok()?;
        let min_len = it.next().map_or(Some(1024), |x| x.trim().parse().ok())?;
        let blocks = it.next().map_or(Some(64), |x| x.trim().parse().ok())?;
        (m & 3 <= 2 && m < 8).then_some(KvPf {
            at: m & 3,
            evict_last: m & 4 != 0,
            min_len,
            blocks,
        })
    }
}

/// Device addresses of one step's metadata arrays inside [`Scratch::meta`].
#[derive(Clone, Copy, Debug, Default)]
struct MetaPtrs {
    ids: u64,
    pos: u64,
    slot: u64,
    seq: u64,
    out_rows: u64,
    btab: u64,
}

impl MetaPtrs {
    /// The arrays of a step of `p` (padded) tokens: five runs of `p` i32, then the block tables.
    fn layout(base: u64, p: usize) -> Self {
        let r = 4 * p as u64;
        MetaPtrs {
            ids: base,
            pos: base + r,
            slot: base + 2 * r,
            seq: base + 3 * r,
            out_rows: base + 4 * r,
            btab: base + 5 * r,
        }
    }
}

/// Which activation the scratch operands hold now (the buffer they were made from, and how), so
/// one conversion serves every matrix that reads the same activation; reset whenever that
/// buffer is rewritten.
#[derive(Clone, Copy, Default)]
struct Acts {
    /// `aq`/`ad`: quantized for the integer matrix-vector kernels.
    q: Option<(u64, ActFormat)>,
    /// `xh`: the f16 GEMM operand, quantize-dequantized in the given format (None: plain f16),
    /// or (`true`) the quantized values themselves with their scales in `rd`.
    h: Option<(u64, Option<ActFormat>, bool)>,
}

impl Scratch {
    /// Whether the split-K workspace and counters hold what a product laid out by `p` over
    /// `rows` rows and `n` tokens needs (head-sized matrices run unsplit).
    fn fits_plan(&self, p: &kernels::MmfPlan, rows: usize, n: usize) -> bool {
        p.ws_floats(rows, n) * 4 <= self.mmf_ws.bytes()
            && (p.slices == 1 || p.tiles * 4 <= self.mmf_cnt.bytes())
    }
}

/// Host copies of one step's metadata.
#[derive(Default)]
struct Meta {
    ids: Vec<i32>,
    pos: Vec<i32>,
    slot: Vec<i32>,
    seq: Vec<i32>,
    out_rows: Vec<i32>,
    btab: Vec<i32>,
    /// The arrays above laid out as [`MetaPtrs::layout`] places them, for the one copy.
    packed: Vec<i32>,
    /// Per chunk: first step row, tokens, first position (its block table is row `i` of `btab`).
    chunks: Vec<(usize, usize, usize)>,
}

/// A hook that sees (and may replace) intermediate tensors of eager steps, named as the CPU
/// backend's trace names them (`cpu::TraceFn`): `(name, layer, occurrence, data)`, token-major.
/// Points: `attn_norm`, `Qcur`#0/`Kcur`#0/`Vcur`#0 (after the products, before bias and RoPE),
/// `Qcur`#2 (after RoPE), `kqv_out`, `ffn_inp`, `ffn_norm`, `ffn_swiglu`, `l_out`. Data the hook
/// writes goes back to the device and the step continues from it, so one op can be checked on
/// exactly the CPU's input (crates/cuda/examples/cuda_trace.rs).
pub type TraceFn = dyn FnMut(&str, usize, usize, &mut [f32]) + Send;

/// One captured decode graph: batch bucket and attention split it was captured with.
struct Graph {
    bucket: usize,
    /// One-token graphs: the attention splits they were captured with
    /// ([`CudaBackend::one_split`]); 0 for the others.
    split: usize,
    graph: cudarc::driver::CudaGraph,
}

/// One row of [`CudaBackend::bench_roofline`]: (probe, prefetch, bytes per launch, launches,
/// microseconds per launch).
pub type RooflineRow = (String, bool, usize, usize, f64);

/// v10's one-token product choices (the [`Gpu`] switches of the same names), for A/B runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeV10 {
    /// [`Gpu::wave`]: `mvr` launches as one wave, L2 prefetch ahead.
    pub wave: bool,
    /// [`Gpu::q6_half`]: Q6_K products by half super-blocks.
    pub q6_half: bool,
    /// [`Gpu::warp_rows`]: wide rows (down) one warp per row.
    pub warp_rows: bool,
    /// [`Gpu::mvr_lb4`]: plain and Q/K/V `mvr` kernels at most 64 registers.
    pub mvr_lb4: bool,
    /// [`Gpu::mvq_pf`]: block-per-row products ask L2 for their row before their wait.
    pub mvq_pf: bool,
}

/// The CUDA backend. Lives on one actor thread.
pub struct CudaBackend {
    graphs: Vec<Graph>,
    graph_failed: Option<String>,
    /// Why capturing a decode step of more than 8 sequences failed, if it did (such steps then
    /// launch eagerly; the narrow buckets keep their graphs).
    wide_graph_failed: Option<String>,
    s: Scratch,
    kc: Vec<DevBuf>,
    vc: Vec<DevBuf>,
    layers: Vec<Layer>,
    embd: Mat,
    output: Option<Mat>,
    output_norm: DevBuf,
    rope: RopeParams,
    _rope_factors: Option<DevBuf>,
    alloc: BlockAllocator,
    cfg: ModelConfig,
    opts: CudaOptions,
    info: BackendInfo,
    max_blocks: usize,
    n_blocks: usize,
    max_split: usize,
    meta: Meta,
    /// Where the last uploaded step's metadata lies in [`Scratch::meta`].
    mp: MetaPtrs,
    /// Session 18 A/B (`cuda_bench --ab-host`): the metadata as six copies, one per array.
    meta_copies: bool,
    /// The (bucket, split) of the graph the last replayed step took ([`Self::replay_last`]).
    last_graph: Option<(usize, usize)>,
    /// [`Self::decode_greedy`] queues its steps back to back (`CROSSOVER_CUDA_CHAIN=0`: one at
    /// a time, each waiting for its pick).
    chain: bool,
    /// The picks of [`Self::decode_greedy`]'s steps, step after step.
    chain_picks: Option<DevBuf>,
    /// Graph replays and eager steps so far (for reports).
    pub stats: StepStats,
    /// GPU memory taken at load (free before minus free after).
    mem_loaded: u64,
    /// Debugging hook (see [`TraceFn`]); `None` in normal use. Set, it turns graph replay off.
    trace: Option<Box<TraceFn>>,
    /// Prompt-sized steps take the tensor-core attention ([`Gpu::attn_prefill`]) where the head
    /// size has one (`CROSSOVER_CUDA_PREFILL_MMA=0` turns it off).
    prefill_mma: bool,
    /// Other steps take the tensor-core split-K attention ([`Gpu::attn_decode`]) where the head
    /// size has one (`CROSSOVER_CUDA_DECODE_MMA=0` turns it off).
    decode_mma: bool,
    /// Steps of more than 8 tokens that are not prompt-sized take the pipelined many-sequence
    /// attention ([`Gpu::attn_batch`], v7; `CROSSOVER_CUDA_ATTN_BATCH=0` turns it off).
    batch_attn: bool,
    /// Blocks per SM that attention aims for (its split count) in those steps:
    /// `CROSSOVER_CUDA_AB_CTAS`, default 3 (session 11: the warp-private form holds 3 blocks
    /// per SM, so one wave; v7's 8 gave x16 9 splits of about one tile each: 3.256 against
    /// 3.125 ms per step on the H200, x64 the same).
    ab_ctas: usize,
    /// Those steps' attention merges its slices itself ([`Gpu::attn_batch_merge`], v9: no
    /// [`Gpu::attn_combine`] launch, same bits): `CROSSOVER_CUDA_AB_MERGE=1` (off by default:
    /// no faster on the H200, docs/perf/cuda.md v9).
    ab_merge: bool,
    /// One-token steps take the pipelined split attention ([`Gpu::attn_one`], v8) over about
    /// this many blocks per SM (0: v7's one-tile [`Gpu::attn_decode`]):
    /// `CROSSOVER_CUDA_ATTN_ONE`, default 2.
    one_attn: usize,
    /// Session 17: one-token steps size their attention splits to the context (a power of two
    /// of 64-position tiles, at most [`CudaBackend::one_attn`]'s count), each class of lengths
    /// with its own graph, instead of always that count: on unless
    /// `CROSSOVER_CUDA_ONE_ADAPT=0`.
    one_adapt: bool,
    /// Session 26/27: contexts up to this many 64-position tiles take one split in those sizes
    /// (which writes the merged rows itself: no merge launch); longer ones keep one tile per
    /// split: `CROSSOVER_CUDA_ONE_TILES`, default 2 (on an H100 tg128 at depth 0 took
    /// 1.365-1.374 ms against 1.383-1.389 with 1, depths 256 and 4096 unchanged;
    /// docs/perf/cuda.md session 27).
    one_tiles: usize,
    /// The longest context the next one-token step's splits are sized for (set per step).
    one_len: usize,
    /// One-token steps merge the splits with [`Gpu::attn_merge`] (v8; same bits as
    /// [`Gpu::attn_combine`], its loads issued together): off with `CROSSOVER_CUDA_ATTN_MERGE=0`.
    one_merge: bool,
    /// One-token steps merge the attention slices and quantize the output projection's
    /// activation in one launch ([`Gpu::attn_merge_q`], v9): on unless `CROSSOVER_CUDA_MERGE_Q=0`
    /// (v9 measured it no faster; session 16, with the RMSNorm slots, -0.01 to -0.017 ms per
    /// token at depth 4096 and unchanged at 0 in two calls, docs/perf/cuda.md session 16).
    one_merge_q: bool,
    /// One-token Q/K/V launches take a V of another type in the same launch
    /// ([`Gpu::matvec_q_qkv_rope_mixed`], v9): on unless `CROSSOVER_CUDA_QKV_MIXED=0`.
    qkv_mixed: bool,
    /// That attention issues its first tiles' copies before the Q/K/V kernel ends
    /// ([`Gpu::attn_one`]; else [`Gpu::attn_batch`]): off with `CROSSOVER_CUDA_ATTN_EARLY=0`.
    one_early: bool,
    /// Session 18: one-token steps whose attention is one split (a context of one 64-position
    /// tile) write the merged rows from the attention launch and quantize them for the output
    /// projection with `quantize_act` instead of `attn_merge_q` (the same bits): on unless
    /// `CROSSOVER_CUDA_ONE_DIRECT=0`.
    one_direct: bool,
    /// Session 18: with [`Self::rms_ss`], the down projection of the default one-token path
    /// also adds the squares of the row it writes, so the next attention norm takes its sum
    /// from the slots: on unless `CROSSOVER_CUDA_DOWN_SS=0`.
    down_ss: bool,
    /// One-token steps take each RMSNorm's sum of squares from partial sums the products that
    /// wrote the row added up (session 16, [`Gpu::rms_norm_ss`]): on unless
    /// `CROSSOVER_CUDA_RMS_SS=0`. The output projection always adds them (the FFN norm); the
    /// down projection only on the [`Gpu::fuse_quant`] path, so by default the attention norm
    /// sums its row.
    rms_ss: bool,
    /// Batched steps (9..64 tokens on cuBLAS) multiply Q/K/V and gate/up as one GEMM each on
    /// the fused copies (v10): on unless `CROSSOVER_CUDA_FUSE_GEMM=0`.
    fuse_gemm: bool,
    /// Those steps merge the attention slices with [`Gpu::attn_merge`] (same bits as
    /// [`Gpu::attn_combine`]): off unless `CROSSOVER_CUDA_AB_FASTMERGE=1`.
    ab_fast_merge: bool,
    /// Session 11: which steps ask L2 for weights from the side stream ([`SIDE_ONE`],
    /// [`SIDE_WIDE`] bits; `CROSSOVER_CUDA_SIDE_L2`).
    side_l2: u8,
    /// Session 30: one-token steps ask L2 for the next layer's cached K and V rows from the
    /// main chain ([`Gpu::kv_prefetch`]) when their context class is at least
    /// [`KvPf::min_len`] positions (`CROSSOVER_CUDA_KV_PF=M[:MIN[:BLOCKS]]`; off).
    kv_pf: KvPf,
    /// Graph buckets whose product shapes [`CudaBackend::tune_products`] tuned, with the
    /// product form (fused or not) it tuned them for.
    tuned: Vec<(usize, bool)>,
    /// Why tuning the batched products at load failed, if it did (cuBLASLt is then left off
    /// and the products run on `cublasGemmEx`, as before v10).
    lt_failed: Option<String>,
    /// Exact mode ([`CudaOptions::exact`]): every step runs [`exact::forward`].
    exact: Option<ExactState>,
    gpu: Gpu,
}

/// Exact mode's model view and scratch (made at the first exact step).
struct ExactState {
    model: exact::ExactModel,
    bufs: Option<exact::ExactBufs>,
    /// The scratch allocations (lent to [`exact::GpuExact`] for each step).
    store: Vec<DevBuf>,
}

/// Counters of how steps ran.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepStats {
    pub graph_steps: u64,
    pub eager_steps: u64,
    pub gemm_calls: u64,
    /// Captures broken by other work on the device (those steps ran eagerly; the next step
    /// captured again).
    pub captures_invalidated: u64,
}

fn model_err(path: &str, why: impl Into<String>) -> CudaError {
    CudaError::Model {
        path: path.to_string(),
        why: why.into(),
    }
}

fn vector(gpu: &Gpu, file: &GgufFile, info: &TensorInfo) -> Result<DevBuf, CudaError> {
    let n = info.n_elements() as usize;
    let v = quant::dequantize_to_vec(info.ty, file.tensor_data(info), n)
        .map_err(|e| model_err(&info.name, e.to_string()))?;
    gpu.upload(&v)
}

fn upload_mat(gpu: &Gpu, file: &GgufFile, info: &TensorInfo) -> Result<Mat, CudaError> {
    let cols = info.dims.first().copied().unwrap_or(0) as usize;
    let rows = info.dims.iter().skip(1).product::<u64>() as usize;
    if !kernels::supports(info.ty) {
        return Err(model_err(
            &info.name,
            format!("type {} has no GPU kernel", info.ty),
        ));
    }
    let be = info.ty.block_size().max(32);
    if !cols.is_multiple_of(be) {
        return Err(model_err(
            &info.name,
            format!("{cols} columns is not a multiple of {be}"),
        ));
    }
    let data = file.tensor_data(info);
    if data.len() != matrix_bytes(info.ty, rows, cols) {
        return Err(model_err(
            &info.name,
            format!("{} bytes of data for {rows}x{cols} {}", data.len(), info.ty),
        ));
    }
    Ok(Mat {
        name: info.name.clone(),
        ty: info.ty,
        rows,
        cols,
        q: gpu.upload(data)?,
        f16: None,
        f16_at: 0,
        host: None,
        q6a: None,
        q6a_group: 0,
    })
}

/// A matrix where `plan` puts it: uploaded, or left in host memory.
fn placed_mat(
    gpu: &Gpu,
    file: &Arc<GgufFile>,
    info: &TensorInfo,
    plan: &HostPlan,
    layer: Option<usize>,
) -> Result<Mat, CudaError> {
    if plan.host_reason(layer, info.ty).is_none() {
        return upload_mat(gpu, file, info);
    }
    let h = HostMat::new(file, info)?;
    Ok(Mat {
        name: info.name.clone(),
        ty: info.ty,
        rows: h.rows,
        cols: h.cols,
        q: gpu.alloc(0)?,
        f16: None,
        f16_at: 0,
        host: Some(h),
        q6a: None,
        q6a_group: 0,
    })
}

fn dev(e: CudaError) -> BackendError {
    BackendError::Device {
        backend: "cuda".into(),
        msg: e.to_string(),
    }
}

impl CudaBackend {
    /// Open a GGUF file and load it onto the GPU.
    pub fn load(path: impl AsRef<Path>, opts: &CudaOptions) -> Result<CudaBackend, CudaError> {
        let p = path.as_ref().display().to_string();
        let file = GgufFile::open(path.as_ref()).map_err(|source| CudaError::Open {
            path: p.clone(),
            source,
        })?;
        Self::from_file(Arc::new(file), &p, opts)
    }

    /// Load an already opened file.
    pub fn from_file(
        file: Arc<GgufFile>,
        label: &str,
        opts: &CudaOptions,
    ) -> Result<CudaBackend, CudaError> {
        for (name, v) in [
            ("ctx_size", opts.ctx_size),
            ("max_seqs", opts.max_seqs),
            ("block_tokens", opts.block_tokens),
            ("max_batch_tokens", opts.max_batch_tokens),
        ] {
            if v == 0 {
                return Err(CudaError::Option {
                    name,
                    value: "0".into(),
                    why: "must be > 0",
                });
            }
        }
        let exact_orders = match opts.exact {
            Some(o) => Some(o),
            None => exact::orders_from_env()?,
        };
        let gpu = Gpu::new(opts.device)?;
        let free0 = gpu.mem_info()?.0;
        let cfg = ModelConfig::from_gguf(&file).map_err(|e| model_err(label, e.to_string()))?;
        let w =
            ModelWeights::from_gguf(&cfg, &file).map_err(|e| model_err(label, e.to_string()))?;
        if !kernels::HEAD_DIMS.contains(&cfg.head_dim) {
            return Err(model_err(
                label,
                format!(
                    "head size {} has no attention kernel (64, 96, 128, 256)",
                    cfg.head_dim
                ),
            ));
        }
        if cfg.n_gqa() > 8 {
            return Err(model_err(label, "more than 8 query heads per KV head"));
        }
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for (li, l) in w.layers.iter().enumerate() {
            let opt =
                |t: &Option<TensorInfo>| t.as_ref().map(|i| vector(&gpu, &file, i)).transpose();
            layers.push(Layer {
                attn_norm: vector(&gpu, &file, &l.attn_norm)?,
                ffn_norm: vector(&gpu, &file, &l.ffn_norm)?,
                wq: placed_mat(&gpu, &file, &l.attn_q, &opts.host, Some(li))?,
                wk: placed_mat(&gpu, &file, &l.attn_k, &opts.host, Some(li))?,
                wv: placed_mat(&gpu, &file, &l.attn_v, &opts.host, Some(li))?,
                wo: placed_mat(&gpu, &file, &l.attn_output, &opts.host, Some(li))?,
                bq: opt(&l.attn_q_bias)?,
                bk: opt(&l.attn_k_bias)?,
                bv: opt(&l.attn_v_bias)?,
                gate: placed_mat(&gpu, &file, &l.ffn_gate, &opts.host, Some(li))?,
                up: placed_mat(&gpu, &file, &l.ffn_up, &opts.host, Some(li))?,
                down: placed_mat(&gpu, &file, &l.ffn_down, &opts.host, Some(li))?,
                qkv16: None,
                gu16: None,
            });
        }
        let mut embd = upload_mat(&gpu, &file, &w.token_embd)?;
        // A tied head stays on the GPU for lookups and multiplies on the host if placed there.
        if cfg.tied_output && opts.host.host_reason(None, embd.ty).is_some() {
            embd.host = Some(HostMat::new(&file, &w.token_embd)?);
        }
        let output = if cfg.tied_output {
            None
        } else {
            Some(placed_mat(&gpu, &file, &w.output, &opts.host, None)?)
        };
        let output_norm = vector(&gpu, &file, &w.output_norm)?;
        let factors = match &w.rope_freqs {
            Some(i) => Some(
                quant::dequantize_to_vec(i.ty, file.tensor_data(i), i.n_elements() as usize)
                    .map_err(|e| model_err(&i.name, e.to_string()))?,
            ),
            None => None,
        };
        // The CPU backend divides by each factor, treating 0 as 1; the kernel does the same.
        let rope_factors = match &factors {
            Some(f) => {
                // Pairs without a factor rotate unscaled, as on the CPU.
                let mut f = f.clone();
                f.resize(f.len().max(cfg.n_rot / 2), 1.0);
                Some(gpu.upload(&f)?)
            }
            None => None,
        };

        // KV cache: one extra block receives the writes of padding tokens in graph replays.
        let bt = opts.block_tokens;
        let max_blocks = opts.ctx_size.div_ceil(bt);
        let n_blocks = max_blocks * opts.max_seqs;
        let kv_row = cfg.n_embd_kv();
        let kv_bytes = (n_blocks + 1) * bt * kv_row * 2;
        let mut kc = Vec::with_capacity(cfg.n_layer);
        let mut vc = Vec::with_capacity(cfg.n_layer);
        for _ in 0..cfg.n_layer {
            kc.push(gpu.alloc_zeroed(kv_bytes)?);
            vc.push(gpu.alloc_zeroed(kv_bytes)?);
        }

        let n = opts.max_batch_tokens;
        let (e, qd, kvd, ff, nv) = (cfg.n_embd, cfg.n_embd_q(), kv_row, cfg.n_ff, cfg.n_vocab);
        let widest = e.max(qd).max(ff);
        let max_split = max_split(gpu.sms as usize, opts.ctx_size);
        // Every step has tokens * splits <= C * SMs / n_kv + tokens * (1 + PREFILL_MAX_SPLIT)
        // (see `splits`).
        let part_floats =
            (n * (1 + PREFILL_MAX_SPLIT) + SPLIT_CTAS_PER_SM * gpu.sms as usize + MV_MAX_NT)
                * cfg.n_head
                * (cfg.head_dim + 2);
        let f4 = 4usize;
        // Workspace of the batched products on quantized weights: the largest split-K plan of
        // any layer matrix at the widest batched-decode step.
        let (mut mmf_ws, mut mmf_tiles) = (0usize, 0usize);
        if n > MV_MAX_NT {
            let nb = n.min(MMQ_MAX_N);
            for (r, c) in [(qd, e), (kvd, e), (e, qd), (ff, e), (e, ff)] {
                for warps in [4, 8] {
                    // (Slices and tiles do not depend on the weight type.)
                    let p = kernels::mmf_plan(gpu.sms as usize, GgmlType::Q4K, r, c, nb, warps);
                    mmf_ws = mmf_ws.max(p.ws_floats(r, nb));
                    mmf_tiles = mmf_tiles.max(p.tiles);
                }
                let p = kernels::mmk_plan(gpu.sms as usize, r, c, nb);
                mmf_ws = mmf_ws.max(p.ws_floats(r, nb));
                mmf_tiles = mmf_tiles.max(p.tiles);
            }
        }
        // Tokens of the widest step that takes the fused products (batched decode, v10).
        let fused_rows = if n > MV_MAX_NT { n.min(MMQ_MAX_N) } else { 1 };
        let mut s = Scratch {
            x: gpu.alloc(n * e * f4)?,
            xn: gpu.alloc(n * e * f4)?,
            xh: gpu.alloc(n * widest * 2)?,
            aq: gpu.alloc(kernels::act_bytes(n, widest).0)?,
            ad: gpu.alloc(kernels::act_bytes(n, widest).1)?,
            rd: gpu.alloc(kernels::act_bytes(n, widest).1)?,
            aq2: gpu.alloc(kernels::act_bytes(1, widest).0)?,
            ad2: gpu.alloc(kernels::act_bytes(1, widest).1)?,
            qcnt: gpu.alloc_zeroed(n * widest.div_ceil(256) * 4)?,
            acnt: gpu.alloc_zeroed(n * cfg.n_head_kv * 4)?,
            ss: gpu.alloc_zeroed(2 * kernels::RMS_SLOTS * 8)?,
            q: gpu.alloc(n * qd * f4)?,
            k: gpu.alloc(n * kvd * f4)?,
            v: gpu.alloc(n * kvd * f4)?,
            att: gpu.alloc(n * qd * f4)?,
            g: gpu.alloc(n * ff * f4)?,
            u: gpu.alloc(n * ff * f4)?,
            qkv: gpu.alloc(fused_rows * (qd + 2 * kvd) * f4)?,
            gu: gpu.alloc(fused_rows * 2 * ff * f4)?,
            part: gpu.alloc(part_floats * f4)?,
            hn: gpu.alloc(n * e * f4)?,
            logits: gpu.alloc(n * nv * f4)?,
            argmax: gpu.alloc(n * 4)?,
            wf16: None,
            mmf_ws: gpu.alloc(mmf_ws.max(1) * f4)?,
            mmf_cnt: gpu.alloc_zeroed(mmf_tiles.max(1) * 4)?,
            host: std::cell::RefCell::new(HostExec::new(opts.host.threads)),
            meta: gpu.alloc((5 * n + (opts.max_seqs + 1) * max_blocks) * 4)?,
        };

        // f16 weight copies for the GEMM path.
        let mut layers = layers;
        let mut embd = embd;
        let mut output = output;
        // Session 18: aligned copies of the Q6_K head and down projections for one-token steps
        // (16/15 of their bytes; CROSSOVER_CUDA_Q6A=0 makes none).
        if gpu.q6a.get() {
            let pad = |m: &mut Mat| -> Result<(), CudaError> {
                if m.ty == GgmlType::Q6K && m.host.is_none() && m.cols.is_multiple_of(256) {
                    m.q6a = Some(gpu.pad_q6k(m.q.ptr(), m.rows, m.cols)?);
                    m.q6a_group = gpu.q6a_group(m.cols);
                }
                Ok(())
            };
            for l in layers.iter_mut() {
                pad(&mut l.down)?;
                // Session 20: V too, for the mixed Q/K/V launch (Q6_KU's decoding).
                pad(&mut l.wv)?;
            }
            pad(output.as_mut().unwrap_or(&mut embd))?;
            gpu.sync()?;
        }
        // Exact mode multiplies the quantized weights only: no f16 copies.
        if gpu.has_blas() && n > opts.gemm_min_tokens && exact_orders.is_none() {
            let mut all: Vec<&Mat> = Vec::new();
            for l in &layers {
                all.extend([&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down]);
            }
            all.push(output.as_ref().unwrap_or(&embd));
            all.retain(|m| m.host.is_none());
            let total: usize = all.iter().map(|m| m.rows * m.cols * 2).sum();
            let largest = all.iter().map(|m| m.rows * m.cols * 2).max().unwrap_or(0);
            let (free, _) = gpu.mem_info()?;
            let cache = match opts.gemm_weights {
                GemmWeights::Cached => true,
                GemmWeights::OnTheFly => false,
                GemmWeights::Auto => (total as u64) < free / 2,
            };
            if cache {
                let conv = |m: &mut Mat| -> Result<(), CudaError> {
                    if m.host.is_some() || m.f16_at != 0 {
                        return Ok(());
                    }
                    let b = gpu.alloc(m.rows * m.cols * 2)?;
                    gpu.dequant_f16(m.ty, m.q.ptr(), m.rows, m.cols, b.ptr())?;
                    m.f16 = Some(b);
                    Ok(())
                };
                // v10: Q/K/V and gate/up copies made into one matrix each (same bytes, the
                // separate products read their rows), where all parts are on the device.
                let fuse = |ms: &mut [&mut Mat]| -> Result<Option<DevBuf>, CudaError> {
                    let cols = ms.first().map_or(0, |m| m.cols);
                    if ms.iter().any(|m| m.host.is_some() || m.cols != cols) {
                        return Ok(None);
                    }
                    let rows: usize = ms.iter().map(|m| m.rows).sum();
                    let b = gpu.alloc(rows * cols * 2)?;
                    let mut off = 0;
                    for m in ms.iter_mut() {
                        gpu.dequant_f16(m.ty, m.q.ptr(), m.rows, m.cols, b.at(off))?;
                        m.f16_at = b.at(off);
                        off += m.rows * m.cols * 2;
                    }
                    Ok(Some(b))
                };
                for l in &mut layers {
                    l.qkv16 = fuse(&mut [&mut l.wq, &mut l.wk, &mut l.wv])?;
                    if l.gate.rows == l.up.rows {
                        l.gu16 = fuse(&mut [&mut l.gate, &mut l.up])?;
                    }
                }
                for l in &mut layers {
                    for m in [
                        &mut l.wq,
                        &mut l.wk,
                        &mut l.wv,
                        &mut l.wo,
                        &mut l.gate,
                        &mut l.up,
                        &mut l.down,
                    ] {
                        conv(m)?;
                    }
                }
                match output.as_mut() {
                    Some(o) => conv(o)?,
                    None => conv(&mut embd)?,
                }
            } else {
                s.wf16 = Some(gpu.alloc(largest)?);
            }
        }
        gpu.sync()?;

        let info = BackendInfo {
            name: opts.host.backend_name(opts.device),
            device: format!(
                "{} (sm_{}{}, {} SMs, {:.0} GiB)",
                gpu.name,
                gpu.cc.0,
                gpu.cc.1,
                gpu.sms,
                gpu.total_mem as f64 / (1u64 << 30) as f64
            ),
            max_batch_tokens: n,
            max_batch_seqs: opts.max_seqs,
            max_seq_tokens: opts.ctx_size,
            kv_block_tokens: bt,
        };
        let mem_loaded = free0.saturating_sub(gpu.mem_info()?.0);
        let mut info = info;
        info.device.push_str(&format!(
            ", {} MiB taken at load{}",
            mem_loaded >> 20,
            opts.host.note()
        ));
        let mut be = CudaBackend {
            graphs: Vec::new(),
            graph_failed: None,
            wide_graph_failed: None,
            s,
            kc,
            vc,
            layers,
            embd,
            output,
            output_norm,
            rope: RopeParams::new(
                cfg.n_rot,
                cfg.rope_freq_base,
                cfg.rope_freq_scale(),
                rope_factors.as_ref().map_or(0, DevBuf::ptr),
            ),
            _rope_factors: rope_factors,
            alloc: BlockAllocator::new(n_blocks, bt),
            cfg,
            opts: opts.clone(),
            info,
            max_blocks,
            n_blocks,
            max_split,
            meta: Meta::default(),
            mp: MetaPtrs::default(),
            meta_copies: false,
            last_graph: None,
            chain: std::env::var("CROSSOVER_CUDA_CHAIN").as_deref() != Ok("0"),
            chain_picks: None,
            stats: StepStats::default(),
            mem_loaded,
            trace: None,
            prefill_mma: std::env::var("CROSSOVER_CUDA_PREFILL_MMA").as_deref() != Ok("0"),
            decode_mma: std::env::var("CROSSOVER_CUDA_DECODE_MMA").as_deref() != Ok("0"),
            batch_attn: std::env::var("CROSSOVER_CUDA_ATTN_BATCH").as_deref() != Ok("0"),
            ab_ctas: std::env::var("CROSSOVER_CUDA_AB_CTAS")
                .ok()
                .and_then(|v| v.parse().ok())
                .filter(|&v: &usize| v > 0)
                .unwrap_or(3),
            ab_merge: std::env::var("CROSSOVER_CUDA_AB_MERGE").as_deref() == Ok("1"),
            one_attn: std::env::var("CROSSOVER_CUDA_ATTN_ONE")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(2),
            one_adapt: std::env::var("CROSSOVER_CUDA_ONE_ADAPT").as_deref() != Ok("0"),
            one_tiles: std::env::var("CROSSOVER_CUDA_ONE_TILES")
                .ok()
                .and_then(|v| v.parse().ok())
                .filter(|&t| t > 0)
                .unwrap_or(2),
            one_len: opts.ctx_size,
            one_merge: std::env::var("CROSSOVER_CUDA_ATTN_MERGE").as_deref() != Ok("0"),
            one_merge_q: std::env::var("CROSSOVER_CUDA_MERGE_Q").as_deref() != Ok("0"),
            qkv_mixed: std::env::var("CROSSOVER_CUDA_QKV_MIXED").as_deref() != Ok("0"),
            one_early: std::env::var("CROSSOVER_CUDA_ATTN_EARLY").as_deref() != Ok("0"),
            one_direct: std::env::var("CROSSOVER_CUDA_ONE_DIRECT").as_deref() != Ok("0"),
            down_ss: std::env::var("CROSSOVER_CUDA_DOWN_SS").as_deref() != Ok("0"),
            rms_ss: std::env::var("CROSSOVER_CUDA_RMS_SS").as_deref() != Ok("0"),
            fuse_gemm: std::env::var("CROSSOVER_CUDA_FUSE_GEMM").as_deref() != Ok("0"),
            ab_fast_merge: std::env::var("CROSSOVER_CUDA_AB_FASTMERGE").as_deref() == Ok("1"),
            side_l2: std::env::var("CROSSOVER_CUDA_SIDE_L2")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
            kv_pf: std::env::var("CROSSOVER_CUDA_KV_PF")
                .ok()
                .and_then(|v| KvPf::parse(&v))
                .unwrap_or_default(),
            tuned: Vec::new(),
            lt_failed: None,
            exact: None,
            gpu,
        };
        if let Some(orders) = exact_orders {
            be.enable_exact(orders, factors.as_deref())
                .map_err(|why| model_err(label, why))?;
        }
        // v10: the batched decode products' algorithms are chosen here, not in a step.
        // A failure there (e.g. no memory for the timing scratch) costs the tuned algorithms,
        // not the load.
        let fused = be.fuse_gemm;
        if let Err(e) = be.tune_products(fused) {
            be.gpu.lt_on.set(false);
            be.lt_failed = Some(e.to_string());
        }
        Ok(be)
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The GPU.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Turn graph replay of decode steps on or off (off: every step launches its kernels eagerly,
    /// e.g. to time them one by one with [`Gpu::profile_start`]).
    pub fn set_graphs(&mut self, on: bool) {
        self.opts.graphs = on;
    }

    /// Install (or remove) a hook that sees every traced intermediate tensor of the following
    /// steps (see [`TraceFn`]); while one is set, steps launch eagerly, one op at a time.
    pub fn set_trace(&mut self, f: Option<Box<TraceFn>>) {
        self.trace = f;
    }

    /// What the matmuls run on the host (layer placement, missing kernels) have cost so far.
    pub fn host_stats(&self) -> runtime::fallback::FallbackStats {
        self.s.host.borrow().stats()
    }

    /// GPU memory this backend took at load (weights, f16 copies, KV cache, scratch), as the
    /// driver's free memory before and after.
    pub fn memory_loaded(&self) -> u64 {
        self.mem_loaded
    }

    /// Whether any matmul runs on the host (then no step is captured in a graph).
    fn any_host(&self) -> bool {
        let out = self.output.as_ref().unwrap_or(&self.embd);
        out.host.is_some()
            || self.layers.iter().any(|l| {
                [&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down]
                    .iter()
                    .any(|m| m.host.is_some())
            })
    }

    /// One-token matrix-vector products of a decode step, kernel class by kernel class (the
    /// layers' Q/K/V, O, gate/up with SwiGLU, down, and the output head), each class's
    /// launches over all layers captured as one graph and replayed `reps` times, on activations
    /// quantized from random values. Returns (class, launches per replay, microseconds per
    /// launch, weight bytes per launch): bytes over time is each kernel's achieved bandwidth
    /// with the weights streamed from memory (a class's matrices over all layers exceed L2,
    /// except for the output head, which is one matrix of hundreds of MB).
    pub fn bench_matvecs(
        &mut self,
        reps: usize,
    ) -> Result<Vec<(String, usize, f64, f64)>, CudaError> {
        let gpu = &self.gpu;
        let s = &self.s;
        let o = &self.opts;
        let cfg = &self.cfg;
        let widest = cfg.n_embd.max(cfg.n_ff).max(cfg.n_embd_q());
        let mut seed = 0x9e37_79b9u32;
        let x: Vec<f32> = (0..widest)
            .map(|_| {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5
            })
            .collect();
        gpu.write(&s.xn, 0, &x)?;
        let mut out = Vec::new();
        let mut st = StepStats::default();
        let quant = |m: &Mat, acts: &mut Acts| -> Result<(), CudaError> {
            if let Some(f) = kernels::act_format(m.ty) {
                gpu.quantize_act(s.xn.ptr(), 1, m.cols, f, s.aq.ptr(), s.ad.ptr())?;
                acts.q = Some((s.xn.ptr(), f));
            }
            Ok(())
        };
        let bytes = |m: &Mat| matrix_bytes(m.ty, m.rows, m.cols) as f64;
        type Class<'a> = (&'a str, Box<dyn Fn(&Layer) -> Vec<&Mat> + 'a>);
        let classes: Vec<Class> = vec![
            ("q+k+v", Box::new(|l: &Layer| vec![&l.wq, &l.wk, &l.wv])),
            ("o", Box::new(|l: &Layer| vec![&l.wo])),
            (
                "gate+up (swiglu)",
                Box::new(|l: &Layer| vec![&l.gate, &l.up]),
            ),
            ("down", Box::new(|l: &Layer| vec![&l.down])),
        ];
        for (name, pick) in &classes {
            let mut acts = Acts::default();
            let mut total = 0.0;
            for l in &self.layers {
                total += pick(l).iter().map(|m| bytes(m)).sum::<f64>();
            }
            let first = pick(&self.layers[0]);
            quant(first[0], &mut acts)?;
            let ms = gpu.time_graph(reps, &mut || {
                for l in &self.layers {
                    let ms = pick(l);
                    if ms.len() == 2
                        && name.starts_with("gate")
                        && gpu.mvp_fits(ms[0].ty, ms[0].cols)
                        && ms[1].ty == ms[0].ty
                    {
                        // The default path's pipelined kernel (session 33: was always the unit
                        // kernel); the plain layout's bytes time the same as the permuted ones.
                        gpu.matvec_q_swiglu_pipe(
                            ms[0].q.ptr(),
                            ms[1].q.ptr(),
                            ms[0].rows,
                            ms[0].cols,
                            s.aq.ptr(),
                            s.ad.ptr(),
                            s.g.ptr(),
                        )?;
                    } else if ms.len() == 2 && ms[0].ty == ms[1].ty && name.starts_with("gate") {
                        gpu.matvec_q_swiglu(
                            ms[0].ty,
                            ms[0].q.ptr(),
                            ms[1].q.ptr(),
                            ms[0].rows,
                            ms[0].cols,
                            s.aq.ptr(),
                            s.ad.ptr(),
                            1,
                            s.g.ptr(),
                        )?;
                    } else {
                        let ys = [s.q.ptr(), s.k.ptr(), s.v.ptr()];
                        let group: Vec<(&Mat, u64)> =
                            ms.iter().zip(ys).map(|(&m, y)| (m, y)).collect();
                        let mut a = acts;
                        Self::linear_group(gpu, o, s, &group, s.xn.ptr(), 1, &mut st, &mut a)?;
                    }
                }
                Ok(())
            })?;
            // Launches over all layers: consecutive matrices of one type share one with mvr.
            let launches: usize = self
                .layers
                .iter()
                .map(|l| {
                    let ms = pick(l);
                    if name.starts_with("gate") {
                        1
                    } else if gpu.mvr_fits(ms[0].cols) {
                        1 + ms.windows(2).filter(|w| w[0].ty != w[1].ty).count()
                    } else {
                        ms.len()
                    }
                })
                .sum();
            out.push((
                name.to_string(),
                launches,
                ms * 1e3 / launches as f64,
                total / launches as f64,
            ));
        }
        let head = self.output.as_ref().unwrap_or(&self.embd);
        let mut acts = Acts::default();
        quant(head, &mut acts)?;
        let ms = gpu.time_graph(reps, &mut || {
            let mut a = acts;
            Self::linear(
                gpu,
                o,
                s,
                head,
                s.xn.ptr(),
                1,
                s.logits.ptr(),
                false,
                &mut st,
                &mut a,
            )
        })?;
        out.push(("output head".into(), 1, ms * 1e3, bytes(head)));
        Ok(out)
    }

    /// Session 15's roofline: for each size in `sizes` (bytes per launch, as a one-token
    /// product class reads), chains of launches of every streaming-read probe
    /// ([`kernels::PROBES`], with and without the L2 prefetch before the wait), each launch on
    /// its own range of a 1.6 GB buffer so nothing is served from L2, captured as one graph and
    /// replayed `reps` times. Returns (probe, prefetch, bytes, launches, microseconds per
    /// launch): what the real kernels of [`CudaBackend::bench_matvecs`] could reach if they
    /// streamed their weights as fast as a kernel that only reads them.
    pub fn bench_roofline(
        &mut self,
        reps: usize,
        sizes: &[usize],
    ) -> Result<Vec<RooflineRow>, CudaError> {
        let gpu = &self.gpu;
        let pool = 1600usize << 20;
        let buf = gpu.alloc(pool)?;
        let out = gpu.alloc(4 * 65536)?;
        let mut rows = Vec::new();
        for &size in sizes {
            let size = size.div_ceil(256) * 256;
            let launches = (pool / size).clamp(1, 28);
            for probe in kernels::PROBES {
                for prefetch in [false, true] {
                    let ms = gpu.time_graph(reps, &mut || {
                        for k in 0..launches {
                            gpu.probe_read(probe, buf.at(k * size), size, out.ptr(), prefetch)?;
                        }
                        Ok(())
                    })?;
                    rows.push((
                        probe.to_string(),
                        prefetch,
                        size,
                        launches,
                        ms * 1e3 / launches as f64,
                    ));
                }
            }
        }
        Ok(rows)
    }

    /// Batched-decode products of `n` tokens (9..64) on one random f16 operand, per matrix class
    /// over all layers (Q/K/V, O, gate/up, down) and for the head: (class, launches, ms per
    /// launch with [`Gpu::matmul_q4k_mmk`] where the class has Q4_K matrices (the others on
    /// cuBLAS; NaN where it has none), with [`Gpu::matmul_f16w`] in blocks of 8 warps, and with
    /// cuBLAS on the f16 copies (NaN without copies or cuBLAS), quantized weight bytes per
    /// launch). Leaves `Gpu::mmf`, `Gpu::mmf_warps` and `Gpu::mmk` as it found them.
    pub fn bench_batched(
        &mut self,
        n: usize,
        reps: usize,
    ) -> Result<Vec<BatchedTiming>, CudaError> {
        let gpu = &self.gpu;
        let s = &self.s;
        let o = &self.opts;
        let cfg = &self.cfg;
        if n <= MV_MAX_NT || n > MMQ_MAX_N || n > o.max_batch_tokens {
            return Err(CudaError::Arg(format!(
                "{n} tokens: batched products take 9..=64"
            )));
        }
        let widest = cfg.n_embd.max(cfg.n_ff).max(cfg.n_embd_q());
        let mut seed = 0x2545_f491u32;
        let xh: Vec<u16> = (0..n * widest)
            .map(|_| {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                half::f16::from_f32((seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5).to_bits()
            })
            .collect();
        gpu.write(&s.xh, 0, &xh)?;
        // Scales and sums for the raw-operand products (their timing does not depend on the
        // values; these keep every sum finite).
        let rd: Vec<f32> = (0..n * widest / 32)
            .flat_map(|_| [1.0f32 / 127.0, 0.0])
            .collect();
        gpu.write(&s.rd, 0, &rd)?;
        let mut st = StepStats::default();
        let head = self.output.as_ref().unwrap_or(&self.embd);
        type Pick<'a> = Box<dyn Fn(&'a Layer) -> Vec<(&'a Mat, u64)> + 'a>;
        let classes: Vec<(&str, Pick)> = vec![
            (
                "q+k+v",
                Box::new(|l: &Layer| {
                    vec![(&l.wq, s.q.ptr()), (&l.wk, s.k.ptr()), (&l.wv, s.v.ptr())]
                }),
            ),
            ("o", Box::new(|l: &Layer| vec![(&l.wo, s.x.ptr())])),
            (
                "gate+up",
                Box::new(|l: &Layer| vec![(&l.gate, s.g.ptr()), (&l.up, s.u.ptr())]),
            ),
            ("down", Box::new(|l: &Layer| vec![(&l.down, s.x.ptr())])),
        ];
        let mut jobs: Vec<(String, Vec<(&Mat, u64)>)> = classes
            .iter()
            .map(|(name, pick)| {
                (
                    name.to_string(),
                    self.layers.iter().flat_map(pick).collect(),
                )
            })
            .collect();
        jobs.push(("head".into(), vec![(head, s.logits.ptr())]));
        let was = (gpu.mmf.get(), gpu.mmf_warps.get(), gpu.mmk.get());
        let mut out = Vec::new();
        for (name, mats) in &jobs {
            let mut ms = [f64::NAN; 3];
            // (Q4_K integer-order kernels, f16 kernels on the quantized weights, cuBLAS.)
            for (i, (mmk, mmf)) in [(true, false), (false, true), (false, false)]
                .into_iter()
                .enumerate()
            {
                gpu.mmk.set(mmk);
                gpu.mmf.set(mmf);
                gpu.mmf_warps.set(8);
                let blas = !mmk && !mmf;
                if blas && (!gpu.has_blas() || mats.iter().any(|(m, _)| m.f16_ptr().is_none())) {
                    continue;
                }
                if mmk && !mats.iter().any(|(m, _)| mmk_for(gpu, m, n)) {
                    continue;
                }
                ms[i] = gpu.time_graph(reps, &mut || {
                    for &(m, y) in mats {
                        // The operand is already in xh: mark it converted from xn.
                        let raw = mmk_for(gpu, m, n);
                        let f = kernels::act_format(m.ty);
                        let mut a = Acts {
                            h: Some((s.xn.ptr(), f, raw)),
                            ..Acts::default()
                        };
                        Self::linear(gpu, o, s, m, s.xn.ptr(), n, y, false, &mut st, &mut a)?;
                    }
                    Ok(())
                })?;
            }
            let bytes: f64 = mats
                .iter()
                .map(|(m, _)| matrix_bytes(m.ty, m.rows, m.cols) as f64)
                .sum();
            let k = mats.len();
            out.push((name.clone(), k, ms.map(|v| v / k as f64), bytes / k as f64));
        }
        gpu.mmf.set(was.0);
        gpu.mmf_warps.set(was.1);
        gpu.mmk.set(was.2);
        Ok(out)
    }

    /// Choose the one-token product kernels (`mvr`: v6's two-rows-per-warp kernels with Q/K/V in
    /// one launch; else the block-per-row ones) and programmatic dependent launch, dropping
    /// the captured decode graphs so the next steps are captured with the new choice.
    pub fn set_kernels(&mut self, mvr: bool, pdl: bool) {
        self.gpu.mvr.set(mvr);
        self.gpu.pdl.set(pdl && self.gpu.cc.0 >= 9);
        self.graphs.clear();
    }

    /// v7's one-token fusions: products that normalize and quantize their own activations
    /// (`prep`), the split attention that merges its own slices (`merge`), the shortest slice
    /// of that attention (`slice` positions) and the blocks per SM of the preparing products
    /// (`blocks_per_sm`); drops the captured graphs so later steps use the choice.
    pub fn set_decode_fusion(
        &mut self,
        prep: bool,
        merge: bool,
        slice: usize,
        blocks_per_sm: usize,
    ) {
        self.gpu.fuse_prep.set(prep);
        self.gpu.fuse_merge.set(merge);
        self.gpu.dec_slice.set(slice.max(32));
        self.gpu.prep_blocks.set(blocks_per_sm.max(1));
        self.graphs.clear();
    }

    /// Use the tensor-core prefill attention for prompt-sized steps (on by default).
    pub fn set_prefill_mma(&mut self, on: bool) {
        self.prefill_mma = on;
    }

    /// Why graph capture was given up, if it was (for every step, or for steps of more than 8
    /// sequences).
    pub fn graph_failure(&self) -> Option<&str> {
        self.graph_failed
            .as_deref()
            .or(self.wide_graph_failed.as_deref())
    }

    /// Use the pipelined many-sequence attention for wide decode steps (on by default; off:
    /// the split-K one-tile kernel), dropping captured graphs.
    pub fn set_batch_attn(&mut self, on: bool) {
        self.batch_attn = on;
        self.graphs.clear();
    }

    /// One-token attention (v8): the pipelined split kernel over about `blocks_per_sm` blocks
    /// per SM (0: v7's one-tile kernel), its first copies issued before the Q/K/V kernel ends
    /// (`early`), merged by [`Gpu::attn_merge`] (`fast_merge`) or [`Gpu::attn_combine`]; drops
    /// captured graphs so later steps use the choice.
    pub fn set_one_attn(&mut self, blocks_per_sm: usize, early: bool, fast_merge: bool) {
        self.one_attn = blocks_per_sm;
        self.one_early = early;
        self.one_merge = fast_merge;
        self.graphs.clear();
    }

    /// v9's one-token changes: the merge that quantizes the output projection's activation
    /// (`merge_q`) and a V of another type in the Q/K/V launch (`qkv_mixed`); drops captured
    /// graphs so later steps use the choice.
    pub fn set_decode_v9(&mut self, merge_q: bool, qkv_mixed: bool) {
        self.one_merge_q = merge_q;
        self.qkv_mixed = qkv_mixed;
        self.graphs.clear();
    }

    /// v10's one-token product choices ([`DecodeV10`]); drops captured graphs so later steps
    /// use them.
    pub fn set_decode_v10(&mut self, c: DecodeV10) {
        let g = &self.gpu;
        g.wave.set(c.wave);
        g.q6_half.set(c.q6_half);
        g.warp_rows.set(c.warp_rows);
        g.mvr_lb4.set(c.mvr_lb4);
        g.mvq_pf.set(c.mvq_pf);
        self.graphs.clear();
    }

    /// Timing ablation (v11, `cuda_bench --ab-skip`): launches of kernels whose names start
    /// with one of `prefixes` are left out of every later step, so the step time shows what
    /// that kernel class costs inside the real captured step; a prefix written `~name`
    /// launches one empty block (`pdl_hop`) in each such launch's place instead, so the step
    /// keeps the link of its dependent chain (session 34, `cuda_bench --ab-hop`). The results
    /// of such steps are wrong; an empty list restores normal steps. Drops captured graphs.
    pub fn set_skip(&mut self, prefixes: &[&str]) {
        *self.gpu.skip.borrow_mut() = prefixes.iter().map(|p| p.to_string()).collect();
        self.graphs.clear();
    }

    /// v11's one-token choices: RMSNorm a warp per group ([`Gpu::rms1`]) and the many-block
    /// argmax ([`Gpu::argmax_mb`]); drops captured graphs so later steps use the choice.
    pub fn set_decode_v11(&mut self, rms1: bool, argmax_mb: bool) {
        self.gpu.rms1.set(rms1);
        self.gpu.argmax_mb.set(argmax_mb);
        self.graphs.clear();
    }

    /// Session 16's one-token choice ([`CudaBackend::rms_ss`]): RMSNorm from the products'
    /// partial sums of squares; drops captured graphs so later steps use the choice.
    pub fn set_rms_ss(&mut self, on: bool) {
        self.rms_ss = on;
        self.graphs.clear();
    }

    /// Session 16's half-unit one-token Q4_K SwiGLU product ([`Gpu::mvh`]); drops captured
    /// graphs so later steps use the choice.
    pub fn set_mvh(&mut self, on: bool) {
        self.gpu.mvh.set(on);
        self.graphs.clear();
    }

    /// Session 17's one-token `mvr` launch shape: the 64-register builds ([`Gpu::mvr_lb4`])
    /// and the warps per block of the plain / Q/K/V and of the SwiGLU launches
    /// ([`Gpu::mvr_warps`], [`Gpu::mvr_warps_glu`]); drops captured graphs so later steps use
    /// the choice.
    pub fn set_mvr(&mut self, lb4: bool, warps: usize, warps_glu: usize) {
        self.gpu.mvr_lb4.set(lb4);
        self.gpu.mvr_warps.set(warps.clamp(1, 8));
        self.gpu.mvr_warps_glu.set(warps_glu.clamp(1, 8));
        self.graphs.clear();
    }

    /// One-token steps quantize the down projection's activation inside the SwiGLU product
    /// ([`Gpu::fuse_quant`]; with it the down product adds up the squares of x for the next
    /// RMSNorm); drops captured graphs so later steps use the choice.
    pub fn set_fuse_quant(&mut self, on: bool) {
        self.gpu.fuse_quant.set(on);
        self.graphs.clear();
    }

    /// Session 29's pipelined SwiGLU product ([`Gpu::mvp`]: rows per warp, 0 off); drops
    /// captured graphs so later steps use the choice.
    pub fn set_mvp(&mut self, rpw: usize) {
        self.gpu.mvp.set(rpw);
        self.graphs.clear();
    }

    /// Session 33's cursor-free pipelined SwiGLU product ([`Gpu::mvps`]); drops captured
    /// graphs so later steps use the choice.
    pub fn set_mvps(&mut self, on: bool) {
        self.gpu.mvps.set(on);
        self.graphs.clear();
    }

    /// Session 33's pipelined Q/K/V launch ([`Gpu::mvpq`]); drops captured graphs so later
    /// steps use the choice.
    pub fn set_mvpq(&mut self, on: bool) {
        self.gpu.mvpq.set(on);
        self.graphs.clear();
    }

    /// Session 34's one-token RMSNorm from the slot sums as a warp per group ([`Gpu::rms1s`]);
    /// drops captured graphs.
    pub fn set_rms1s(&mut self, on: bool) {
        self.gpu.rms1s.set(on);
        self.graphs.clear();
    }

    /// Whether one-token RMSNorms take their sums from the products ([`Self::set_rms_ss`]).
    pub fn rms_ss(&self) -> bool {
        self.rms_ss
    }

    /// v11's one-token choices ([`CudaBackend::set_decode_v11`]'s arguments).
    pub fn decode_v11(&self) -> (bool, bool) {
        (self.gpu.rms1.get(), self.gpu.argmax_mb.get())
    }

    /// v10's one-token choices ([`CudaBackend::set_decode_v10`]'s argument).
    pub fn decode_v10(&self) -> DecodeV10 {
        let g = &self.gpu;
        DecodeV10 {
            wave: g.wave.get(),
            q6_half: g.q6_half.get(),
            warp_rows: g.warp_rows.get(),
            mvr_lb4: g.mvr_lb4.get(),
            mvq_pf: g.mvq_pf.get(),
        }
    }

    /// v9's one-token choices ([`CudaBackend::set_decode_v9`]'s arguments).
    pub fn decode_v9(&self) -> (bool, bool) {
        (self.one_merge_q, self.qkv_mixed)
    }

    /// The one-token attention choice ([`CudaBackend::set_one_attn`]'s arguments).
    pub fn one_attn(&self) -> (usize, bool, bool) {
        (self.one_attn, self.one_early, self.one_merge)
    }

    /// Splits of the pipelined one-token attention for an `n`-token step, when it takes it.
    fn one_split(&self, n: usize) -> Option<usize> {
        let (nh, nkv, hd) = (self.cfg.n_head, self.cfg.n_head_kv, self.cfg.head_dim);
        (n == 1
            && self.one_attn > 0
            && self.decode_mma
            && kernels::PREFILL_HEAD_DIMS.contains(&hd)
            && nkv > 0
            && nh.is_multiple_of(nkv)
            && nh / nkv <= 8)
            .then(|| {
                let full = self.one_split_full();
                if self.one_adapt {
                    // Contexts up to `one_tiles` tiles: one split; longer ones one tile per
                    // split, in powers of two, until the full count.
                    if self.one_len <= ONE_TILE * self.one_tiles {
                        1
                    } else {
                        self.one_len
                            .div_ceil(ONE_TILE)
                            .next_power_of_two()
                            .min(full)
                    }
                } else {
                    full
                }
            })
    }

    /// Drop the captured decode graphs, so later steps capture again with the [`Gpu`]'s
    /// current launch choices (for A/B runs that change a `Gpu` setting directly).
    pub fn reset_graphs(&mut self) {
        self.graphs.clear();
    }

    /// The one-token attention's split count for the longest context: about
    /// [`CudaBackend::one_attn`] blocks per SM over the KV heads.
    fn one_split_full(&self) -> usize {
        (self.one_attn * self.gpu.sms as usize)
            .div_ceil(self.cfg.n_head_kv.max(1))
            .clamp(1, self.max_split)
    }

    /// Whether one-token steps size their attention splits to the context
    /// ([`Self::set_one_adapt`]).
    pub fn one_adapt(&self) -> bool {
        self.one_adapt
    }

    /// Session 17's one-token choice ([`CudaBackend::one_adapt`]'s field): attention splits
    /// sized to the context, a graph per class of lengths; drops captured graphs.
    pub fn set_one_adapt(&mut self, on: bool) {
        self.one_adapt = on;
        self.graphs.clear();
    }

    /// Session 26's one-token choice ([`CudaBackend::one_tiles`]'s field): the longest context,
    /// in 64-position tiles, that the context-sized attention runs as one split.
    pub fn one_tiles(&self) -> usize {
        self.one_tiles
    }

    /// Sets [`CudaBackend::one_tiles`] (at least 1); drops captured graphs.
    pub fn set_one_tiles(&mut self, tiles: usize) {
        self.one_tiles = tiles.max(1);
        self.graphs.clear();
    }

    /// Session 18's one-token choice ([`CudaBackend::one_direct`]'s field): a one-split
    /// attention writes the merged rows itself; drops captured graphs.
    pub fn set_one_direct(&mut self, on: bool) {
        self.one_direct = on;
        self.graphs.clear();
    }

    /// Session 18's one-token choice ([`CudaBackend::down_ss`]'s field): the down projection
    /// adds the squares of its row for the next attention norm; drops captured graphs.
    pub fn set_down_ss(&mut self, on: bool) {
        self.down_ss = on;
        self.graphs.clear();
    }

    /// Use the tensor-core integer GEMM for products of 9..64 tokens (off by default: cuBLAS on
    /// the f16 copies), dropping captured graphs so later steps use the choice.
    pub fn set_mmq(&mut self, on: bool) {
        self.gpu.mmq.set(on);
        self.graphs.clear();
        self.wide_graph_failed = None;
    }

    /// Use the f16 tensor-core products on the quantized weights for 9..64-token steps
    /// ([`Gpu::matmul_f16w`]; off, the default: cuBLAS on the f16 copies), dropping captured
    /// graphs.
    pub fn set_mmf(&mut self, on: bool) {
        self.gpu.mmf.set(on);
        self.graphs.clear();
        self.wide_graph_failed = None;
    }

    /// Use the Q4_K tensor-core products in the CPU's integer order for 9..64-token steps
    /// ([`Gpu::matmul_q4k_mmk`]), dropping captured graphs.
    pub fn set_mmk(&mut self, on: bool) {
        self.gpu.mmk.set(on);
        self.graphs.clear();
        self.wide_graph_failed = None;
    }

    /// v10's batched-step products: Q/K/V and gate/up as one GEMM each on the fused copies
    /// (`fused`) and cuBLASLt's algorithm timed fastest per shape (`lt`); drops captured graphs.
    pub fn set_batched_products(&mut self, fused: bool, lt: bool) {
        self.fuse_gemm = fused;
        self.gpu.lt_on.set(lt);
        self.graphs.clear();
        self.wide_graph_failed = None;
    }

    /// Merge the wide steps' attention slices with [`Gpu::attn_merge`] instead of
    /// [`Gpu::attn_combine`] (same bits); drops captured graphs.
    pub fn set_ab_fast_merge(&mut self, on: bool) {
        self.ab_fast_merge = on;
        self.graphs.clear();
    }

    /// Take the split attention's warp-private loaders ([`Gpu::attn_wp`], the same bits) or
    /// the block-wide ones; drops captured graphs.
    pub fn set_attn_wp(&mut self, on: bool) {
        self.gpu.attn_wp.set(on);
        self.graphs.clear();
    }

    /// Which steps ask L2 for the weights of products ahead from the side stream
    /// ([`Gpu::side_prefetch`]; bits [`SIDE_ONE`] and [`SIDE_WIDE`]); drops captured graphs.
    pub fn set_side_l2(&mut self, bits: u8) {
        self.side_l2 = bits;
        self.graphs.clear();
    }

    /// Session 30's KV prefetch choice ([`KvPf`]); drops captured graphs.
    pub fn set_kv_pf(&mut self, pf: KvPf) {
        self.kv_pf = pf;
        self.graphs.clear();
    }

    /// The [`CudaBackend::set_kv_pf`] choice.
    pub fn kv_pf(&self) -> KvPf {
        self.kv_pf
    }

    /// The [`CudaBackend::set_side_l2`] bits.
    pub fn side_l2(&self) -> u8 {
        self.side_l2
    }

    /// Whether [`CudaBackend::set_ab_fast_merge`] is on.
    pub fn ab_fast_merge(&self) -> bool {
        self.ab_fast_merge
    }

    /// Why the batched products' cuBLASLt algorithms were given up at load, if they were.
    pub fn lt_failure(&self) -> Option<&str> {
        self.lt_failed.as_deref()
    }

    /// [`CudaBackend::set_batched_products`]'s current arguments.
    pub fn batched_products(&self) -> (bool, bool) {
        (self.fuse_gemm, self.gpu.lt_on.get())
    }

    /// Tune the cuBLASLt algorithm of every product shape a batched decode graph bucket of
    /// this backend takes (16..64 tokens, up to the sequences it holds), with the Q/K/V and
    /// gate/up products fused (`fused`) or not, on a random f16 operand (v10). Done at load
    /// for the default, so that no step pays for it; returns the shapes tuned now.
    pub fn tune_products(&mut self, fused: bool) -> Result<usize, CudaError> {
        let gpu = &self.gpu;
        let s = &self.s;
        let cfg = &self.cfg;
        // Graph steps of up to `top` sequences replay the smallest bucket that holds them.
        let top = self.opts.max_seqs.min(MMQ_MAX_N);
        let cap = DECODE_BUCKETS
            .iter()
            .copied()
            .find(|&b| b >= top)
            .unwrap_or(MMQ_MAX_N);
        let buckets: Vec<usize> = DECODE_BUCKETS
            .iter()
            .copied()
            .filter(|&b| {
                b > MV_MAX_NT && b > self.opts.gemm_min_tokens && b <= cap && gpu.lt_wants(b)
            })
            .collect();
        if buckets.is_empty() || !gpu.has_blas() {
            return Ok(0);
        }
        // Weight, shape (rows, columns), accumulating: one of each distinct shape.
        let mut mats: Vec<(u64, usize, usize, bool)> = Vec::new();
        let mut add = |w: Option<u64>, rows: usize, cols: usize, acc: bool| {
            if let Some(w) = w {
                if !mats.iter().any(|m| (m.1, m.2, m.3) == (rows, cols, acc)) {
                    mats.push((w, rows, cols, acc));
                }
            }
        };
        let (e, qd, kvd, ff) = (cfg.n_embd, cfg.n_embd_q(), cfg.n_embd_kv(), cfg.n_ff);
        for l in &self.layers {
            match (&l.qkv16, fused) {
                (Some(b), true) => add(Some(b.ptr()), qd + 2 * kvd, e, false),
                _ => {
                    for m in [&l.wq, &l.wk, &l.wv] {
                        add(m.f16_ptr(), m.rows, m.cols, false);
                    }
                }
            }
            add(l.wo.f16_ptr(), l.wo.rows, l.wo.cols, true);
            match (&l.gu16, fused) {
                (Some(b), true) => add(Some(b.ptr()), 2 * ff, e, false),
                _ => {
                    for m in [&l.gate, &l.up] {
                        add(m.f16_ptr(), m.rows, m.cols, false);
                    }
                }
            }
            add(l.down.f16_ptr(), l.down.rows, l.down.cols, true);
        }
        let head = self.output.as_ref().unwrap_or(&self.embd);
        add(head.f16_ptr(), head.rows, head.cols, false);
        let widest = mats.iter().map(|m| m.2).max().unwrap_or(0);
        let top_n = buckets.iter().copied().max().unwrap_or(0);
        if widest * top_n * 2 > s.xh.bytes() {
            return Ok(0);
        }
        let mut seed = 0x9e37_79b9u32;
        let xh: Vec<u16> = (0..top_n * widest)
            .map(|_| {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                half::f16::from_f32((seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5).to_bits()
            })
            .collect();
        gpu.write(&s.xh, 0, &xh)?;
        let before = gpu.gemm_tunings().len();
        for &n in &buckets {
            for &(w, m, k, acc) in &mats {
                // The product runs once after its tuning: into the logits buffer, which the
                // next step rewrites (skipped where it would not fit).
                if m * n * 4 > s.logits.bytes() {
                    continue;
                }
                let sh = crate::lt::GemmShape { m, n, k, acc };
                gpu.gemm_lt(sh, w, s.xh.ptr(), s.logits.ptr())?;
            }
        }
        gpu.sync()?;
        let done = gpu.gemm_tunings().len() - before;
        self.tuned.extend(buckets.iter().map(|&b| (b, fused)));
        Ok(done)
    }

    fn check(&self, batch: &StepBatch) -> Result<(), BackendError> {
        batch.validate(&self.info, self.cfg.n_vocab, &self.alloc)
    }

    /// Fill the host metadata for `batch` padded to `padded` tokens; returns the number of
    /// logits rows and the longest context in the step.
    fn build_meta(&mut self, batch: &StepBatch, padded: usize, all_rows: bool) -> (usize, usize) {
        let bt = self.opts.block_tokens;
        let trash_block = self.n_blocks as i32;
        let mb = self.max_blocks;
        let m = &mut self.meta;
        m.ids.clear();
        m.pos.clear();
        m.slot.clear();
        m.seq.clear();
        m.out_rows.clear();
        m.btab.clear();
        m.chunks.clear();
        m.btab.resize((batch.chunks.len() + 1) * mb, trash_block);
        let mut max_len = 1;
        for (ci, c) in batch.chunks.iter().enumerate() {
            let blocks = self.alloc.blocks(c.seq);
            for (j, &b) in blocks.iter().enumerate().take(mb) {
                m.btab[ci * mb + j] = b as i32;
            }
            m.chunks.push((m.ids.len(), c.tokens.len(), c.start_pos));
            for (ti, &id) in c.tokens.iter().enumerate() {
                let p = c.start_pos + ti;
                let b = blocks.get(p / bt).copied().unwrap_or(self.n_blocks as u32);
                let want = match c.want {
                    Want::All => true,
                    Want::Last => ti + 1 == c.tokens.len(),
                    Want::None => false,
                };
                if want || all_rows {
                    m.out_rows.push(m.ids.len() as i32);
                }
                m.ids.push(id as i32);
                m.pos.push(p as i32);
                m.slot.push((b as usize * bt + p % bt) as i32);
                m.seq.push(ci as i32);
                max_len = max_len.max(p + 1);
            }
        }
        // Padding tokens: position 0 of a sequence whose every block is the spare one.
        let pad_row = batch.chunks.len() as i32;
        while m.ids.len() < padded {
            if all_rows {
                m.out_rows.push(m.ids.len() as i32);
            }
            m.ids.push(0);
            m.pos.push(0);
            m.slot.push(self.n_blocks as i32 * bt as i32);
            m.seq.push(pad_row);
        }
        (m.out_rows.len(), max_len)
    }

    /// One copy of the step's metadata ([`Scratch::meta`]), and where its arrays now lie.
    fn upload_meta(&mut self) -> Result<(), CudaError> {
        self.upload_meta_from(false)
    }

    /// [`Self::upload_meta`]; with `keep_ids` the token ids already on the device stay (the
    /// copy starts after them: [`Self::decode_greedy`] puts the picks there).
    fn upload_meta_from(&mut self, keep_ids: bool) -> Result<(), CudaError> {
        let m = &mut self.meta;
        let p = m.ids.len();
        m.packed.clear();
        for a in [&m.ids, &m.pos, &m.slot, &m.seq] {
            m.packed.extend_from_slice(a);
        }
        m.packed.extend_from_slice(&m.out_rows);
        m.packed.resize(5 * p, 0);
        m.packed.extend_from_slice(&m.btab);
        if self.meta_copies {
            // Session 18's A/B: the same bytes, one copy per array as before.
            let r = 4 * p;
            for (k, a) in [&m.ids, &m.pos, &m.slot, &m.seq, &m.out_rows, &m.btab]
                .into_iter()
                .enumerate()
            {
                self.gpu.write(&self.s.meta, k * r, a)?;
            }
        } else if keep_ids {
            self.gpu.write(&self.s.meta, 4 * p, &m.packed[p..])?;
        } else {
            self.gpu.write(&self.s.meta, 0, &m.packed)?;
        }
        self.mp = MetaPtrs::layout(self.s.meta.ptr(), p);
        Ok(())
    }

    /// Session 18 A/B: upload a step's metadata as one copy per array (`true`) instead of one.
    pub fn set_meta_copies(&mut self, on: bool) {
        self.meta_copies = on;
    }

    /// Session 18 (`cuda_bench --ab-host`): the graph of the last replayed step launched `reps`
    /// times with its argmax, back to back, then one wait: seconds per step of GPU work
    /// without the host's part (metadata upload, result copy, the wait). Each replay recomputes
    /// that step (same token, same position, the same KV slot written again).
    pub fn replay_last(&mut self, reps: usize) -> Result<f64, CudaError> {
        let (bucket, split) = self
            .last_graph
            .ok_or_else(|| CudaError::Arg("no step has replayed a graph yet".into()))?;
        let g = self
            .graphs
            .iter()
            .find(|g| g.bucket == bucket && g.split == split)
            .ok_or_else(|| CudaError::Arg(format!("graph ({bucket}, {split}) is gone")))?;
        self.gpu.sync()?;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            g.graph
                .launch()
                .map_err(crate::error::drv("graph launch"))?;
            self.gpu.argmax_rows(
                self.s.logits.ptr(),
                self.cfg.n_vocab,
                bucket,
                self.s.argmax.ptr(),
            )?;
        }
        self.gpu.sync()?;
        Ok(t.elapsed().as_secs_f64() / reps.max(1) as f64)
    }

    /// Splits of the attention for `n` tokens whose longest context is `max_len`.
    fn splits(&self, n: usize, max_len: usize) -> (usize, usize) {
        // v2 sized this for 2 blocks per SM while max_split allowed 8: the captured decode graphs
        // walked 160-position slices per block at 4K context.
        let want = (SPLIT_CTAS_PER_SM * self.gpu.sms as usize)
            .div_ceil(n * self.cfg.n_head_kv)
            .max(1);
        // Prefill-sized steps: also keep each block's walk short (a 512-token prompt's last
        // token otherwise walks 512 positions in one block while the early ones idle).
        let by_len = if n > MV_MAX_NT {
            max_len.div_ceil(PREFILL_SLICE).min(PREFILL_MAX_SPLIT)
        } else {
            1
        };
        let n_split = want
            .max(by_len)
            .min(max_len.div_ceil(32))
            .min(self.max_split)
            .max(1);
        let mut split_len = max_len.div_ceil(n_split).div_ceil(32) * 32;
        if self.merge_in_split(n) {
            // The last block merges every slice itself: fewer, longer slices (v7).
            split_len = split_len.max(self.gpu.dec_slice.get().div_ceil(32) * 32);
        }
        (max_len.div_ceil(split_len), split_len)
    }

    /// Whether an `n`-token step's split attention merges its slices itself
    /// ([`Gpu::attn_decode_merge`], v7: one-token steps, `CROSSOVER_CUDA_FUSE_MERGE`).
    fn merge_in_split(&self, n: usize) -> bool {
        n == 1
            && self.gpu.fuse_merge.get()
            && self.decode_mma
            && kernels::PREFILL_HEAD_DIMS.contains(&self.cfg.head_dim)
    }

    /// `y (+)= W x` for `n` tokens, choosing GEMM, integer matvec (quantized weights: `x` is
    /// quantized first unless `acts` says the activation buffers already hold it) or f32 matvec.
    #[allow(clippy::too_many_arguments)]
    fn linear(
        gpu: &Gpu,
        opts: &CudaOptions,
        s: &Scratch,
        m: &Mat,
        x: u64,
        n: usize,
        y: u64,
        acc: bool,
        stats: &mut StepStats,
        acts: &mut Acts,
    ) -> Result<(), CudaError> {
        Self::linear_ss(gpu, opts, s, m, x, n, y, acc, stats, acts, 0).map(|_| ())
    }

    /// [`Self::linear`]; for one token on the integer matrix-vector kernels, also adds the
    /// outputs' squares into the slot set `ss` ([`Gpu::matvec_q_ss`]; 0: none). Returns whether
    /// it did.
    #[allow(clippy::too_many_arguments)]
    fn linear_ss(
        gpu: &Gpu,
        opts: &CudaOptions,
        s: &Scratch,
        m: &Mat,
        x: u64,
        n: usize,
        y: u64,
        acc: bool,
        stats: &mut StepStats,
        acts: &mut Acts,
        ss: u64,
    ) -> Result<bool, CudaError> {
        if let Some(h) = &m.host {
            return s
                .host
                .borrow_mut()
                .linear(gpu, h, x, n, y, acc)
                .map(|_| false);
        }
        let name = |e: CudaError| match e {
            CudaError::Arg(a) => CudaError::Arg(format!("{}: {a}", m.name)),
            o => o,
        };
        // Batched decode (9..64 tokens): integer products on the tensor cores, one pass over
        // the quantized weights for all tokens.
        if let Some(f) = kernels::act_format(m.ty).filter(|_| mmq_tokens(gpu, n)) {
            if acts.q != Some((x, f)) {
                if gpu.warp_quant.get() {
                    gpu.act_quant_w(x, 0, n, m.cols, Some(f), s.aq.ptr(), s.ad.ptr(), 0)
                } else {
                    gpu.quantize_act(x, n, m.cols, f, s.aq.ptr(), s.ad.ptr())
                }
                .map_err(name)?;
                acts.q = Some((x, f));
            }
            return gpu
                .matmul_q(
                    m.ty,
                    m.q.ptr(),
                    m.rows,
                    m.cols,
                    s.aq.ptr(),
                    s.ad.ptr(),
                    n,
                    y,
                    acc,
                )
                .map(|_| false)
                .map_err(name);
        }
        // Batched decode (9..64 tokens), Q4_K (session 10): tensor-core products on the
        // quantized weights in the CPU's integer order, where the workspace holds the plan's
        // partial sums (head-sized matrices run unsplit).
        if mmk_for(gpu, m, n)
            && s.fits_plan(
                &kernels::mmk_plan(gpu.sms as usize, m.rows, m.cols, n),
                m.rows,
                n,
            )
        {
            let f = ActFormat::Q8K;
            if acts.h != Some((x, Some(f), true)) {
                gpu.act_raw_w(x, 0, n, m.cols, f, s.rd.ptr(), s.xh.ptr())
                    .map_err(name)?;
                acts.h = Some((x, Some(f), true));
            }
            return gpu
                .matmul_q4k_mmk(
                    m.q.ptr(),
                    m.rows,
                    m.cols,
                    s.xh.ptr(),
                    s.rd.ptr(),
                    n,
                    y,
                    acc,
                    s.mmf_ws.ptr(),
                    s.mmf_cnt.ptr(),
                )
                .map(|_| false)
                .map_err(name);
        }
        // Batched decode (9..64 tokens): f16 tensor-core products reading the quantized weights
        // (the same f16 operands cuBLAS gets from the copies), where the workspace holds the
        // plan's partial sums (head-sized matrices run unsplit).
        let mmf = n > opts.gemm_min_tokens
            && mmf_tokens(gpu, n)
            && kernels::mmf_supports(m.ty)
            && m.cols.is_multiple_of(m.ty.block_size().max(32))
            && s.fits_plan(
                &kernels::mmf_plan(
                    gpu.sms as usize,
                    m.ty,
                    m.rows,
                    m.cols,
                    n,
                    gpu.mmf_warps.get(),
                ),
                m.rows,
                n,
            );
        if n > opts.gemm_min_tokens && gpu.has_blas() {
            let w = match (m.f16_ptr(), s.wf16.as_ref()) {
                _ if mmf => m.q.ptr(),
                (Some(b), _) => b,
                (None, Some(b)) => {
                    gpu.dequant_f16(m.ty, m.q.ptr(), m.rows, m.cols, b.ptr())?;
                    b.ptr()
                }
                (None, None) => 0,
            };
            if w != 0 {
                // The f16 operand holds the activations the CPU backend's integer products use
                // (its Q8_1 / Q8_K values, dequantized), so prompts and decode steps see the same
                // numbers up to f16 rounding; float weights take plain f16 activations.
                Self::f16_operand(gpu, s, x, n, m.cols, kernels::act_format(m.ty), acts)
                    .map_err(name)?;
                if mmf {
                    return gpu
                        .matmul_f16w(
                            m.ty,
                            m.q.ptr(),
                            m.rows,
                            m.cols,
                            s.xh.ptr(),
                            n,
                            y,
                            acc,
                            s.mmf_ws.ptr(),
                            s.mmf_cnt.ptr(),
                        )
                        .map(|_| false)
                        .map_err(name);
                }
                stats.gemm_calls += 1;
                return gpu
                    .gemm_f16(
                        w,
                        s.xh.ptr(),
                        y,
                        m.rows,
                        n,
                        m.cols,
                        if acc { 1.0 } else { 0.0 },
                    )
                    .map(|_| false);
            }
        }
        let fmt = kernels::act_format(m.ty);
        // Session 18: one token on the aligned Q6_K copy (the same bits), unless a switch
        // picks one of the Q6_K forms that copy has no kernel for.
        let q6a = q6a_for(gpu, m, n);
        if let Some(f) = fmt {
            if acts.q != Some((x, f)) {
                // Session 21: one token on a row too wide for the mvr kernels (the down
                // projection): the product quantizes x itself on clusters (the same bits).
                if n == 1 && gpu.mvqc_takes(m.ty, m.rows, m.cols, q6a.is_some()) {
                    let w = q6a.map_or(m.q.ptr(), |b| b.ptr());
                    return gpu
                        .matvec_q_cluster(m.ty, q6a.is_some(), w, m.rows, m.cols, x, y, acc, ss)
                        .map_err(name);
                }
                gpu.quantize_act(x, n, m.cols, f, s.aq.ptr(), s.ad.ptr())
                    .map_err(name)?;
                acts.q = Some((x, f));
            }
        }
        let mut t0 = 0;
        let mut wrote = false;
        while t0 < n {
            let nt = (n - t0).min(MV_MAX_NT);
            let yt = y + (t0 * m.rows * 4) as u64;
            wrote = match fmt {
                Some(_) => {
                    let (qo, dof) = kernels::act_bytes(t0, m.cols);
                    let ss = if n == 1 { ss } else { 0 };
                    matvec_q_int(gpu, m, n, (s.aq.at(qo), s.ad.at(dof)), nt, yt, acc, ss)
                }
                None => gpu
                    .matvec(
                        m.ty,
                        m.q.ptr(),
                        m.rows,
                        m.cols,
                        x + (t0 * m.cols * 4) as u64,
                        nt,
                        yt,
                        acc,
                    )
                    .map(|_| false),
            }
            .map_err(name)?;
            t0 += nt;
        }
        Ok(wrote)
    }

    /// Make `xh` the f16 GEMM operand of `n` rows of `x` (`cols` wide) in `fmt` (see
    /// [`Self::linear`]) unless `acts` says it already is.
    fn f16_operand(
        gpu: &Gpu,
        s: &Scratch,
        x: u64,
        n: usize,
        cols: usize,
        fmt: Option<ActFormat>,
        acts: &mut Acts,
    ) -> Result<(), CudaError> {
        let key = (x, fmt, false);
        if acts.h != Some(key) {
            match fmt {
                Some(f) if gpu.warp_quant.get() => {
                    gpu.act_f16_w(x, 0, n, cols, Some(f), s.xh.ptr())?
                }
                Some(f) => gpu.quantize_act_f16(x, n, cols, f, s.xh.ptr())?,
                None => gpu.to_f16(x, n * cols, s.xh.ptr())?,
            }
            acts.h = Some(key);
        }
        Ok(())
    }

    /// `y_i = W_i x` for matrices that read the same activation (a layer's Q, K and V): one
    /// token's products over consecutive matrices of one quantized type run as one launch
    /// ([`Gpu::matvec_q_multi`]); anything else goes through [`Self::linear`] one by one.
    #[allow(clippy::too_many_arguments)]
    fn linear_group(
        gpu: &Gpu,
        opts: &CudaOptions,
        s: &Scratch,
        mats: &[(&Mat, u64)],
        x: u64,
        n: usize,
        stats: &mut StepStats,
        acts: &mut Acts,
    ) -> Result<(), CudaError> {
        let one = n == 1 && (n <= opts.gemm_min_tokens || !gpu.has_blas());
        let mut i = 0;
        while i < mats.len() {
            let m = mats[i].0;
            let fmt = kernels::act_format(m.ty);
            let mut j = i + 1;
            if one && gpu.mvr_fits(m.cols) && m.host.is_none() && fmt.is_some() {
                while j < mats.len()
                    && mats[j].0.host.is_none()
                    && mats[j].0.ty == m.ty
                    && mats[j].0.cols == m.cols
                {
                    j += 1;
                }
            }
            if j - i < 2 {
                Self::linear(gpu, opts, s, m, x, n, mats[i].1, false, stats, acts)?;
                i += 1;
                continue;
            }
            if let Some(f) = fmt {
                if acts.q != Some((x, f)) {
                    gpu.quantize_act(x, n, m.cols, f, s.aq.ptr(), s.ad.ptr())?;
                    acts.q = Some((x, f));
                }
            }
            let segs: Vec<(u64, usize, u64)> = mats[i..j]
                .iter()
                .map(|&(mm, y)| (mm.q.ptr(), mm.rows, y))
                .collect();
            gpu.matvec_q_multi(m.ty, &segs, m.cols, s.aq.ptr(), s.ad.ptr(), false)
                .map_err(|e| match e {
                    CudaError::Arg(a) => CudaError::Arg(format!("{}: {a}", m.name)),
                    o => o,
                })?;
            i = j;
        }
        Ok(())
    }

    /// Hand the first `n * cols` floats of `buf` to the trace hook (if any) and write back what
    /// it leaves there; conversions cached from `buf` are redone or forgotten.
    #[allow(clippy::too_many_arguments)]
    fn trace_point(
        gpu: &Gpu,
        tr: &mut Option<Box<TraceFn>>,
        s: &Scratch,
        acts: &mut Acts,
        (name, layer, occ): (&str, usize, usize),
        buf: &DevBuf,
        n: usize,
        cols: usize,
    ) -> Result<(), CudaError> {
        let Some(f) = tr.as_mut() else {
            return Ok(());
        };
        let mut v = vec![0f32; n * cols];
        gpu.read(buf, 0, &mut v)?;
        f(name, layer, occ, &mut v);
        gpu.write(buf, 0, &v)?;
        if acts.h.is_some_and(|(p, _, _)| p == buf.ptr()) {
            acts.h = None;
        }
        if let Some((p, fmt)) = acts.q {
            if p == buf.ptr() {
                gpu.quantize_act(p, n, cols, fmt, s.aq.ptr(), s.ad.ptr())?;
            }
        }
        gpu.sync()
    }

    /// What the RMSNorm writing `out` and feeding `m` should produce besides `out`: on the
    /// matvec path the quantized activations (quantized weights), on the GEMM path the f16
    /// operand (`f16(d * q)` of the CPU's quantization of that matrix's activations, as
    /// [`Self::linear`] would convert it). Returns (f16 output, quantization) for
    /// [`Gpu::rms_norm`] and records in `acts` what the buffers will hold.
    fn norm_outputs(
        s: &Scratch,
        m: &Mat,
        matvec_path: bool,
        raw: bool,
        out: u64,
        acts: &mut Acts,
    ) -> (u64, Option<(ActFormat, u64, u64)>) {
        let f = kernels::act_format(m.ty);
        *acts = Acts::default();
        if matvec_path {
            acts.q = f.map(|f| (out, f));
            (0, f.map(|f| (f, s.aq.ptr(), s.ad.ptr())))
        } else if let Some(f) = f.filter(|_| raw) {
            // The Q4_K tensor-core products' operand (session 10).
            acts.h = Some((out, Some(f), true));
            (s.xh.ptr(), Some((f, 0, s.rd.ptr())))
        } else {
            acts.h = Some((out, f, false));
            (s.xh.ptr(), f.map(|f| (f, 0, 0)))
        }
    }

    /// RMSNorm of the step's `n` rows of `x` (see [`Gpu::rms_norm`]): prompt-sized steps that
    /// want the f16 GEMM operand take the warp-quantizing kernel ([`Gpu::rms_norm_w`]).
    /// `ss` = (filled, to zero) slot sets of [`Scratch::ss`] for one row (0: none): returns
    /// whether the launch took them ([`Gpu::rms_norm_ss`]), i.e. zeroed the second.
    #[allow(clippy::too_many_arguments)]
    fn norm_rows(
        gpu: &Gpu,
        x: u64,
        w: u64,
        e: usize,
        eps: f32,
        n: usize,
        out: u64,
        out_h: u64,
        quant: Option<(ActFormat, u64, u64)>,
        raw: bool,
        ss: (u64, u64),
        perm: bool,
    ) -> Result<bool, CudaError> {
        if raw {
            // norm_outputs chose the raw operand: the quantization is there.
            let (f, _, ds) = quant.ok_or_else(|| {
                CudaError::Arg("raw RMSNorm operand without a quantization".into())
            })?;
            return gpu
                .rms_norm_w_raw(x, w, e, eps, n, out, f, out_h, ds)
                .map(|_| false);
        }
        // v11: one row, a warp per 256-element group (the same bits).
        if n == 1 && gpu.rms1.get() && Gpu::rms1_fits(e) {
            return gpu
                .rms_norm1(x, w, e, eps, out, out_h, quant)
                .map(|_| false);
        }
        let blk = quant.map_or(32, |q| q.0.block().max(32));
        let wide = (out_h != 0 && n >= 32) || (quant.is_some() && n > MV_MAX_NT);
        if gpu.warp_quant.get() && wide && e.is_multiple_of(blk) {
            gpu.rms_norm_w(x, w, e, eps, n, out, out_h, quant)
                .map(|_| false)
        } else if let Some(q) = quant.filter(|q| {
            // Session 34: the slot sums and a quantized row only: a warp per group.
            n == 1
                && ss.0 != 0
                && out_h == 0
                && gpu.rms1s.get()
                && Gpu::rms1_fits(e)
                && (!perm || q.0 == kernels::ActFormat::Q8K)
        }) {
            gpu.rms_norm1s(x, w, e, eps, out, q, ss.0, ss.1, perm)
                .map(|_| true)
        } else if n == 1 && (ss.1 != 0 || perm) {
            gpu.rms_norm_ss(x, 0, w, e, eps, 1, out, out_h, quant, ss.0, ss.1, perm)
                .map(|_| true)
        } else {
            gpu.rms_norm(x, 0, w, e, eps, n, out, out_h, quant)
                .map(|_| false)
        }
    }

    /// Queue the whole forward pass for `n` tokens whose metadata is on the device; logits of
    /// the `n_out` rows listed in `out_rows` land in `logits`.
    fn enqueue(
        &mut self,
        n: usize,
        n_out: usize,
        n_split: usize,
        split_len: usize,
    ) -> Result<(), CudaError> {
        let r = self.enqueue_layers(n, n_out, n_split, split_len);
        // The side stream's prefetches rejoin the main stream whatever happened (a capture
        // cannot end with a stream it forked still apart).
        let j = self.gpu.side_join();
        r.and(j)
    }

    fn enqueue_layers(
        &mut self,
        n: usize,
        n_out: usize,
        n_split: usize,
        split_len: usize,
    ) -> Result<(), CudaError> {
        let merge = self.merge_in_split(n);
        let one = self.one_split(n);
        let mp = self.mp;
        let gpu = &self.gpu;
        let cfg = &self.cfg;
        let s = &self.s;
        let o = &self.opts;
        let st = &mut self.stats;
        let tr = &mut self.trace;
        let (e, hd, nh, nkv) = (cfg.n_embd, cfg.head_dim, cfg.n_head, cfg.n_head_kv);
        let (qd, kvd, ff) = (cfg.n_embd_q(), cfg.n_embd_kv(), cfg.n_ff);
        // Which activation the quantized-activation buffers hold now (pointer, format).
        let mut qc = Acts::default();
        gpu.get_rows(self.embd.ty, self.embd.q.ptr(), e, mp.ids, n, s.x.ptr())?;
        let matvec_path = n <= o.gemm_min_tokens || !gpu.has_blas();
        // Activations are quantized (not converted to f16) for the integer products: the
        // matrix-vector kernels, or the tensor-core integer GEMM of batched decode steps.
        let int_path = matvec_path || mmq_tokens(gpu, n);
        // Prompt-sized steps whose every chunk fills a good part of a 64-query tile.
        let mma = self.prefill_mma
            && n > MV_MAX_NT
            && kernels::PREFILL_HEAD_DIMS.contains(&hd)
            && self.meta.chunks.iter().all(|c| c.1 >= 16)
            && self.meta.ids.len() == n;
        // One token: the products normalize and quantize their own activations (v7).
        let prep = n == 1 && gpu.fuse_prep.get() && matvec_path && tr.is_none();
        // Session 16, one token: the products that write x add up its squares for the next
        // RMSNorm. `ss_full` is the slot set holding x's whole sum (0: none, the norm takes it
        // from the row), `ss_clear` the set the last norm zeroed for the next product.
        let use_ss = n == 1 && self.rms_ss && matvec_path && tr.is_none() && !prep;
        let ss_set = |k: usize| {
            if use_ss {
                s.ss.at(k * kernels::RMS_SLOTS * 8)
            } else {
                0
            }
        };
        let mut ss_full = 0u64;
        // The slot set the default down product filled this layer (0: none).
        let mut down_full = 0u64;
        // Batched steps on cuBLAS: Q/K/V and gate/up as one GEMM each on the fused copies (v10).
        let wide_gemm = self.fuse_gemm
            && tr.is_none()
            && !int_path
            && n > MV_MAX_NT
            && n <= MMQ_MAX_N
            && n <= s.qkv.bytes() / (4 * (qd + 2 * kvd))
            && gpu.has_blas()
            && !mmf_tokens(gpu, n);
        // Session 11: L2 prefetches of the weights ahead from the side stream.
        let side_one = self.side_l2 & SIDE_ONE != 0 && n == 1 && matvec_path && tr.is_none();
        let side_next = side_one && self.side_l2 & SIDE_ONE_NEXT != 0;
        let side_wide = self.side_l2 & SIDE_WIDE != 0 && wide_gemm;
        let cap = gpu.side_cfg.get().cap;
        let qr = |m: &Mat| (m.q.ptr(), if m.host.is_none() { m.q.bytes() } else { 0 });
        let hr = |m: &Mat| (m.f16_ptr().unwrap_or(0), (m.rows * m.cols * 2).min(cap));
        let br = |b: &Option<DevBuf>| b.as_ref().map_or((0, 0), |b| (b.ptr(), b.bytes().min(cap)));
        // Session 30: the next layer's cached K and V rows asked of L2 ahead of its attention
        // (one-token steps on the pipelined attention, long context classes only).
        let kv_pf = if n == 1 && one.is_some() && tr.is_none() && self.one_len >= self.kv_pf.min_len
        {
            self.kv_pf
        } else {
            KvPf::default()
        };
        let (kc_all, vc_all, max_blocks) = (&self.kc, &self.vc, self.max_blocks);
        let kv_prefetch = |li: usize| -> Result<(), CudaError> {
            match (kc_all.get(li), vc_all.get(li)) {
                (Some(k), Some(v)) => gpu.kv_prefetch(
                    (k.ptr(), v.ptr()),
                    (mp.pos, mp.seq, mp.btab, max_blocks, o.block_tokens),
                    nkv * hd * 2,
                    kv_pf.evict_last,
                    if kv_pf.blocks == 0 { 64 } else { kv_pf.blocks },
                ),
                _ => Ok(()),
            }
        };
        let layers = &self.layers;
        for (li, l) in layers.iter().enumerate() {
            // One token: Q/K/V products, RoPE and the KV-cache store in one launch.
            let qf = kernels::act_format(l.wq.ty);
            let rope_ok = n == 1
                && gpu.fuse.get()
                && matvec_path
                && tr.is_none()
                && gpu.mvr_fits(l.wq.cols)
                && [&l.wq, &l.wk, &l.wv]
                    .iter()
                    .all(|m| m.host.is_none() && kernels::act_format(m.ty) == qf)
                && l.wk.ty == l.wq.ty
                && gpu.mvr_fits(l.wv.cols)
                && l.bq.is_none()
                && l.bk.is_none()
                && l.bv.is_none()
                && cfg.rope_style != RopeStyle::Neox
                && qf.is_some();
            // ... with the RMSNorm and quantization inside that launch too.
            let prep_qkv = rope_ok && prep && gpu.mvr_prep_fits(l.wq.cols);
            // Session 20: whether the output projection takes the attention's f32 rows and
            // quantizes them itself (set with the one-token attention below).
            let mut o_from_f32 = false;
            let ss_in = std::mem::take(&mut ss_full);
            let mut ss_clear = 0u64;
            if !prep_qkv {
                let raw = !int_path && mmk_for(gpu, &l.wq, n);
                let (nh16, nq) = Self::norm_outputs(s, &l.wq, int_path, raw, s.xn.ptr(), &mut qc);
                let zero = ss_set(SS_FFN);
                let took = Self::norm_rows(
                    gpu,
                    s.x.ptr(),
                    l.attn_norm.ptr(),
                    e,
                    cfg.rms_norm_eps,
                    n,
                    s.xn.ptr(),
                    nh16,
                    nq,
                    raw,
                    (ss_in, zero),
                    false,
                )?;
                if took {
                    ss_clear = zero;
                }
                Self::trace_point(gpu, tr, s, &mut qc, ("attn_norm", li, 0), &s.xn, n, e)?;
            }
            let fused_rope = rope_ok && (prep_qkv || qc.q == qf.map(|f| (s.xn.ptr(), f)));
            let qkv_w = l.qkv16.as_ref().filter(|_| {
                wide_gemm
                    && !fused_rope
                    && !mmk_for(gpu, &l.wq, n)
                    && [&l.wk, &l.wv]
                        .iter()
                        .all(|m| kernels::act_format(m.ty) == qf)
            });
            let qkv_width = qd + 2 * kvd;
            if fused_rope {
                // V joins the launch when it has Q's type, else takes its own.
                let same = l.wv.ty == l.wq.ty;
                let mut launches = vec![(
                    l.wq.ty,
                    [l.wq.q.ptr(), l.wk.q.ptr(), l.wv.q.ptr()],
                    [l.wq.rows, l.wk.rows, if same { l.wv.rows } else { 0 }],
                )];
                if !same {
                    launches.push((l.wv.ty, [0, 0, l.wv.q.ptr()], [0, 0, l.wv.rows]));
                }
                let ap = kernels::ActPrep {
                    x: s.x.ptr(),
                    norm: l.attn_norm.ptr(),
                    eps: cfg.rms_norm_eps,
                };
                // v9: a V of another type joins the launch where a mixed kernel exists.
                if !same
                    && !prep_qkv
                    && self.qkv_mixed
                    && Gpu::qkv_mixed_fits(l.wq.ty, l.wv.ty)
                    && kernels::act_format(l.wv.ty) == qf
                {
                    launches.clear();
                }
                if launches.is_empty() {
                    // Session 20: V from its aligned copy where one was made.
                    let vcopy =
                        l.wv.q6a.as_ref().filter(|_| {
                            gpu.q6u.get() && gpu.q6a_group(l.wv.cols) == l.wv.q6a_group
                        });
                    gpu.matvec_q_qkv_rope_mixed(
                        l.wq.ty,
                        l.wv.ty,
                        vcopy.is_some(),
                        [
                            l.wq.q.ptr(),
                            l.wk.q.ptr(),
                            vcopy.map_or(l.wv.q.ptr(), DevBuf::ptr),
                        ],
                        [l.wq.rows, l.wk.rows, l.wv.rows],
                        l.wq.cols,
                        s.aq.ptr(),
                        s.ad.ptr(),
                        s.q.ptr(),
                        &self.rope,
                        mp.pos,
                        mp.slot,
                        hd,
                        kvd,
                        self.kc[li].ptr(),
                        self.vc[li].ptr(),
                    )
                    .map_err(|e| match e {
                        CudaError::Arg(a) => CudaError::Arg(format!("{}: {a}", l.wv.name)),
                        o => o,
                    })?;
                }
                for (ty, w, rows) in launches {
                    let (pos, slot) = (mp.pos, mp.slot);
                    let (kcl, vcl) = (self.kc[li].ptr(), self.vc[li].ptr());
                    let r = if prep_qkv {
                        gpu.matvec_q_qkv_rope_prep(
                            ty,
                            w,
                            rows,
                            l.wq.cols,
                            &ap,
                            s.q.ptr(),
                            &self.rope,
                            pos,
                            slot,
                            hd,
                            kvd,
                            kcl,
                            vcl,
                        )
                    } else {
                        gpu.matvec_q_qkv_rope(
                            ty,
                            w,
                            rows,
                            l.wq.cols,
                            s.aq.ptr(),
                            s.ad.ptr(),
                            s.q.ptr(),
                            &self.rope,
                            pos,
                            slot,
                            hd,
                            kvd,
                            kcl,
                            vcl,
                        )
                    };
                    r.map_err(|e| match e {
                        CudaError::Arg(a) => CudaError::Arg(format!("{}: {a}", l.wq.name)),
                        o => o,
                    })?;
                }
            } else if let Some(wb) = qkv_w {
                // v10: one GEMM; rows of the output hold Q, K, V side by side.
                Self::f16_operand(gpu, s, s.xn.ptr(), n, e, qf, &mut qc)?;
                st.gemm_calls += 1;
                gpu.gemm_f16(wb.ptr(), s.xh.ptr(), s.qkv.ptr(), qkv_width, n, e, 0.0)?;
            } else {
                let qkv = [(&l.wq, s.q.ptr()), (&l.wk, s.k.ptr()), (&l.wv, s.v.ptr())];
                Self::linear_group(gpu, o, s, &qkv, s.xn.ptr(), n, st, &mut qc)?;
            }
            if side_one {
                gpu.side_prefetch(&[qr(&l.wo), qr(&l.gate), qr(&l.up)])?;
            }
            for (name, b, w) in [("Qcur", &s.q, qd), ("Kcur", &s.k, kvd), ("Vcur", &s.v, kvd)] {
                Self::trace_point(gpu, tr, s, &mut qc, (name, li, 0), b, n, w)?;
            }
            if !fused_rope {
                let b = |x: &Option<DevBuf>| x.as_ref().map_or(0, DevBuf::ptr);
                let (qi, ki, vi, io) = if qkv_w.is_some() {
                    let io = kernels::RopeRows {
                        q_out: s.q.ptr(),
                        q_stride: qkv_width,
                        kv_stride: qkv_width,
                    };
                    (s.qkv.ptr(), s.qkv.at(qd * 4), s.qkv.at((qd + kvd) * 4), io)
                } else {
                    let io = kernels::RopeRows {
                        q_out: s.q.ptr(),
                        q_stride: qd,
                        kv_stride: kvd,
                    };
                    (s.q.ptr(), s.k.ptr(), s.v.ptr(), io)
                };
                gpu.rope_store_rows(
                    n,
                    qi,
                    ki,
                    vi,
                    [b(&l.bq), b(&l.bk), b(&l.bv)],
                    mp.pos,
                    mp.slot,
                    &self.rope,
                    nh,
                    nkv,
                    hd,
                    cfg.rope_style == RopeStyle::Neox,
                    self.kc[li].ptr(),
                    self.vc[li].ptr(),
                    io,
                )?;
            }
            Self::trace_point(gpu, tr, s, &mut qc, ("Qcur", li, 2), &s.q, n, qd)?;
            if mma {
                for (ci, &(t0, t, p0)) in self.meta.chunks.iter().enumerate() {
                    gpu.attn_prefill(
                        s.q.ptr(),
                        self.kc[li].ptr(),
                        self.vc[li].ptr(),
                        mp.btab + (ci * self.max_blocks * 4) as u64,
                        o.block_tokens,
                        t0,
                        t,
                        p0,
                        nh,
                        nkv,
                        hd,
                        s.att.ptr(),
                    )?;
                }
            } else if merge {
                // One token: the split attention merges its slices itself (v7).
                gpu.attn_decode_merge(
                    n,
                    s.q.ptr(),
                    self.kc[li].ptr(),
                    self.vc[li].ptr(),
                    mp.pos,
                    mp.seq,
                    mp.btab,
                    self.max_blocks,
                    o.block_tokens,
                    nh,
                    nkv,
                    hd,
                    n_split,
                    split_len,
                    s.part.ptr(),
                    Some((s.att.ptr(), s.acnt.ptr())),
                )?;
            } else if let Some(ns1) = one {
                // One token (v8): slices of whole tiles from the token's own length, the next
                // tile's copy in flight, the first two issued before the Q/K/V kernel ends.
                let (p, tp, a) = (s.part.ptr(), mp.pos, s.att.ptr());
                // v9: the merge quantizes the output projection's activation itself.
                let mq = kernels::act_format(l.wo.ty).filter(|_| {
                    self.one_merge
                        && self.one_merge_q
                        && matvec_path
                        && !prep
                        && l.wo.host.is_none()
                        && tr.is_none()
                        && Gpu::attn_merge_q_fits(nh, hd, ns1)
                });
                let kv = (mp.pos, mp.seq, mp.btab, self.max_blocks, o.block_tokens);
                let qkv = (s.q.ptr(), self.kc[li].ptr(), self.vc[li].ptr());
                // Session 18: one split (a context of one tile) writes the merged rows from the
                // attention itself, then quantize_act: merge_q's bits, a lighter launch.
                let direct = mq.filter(|_| ns1 == 1 && self.one_direct && self.one_early);
                // Session 20: after a one-split attention the staged output projection
                // quantizes its rows itself (no quantize_act launch). After a merge it does not:
                // the merge's own quantization is cheaper than the projection's (on the H200
                // the 3B step at depth 4096 took 1.460-1.465 ms that way against 1.446-1.448).
                o_from_f32 = direct.is_some() && gpu.mvsm_prep_fits(l.wo.ty, l.wo.rows, l.wo.cols);
                if let Some(f) = direct {
                    gpu.attn_one_direct(n, qkv, kv, nh, nkv, hd, a)?;
                    if !o_from_f32 {
                        gpu.quantize_act(a, n, qd, f, s.aq.ptr(), s.ad.ptr())?;
                        qc.q = Some((a, f));
                    }
                } else {
                    let attn = if self.one_early {
                        Gpu::attn_one
                    } else {
                        Gpu::attn_batch
                    };
                    attn(
                        gpu, n, qkv.0, qkv.1, qkv.2, kv.0, kv.1, kv.2, kv.3, kv.4, nh, nkv, hd,
                        ns1, p,
                    )?;
                    if let Some(f) = mq.filter(|_| !o_from_f32) {
                        gpu.attn_merge_q(n, p, tp, nh, hd, ns1, 0, a, f, s.aq.ptr(), s.ad.ptr())?;
                        qc.q = Some((a, f));
                    } else if self.one_merge && ns1 <= kernels::ATTN_MERGE_MAX_SPLIT {
                        gpu.attn_merge(n, p, tp, nh, hd, ns1, 0, a)?;
                    } else {
                        gpu.attn_combine(n, p, tp, nh, hd, ns1, 0, a)?;
                    }
                }
            } else if self.batch_attn
                && n > MV_MAX_NT
                && kernels::PREFILL_HEAD_DIMS.contains(&hd)
                && nh / nkv <= 8
            {
                // Many sequences (v7): each block walks a slice of several tiles, the next
                // tile's copy in flight; slices from each token's own length.
                let ab_split = (self.ab_ctas * gpu.sms as usize)
                    .div_ceil(n * nkv)
                    .min((n_split * split_len).div_ceil(64))
                    .clamp(1, self.max_split);
                if self.ab_merge {
                    gpu.attn_batch_merge(
                        n,
                        (s.q.ptr(), self.kc[li].ptr(), self.vc[li].ptr()),
                        (mp.pos, mp.seq, mp.btab, self.max_blocks, o.block_tokens),
                        nh,
                        nkv,
                        hd,
                        ab_split,
                        s.part.ptr(),
                        s.att.ptr(),
                        s.acnt.ptr(),
                    )?;
                } else if ab_split == 1 && !self.ab_fast_merge {
                    // Session 11: one split (tokens and KV heads fill the GPU): the attention
                    // writes the merged rows itself, attn_combine's bits.
                    gpu.attn_batch_direct(
                        n,
                        (s.q.ptr(), self.kc[li].ptr(), self.vc[li].ptr()),
                        (mp.pos, mp.seq, mp.btab, self.max_blocks, o.block_tokens),
                        nh,
                        nkv,
                        hd,
                        s.att.ptr(),
                    )?;
                    if side_wide {
                        gpu.side_prefetch(&[hr(&l.wo)])?;
                    }
                } else {
                    gpu.attn_batch(
                        n,
                        s.q.ptr(),
                        self.kc[li].ptr(),
                        self.vc[li].ptr(),
                        mp.pos,
                        mp.seq,
                        mp.btab,
                        self.max_blocks,
                        o.block_tokens,
                        nh,
                        nkv,
                        hd,
                        ab_split,
                        s.part.ptr(),
                    )?;
                    if side_wide {
                        gpu.side_prefetch(&[hr(&l.wo)])?;
                    }
                    // v10 (switch): v8's merge with its loads issued together, same bits.
                    let merge = if self.ab_fast_merge && ab_split <= kernels::ATTN_MERGE_MAX_SPLIT {
                        Gpu::attn_merge
                    } else {
                        Gpu::attn_combine
                    };
                    merge(
                        gpu,
                        n,
                        s.part.ptr(),
                        mp.pos,
                        nh,
                        hd,
                        ab_split,
                        0,
                        s.att.ptr(),
                    )?;
                }
            } else {
                let attn = if self.decode_mma && kernels::PREFILL_HEAD_DIMS.contains(&hd) {
                    Gpu::attn_decode
                } else {
                    Gpu::attn_partial
                };
                attn(
                    gpu,
                    n,
                    s.q.ptr(),
                    self.kc[li].ptr(),
                    self.vc[li].ptr(),
                    mp.pos,
                    mp.seq,
                    mp.btab,
                    self.max_blocks,
                    o.block_tokens,
                    nh,
                    nkv,
                    hd,
                    n_split,
                    split_len,
                    s.part.ptr(),
                )?;
                // On the integer path the output projection's activation is quantized by the
                // merge itself (one launch fewer per layer).
                let of = kernels::act_format(l.wo.ty).filter(|f| {
                    matvec_path
                        && !prep
                        && gpu.fuse.get()
                        && gpu.fuse_quant.get()
                        && l.wo.host.is_none()
                        && tr.is_none()
                        && (256 % hd == 0 || hd.is_multiple_of(256))
                        && qd.is_multiple_of(f.block())
                });
                gpu.attn_combine_q(
                    n,
                    s.part.ptr(),
                    mp.pos,
                    nh,
                    hd,
                    n_split,
                    split_len,
                    s.att.ptr(),
                    of.map(|f| (f, s.qcnt.ptr(), s.aq.ptr(), s.ad.ptr())),
                )?;
                if let Some(f) = of {
                    qc.q = Some((s.att.ptr(), f));
                }
            }
            Self::trace_point(gpu, tr, s, &mut qc, ("kqv_out", li, 0), &s.att, n, qd)?;
            if prep
                && l.wo.host.is_none()
                && kernels::act_format(l.wo.ty).is_some()
                && gpu.mvr_prep_fits(l.wo.cols)
            {
                // One token: the output projection quantizes the attention output itself (v7).
                let ap = kernels::ActPrep {
                    x: s.att.ptr(),
                    norm: 0,
                    eps: 0.0,
                };
                gpu.matvec_q_prep(
                    l.wo.ty,
                    l.wo.q.ptr(),
                    l.wo.rows,
                    l.wo.cols,
                    &ap,
                    s.x.ptr(),
                    true,
                )
                .map_err(|e| match e {
                    CudaError::Arg(a) => CudaError::Arg(format!("{}: {a}", l.wo.name)),
                    o => o,
                })?;
            } else if o_from_f32 {
                let wrote = gpu
                    .matvec_q_staged_prep(
                        l.wo.ty,
                        l.wo.q.ptr(),
                        l.wo.rows,
                        l.wo.cols,
                        s.att.ptr(),
                        s.x.ptr(),
                        true,
                        std::mem::take(&mut ss_clear),
                    )
                    .map_err(|e| match e {
                        CudaError::Arg(a) => CudaError::Arg(format!("{}: {a}", l.wo.name)),
                        o => o,
                    })?;
                if wrote {
                    ss_full = s.ss.at(SS_FFN * kernels::RMS_SLOTS * 8);
                }
            } else {
                let wrote = Self::linear_ss(
                    gpu,
                    o,
                    s,
                    &l.wo,
                    s.att.ptr(),
                    n,
                    s.x.ptr(),
                    true,
                    st,
                    &mut qc,
                    std::mem::take(&mut ss_clear),
                )?;
                if wrote {
                    ss_full = s.ss.at(SS_FFN * kernels::RMS_SLOTS * 8);
                }
            }
            ss_clear = 0;
            if side_one {
                gpu.side_prefetch(&[qr(&l.down)])?;
            }
            if kv_pf.at == 2 {
                kv_prefetch(li + 1)?;
            }
            if side_wide {
                gpu.side_prefetch(&[br(&l.gu16)])?;
            }
            Self::trace_point(gpu, tr, s, &mut qc, ("ffn_inp", li, 0), &s.x, n, e)?;
            let gf = kernels::act_format(l.gate.ty);
            // One token: the gate/up product normalizes and quantizes its activation itself (v7).
            // v6: the fused quantization of the down projection's activation.
            let fq = gpu.fuse.get() && gpu.fuse_quant.get();
            let prep_ffn = prep
                && !fq
                && l.gate.host.is_none()
                && l.up.host.is_none()
                && l.gate.ty == l.up.ty
                && gf.is_some()
                && gpu.mvr_prep_fits(l.gate.cols);
            let ss_in = std::mem::take(&mut ss_full);
            // One token: gate, up, SwiGLU and the down projection's activation quantization in
            // one launch, then the down product from the second activation buffers (`df`:
            // the format of that activation; the norm below must have quantized x for gate).
            let no_trace = tr.is_none();
            // One token on the integer SwiGLU product with x quantized by the norm.
            let one_glu = |qc: &Acts| {
                n == 1
                    && gpu.fuse.get()
                    && matvec_path
                    && no_trace
                    && gpu.mvr_fits(l.gate.cols)
                    && l.gate.host.is_none()
                    && l.up.host.is_none()
                    && l.gate.ty == l.up.ty
                    && gf.is_some()
                    && qc.q == gf.map(|g| (s.xn.ptr(), g))
            };
            let df_ok = |qc: &Acts| {
                kernels::act_format(l.down.ty).filter(|f| {
                    fq && one_glu(qc) && l.down.host.is_none() && ff.is_multiple_of(f.block())
                })
            };
            // Session 16: for the half-unit Q4_K product the norm stores the permuted layout
            // (session 29: with the fused quantization or, without it, before a quantize_act).
            let perm_ffn = !prep_ffn
                && (gpu.mvh_fits(l.gate.ty, l.gate.cols) || gpu.mvp_fits(l.gate.ty, l.gate.cols))
                && one_glu(&Acts {
                    q: gf.map(|g| (s.xn.ptr(), g)),
                    ..Acts::default()
                });
            let mut perm_used = false;
            if !prep_ffn {
                let raw = !int_path && mmk_for(gpu, &l.gate, n);
                let (nh16, nq) = Self::norm_outputs(s, &l.gate, int_path, raw, s.xn.ptr(), &mut qc);
                let zero = ss_set(SS_ATTN);
                let took = Self::norm_rows(
                    gpu,
                    s.x.ptr(),
                    l.ffn_norm.ptr(),
                    e,
                    cfg.rms_norm_eps,
                    n,
                    s.xn.ptr(),
                    nh16,
                    nq,
                    raw,
                    (ss_in, zero),
                    perm_ffn,
                )?;
                if took {
                    ss_clear = zero;
                    perm_used = perm_ffn;
                }
                Self::trace_point(gpu, tr, s, &mut qc, ("ffn_norm", li, 0), &s.xn, n, e)?;
            }
            // With the permuted layout the fused quantization needs the half-unit kernel (the
            // pipelined one has none); perm_used means one_glu held, so one of the two reads it.
            let df = df_ok(&qc).filter(|_| !perm_used || gpu.mvh_fits(l.gate.ty, l.gate.cols));
            // v10: gate and up as one GEMM on the fused copy (batched cuBLAS steps).
            let gu_w = l.gu16.as_ref().filter(|_| {
                let df = kernels::act_format(l.down.ty);
                wide_gemm
                    && !mmk_for(gpu, &l.gate, n)
                    && gpu.warp_quant.get()
                    && l.gate.rows == ff
                    && l.up.rows == ff
                    && l.down.cols == ff
                    && kernels::act_format(l.up.ty) == gf
                    && ff.is_multiple_of(df.map_or(32, |f| f.block().max(32)))
                    && n <= s.gu.bytes() / (8 * ff)
            });
            let mut down_x = s.g.ptr();
            if let Some(f) = df {
                let dq = Some(kernels::OutQuant {
                    fmt: f,
                    cnt: s.qcnt.ptr(),
                    qs: s.aq2.ptr(),
                    ds: s.ad2.ptr(),
                });
                let y = s.g.ptr();
                if perm_used {
                    gpu.matvec_q_swiglu_half(
                        l.gate.q.ptr(),
                        l.up.q.ptr(),
                        ff,
                        l.gate.cols,
                        s.aq.ptr(),
                        s.ad.ptr(),
                        y,
                        dq,
                    )?;
                } else {
                    gpu.matvec_q_swiglu_quant(
                        l.gate.ty,
                        l.gate.q.ptr(),
                        l.up.q.ptr(),
                        ff,
                        l.gate.cols,
                        s.aq.ptr(),
                        s.ad.ptr(),
                        1,
                        y,
                        dq,
                    )?;
                }
                // The down product as the default path runs it (the aligned Q6_K copy where
                // there is one), on the second activation buffers.
                let ss = std::mem::take(&mut ss_clear);
                let (qs, ds) = (s.aq2.ptr(), s.ad2.ptr());
                let wrote = matvec_q_int(gpu, &l.down, 1, (qs, ds), 1, s.x.ptr(), true, ss)
                    .map_err(|e| match e {
                        CudaError::Arg(a) => CudaError::Arg(format!("{}: {a}", l.down.name)),
                        o => o,
                    })?;
                if wrote {
                    ss_full = s.ss.at(SS_ATTN * kernels::RMS_SLOTS * 8);
                }
                qc = Acts::default();
                continue;
            }
            if perm_used {
                // Session 29: the half-unit product without the fused quantization (pipelined
                // where switched on); the down projection below quantizes its row as usual.
                if gpu.mvp_fits(l.gate.ty, l.gate.cols) {
                    gpu.matvec_q_swiglu_pipe(
                        l.gate.q.ptr(),
                        l.up.q.ptr(),
                        ff,
                        l.gate.cols,
                        s.aq.ptr(),
                        s.ad.ptr(),
                        s.g.ptr(),
                    )?;
                } else {
                    gpu.matvec_q_swiglu_half(
                        l.gate.q.ptr(),
                        l.up.q.ptr(),
                        ff,
                        l.gate.cols,
                        s.aq.ptr(),
                        s.ad.ptr(),
                        s.g.ptr(),
                        None,
                    )?;
                }
                qc = Acts::default();
            } else if prep_ffn {
                let ap = kernels::ActPrep {
                    x: s.x.ptr(),
                    norm: l.ffn_norm.ptr(),
                    eps: cfg.rms_norm_eps,
                };
                gpu.matvec_q_swiglu_prep(
                    l.gate.ty,
                    l.gate.q.ptr(),
                    l.up.q.ptr(),
                    ff,
                    l.gate.cols,
                    &ap,
                    s.g.ptr(),
                )?;
                qc = Acts::default();
            } else if matvec_path
                && !mmq_tokens(gpu, n)
                && l.gate.host.is_none()
                && l.up.host.is_none()
                && l.gate.ty == l.up.ty
                && gf.is_some()
                && qc.q == gf.map(|f| (s.xn.ptr(), f))
            {
                let (ff, cols) = (l.gate.rows, l.gate.cols);
                let mut t0 = 0;
                while t0 < n {
                    let nt = (n - t0).min(MV_MAX_NT);
                    let (qo, dof) = kernels::act_bytes(t0, cols);
                    gpu.matvec_q_swiglu(
                        l.gate.ty,
                        l.gate.q.ptr(),
                        l.up.q.ptr(),
                        ff,
                        cols,
                        s.aq.at(qo),
                        s.ad.at(dof),
                        nt,
                        s.g.at(t0 * ff * 4),
                    )?;
                    t0 += nt;
                }
            } else if matvec_path
                && gf.is_none()
                && l.gate.host.is_none()
                && l.up.host.is_none()
                && l.gate.ty == l.up.ty
                && n <= MV_MAX_NT
                && kernels::mv_rows_per_warp(l.gate.rows, n) == 1
            {
                gpu.matvec_swiglu(
                    l.gate.ty,
                    l.gate.q.ptr(),
                    l.up.q.ptr(),
                    l.gate.rows,
                    l.gate.cols,
                    s.xn.ptr(),
                    n,
                    s.g.ptr(),
                )?;
            } else if let Some(wb) = gu_w {
                // v10: gate and up in one GEMM (rows: gate outputs, then up outputs), the
                // SwiGLU and the down product's f16 operand read them with the row stride.
                Self::f16_operand(gpu, s, s.xn.ptr(), n, e, gf, &mut qc)?;
                st.gemm_calls += 1;
                gpu.gemm_f16(wb.ptr(), s.xh.ptr(), s.gu.ptr(), 2 * ff, n, e, 0.0)?;
                if side_wide {
                    gpu.side_prefetch(&[hr(&l.down)])?;
                }
                let df = kernels::act_format(l.down.ty);
                gpu.act_f16_strided(s.gu.ptr(), s.gu.at(ff * 4), n, ff, 2 * ff, df, s.xh.ptr())?;
                qc.h = Some((s.gu.ptr(), df, false));
                down_x = s.gu.ptr();
            } else {
                for (m, y) in [(&l.gate, s.g.ptr()), (&l.up, s.u.ptr())] {
                    Self::linear(gpu, o, s, m, s.xn.ptr(), n, y, false, st, &mut qc)?;
                }
                let dq = kernels::act_format(l.down.ty).filter(|f| {
                    mmq_tokens(gpu, n) && gpu.warp_quant.get() && ff.is_multiple_of(f.block())
                });
                if let Some(f) = dq {
                    // The down product's activation quantized with the SwiGLU (one launch).
                    gpu.act_quant_w(
                        s.g.ptr(),
                        s.u.ptr(),
                        n,
                        ff,
                        Some(f),
                        s.aq.ptr(),
                        s.ad.ptr(),
                        0,
                    )?;
                    qc.q = Some((s.g.ptr(), f));
                } else if int_path {
                    gpu.swiglu(s.g.ptr(), s.u.ptr(), n * cfg.n_ff)?;
                } else {
                    // The down projection's f16 operand comes with the product (one launch).
                    let df = kernels::act_format(l.down.ty);
                    if let Some(f) = df.filter(|_| mmk_for(gpu, &l.down, n)) {
                        gpu.act_raw_w(s.g.ptr(), s.u.ptr(), n, ff, f, s.rd.ptr(), s.xh.ptr())?;
                        qc.h = Some((s.g.ptr(), df, true));
                    } else if gpu.warp_quant.get()
                        && ff.is_multiple_of(df.map_or(32, |f| f.block().max(32)))
                    {
                        gpu.act_f16_w(s.g.ptr(), s.u.ptr(), n, ff, df, s.xh.ptr())?;
                    } else {
                        gpu.swiglu_f16(s.g.ptr(), s.u.ptr(), n, ff, df, s.xh.ptr())?;
                    }
                    qc.h = Some((s.g.ptr(), df, false));
                }
            }
            if kv_pf.at == 1 {
                kv_prefetch(li + 1)?;
            }
            if side_next {
                if let Some(nl) = layers.get(li + 1) {
                    gpu.side_prefetch(&[qr(&nl.wq), qr(&nl.wk), qr(&nl.wv)])?;
                }
            }
            Self::trace_point(gpu, tr, s, &mut qc, ("ffn_swiglu", li, 0), &s.g, n, ff)?;
            if prep
                && gpu.wide.get()
                && l.down.host.is_none()
                && kernels::act_format(l.down.ty).is_some()
                && !gpu.mvr_fits(l.down.cols)
                && gpu.mvw_fits(l.down.cols)
            {
                // One token: the down projection quantizes the SwiGLU output itself (v7).
                gpu.matvec_q_wide_prep(
                    l.down.ty,
                    l.down.q.ptr(),
                    l.down.rows,
                    l.down.cols,
                    s.g.ptr(),
                    s.x.ptr(),
                    true,
                )
                .map_err(|e| match e {
                    CudaError::Arg(a) => CudaError::Arg(format!("{}: {a}", l.down.name)),
                    o => o,
                })?;
            } else {
                // Session 18: down adds the squares of the row it writes for the next layer's
                // attention norm (before, only the fuse_quant path did, so that norm summed
                // its row).
                let ss = if self.down_ss {
                    std::mem::take(&mut ss_clear)
                } else {
                    0
                };
                let wrote = Self::linear_ss(
                    gpu,
                    o,
                    s,
                    &l.down,
                    down_x,
                    n,
                    s.x.ptr(),
                    true,
                    st,
                    &mut qc,
                    ss,
                )?;
                if wrote {
                    down_full = s.ss.at(SS_ATTN * kernels::RMS_SLOTS * 8);
                }
            }
            if side_wide {
                if let Some(nl) = layers.get(li + 1) {
                    gpu.side_prefetch(&[br(&nl.qkv16)])?;
                }
            }
            // g and att are rewritten next layer: forget their quantized copies.
            qc = Acts::default();
            // x's sum: in the slots down wrote, or (0) in none.
            ss_full = std::mem::take(&mut down_full);
            Self::trace_point(gpu, tr, s, &mut qc, ("l_out", li, 0), &s.x, n, e)?;
        }
        if n_out == 0 {
            return Ok(());
        }
        let out = self.output.as_ref().unwrap_or(&self.embd);
        let out_path = n_out <= o.gemm_min_tokens || !gpu.has_blas() || mmq_tokens(gpu, n_out);
        let (nh16, nq) = Self::norm_outputs(s, out, out_path, false, s.hn.ptr(), &mut qc);
        if ss_full != 0 && n == 1 && n_out == 1 {
            // One token: its only row is row 0 of x.
            gpu.rms_norm_ss(
                s.x.ptr(),
                0,
                self.output_norm.ptr(),
                e,
                cfg.rms_norm_eps,
                1,
                s.hn.ptr(),
                nh16,
                nq,
                ss_full,
                0,
                false,
            )?;
        } else {
            gpu.rms_norm(
                s.x.ptr(),
                mp.out_rows,
                self.output_norm.ptr(),
                e,
                cfg.rms_norm_eps,
                n_out,
                s.hn.ptr(),
                nh16,
                nq,
            )?;
        }
        Self::linear(
            gpu,
            o,
            s,
            out,
            s.hn.ptr(),
            n_out,
            s.logits.ptr(),
            false,
            st,
            &mut qc,
        )
    }

    fn is_decode(&self, batch: &StepBatch) -> bool {
        let n = batch.chunks.len();
        self.opts.graphs
            && self.trace.is_none()
            && self.graph_failed.is_none()
            && !self.any_host()
            && n > 0
            && (n <= MV_MAX_NT || (n <= MMQ_MAX_N && self.wide_graph_failed.is_none()))
            && batch
                .chunks
                .iter()
                .all(|c| c.tokens.len() == 1 && c.want != Want::None)
    }

    /// Run a step, leaving logits of the wanted rows on the device. Returns the row count.
    fn run_step(&mut self, batch: &StepBatch) -> Result<usize, BackendError> {
        self.check(batch)?;
        for c in &batch.chunks {
            self.alloc.grow(c.seq, c.start_pos + c.tokens.len())?;
        }
        let n = batch.n_tokens();
        if n == 0 {
            return Ok(0);
        }
        if self.exact.is_some() {
            return self.run_exact(batch);
        }
        if self.is_decode(batch) {
            let bucket = DECODE_BUCKETS
                .iter()
                .copied()
                .find(|&b| n <= b)
                .unwrap_or(MMQ_MAX_N);
            let (n_out, max_len) = self.build_meta(batch, bucket, true);
            self.upload_meta().map_err(dev)?;
            match self.replay(bucket, n_out, max_len) {
                Ok(()) => {
                    self.stats.graph_steps += 1;
                    // Rows of padding tokens are computed but never read.
                    return Ok(n);
                }
                Err(CudaError::CaptureInvalidated) => {
                    // Other work on the device broke this capture (another handle loading):
                    // this step runs eagerly and the next one captures again.
                    self.stats.captures_invalidated += 1;
                }
                Err(e) if bucket > MV_MAX_NT => {
                    // A wide step's capture failing (cuBLAS where the integer GEMM does not
                    // apply) leaves the narrow buckets' graphs in use.
                    self.wide_graph_failed = Some(e.to_string());
                    self.graphs.retain(|g| g.bucket <= MV_MAX_NT);
                }
                Err(e) => {
                    // Capture can fail on drivers or tools that forbid it: fall back to eager
                    // launches for the rest of the run, and say why.
                    self.graph_failed = Some(e.to_string());
                    self.graphs.clear();
                }
            }
        }
        self.run_eager(batch)
    }

    /// Turn exact mode on ([`crate::exact`]): check the model can run it and make its view of
    /// the weights and caches (scratch comes at the first step). `factors`: the file's RoPE
    /// frequency factors, as the CPU backend reads them.
    fn enable_exact(
        &mut self,
        orders: (quant::dot::SumOrder, quant::dot::SumOrder),
        factors: Option<&[f32]>,
    ) -> Result<(), String> {
        let mut mats: Vec<&Mat> = Vec::new();
        for l in &self.layers {
            mats.extend([&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down]);
        }
        let out = self.output.as_ref().unwrap_or(&self.embd);
        mats.push(out);
        if let Some(m) = mats.iter().find(|m| m.host.is_some()) {
            return Err(format!(
                "exact mode runs every product on the GPU, but {} is placed on the host",
                m.name
            ));
        }
        let types: Vec<(&str, GgmlType)> = mats.iter().map(|m| (m.name.as_str(), m.ty)).collect();
        exact::check_model(&self.cfg, &types)?;
        let em = |m: &Mat| exact::ExactMat {
            ty: m.ty,
            rows: m.rows,
            cols: m.cols,
            w: m.q.ptr(),
        };
        let cfg = &self.cfg;
        let model = exact::ExactModel {
            cfg: cfg.clone(),
            layers: self
                .layers
                .iter()
                .map(|l| exact::ExactLayer {
                    attn_norm: l.attn_norm.ptr(),
                    ffn_norm: l.ffn_norm.ptr(),
                    wq: em(&l.wq),
                    wk: em(&l.wk),
                    wv: em(&l.wv),
                    wo: em(&l.wo),
                    gate: em(&l.gate),
                    up: em(&l.up),
                    down: em(&l.down),
                    bq: l.bq.as_ref().map(DevBuf::ptr),
                    bk: l.bk.as_ref().map(DevBuf::ptr),
                    bv: l.bv.as_ref().map(DevBuf::ptr),
                })
                .collect(),
            output_norm: self.output_norm.ptr(),
            output: em(out),
            rope: model::Rope::new(
                cfg.n_rot,
                cfg.rope_freq_base,
                cfg.rope_freq_scale(),
                factors,
                cfg.rope_style,
            ),
            kc: self.kc.iter().map(DevBuf::ptr).collect(),
            vc: self.vc.iter().map(DevBuf::ptr).collect(),
            block_tokens: self.opts.block_tokens,
            orders,
        };
        self.exact = Some(ExactState {
            model,
            bufs: None,
            store: Vec::new(),
        });
        self.info.device.push_str(&format!(
            ", exact mode ({} prompts, {} decode: the CPU backend's logits bit for bit)",
            orders.0.name(),
            orders.1.name()
        ));
        Ok(())
    }

    /// `batch` through [`exact::forward`] (KV blocks already allocated): the logits rows it
    /// wants, in [`Scratch::logits`].
    fn run_exact(&mut self, batch: &StepBatch) -> Result<usize, BackendError> {
        let Some(ex) = self.exact.as_mut() else {
            return Ok(0);
        };
        let mut ops = exact::GpuExact {
            gpu: &self.gpu,
            embd: (self.embd.q.ptr(), self.embd.ty, self.cfg.n_embd),
            bufs: std::mem::take(&mut ex.store),
        };
        if ex.bufs.is_none() {
            let b = exact::ExactBufs::new(
                &mut ops,
                &self.cfg,
                self.opts.max_batch_tokens,
                self.opts.max_seqs,
                self.opts.ctx_size,
                self.max_blocks,
            );
            match b {
                Ok(b) => ex.bufs = Some(b),
                Err(e) => {
                    ex.store = ops.bufs;
                    return Err(dev(e));
                }
            }
        }
        let chunks = exact::ExChunk::of(batch, &self.alloc);
        let r = match ex.bufs.as_ref() {
            Some(b) => exact::forward(&ops, &ex.model, b, &chunks, self.s.logits.ptr()),
            None => Ok(0),
        };
        ex.store = ops.bufs;
        self.stats.eager_steps += 1;
        r
    }

    /// `batch` as eager launches (its KV blocks already allocated): the logits rows it wants.
    fn run_eager(&mut self, batch: &StepBatch) -> Result<usize, BackendError> {
        let n = batch.n_tokens();
        let (n_out, max_len) = self.build_meta(batch, n, false);
        self.upload_meta().map_err(dev)?;
        let (n_split, split_len) = self.splits(n, max_len);
        self.one_len = max_len;
        self.enqueue(n, n_out, n_split, split_len).map_err(dev)?;
        self.stats.eager_steps += 1;
        Ok(n_out)
    }

    fn replay(&mut self, bucket: usize, n_out: usize, max_len: usize) -> Result<(), CudaError> {
        // One-token graphs: one per class of context lengths (the attention's split count).
        self.one_len = max_len;
        let split = self.one_split(bucket).unwrap_or(0);
        if split > 0 {
            // The class's longest context: its graph serves every length up to it.
            self.one_len = if split < self.one_split_full() {
                let tiles = if split == 1 { self.one_tiles } else { split };
                (tiles * ONE_TILE).min(self.opts.ctx_size)
            } else {
                self.opts.ctx_size
            };
        }
        self.last_graph = Some((bucket, split));
        if let Some(g) = self
            .graphs
            .iter()
            .find(|g| g.bucket == bucket && g.split == split)
        {
            return g.graph.launch().map_err(crate::error::drv("graph launch"));
        }
        // Capture with splits sized for the longest context, so one graph serves any length
        // (one-token graphs: any length of their class).
        let (n_split, split_len) = self.splits(bucket, self.opts.ctx_size);
        if self.gpu.lt_wants(bucket) && !self.tuned.contains(&(bucket, self.fuse_gemm)) {
            // v10: one eager pass first, so that every product shape of this bucket is tuned
            // (timing is impossible inside a capture), unless tuning at load covered it. It
            // writes what the replay below writes.
            self.enqueue(bucket, n_out, n_split, split_len)?;
        }
        let stream = self.gpu.stream.clone();
        stream
            .begin_capture(
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
            .map_err(crate::error::drv("begin capture"))?;
        let r = self.enqueue(bucket, n_out, n_split, split_len);
        let g = stream.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
        use cudarc::driver::sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED as INVALIDATED;
        if matches!(&g, Err(e) if e.0 == INVALIDATED) {
            return Err(CudaError::CaptureInvalidated);
        }
        r?;
        let graph = g
            .map_err(crate::error::drv("end capture"))?
            .ok_or_else(|| CudaError::Arg("capture produced no graph".into()))?;
        graph.upload().map_err(crate::error::drv("graph upload"))?;
        graph.launch().map_err(crate::error::drv("graph launch"))?;
        self.graphs.push(Graph {
            bucket,
            split,
            graph,
        });
        Ok(())
    }

    /// Run a step and return the greedy (argmax) token of each wanted row, computed on the GPU:
    /// 4 bytes per row cross the bus instead of a row of logits.
    pub fn step_greedy(&mut self, batch: &StepBatch) -> Result<Vec<u32>, BackendError> {
        let rows = self.run_step(batch)?;
        self.pick_rows(rows)
    }

    /// The greedy picks of the first `rows` logits rows of the step just queued.
    fn pick_rows(&mut self, rows: usize) -> Result<Vec<u32>, BackendError> {
        if rows == 0 {
            return Ok(Vec::new());
        }
        let g = &self.gpu;
        g.argmax_rows(
            self.s.logits.ptr(),
            self.cfg.n_vocab,
            rows,
            self.s.argmax.ptr(),
        )
        .map_err(dev)?;
        let mut ids = vec![0i32; rows];
        g.read(&self.s.argmax, 0, &mut ids).map_err(dev)?;
        Ok(ids.into_iter().map(|i| i as u32).collect())
    }

    /// Session 18: `steps` greedy one-token steps of the sequences of `batch` (each chunk one
    /// token, [`runtime::Backend::decode_greedy`]) queued without waiting for any pick: step
    /// `k` replays its graph, its argmax writes the picks, and a device copy makes them the
    /// token ids of step `k + 1`, whose other metadata the host uploads ahead (the ids stay).
    /// One wait at the end reads every pick. The same graphs and kernels as `steps` calls of
    /// [`Self::step_greedy`], so the same picks; steps that are not graph-replayed decode
    /// steps (or a graph that fails) take [`Self::step_greedy`] one by one.
    pub fn decode_greedy(
        &mut self,
        batch: &StepBatch,
        steps: usize,
    ) -> Result<Vec<Vec<u32>>, BackendError> {
        let rows = batch.chunks.len();
        let one_each = batch
            .chunks
            .iter()
            .all(|c| c.tokens.len() == 1 && c.want == Want::Last);
        if steps <= 1 || !one_each || !self.is_decode(batch) || !self.chain || self.exact.is_some()
        {
            return runtime::Backend::decode_greedy(self, batch, steps);
        }
        self.check(batch)?;
        let ctx = self.opts.ctx_size;
        for c in &batch.chunks {
            if c.start_pos + steps > ctx {
                return Err(BackendError::ContextOverflow {
                    seq: c.seq,
                    pos: c.start_pos + steps - 1,
                    max: ctx,
                });
            }
        }
        // Room for every step's KV rows, or the steps one at a time (whose own check names the
        // step that finds the cache full).
        let need: usize = batch
            .chunks
            .iter()
            .map(|c| self.alloc.blocks_needed(c.seq, c.start_pos + steps))
            .sum();
        if need > self.alloc.stats().blocks_free() {
            return runtime::Backend::decode_greedy(self, batch, steps);
        }
        let bucket = DECODE_BUCKETS
            .iter()
            .copied()
            .find(|&b| rows <= b)
            .unwrap_or(MMQ_MAX_N);
        let need = steps * rows * 4;
        if self.chain_picks.as_ref().is_none_or(|b| b.bytes() < need) {
            self.chain_picks = Some(self.gpu.alloc(need).map_err(dev)?);
        }
        let picks = self.chain_picks.as_ref().map_or(0, DevBuf::ptr);
        let mut b = batch.clone();
        let mut done = 0;
        while done < steps {
            for c in &b.chunks {
                self.alloc.grow(c.seq, c.start_pos + 1)?;
            }
            let (n_out, max_len) = self.build_meta(&b, bucket, true);
            self.upload_meta_from(done > 0).map_err(dev)?;
            if done > 0 {
                // The previous step's picks are this step's tokens.
                let prev = picks + ((done - 1) * rows * 4) as u64;
                self.gpu
                    .copy_dtod(self.mp.ids, prev, rows * 4)
                    .map_err(dev)?;
            }
            if let Err(e) = self.replay(bucket, n_out, max_len) {
                // As in a single step: later steps launch eagerly, or capture again after an
                // invalidated capture; this one runs eagerly below, with the picks so far.
                match e {
                    CudaError::CaptureInvalidated => self.stats.captures_invalidated += 1,
                    e => {
                        self.graph_failed = Some(e.to_string());
                        self.graphs.clear();
                    }
                }
                break;
            }
            self.stats.graph_steps += 1;
            let out = picks + (done * rows * 4) as u64;
            self.gpu
                .argmax_rows(self.s.logits.ptr(), self.cfg.n_vocab, rows, out)
                .map_err(dev)?;
            done += 1;
            for c in b.chunks.iter_mut() {
                c.start_pos += 1;
            }
        }
        let mut ids = vec![0i32; done * rows];
        if let Some(pb) = &self.chain_picks {
            self.gpu.read(pb, 0, &mut ids).map_err(dev)?;
        }
        let mut out: Vec<Vec<u32>> = ids
            .chunks_exact(rows.max(1))
            .map(|r| r.iter().map(|&i| i as u32).collect())
            .collect();
        // A graph that could not replay: that step eagerly (its KV rows are allocated), the
        // rest one step at a time, each with its own fallbacks.
        let mut eager = done < steps;
        while out.len() < steps {
            if let Some(last) = out.last() {
                for (c, &id) in b.chunks.iter_mut().zip(last) {
                    c.tokens = vec![id];
                }
            }
            let ids = if std::mem::take(&mut eager) {
                let n = self.run_eager(&b)?;
                self.pick_rows(n)?
            } else {
                self.step_greedy(&b)?
            };
            out.push(ids);
            for c in b.chunks.iter_mut() {
                c.start_pos += 1;
            }
        }
        Ok(out)
    }

    /// Session 18 A/B ([`Self::decode_greedy`]): queue greedy steps without a host round trip
    /// between them (`true`, the default) or take [`Self::step_greedy`] one by one.
    pub fn set_chain(&mut self, on: bool) {
        self.chain = on;
    }

    /// Wait for queued work (for timing).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.gpu.sync()
    }
}

/// Whether a product over `n` tokens takes the tensor-core integer GEMM ([`Gpu::matmul_q`]):
/// steps of 9..64 tokens, while it is switched on (`Gpu::mmq`, off by default).
fn mmq_tokens(gpu: &Gpu, n: usize) -> bool {
    gpu.mmq.get() && n > MV_MAX_NT && n <= MMQ_MAX_N
}

/// `y (+)= m x` for `nt` of a step's `n` tokens on activations quantized at `act` (values,
/// scales) in `m`'s format, on the aligned Q6_K copy where one-token products read it
/// ([`q6a_for`]); whether the squares went into `ss`.
#[allow(clippy::too_many_arguments)]
fn matvec_q_int(
    gpu: &Gpu,
    m: &Mat,
    n: usize,
    (qs, ds): (u64, u64),
    nt: usize,
    y: u64,
    acc: bool,
    ss: u64,
) -> Result<bool, CudaError> {
    match q6a_for(gpu, m, n) {
        Some(wa) => gpu.matvec_q6ka_ss(m.ty, wa.ptr(), m.rows, m.cols, qs, ds, 1, y, acc, ss),
        None => gpu.matvec_q_ss(m.ty, m.q.ptr(), m.rows, m.cols, qs, ds, nt, y, acc, ss),
    }
}

/// The aligned Q6_K copy a one-token product of `m` reads (the same bits, session 18), unless
/// a switch picks one of the Q6_K forms that copy has no kernel for, or [`Gpu::q6a_g`] changed
/// since the copy was made (its products would read another layout).
fn q6a_for<'a>(gpu: &Gpu, m: &'a Mat, n: usize) -> Option<&'a DevBuf> {
    m.q6a.as_ref().filter(|_| {
        n == 1
            && gpu.q6a_group(m.cols) == m.q6a_group
            && gpu.q6a.get()
            && !gpu.q6_half.get()
            && !gpu.warp_rows.get()
            && gpu.mvr_lb4.get()
            && gpu.pdl.get()
            && gpu.mvq_pf.get()
    })
}

/// Whether a product of `n` tokens with `m` takes the Q4_K tensor-core kernels in the CPU's
/// integer order ([`Gpu::matmul_q4k_mmk`]; `Gpu::mmk`, off by default).
fn mmk_for(gpu: &Gpu, m: &Mat, n: usize) -> bool {
    gpu.mmk.get()
        && m.ty == GgmlType::Q4K
        && m.host.is_none()
        && n > MV_MAX_NT
        && n <= MMQ_MAX_N
        && !gpu.mmq.get()
        && m.cols.is_multiple_of(256)
}

/// One product class of [`CudaBackend::bench_batched`]: (class, launches, ms per launch with the
/// Q4_K integer-order kernels, with the f16 products on quantized weights in blocks of 8 warps
/// and with cuBLAS, quantized weight bytes per launch).
pub type BatchedTiming = (String, usize, [f64; 3], f64);

/// Whether a product over `n` tokens takes the f16 tensor-core kernels on the quantized weights
/// ([`Gpu::matmul_f16w`]) rather than cuBLAS on the f16 copies: steps of 9..64 tokens, while
/// `Gpu::mmf` is on (off by default).
fn mmf_tokens(gpu: &Gpu, n: usize) -> bool {
    gpu.mmf.get() && n > MV_MAX_NT && n <= MMQ_MAX_N
}

/// Batch sizes decode graphs are captured for: a step of `n` sequences replays the smallest
/// bucket that holds it, the rest padding. Past 8 the products take cuBLAS (or the integer
/// GEMM), whose time grows slowly with the token count, so padding costs little.
/// [`CudaBackend::set_side_l2`] bit: one-token steps ask L2 for O and gate/up once Q/K/V is
/// launched, and for down once O is (session 11).
pub const SIDE_ONE: u8 = 1;
/// Bit: batched cuBLAS steps ask L2 for the start of each next f16 copy (O during the attention
/// merge, gate/up after O, down after gate/up, the next Q/K/V after down).
pub const SIDE_WIDE: u8 = 2;
/// Bit: one-token steps also ask for the next layer's Q/K/V once gate/up is launched.
pub const SIDE_ONE_NEXT: u8 = 4;

const DECODE_BUCKETS: [usize; 9] = [1, 2, 4, 8, 16, 24, 32, 48, 64];

/// Most attention splits any step uses: enough to spread one token's context over twice the
/// multiprocessors, never slices shorter than 32 positions.
fn max_split(sms: usize, ctx: usize) -> usize {
    (SPLIT_CTAS_PER_SM * sms).min(ctx.div_ceil(32)).max(1)
}

/// Attention blocks per multiprocessor a step aims for: each block walks its slice of the context
/// one position per warp-iteration, latency-bound, so many short slices beat a few long ones.
const SPLIT_CTAS_PER_SM: usize = 8;
/// Positions per tile of the one-token split attention (its slices are whole tiles).
const ONE_TILE: usize = 64;
/// Longest context slice one attention block walks in a prefill-sized step.
const PREFILL_SLICE: usize = 64;
/// Most slices of one token's context in a prefill-sized step (bounds the partial-result buffer).
const PREFILL_MAX_SPLIT: usize = 16;

impl Backend for CudaBackend {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn support(&self, op: &OpDesc) -> Support {
        crate::host::cuda_support(&self.opts.host, op)
    }

    fn step(&mut self, batch: &StepBatch) -> Result<StepOutput, BackendError> {
        let rows = self.run_step(batch)?;
        let nv = self.cfg.n_vocab;
        // Graph steps compute a row for every padded token; the wanted rows are the first ones.
        let mut logits = vec![0f32; rows * nv];
        self.gpu.read(&self.s.logits, 0, &mut logits).map_err(dev)?;
        Ok(StepOutput {
            n_vocab: nv,
            logits,
        })
    }

    /// The greedy picks on the GPU ([`CudaBackend::step_greedy`]): one id per row comes back
    /// instead of the rows (512 KB per row for a 128,256-token vocabulary).
    fn step_argmax(&mut self, batch: &StepBatch) -> Result<Vec<u32>, BackendError> {
        self.step_greedy(batch)
    }

    /// Session 21: with [`Gpu::top_k_dev`] on, up to [`kernels::TOPK_MAX`].
    fn device_top_k(&self) -> usize {
        if self.gpu.top_k_dev.get() {
            kernels::TOPK_MAX
        } else {
            0
        }
    }

    /// Session 21: each row's k best logits selected on the GPU ([`Gpu::top_k_rows`]: k pairs
    /// per row cross the bus instead of the row); where that is off or does not take `k`, the
    /// rows are copied and selected on the host (the trait's default).
    fn step_top_k(
        &mut self,
        batch: &StepBatch,
        k: usize,
    ) -> Result<Vec<Vec<(u32, f32)>>, BackendError> {
        let nv = self.cfg.n_vocab;
        if !self.gpu.top_k_dev.get() || !Gpu::top_k_fits(nv, k) {
            return Ok(self.step(batch)?.top_k_rows(k));
        }
        let rows = self.run_step(batch)?;
        self.gpu
            .top_k_rows(self.s.logits.ptr(), nv, rows, k)
            .map_err(dev)
    }

    fn pipelines_decode(&self) -> bool {
        self.chain && self.opts.graphs && self.graph_failed.is_none() && self.exact.is_none()
    }

    fn decode_greedy(
        &mut self,
        batch: &StepBatch,
        steps: usize,
    ) -> Result<Vec<Vec<u32>>, BackendError> {
        CudaBackend::decode_greedy(self, batch, steps)
    }

    fn release(&mut self, seq: SeqId) {
        self.alloc.release(seq);
    }

    fn kv(&self) -> KvStats {
        self.alloc.stats()
    }
}
