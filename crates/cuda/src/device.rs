//! One GPU: its context, stream, compiled kernels and cuBLAS handle, plus device buffers.
//!
//! Lives on the thread that made it (a CUDA context is bound to its thread). Kernels are launched
//! through the driver API with raw device pointers: the backend owns every buffer for the whole
//! run and orders all work on one stream, so cudarc's per-buffer event tracking would only add
//! host work to every launch (and get in the way of graph capture).

use std::cell::RefCell;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys::{CUdevice_attribute, CUdeviceptr};
use cudarc::driver::{
    result as drv_result, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaStream,
};

use crate::compile;
use crate::error::{drv, CudaError};
use crate::kernels::all_kernel_names;

/// Whether this machine can run the CUDA backend, and if not, why.
pub fn available() -> Result<usize, CudaError> {
    // SAFETY: only attempts to dlopen libcuda by its usual names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaError::NoDriver);
    }
    drv_result::init().map_err(drv("cuInit"))?;
    let n = drv_result::device::get_count().map_err(drv("cuDeviceGetCount"))?;
    if n <= 0 {
        return Err(CudaError::NoDevice);
    }
    if !compile::nvrtc_available() {
        return Err(CudaError::NoNvrtc);
    }
    Ok(n as usize)
}

/// Device memory owned by one allocation; freed on drop.
pub struct DevBuf {
    ptr: CUdeviceptr,
    bytes: usize,
}

impl DevBuf {
    /// Device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Device address `off` bytes in.
    pub fn at(&self, off: usize) -> u64 {
        self.ptr + off as u64
    }
    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.ptr != 0 {
            // SAFETY: `ptr` came from cuMemAlloc and is freed once, here. Errors (a context
            // already torn down, which frees everything anyway) are ignored.
            unsafe {
                let _ = drv_result::free_sync(self.ptr);
            }
        }
    }
}

/// cuBLAS handle bound to the GPU's stream.
pub struct Blas {
    handle: cudarc::cublas::sys::cublasHandle_t,
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created by cublasCreate, destroyed once.
        unsafe {
            let _ = cudarc::cublas::result::destroy_handle(self.handle);
        }
    }
}

/// How the side stream's kernels ask L2 for weights ([`Gpu::side_prefetch`], session 11).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SideCfg {
    /// 0: one `cp.async.bulk.prefetch.L2` per `chunk` bytes; 1: `prefetch.global.L2` per line.
    pub kind: u32,
    /// Blocks and threads per block of each prefetch launch.
    pub blocks: u32,
    pub threads: u32,
    /// Bytes per bulk prefetch (a multiple of 16).
    pub chunk: u32,
    /// Most bytes of one matrix a wide step asks for ahead (the f16 copies are larger than L2).
    pub cap: usize,
}

impl Default for SideCfg {
    fn default() -> Self {
        SideCfg {
            kind: 0,
            blocks: 32,
            threads: 32,
            chunk: 16384,
            cap: 24 << 20,
        }
    }
}

impl SideCfg {
    /// `kind:blocks:threads:chunk[:cap MiB]`, e.g. `0:32:32:16384:24` (`CROSSOVER_CUDA_SIDE_CFG`).
    pub fn parse(s: &str) -> Option<SideCfg> {
        let v: Vec<usize> = s
            .split(':')
            .map(|x| x.trim().parse().ok())
            .collect::<Option<_>>()?;
        let d = SideCfg::default();
        let c = SideCfg {
            kind: *v.first()? as u32,
            blocks: *v.get(1)? as u32,
            threads: *v.get(2)? as u32,
            chunk: v.get(3).map_or(d.chunk, |&c| c as u32),
            cap: v.get(4).map_or(d.cap, |&m| m << 20),
        };
        (c.kind <= 1
            && (1..=1024).contains(&c.blocks)
            && (32..=1024).contains(&c.threads)
            && c.chunk >= 16
            && c.chunk.is_multiple_of(16))
        .then_some(c)
    }
}

/// A second stream beside the main one, for launches nothing on the main stream waits for
/// until the step ends (L2 prefetches of weights, session 11), with the two events that fork it
/// from and join it to the main stream (in a capture, these make a parallel graph branch).
struct Side {
    stream: Arc<CudaStream>,
    fork: cudarc::driver::sys::CUevent,
    join: cudarc::driver::sys::CUevent,
}

impl Drop for Side {
    fn drop(&mut self) {
        // SAFETY: both events were created by cuEventCreate for this context, destroyed once.
        unsafe {
            let _ = drv_result::event::destroy(self.fork);
            let _ = drv_result::event::destroy(self.join);
        }
    }
}

/// [`Gpu::set_pdl_small`]'s bits (common.cu's PDL_RMS ... PDL_RMS_FFN): the RMSNorms that
/// write the plain layout (the attention's, the output head's), `quantize_act`,
/// `attn_merge_q`, the empty `pdl_hop` of `set_skip`'s `~` prefix, the one-token attention
/// (`attn_one*`), and the FFN norm writing the pipelined SwiGLU product's permuted layout.
pub const PDL_SMALL_RMS: u32 = 1;
/// See [`PDL_SMALL_RMS`].
pub const PDL_SMALL_QUANT: u32 = 2;
/// See [`PDL_SMALL_RMS`].
pub const PDL_SMALL_MERGE: u32 = 4;
/// See [`PDL_SMALL_RMS`].
pub const PDL_SMALL_HOP: u32 = 8;
/// See [`PDL_SMALL_RMS`].
pub const PDL_SMALL_ATTN: u32 = 16;
/// See [`PDL_SMALL_RMS`].
pub const PDL_SMALL_RMS_FFN: u32 = 32;
/// Every bit [`Gpu::set_pdl_small`] takes.
pub const PDL_SMALL_ALL: u32 = 63;
/// The mask a handle starts with when `CROSSOVER_CUDA_PDL_SMALL` is unset: quantize_act, the
/// attention merge and the attention's RMSNorm (session 35 on an H100, `cuda_bench
/// --ab-small`, with the warp-per-group forms [`Gpu::rms1s`] and [`Gpu::quant1`]: -0.015 ms
/// per token at depth 0 and -0.044 at 4096 against none; the FFN norm too gained 0.004 ms at
/// depth 0 but lost 0.018 at 4096; docs/perf/cuda.md "Session 35").
pub const PDL_SMALL_DEFAULT: u32 = PDL_SMALL_QUANT | PDL_SMALL_MERGE | PDL_SMALL_RMS;

