//! The CPU backend: runs Llama-family GGUF models with SIMD kernels on every core.
//!
//! By default the layer and output matrices are moved out of the file mapping at load into
//! owned memory, repacked for this CPU's kernels where a packed kernel exists (their mapped
//! pages are released as they are read, so each weight is held once); with
//! [`CpuOptions::no_repack`] every weight stays memory-mapped, zero-copy (pageable, and shared
//! through the page cache with other processes mapping the file), multiplied by the GGUF-layout
//! kernels: slower, bit-identical logits. The KV cache is f16, paged in blocks, and sized from
//! the context length asked for, not the model's maximum. Products of the 32-element block
//! types take llama.cpp's summation order in prompts of 64 or more tokens (bit-identical
//! logits) and whole-block sums in decode steps and shorter prompts by default
//! ([`CpuOptions::prompt_order`], [`CpuOptions::decode_order`]).

mod attention;
mod forward;
pub mod ops;

use std::path::Path;
use std::sync::Arc;

use gguf::GgufFile;
use model::ModelConfig;
use quant::dot::{self, Pool};
use runtime::fault::{Fault, FaultSwitch};
use runtime::{
    Backend, BackendError, BackendInfo, KvStats, OpDesc, SeqId, StepBatch, StepOutput, Support,
    Want,
};

pub use forward::TraceFn;
use forward::{Chunk, KvCache, Model, Scratch};
pub use quant::dot::SumOrder;

/// How to set up the CPU backend.
#[derive(Clone, Debug)]
pub struct CpuOptions {
    /// Worker threads (the calling thread included); `None` = every core.
    pub threads: Option<usize>,
    /// Most tokens one sequence may hold (prompt + generated).
    pub ctx_size: usize,
    /// Sequences that may be live at once; the KV pool holds `ctx_size * max_seqs` tokens.
    pub max_seqs: usize,
    /// Tokens per KV block.
    pub block_tokens: usize,
    /// Most tokens in one step (longer prompts are fed in chunks by the scheduler).
    pub max_batch_tokens: usize,
    /// Keep every weight memory-mapped and zero-copy, multiplied in the file's layout
    /// (llama.cpp's `--no-repack`): the weights stay pageable file pages, shared with every
    /// process that maps the same file, but the packed kernels are not used, so products are
    /// slower (the same results bit for bit). Default `false`: matrices are repacked into
    /// owned memory at load.
    pub no_repack: bool,
    /// How the products of the 32-element block types (`Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`, `Q8_0`)
    /// round ([`dot::SumOrder`]) in prompts: the chunks of a prompt of at least
    /// [`runtime::backend::SHORT_PROMPT`] tokens ([`runtime::SeqChunk::prompt_len`]), and
    /// chunks of two or more tokens that do not say (teacher forcing, scoring). Default
    /// [`dot::SumOrder::Ggml`]: llama.cpp's order, so such a prompt's logits (and the keys and
    /// values it leaves in the cache) are bit-identical to llama.cpp's CPU backend's.
    pub prompt_order: dot::SumOrder,
    /// The same for generated tokens (one-token decode chunks) and for prompts shorter than
    /// [`runtime::backend::SHORT_PROMPT`] (chat turns, batched by a server with decode steps).
    /// Default [`dot::SumOrder::Block`]: one f32
    /// step per 32-element block, which makes many-sequence decode steps about twice as fast
    /// and rounds no worse, but not as llama.cpp does, so generated tokens may leave
    /// llama.cpp's after a few steps. The order is chosen per chunk from the chunk alone
    /// (never from what shares the step, how the scheduler split the prompt or what the prefix
    /// cache held: cached blocks are reused only by prompts that would compute them in the
    /// same order), so a sequence's logits are the same whether it runs alone or batched (as
    /// the attention's one-token order is). The environment variable `CROSSOVER_CPU_ORDER` sets both defaults:
    /// `auto` (the default described here), `ggml` (llama.cpp's order everywhere: decode
    /// bit-identical to llama.cpp too) or `block` (whole-block sums everywhere: fastest
    /// prompts); an invalid value there is refused at load ([`CpuError::Option`]).
    pub decode_order: dot::SumOrder,
}

