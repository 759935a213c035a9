//! The contract between the runtime and a compute backend.
//!
//! A backend lives on its actor's thread only: it needs no `Send`/`Sync` and takes no locks. The
//! runtime hands it batches of sequence chunks (prefill chunks and single decode tokens of many
//! sequences at once) and gets logits back.

use std::fmt;

/// Identifies one sequence (one request's context) inside a backend.
pub type SeqId = u64;

/// What a backend is and what it can hold.
#[derive(Clone, Debug)]
pub struct BackendInfo {
    /// Stable short name used in routing rules, headers and metrics: `cpu`, `cuda:0`.
    pub name: String,
    /// Human-readable device description (CPU model and ISA, GPU name and memory).
    pub device: String,
    /// Most tokens one `step` accepts across all chunks.
    pub max_batch_tokens: usize,
    /// Most sequences one `step` accepts.
    pub max_batch_seqs: usize,
    /// Most tokens one sequence may hold (prompt + generated).
    pub max_seq_tokens: usize,
    /// Tokens per KV block.
    pub kv_block_tokens: usize,
}

/// An operation of a model's forward pass, as `audit` and `support` see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpDesc {
    /// Op name: `matmul`, `rms_norm`, `rope`, `attention`, `swiglu`, `get_rows`, ...
    pub op: String,
    /// Tensor (weight) type the op reads, when it reads one.
    pub ty: Option<gguf::GgmlType>,
    /// Shape of the weight or activation, ggml order.
    pub shape: Vec<u64>,
    /// The block the op belongs to (`None` for the embedding and the head): lets a backend with
    /// partial placement (some layers on the device, the rest on the host) answer per layer.
    pub layer: Option<usize>,
}

impl OpDesc {
    /// The runtime's view of one op of `model::ops::ops`: the op name as backends match it
    /// (`matmul` for `OpKind::MatMul`, otherwise `OpKind::name`), the type it reads, and its
    /// first operand's shape.
    pub fn from_model(op: &model::ops::OpDesc) -> OpDesc {
        let name = match op.kind {
            model::ops::OpKind::MatMul => "matmul",
            k => k.name(),
        };
        OpDesc {
            op: name.to_string(),
            ty: Some(op.ty),
            shape: op.inputs.first().cloned().unwrap_or_default(),
            layer: op.layer,
        }
    }
}

/// Whether a backend runs an op natively.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Support {
    /// Runs on the backend's own device.
    Native,
    /// Runs elsewhere (normally the CPU) inside this backend's plan.
    Fallback { to: String, why: String },
}

/// Which logits a chunk wants back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// Only the last token's logits (normal generation).
    Last,
    /// Every token's logits (teacher forcing, perplexity).
    All,
    /// No logits (a prefill chunk that is not the prompt's last).
    None,
}

/// One sequence's share of a step: `tokens` at positions `start_pos..start_pos + tokens.len()`.
#[derive(Clone, Debug)]
pub struct SeqChunk {
    pub seq: SeqId,
    pub tokens: Vec<u32>,
    pub start_pos: usize,
    pub want: Want,
    /// For a chunk of prompt tokens: the length of its sequence's whole prompt (cached prefix
    /// included), the same for every chunk of that prompt however the scheduler splits it and
    /// whatever the prefix cache holds. `None`: generated tokens, or a caller that does not say.
    /// A backend may choose its numerics by it, never by what shares the step (the CPU
    /// backend: [`SHORT_PROMPT`]).
    pub prompt_len: Option<usize>,
}

/// Prompts shorter than this are, for the CPU backend's summation order, treated like
/// generated tokens (whole-block integer sums); longer ones, and multi-token chunks whose
/// [`SeqChunk::prompt_len`] is unknown, keep llama.cpp's order (docs/operations.md,
/// `CROSSOVER_CPU_ORDER`).
pub const SHORT_PROMPT: usize = 64;

/// One step's work.
#[derive(Clone, Debug, Default)]
pub struct StepBatch {
    pub chunks: Vec<SeqChunk>,
}

impl StepBatch {
    /// Total tokens across chunks.
    pub fn n_tokens(&self) -> usize {
        self.chunks.iter().map(|c| c.tokens.len()).sum()
    }

