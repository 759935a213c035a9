//! The Llama-family forward pass over a batch of sequence chunks, with a paged f16 KV cache.

use gguf::{GgmlType, GgufFile, TensorInfo};
use half::f16;
use model::{ModelConfig, ModelWeights};
use quant::dot::{self, Pool};
use runtime::fallback::{HostMatMul, HostWeight};
use runtime::kv::BlockAllocator;
use runtime::{BackendError, SeqId};

use crate::attention::{attend, AttnScratch, KvLayer, Order, Span};
use crate::ops::{rms_norm, swiglu, Rope};

/// A weight matrix: `rows` rows of `cols` elements of `ty`, located in the model file.
#[derive(Clone, Debug)]
pub(crate) struct Mat {
    pub info: TensorInfo,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    /// Run by the host fallback executor instead of the dot kernels (the `lacking_kernel` test
    /// double).
    pub host: bool,
    /// The weights in owned memory, repacked for this CPU's kernels or copied (see
    /// [`Mat::own`]); `None`: multiplied straight from the file's bytes.
    pub packed: Option<std::sync::Arc<dot::PackedMat>>,
}

impl Mat {
    fn new(info: &TensorInfo) -> Result<Mat, String> {
        let cols = info.dims.first().copied().unwrap_or(0) as usize;
        let rows = info.dims.iter().skip(1).product::<u64>() as usize;
        if !dot::supports(info.ty) {
            return Err(format!(
                "tensor {} has type {} which no CPU kernel handles",
                info.name, info.ty
            ));
        }
        Ok(Mat {
            info: info.clone(),
            ty: info.ty,
            rows,
            cols,
            host: false,
            packed: None,
        })
    }

    /// Move the weights out of the file mapping into owned memory: repacked for a faster
    /// kernel where one exists for this type, shape and CPU (`dot::PackedMat`: Q4_K, Q6_K,
    /// Q4_0, Q4_1, Q8_0 on AVX-512; same results bit for bit), else copied as they are; the
    /// mapped pages are handed back to the kernel a few MiB at a time as they are read, so the
    /// copy replaces the file's pages in memory instead of adding to them. Copying what is not
    /// repacked costs nothing in memory and keeps the mapped pages of other tensors from
    /// pulling the released ones back in (the kernel maps file pages in large runs that
    /// straddle tensor boundaries). The file stays mapped: anything that reads
    /// the original later (the host fallback test double) faults the pages back in. A file
    /// held in memory (not mapped) is left as it is.
    fn own(&mut self, file: &GgufFile) -> Result<(), String> {
        if !file.is_mmapped() {
            return Ok(());
        }
        let data = file.tensor_data(&self.info);
        // Backends made from one opened file (two CPU actors with different thread counts)
        // share the owned copies, as they would share the mapped pages. A live entry means
        // its mapping is alive (the copy's owner holds the file), so the address names it.
        static OWNED: std::sync::Mutex<Vec<(usize, std::sync::Weak<dot::PackedMat>)>> =
            std::sync::Mutex::new(Vec::new());
        let key = data.as_ptr() as usize;
        let mut owned = OWNED.lock().unwrap_or_else(|e| e.into_inner());
        owned.retain(|(_, w)| w.strong_count() > 0);
        if let Some(p) = owned
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|(_, w)| w.upgrade())
        {
            self.packed = Some(p);
            return Ok(());
        }
        let err = |e: dot::DotError| format!("tensor {}: {e}", self.info.name);
        let isa = dot::best_isa();
        let packed =
            dot::PackedMat::pack_with(self.ty, data, self.rows, self.cols, isa, release_pages);
        let p = match packed.map_err(err)? {
            Some(p) => p,
            None => dot::PackedMat::copy_with(self.ty, data, self.rows, self.cols, release_pages)
                .map_err(err)?,
        };
        let p = std::sync::Arc::new(p);
        owned.push((key, std::sync::Arc::downgrade(&p)));
        self.packed = Some(p);
        release_pages(data);
        Ok(())
    }
}

