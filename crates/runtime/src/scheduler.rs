//! Scheduling decisions of an actor, as pure functions: which waiting requests to admit and what
//! each running sequence feeds in the next step.
//!
//! Admission reserves, per request, the KV blocks its worst case needs (prompt plus every token
//! it may generate, capped by the context) against the backend's pool, so a running sequence
//! never finds the cache full: no preemption, no recomputation. The blocks themselves are taken
//! from the pool only as the sequence grows, so memory follows actual use.

use std::time::Duration;

/// Limits and knobs of one actor's scheduler.
#[derive(Clone, Debug, PartialEq)]
pub struct SchedConfig {
    /// Most tokens in one step (the backend's limit).
    pub max_batch_tokens: usize,
    /// Most sequences running at once (the backend's limit).
    pub max_batch_seqs: usize,
    /// Most prompt tokens fed in one step while other sequences are generating, so their tokens
    /// keep flowing during a long prefill.
    pub prefill_chunk: usize,
    /// Tokens per KV block.
    pub block_tokens: usize,
    /// Most requests waiting for admission; more are refused at once.
    pub max_waiting: usize,
    /// How long a request may wait for admission before it is refused as overloaded.
    pub admission_timeout: Duration,
}

/// KV blocks that hold `tokens` tokens.
pub fn blocks_for(tokens: usize, block_tokens: usize) -> usize {
    tokens.div_ceil(block_tokens.max(1))
}

/// Tokens a request may generate: `max_tokens` capped by what the context leaves after the
/// prompt. The caller has checked `prompt_len < ctx`.
pub fn max_new_tokens(prompt_len: usize, max_tokens: Option<usize>, ctx: usize) -> usize {
    let room = ctx.saturating_sub(prompt_len);
    max_tokens.map_or(room, |m| m.min(room))
}

/// KV tokens a request needs at most: the last sampled token is never fed back.
pub fn kv_tokens_needed(prompt_len: usize, max_new: usize) -> usize {
    prompt_len + max_new.saturating_sub(1)
}

/// How many requests at the head of the waiting queue to admit (first come, first served: a
/// request that does not fit blocks those behind it, so none starves).
///
/// `reserved` is the sum of the running sequences' reservations, `waiting` the reservations of
/// the waiting ones in queue order.
pub fn admit_count(
    cfg: &SchedConfig,
    total_blocks: usize,
    reserved: usize,
    running: usize,
    waiting: &[usize],
) -> usize {
    let mut reserved = reserved;
    let mut n = 0;
    for &need in waiting {
        if running + n >= cfg.max_batch_seqs || reserved + need > total_blocks {
            break;
        }
        reserved += need;
        n += 1;
    }
    n
}

/// Where a request of priority `rank` joins the waiting queue, given the ranks of the requests
/// already waiting in queue order: behind every one of the same or a higher rank, ahead of the
/// lower ones. Each priority is therefore first come, first served, and a higher one is admitted
/// first (a lower one still gets its turn or its overloaded refusal at `admission_timeout`).
pub fn queue_position(waiting_ranks: &[u8], rank: u8) -> usize {
    waiting_ranks
        .iter()
        .position(|&r| r < rank)
        .unwrap_or(waiting_ranks.len())
}

/// A running sequence as the planner sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunView {
    /// Tokens not yet in the KV cache (prompt remainder while prefilling, 1 while generating).
    pub pending: usize,
    /// Whether it is generating (its whole prompt is in the cache).
    pub decoding: bool,
}