/// One GPU ready to run the kernels.
pub struct Gpu {
    /// Timing events after each launch while a profile is being taken ([`Gpu::profile_start`]).
    prof: RefCell<Option<Vec<(String, CudaEvent)>>>,
    /// Launches of kernels whose names start with one of these are left out (v11's timing
    /// ablation, `cuda_bench --ab-skip`: what a kernel class costs inside the real step (a
    /// prefix starting with `~` launches an empty `pdl_hop` in its place, session 34); the
    /// step's results are then wrong). Empty unless set through
    /// [`crate::CudaBackend::set_skip`].
    pub(crate) skip: RefCell<Vec<String>>,
    /// Session 39: when set, every launch (eager or captured) adds one to its kernel's count
    /// here (`cuda_bench --launches`: which kernels a step takes).
    pub launch_log: RefCell<Option<std::collections::BTreeMap<String, u64>>>,
    /// Resident blocks per SM of each kernel at the block size asked last
    /// ([`Gpu::blocks_per_sm`]; 0 = not asked yet).
    occupancy: RefCell<Vec<(u32, usize)>>,
    funcs: Vec<CudaFunction>,
    names: Vec<String>,
    _module: Arc<CudaModule>,
    blas: Option<Blas>,
    /// cuBLASLt with per-shape tuned algorithms for the batched decode products (v10).
    pub(crate) lt: Option<crate::lt::Lt>,
    /// The side stream (None when it could not be made: then no prefetch branch is taken).
    side: Option<Side>,
    /// Whether the side stream has work not yet joined to the main stream.
    side_pending: std::cell::Cell<bool>,
    /// How side prefetches are launched (`CROSSOVER_CUDA_SIDE_CFG`).
    pub side_cfg: std::cell::Cell<SideCfg>,
    /// The stream all work goes to.
    pub stream: Arc<CudaStream>,
    /// The context (kept last so it outlives the stream and module).
    pub ctx: Arc<CudaContext>,
    /// Device index.
    pub ordinal: usize,
    /// Marketing name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Compute capability (major, minor).
    pub cc: (i32, i32),
    /// Multiprocessors.
    pub sms: u32,
    /// Total memory in bytes.
    pub total_mem: u64,
    /// Whether the kernels came from the disk cache.
    pub kernels_cached: bool,
    /// Seconds spent compiling or loading kernels.
    pub kernel_load_s: f64,
    /// Why cuBLAS is not used, when it is not.
    pub blas_missing: Option<String>,
    /// One-token integer products take the two-rows-per-warp kernels (`mvr_*`, v6) rather than
    /// the block-per-row ones (`mvq_*_1`): on unless `CROSSOVER_CUDA_MVQ=block` at start.
    pub mvr: std::cell::Cell<bool>,
    /// Kernels are launched with programmatic dependent launch (sm_90 and later; every kernel
    /// waits for its predecessor itself, see common.cu): on unless `CROSSOVER_CUDA_PDL=0`.
    pub pdl: std::cell::Cell<bool>,
    /// Session 35: which small kernels of the one-token chain let their successor launch
    /// before their own wait (a mask of [`PDL_SMALL_RMS`] ... [`PDL_SMALL_RMS_FFN`];
    /// common.cu, `PDL_ENTRY_SMALL`); set through
    /// [`Gpu::set_pdl_small`], at start from `CROSSOVER_CUDA_PDL_SMALL`.
    pdl_small: std::cell::Cell<u32>,
    /// One-token decode steps fuse RoPE and the KV store into the Q/K/V launch and (with
    /// `fuse_quant`) the activation quantizations into the SwiGLU product and the attention
    /// merge (v6): on unless `CROSSOVER_CUDA_FUSE=0`.
    pub fuse: std::cell::Cell<bool>,
    /// Of those fusions, the activation quantizations: off unless `CROSSOVER_CUDA_FUSE_QUANT=1`
    /// (on the H200 they cost more than the two launches per layer they save: tg128 1.896 ms
    /// per token without, 2.045 with, docs/perf/cuda.md v6).
    pub fuse_quant: std::cell::Cell<bool>,
    /// Products of 9..64 tokens (batched decode) take the tensor-core integer GEMM
    /// ([`Gpu::matmul_q`], v7) rather than cuBLAS on f16 copies: off unless
    /// `CROSSOVER_CUDA_MMQ=1` (correct, but on the H200 it runs at ~0.1 TB/s: a 64-sequence step
    /// took 46 ms against cuBLAS's 5.1, docs/perf/cuda.md v7).
    pub mmq: std::cell::Cell<bool>,
    /// Products of 9..64 tokens take the f16 tensor-core kernels that read the quantized
    /// weights ([`Gpu::matmul_f16w`], v8: the operands cuBLAS gets from the f16 copies) rather
    /// than cuBLAS: off unless `CROSSOVER_CUDA_MMF=1` (correct, but on the H200 still slower
    /// than cuBLAS on the copies: a 64-sequence step 10.0 against 5.6 ms, docs/perf/cuda.md v8).
    pub mmf: std::cell::Cell<bool>,
    /// Warps per block of those products, 4 or 8 (`CROSSOVER_CUDA_MMF_WARPS`, default 8).
    pub mmf_warps: std::cell::Cell<usize>,
    /// Those products decode Q4_K and Q6_K with byte permutes instead of the conversion unit
    /// (the same values): on unless `CROSSOVER_CUDA_MMF_FASTDEC=0`.
    pub mmf_fast: std::cell::Cell<bool>,
    /// Q4_K products of 9..64 tokens take the tensor-core kernels in the CPU's integer order
    /// ([`Gpu::matmul_q4k_mmk`], session 10: the quantized weights, 1.9 GB per 3B step, instead
    /// of the 6.4 GB of f16 copies cuBLAS reads): `CROSSOVER_CUDA_MMK=1` turns them on.
    pub mmk: std::cell::Cell<bool>,
    /// The prompt path's f16 operands (RMSNorm, SwiGLU, attention output) are quantized a warp
    /// per 256-element group (prefill.cu, v7) rather than a block per group with three
    /// barriers: on unless `CROSSOVER_CUDA_WARPQ=0`.
    pub warp_quant: std::cell::Cell<bool>,
    /// One-token products prepare their own activations (v7: RMSNorm and quantization inside
    /// the Q/K/V, O and gate/up launches): off unless `CROSSOVER_CUDA_FUSE_PREP=1` (on the H200
    /// every block's own pass over the row cost more than the launches it saves: tg128 2.17
    /// against 2.04 ms per token with the fused merge on in both, docs/perf/cuda.md v7).
    pub fuse_prep: std::cell::Cell<bool>,
    /// One-token split attention merges its own slices (v7: the last block of each KV head
    /// merges, no `attn_combine` launch) over slices of at least `dec_slice` positions: off
    /// unless `CROSSOVER_CUDA_FUSE_MERGE=1` (on the H200 the merging block's tail costs what
    /// the launch did, and the longer slices cost short contexts: tg128 2.04 against 1.88 ms
    /// per token at depth 0, equal at 4096, docs/perf/cuda.md v7).
    pub fuse_merge: std::cell::Cell<bool>,
    /// Blocks per SM the products that prepare their own activation aim for (each block reads
    /// the whole f32 row, so fewer blocks with more rows each): `CROSSOVER_CUDA_PREP_BLOCKS`,
    /// default 4.
    pub prep_blocks: std::cell::Cell<usize>,
    /// Shortest context slice of a one-token attention block when the merge is fused
    /// (`CROSSOVER_CUDA_DEC_SLICE`, default 128 positions).
    pub dec_slice: std::cell::Cell<usize>,
    /// With `fuse_prep`, one-token products of rows wider than the `mvr` kernels take (down)
    /// run the block-wide kernel that quantizes its own activation (`mvw_*`, v7): off unless
    /// `CROSSOVER_CUDA_WIDE=1` (slower than quantize_act + the block-per-row kernel on the
    /// H200: 2.44 against 2.20 ms per token with `fuse_prep`).
    pub wide: std::cell::Cell<bool>,
    /// Products of 9..64 tokens take the cuBLASLt algorithm timed fastest for their shape
    /// (v10, [`Gpu::lt_wants`]): on unless `CROSSOVER_CUDA_LT=0`.
    pub lt_on: std::cell::Cell<bool>,
    /// Heuristic candidates timed per shape (`CROSSOVER_CUDA_LT_ALGOS`, default 16).
    pub lt_candidates: std::cell::Cell<usize>,
    /// Why cuBLASLt is not used, when it is not.
    pub lt_missing: Option<String>,
    /// Tuning also times the heuristic's first candidates with K split 2, 4 and 8 ways
    /// (v10): on unless `CROSSOVER_CUDA_LT_SPLITK=0`.
    pub lt_splitk: std::cell::Cell<bool>,
    /// Keep the fastest cuBLASLt candidate of a shape tuned from now on even where
    /// `cublasGemmEx` was faster (for tests of the cuBLASLt path; off).
    pub lt_force: std::cell::Cell<bool>,
    /// One-token `mvr_*` products on quantized activations run as one wave (v10): the grid
    /// sized to the blocks resident at once, each warp taking several row pairs and asking L2
    /// for its rows two steps ahead: off unless `CROSSOVER_CUDA_WAVE=1` (on the H200 the
    /// products got slower: gate+up 12.5 -> 13.1 us, head 131 -> 148 us, docs/perf/cuda.md v10).
    pub wave: std::cell::Cell<bool>,
    /// One-token Q6_K products (the output head) take the half-super-block kernel
    /// (`mv6_q6_k`, v10) rather than `mvr_q6_k`: off unless `CROSSOVER_CUDA_Q6H=1` (on the H200
    /// the head got slower: 131 -> 180 us, docs/perf/cuda.md v10).
    pub q6_half: std::cell::Cell<bool>,
    /// Session 18: one-token products of the Q6_K output head and down projections read a
    /// 16-byte aligned copy made at load ([`Gpu::pad_q6k`], the same bits): on unless
    /// `CROSSOVER_CUDA_Q6A=0` (then no copy is made). On the H200 the head took 100 us instead
    /// of 117, a down projection 9.5 instead of 11.4 (docs/perf/cuda.md session 18).
    pub q6a: std::cell::Cell<bool>,
    /// Session 20: the one-token products on the Q6_KA copies (the output head, V in the mixed
    /// Q/K/V launch) decode the 6-bit values unsigned and take the - 32 from the activation's
    /// sums of 16 (`mvr4_q6_ku`, `mvr4_rope2_*_q6_ku`, `mvsm_q6_ku`: the same int32 sums, so the
    /// same bits, with fewer operations per word): on unless `CROSSOVER_CUDA_Q6U=0` (on the
    /// H200 -0.018 ms per token at depth 0, -0.015 at 4096, docs/perf/cuda.md session 20).
    pub q6u: std::cell::Cell<bool>,
    /// Session 32: the blocks per slot of the aligned Q6_K copies ([`Gpu::pad_q6k`]): 4 (848
    /// bytes a group of four blocks, 1/105 over the matrix, for rows of a multiple of 1024
    /// columns; other rows take 1) unless `CROSSOVER_CUDA_Q6A_GROUP=1` (one block per
    /// 224-byte slot, 1/15 over, sessions 18-31). Read when a copy is made and when a product
    /// on it is launched ([`Gpu::q6a_group`]); a backend whose copies were made with another
    /// value runs the GGUF-layout kernels instead of reading them. On the H200 four a slot
    /// made the 3B step 0.023 ms faster at depth 0 (docs/perf/cuda.md session 32).
    pub q6a_g: std::cell::Cell<usize>,
    /// With [`Gpu::q6u`], Q6_KU's decoding also for rows wider than the `mvr` kernels take (the
    /// block-per-row down projection, `mvqp_q6_ku`): off unless `CROSSOVER_CUDA_Q6U_WIDE=1` (on
    /// the H200 the 3B step took 1.265-1.269 ms with it against 1.258-1.259 without, at depth
    /// 0, docs/perf/cuda.md session 20).
    pub q6u_wide: std::cell::Cell<bool>,
    /// Session 19: one-token products of at most [`crate::kernels::MVSM_MAX_BYTES`] weight bytes
    /// per block (the output and down projections of a 3B model fit) stage their rows in
    /// shared memory before the PDL wait (`mvsm_*`, the `mvr` kernels' bits where those take
    /// the rows), up to [`Gpu::mvsm_cols`] columns: on unless `CROSSOVER_CUDA_MVSM=0`. On the
    /// H200 the output projection staged took the 3B step from 1.466 to 1.457 ms at depth 4096
    /// (equal at depth 0); the down projection staged too made it 0.02 ms slower
    /// (docs/perf/cuda.md session 19).
    pub mvsm: std::cell::Cell<bool>,
    /// The widest rows [`Gpu::mvsm`] stages (`CROSSOVER_CUDA_MVSM_COLS`, default 4096: the
    /// output projection, not the down projection's 8192 columns, whose staging slowed the
    /// step on the H200, docs/perf/cuda.md session 19).
    pub mvsm_cols: std::cell::Cell<usize>,
    /// Session 20: after a one-token attention of one split (contexts of up to 64 positions),
    /// the output projection, where it is staged ([`Gpu::mvsm`]), quantizes the attention's
    /// rows itself ([`Gpu::matvec_q_staged_prep`]; the same bits), so no `quantize_act` runs
    /// between them: on unless `CROSSOVER_CUDA_MVSM_PREP=0` (on the H200 the 3B step at depth
    /// 0 took 1.235-1.238 ms with it against 1.263-1.264, docs/perf/cuda.md session 20).
    pub mvsm_prep: std::cell::Cell<bool>,
    /// One-token products of rows wider than the `mvr` kernels take (the down projection)
    /// run one warp per row (`mvd_*`, v10) rather than a block of 128 threads per row
    /// (`mvq_*_1`): off unless `CROSSOVER_CUDA_MVD=1` (on the H200 down got slower: 8.8 -> 9.9
    /// us at 80 registers and 24 warps per SM against 32 registers and 64 warps,
    /// docs/perf/cuda.md v10).
    pub warp_rows: std::cell::Cell<bool>,
    /// One-token plain and mixed Q/K/V `mvr` products (O, the head, Q/K/V) take the kernels
    /// compiled for at most 64 registers (`mvr4_*`, v10: 4 blocks per SM instead of 2): on
    /// unless `CROSSOVER_CUDA_MVR4=0` (on the H200 the head 130.6 -> 116.2 us, O 3.19 -> 3.58
    /// us, the step 0.02-0.03 ms faster, docs/perf/cuda.md v10).
    pub mvr_lb4: std::cell::Cell<bool>,
    /// Warps per block of the one-token plain and Q/K/V `mvr_*` launches on quantized
    /// activations (1 to 8, `CROSSOVER_CUDA_MVR_WARPS`, default 4 since session 17). Fewer
    /// warps per block spread a small grid (O: 192 blocks of 8 warps on 132 multiprocessors)
    /// more evenly.
    pub mvr_warps: std::cell::Cell<usize>,
    /// The same for the SwiGLU launches (`mvr_swiglu_*`, `CROSSOVER_CUDA_MVR_WARPS_GLU`,
    /// default 4: on the H200 gate+up 12.1 -> 10.5 us per launch, the step 1.438 -> 1.424 ms
    /// at depth 0 and 1.577 -> 1.556 at 4096 with the plain launches at 4 too,
    /// docs/perf/cuda.md session 17).
    pub mvr_warps_glu: std::cell::Cell<usize>,
    /// Threads per block of the one-token block-per-row products (`mvqp_*`, the down
    /// projection): 0 (the default) as many as the row has units, up to 128; else 32 to 128
    /// (`CROSSOVER_CUDA_MVQP_THREADS`; another block reduction order, so other float bits).
    pub mvqp_threads: std::cell::Cell<usize>,
    /// One-token Q4_K SwiGLU products take the half-unit kernel on a permuted activation
    /// (`mvh_swiglu_q4_k`, session 16): off unless `CROSSOVER_CUDA_MVH=1`. On the H200 it was
    /// 0.015-0.03 ms per token faster than the unit kernel on the [`Gpu::fuse_quant`] path,
    /// which is itself 0.13 ms slower than the default (docs/perf/cuda.md session 17); since
    /// session 29 it also runs without a fused quantization (a quantize_act launch after it).
    pub mvh: std::cell::Cell<bool>,
    /// Session 29: one-token Q4_K SwiGLU products take the half-unit kernel with a row's
    /// weights in registers before the PDL wait (`mvp3_swiglu_q4_k`, [`Gpu::matvec_q_swiglu_pipe`])
    /// with this many rows per warp: 1 unless `CROSSOVER_CUDA_MVP=R` (0: off). On an H100
    /// 0.028-0.030 ms per token faster than the unit kernel at depth 0 and 0.034 at 4096
    /// (docs/perf/cuda.md session 29).
    pub mvp: std::cell::Cell<usize>,
    /// Session 33: at one row per warp, rows of 1024, 2048, 3072 or 4096 columns take
    /// `mvps<S>_swiglu_q4_k` (mvp3's bits without its cursors, the super-block headers decoded
    /// before the PDL wait): on unless `CROSSOVER_CUDA_MVPS=0` (on an H100 -0.037 ms per token
    /// at depth 0, -0.035 at 4096; docs/perf/cuda.md session 33).
    pub mvps: std::cell::Cell<bool>,
    /// Session 33: one-token Q/K/V launches with Q/K of Q4_K on rows of 1024 to 4096 columns
    /// take `mvpq<S>_q4_k_<v>` (a warp per rotation pair with its weights in registers before
    /// the PDL wait, mvps's half-unit lanes; the `mvr` kernels' bits): off unless
    /// `CROSSOVER_CUDA_MVPQ=1` (docs/perf/cuda.md session 33).
    pub mvpq: std::cell::Cell<bool>,
    /// One-token block-per-row products (the down projection) ask L2 for their row before
    /// their wait (`mvqp_*`, v10; with PDL only): on unless `CROSSOVER_CUDA_MVQ_PF=0` (on the
    /// H200 down 8.87 -> 8.22 us, the step ~0.01 ms faster, docs/perf/cuda.md v10).
    pub mvq_pf: std::cell::Cell<bool>,
    /// Session 30: those products with each thread's units decoded in registers before the
    /// wait (`mvqe_*`, the same bits; rows of at most [`crate::kernels::MVQE_UNITS`] units per
    /// thread): on unless `CROSSOVER_CUDA_MVQE=0` (on an H100 the step 0.015 ms faster at depth
    /// 0, docs/perf/cuda.md "Session 30").
    pub mvqe: std::cell::Cell<bool>,
    /// Session 36: the one-token Q4_K down projection (rows of 4 to 8 four-super-block steps,
    /// where `mvqe` runs 128 threads) as a warp per row with each lane's weights and decoded
    /// headers in registers before the PDL wait (`mvpd<S>_q4_k`, mvps's loads; `mvqe`'s
    /// bits): on unless `CROSSOVER_CUDA_MVPD=0` (on an H100 the step 0.016-0.020 ms faster at
    /// depth 0 and 0.024-0.042 at 4096 in six alternating rounds over two calls,
    /// docs/perf/cuda.md "Session 36").
    pub mvpd: std::cell::Cell<bool>,
    /// Session 36: the other one-token block-per-row products that `mvqe` runs at 128
    /// threads (rows of 97 to 256 units: the down projection's Q6_K copies among them) as a
    /// warp per row with its units decoded before the PDL wait (`mvqw_*`: `mvqe`'s bits,
    /// K-quants only; `mvpd` first where it takes the row): on with `CROSSOVER_CUDA_MVQW=1`
    /// (slower: 113-120 registers; with `mvpd` on, the step +0.04-0.05 ms at depth 0 on an
    /// H100, docs/perf/cuda.md "Session 36").
    pub mvqw: std::cell::Cell<bool>,
    /// Session 21: one-token products on rows wider than the `mvr` kernels take (the down
    /// projection) quantize their own f32 activation on thread block clusters of
    /// [`Gpu::mvqc_cluster`] blocks (`mvqc_*`, sm_90 with PDL; the same bits as
    /// `quantize_act` then `mvqp_*`), so no quantization launch runs before them: off unless
    /// `CROSSOVER_CUDA_DOWN_CL=1` (on the H200 the 3B step took 1.589-1.594 ms with a block per
    /// row in clusters of 8 against 1.226-1.238 without, docs/perf/cuda.md session 21).
    pub down_cl: std::cell::Cell<bool>,
    /// Blocks per cluster of the `mvqc_*` products ([`Gpu::down_cl`]; 1 to 8, default
    /// [`crate::kernels::MVQC_CLUSTER`]; `CROSSOVER_CUDA_MVQC_CL`).
    pub mvqc_cluster: std::cell::Cell<u32>,
    /// Blocks per multiprocessor of the `mvqc_*` grid, each looping over rows (0, the default:
    /// one block per row; `CROSSOVER_CUDA_MVQC_PER_SM`).
    pub mvqc_per_sm: std::cell::Cell<usize>,
    /// One-token RMSNorm (with its quantization) runs as one warp per 256-element group
    /// (`rms_norm1`, v11: no block barrier, rms_norm's bits): off unless
    /// `CROSSOVER_CUDA_RMS1=1` (on the H200 the step got slower: tg128 1.598 against 1.549 ms
    /// per token at depth 0, docs/perf/cuda.md v11).
    pub rms1: std::cell::Cell<bool>,
    /// Session 34: a one-token RMSNorm whose sum of squares the product before it left in
    /// the slots (session 16) runs as one warp per 256-element group (`rms_norm1s`: no block
    /// barrier, rms_norm's bits): on unless `CROSSOVER_CUDA_RMS1S=0` (neutral in session 34
    /// while every norm waited first; its shorter body pays where the attention norm launches
    /// its successor early, session 35).
    pub rms1s: std::cell::Cell<bool>,
    /// Session 35: one-row activation quantizations without an f16 operand (the down
    /// projection's, one token) run as one warp per 256-element group (`quantize_act1`:
    /// quantize_act's bytes, no block barrier): on unless `CROSSOVER_CUDA_QUANT1=0`.
    pub quant1: std::cell::Cell<bool>,
    /// The split attention of decode steps takes the forms whose warps each copy their own 16
    /// rows of every tile (`attn_batchw_*`, `attn_onew_*`, session 11: no block barrier in the
    /// tile loop, one block-table lookup per warp and tile, 154-160 registers where the
    /// block-wide forms take 162-178; the same bits; cache blocks of a multiple of 16
    /// positions): on unless `CROSSOVER_CUDA_ATTN_WP=0` (on the H200 the 64-sequence step
    /// 4.69 -> 4.31 ms, one-token steps unchanged, docs/perf/cuda.md "Version 13").
    pub attn_wp: std::cell::Cell<bool>,
    /// Greedy argmax takes up to 64 blocks per row (`argmax_mb`, v11) rather than one
    /// (`argmax_rows`, whose threads walked ~125 logits each, one round trip after another):
    /// on unless `CROSSOVER_CUDA_ARGMAX_MB=0` (on the H200 tg128 1.549 -> 1.511 ms per token at
    /// depth 0, 1.690 -> 1.659 at 4096, docs/perf/cuda.md v11).
    pub argmax_mb: std::cell::Cell<bool>,
    /// Session 21: the CUDA backend selects each sampled row's top-k on the GPU
    /// ([`Gpu::top_k_rows`], `runtime::Backend::step_top_k`), k pairs copied back instead of
    /// the row: on unless `CROSSOVER_CUDA_TOPK=0` (session 24 on the H200, 3B file, temperature
    /// 0.8, top-k 40: 628-660 generated tok/s against 574-592 copying each row, the same text;
    /// docs/perf/cuda.md session 24).
    pub top_k_dev: std::cell::Cell<bool>,
    /// [`Gpu::top_k_rows`]' scratch (u64 keys) and its length.
    pub(crate) topk_ws: RefCell<Option<(DevBuf, usize)>>,
    /// `argmax_mb`'s partial values, partial indices and per-row counters (zero between
    /// launches), for up to the row count kept with them.
    #[allow(clippy::type_complexity)]
    pub(crate) argmax_ws: RefCell<Option<(DevBuf, DevBuf, DevBuf, usize)>>,
    /// Tests only: with [`Gpu::wave`], size one-wave grids to at most this many blocks (0: what
    /// the GPU holds at once), so small products take several steps per warp.
    pub wave_cap: std::cell::Cell<usize>,
}

