//! Paged KV bookkeeping: a pool of fixed-size blocks handed to sequences as they grow, with a
//! prefix cache over whole blocks.
//!
//! Backends own the KV memory; this allocator only decides which block holds which positions, so
//! memory follows actual use and a cancelled sequence gives its blocks back at once.
//!
//! **Prefix cache.** A backend that reports the tokens whose keys and values it has written
//! ([`BlockAllocator::commit`]) gets each full block indexed by its content and position: the
//! chain of its tokens and every token before it. A new sequence whose prompt starts with
//! indexed blocks takes them over ([`BlockAllocator::reuse_prefix`]) instead of computing them
//! again: chat requests that share a system prompt prefill it once. A backend whose numerics
//! differ between computations (the CPU backend's two summation orders) tags each commit; a
//! block is indexed with the tags of the commits that wrote it and reused only by a prompt
//! that would compute it with the same tag, so a request's results never depend on which
//! earlier request filled the cache. Shared blocks are counted
//! (a block returns to the pool when its last holder releases it) and never written again, since
//! a sequence only writes positions past what it holds. An indexed block that no sequence holds
//! stays cached, counted as free: it is taken back, least recently released first, when the
//! pool has no plain free block left.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

use crate::backend::{BackendError, KvStats, SeqId};

/// Block table of every live sequence, block reference counts and the prefix index.
#[derive(Debug)]
pub struct BlockAllocator {
    block_tokens: usize,
    /// Blocks nobody holds and the index does not name.
    free: Vec<u32>,
    total: usize,
    seqs: HashMap<SeqId, SeqBlocks>,
    /// Per block: how many sequences hold it.
    refs: Vec<u32>,
    /// Per block: its entry in the prefix index, if any.
    cached: Vec<Option<CachedBlock>>,
    /// Chain hash of a full block's content and position -> the block holding it.
    index: HashMap<u64, u32>,
    /// Indexed blocks nobody holds, by the tick they were released (oldest first).
    idle: BTreeMap<u64, u32>,
    /// Per block: its key in `idle` while it is there.
    idle_at: Vec<u64>,
    tick: u64,
}

/// What the index knows about a block: enough to check a match exactly (a hash match alone is
/// not trusted).
#[derive(Debug)]
struct CachedBlock {
    hash: u64,
    /// The block before it in its sequence (`None` for a first block).
    parent: Option<u32>,
    tokens: Box<[u32]>,
    /// The union of the tags of the commits that wrote it.
    tag: u8,
}

#[derive(Debug, Default)]
struct SeqBlocks {
    blocks: Vec<u32>,
    len: usize,
    /// Tokens whose keys and values the backend has reported written.
    committed: usize,
    /// Full blocks already offered to the index.
    full: usize,
    /// Chain hash after the last full block (0 before the first).
    chain: u64,
    /// Committed tokens past the last full block.
    pending: Vec<u32>,
    /// The tag of each pending token's commit.
    pending_tags: Vec<u8>,
    /// The commits went out of step with the positions: nothing more of this sequence is
    /// indexed.
    untracked: bool,
}