/// Tell the kernel it may drop the resident pages of `data`, a range of a read-only file
/// mapping (whole pages inside the range only). Advisory: failure changes nothing.
#[cfg(target_os = "linux")]
fn release_pages(data: &[u8]) {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let page = if page > 0 { page as usize } else { 4096 };
    let start = (data.as_ptr() as usize).div_ceil(page) * page;
    let end = (data.as_ptr() as usize + data.len()) / page * page;
    if end > start {
        // SAFETY: [start, end) lies inside `data`, which is part of a read-only shared file
        // mapping (the caller checks `is_mmapped`). MADV_DONTNEED on such a mapping only drops
        // this process's page-table entries; the next read faults the same file contents back
        // in, so every live reference keeps seeing the same bytes.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED);
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn release_pages(_data: &[u8]) {}

/// Weights of one block, vectors already in f32.
pub(crate) struct Layer {
    attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    wq: Mat,
    wk: Mat,
    wv: Mat,
    wo: Mat,
    bq: Option<Vec<f32>>,
    bk: Option<Vec<f32>>,
    bv: Option<Vec<f32>>,
    gate: Mat,
    up: Mat,
    down: Mat,
}

/// A loaded model: configuration plus where each weight lives.
pub(crate) struct Model {
    pub cfg: ModelConfig,
    pub embd: Mat,
    pub output_norm: Vec<f32>,
    pub output: Mat,
    pub layers: Vec<Layer>,
    pub rope: Rope,
    /// Weight type whose matmuls go through the host fallback executor (test double only).
    pub host_fallback: Option<GgmlType>,
    /// The summation order of the products of the 32-element block types for the tokens of
    /// chunks of two or more tokens (`CpuOptions::prompt_order`).
    pub prompt_order: dot::SumOrder,
    /// The same for one-token chunks (`CpuOptions::decode_order`). Chosen per chunk, never per
    /// step, so a token's logits do not depend on what shares its step.
    pub decode_order: dot::SumOrder,
}

impl Model {
    /// The summation order of the products for `chunk`'s tokens: the decode order for
    /// generated tokens and for the chunks of prompts shorter than
    /// [`runtime::backend::SHORT_PROMPT`] (chat turns: decode-sized work that a server batches
    /// with decode steps); the prompt order for longer prompts. A chunk that does not say
    /// ([`runtime::SeqChunk::prompt_len`] `None`) is judged by its own length (one token:
    /// decode). Never by what shares the step or by what the prefix cache held, so a token's
    /// logits do not depend on the load.
    fn order_for(&self, chunk: &Chunk<'_>) -> dot::SumOrder {
        match chunk.prompt_len {
            Some(n) => self.prompt_len_order(n),
            None if chunk.tokens.len() > 1 => self.prompt_order,
            None => self.decode_order,
        }
    }

    /// The order of every token of a prompt of `len` tokens ([`Model::order_for`]).
    pub(crate) fn prompt_len_order(&self, len: usize) -> dot::SumOrder {
        if len >= runtime::backend::SHORT_PROMPT {
            self.prompt_order
        } else {
            self.decode_order
        }
    }
}

/// The prefix cache's tag for keys and values computed in `order` (`runtime::kv`): one bit per
/// order, so a block written in both is reused by neither.
pub(crate) fn order_tag(order: dot::SumOrder) -> u8 {
    match order {
        dot::SumOrder::Ggml => 1,
        dot::SumOrder::Block => 2,
    }
}

fn vector(file: &GgufFile, info: &TensorInfo) -> Result<Vec<f32>, String> {
    let n = info.n_elements() as usize;
    quant::dequantize_to_vec(info.ty, file.tensor_data(info), n)
        .map_err(|e| format!("tensor {}: {e}", info.name))
}

impl Model {
    /// Read the model's weights from `file`: with `repack`, the layer and output matrices are
    /// moved into owned memory ([`Mat::own`]); without, every matrix is multiplied straight
    /// from the file mapping (zero-copy).
    pub fn load(file: &GgufFile, repack: bool) -> Result<Model, String> {
        let cfg = ModelConfig::from_gguf(file).map_err(|e| e.to_string())?;
        let w = ModelWeights::from_gguf(&cfg, file).map_err(|e| e.to_string())?;
        let mut layers = Vec::with_capacity(w.layers.len());
        for l in &w.layers {
            let opt = |t: &Option<TensorInfo>| t.as_ref().map(|i| vector(file, i)).transpose();
            layers.push(Layer {
                attn_norm: vector(file, &l.attn_norm)?,
                ffn_norm: vector(file, &l.ffn_norm)?,
                wq: Mat::new(&l.attn_q)?,
                wk: Mat::new(&l.attn_k)?,
                wv: Mat::new(&l.attn_v)?,
                wo: Mat::new(&l.attn_output)?,
                bq: opt(&l.attn_q_bias)?,
                bk: opt(&l.attn_k_bias)?,
                bv: opt(&l.attn_v_bias)?,
                gate: Mat::new(&l.ffn_gate)?,
                up: Mat::new(&l.ffn_up)?,
                down: Mat::new(&l.ffn_down)?,
            });
        }
        let mut owned = Vec::new();
        for l in layers.iter_mut().filter(|_| repack) {
            for m in [
                &mut l.wq,
                &mut l.wk,
                &mut l.wv,
                &mut l.wo,
                &mut l.gate,
                &mut l.up,
                &mut l.down,
            ] {
                m.own(file)?;
                if m.packed.is_some() {
                    owned.push(m.info.clone());
                }
            }
        }
        // The output matrix is read in full by every forward pass: owned too. A tied token
        // embedding (the same tensor) reads its rows from that copy.
        let mut output = Mat::new(&w.output)?;
        if repack {
            output.own(file)?;
        }
        let mut embd = Mat::new(&w.token_embd)?;
        if output.packed.is_some() {
            owned.push(output.info.clone());
            if embd.info.offset == output.info.offset {
                embd.packed = output.packed.clone();
            }
        }
        if file.is_mmapped() {
            // Reading the tensors one by one above mapped the edges of those released before
            // them back in (the kernel maps file pages in large runs that straddle tensors):
            // release them all once more (none without `repack`). The header (metadata, parsed
            // into owned values at open) is not read again either, in both modes (7.5 MiB of a
            // Llama 3 file, its vocabulary).
            for info in &owned {
                release_pages(file.tensor_data(info));
            }
            let header = usize::try_from(file.data_offset()).unwrap_or(0);
            release_pages(file.bytes().get(..header).unwrap_or(&[]));
        }
        let factors = w.rope_freqs.as_ref().map(|i| vector(file, i)).transpose()?;
        let rope = Rope::new(
            cfg.n_rot,
            cfg.rope_freq_base,
            cfg.rope_freq_scale(),
            factors.as_deref(),
            cfg.rope_style,
        );
        Ok(Model {
            embd,
            output_norm: vector(file, &w.output_norm)?,
            output,
            layers,
            rope,
            cfg,
            host_fallback: None,
            prompt_order: dot::SumOrder::default(),
            decode_order: dot::SumOrder::default(),
        })
    }

    /// Bytes of the matrices held in owned memory (a tied embedding shares the output's).
    pub fn owned_bytes(&self) -> usize {
        let mats = self
            .layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down]);
        mats.chain([&self.output])
            .filter_map(|m| m.packed.as_ref())
            .map(|p| p.bytes().len())
            .sum()
    }

    /// Send every matmul of weight type `ty` through the host fallback executor, as a backend
    /// without a kernel for `ty` must.
    pub fn route_to_host(&mut self, ty: GgmlType) {
        self.host_fallback = Some(ty);
        let mats = self.layers.iter_mut().flat_map(|l| {
            [
                &mut l.wq,
                &mut l.wk,
                &mut l.wv,
                &mut l.wo,
                &mut l.gate,
                &mut l.up,
                &mut l.down,
            ]
        });
        for m in mats.chain([&mut self.output]) {
            m.host = m.ty == ty;
        }
    }
}

