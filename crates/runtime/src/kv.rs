//! Paged KV bookkeeping: a pool of fixed-size blocks handed to sequences as they grow.
//!
//! Backends own the KV memory; this allocator only decides which block holds which positions, so
//! memory follows actual use and a cancelled sequence gives its blocks back at once.

use std::collections::HashMap;

use crate::backend::{BackendError, KvStats, SeqId};

/// Block table of every live sequence.
#[derive(Debug)]
pub struct BlockAllocator {
    block_tokens: usize,
    free: Vec<u32>,
    total: usize,
    seqs: HashMap<SeqId, SeqBlocks>,
}

#[derive(Debug, Default)]
struct SeqBlocks {
    blocks: Vec<u32>,
    len: usize,
}

impl BlockAllocator {
    /// A pool of `total` blocks of `block_tokens` tokens each.
    pub fn new(total: usize, block_tokens: usize) -> Self {
        let block_tokens = block_tokens.max(1);
        // Pop from the end, so hand out low ids first.
        let free = (0..total as u32).rev().collect();
        BlockAllocator {
            block_tokens,
            free,
            total,
            seqs: HashMap::new(),
        }
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// Tokens currently held by `seq` (0 if unknown).
    pub fn seq_len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.len)
    }

    /// Grow `seq` to hold `new_len` tokens, taking blocks as needed. All or nothing: on failure no
    /// block is taken.
    pub fn grow(&mut self, seq: SeqId, new_len: usize) -> Result<(), BackendError> {
        let have = self.seqs.get(&seq).map_or(0, |s| s.blocks.len());
        let need = new_len.div_ceil(self.block_tokens);
        if need > have {
            let extra = need - have;
            if extra > self.free.len() {
                return Err(BackendError::KvFull {
                    seq,
                    needed: extra,
                    free: self.free.len(),
                });
            }
            let entry = self.seqs.entry(seq).or_default();
            for _ in 0..extra {
                if let Some(b) = self.free.pop() {
                    entry.blocks.push(b);
                }
            }
        }
        let entry = self.seqs.entry(seq).or_default();
        entry.len = entry.len.max(new_len);
        Ok(())
    }

    /// Blocks that `grow(seq, new_len)` would take.
    pub fn blocks_needed(&self, seq: SeqId, new_len: usize) -> usize {
        let have = self.seqs.get(&seq).map_or(0, |s| s.blocks.len());
        new_len.div_ceil(self.block_tokens).saturating_sub(have)
    }

    /// Block and offset of position `pos` of `seq`, if allocated.
    pub fn locate(&self, seq: SeqId, pos: usize) -> Option<(u32, usize)> {
        let s = self.seqs.get(&seq)?;
        let b = *s.blocks.get(pos / self.block_tokens)?;
        Some((b, pos % self.block_tokens))
    }

    /// The block table of `seq`.
    pub fn blocks(&self, seq: SeqId) -> &[u32] {
        self.seqs.get(&seq).map_or(&[], |s| s.blocks.as_slice())
    }

    /// Return every block of `seq` to the pool.
    pub fn release(&mut self, seq: SeqId) {
        if let Some(s) = self.seqs.remove(&seq) {
            self.free.extend(s.blocks.into_iter().rev());
        }
    }

    /// Capacity and use.
    pub fn stats(&self) -> KvStats {
        KvStats {
            block_tokens: self.block_tokens,
            blocks_total: self.total,
            blocks_used: self.total - self.free.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grow_locate_release_returns_every_block() {
        let mut a = BlockAllocator::new(10, 16);
        a.grow(1, 17).unwrap();
        assert_eq!(a.blocks(1).len(), 2);
        a.grow(2, 16 * 8).unwrap();
        assert_eq!(a.stats().blocks_used, 10);
        let e = a.grow(1, 33).unwrap_err();
        assert!(matches!(
            e,
            BackendError::KvFull {
                seq: 1,
                needed: 1,
                free: 0
            }
        ));
        // A failed grow takes nothing.
        assert_eq!(a.blocks(1).len(), 2);
        let (b, off) = a.locate(1, 16).unwrap();
        assert_eq!((b, off), (a.blocks(1)[1], 0));
        a.release(2);
        a.release(1);
        assert_eq!(a.stats().blocks_used, 0);
        assert!(a.locate(1, 0).is_none());
    }
}