/// A positive integer from the environment, or `default` when unset or not one.
fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&v| v > 0)
        .unwrap_or(default)
}

/// Build a kernel argument list: pointers to each value, alive for the enclosing statement.
#[macro_export]
macro_rules! kargs {
    ($($a:expr),* $(,)?) => {
        &mut [$( (&$a) as *const _ as *mut ::std::ffi::c_void ),*]
    };
}

impl Gpu {
    /// Open device `ordinal`: create its context and stream, compile (or load from the cache)
    /// the kernels for its architecture, and open cuBLAS when present.
    pub fn new(ordinal: usize) -> Result<Gpu, CudaError> {
        let count = available()?;
        if ordinal >= count {
            return Err(CudaError::BadDevice {
                index: ordinal,
                count,
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(drv("creating the context"))?;
        let name = ctx.name().map_err(drv("device name"))?;
        let cc = ctx
            .compute_capability()
            .map_err(drv("compute capability"))?;
        let sms = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(drv("multiprocessor count"))? as u32;
        let total_mem = ctx.total_mem().map_err(drv("total memory"))? as u64;
        // cudarc's cross-stream event tracking synchronizes the whole (primary, so shared)
        // context when a handle makes its first stream, which fails while another handle on
        // the device is capturing a graph (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: a second
        // actor or model loaded beside a running one). A handle has one stream and its buffers
        // never leave it, so there is nothing across streams to track.
        // SAFETY: every buffer of this handle is allocated, used and freed on `stream` alone.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(drv("creating a stream"))?;
        let side = Self::make_side(&ctx);
        let t = std::time::Instant::now();
        let arch = format!("sm_{}{}", cc.0, cc.1);
        let (image, kernels_cached) = compile::compile_cached(&arch)?;
        let ptx = cudarc::nvrtc::Ptx::from_binary(image.bytes().to_vec());
        let module = ctx.load_module(ptx).map_err(drv("loading the kernels"))?;
        let names = all_kernel_names();
        let mut funcs = Vec::with_capacity(names.len());
        for n in &names {
            funcs.push(
                module
                    .load_function(n)
                    .map_err(drv(format!("kernel {n}")))?,
            );
        }
        let kernel_load_s = t.elapsed().as_secs_f64();
        // SAFETY: only attempts to dlopen libcublas.
        let (blas, blas_missing) = if unsafe { cudarc::cublas::sys::is_culib_present() } {
            match cudarc::cublas::result::create_handle() {
                Ok(handle) => {
                    // SAFETY: the handle is fresh; the stream belongs to this context and outlives
                    // the handle (fields drop in order: blas before stream).
                    let r = unsafe {
                        cudarc::cublas::result::set_stream(handle, stream.cu_stream() as *mut _)
                    };
                    match r {
                        Ok(()) => (Some(Blas { handle }), None),
                        Err(e) => (None, Some(format!("cublasSetStream: {e:?}"))),
                    }
                }
                Err(e) => (None, Some(format!("cublasCreate: {e:?}"))),
            }
        } else {
            (None, Some("libcublas.so could not be loaded".to_string()))
        };
        let alloc_ws = |bytes: usize| -> Result<DevBuf, CudaError> {
            // SAFETY: plain cuMemAlloc in this thread's context; owned by the DevBuf.
            let ptr = unsafe { drv_result::malloc_sync(bytes) }
                .map_err(drv("cuMemAlloc (cuBLASLt workspace)"))?;
            Ok(DevBuf { ptr, bytes })
        };
        let (lt, lt_missing) = if blas.is_some() {
            match crate::lt::Lt::open(alloc_ws) {
                Ok(l) => (Some(l), None),
                Err(e) => (None, Some(e)),
            }
        } else {
            (None, blas_missing.clone())
        };
        let gpu = Gpu {
            prof: RefCell::new(None),
            skip: RefCell::new(Vec::new()),
            launch_log: RefCell::new(None),
            lt,
            lt_missing,
            lt_on: std::cell::Cell::new(std::env::var("CROSSOVER_CUDA_LT").as_deref() != Ok("0")),
            lt_candidates: std::cell::Cell::new(env_usize("CROSSOVER_CUDA_LT_ALGOS", 16)),
            lt_force: std::cell::Cell::new(false),
            lt_splitk: std::cell::Cell::new(
                std::env::var("CROSSOVER_CUDA_LT_SPLITK").as_deref() != Ok("0"),
            ),
            occupancy: RefCell::new(vec![(0, 0); names.len()]),
            funcs,
            names,
            _module: module,
            blas,
            side,
            side_pending: std::cell::Cell::new(false),
            side_cfg: std::cell::Cell::new(
                std::env::var("CROSSOVER_CUDA_SIDE_CFG")
                    .ok()
                    .and_then(|v| SideCfg::parse(&v))
                    .unwrap_or_default(),
            ),
            stream,
            ctx,
            ordinal,
            name,
            cc,
            sms,
            total_mem,
            kernels_cached,
            kernel_load_s,
            blas_missing,
            mvr: std::cell::Cell::new(
                std::env::var("CROSSOVER_CUDA_MVQ").as_deref() != Ok("block"),
            ),
            fuse: std::cell::Cell::new(std::env::var("CROSSOVER_CUDA_FUSE").as_deref() != Ok("0")),
            fuse_quant: std::cell::Cell::new(
                std::env::var("CROSSOVER_CUDA_FUSE_QUANT").as_deref() == Ok("1"),
            ),
            mmq: std::cell::Cell::new(std::env::var("CROSSOVER_CUDA_MMQ").as_deref() == Ok("1")),
            mmf: std::cell::Cell::new(std::env::var("CROSSOVER_CUDA_MMF").as_deref() == Ok("1")),
            mmf_warps: std::cell::Cell::new(env_usize("CROSSOVER_CUDA_MMF_WARPS", 8)),
            mmf_fast: std::cell::Cell::new(
                std::env::var("CROSSOVER_CUDA_MMF_FASTDEC").as_deref() != Ok("0"),
            ),
            mmk: std::cell::Cell::new(std::env::var("CROSSOVER_CUDA_MMK").as_deref() == Ok("1")),
            warp_quant: std::cell::Cell::new(
                std::env::var("CROSSOVER_CUDA_WARPQ").as_deref() != Ok("0"),
            ),
            pdl: std::cell::Cell::new(
                cc.0 >= 9 && std::env::var("CROSSOVER_CUDA_PDL").as_deref() != Ok("0"),
            ),
            fuse_prep: std::cell::Cell::new(
                std::env::var("CROSSOVER_CUDA_FUSE_PREP").as_deref() == Ok("1"),
            ),
            fuse_merge: std::cell::Cell::new(
                std::env::var("CROSSOVER_CUDA_FUSE_MERGE").as_deref() == Ok("1"),
            ),
            prep_blocks: std::cell::Cell::new(env_usize("CROSSOVER_CUDA_PREP_BLOCKS", 4)),
            dec_slice: std::cell::Cell::new(env_usize("CROSSOVER_CUDA_DEC_SLICE", 128)),
            wide: std::cell::Cell::new(std::env::var("CROSSOVER_CUDA_WIDE").as_deref() == Ok("1")),
            wave: std::cell::Cell::new(std::env::var("CROSSOVER_CUDA_WAVE").as_deref() == Ok("1")),
            q6_half: std::cell::Cell::new(
                std::env::var("CROSSOVER_CUDA_Q6H").as_deref() == Ok("1"),
            ),
            q6a: std::cell::Cell::new(std::env::var("CROSSOVER_CUDA_Q6A").as_deref() != Ok("0")),
            q6u: std::cell::Cell::new(std::env::var("CROSSOVER_CUDA_Q6U").as_deref() != Ok("0")),
            q6a_g: std::cell::Cell::new(
                if std::env::var("CROSSOVER_CUDA_Q6A_GROUP").as_deref() == Ok("1") {
                    1
                } else {
                    4
                },
            ),
            q6u_wide: std::cell::Cell::new(
                std::env::var("CROSSOVER_CUDA_Q6U_WIDE").as_deref() == Ok("1"),
            ),
            mvsm: std::cell::Cell::new(std::env::var("CROSSOVER_CUDA_MVSM").as_deref() != Ok("0")),
            mvsm_cols: std::cell::Cell::new(env_usize("CROSSOVER_CUDA_MVSM_COLS", 4096)),
            mvsm_prep: std::cell::Cell::new(
                std::env::var("CROSSOVER_CUDA_MVSM_PREP").as_deref() != Ok("0"),
            ),
            wave_cap: std::cell::Cell::new(0),
            warp_rows: std::cell::Cell::new(
                std::env::var("CROSSOVER_CUDA_MVD").as_deref() == Ok("1"),
            ),
            mvh: std::cell::Cell::new(std::env::var("CROSSOVER_CUDA_MVH").as_deref() == Ok("1")),
            mvp: std::cell::Cell::new(env_usize("CROSSOVER_CUDA_MVP", 1)),
            mvps: std::cell::Cell::new(std::env::var("CROSSOVER_CUDA_MVPS").as_deref() != Ok("0")),
            mvpq: std::cell::Cell::new(std::env::var("CROSSOVER_CUDA_MVPQ").as_deref() == Ok("1")),
            mvr_lb4: std::cell::Cell::new(
                std::env::var("CROSSOVER_CUDA_MVR4").as_deref() != Ok("0"),
            ),
            mvr_warps: std::cell::Cell::new(env_usize("CROSSOVER_CUDA_MVR_WARPS", 4).clamp(1, 8)),
            mvqp_threads: std::cell::Cell::new(env_usize("CROSSOVER_CUDA_MVQP_THREADS", 0)),
            mvr_warps_glu: std::cell::Cell::new(
                env_usize("CROSSOVER_CUDA_MVR_WARPS_GLU", 4).clamp(1, 8),
            ),
            mvq_pf: std::cell::Cell::new(
                std::env::var("CROSSOVER_CUDA_MVQ_PF").as_deref() != Ok("0"),
            ),
            mvqe: std::cell::Cell::new(std::env::var("CROSSOVER_CUDA_MVQE").as_deref() != Ok("0")),
            mvpd: std::cell::Cell::new(std::env::var("CROSSOVER_CUDA_MVPD").as_deref() != Ok("0")),
            mvqw: std::cell::Cell::new(std::env::var("CROSSOVER_CUDA_MVQW").as_deref() == Ok("1")),
            down_cl: std::cell::Cell::new(
                std::env::var("CROSSOVER_CUDA_DOWN_CL").as_deref() == Ok("1"),
            ),
            mvqc_cluster: std::cell::Cell::new(
                env_usize(
                    "CROSSOVER_CUDA_MVQC_CL",
                    crate::kernels::MVQC_CLUSTER as usize,
                )
                .clamp(1, 8) as u32,
            ),
            mvqc_per_sm: std::cell::Cell::new(env_usize("CROSSOVER_CUDA_MVQC_PER_SM", 0)),
            rms1: std::cell::Cell::new(std::env::var("CROSSOVER_CUDA_RMS1").as_deref() == Ok("1")),
            rms1s: std::cell::Cell::new(
                std::env::var("CROSSOVER_CUDA_RMS1S").as_deref() != Ok("0"),
            ),
            quant1: std::cell::Cell::new(
                std::env::var("CROSSOVER_CUDA_QUANT1").as_deref() != Ok("0"),
            ),
            argmax_mb: std::cell::Cell::new(
                std::env::var("CROSSOVER_CUDA_ARGMAX_MB").as_deref() != Ok("0"),
            ),
            argmax_ws: RefCell::new(None),
            top_k_dev: std::cell::Cell::new(
                std::env::var("CROSSOVER_CUDA_TOPK").as_deref() != Ok("0"),
            ),
            topk_ws: RefCell::new(None),
            attn_wp: std::cell::Cell::new(
                std::env::var("CROSSOVER_CUDA_ATTN_WP").as_deref() != Ok("0"),
            ),
            pdl_small: std::cell::Cell::new(0),
        };
        let small = std::env::var("CROSSOVER_CUDA_PDL_SMALL")
            .ok()
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(PDL_SMALL_DEFAULT);
        if small != 0 && gpu.pdl.get() {
            gpu.set_pdl_small(small)?;
        }
        Ok(gpu)
    }

    /// The side stream and its events, or None when any of them cannot be made.
    fn make_side(ctx: &Arc<CudaContext>) -> Option<Side> {
        use cudarc::driver::sys::CUevent_flags;
        let stream = ctx.new_stream().ok()?;
        let fork = drv_result::event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING).ok()?;
        let Ok(join) = drv_result::event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING) else {
            // SAFETY: created just above, destroyed once.
            unsafe {
                let _ = drv_result::event::destroy(fork);
            }
            return None;
        };
        Some(Side { stream, fork, join })
    }

    /// Ask L2, from the side stream, for the bytes of up to four device ranges `(address,
    /// bytes)` once everything queued so far on the main stream has finished, while the main
    /// stream goes on (session 11: the weights of a product two or more launches ahead, read
    /// while small kernels leave the memory idle). A hint only: nothing is written, and
    /// nothing on the main stream waits for it until [`Gpu::side_join`]. Does nothing when
    /// there is no side stream or no range.
    pub fn side_prefetch(&self, ranges: &[(u64, usize)]) -> Result<(), CudaError> {
        let Some(side) = &self.side else {
            return Ok(());
        };
        #[repr(C)]
        struct PfRanges {
            p: [u64; 4],
            n: [i64; 4],
        }
        let mut r = PfRanges {
            p: [0; 4],
            n: [0; 4],
        };
        let mut k = 0;
        for &(a, b) in ranges.iter().filter(|x| x.0 != 0 && x.1 >= 16) {
            if k == 4 {
                return Err(CudaError::Arg(
                    "side prefetch: more than four ranges".into(),
                ));
            }
            // The bulk form wants 16-byte aligned starts and sizes.
            let a16 = a.next_multiple_of(16);
            let skip = (a16 - a) as usize;
            if b <= skip + 16 {
                continue;
            }
            r.p[k] = a16;
            r.n[k] = ((b - skip) & !15) as i64;
            k += 1;
        }
        if k == 0 {
            return Ok(());
        }
        let id = self.kernel_id("l2_prefetch")?;
        if self
            .skip
            .borrow()
            .iter()
            .any(|p| "l2_prefetch".starts_with(p.as_str()))
        {
            return Ok(());
        }
        let c = self.side_cfg.get();
        let (kind, chunk) = (c.kind as i32, c.chunk as i32);
        let f = &self.funcs[id];
        // SAFETY: both streams and the event belong to this context; recording then waiting
        // orders the side stream after everything queued on the main stream so far (in a
        // capture, the side stream joins it). The kernel's arguments match its C signature
        // (ops.cu `l2_prefetch`: a by-value struct of four addresses and four sizes, two ints);
        // it only issues prefetches of the given live ranges.
        unsafe {
            drv_result::event::record(side.fork, self.stream.cu_stream())
                .map_err(drv("side stream fork"))?;
            drv_result::stream::wait_event(
                side.stream.cu_stream(),
                side.fork,
                cudarc::driver::sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
            .map_err(drv("side stream wait"))?;
            let mut args: [*mut c_void; 3] = [
                (&mut r as *mut PfRanges).cast(),
                (&kind as *const i32 as *mut i32).cast(),
                (&chunk as *const i32 as *mut i32).cast(),
            ];
            drv_result::launch_kernel(
                f.cu_function(),
                (c.blocks, 1, 1),
                (c.threads, 1, 1),
                0,
                side.stream.cu_stream(),
                &mut args,
            )
            .map_err(drv("launching l2_prefetch"))?;
        }
        self.side_pending.set(true);
        Ok(())
    }

    /// Make the main stream wait for everything queued on the side stream (a capture must
    /// join every stream it forked before it ends). Does nothing when nothing is pending.
    pub fn side_join(&self) -> Result<(), CudaError> {
        let Some(side) = &self.side else {
            return Ok(());
        };
        if !self.side_pending.replace(false) {
            return Ok(());
        }
        // SAFETY: both streams and the event belong to this context.
        unsafe {
            drv_result::event::record(side.join, side.stream.cu_stream())
                .map_err(drv("side stream join"))?;
            drv_result::stream::wait_event(
                self.stream.cu_stream(),
                side.join,
                cudarc::driver::sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
            .map_err(drv("main stream wait"))?;
        }
        Ok(())
    }

    /// Whether cuBLAS is available for the GEMM path.
    pub fn has_blas(&self) -> bool {
        self.blas.is_some()
    }

    /// Free and total device memory.
    pub fn mem_info(&self) -> Result<(u64, u64), CudaError> {
        self.ctx
            .mem_get_info()
            .map(|(f, t)| (f as u64, t as u64))
            .map_err(drv("cuMemGetInfo"))
    }

    /// Allocate `bytes` (at least 1) of device memory, uninitialized.
    pub fn alloc(&self, bytes: usize) -> Result<DevBuf, CudaError> {
        // SAFETY: plain cuMemAlloc; the returned pointer is owned by the DevBuf.
        let ptr = unsafe { drv_result::malloc_sync(bytes.max(1)) }.map_err(|e| {
            let free = self.mem_info().map(|m| m.0).unwrap_or(0);
            if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                CudaError::OutOfMemory {
                    what: format!("an allocation of {bytes} bytes"),
                    need: bytes as u64,
                    free,
                }
            } else {
                CudaError::Driver {
                    what: format!("cuMemAlloc({bytes})"),
                    err: format!("{e:?}"),
                }
            }
        })?;
        Ok(DevBuf { ptr, bytes })
    }

    /// Allocate and fill with zeros.
    pub fn alloc_zeroed(&self, bytes: usize) -> Result<DevBuf, CudaError> {
        let b = self.alloc(bytes)?;
        // SAFETY: `b` holds at least `bytes` bytes.
        unsafe { drv_result::memset_d8_async(b.ptr, 0, bytes.max(1), self.stream.cu_stream()) }
            .map_err(drv("cuMemsetD8"))?;
        Ok(b)
    }

    /// Copy a host slice into a new device buffer (synchronously).
    pub fn upload<T: Copy>(&self, data: &[T]) -> Result<DevBuf, CudaError> {
        let bytes = std::mem::size_of_val(data);
        let b = self.alloc(bytes)?;
        self.write(&b, 0, data)?;
        self.sync()?;
        Ok(b)
    }

    /// Copy a host slice to `dst` at byte offset `off`, ordered on the stream. The host data may
    /// be reused as soon as this returns (pageable copies are staged by the driver).
    pub fn write<T: Copy>(&self, dst: &DevBuf, off: usize, data: &[T]) -> Result<(), CudaError> {
        let bytes = std::mem::size_of_val(data);
        if off + bytes > dst.bytes {
            return Err(CudaError::Arg(format!(
                "write of {bytes} bytes at {off} into a buffer of {}",
                dst.bytes
            )));
        }
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: bounds checked above; `data` is plain old data (`Copy`) of `bytes` bytes.
        unsafe {
            drv_result::memcpy_htod_async(dst.at(off), data, self.stream.cu_stream())
                .map_err(drv("cuMemcpyHtoD"))
        }
    }

    /// Copy a host slice to device address `dst`, ordered on the stream (exact mode's small
    /// per-step tables). The range must lie inside a live allocation of this context (the
    /// caller passes addresses inside its own [`DevBuf`]s, sized for the data).
    pub fn write_addr(&self, dst: u64, data: &[u8]) -> Result<(), CudaError> {
        if data.is_empty() {
            return Ok(());
        }
        // SAFETY: the caller keeps the range inside a live allocation (see above); pageable
        // host data is staged by the driver before this returns.
        unsafe {
            drv_result::memcpy_htod_async(dst, data, self.stream.cu_stream())
                .map_err(drv("cuMemcpyHtoD"))
        }
    }

    /// Copy `out.len()` bytes from device address `src` to the host; waits for the stream. The
    /// range must lie inside a live allocation of this context.
    pub fn read_addr(&self, src: u64, out: &mut [u8]) -> Result<(), CudaError> {
        if out.is_empty() {
            return Ok(());
        }
        // SAFETY: the caller keeps the range inside a live allocation; the synchronize below
        // completes the copy before `out` is used again.
        unsafe {
            drv_result::memcpy_dtoh_async(out, src, self.stream.cu_stream())
                .map_err(drv("cuMemcpyDtoH"))?;
        }
        self.sync()
    }

    /// Copy `bytes` bytes from device address `src` to `dst`, ordered on the stream. Both ranges
    /// must lie inside live allocations of this context (the callers pass addresses inside
    /// their own [`DevBuf`]s).
    pub fn copy_dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the caller keeps both ranges inside live allocations (see above); the copy
        // is ordered on this context's stream.
        unsafe {
            drv_result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream())
                .map_err(drv("cuMemcpyDtoD"))
        }
    }