/// The KV cache: per layer, `n_blocks * block_tokens` rows of `n_embd_kv` f16 for K and for V.
pub(crate) struct KvCache {
    k: Vec<Vec<f16>>,
    v: Vec<Vec<f16>>,
    row: usize,
    pub alloc: BlockAllocator,
}

impl KvCache {
    pub fn new(cfg: &ModelConfig, blocks: usize, block_tokens: usize) -> KvCache {
        let row = cfg.n_embd_kv();
        let n = blocks * block_tokens * row;
        KvCache {
            k: (0..cfg.n_layer).map(|_| vec![f16::ZERO; n]).collect(),
            v: (0..cfg.n_layer).map(|_| vec![f16::ZERO; n]).collect(),
            row,
            alloc: BlockAllocator::new(blocks, block_tokens),
        }
    }

    /// Row index of (seq, pos); the position must be allocated.
    fn slot(&self, seq: SeqId, pos: usize) -> Option<usize> {
        let (b, off) = self.alloc.locate(seq, pos)?;
        Some(b as usize * self.alloc.block_tokens() + off)
    }
}

/// Tokens per slice of a layer (see `forward`). A multiple of 4: llama.cpp's repacked Q4_K
/// matmul rounds the last `n % 4` tokens of a batch differently, and we mirror that, so the
/// chunks must leave the same tokens over as the whole batch does.
const FFN_TOKENS: usize = 64;

/// Tokens in a layer's slice from which its attention runs one pool item per token (all its KV
/// heads) rather than one per (token, KV head): below it (a one-sequence decode step), the
/// heads of a token are what there is to share between the threads.
const ATTN_TOKEN_ITEMS: usize = 8;

/// One token of the flattened batch.
struct Tok {
    id: u32,
    pos: usize,
    /// Index of its chunk.
    chunk: usize,
}

/// A hook that sees (and may replace) intermediate tensors, named as llama.cpp's graph names
/// them: `(name, layer, occurrence, data)`, e.g. `("attn_norm", 0, 0, ..)` for llama.cpp's
/// `attn_norm-0`. Data is token-major, as ggml stores it (`ne[0]` fastest).
pub type TraceFn = dyn FnMut(&str, usize, usize, &mut [f32]) + Send;