    /// Checks the batch against a backend's limits (`info`), its vocabulary and its KV cache
    /// before any work starts, so a bad batch changes nothing: at most `max_batch_tokens`
    /// tokens and `max_batch_seqs` sequences, one chunk per sequence, each chunk starting where
    /// its sequence's cache ends and staying within `max_seq_tokens`, every token id below
    /// `n_vocab`, and enough free KV blocks for all chunks together. Every backend calls this
    /// first in `step`.
    pub fn validate(
        &self,
        info: &BackendInfo,
        n_vocab: usize,
        kv: &crate::kv::BlockAllocator,
    ) -> Result<(), BackendError> {
        let n = self.n_tokens();
        if n > info.max_batch_tokens {
            return Err(BackendError::BatchTooLarge {
                what: "tokens",
                got: n,
                max: info.max_batch_tokens,
            });
        }
        if self.chunks.len() > info.max_batch_seqs {
            return Err(BackendError::BatchTooLarge {
                what: "sequences",
                got: self.chunks.len(),
                max: info.max_batch_seqs,
            });
        }
        let mut need = 0;
        for (i, c) in self.chunks.iter().enumerate() {
            if self.chunks[..i].iter().any(|o| o.seq == c.seq) {
                return Err(BackendError::BatchTooLarge {
                    what: "chunks of one sequence",
                    got: 2,
                    max: 1,
                });
            }
            let have = kv.seq_len(c.seq);
            if c.start_pos != have {
                return Err(BackendError::PositionMismatch {
                    seq: c.seq,
                    got: c.start_pos,
                    have,
                });
            }
            let end = c.start_pos + c.tokens.len();
            if end > info.max_seq_tokens {
                return Err(BackendError::ContextOverflow {
                    seq: c.seq,
                    pos: end.saturating_sub(1),
                    max: info.max_seq_tokens,
                });
            }
            if let Some((index, &id)) = c
                .tokens
                .iter()
                .enumerate()
                .find(|(_, &id)| id as usize >= n_vocab)
            {
                return Err(BackendError::InvalidToken {
                    seq: c.seq,
                    index,
                    id,
                    n_vocab,
                });
            }
            need += kv.blocks_needed(c.seq, end);
        }
        let free = kv.stats().blocks_free();
        if need > free {
            let seq = self.chunks.first().map_or(0, |c| c.seq);
            return Err(BackendError::KvFull {
                seq,
                needed: need,
                free,
            });
        }
        Ok(())
    }
}

/// Logits of one step: rows in chunk order; a chunk with `Want::Last` contributes one row,
/// `Want::All` one row per token, `Want::None` none.
#[derive(Clone, Debug, Default)]
pub struct StepOutput {
    pub n_vocab: usize,
    pub logits: Vec<f32>,
}

impl StepOutput {
    /// Each row's `k` best logits as [`crate::sampling::top_k`] lists them (what
    /// [`Backend::step_top_k`] returns when it selects on the host).
    pub fn top_k_rows(&self, k: usize) -> Vec<Vec<(u32, f32)>> {
        self.logits
            .chunks_exact(self.n_vocab.max(1))
            .map(|r| crate::sampling::top_k(r, k))
            .collect()
    }
    /// Row `i` of the logits.
    pub fn row(&self, i: usize) -> Option<&[f32]> {
        let a = i.checked_mul(self.n_vocab)?;
        self.logits.get(a..a.checked_add(self.n_vocab)?)
    }
    /// Number of rows.
    pub fn n_rows(&self) -> usize {
        self.logits.len().checked_div(self.n_vocab).unwrap_or(0)
    }
}

/// KV cache capacity and use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvStats {
    pub block_tokens: usize,
    pub blocks_total: usize,
    pub blocks_used: usize,
}

impl KvStats {
    /// Free blocks.
    pub fn blocks_free(&self) -> usize {
        self.blocks_total.saturating_sub(self.blocks_used)
    }
}

/// What can go wrong in a step.
#[derive(Clone, Debug, thiserror::Error)]
pub enum BackendError {
    #[error("KV cache full: sequence {seq} needs {needed} more blocks, {free} free")]
    KvFull {
        seq: SeqId,
        needed: usize,
        free: usize,
    },
    #[error("sequence {seq}: position {pos} is beyond the context of {max} tokens")]
    ContextOverflow { seq: SeqId, pos: usize, max: usize },
    #[error("sequence {seq}: chunk starts at {got} but the cache holds {have} tokens")]
    PositionMismatch { seq: SeqId, got: usize, have: usize },
    #[error(
        "token id {id} at index {index} of sequence {seq} is outside the vocabulary of {n_vocab}"
    )]
    InvalidToken {
        seq: SeqId,
        index: usize,
        id: u32,
        n_vocab: usize,
    },
    #[error("batch of {got} {what} exceeds the backend limit of {max}")]
    BatchTooLarge {
        what: &'static str,
        got: usize,
        max: usize,
    },
    #[error("model not supported by backend {backend}: {why}")]
    Unsupported { backend: String, why: String },
    #[error("device error on {backend}: {msg}")]
    Device { backend: String, msg: String },
}

