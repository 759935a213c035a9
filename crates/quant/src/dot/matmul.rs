//! Matrix products `out[t][r] = dot(W row r, x_t)`, tiled and spread over a [`Pool`].
//!
//! Work is cut into chunks of (rows × tokens). A chunk's weight rows are read once per group of
//! `nt` tokens and stay in L2 between groups; each tile reuses every unpacked weight block for
//! `nt` tokens and every activation block for `mr` rows. Threads take chunks from a shared
//! counter, so a slow or descheduled thread does not hold the others up. Several products that
//! share one input (Q/K/V, gate/up) can run as one dispatch ([`matmul_f32_multi`]), which halves
//! the hand-offs per layer and balances small matrices against large ones.

use std::cell::RefCell;

use gguf::GgmlType;

use super::kernels::{self, Kernel, Tile};
use super::packed::PackedMat;
use super::{act_type, best_isa, row_bytes, ActBuf, DotError, Isa, Pool, SumOrder};

/// Products smaller than this many multiply-adds run on the calling thread alone: handing them
/// out costs more than it saves.
const SERIAL_MACS: usize = 1 << 15;
/// Tokens per chunk, at most (rounded to a multiple of the kernel's `nt`).
const TOKENS_PER_CHUNK: usize = 64;
/// Weight bytes per chunk, at most: keeps a chunk's rows in L2 while its token groups run.
const CHUNK_WEIGHT_BYTES: usize = 256 * 1024;
/// Activation rows quantized per work item when quantization is spread over the pool.
const QUANT_ROWS_PER_ITEM: usize = 8;

/// One product of a batch run by [`matmul_f32_multi`] / [`matmul_multi`]: `rows` rows of
/// `weight_ty` weights (GGUF layout, `cols` elements each) and the output, token-major
/// (`n_tokens * rows` elements).
#[derive(Debug)]
pub struct MatJob<'a> {
    pub weight_ty: GgmlType,
    pub w: &'a [u8],
    pub rows: usize,
    pub out: &'a mut [f32],
}

/// `out[t * rows + r] = dot(row r of w, token t of acts)` for every weight row `r` and token `t`,
/// with the best instruction set. `w` holds `rows` rows of `cols` elements of `weight_ty` in GGUF
/// layout; `acts` must come from [`super::quantize_acts`] for the same weight type and `cols`;
/// `out` has `acts.n_tokens() * rows` elements.
pub fn matmul(
    weight_ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    acts: &ActBuf,
    out: &mut [f32],
    pool: &Pool,
) -> Result<(), DotError> {
    matmul_with_isa(weight_ty, w, rows, cols, acts, out, pool, best_isa())
}

/// [`matmul`] with an explicit instruction set (for tests and comparisons).
#[allow(clippy::too_many_arguments)]
pub fn matmul_with_isa(
    weight_ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    acts: &ActBuf,
    out: &mut [f32],
    pool: &Pool,
    isa: Isa,
) -> Result<(), DotError> {
    matmul_ordered(
        weight_ty,
        w,
        rows,
        cols,
        acts,
        out,
        pool,
        isa,
        SumOrder::Ggml,
    )
}

/// [`matmul_with_isa`] in a chosen [`SumOrder`] (heeded by the 32-element block types).
#[allow(clippy::too_many_arguments)]
pub fn matmul_ordered(
    weight_ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    acts: &ActBuf,
    out: &mut [f32],
    pool: &Pool,
    isa: Isa,
    order: SumOrder,
) -> Result<(), DotError> {
    if acts.cols() != cols {
        return Err(DotError::Cols {
            weight_ty,
            expected: cols,
            got: acts.cols(),
        });
    }
    let mut jobs = [MatJob {
        weight_ty,
        w,
        rows,
        out,
    }];
    run_jobs(&mut jobs, &[acts], pool, isa, None, None, order)
}

/// [`matmul`] of a packed matrix ([`PackedMat`]): the same results, bit for bit, as
/// [`matmul`] on the GGUF bytes it was packed from.
pub fn matmul_packed(
    w: &PackedMat,
    acts: &ActBuf,
    out: &mut [f32],
    pool: &Pool,
) -> Result<(), DotError> {
    matmul_packed_with_amx(w, acts, out, pool, super::amx_enabled())
}

