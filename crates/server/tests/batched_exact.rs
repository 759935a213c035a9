//! Continuous batching must not change a sequence's numbers: on the real CPU backend and the
//! default model, bit for bit,
//! - a decode step of many sequences gives each the logits it gets decoding alone;
//! - the per-token work spread over the thread pool (norms, RoPE, KV stores, residual adds)
//!   equals the serial path the trace hook runs;
//! - a prompt started from prefix-cache blocks gives the logits of computing those blocks itself;
//! - a step that mixes a prompt chunk with decode tokens (whose products take different
//!   summation orders, `CpuOptions::prompt_order` / `decode_order`) gives each chunk its own
//!   logits.
//!
//! Prompts are fresh random token ids (seeded).

mod common;

use std::sync::Arc;

use cpu::{CpuBackend, CpuOptions};
use gguf::GgufFile;
use rand::{Rng, SeedableRng};
use runtime::{Backend, SeqChunk, SeqId, StepBatch, Want};

fn backend(file: &Arc<GgufFile>, max_seqs: usize, threads: usize) -> CpuBackend {
    let opts = CpuOptions {
        threads: Some(threads),
        ctx_size: 128,
        max_seqs,
        block_tokens: 16,
        max_batch_tokens: 512,
        ..CpuOptions::default()
    };
    CpuBackend::from_file(file.clone(), "smollm2", &opts).expect("backend")
}

fn bits(row: &[f32]) -> Vec<u32> {
    row.iter().map(|v| v.to_bits()).collect()
}

/// One step; the logit rows (one per chunk that wants them) as bit patterns.
fn step(be: &mut CpuBackend, chunks: Vec<(SeqId, Vec<u32>, usize)>) -> Vec<Vec<u32>> {
    let chunks = chunks
        .into_iter()
        .map(|(s, t, p)| (s, t, p, None))
        .collect();
    step_p(be, chunks)
}

/// [`step`] with each chunk's `SeqChunk::prompt_len`.
#[allow(clippy::type_complexity)]
fn step_p(
    be: &mut CpuBackend,
    chunks: Vec<(SeqId, Vec<u32>, usize, Option<usize>)>,
) -> Vec<Vec<u32>> {
    let batch = StepBatch {
        chunks: chunks
            .into_iter()
            .map(|(seq, tokens, start_pos, prompt_len)| SeqChunk {
                prompt_len,
                seq,
                tokens,
                start_pos,
                want: Want::Last,
            })
            .collect(),
    };
    let out = be.step(&batch).expect("step");
    (0..out.n_rows())
        .map(|r| bits(out.row(r).expect("row")))
        .collect()
}

/// Prefill `prompts` in one step, then `decode` steps of one token each for all of them
/// (each sequence feeds back a token drawn from its own random stream, the same in every run).
fn run(be: &mut CpuBackend, prompts: &[Vec<u32>], decode: usize, seed: u64) -> Vec<Vec<Vec<u32>>> {
    let mut rows = vec![Vec::new(); prompts.len()];
    let first = step(
        be,
        prompts
            .iter()
            .enumerate()
            .map(|(i, p)| (i as SeqId, p.clone(), 0))
            .collect(),
    );
    for (i, r) in first.into_iter().enumerate() {
        rows[i].push(r);
    }
    let mut rngs: Vec<rand_chacha::ChaCha8Rng> = (0..prompts.len())
        .map(|i| rand_chacha::ChaCha8Rng::seed_from_u64(seed + i as u64))
        .collect();
    for d in 0..decode {
        let chunks = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| (i as SeqId, vec![rngs[i].gen_range(0..49152)], p.len() + d))
            .collect();
        for (i, r) in step(be, chunks).into_iter().enumerate() {
            rows[i].push(r);
        }
    }
    rows
}

fn prompts(seed: u64, n: usize) -> Vec<Vec<u32>> {
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let len = r.gen_range(3..40);
            (0..len).map(|_| r.gen_range(0..49152)).collect()
        })
        .collect()
}

#[test]
fn batched_decode_equals_each_sequence_alone_and_the_serial_path() {
    let (file, _tok) = common::open();
    let ps = prompts(5, 9);
    let decode = 3;
    let batched = run(&mut backend(&file, ps.len(), 2), &ps, decode, 100);
    // The traced path runs the per-token work serially, phase by phase.
    let mut traced_be = backend(&file, ps.len(), 2);
    traced_be.set_trace(Some(Box::new(|_, _, _, _| {})));
    let traced = run(&mut traced_be, &ps, decode, 100);
    assert_eq!(
        batched, traced,
        "pool-spread per-token work vs the serial path"
    );
    for (i, p) in ps.iter().enumerate() {
        let mut alone_be = backend(&file, 1, 2);
        let alone = run(
            &mut alone_be,
            std::slice::from_ref(p),
            decode,
            100 + i as u64,
        );
        assert_eq!(batched[i], alone[0], "sequence {i} batched vs alone");
    }
}