/// A compute backend, owned by exactly one actor thread.
pub trait Backend {
    /// Name, device, limits.
    fn info(&self) -> &BackendInfo;
    /// Can this backend run `op` natively?
    fn support(&self, op: &OpDesc) -> Support;
    /// Run one step: append each chunk's tokens to its sequence's KV cache and return logits.
    fn step(&mut self, batch: &StepBatch) -> Result<StepOutput, BackendError>;
    /// Free a sequence's KV blocks (unknown ids are ignored).
    fn release(&mut self, seq: SeqId);
    /// KV capacity and use.
    fn kv(&self) -> KvStats;
    /// Prefix cache: let the new sequence `seq` (nothing fed yet) start from KV blocks that
    /// already hold the beginning of `prompt` (computed for an earlier sequence with the same
    /// tokens at the same positions). Returns how many leading prompt tokens `seq` now holds,
    /// always fewer than `prompt.len()` (the last prompt token must be computed for its
    /// logits); its first chunk then starts at that position. The default has no cache.
    fn reuse_prefix(&mut self, seq: SeqId, prompt: &[u32]) -> usize {
        let _ = (seq, prompt);
        0
    }
    /// Take back the logits buffer of a [`StepOutput`] its caller is done with, so a later step
    /// can write its logits there instead of allocating (and clearing) a new buffer: 64 rows
    /// of a 49k vocabulary are 12.6 MB per step. The contents are stale; the default drops it.
    fn recycle(&mut self, logits: Vec<f32>) {
        drop(logits);
    }
    /// Run one step like [`Backend::step`] and return each logits row's greedy pick instead of
    /// the row: the index of its largest logit, the lowest index on ties, NaN never winning
    /// (what [`crate::Sampler::sample`] picks at temperature 0 without penalties), one id per
    /// row in row order. A backend that picks on its device saves copying the rows to the host
    /// (128,256 floats per row for a Llama-3 vocabulary); the default runs [`Backend::step`]
    /// and picks on the host.
    fn step_argmax(&mut self, batch: &StepBatch) -> Result<Vec<u32>, BackendError> {
        let out = self.step(batch)?;
        let ids = out
            .logits
            .chunks_exact(out.n_vocab.max(1))
            .map(crate::sampling::argmax)
            .collect();
        self.recycle(out.logits);
        Ok(ids)
    }
    /// The largest `k` for which [`Backend::step_top_k`] selects on the backend's own device,
    /// so that asking for each row's best logits saves copying the rows (the actor then takes
    /// it for sampled rows whose sampler reads only those, [`crate::Sampler::top_k_only`]);
    /// 0: none. The default is 0: its `step_top_k` selects on the host, on the actor's
    /// thread, where copying the rows and sampling them on several threads is as fast.
    fn device_top_k(&self) -> usize {
        0
    }
    /// Run one step like [`Backend::step`] and return, per logits row in row order, its `k`
    /// best logits as [`crate::sampling::top_k`] lists them: `(token, logit)`, descending, the
    /// lower id first among equals, NaN as negative infinity (the whole row so ordered when
    /// `k` is not below its length). [`crate::Sampler::sample_top_k`] draws from such a list
    /// the token [`crate::Sampler::sample`] draws from the row. The default runs
    /// [`Backend::step`] and selects on the host.
    fn step_top_k(
        &mut self,
        batch: &StepBatch,
        k: usize,
    ) -> Result<Vec<Vec<(u32, f32)>>, BackendError> {
        let out = self.step(batch)?;
        let rows = out.top_k_rows(k);
        self.recycle(out.logits);
        Ok(rows)
    }
    /// Whether [`Backend::decode_greedy`] queues its steps without waiting for each pick, so
    /// that taking several at once pays (the CUDA backend). The actor chains steps only then:
    /// a chain ends when its last step does, so a dropped stream stops within a chain rather
    /// than within a step. The default (which loops [`Backend::step_argmax`]) says no.
    fn pipelines_decode(&self) -> bool {
        false
    }
    /// `steps` greedy decode steps at once: every chunk of `batch` feeds one token (`Want::Last`)
    /// and step `k > 0` feeds each sequence its pick of step `k - 1` at the next position.
    /// Returns the picks, `steps` rows of one id per chunk ([`Backend::step_argmax`]'s picks).
    /// A backend may queue every step before the first pick comes back (the CUDA backend: no
    /// host round trip between steps); the default runs [`Backend::step_argmax`] `steps` times.
    /// On an error the sequences hold an unknown number of the steps' positions.
    fn decode_greedy(
        &mut self,
        batch: &StepBatch,
        steps: usize,
    ) -> Result<Vec<Vec<u32>>, BackendError> {
        let mut b = batch.clone();
        let mut out = Vec::with_capacity(steps);
        for _ in 0..steps {
            let ids = self.step_argmax(&b)?;
            for (c, &id) in b.chunks.iter_mut().zip(&ids) {
                c.start_pos += c.tokens.len();
                c.tokens = vec![id];
                c.prompt_len = None;
            }
            out.push(ids);
        }
        Ok(out)
    }
}