/// [`matmul_packed`] with the AMX kernels allowed (`amx`: for the types that have one, where
/// [`super::amx_available`], for products of 8 or more tokens) or not, whatever
/// [`super::amx_enabled`] says: for tests and comparisons. The results are the same bit for
/// bit either way.
pub fn matmul_packed_with_amx(
    w: &PackedMat,
    acts: &ActBuf,
    out: &mut [f32],
    pool: &Pool,
    amx: bool,
) -> Result<(), DotError> {
    matmul_packed_ordered(w, acts, out, pool, amx, SumOrder::Ggml)
}

/// [`matmul_packed_with_amx`] in a chosen [`SumOrder`] (heeded by the 32-element block types;
/// an order without an AMX kernel for the type runs the `vpdpbusd` one).
pub fn matmul_packed_ordered(
    w: &PackedMat,
    acts: &ActBuf,
    out: &mut [f32],
    pool: &Pool,
    amx: bool,
    order: SumOrder,
) -> Result<(), DotError> {
    if acts.cols() != w.cols() {
        return Err(DotError::Cols {
            weight_ty: w.weight_type(),
            expected: w.cols(),
            got: acts.cols(),
        });
    }
    let mut jobs = [MatJob {
        weight_ty: w.weight_type(),
        w: w.bytes(),
        rows: w.rows(),
        out,
    }];
    let amx_k = if amx { w.amx_kernel(order) } else { None };
    run_jobs(
        &mut jobs,
        &[acts],
        pool,
        best_isa(),
        w.kernels(order),
        amx_k,
        order,
    )
}

/// [`matmul_f32`] of a packed matrix ([`PackedMat`]).
pub fn matmul_f32_packed(
    w: &PackedMat,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
    pool: &Pool,
) -> Result<(), DotError> {
    matmul_f32_packed_ordered(w, x, n_tokens, out, pool, SumOrder::Ggml)
}

/// [`matmul_f32_packed`] in a chosen [`SumOrder`] (heeded by the 32-element block types).
pub fn matmul_f32_packed_ordered(
    w: &PackedMat,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
    pool: &Pool,
    order: SumOrder,
) -> Result<(), DotError> {
    let mut jobs = [MatJob {
        weight_ty: w.weight_type(),
        w: w.bytes(),
        rows: w.rows(),
        out,
    }];
    let amx = if super::amx_enabled() {
        w.amx_kernel(order)
    } else {
        None
    };
    f32_jobs(
        &mut jobs,
        x,
        n_tokens,
        w.cols(),
        pool,
        w.kernels(order),
        amx,
        order,
    )
}

/// Several products of packed matrices ([`PackedMat`]) over the same f32 activations `x`
/// (`n_tokens` rows), e.g. the Q, K and V projections, in one dispatch: the input is quantized
/// once and the threads share one pool of chunks. The matrices must share their weight type,
/// row length and layout ([`DotError::Mixed`] otherwise); each output (`n_tokens` × its rows,
/// token-major) is bit for bit what [`matmul_f32_packed_ordered`] gives for its matrix alone.
pub fn matmul_f32_packed_multi_ordered(
    mats: &mut [(&PackedMat, &mut [f32])],
    x: &[f32],
    n_tokens: usize,
    pool: &Pool,
    order: SumOrder,
) -> Result<(), DotError> {
    let Some((first, _)) = mats.first() else {
        return Ok(());
    };
    let first: &PackedMat = first;
    for (m, _) in mats.iter() {
        let mixed = |what, a: String, b: String| DotError::Mixed {
            what,
            first: a,
            other: b,
        };
        if m.weight_type() != first.weight_type() {
            let (a, b) = (first.weight_type(), m.weight_type());
            return Err(mixed("weight type", a.to_string(), b.to_string()));
        }
        if m.cols() != first.cols() {
            let (a, b) = (first.cols(), m.cols());
            return Err(mixed("columns", a.to_string(), b.to_string()));
        }
        if m.is_interleaved() != first.is_interleaved() {
            let name = |i: bool| if i { "packed" } else { "plain copy" }.to_string();
            return Err(mixed(
                "layout",
                name(first.is_interleaved()),
                name(m.is_interleaved()),
            ));
        }
    }
    let amx = if super::amx_enabled() {
        first.amx_kernel(order)
    } else {
        None
    };
    let (packed, cols) = (first.kernels(order), first.cols());
    let mut jobs: Vec<MatJob<'_>> = mats
        .iter_mut()
        .map(|(m, out)| MatJob {
            weight_ty: m.weight_type(),
            w: m.bytes(),
            rows: m.rows(),
            out,
        })
        .collect();
    f32_jobs(&mut jobs, x, n_tokens, cols, pool, packed, amx, order)
}

