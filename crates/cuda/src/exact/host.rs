//! Exact mode on the host: kernels/exact.cu compiled as C (build.rs) behind [`super::ExactOps`],
//! and a loader that runs a GGUF file through [`super::forward`] with it. What the GPU launches
//! is the same source, so the tests that hold this against the CPU engine check the GPU's exact
//! forward pass (its driver and its kernels) on a machine without a GPU.

use gguf::{GgmlType, GgufFile, TensorInfo};
use model::{ModelConfig, ModelWeights, Rope};
use quant::dot::{scalar, SumOrder};
use runtime::kv::BlockAllocator;
use runtime::{BackendError, StepBatch};

use super::{ExChunk, ExactBufs, ExactLayer, ExactMat, ExactModel};
use crate::error::CudaError;
use crate::kernels::ActFormat;

/// The host's [`super::ExactOps`]: buffers in host memory, kernels as plain loops.
pub struct HostExact {
    /// The embedding matrix: address of its GGUF rows (a mapped file the owner keeps alive),
    /// type, columns.
    embd: (u64, GgmlType, usize),
    bufs: Vec<Vec<u64>>,
}

impl Default for HostExact {
    fn default() -> Self {
        HostExact::new()
    }
}

impl HostExact {
    /// An executor without an embedding matrix (kernels and memory only; `embed` then writes
    /// nothing).
    pub fn new() -> HostExact {
        HostExact {
            embd: (0, GgmlType::F32, 0),
            bufs: Vec::new(),
        }
    }