/// The environment variable that sets [`CpuOptions::prompt_order`]'s and
/// [`CpuOptions::decode_order`]'s defaults.
pub const ORDER_ENV: &str = "CROSSOVER_CPU_ORDER";

/// What `CROSSOVER_CPU_ORDER` may say.
const ORDER_VALUES: &str = "must be `auto`, `ggml` or `block`";

/// The (prompt, decode) orders of the default policy: llama.cpp's for prompts, whole-block sums
/// for decode steps.
pub const AUTO_ORDERS: (dot::SumOrder, dot::SumOrder) = (dot::SumOrder::Ggml, dot::SumOrder::Block);

/// The (prompt, decode) orders `CROSSOVER_CPU_ORDER` names: `Ok(None)` when unset, an error
/// naming the variable and its value when it names no policy.
fn order_from_env() -> Result<Option<(dot::SumOrder, dot::SumOrder)>, CpuError> {
    match std::env::var(ORDER_ENV) {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Ok(v) if v.trim().eq_ignore_ascii_case("auto") => Ok(Some(AUTO_ORDERS)),
        Ok(v) => match dot::SumOrder::from_name(&v) {
            Some(o) => Ok(Some((o, o))),
            None => Err(CpuError::Option {
                name: ORDER_ENV,
                value: v,
                why: ORDER_VALUES,
            }),
        },
        Err(std::env::VarError::NotUnicode(v)) => Err(CpuError::Option {
            name: ORDER_ENV,
            value: v.to_string_lossy().into_owned(),
            why: ORDER_VALUES,
        }),
    }
}

impl Default for CpuOptions {
    fn default() -> Self {
        // An invalid value is reported by `CpuBackend::from_file`.
        let (prompt_order, decode_order) = order_from_env().ok().flatten().unwrap_or(AUTO_ORDERS);
        CpuOptions {
            threads: None,
            ctx_size: 4096,
            max_seqs: 1,
            block_tokens: 32,
            max_batch_tokens: 512,
            no_repack: false,
            prompt_order,
            decode_order,
        }
    }
}

/// Why the CPU backend could not start.
#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    #[error("cannot open model {path}: {source}")]
    Open {
        path: String,
        source: gguf::GgufError,
    },
    #[error("model {path} cannot run on the CPU backend: {why}")]
    Model { path: String, why: String },
    #[error("invalid option {name} = {value}: {why}")]
    Option {
        name: &'static str,
        value: String,
        why: &'static str,
    },
    #[error("cannot start CPU worker threads: {0}")]
    Threads(String),
    /// A fault planned by a test's [`FaultSwitch`] (never happens without one).
    #[error("injected fault while loading {path}")]
    InjectedFault { path: String },
}

/// Give the allocator's free memory back to the system. Loading leaves the heap full of
/// freed temporaries (the file's parsing, the tokenizer's construction in the same process,
/// the weights' repacking); glibc keeps them resident unless asked, and they would count
/// against the process's memory for its whole life.
fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns unused pages of the allocator's own arenas; no
    // preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The CPU backend. Lives on one actor thread; owns its KV cache and thread pool.
pub struct CpuBackend {
    file: Arc<GgufFile>,
    model: Model,
    kv: KvCache,
    scratch: Scratch,
    pool: Pool,
    info: BackendInfo,
    /// Testing aid (supervision tests): planned faults. `None` in normal use; checked once per
    /// step, never in the kernels.
    faults: Option<FaultSwitch>,
}

impl CpuBackend {
    /// Open a GGUF file and prepare to run it.
    pub fn load(path: impl AsRef<Path>, opts: &CpuOptions) -> Result<CpuBackend, CpuError> {
        let p = path.as_ref().display().to_string();
        let file = GgufFile::open(path.as_ref()).map_err(|source| CpuError::Open {
            path: p.clone(),
            source,
        })?;
        Self::from_file(Arc::new(file), &p, opts)
    }