/// The next step: `(index into running, tokens to feed)`. Generating sequences go first, one
/// token each; the remaining token budget goes to prompt chunks in admission order, at most
/// `prefill_chunk` prompt tokens in all while anything is generating.
pub fn plan_step(cfg: &SchedConfig, running: &[RunView]) -> Vec<(usize, usize)> {
    let mut budget = cfg.max_batch_tokens;
    let mut seqs = cfg.max_batch_seqs;
    let mut plan = Vec::new();
    let mut any_decoding = false;
    for (i, r) in running.iter().enumerate() {
        if r.decoding && r.pending > 0 && budget > 0 && seqs > 0 {
            let n = r.pending.min(budget);
            plan.push((i, n));
            budget -= n;
            seqs -= 1;
            any_decoding = true;
        }
    }
    let mut prefill_budget = if any_decoding {
        budget.min(cfg.prefill_chunk.max(1))
    } else {
        budget
    };
    for (i, r) in running.iter().enumerate() {
        if r.decoding || r.pending == 0 || prefill_budget == 0 || seqs == 0 {
            continue;
        }
        let n = r.pending.min(prefill_budget);
        plan.push((i, n));
        prefill_budget -= n;
        seqs -= 1;
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priorities_queue_ahead_of_lower_ones_and_in_arrival_order_among_equals() {
        // Arrivals: normal, low, high, normal, high, low -> high, high, normal, normal, low, low.
        let arrivals = [(1u8, 'a'), (0, 'b'), (2, 'c'), (1, 'd'), (2, 'e'), (0, 'f')];
        let mut q: Vec<(u8, char)> = Vec::new();
        for (rank, id) in arrivals {
            let ranks: Vec<u8> = q.iter().map(|e| e.0).collect();
            q.insert(queue_position(&ranks, rank), (rank, id));
        }
        let order: String = q.iter().map(|e| e.1).collect();
        assert_eq!(order, "ceadbf");
        assert_eq!(queue_position(&[], 0), 0);
    }

    fn cfg() -> SchedConfig {
        SchedConfig {
            max_batch_tokens: 512,
            max_batch_seqs: 8,
            prefill_chunk: 256,
            block_tokens: 32,
            max_waiting: 16,
            admission_timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn reservations_cap_by_context() {
        assert_eq!(max_new_tokens(100, None, 512), 412);
        assert_eq!(max_new_tokens(100, Some(50), 512), 50);
        assert_eq!(max_new_tokens(100, Some(5000), 512), 412);
        // 100 prompt + 49 fed generated tokens = 149 tokens = 5 blocks of 32.
        assert_eq!(blocks_for(kv_tokens_needed(100, 50), 32), 5);
        assert_eq!(blocks_for(kv_tokens_needed(128, 1), 32), 4);
        assert_eq!(blocks_for(kv_tokens_needed(128, 2), 32), 5);
    }

    #[test]
    fn admission_is_fifo_and_bounded_by_blocks_and_seqs() {
        let c = cfg();
        // 20 blocks, 12 reserved: 8 left; head needs 5, next 4 -> only the head.
        assert_eq!(admit_count(&c, 20, 12, 1, &[5, 4, 1]), 1);
        // The head does not fit: nobody behind it jumps the queue.
        assert_eq!(admit_count(&c, 20, 12, 1, &[9, 1, 1]), 0);
        assert_eq!(admit_count(&c, 20, 0, 0, &[5, 5, 5, 5, 1]), 4);
        // The sequence limit binds before the blocks.
        assert_eq!(admit_count(&c, 1000, 0, 6, &[1, 1, 1, 1]), 2);
        assert_eq!(admit_count(&c, 1000, 0, 0, &[]), 0);
    }

    #[test]
    fn decoders_first_then_prompt_chunks() {
        let c = cfg();
        let d = RunView {
            pending: 1,
            decoding: true,
        };
        let p = |n| RunView {
            pending: n,
            decoding: false,
        };
        // Nothing generating: a long prompt gets the whole step budget.
        assert_eq!(plan_step(&c, &[p(2000)]), vec![(0, 512)]);
        // Two generating + two prompts: decoders first, then at most 256 prompt tokens, FIFO.
        assert_eq!(
            plan_step(&c, &[p(1000), d, p(100), d]),
            vec![(1, 1), (3, 1), (0, 256)]
        );
        assert_eq!(
            plan_step(&c, &[p(200), d, p(100)]),
            vec![(1, 1), (0, 200), (2, 56)]
        );
        // The token budget binds too.
        let c2 = SchedConfig {
            max_batch_tokens: 3,
            ..cfg()
        };
        assert_eq!(
            plan_step(&c2, &[d, d, d, d, p(9)]),
            vec![(0, 1), (1, 1), (2, 1)]
        );
        // And the sequence limit.
        let c3 = SchedConfig {
            max_batch_seqs: 2,
            ..cfg()
        };
        assert_eq!(plan_step(&c3, &[p(5), d, p(7)]), vec![(1, 1), (0, 5)]);
    }

    #[test]
    fn every_running_sequence_progresses_within_a_few_steps() {
        // Simulate: 8 sequences with prompts of assorted lengths; all must reach decoding and
        // every decoder must be fed every step.
        let c = cfg();
        let mut seqs: Vec<RunView> = [700usize, 30, 1500, 5, 260, 90, 1024, 1]
            .iter()
            .map(|&n| RunView {
                pending: n,
                decoding: false,
            })
            .collect();
        for _step in 0..20 {
            let plan = plan_step(&c, &seqs);
            let tokens: usize = plan.iter().map(|p| p.1).sum();
            assert!(tokens <= c.max_batch_tokens);
            for (i, s) in seqs.iter().enumerate() {
                if s.decoding {
                    assert!(plan.contains(&(i, 1)), "decoder {i} skipped");
                }
            }
            for (i, n) in plan {
                let s = &mut seqs[i];
                s.pending -= n;
                if s.pending == 0 {
                    s.decoding = true;
                    s.pending = 1;
                }
            }
        }
        assert!(seqs.iter().all(|s| s.decoding));
    }
}