    /// Copy `out.len()` elements from `src` at byte offset `off` to the host; waits for the stream.
    pub fn read<T: Copy>(&self, src: &DevBuf, off: usize, out: &mut [T]) -> Result<(), CudaError> {
        let bytes = std::mem::size_of_val(out);
        if off + bytes > src.bytes {
            return Err(CudaError::Arg(format!(
                "read of {bytes} bytes at {off} from a buffer of {}",
                src.bytes
            )));
        }
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: bounds checked; the host slice is written only by this copy, and the stream
        // synchronize below completes it before `out` is used again.
        unsafe {
            drv_result::memcpy_dtoh_async(out, src.at(off), self.stream.cu_stream())
                .map_err(drv("cuMemcpyDtoH"))?;
        }
        self.sync()
    }

    /// Copy a whole buffer of `T` to a new vector.
    pub fn download<T: Copy + Default>(&self, src: &DevBuf, n: usize) -> Result<Vec<T>, CudaError> {
        let mut v = vec![T::default(); n];
        self.read(src, 0, &mut v)?;
        Ok(v)
    }

    /// Session 35: let the small kernels in `mask` ([`PDL_SMALL_RMS`] ...) launch their
    /// successor before they wait for their own predecessor (the `pdl_small_c` constant of
    /// common.cu, read by those kernels at their start, so graphs captured before take the new
    /// order from their next replay). Waits for the stream first, so no running kernel sees
    /// the change. The results are the same bits either way: only when the next kernel's
    /// blocks start changes, not what any kernel reads after its wait.
    pub fn set_pdl_small(&self, mask: u32) -> Result<(), CudaError> {
        if mask & !PDL_SMALL_ALL != 0 {
            return Err(CudaError::Arg(format!(
                "early-launch mask {mask:#x} has bits past {PDL_SMALL_ALL:#x}"
            )));
        }
        self.sync()?;
        let mut sym = self
            ._module
            .get_global("pdl_small_c", &self.stream)
            .map_err(drv("the pdl_small_c constant"))?;
        // SAFETY: the symbol is one int (common.cu); the view is 4 bytes long.
        let mut v = unsafe { sym.transmute_mut::<i32>(1) }
            .ok_or_else(|| CudaError::Arg("pdl_small_c is not one int".into()))?;
        self.stream
            .memcpy_htod(&[mask as i32], &mut v)
            .map_err(drv("setting pdl_small_c"))?;
        self.sync()?;
        self.pdl_small.set(mask);
        Ok(())
    }