/// A prompt that starts from cached blocks gets the logits of computing them, for a short
/// prompt (under `runtime::backend::SHORT_PROMPT`: the decode order) and a long one
/// (llama.cpp's order); blocks written in one order are not reused by a prompt that would
/// compute them in the other.
#[test]
fn a_prompt_started_from_cached_blocks_gets_the_logits_of_computing_them() {
    let (file, _tok) = common::open();
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(9);
    let mut toks = |n: usize| -> Vec<u32> { (0..n).map(|_| r.gen_range(0..49152)).collect() };
    assert_eq!(runtime::backend::SHORT_PROMPT, 64);
    for (shared_len, reuse) in [(37usize, 32usize), (70, 64)] {
        let shared = toks(shared_len);
        let mut prompt = shared[..reuse].to_vec();
        prompt.extend(toks(6));
        let plen = Some(prompt.len());
        let mut be = backend(&file, 2, 2);
        // Sequence 1 computes `shared` (a prompt of the same kind); its full blocks (16 tokens
        // each) get indexed.
        step_p(&mut be, vec![(1, shared.clone(), 0, Some(shared.len()))]);
        be.release(1);
        // Sequence 2 starts from them and computes only its own tail.
        assert_eq!(
            be.reuse_prefix(2, &prompt),
            reuse,
            "prompt of {}",
            prompt.len()
        );
        let cached = step_p(&mut be, vec![(2, prompt[reuse..].to_vec(), reuse, plen)]);
        // The same computation without the cache: the first tokens in one chunk (as
        // sequence 1 computed them), then the tail.
        let mut fresh_be = backend(&file, 1, 2);
        step_p(&mut fresh_be, vec![(3, prompt[..reuse].to_vec(), 0, plen)]);
        let fresh = step_p(
            &mut fresh_be,
            vec![(3, prompt[reuse..].to_vec(), reuse, plen)],
        );
        assert_eq!(cached, fresh, "prompt of {}", prompt.len());
        // And a prompt that differs inside the first block reuses nothing.
        let mut other = prompt.clone();
        other[5] ^= 1;
        assert_eq!(be.reuse_prefix(4, &other), 0);
    }
    // A short prompt's blocks (decode order) serve another short prompt, not a long one.
    let short = toks(40);
    let mut be = backend(&file, 3, 2);
    step_p(&mut be, vec![(1, short.clone(), 0, Some(short.len()))]);
    be.release(1);
    let mut long = short[..32].to_vec();
    long.extend(toks(40));
    assert_eq!(
        be.reuse_prefix(2, &long),
        0,
        "a long prompt took decode-order blocks"
    );
    let mut short2 = short[..32].to_vec();
    short2.extend(toks(3));
    assert_eq!(be.reuse_prefix(3, &short2), 32);
}

#[test]
fn a_step_mixing_a_prompt_with_decode_tokens_gives_each_its_own_logits() {
    let (file, _tok) = common::open();
    let ps = prompts(11, 4);
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(12);
    let late: Vec<u32> = (0..23).map(|_| r.gen_range(0..49152)).collect();
    let next: Vec<u32> = (0..4).map(|_| r.gen_range(0..49152)).collect();
    let mut be = backend(&file, 5, 2);
    step(
        &mut be,
        ps.iter()
            .enumerate()
            .map(|(i, p)| (i as SeqId, p.clone(), 0))
            .collect(),
    );
    // The late prompt sits between decode tokens, so the step's tokens change order twice.
    let mixed = step(
        &mut be,
        vec![
            (0, vec![next[0]], ps[0].len()),
            (1, vec![next[1]], ps[1].len()),
            (4, late.clone(), 0),
            (2, vec![next[2]], ps[2].len()),
            (3, vec![next[3]], ps[3].len()),
        ],
    );
    assert_eq!(mixed.len(), 5);
    let mut alone_be = backend(&file, 1, 2);
    let late_alone = step(&mut alone_be, vec![(4, late.clone(), 0)]);
    assert_eq!(mixed[2], late_alone[0], "the prompt chunk batched vs alone");
    for (k, i) in [(0usize, 0usize), (1, 1), (3, 2), (4, 3)] {
        let mut alone_be = backend(&file, 1, 2);
        step(&mut alone_be, vec![(9, ps[i].clone(), 0)]);
        let alone = step(&mut alone_be, vec![(9, vec![next[i]], ps[i].len())]);
        assert_eq!(
            mixed[k], alone[0],
            "decode of sequence {i} batched vs alone"
        );
    }
}