    /// Prepare an already opened file.
    pub fn from_file(
        file: Arc<GgufFile>,
        label: &str,
        opts: &CpuOptions,
    ) -> Result<CpuBackend, CpuError> {
        order_from_env()?;
        let mut model = Model::load(&file, !opts.no_repack).map_err(|why| CpuError::Model {
            path: label.into(),
            why,
        })?;
        model.prompt_order = opts.prompt_order;
        model.decode_order = opts.decode_order;
        if opts.ctx_size == 0 {
            return Err(CpuError::Option {
                name: "ctx_size",
                value: "0".into(),
                why: "must be > 0",
            });
        }
        if opts.max_seqs == 0 || opts.block_tokens == 0 || opts.max_batch_tokens == 0 {
            return Err(CpuError::Option {
                name: "max_seqs/block_tokens/max_batch_tokens",
                value: "0".into(),
                why: "must be > 0",
            });
        }
        let threads = opts
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
            .max(1);
        let pool = Pool::new(threads).map_err(|e| CpuError::Threads(e.to_string()))?;
        let blocks = opts.ctx_size.div_ceil(opts.block_tokens) * opts.max_seqs;
        let kv = KvCache::new(&model.cfg, blocks, opts.block_tokens);
        let info = BackendInfo {
            name: "cpu".into(),
            device: format!(
                "{} threads, {}, {} order for prompts and {} for decode, weights {}",
                threads,
                dot::best_isa().name(),
                opts.prompt_order.name(),
                opts.decode_order.name(),
                if opts.no_repack {
                    "memory-mapped (no repack)"
                } else {
                    match dot::best_isa() {
                        dot::Isa::Avx512 | dot::Isa::Avx2 => "repacked",
                        // `PackedMat` has x86 layouts only; elsewhere the weights are copied
                        // into owned memory as they are (`Weights::own`).
                        _ => "copied into memory (not repacked: no packed kernels on this level)",
                    }
                }
            ),
            max_batch_tokens: opts.max_batch_tokens,
            max_batch_seqs: opts.max_seqs,
            max_seq_tokens: opts.ctx_size,
            kv_block_tokens: opts.block_tokens,
        };
        trim_heap();
        Ok(CpuBackend {
            file,
            model,
            kv,
            scratch: Scratch::default(),
            pool,
            info,
            faults: None,
        })
    }

    /// Testing aid: like [`CpuBackend::from_file`], but faults planned on `faults` happen inside
    /// this real backend: a load fault before the model is prepared (a panic, or
    /// [`CpuError::InjectedFault`]), a step fault after the step's KV blocks are taken and before
    /// the forward pass (a panic, or a device error), so the backend is left half-way as a real
    /// failure would leave it.
    pub fn from_file_with_faults(
        file: Arc<GgufFile>,
        label: &str,
        opts: &CpuOptions,
        faults: FaultSwitch,
    ) -> Result<CpuBackend, CpuError> {
        match faults.on_load() {
            Fault::Off => {}
            Fault::Error => {
                return Err(CpuError::InjectedFault {
                    path: label.to_string(),
                })
            }
            Fault::Panic => panic!("injected panic while loading {label}"),
        }
        let mut be = Self::from_file(file, label, opts)?;
        be.faults = Some(faults);
        Ok(be)
    }

    /// **Test double** of a backend that lacks the matmul kernel for weight type `lacking`: a
    /// real CPU backend whose matmuls of that type run through the host fallback executor
    /// (`runtime::fallback::HostMatMul`: activations staged, the CPU's own `quant::dot` kernels
    /// over the file's weights, result copied back) exactly as a device backend
    /// without that kernel runs them. Named `cpu-lacking-<type>` (`cpu-lacking-q8_0`); its
    /// `support` reports those matmuls as `Fallback { to: "host", .. }`. It exists so `audit`
    /// and the fallback path can be tested on a machine without a GPU. The host executor
    /// multiplies in llama.cpp's summation order ([`SumOrder::Ggml`]), so the double equals a
    /// backend whose [`CpuOptions::prompt_order`] and [`CpuOptions::decode_order`] are `Ggml`
    /// bit for bit.
    pub fn lacking_kernel(
        file: Arc<GgufFile>,
        label: &str,
        opts: &CpuOptions,
        lacking: gguf::GgmlType,
    ) -> Result<CpuBackend, CpuError> {
        let mut be = Self::from_file(file, label, opts)?;
        be.model.route_to_host(lacking);
        be.info.name = format!("cpu-lacking-{}", lacking.to_string().to_lowercase());
        Ok(be)
    }