/// Per-step buffers, kept between steps so a decode step allocates nothing.
#[derive(Default)]
pub(crate) struct Scratch {
    /// Debugging hook (see [`TraceFn`]); `None` in normal use.
    pub trace: Option<Box<TraceFn>>,
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
    g: Vec<f32>,
    u: Vec<f32>,
    /// A logits buffer handed back by the caller (`Backend::recycle`), written by the next
    /// step's output product instead of a fresh allocation.
    pub logits: Vec<f32>,
}

/// `v` with `n` elements for a caller that writes every one of them (the products assign their
/// outputs): only growth is zeroed, so a step does not clear the ~45 MB of activations of a
/// 64-token SmolLM2 step that it then overwrites.
fn resize(v: &mut Vec<f32>, n: usize) {
    v.resize(n, 0.0);
}

/// `out = x · m` for `n_tok` tokens in summation order `order` (the host fallback double runs
/// its executor's order, ggml's).
fn matmul(
    file: &GgufFile,
    m: &Mat,
    x: &[f32],
    n_tok: usize,
    out: &mut Vec<f32>,
    pool: &Pool,
    order: dot::SumOrder,
) -> Result<(), BackendError> {
    resize(out, n_tok * m.rows);
    matmul_into(file, m, x, n_tok, &mut out[..n_tok * m.rows], pool, order)
}

/// [`matmul`] into a slice of exactly `n_tok * m.rows` values.
fn matmul_into(
    file: &GgufFile,
    m: &Mat,
    x: &[f32],
    n_tok: usize,
    out: &mut [f32],
    pool: &Pool,
    order: dot::SumOrder,
) -> Result<(), BackendError> {
    if m.host {
        return host_matmul(file, m, x, n_tok, out);
    }
    if let Some(p) = &m.packed {
        return dot::matmul_f32_packed_ordered(p, x, n_tok, out, pool, order).map_err(|e| {
            BackendError::Device {
                backend: "cpu".into(),
                msg: format!("{}: {e}", m.info.name),
            }
        });
    }
    dot::matmul_f32_ordered(
        m.ty,
        file.tensor_data(&m.info),
        m.rows,
        m.cols,
        x,
        n_tok,
        out,
        pool,
        order,
    )
    .map_err(|e| BackendError::Device {
        backend: "cpu".into(),
        msg: format!("{}: {e}", m.info.name),
    })
}

/// `outs[i] = x · mats[i]` for matrices that share their input (Q/K/V, gate/up): one dispatch
/// with the input quantized once where the matrices allow it (owned alike: same type, columns
/// and layout), else one product after another. The results are the same bits either way.
#[allow(clippy::too_many_arguments)]
fn matmul_group(
    file: &GgufFile,
    mats: &[&Mat],
    x: &[f32],
    n_tok: usize,
    outs: &mut [&mut Vec<f32>],
    pool: &Pool,
    order: dot::SumOrder,
) -> Result<(), BackendError> {
    let packed: Option<Vec<&dot::PackedMat>> = mats
        .iter()
        .map(|m| m.packed.as_deref().filter(|_| !m.host))
        .collect();
    let alike = packed.as_ref().is_some_and(|ps| {
        ps.windows(2).all(|w| {
            w[0].weight_type() == w[1].weight_type()
                && w[0].cols() == w[1].cols()
                && w[0].is_interleaved() == w[1].is_interleaved()
        })
    });
    match packed {
        Some(ps) if alike && ps.len() == outs.len() => {
            let mut pairs: Vec<(&dot::PackedMat, &mut [f32])> = ps
                .into_iter()
                .zip(outs.iter_mut())
                .map(|(p, o)| {
                    resize(o, n_tok * p.rows());
                    (p, &mut o[..])
                })
                .collect();
            dot::matmul_f32_packed_multi_ordered(&mut pairs, x, n_tok, pool, order).map_err(|e| {
                BackendError::Device {
                    backend: "cpu".into(),
                    msg: format!("{}: {e}", mats[0].info.name),
                }
            })
        }
        _ => {
            for (m, o) in mats.iter().zip(outs.iter_mut()) {
                matmul(file, m, x, n_tok, o, pool, order)?;
            }
            Ok(())
        }
    }
}