    /// The mask [`Gpu::set_pdl_small`] set last.
    pub fn pdl_small(&self) -> u32 {
        self.pdl_small.get()
    }

    /// Wait for all queued work; reports errors of earlier kernels.
    pub fn sync(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(drv("stream synchronize"))
    }

    /// Milliseconds of GPU time per replay of the launches `f` queues, captured once as a graph
    /// and replayed `reps` times between two events (so launch gaps are the graph's, as in a
    /// decode step, not the host's).
    pub fn time_graph(
        &self,
        reps: usize,
        f: &mut dyn FnMut() -> Result<(), CudaError>,
    ) -> Result<f64, CudaError> {
        use cudarc::driver::sys;
        self.sync()?;
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(drv("begin capture"))?;
        let r = f();
        let g = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(drv("end capture"));
        r?;
        let g = g?.ok_or_else(|| CudaError::Arg("capture produced no graph".into()))?;
        g.launch().map_err(drv("graph launch"))?;
        let e0 = self
            .stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv("cuEventRecord"))?;
        for _ in 0..reps {
            g.launch().map_err(drv("graph launch"))?;
        }
        let e1 = self
            .stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv("cuEventRecord"))?;
        self.sync()?;
        let ms = e0.elapsed_ms(&e1).map_err(drv("cuEventElapsedTime"))?;
        Ok(ms as f64 / reps.max(1) as f64)
    }

    /// Start timing every launch (eager launches only: not while a graph is being captured).
    /// Each launch is followed by a timing event; [`Gpu::profile_stop`] turns them into times.
    pub fn profile_start(&self) -> Result<(), CudaError> {
        let e = self
            .stream
            .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv("cuEventRecord"))?;
        *self.prof.borrow_mut() = Some(vec![("start".into(), e)]);
        Ok(())
    }

    fn prof_mark(&self, name: &str) -> Result<(), CudaError> {
        if let Some(v) = self.prof.borrow_mut().as_mut() {
            let e = self
                .stream
                .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(drv("cuEventRecord"))?;
            v.push((name.to_string(), e));
        }
        Ok(())
    }

    /// Stop timing; returns each launch's kernel name and the milliseconds from the previous
    /// event to its own (its run time plus any idle gap before it).
    pub fn profile_stop(&self) -> Result<Vec<(String, f64)>, CudaError> {
        self.sync()?;
        let v = self.prof.borrow_mut().take().unwrap_or_default();
        let mut out = Vec::with_capacity(v.len());
        for w in v.windows(2) {
            let ms = w[0]
                .1
                .elapsed_ms(&w[1].1)
                .map_err(drv("cuEventElapsedTime"))?;
            out.push((w[1].0.clone(), ms as f64));
        }
        Ok(out)
    }

    /// How many blocks of `threads` threads of kernel `id` (no dynamic shared memory) a
    /// multiprocessor holds at once (the driver's occupancy calculation, kept per kernel).
    pub(crate) fn blocks_per_sm(&self, id: usize, threads: u32) -> Result<usize, CudaError> {
        let f = self
            .funcs
            .get(id)
            .ok_or_else(|| CudaError::Arg(format!("no kernel number {id}")))?;
        if let Some(&(t, n)) = self.occupancy.borrow().get(id) {
            if t == threads && n > 0 {
                return Ok(n);
            }
        }
        let mut n: std::ffi::c_int = 0;
        // SAFETY: a valid function handle of this context and a live out-pointer.
        unsafe {
            cudarc::driver::sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                &mut n,
                f.cu_function(),
                threads as std::ffi::c_int,
                0,
            )
        }
        .result()
        .map_err(drv("cuOccupancyMaxActiveBlocksPerMultiprocessor"))?;
        let n = (n.max(1)) as usize;
        if let Some(e) = self.occupancy.borrow_mut().get_mut(id) {
            *e = (threads, n);
        }
        Ok(n)
    }

    /// The number of the kernel called `name` in [`all_kernel_names`].
    pub(crate) fn kernel_id(&self, name: &str) -> Result<usize, CudaError> {
        self.names
            .iter()
            .position(|n| n == name)
            .ok_or_else(|| CudaError::Arg(format!("no kernel {name}")))
    }

    /// Launch kernel number `id` of [`all_kernel_names`] on the stream.
    pub(crate) fn launch_id(
        &self,
        id: usize,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &mut [*mut c_void],
    ) -> Result<(), CudaError> {
        self.launch_id_smem(id, grid, block, 0, args)
    }

    /// [`Gpu::launch_id`] with `smem` bytes of dynamic shared memory (over 48 KiB the kernel's
    /// limit is raised first).
    pub(crate) fn launch_id_smem(
        &self,
        id: usize,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &mut [*mut c_void],
    ) -> Result<(), CudaError> {
        self.launch_id_cluster(id, grid, block, smem, 1, args)
    }

    /// [`Gpu::launch_id_smem`] in thread block clusters of `cluster` blocks along x (session 21;
    /// sm_90; `grid.0` a multiple of `cluster`); 1: no cluster.
    pub(crate) fn launch_id_cluster(
        &self,
        id: usize,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        cluster: u32,
        args: &mut [*mut c_void],
    ) -> Result<(), CudaError> {
        let f = self
            .funcs
            .get(id)
            .ok_or_else(|| CudaError::Arg(format!("no kernel number {id}")))?;
        let name = self.names.get(id).map_or("?", String::as_str);
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let (skip, hop) = {
            let s = self.skip.borrow();
            let skip = s.iter().any(|p| name.starts_with(p.as_str()));
            // "~prefix": the launch stands in as one empty block (`pdl_hop`).
            let hop = s
                .iter()
                .any(|p| p.strip_prefix('~').is_some_and(|q| name.starts_with(q)));
            (skip, hop)
        };
        if skip {
            return Ok(());
        }
        if let Some(log) = self.launch_log.borrow_mut().as_mut() {
            *log.entry(name.to_string()).or_insert(0) += 1;
        }
        if hop {
            let id = self.kernel_id("pdl_hop")?;
            return self.launch_id_cluster(id, (1, 1, 1), (32, 1, 1), 0, 1, &mut []);
        }
        if smem > 48 * 1024 {
            use cudarc::driver::sys;
            // SAFETY: a valid function handle of this context; the attribute takes a byte count.
            unsafe {
                sys::cuFuncSetAttribute(
                    f.cu_function(),
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
            }
            .result()
            .map_err(drv(format!("shared memory limit of {name}")))?;
        }
        if cluster > 1 && !grid.0.is_multiple_of(cluster) {
            return Err(CudaError::Arg(format!(
                "{name}: grid of {} blocks in clusters of {cluster}",
                grid.0
            )));
        }
        // SAFETY: the argument list matches the kernel's C signature (each launch site in
        // kernels.rs mirrors the .cu declaration), every pointer is a live device buffer of the
        // size the kernel indexes, and the stream belongs to this context.
        if self.pdl.get() || cluster > 1 {
            use cudarc::driver::sys;
            // SAFETY: an all-zero launch attribute is a valid (empty) value; the fields set
            // below are each one's id and the one union member that id reads.
            let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
            let mut na = 0;
            if self.pdl.get() {
                attrs[na].id =
                    sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
                attrs[na].value.programmaticStreamSerializationAllowed = 1;
                na += 1;
            }
            if cluster > 1 {
                attrs[na].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
                attrs[na].value.clusterDim.x = cluster;
                attrs[na].value.clusterDim.y = 1;
                attrs[na].value.clusterDim.z = 1;
                na += 1;
            }
            let cfg = sys::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block.0,
                blockDimY: block.1,
                blockDimZ: block.2,
                sharedMemBytes: smem,
                hStream: self.stream.cu_stream(),
                attrs: attrs.as_mut_ptr(),
                numAttrs: na as u32,
            };
            // SAFETY: as for the plain launch below; `cfg` and `attrs` outlive the call, and
            // every kernel starts with griddepcontrol.wait (common.cu), so starting it before
            // its predecessor ends is safe.
            unsafe {
                sys::cuLaunchKernelEx(
                    &cfg,
                    f.cu_function(),
                    args.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            }
            .result()
            .map_err(drv(format!("launching {name}")))?;
            return self.prof_mark(name);
        }
        unsafe {
            drv_result::launch_kernel(
                f.cu_function(),
                grid,
                block,
                smem,
                self.stream.cu_stream(),
                args,
            )
        }
        .map_err(drv(format!("launching {name}")))?;
        self.prof_mark(name)
    }

    /// `C[n, m] (+)= A[n, k] * W[m, k]^T` with f16 `W` (row-major `m x k`) and f16 `A` (row-major
    /// `n x k`), f32 output and accumulation (tensor cores). `beta` 1 adds into `C`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_f16(
        &self,
        w: u64,
        a: u64,
        c: u64,
        m: usize,
        n: usize,
        k: usize,
        beta: f32,
    ) -> Result<(), CudaError> {
        // v10: batched decode shapes take their tuned cuBLASLt algorithm where it won.
        if self.lt_wants(n) {
            let sh = crate::lt::GemmShape {
                m,
                n,
                k,
                acc: beta != 0.0,
            };
            if self.gemm_lt(sh, w, a, c)? {
                return self.prof_mark("cublaslt_gemm_f16");
            }
        }
        self.gemm_ex(w, a, c, m, n, k, beta)?;
        self.prof_mark("cublas_gemm_f16")
    }

    /// [`Gpu::gemm_f16`] through `cublasGemmEx` (`CUBLAS_GEMM_DEFAULT`), without a profile mark.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm_ex(
        &self,
        w: u64,
        a: u64,
        c: u64,
        m: usize,
        n: usize,
        k: usize,
        beta: f32,
    ) -> Result<(), CudaError> {
        use cudarc::cublas::sys::{
            cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType,
        };
        let blas = self.blas.as_ref().ok_or_else(|| CudaError::Cublas {
            what: "gemm".into(),
            err: self.blas_missing.clone().unwrap_or_default(),
        })?;
        let alpha = 1.0f32;
        // Column-major view: C^T (m x n, ldc m) = op(W_cm)^T ... W row-major m x k is column-major
        // k x m (lda k), transposed; A row-major n x k is column-major k x n (ldb k).
        // SAFETY: pointers are live device buffers of at least m*k, n*k halves and n*m floats;
        // alpha/beta are host scalars (the handle's default pointer mode).
        unsafe {
            cudarc::cublas::result::gemm_ex(
                blas.handle,
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                (&alpha) as *const f32 as *const c_void,
                w as *const c_void,
                cudaDataType::CUDA_R_16F,
                k as i32,
                a as *const c_void,
                cudaDataType::CUDA_R_16F,
                k as i32,
                (&beta) as *const f32 as *const c_void,
                c as *mut c_void,
                cudaDataType::CUDA_R_32F,
                m as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| CudaError::Cublas {
            what: format!("gemm m={m} n={n} k={k}"),
            err: format!("{e:?}"),
        })
    }
}