impl fmt::Display for Support {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Support::Native => f.write_str("native"),
            Support::Fallback { to, why } => write!(f, "fallback to {to}: {why}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::BlockAllocator;

    fn info() -> BackendInfo {
        BackendInfo {
            name: "t".into(),
            device: "test".into(),
            max_batch_tokens: 64,
            max_batch_seqs: 4,
            max_seq_tokens: 100,
            kv_block_tokens: 16,
        }
    }

    fn chunk(seq: SeqId, start_pos: usize, tokens: Vec<u32>) -> SeqChunk {
        SeqChunk {
            prompt_len: None,
            seq,
            tokens,
            start_pos,
            want: Want::Last,
        }
    }

    #[test]
    fn validate_names_each_violation_and_accepts_a_good_batch() {
        let mut kv = BlockAllocator::new(8, 16);
        kv.grow(1, 20).unwrap();
        let (info, n_vocab) = (info(), 50);
        let check = |chunks: Vec<SeqChunk>| StepBatch { chunks }.validate(&info, n_vocab, &kv);

        assert!(check(vec![chunk(1, 20, vec![3, 4]), chunk(2, 0, vec![49; 30])]).is_ok());
        assert!(matches!(
            check(vec![chunk(2, 0, vec![1; 65])]),
            Err(BackendError::BatchTooLarge {
                what: "tokens",
                got: 65,
                max: 64
            })
        ));
        assert!(matches!(
            check((2..7).map(|s| chunk(s, 0, vec![1])).collect()),
            Err(BackendError::BatchTooLarge {
                what: "sequences",
                got: 5,
                ..
            })
        ));
        assert!(matches!(
            check(vec![chunk(2, 0, vec![1]), chunk(2, 1, vec![1])]),
            Err(BackendError::BatchTooLarge {
                what: "chunks of one sequence",
                ..
            })
        ));
        assert!(matches!(
            check(vec![chunk(1, 19, vec![1])]),
            Err(BackendError::PositionMismatch {
                seq: 1,
                got: 19,
                have: 20
            })
        ));
        assert!(matches!(
            check(vec![chunk(4, 0, vec![1, 2, 50])]),
            Err(BackendError::InvalidToken {
                seq: 4,
                index: 2,
                id: 50,
                n_vocab: 50
            })
        ));
        // 8 blocks of 16: sequence 1 holds 2 (20 tokens), so 6 are free: 96 new tokens of
        // sequence 2 fit, 112 (7 blocks) do not.
        let mut big = info.clone();
        big.max_batch_tokens = 200;
        big.max_seq_tokens = 200;
        let one = |c: SeqChunk, info: &BackendInfo| {
            StepBatch { chunks: vec![c] }.validate(info, n_vocab, &kv)
        };
        assert!(one(chunk(2, 0, vec![1; 96]), &big).is_ok());
        assert!(matches!(
            one(chunk(2, 0, vec![1; 112]), &big),
            Err(BackendError::KvFull {
                seq: 2,
                needed: 7,
                free: 6
            })
        ));
        big.max_seq_tokens = 100;
        assert!(matches!(
            one(chunk(1, 20, vec![1; 81]), &big),
            Err(BackendError::ContextOverflow {
                seq: 1,
                pos: 100,
                max: 100
            })
        ));
        assert!(one(chunk(1, 20, vec![1; 80]), &big).is_ok());
    }
}