/// The fallback path: activations copied to the executor's staging buffer, the weight rows
/// dequantized from the memory-mapped file, the result copied back, as a device backend does it
/// (`runtime::fallback`).
fn host_matmul(
    file: &GgufFile,
    m: &Mat,
    x: &[f32],
    n_tok: usize,
    out: &mut [f32],
) -> Result<(), BackendError> {
    thread_local! {
        static HOST: std::cell::RefCell<HostMatMul> = std::cell::RefCell::new(HostMatMul::default());
    }
    let w = HostWeight {
        name: &m.info.name,
        ty: m.ty,
        data: file.tensor_data(&m.info),
        rows: m.rows,
        cols: m.cols,
    };
    HOST.with(|h| {
        let mut h = h.borrow_mut();
        h.stage(n_tok * m.cols)
            .copy_from_slice(&x[..n_tok * m.cols]);
        let y = h.run(&w, n_tok).map_err(|e| BackendError::Device {
            backend: "cpu".into(),
            msg: e.to_string(),
        })?;
        out.copy_from_slice(y);
        Ok(())
    })
}

fn add_bias(x: &mut [f32], b: &Option<Vec<f32>>) {
    if let Some(b) = b {
        for row in x.chunks_exact_mut(b.len()) {
            for (v, &bb) in row.iter_mut().zip(b) {
                *v += bb;
            }
        }
    }
}

/// Disjoint rows of one buffer handed to pool items: each row is written by one item only.
#[derive(Clone, Copy)]
struct Rows<T> {
    ptr: *mut T,
    len: usize,
    width: usize,
}
// SAFETY: only used to hand disjoint rows of one buffer to pool workers (see `Rows::row`).
unsafe impl<T: Send> Send for Rows<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for Rows<T> {}

impl<T> Rows<T> {
    fn new(buf: &mut [T], width: usize) -> Rows<T> {
        Rows {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            width,
        }
    }

    /// Row `i` (empty if outside the buffer).
    ///
    /// # Safety
    /// While the returned slice lives, no other reference to row `i` exists (every row is
    /// claimed by one pool item at most) and the buffer outlives it and is not moved.
    #[allow(clippy::mut_from_ref)]
    unsafe fn row<'a>(&self, i: usize) -> &'a mut [T] {
        let a = i * self.width;
        if a + self.width > self.len {
            return &mut [];
        }
        // SAFETY: in bounds (checked above); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(a), self.width) }
    }
}

/// Tokens per pool item for the per-token work of a slice (norms, RoPE, KV stores, adds): a
/// few, so 64 tokens spread over every thread while a one-token step runs inline.
const TOKENS_PER_ITEM: usize = 4;

/// `f(i)` for every token `i` of `0..m`, spread over the pool.
fn per_token(pool: &Pool, m: usize, f: impl Fn(usize) + Sync) {
    pool.par_for(m.div_ceil(TOKENS_PER_ITEM), |it| {
        for i in it * TOKENS_PER_ITEM..((it + 1) * TOKENS_PER_ITEM).min(m) {
            f(i);
        }
    });
}

/// A token's K or V row, rounded to f16 into its KV-cache slot.
fn store_f16(dst: &mut [f16], src: &[f32]) {
    crate::attention::to_f16(dot::best_isa(), dst, src);
}

/// One input of [`forward`]: tokens of one sequence at consecutive positions.
pub(crate) struct Chunk<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    pub start_pos: usize,
    /// [`runtime::SeqChunk::prompt_len`].
    pub prompt_len: Option<usize>,
}