    /// Install (or with `None` remove) a hook that sees every intermediate tensor of the
    /// forward pass under llama.cpp's graph names, and may overwrite it: a debugging aid for
    /// comparing our numerics with llama.cpp's op by op (`examples/trace.rs`).
    pub fn set_trace(&mut self, f: Option<Box<TraceFn>>) {
        self.scratch.trace = f;
    }

    /// Bytes of weights held in owned memory (repacked or copied out of the file mapping at
    /// load); 0 with [`CpuOptions::no_repack`], where every weight is read from the mapping.
    pub fn owned_weight_bytes(&self) -> usize {
        self.model.owned_bytes()
    }

    /// The summation order of this engine's products in chunks of two or more tokens
    /// ([`CpuOptions::prompt_order`]).
    pub fn prompt_order(&self) -> dot::SumOrder {
        self.model.prompt_order
    }

    /// The summation order of this engine's products in one-token chunks
    /// ([`CpuOptions::decode_order`]).
    pub fn decode_order(&self) -> dot::SumOrder {
        self.model.decode_order
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.model.cfg
    }

    /// The opened file.
    pub fn file(&self) -> &Arc<GgufFile> {
        &self.file
    }

    fn check(&self, batch: &StepBatch) -> Result<(), BackendError> {
        batch.validate(&self.info, self.model.cfg.n_vocab, &self.kv.alloc)
    }
}

impl Backend for CpuBackend {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn support(&self, op: &OpDesc) -> Support {
        match op.ty {
            Some(ty) if op.op == "matmul" && self.model.host_fallback == Some(ty) => {
                Support::Fallback {
                    to: "host".into(),
                    why: format!(
                        "test double built without a {ty} matmul kernel: run by the host \
                         executor (the CPU's kernels, activations copied)"
                    ),
                }
            }
            Some(ty) if op.op == "matmul" || op.op == "get_rows" => {
                if dot::supports(ty) {
                    Support::Native
                } else {
                    Support::Fallback {
                        to: "none".into(),
                        why: format!("no CPU kernel for {ty}"),
                    }
                }
            }
            _ => Support::Native,
        }
    }

    fn step(&mut self, batch: &StepBatch) -> Result<StepOutput, BackendError> {
        self.check(batch)?;
        for c in &batch.chunks {
            self.kv.alloc.grow(c.seq, c.start_pos + c.tokens.len())?;
        }
        if let Some(f) = &self.faults {
            match f.on_step() {
                Fault::Off => {}
                Fault::Error => {
                    return Err(BackendError::Device {
                        backend: self.info.name.clone(),
                        msg: format!("injected device fault at step {}", f.steps()),
                    })
                }
                Fault::Panic => panic!("injected panic at step {}", f.steps()),
            }
        }
        let chunks: Vec<Chunk<'_>> = batch
            .chunks
            .iter()
            .map(|c| Chunk {
                seq: c.seq,
                tokens: &c.tokens,
                start_pos: c.start_pos,
                prompt_len: c.prompt_len,
            })
            .collect();
        let want = |ci: usize, ti: usize| {
            let c = &batch.chunks[ci];
            match c.want {
                Want::All => true,
                Want::Last => ti + 1 == c.tokens.len(),
                Want::None => false,
            }
        };
        let logits = forward::forward(
            &self.model,
            &self.file,
            &mut self.kv,
            &mut self.scratch,
            &self.pool,
            &chunks,
            &want,
        )?;
        Ok(StepOutput {
            n_vocab: self.model.cfg.n_vocab,
            logits,
        })
    }

    fn release(&mut self, seq: SeqId) {
        self.kv.alloc.release(seq);
    }

    fn kv(&self) -> KvStats {
        self.kv.alloc.stats()
    }

    fn reuse_prefix(&mut self, seq: SeqId, prompt: &[u32]) -> usize {
        // Blocks are indexed by `forward` once their keys and values are written, tagged with
        // the order they were computed in: take only those this prompt would compute alike.
        let tag = forward::order_tag(self.model.prompt_len_order(prompt.len()));
        self.kv.alloc.reuse_prefix(seq, prompt, tag)
    }

    fn recycle(&mut self, logits: Vec<f32>) {
        // The larger buffer stays: the next step's logits are written into it (every value).
        if logits.capacity() > self.scratch.logits.capacity() {
            self.scratch.logits = logits;
        }
    }
}