/// Run several products over the same activations in one dispatch. `acts` holds the input
/// quantized for every activation type the jobs need (one [`ActBuf`] per type, any order, all
/// with the same tokens and columns).
pub fn matmul_multi(
    jobs: &mut [MatJob<'_>],
    acts: &[&ActBuf],
    pool: &Pool,
) -> Result<(), DotError> {
    run_jobs(jobs, acts, pool, best_isa(), None, None, SumOrder::Ggml)
}

thread_local! {
    /// Per-thread activation scratch for the `*_f32` entry points: one buffer per activation
    /// type (Q8_0, Q8_1, Q8_K, F32).
    static SCRATCH: RefCell<[ActBuf; 4]> = RefCell::new(std::array::from_fn(|_| ActBuf::new()));
}

fn scratch_slot(act: GgmlType) -> usize {
    match act {
        GgmlType::Q8_0 => 0,
        GgmlType::Q8_1 => 1,
        GgmlType::Q8K => 2,
        _ => 3,
    }
}

/// [`matmul`] on f32 activations `x` (`n_tokens` rows of `cols`): quantizes them (across the
/// pool for many tokens) into a per-thread scratch buffer first.
#[allow(clippy::too_many_arguments)]
pub fn matmul_f32(
    weight_ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
    pool: &Pool,
) -> Result<(), DotError> {
    matmul_f32_ordered(
        weight_ty,
        w,
        rows,
        cols,
        x,
        n_tokens,
        out,
        pool,
        SumOrder::Ggml,
    )
}

/// [`matmul_f32`] in a chosen [`SumOrder`] (heeded by the 32-element block types).
#[allow(clippy::too_many_arguments)]
pub fn matmul_f32_ordered(
    weight_ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
    pool: &Pool,
    order: SumOrder,
) -> Result<(), DotError> {
    let mut jobs = [MatJob {
        weight_ty,
        w,
        rows,
        out,
    }];
    f32_jobs(&mut jobs, x, n_tokens, cols, pool, None, None, order)
}

/// Several products of the same f32 activations `x` (`n_tokens` rows of `cols`), e.g. the Q, K
/// and V projections: the input is quantized once per activation type the jobs need, and all
/// products run in one dispatch.
pub fn matmul_f32_multi(
    jobs: &mut [MatJob<'_>],
    x: &[f32],
    n_tokens: usize,
    cols: usize,
    pool: &Pool,
) -> Result<(), DotError> {
    f32_jobs(jobs, x, n_tokens, cols, pool, None, None, SumOrder::Ggml)
}

#[allow(clippy::too_many_arguments)]
fn f32_jobs(
    jobs: &mut [MatJob<'_>],
    x: &[f32],
    n_tokens: usize,
    cols: usize,
    pool: &Pool,
    packed: Option<(Kernel, Kernel)>,
    amx: Option<(Kernel, bool)>,
    order: SumOrder,
) -> Result<(), DotError> {
    let isa = best_isa();
    SCRATCH.with(|s| {
        let mut fresh: [ActBuf; 4];
        let mut guard;
        // A nested call (impossible unless a kernel calls back in) gets fresh buffers rather
        // than a borrow panic.
        let bufs: &mut [ActBuf; 4] = match s.try_borrow_mut() {
            Ok(g) => {
                guard = g;
                &mut guard
            }
            Err(_) => {
                fresh = std::array::from_fn(|_| ActBuf::new());
                &mut fresh
            }
        };
        let mut needed = [None; 4];
        for j in jobs.iter() {
            let at = act_type(j.weight_ty)?;
            let slot = scratch_slot(at);
            if needed[slot].is_none() {
                needed[slot] = Some(j.weight_ty);
            }
        }
        for (slot, wt) in needed.iter().enumerate() {
            if let Some(wt) = wt {
                quantize_acts_pool(*wt, x, n_tokens, cols, &mut bufs[slot], isa, pool)?;
            }
        }
        let acts: Vec<&ActBuf> = needed
            .iter()
            .zip(bufs.iter())
            .filter(|(n, _)| n.is_some())
            .map(|(_, b)| b)
            .collect();
        run_jobs(jobs, &acts, pool, isa, packed, amx, order)
    })
}

/// [`super::quantize_acts_with_isa`], with the rows spread over `pool` when there are many.
fn quantize_acts_pool(
    weight_ty: GgmlType,
    x: &[f32],
    n_tokens: usize,
    cols: usize,
    buf: &mut ActBuf,
    isa: Isa,
    pool: &Pool,
) -> Result<(), DotError> {
    if n_tokens < 2 * QUANT_ROWS_PER_ITEM || pool.n_threads() == 1 {
        return super::quantize_acts_with_isa(weight_ty, x, n_tokens, cols, buf, isa);
    }
    // Validate and size the buffer with an empty run, then fill rows in parallel.
    super::quantize_acts_with_isa(weight_ty, &[], 0, cols, buf, isa)?;
    let expected = n_tokens.checked_mul(cols).ok_or(DotError::Overflow {
        what: "activation element count",
    })?;
    if x.len() != expected {
        return Err(DotError::Length {
            what: "activations x (f32)",
            expected,
            got: x.len(),
        });
    }
    let act_ty = buf.act_type();
    buf.reshape(act_ty, n_tokens, cols)?;
    let rb = buf.row_bytes();
    let base = SendPtr(buf.bytes_mut().as_mut_ptr());
    let items = n_tokens.div_ceil(QUANT_ROWS_PER_ITEM);
    pool.par_for(items, |i| {
        let base: SendPtr = base;
        let t0 = i * QUANT_ROWS_PER_ITEM;
        let t1 = (t0 + QUANT_ROWS_PER_ITEM).min(n_tokens);
        for t in t0..t1 {
            // SAFETY: rows t0..t1 of the buffer (sized by `reshape` for n_tokens rows of `rb`
            // bytes) belong to this item alone; the buffer outlives `par_for`.
            let y = unsafe { std::slice::from_raw_parts_mut(base.0.add(t * rb), rb) };
            kernels::quantize_row(act_ty, isa, &x[t * cols..(t + 1) * cols], y);
        }
    });
    Ok(())
}

#[derive(Clone, Copy)]
struct SendPtr(*mut u8);
// SAFETY: used only to hand disjoint rows of one buffer to pool workers (see the use).
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

/// One validated product, as raw pointers for the workers. Threads write disjoint output
/// elements and only read the inputs.
#[derive(Clone, Copy)]
struct Prepared {
    k: Kernel,
    /// Kernel for tokens `tail_from..` (llama.cpp's rounding of the tokens left over from
    /// groups of 4, see `kernels::tail_kernel`); `tail_from == n_tokens` when none.
    tail: Kernel,
    tail_from: usize,
    nb: usize,
    rows: usize,
    wrb: usize,
    w: *const u8,
    a: *const u8,
    arb: usize,
    out: *mut f32,
    plan: Plan,
    /// Index of this job's first chunk in the batch.
    first: usize,
}
// SAFETY: the pointers are only dereferenced inside `run_jobs`'s `pool.run`, which returns
// before the borrows they came from end; writes go to disjoint elements.
unsafe impl Send for Prepared {}
// SAFETY: as above.
unsafe impl Sync for Prepared {}

/// `packed`: the kernels of a packed layout (groups of 4 tokens, tokens left over), which then
/// apply to every job (the weights are packed bytes); `None` for GGUF-layout weights. `amx`:
/// the packed layout's AMX kernel and whether it reads transposed activations, taken for
/// products of at least [`AMX_MIN_TOKENS`] tokens (the packed tail kernel still takes the
/// tokens left over from groups of 4). `order`: the summation order of the 32-element block
/// types (the `packed` and `amx` kernels were chosen for it).
fn run_jobs(
    jobs: &mut [MatJob<'_>],
    acts: &[&ActBuf],
    pool: &Pool,
    isa: Isa,
    packed: Option<(Kernel, Kernel)>,
    amx: Option<(Kernel, bool)>,
    order: SumOrder,
) -> Result<(), DotError> {
    if !isa.available() {
        return Err(DotError::IsaUnavailable { isa });
    }
    let Some(first) = acts.first() else {
        return match jobs.first() {
            Some(j) => Err(DotError::ActType {
                weight_ty: j.weight_ty,
                expected: act_type(j.weight_ty)?,
                got: GgmlType::F32,
            }),
            None => Ok(()),
        };
    };
    let (n_tokens, cols) = (first.n_tokens(), first.cols());
    let mut prepared: Vec<Prepared> = Vec::with_capacity(jobs.len());
    let mut wide_guard = WIDE.with(|w| w.take());
    // Per-job activation rows of the whole-block packed kernels (spare buffers, and those in
    // use by this call's jobs).
    let mut block_bufs = BLOCK_ROWS.with(|b| b.take());
    let mut block_used: Vec<Vec<WideLine>> = Vec::new();
    // The wide many-token kernels exist on x86-64 only.
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    let wide_bufs = &mut wide_guard;
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables, unused_mut))]
    let mut wide_built = [false; 2];
    // The last activation rows laid out for the whole-block kernels: (source rows, row bytes,
    // blocks, extra) and where they were put.
    #[cfg(target_arch = "x86_64")]
    #[allow(clippy::type_complexity)]
    let mut last_block: Option<((*const u8, usize, usize, Option<u32>), *const u8)> = None;
    let mut total_chunks = 0usize;
    let mut total_macs = 0usize;
    for j in jobs.iter_mut() {
        let want = act_type(j.weight_ty)?;
        let a = acts
            .iter()
            .find(|a| a.act_type() == want)
            .ok_or(DotError::ActType {
                weight_ty: j.weight_ty,
                expected: want,
                got: first.act_type(),
            })?;
        if a.cols() != cols {
            return Err(DotError::Cols {
                weight_ty: j.weight_ty,
                expected: cols,
                got: a.cols(),
            });
        }
        if a.n_tokens() != n_tokens {
            return Err(DotError::Length {
                what: "activation tokens (per activation type)",
                expected: n_tokens,
                got: a.n_tokens(),
            });
        }
        let wrb = row_bytes(j.weight_ty, cols)?;
        let wlen = wrb.checked_mul(j.rows).ok_or(DotError::Overflow {
            what: "weight matrix size",
        })?;
        if j.w.len() != wlen {
            return Err(DotError::Length {
                what: "weights (bytes)",
                expected: wlen,
                got: j.w.len(),
            });
        }
        let olen = n_tokens.checked_mul(j.rows).ok_or(DotError::Overflow {
            what: "output size",
        })?;
        if j.out.len() != olen {
            return Err(DotError::Length {
                what: "output (f32)",
                expected: olen,
                got: j.out.len(),
            });
        }
        if olen == 0 {
            continue;
        }
        if cols == 0 {
            j.out.fill(0.0);
            continue;
        }
        let nb = cols / j.weight_ty.block_size();
        let amx = amx.filter(|_| n_tokens >= AMX_MIN_TOKENS && isa == Isa::Avx512);
        let wide = match amx {
            Some((k, true)) => Some(k),
            Some((_, false)) => None,
            None if packed.is_none() && n_tokens >= WIDE_MIN_TOKENS => {
                wide_kernel(j.weight_ty, isa, order)
            }
            None => None,
        };
        let (k, tail) = match (amx, packed, wide) {
            // A kernel over transposed activations takes every token (the tail kernels read
            // plain rows).
            (Some((k, false)), Some((_, t)), _) => (k, Some(t)),
            (Some((k, _)), _, _) => (k, None),
            (None, Some((k, t)), _) => (k, Some(t)),
            (None, None, Some(k)) => (k, None),
            (None, None, None) => (
                kernels::kernel(j.weight_ty, isa, order)
                    .ok_or(DotError::Unsupported { ty: j.weight_ty })?,
                kernels::tail_kernel(j.weight_ty, isa),
            ),
        };
        // Wide kernels read the activations transposed (tokens across lanes), made once per
        // product and activation type.
        // The whole-block packed kernels (and their AMX form) read activation rows with each
        // block's scales converted (and offset seed summed) once per product.
        #[cfg(target_arch = "x86_64")]
        let block_rows = match (wide, packed) {
            (None, Some(_)) if order == SumOrder::Block => {
                super::avx512::block_act_extra(j.weight_ty)
            }
            _ => None,
        };
        let (a_ptr, arb) = match wide {
            #[cfg(target_arch = "x86_64")]
            None if block_rows.is_some() => {
                let extra = block_rows.flatten();
                let key = (a.bytes().as_ptr(), a.row_bytes(), nb, extra);
                let ptr = match last_block {
                    // The jobs of a grouped product (Q/K/V, gate/up) read the same rows.
                    Some((k, ptr)) if k == key => ptr,
                    _ => {
                        let mut buf = block_bufs.pop().unwrap_or_default();
                        super::avx512::block_acts_pool(
                            a.bytes(),
                            a.row_bytes(),
                            n_tokens,
                            nb,
                            extra,
                            &mut buf,
                            pool,
                        );
                        let ptr = buf.as_ptr() as *const u8;
                        // The buffer's heap block does not move when the vector is moved; it
                        // lives in `block_used` until every job has run.
                        block_used.push(buf);
                        last_block = Some((key, ptr));
                        ptr
                    }
                };
                (ptr, nb * super::avx512::BLOCK_ACT)
            }
            #[cfg(target_arch = "x86_64")]
            Some(_) => {
                let min = a.act_type() == GgmlType::Q8_1;
                let slot = usize::from(min);
                if !wide_built[slot] {
                    super::avx512::wide_acts(
                        a.bytes(),
                        a.row_bytes(),
                        n_tokens,
                        nb,
                        min,
                        &mut wide_bufs[slot],
                    );
                    wide_built[slot] = true;
                }
                (
                    wide_bufs[slot].as_ptr() as *const u8,
                    nb * super::avx512::WIDE_BLOCK / super::avx512::WIDE_LANES,
                )
            }
            _ => (a.bytes().as_ptr(), a.row_bytes()),
        };
        if k.exact_rows && !j.rows.is_multiple_of(k.mr) {
            return Err(DotError::Length {
                what: "rows of a packed matrix (whole groups)",
                expected: j.rows.div_ceil(k.mr) * k.mr,
                got: j.rows,
            });
        }
        let plan = Plan::new(&k, j.rows, n_tokens, wrb, pool.n_threads(), cols);
        let (tail, tail_from) = match tail {
            Some(t) => (t, n_tokens - n_tokens % kernels::GROUP_TOKENS),
            None => (k, n_tokens),
        };
        prepared.push(Prepared {
            k,
            tail,
            tail_from,
            nb,
            rows: j.rows,
            wrb,
            w: j.w.as_ptr(),
            a: a_ptr,
            arb,
            out: j.out.as_mut_ptr(),
            plan,
            first: total_chunks,
        });
        total_chunks += plan.n_chunks;
        total_macs =
            total_macs.saturating_add(j.rows.saturating_mul(cols).saturating_mul(n_tokens));
    }
    if total_chunks == 0 {
        return Ok(());
    }
    let prepared = &prepared[..];
    let run_chunk = |c: usize| {
        // Chunks are numbered job after job; few jobs, so a scan is cheap.
        let Some(p) = prepared.iter().rev().find(|p| p.first <= c) else {
            return;
        };
        // SAFETY: `p` describes a validated job and `c - p.first` one of its chunks.
        unsafe { run_chunk(p, c - p.first) };
    };
    if total_macs < SERIAL_MACS || total_chunks == 1 || pool.n_threads() == 1 {
        (0..total_chunks).for_each(run_chunk);
    } else {
        pool.par_for(total_chunks, run_chunk);
    }
    WIDE.with(|w| w.replace(wide_guard));
    block_bufs.append(&mut block_used);
    BLOCK_ROWS.with(|b| b.replace(block_bufs));
    Ok(())
}

/// Products of at least this many tokens use the wide kernels of the legacy types (tokens
/// across the vector lanes), where one exists.
const WIDE_MIN_TOKENS: usize = 8;

/// Products of packed legacy matrices with at least this many tokens use the AMX kernel where
/// it is enabled.
const AMX_MIN_TOKENS: usize = 8;

thread_local! {
    /// Transposed activations for the wide kernels, per activation type (Q8_0, Q8_1), reused
    /// between products.
    static WIDE: std::cell::Cell<[Vec<WideLine>; 2]> = const { std::cell::Cell::new([Vec::new(), Vec::new()]) };
}

thread_local! {
    /// Activation rows of the whole-block packed kernels (`avx512::block_acts`), one buffer
    /// per job of a call, reused between products.
    static BLOCK_ROWS: std::cell::Cell<Vec<Vec<WideLine>>> = const { std::cell::Cell::new(Vec::new()) };
}

#[cfg(target_arch = "x86_64")]
type WideLine = super::avx512::Line64;
#[cfg(not(target_arch = "x86_64"))]
type WideLine = [u8; 64];

fn wide_kernel(ty: GgmlType, isa: Isa, order: SumOrder) -> Option<Kernel> {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => super::avx512::wide_kernel(ty, order),
        _ => {
            let _ = (ty, order);
            None
        }
    }
}