    /// Quantize rows as the CPU engine does (`quant::dot::scalar`'s quantizers, which every
    /// level and the GPU's `quantize_act` equal bit for bit), into the GPU's operand layout.
    pub(super) fn quantize_rows(
        &self,
        x: u64,
        rows: usize,
        n: usize,
        fmt: ActFormat,
        qs: u64,
        ds: u64,
    ) -> Result<(), CudaError> {
        // SAFETY: the driver passes live buffers: `rows * n` floats at `x`, `rows * n` bytes
        // at `qs` and `rows * n / 32` float pairs at `ds`.
        let (xs, q, d) = unsafe {
            (
                std::slice::from_raw_parts(x as *const f32, rows * n),
                std::slice::from_raw_parts_mut(qs as *mut i8, rows * n),
                std::slice::from_raw_parts_mut(ds as *mut f32, rows * n / 32 * 2),
            )
        };
        let groups = n / 32;
        for r in 0..rows {
            let (xr, qr, dr) = (
                &xs[r * n..(r + 1) * n],
                &mut q[r * n..(r + 1) * n],
                &mut d[r * groups * 2..(r + 1) * groups * 2],
            );
            match fmt {
                ActFormat::Q8x32 => {
                    let mut blocks = vec![0u8; groups * 36];
                    scalar::quantize_row_q8_1(xr, &mut blocks);
                    for (g, b) in blocks.chunks_exact(36).enumerate() {
                        let h = |o: usize| half::f16::from_le_bytes([b[o], b[o + 1]]).to_f32();
                        dr[2 * g] = h(0);
                        dr[2 * g + 1] = h(2);
                        for (k, &v) in b[4..36].iter().enumerate() {
                            qr[32 * g + k] = v as i8;
                        }
                    }
                }
                ActFormat::Q8K => {
                    let mut blocks = vec![0u8; n / 256 * 292];
                    scalar::quantize_row_q8_k(xr, &mut blocks);
                    for (s, b) in blocks.chunks_exact(292).enumerate() {
                        let dk = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                        for (k, &v) in b[4..260].iter().enumerate() {
                            qr[256 * s + k] = v as i8;
                        }
                        for g in 0..8 {
                            let lo = u16::from_le_bytes([b[260 + 4 * g], b[261 + 4 * g]]) as u32;
                            let hi = u16::from_le_bytes([b[262 + 4 * g], b[263 + 4 * g]]) as u32;
                            dr[2 * (8 * s + g)] = dk;
                            dr[2 * (8 * s + g) + 1] = f32::from_bits(lo | (hi << 16));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Dequantize the embedding rows of `ids` with the CPU's code.
    pub(super) fn embed_rows(&self, ids: &[u32], out: u64) -> Result<(), CudaError> {
        let (w, ty, cols) = self.embd;
        if w == 0 {
            return Ok(());
        }
        let rb = ty.bytes_for(cols as u64).unwrap_or(0) as usize;
        // SAFETY: `out` holds a row of `cols` floats per id (the driver's scratch); the
        // embedding rows lie in the mapped file the loader keeps alive, and ids were checked
        // against the vocabulary.
        let dst = unsafe { std::slice::from_raw_parts_mut(out as *mut f32, ids.len() * cols) };
        for (&id, d) in ids.iter().zip(dst.chunks_exact_mut(cols)) {
            // SAFETY: as above.
            let src =
                unsafe { std::slice::from_raw_parts((w + id as u64 * rb as u64) as *const u8, rb) };
            quant::dequantize_serial(ty, src, d).map_err(|e| CudaError::Arg(e.to_string()))?;
        }
        Ok(())
    }

    /// Zeroed 8-byte aligned buffers of the given sizes (replacing the previous ones).
    pub(super) fn alloc_bufs(&mut self, sizes: &[usize]) -> Vec<u64> {
        self.bufs = sizes
            .iter()
            .map(|&s| vec![0u64; s.div_ceil(8).max(1)])
            .collect();
        self.bufs.iter().map(|b| b.as_ptr() as u64).collect()
    }
}

/// A GGUF file run by the exact forward pass on the host, with its own paged KV cache (the
/// GPU backend's layout).
pub struct HostModel {
    // Fields drop in order: the executor and the model's addresses before the buffers and
    // the mapped file they point into.
    ops: HostExact,
    bufs: ExactBufs,
    model: ExactModel,
    alloc: BlockAllocator,
    n_vocab: usize,
    _vectors: Vec<Vec<f32>>,
    _kv: Vec<Vec<u16>>,
    _file: GgufFile,
}

impl HostModel {
    /// Load `path` for sequences of up to `ctx` tokens, `max_seqs` at once, steps of up to
    /// `max_tokens` tokens, in the given (prompt, decode) orders.
    pub fn load(
        path: &std::path::Path,
        ctx: usize,
        max_seqs: usize,
        max_tokens: usize,
        orders: (SumOrder, SumOrder),
    ) -> Result<HostModel, String> {
        let file = GgufFile::open(path).map_err(|e| e.to_string())?;
        let cfg = ModelConfig::from_gguf(&file).map_err(|e| e.to_string())?;
        let w = ModelWeights::from_gguf(&cfg, &file).map_err(|e| e.to_string())?;
        let mut vectors: Vec<Vec<f32>> = Vec::new();
        let mut vector = |info: &TensorInfo| -> Result<u64, String> {
            let v = quant::dequantize_to_vec(
                info.ty,
                file.tensor_data(info),
                info.n_elements() as usize,
            )
            .map_err(|e| format!("tensor {}: {e}", info.name))?;
            vectors.push(v);
            Ok(vectors.last().map_or(0, |v| v.as_ptr() as u64))
        };
        let mat = |info: &TensorInfo| ExactMat {
            ty: info.ty,
            cols: info.dims.first().copied().unwrap_or(0) as usize,
            rows: info.dims.iter().skip(1).product::<u64>() as usize,
            w: file.tensor_data(info).as_ptr() as u64,
        };
        let mut layers = Vec::new();
        let mut names = Vec::new();
        for l in &w.layers {
            let opt = |t: &Option<TensorInfo>| t.clone();
            let (bq, bk, bv) = (
                opt(&l.attn_q_bias),
                opt(&l.attn_k_bias),
                opt(&l.attn_v_bias),
            );
            layers.push(ExactLayer {
                attn_norm: vector(&l.attn_norm)?,
                ffn_norm: vector(&l.ffn_norm)?,
                wq: mat(&l.attn_q),
                wk: mat(&l.attn_k),
                wv: mat(&l.attn_v),
                wo: mat(&l.attn_output),
                gate: mat(&l.ffn_gate),
                up: mat(&l.ffn_up),
                down: mat(&l.ffn_down),
                bq: bq.as_ref().map(&mut vector).transpose()?,
                bk: bk.as_ref().map(&mut vector).transpose()?,
                bv: bv.as_ref().map(&mut vector).transpose()?,
            });
            for t in [
                &l.attn_q,
                &l.attn_k,
                &l.attn_v,
                &l.attn_output,
                &l.ffn_gate,
                &l.ffn_up,
                &l.ffn_down,
            ] {
                names.push((t.name.clone(), t.ty));
            }
        }
        names.push((w.output.name.clone(), w.output.ty));
        let refs: Vec<(&str, GgmlType)> = names.iter().map(|(n, t)| (n.as_str(), *t)).collect();
        super::check_model(&cfg, &refs)?;
        let factors = w
            .rope_freqs
            .as_ref()
            .map(|i| quant::dequantize_to_vec(i.ty, file.tensor_data(i), i.n_elements() as usize))
            .transpose()
            .map_err(|e| e.to_string())?;
        let rope = Rope::new(
            cfg.n_rot,
            cfg.rope_freq_base,
            cfg.rope_freq_scale(),
            factors.as_deref(),
            cfg.rope_style,
        );
        let output_norm = vector(&w.output_norm)?;
        let block_tokens = 16;
        let blocks_per_seq = ctx.div_ceil(block_tokens);
        let n_blocks = blocks_per_seq * max_seqs;
        let kv_len = n_blocks * block_tokens * cfg.n_embd_kv();
        let kv: Vec<Vec<u16>> = (0..2 * cfg.n_layer).map(|_| vec![0u16; kv_len]).collect();
        let (kc, vc) = (
            kv[..cfg.n_layer]
                .iter()
                .map(|b| b.as_ptr() as u64)
                .collect(),
            kv[cfg.n_layer..]
                .iter()
                .map(|b| b.as_ptr() as u64)
                .collect(),
        );
        let embd = (
            file.tensor_data(&w.token_embd).as_ptr() as u64,
            w.token_embd.ty,
            cfg.n_embd,
        );
        let model = ExactModel {
            layers,
            output_norm,
            output: mat(&w.output),
            rope,
            kc,
            vc,
            block_tokens,
            orders,
            cfg: cfg.clone(),
        };
        let mut ops = HostExact {
            embd,
            bufs: Vec::new(),
        };
        let bufs = ExactBufs::new(&mut ops, &cfg, max_tokens, max_seqs, ctx, blocks_per_seq)
            .map_err(|e| e.to_string())?;
        Ok(HostModel {
            ops,
            bufs,
            model,
            alloc: BlockAllocator::new(n_blocks, block_tokens),
            n_vocab: cfg.n_vocab,
            _vectors: vectors,
            _kv: kv,
            _file: file,
        })
    }

    /// Run one step; the logits rows it wants, one after another.
    pub fn step(&mut self, batch: &StepBatch) -> Result<Vec<f32>, BackendError> {
        for c in &batch.chunks {
            if let Some(&bad) = c.tokens.iter().find(|&&t| t as usize >= self.n_vocab) {
                return Err(BackendError::InvalidToken {
                    seq: c.seq,
                    index: c.start_pos,
                    id: bad,
                    n_vocab: self.n_vocab,
                });
            }
            self.alloc.grow(c.seq, c.start_pos + c.tokens.len())?;
        }
        let chunks = ExChunk::of(batch, &self.alloc);
        let rows: usize = chunks
            .iter()
            .map(|c| match c.want {
                runtime::Want::All => c.tokens.len(),
                runtime::Want::Last => 1,
                runtime::Want::None => 0,
            })
            .sum();
        let mut logits = vec![0f32; rows * self.n_vocab];
        let n = super::forward(
            &self.ops,
            &self.model,
            &self.bufs,
            &chunks,
            logits.as_mut_ptr() as u64,
        )?;
        logits.truncate(n * self.n_vocab);
        Ok(logits)
    }

    /// Free a sequence's KV blocks.
    pub fn release(&mut self, seq: runtime::SeqId) {
        self.alloc.release(seq);
    }
}