/// Run the model over `chunks` (KV space must already be allocated for every position), and return
/// the logits of the rows `want(chunk_index, token_index)` selects, in order.
pub(crate) fn forward(
    model: &Model,
    file: &GgufFile,
    kv: &mut KvCache,
    s: &mut Scratch,
    pool: &Pool,
    chunks: &[Chunk<'_>],
    want: &dyn Fn(usize, usize) -> bool,
) -> Result<Vec<f32>, BackendError> {
    let cfg = &model.cfg;
    let (e, hd) = (cfg.n_embd, cfg.head_dim);
    let (nh, nkv) = (cfg.n_head, cfg.n_head_kv);
    let gqa = cfg.n_gqa();
    let toks: Vec<Tok> = chunks
        .iter()
        .enumerate()
        .flat_map(|(ci, c)| {
            c.tokens.iter().enumerate().map(move |(i, &id)| Tok {
                id,
                pos: c.start_pos + i,
                chunk: ci,
            })
        })
        .collect();
    let n = toks.len();
    // Each token's product order, from its chunk (`Model::order_for`).
    let ord: Vec<dot::SumOrder> = toks
        .iter()
        .map(|t| model.order_for(&chunks[t.chunk]))
        .collect();
    let slots: Vec<usize> = toks
        .iter()
        .map(|t| {
            let seq = chunks[t.chunk].seq;
            kv.slot(seq, t.pos).ok_or(BackendError::KvFull {
                seq,
                needed: 1,
                free: 0,
            })
        })
        .collect::<Result<_, _>>()?;
    // The per-token work below writes each token's KV slot from its own pool item: two
    // tokens of a batch at one slot (a sequence fed twice in one step) would be a data race.
    {
        let mut sorted = slots.clone();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return Err(BackendError::BatchTooLarge {
                what: "chunks of one sequence",
                got: 2,
                max: 1,
            });
        }
    }

    // Token embeddings.
    resize(&mut s.x, n * e);
    let embd = match &model.embd.packed {
        Some(p) if !p.is_interleaved() => p.bytes(),
        Some(_) => &[],
        None => file.tensor_data(&model.embd.info),
    };
    let row_bytes = model.embd.ty.bytes_for(e as u64).unwrap_or(0) as usize;
    for (t, xr) in toks.iter().zip(s.x.chunks_exact_mut(e)) {
        let bad = || BackendError::InvalidToken {
            seq: chunks[t.chunk].seq,
            index: t.pos,
            id: t.id,
            n_vocab: cfg.n_vocab,
        };
        let a = t.id as usize * row_bytes;
        let row;
        let src = match &model.embd.packed {
            // A repacked tied embedding: the row back in GGUF layout.
            Some(p) if p.is_interleaved() => {
                row = p.unpack_row(t.id as usize).ok_or_else(bad)?;
                &row[..]
            }
            _ => embd.get(a..a + row_bytes).ok_or_else(bad)?,
        };
        quant::dequantize_serial(model.embd.ty, src, xr).map_err(|err| BackendError::Device {
            backend: "cpu".into(),
            msg: err.to_string(),
        })?;
    }

    // Rotation angles per token, shared by every layer and head.
    let angles: Vec<Vec<(f32, f32)>> = toks
        .iter()
        .map(|t| {
            let mut cs = Vec::new();
            model.rope.angles(t.pos, &mut cs);
            cs
        })
        .collect();
    let scale = 1.0 / (hd as f32).sqrt();
    // Each layer runs FFN_TOKENS tokens at a time (the whole batch under a trace hook, so the
    // hook sees whole tensors, unless the batch mixes product orders): every per-token buffer but the residual stream is that small,
    // and a slice's keys and values are stored before its attention reads them, as the
    // earlier slices' were. The layer's weights stay in cache across its slices.
    let step = if s.trace.is_some() {
        n.max(1)
    } else {
        FFN_TOKENS
    };
    for (li, l) in model.layers.iter().enumerate() {
        let mut b0 = 0;
        while b0 < n {
            // A slice never mixes product orders (a step may hold prompt chunks and decode
            // tokens): it ends where the order changes.
            let order = ord[b0];
            let lim = (b0 + step).min(n);
            let b1 = (b0 + 1..lim).find(|&j| ord[j] != order).unwrap_or(lim);
            let m = b1 - b0;
            let (toks, slots, angles) = (&toks[b0..b1], &slots[b0..b1], &angles[b0..b1]);
            resize(&mut s.xn, m * e);
            {
                let xn = Rows::new(&mut s.xn, e);
                let x = &s.x[b0 * e..b1 * e];
                per_token(pool, m, |i| {
                    // SAFETY: token i's row of `xn` belongs to this item alone.
                    let out = unsafe { xn.row(i) };
                    rms_norm(&x[i * e..(i + 1) * e], &l.attn_norm, cfg.rms_norm_eps, out);
                });
            }
            if let Some(t) = s.trace.as_mut() {
                t("attn_norm", li, 0, &mut s.xn);
            }
            matmul_group(
                file,
                &[&l.wq, &l.wk, &l.wv],
                &s.xn,
                m,
                &mut [&mut s.q, &mut s.k, &mut s.v],
                pool,
                order,
            )?;
            let row = kv.row;
            if s.trace.is_none() {
                // Bias, RoPE and the KV store of each token in one pass, spread over the pool
                // (the same operations per element as the traced path below).
                let (q, k, v) = (
                    Rows::new(&mut s.q, nh * hd),
                    Rows::new(&mut s.k, row),
                    Rows::new(&mut s.v, row),
                );
                let (kc, vc) = (Rows::new(&mut kv.k[li], row), Rows::new(&mut kv.v[li], row));
                per_token(pool, m, |i| {
                    // SAFETY: token i's rows of q, k and v belong to this item alone, and so
                    // do its KV slots (slots are distinct, checked above).
                    let (qr, kr, vr, kd, vd) = unsafe {
                        (
                            q.row(i),
                            k.row(i),
                            v.row(i),
                            kc.row(slots[i]),
                            vc.row(slots[i]),
                        )
                    };
                    add_bias(qr, &l.bq);
                    add_bias(kr, &l.bk);
                    add_bias(vr, &l.bv);
                    for h in qr.chunks_exact_mut(hd) {
                        model.rope.apply_with(h, &angles[i]);
                    }
                    for h in kr.chunks_exact_mut(hd) {
                        model.rope.apply_with(h, &angles[i]);
                    }
                    store_f16(kd, kr);
                    store_f16(vd, vr);
                });
            } else {
                add_bias(&mut s.q, &l.bq);
                add_bias(&mut s.k, &l.bk);
                add_bias(&mut s.v, &l.bv);
                if let Some(t) = s.trace.as_mut() {
                    t("Qcur", li, 0, &mut s.q);
                    t("Kcur", li, 0, &mut s.k);
                    t("Vcur", li, 0, &mut s.v);
                }
                for (i, cs) in angles.iter().enumerate() {
                    for h in s.q[i * nh * hd..(i + 1) * nh * hd].chunks_exact_mut(hd) {
                        model.rope.apply_with(h, cs);
                    }
                    for h in s.k[i * nkv * hd..(i + 1) * nkv * hd].chunks_exact_mut(hd) {
                        model.rope.apply_with(h, cs);
                    }
                }
                if let Some(t) = s.trace.as_mut() {
                    t("Qcur", li, 2, &mut s.q);
                    t("Kcur", li, 2, &mut s.k);
                }
                // Store this step's keys and values.
                let (kc, vc) = (&mut kv.k[li], &mut kv.v[li]);
                for (i, &slot) in slots.iter().enumerate() {
                    store_f16(
                        &mut kc[slot * row..(slot + 1) * row],
                        &s.k[i * row..(i + 1) * row],
                    );
                    store_f16(
                        &mut vc[slot * row..(slot + 1) * row],
                        &s.v[i * row..(i + 1) * row],
                    );
                }
            }
            // Attention: one work item per (token, KV head), the query heads sharing that KV
            // head together (`attention`: llama.cpp's float order, bit for bit).
            resize(&mut s.att, m * nh * hd);
            {
                let layer = KvLayer {
                    k: &kv.k[li],
                    v: &kv.v[li],
                    row,
                    block_tokens: kv.alloc.block_tokens(),
                };
                let alloc = &kv.alloc;
                // Chosen once per layer, not per call.
                let isa = dot::best_isa();
                let q = &s.q;
                let out = Rows::new(&mut s.att, gqa * hd);
                let one = |item: usize| {
                    let (i, kvh) = (item / nkv, item % nkv);
                    let t = &toks[i];
                    let c = &chunks[t.chunk];
                    let sp = Span {
                        blocks: alloc.blocks(c.seq),
                        kv_head: kvh,
                        head_dim: hd,
                        len: t.pos + 1,
                        scale,
                        // A one-token chunk (a decode step) takes ggml's `vec_dot_f16` order,
                        // as llama.cpp's single-token decode does (llamafile's kernel refuses
                        // single-token products); a token of a longer chunk tinyBLAS's. Chosen
                        // per chunk, not per step, so a sequence decodes to the same tokens
                        // alone or batched with others.
                        order: if c.tokens.len() == 1 {
                            Order::Vec64
                        } else {
                            Order::Tiny16
                        },
                    };
                    thread_local! {
                        static SCRATCH: std::cell::RefCell<AttnScratch> =
                            std::cell::RefCell::new(AttnScratch::default());
                    }
                    let qg = &q[(i * nh + kvh * gqa) * hd..(i * nh + (kvh + 1) * gqa) * hd];
                    // SAFETY: the heads kvh * gqa .. (kvh + 1) * gqa of token i (row
                    // i * nkv + kvh of width gqa * hd) belong to this item alone.
                    let o = unsafe { out.row(item) };
                    SCRATCH.with(|sc| attend(isa, &layer, &sp, qg, o, &mut sc.borrow_mut()));
                };
                if m >= ATTN_TOKEN_ITEMS {
                    // One item per token, its KV heads one after another: the heads' keys and
                    // values share each position's row, so one core reads a token's rows whole
                    // (the cache of a 64-sequence step is read from memory, not from the
                    // caches); ~4 % less time per 64-sequence decode step than spreading the
                    // heads of a token over both threads.
                    pool.par_for(m, |i| (i * nkv..(i + 1) * nkv).for_each(one));
                } else {
                    pool.par_for(m * nkv, one);
                }
            }
            if let Some(t) = s.trace.as_mut() {
                t("kqv_out", li, 0, &mut s.att);
            }
            matmul(file, &l.wo, &s.att, m, &mut s.o, pool, order)?;
            if let Some(t) = s.trace.as_mut() {
                t("attn_out", li, 0, &mut s.o);
            }
            if s.trace.is_none() {
                // The residual add and the feed-forward norm of each token, over the pool.
                let (x, xn) = (
                    Rows::new(&mut s.x[b0 * e..b1 * e], e),
                    Rows::new(&mut s.xn, e),
                );
                let o = &s.o;
                per_token(pool, m, |i| {
                    // SAFETY: token i's rows of x and xn belong to this item alone.
                    let (xr, nr) = unsafe { (x.row(i), xn.row(i)) };
                    for (x, o) in xr.iter_mut().zip(&o[i * e..(i + 1) * e]) {
                        *x += o;
                    }
                    rms_norm(xr, &l.ffn_norm, cfg.rms_norm_eps, nr);
                });
            } else {
                for (x, o) in s.x[b0 * e..b1 * e].iter_mut().zip(&s.o) {
                    *x += o;
                }
                if let Some(t) = s.trace.as_mut() {
                    t("ffn_inp", li, 0, &mut s.x);
                }
                for (xr, or) in s.x[b0 * e..b1 * e]
                    .chunks_exact(e)
                    .zip(s.xn.chunks_exact_mut(e))
                {
                    rms_norm(xr, &l.ffn_norm, cfg.rms_norm_eps, or);
                }
            }
            if let Some(t) = s.trace.as_mut() {
                t("ffn_norm", li, 0, &mut s.xn);
            }
            matmul_group(
                file,
                &[&l.gate, &l.up],
                &s.xn,
                m,
                &mut [&mut s.g, &mut s.u],
                pool,
                order,
            )?;
            if let Some(t) = s.trace.as_mut() {
                t("ffn_gate", li, 0, &mut s.g);
                t("ffn_up", li, 0, &mut s.u);
            }
            {
                // Row by row, as ggml applies it (its vector body and scalar tail per row).
                let ff = l.gate.rows;
                let g = Rows::new(&mut s.g, ff);
                let u = &s.u;
                per_token(pool, m, |i| {
                    // SAFETY: token i's row of g belongs to this item alone.
                    swiglu(unsafe { g.row(i) }, &u[i * ff..(i + 1) * ff]);
                });
            }
            if let Some(t) = s.trace.as_mut() {
                t("ffn_swiglu", li, 0, &mut s.g);
            }
            matmul(file, &l.down, &s.g, m, &mut s.o, pool, order)?;
            if let Some(t) = s.trace.as_mut() {
                t("ffn_out", li, 0, &mut s.o);
            }
            {
                let x = Rows::new(&mut s.x[b0 * e..b1 * e], e);
                let o = &s.o;
                per_token(pool, m, |i| {
                    // SAFETY: token i's row of x belongs to this item alone.
                    for (x, o) in unsafe { x.row(i) }.iter_mut().zip(&o[i * e..(i + 1) * e]) {
                        *x += o;
                    }
                });
            }
            if let Some(t) = s.trace.as_mut() {
                t("l_out", li, 0, &mut s.x);
            }
            b0 = b1;
        }
    }

    // Final norm and LM head on the wanted rows only.
    let mut sel = Vec::new();
    let mut idx = 0;
    for (ci, c) in chunks.iter().enumerate() {
        for ti in 0..c.tokens.len() {
            if want(ci, ti) {
                sel.push(idx);
            }
            idx += 1;
        }
    }
    let mut h = vec![0.0f32; sel.len() * e];
    {
        let hr = Rows::new(&mut h, e);
        let x = &s.x;
        per_token(pool, sel.len(), |r| {
            let i = sel[r];
            // SAFETY: output row r belongs to this item alone.
            let out = unsafe { hr.row(r) };
            rms_norm(
                &x[i * e..(i + 1) * e],
                &model.output_norm,
                cfg.rms_norm_eps,
                out,
            );
        });
    }
    let rows = model.output.rows;
    // Every value is written by the products below; only growth is zeroed.
    let mut logits = std::mem::take(&mut s.logits);
    resize(&mut logits, sel.len() * rows);
    // One product per run of rows of the same order.
    let mut r0 = 0;
    while r0 < sel.len() {
        let order = ord[sel[r0]];
        let r1 = (r0 + 1..sel.len())
            .find(|&r| ord[sel[r]] != order)
            .unwrap_or(sel.len());
        matmul_into(
            file,
            &model.output,
            &h[r0 * e..r1 * e],
            r1 - r0,
            &mut logits[r0 * rows..r1 * rows],
            pool,
            order,
        )?;
        r0 = r1;
    }
    // Every chunk's keys and values are in place: their full blocks may serve later prompts
    // with the same beginning (the prefix cache, `runtime::kv`).
    // Each block is indexed with the order its tokens were computed in, and reused only by a
    // prompt that would compute it in that order.
    for c in chunks {
        let tag = order_tag(model.order_for(c));
        kv.alloc.commit(c.seq, c.start_pos, c.tokens, tag);
    }
    Ok(logits)
}