/// Compute chunk `c` of job `p`.
///
/// # Safety
/// `p` was built by `run_jobs` from validated slices that are still borrowed, `c < p.plan.n_chunks`,
/// and no other thread runs the same chunk.
unsafe fn run_chunk(p: &Prepared, c: usize) {
    let (r0, r1, t0, t1) = p.plan.chunk(c);
    let mut t = t0;
    while t < t1 {
        let (k, end) = if t < p.tail_from {
            (&p.k, t1.min(p.tail_from))
        } else {
            (&p.tail, t1)
        };
        let tn = (end - t).min(k.nt);
        let mr = if tn == 1 { k.mr1 } else { k.mr };
        let mut r = r0;
        while r < r1 {
            let rn = (r1 - r).min(mr);
            let tile = Tile {
                nb: p.nb,
                w: p.w.wrapping_add(r * p.wrb),
                w_stride: p.wrb,
                a: p.a.wrapping_add(t * p.arb),
                a_stride: p.arb,
                out: p.out.wrapping_add(t * p.rows + r),
                out_stride: p.rows,
                rows: rn,
                toks: tn,
            };
            // SAFETY: rows r..r+rn < `rows` and tokens t..t+tn < `n_tokens`, whose sizes
            // were checked against the weights, activations and output; rn <= mr (mr1 for one
            // token), 1 <= tn <= nt; the instruction set is available. Chunks are disjoint, so
            // no two tiles write one element.
            unsafe { (k.tile)(&tile) };
            r += rn;
        }
        t += tn;
    }
}