/// Chain hash of a block: its tokens and tag after the hash of everything before it.
fn chain_hash(prev: u64, tokens: &[u32], tag: u8) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    prev.hash(&mut h);
    tokens.hash(&mut h);
    tag.hash(&mut h);
    h.finish()
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
            refs: vec![0; total],
            cached: (0..total).map(|_| None).collect(),
            index: HashMap::new(),
            idle: BTreeMap::new(),
            idle_at: vec![0; total],
            tick: 0,
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

    /// Blocks a sequence could take now: plain free ones and cached ones nobody holds.
    fn available(&self) -> usize {
        self.free.len() + self.idle.len()
    }

    /// A block for a growing sequence: a plain free one, else the least recently released
    /// cached one (dropped from the index).
    fn take_block(&mut self) -> Option<u32> {
        if let Some(b) = self.free.pop() {
            return Some(b);
        }
        let (_, b) = self.idle.pop_first()?;
        self.uncache(b);
        Some(b)
    }

    fn uncache(&mut self, b: u32) {
        if let Some(c) = self.cached.get_mut(b as usize).and_then(Option::take) {
            if self.index.get(&c.hash) == Some(&b) {
                self.index.remove(&c.hash);
            }
        }
    }

    /// Grow `seq` to hold `new_len` tokens, taking blocks as needed. All or nothing: on failure no
    /// block is taken.
    pub fn grow(&mut self, seq: SeqId, new_len: usize) -> Result<(), BackendError> {
        let have = self.seqs.get(&seq).map_or(0, |s| s.blocks.len());
        let need = new_len.div_ceil(self.block_tokens);
        if need > have {
            let extra = need - have;
            if extra > self.available() {
                return Err(BackendError::KvFull {
                    seq,
                    needed: extra,
                    free: self.available(),
                });
            }
            let mut taken = Vec::with_capacity(extra);
            for _ in 0..extra {
                if let Some(b) = self.take_block() {
                    self.refs[b as usize] = 1;
                    taken.push(b);
                }
            }
            self.seqs.entry(seq).or_default().blocks.extend(taken);
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

    /// Give back `seq`'s hold on each of its blocks: a block nobody holds any more returns to
    /// the pool, or, if indexed, stays cached (and counts as free) until it is needed.
    pub fn release(&mut self, seq: SeqId) {
        let Some(s) = self.seqs.remove(&seq) else {
            return;
        };
        for b in s.blocks.into_iter().rev() {
            let r = &mut self.refs[b as usize];
            *r = r.saturating_sub(1);
            if *r > 0 {
                continue;
            }
            if self.cached[b as usize].is_some() {
                self.tick += 1;
                self.idle.insert(self.tick, b);
                self.idle_at[b as usize] = self.tick;
            } else {
                self.free.push(b);
            }
        }
    }

    /// The backend has written the keys and values of `tokens` at positions `start_pos..` of
    /// `seq` with numerics `tag` (a bit set of the backend's own; 0 when it has one kind):
    /// index every block this completes, under the union of its tokens' tags, so later prompts
    /// computed with that tag can reuse it. Call only after the step succeeded (a failed step
    /// leaves its blocks unindexed).
    pub fn commit(&mut self, seq: SeqId, start_pos: usize, tokens: &[u32], tag: u8) {
        let bt = self.block_tokens;
        let Some(s) = self.seqs.get_mut(&seq) else {
            return;
        };
        if s.untracked {
            return;
        }
        if start_pos != s.committed || start_pos + tokens.len() > s.len {
            s.untracked = true;
            s.pending = Vec::new();
            s.pending_tags = Vec::new();
            return;
        }
        s.committed += tokens.len();
        s.pending.extend_from_slice(tokens);
        s.pending_tags
            .extend(std::iter::repeat_n(tag, tokens.len()));
        let mut done = 0;
        while s.pending.len() - done >= bt {
            let toks = &s.pending[done..done + bt];
            let Some(&b) = s.blocks.get(s.full) else {
                break;
            };
            let tag = s.pending_tags[done..done + bt]
                .iter()
                .fold(0, |a, &t| a | t);
            let hash = chain_hash(s.chain, toks, tag);
            let parent = s.full.checked_sub(1).and_then(|i| s.blocks.get(i).copied());
            if self.cached[b as usize].is_none() && !self.index.contains_key(&hash) {
                self.index.insert(hash, b);
                self.cached[b as usize] = Some(CachedBlock {
                    hash,
                    parent,
                    tokens: toks.into(),
                    tag,
                });
            }
            s.chain = hash;
            s.full += 1;
            done += bt;
        }
        s.pending.drain(..done);
        s.pending_tags.drain(..done);
    }

    /// Give the new sequence `seq` (holding nothing yet) the cached blocks that hold the longest
    /// prefix of `prompt` in whole blocks written with numerics `tag` alone (as `seq` would
    /// compute them), leaving at least one prompt token to compute (its logits are needed).
    /// Returns how many tokens `seq` now holds: its first chunk starts there.
    pub fn reuse_prefix(&mut self, seq: SeqId, prompt: &[u32], tag: u8) -> usize {
        let bt = self.block_tokens;
        if self.seqs.get(&seq).is_some_and(|s| !s.blocks.is_empty()) {
            return 0;
        }
        let mut chain = 0u64;
        let mut matched: Vec<u32> = Vec::new();
        for toks in prompt[..prompt.len().saturating_sub(1)].chunks_exact(bt) {
            let hash = chain_hash(chain, toks, tag);
            let Some(&b) = self.index.get(&hash) else {
                break;
            };
            let ok = self.cached[b as usize].as_ref().is_some_and(|c| {
                c.parent == matched.last().copied() && &*c.tokens == toks && c.tag == tag
            });
            if !ok {
                break;
            }
            matched.push(b);
            chain = hash;
        }
        if matched.is_empty() {
            return 0;
        }
        for &b in &matched {
            if self.refs[b as usize] == 0 {
                self.idle.remove(&self.idle_at[b as usize]);
            }
            self.refs[b as usize] += 1;
        }
        let n = matched.len() * bt;
        let s = self.seqs.entry(seq).or_default();
        *s = SeqBlocks {
            full: matched.len(),
            blocks: matched,
            len: n,
            committed: n,
            chain,
            pending: Vec::new(),
            pending_tags: Vec::new(),
            untracked: false,
        };
        n
    }

    /// Capacity and use. Cached blocks that no sequence holds count as free: they are taken
    /// back as soon as a sequence needs them.
    pub fn stats(&self) -> KvStats {
        KvStats {
            block_tokens: self.block_tokens,
            blocks_total: self.total,
            blocks_used: self.total - self.available(),
        }
    }

    /// Blocks in the prefix index (held or idle).
    pub fn cached_blocks(&self) -> usize {
        self.index.len()
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

    #[test]
    fn blocks_are_reused_only_under_the_tag_they_were_written_with() {
        let mut a = BlockAllocator::new(16, 4);
        let prompt: Vec<u32> = (10..22).collect();
        a.grow(1, prompt.len()).unwrap();
        // Blocks 0 and 1 written with tag 1; block 2 half with 1, half with 2.
        a.commit(1, 0, &prompt[..10], 1);
        a.commit(1, 10, &prompt[10..], 2);
        a.release(1);
        let mut longer = prompt.clone();
        longer.push(99);
        assert_eq!(
            a.reuse_prefix(2, &longer, 1),
            8,
            "tag 1: the two whole tag-1 blocks"
        );
        assert_eq!(a.reuse_prefix(3, &longer, 2), 0, "tag 2: none");
        assert_eq!(
            a.reuse_prefix(4, &longer, 3),
            0,
            "tag 3 (the mixed block's): none"
        );
    }

    #[test]
    fn a_committed_prefix_is_reused_shared_and_cached_after_release() {
        let mut a = BlockAllocator::new(8, 16);
        let prompt: Vec<u32> = (100..140).collect(); // 40 tokens: 2 full blocks + 8
        a.grow(1, 40).unwrap();
        a.commit(1, 0, &prompt[..20], 0);
        a.commit(1, 20, &prompt[20..], 0);
        assert_eq!(a.cached_blocks(), 2);
        // A prompt sharing 2 blocks and going on: both reused.
        let mut p2 = prompt[..32].to_vec();
        p2.extend([7, 8, 9]);
        assert_eq!(a.reuse_prefix(2, &p2, 0), 32);
        assert_eq!(a.blocks(2), &a.blocks(1)[..2]);
        assert_eq!(a.seq_len(2), 32);
        // Shared blocks count once.
        assert_eq!(a.stats().blocks_used, 3);
        a.grow(2, 35).unwrap();
        assert_eq!(a.stats().blocks_used, 4);
        // A prompt of exactly 32 tokens keeps its last block to compute (it needs logits).
        assert_eq!(a.reuse_prefix(3, &prompt[..32], 0), 16);
        // A different second block: only the first is reused; a different first: nothing.
        let mut p4 = prompt[..16].to_vec();
        p4.extend(0..20);
        assert_eq!(a.reuse_prefix(4, &p4, 0), 16);
        let mut p5 = prompt.clone();
        p5[3] = 1;
        assert_eq!(a.reuse_prefix(5, &p5, 0), 0);
        for s in [1, 2, 3, 4, 5] {
            a.release(s);
        }
        // Released, the indexed blocks stay cached but count as free.
        assert_eq!(a.stats().blocks_used, 0);
        assert_eq!(a.reuse_prefix(6, &prompt, 0), 32);
        a.release(6);
        // Needing every block evicts the cached ones (oldest first) and drops them from the index.
        a.grow(7, 8 * 16).unwrap();
        assert_eq!(a.cached_blocks(), 0);
        assert_eq!(a.stats().blocks_used, 8);
        a.release(7);
        assert_eq!(a.reuse_prefix(8, &prompt, 0), 0);
        assert_eq!(a.stats().blocks_used, 0);
    }

    #[test]
    fn commits_out_of_step_stop_indexing_that_sequence() {
        let mut a = BlockAllocator::new(4, 4);
        a.grow(1, 8).unwrap();
        a.commit(1, 0, &[1, 2, 3], 0);
        // A gap (positions 3 and 4 reported before 3): nothing of it may be indexed.
        a.commit(1, 4, &[5, 6, 7, 8], 0);
        assert_eq!(a.cached_blocks(), 0);
        // Past what the sequence holds: ignored too.
        a.grow(2, 4).unwrap();
        a.commit(2, 0, &[1, 2, 3, 4, 5], 0);
        assert_eq!(a.cached_blocks(), 0);
    }

    /// Random grows, commits, reuses and releases against a shadow of what each slot holds:
    /// the exact token prefix whose last token's keys and values were written there. Every
    /// reused block must hold exactly the new prompt's prefix, and every block is exactly one
    /// of free, cached-idle or held.
    #[test]
    fn random_traffic_reuses_only_identical_prefixes() {
        use rand::{Rng, SeedableRng};
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(17);
        let bt = 4;
        let total = 24;
        let mut a = BlockAllocator::new(total, bt);
        let mut slots: Vec<Option<Vec<u32>>> = vec![None; total * bt];
        // Live sequences: id -> tokens fed so far (all committed).
        let mut live: HashMap<SeqId, Vec<u32>> = HashMap::new();
        let mut next: SeqId = 1;
        let mut reused_tokens = 0;
        for _ in 0..3000 {
            match r.gen_range(0..10) {
                0..=2 if live.len() < 6 => {
                    // A new sequence: prompts from a small alphabet share prefixes often.
                    let len = r.gen_range(1..14);
                    let prompt: Vec<u32> = (0..len).map(|_| r.gen_range(0..2)).collect();
                    let id = next;
                    next += 1;
                    let n = a.reuse_prefix(id, &prompt, 0);
                    assert!(n < prompt.len() && n.is_multiple_of(bt));
                    for pos in 0..n {
                        let (b, off) = a.locate(id, pos).unwrap();
                        let held = slots[b as usize * bt + off].as_deref();
                        assert_eq!(held, Some(&prompt[..=pos]), "reused slot of {id} at {pos}");
                    }
                    reused_tokens += n;
                    if a.grow(id, prompt.len()).is_err() {
                        a.release(id);
                        continue;
                    }
                    for pos in n..prompt.len() {
                        let (b, off) = a.locate(id, pos).unwrap();
                        slots[b as usize * bt + off] = Some(prompt[..=pos].to_vec());
                    }
                    a.commit(id, n, &prompt[n..], 0);
                    live.insert(id, prompt);
                }
                3..=6 if !live.is_empty() => {
                    // A sequence generates a few tokens.
                    let ids: Vec<SeqId> = live.keys().copied().collect();
                    let id = ids[r.gen_range(0..ids.len())];
                    let toks = live.get_mut(&id).unwrap();
                    let start = toks.len();
                    let add: Vec<u32> = (0..r.gen_range(1..6)).map(|_| r.gen_range(0..2)).collect();
                    if a.grow(id, start + add.len()).is_err() {
                        continue;
                    }
                    toks.extend(&add);
                    for pos in start..toks.len() {
                        let (b, off) = a.locate(id, pos).unwrap();
                        slots[b as usize * bt + off] = Some(toks[..=pos].to_vec());
                    }
                    a.commit(id, start, &add, 0);
                }
                _ if !live.is_empty() => {
                    let ids: Vec<SeqId> = live.keys().copied().collect();
                    let id = ids[r.gen_range(0..ids.len())];
                    live.remove(&id);
                    a.release(id);
                }
                _ => {}
            }
            // Every block is free, idle-cached or held, exactly once; use counts the held ones.
            let mut holders = vec![0u32; total];
            for id in live.keys() {
                for &b in a.blocks(*id) {
                    holders[b as usize] += 1;
                }
            }
            assert_eq!(holders, a.refs);
            let held = holders.iter().filter(|&&h| h > 0).count();
            assert_eq!(a.stats().blocks_used, held);
            let mut seen = vec![0; total];
            for &b in a.free.iter().chain(a.idle.values()) {
                seen[b as usize] += 1;
            }
            for b in 0..total {
                assert_eq!(seen[b] + usize::from(holders[b] > 0), 1, "block {b}");
            }
        }
        assert!(
            reused_tokens > 100,
            "the traffic should reuse prefixes ({reused_tokens})"
        );
    }
}