/// Products of at least this many tokens are cut into finer row chunks (see `Plan::new`).
const MANY_TOKENS: usize = 16;

/// How a product is cut into chunks: `row_chunks × tok_chunks`, row-chunk-major.
#[derive(Clone, Copy)]
struct Plan {
    rows: usize,
    n_tokens: usize,
    rc: usize,
    tc: usize,
    tok_chunks: usize,
    n_chunks: usize,
}

impl Plan {
    fn new(
        k: &Kernel,
        rows: usize,
        n_tokens: usize,
        wrb: usize,
        threads: usize,
        cols: usize,
    ) -> Plan {
        let macs = rows.saturating_mul(cols).saturating_mul(n_tokens);
        let tc = if n_tokens <= TOKENS_PER_CHUNK {
            n_tokens
        } else {
            (TOKENS_PER_CHUNK / k.nt).max(1) * k.nt
        };
        let tok_chunks = n_tokens.div_ceil(tc);
        let rc = if macs < SERIAL_MACS || threads == 1 {
            rows
        } else {
            // Aim for about four chunks per thread so uneven progress balances out; sixteen
            // for many-token products, whose chunks each take tens of microseconds: a thread
            // that takes the last chunk while the others have none left holds the whole
            // product up for it (docs/server.md, "Session 7").
            let per_thread = if n_tokens >= MANY_TOKENS { 16 } else { 4 };
            let want_row_chunks = (threads * per_thread).div_ceil(tok_chunks).max(1);
            rows.div_ceil(want_row_chunks)
        };
        let max_rc = (CHUNK_WEIGHT_BYTES / wrb.max(1)).max(1);
        let rc = rc.min(max_rc).max(1);
        // Whole tiles per chunk where possible.
        let mr = if n_tokens == 1 { k.mr1 } else { k.mr };
        let rc = if rc >= mr || k.exact_rows {
            rc.div_ceil(mr) * mr
        } else {
            rc
        };
        let row_chunks = rows.div_ceil(rc);
        Plan {
            rows,
            n_tokens,
            rc,
            tc,
            tok_chunks,
            n_chunks: row_chunks * tok_chunks,
        }
    }

    /// Rows `r0..r1` and tokens `t0..t1` of chunk `c`.
    fn chunk(&self, c: usize) -> (usize, usize, usize, usize) {
        let (rb, tb) = (c / self.tok_chunks, c % self.tok_chunks);
        let r0 = rb * self.rc;
        let t0 = tb * self.tc;
        (
            r0,
            (r0 + self.rc).min(self.rows),
            t0,
            (t0 + self.tc).min(self.n_tokens),
        )
    }
}
