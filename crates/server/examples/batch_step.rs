//! Engine-level timing of continuous batching, without HTTP: what a decode step of `NSEQ`
//! sequences costs per token against a one-sequence decode step at the same context, and what
//! sampling the batch's rows with the server's default sampler adds. The load test
//! (`scripts/load_test.py`) measures the same through the server; this isolates the engine.
//!
//! With one thread the figures are also given in the thread's CPU time, which a busy machine
//! does not inflate.
//!
//! Usage: batch_step MODEL [THREADS] [NSEQ] [PROMPT] [GEN]
use std::time::{Duration, Instant};

/// This thread's CPU time so far (Linux; zero elsewhere).
fn cpu_time() -> Duration {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(Duration::ZERO, Duration::from_nanos)
}

use cpu::{CpuBackend, CpuOptions};
use runtime::sampling::{Sampler, SamplingParams};
use runtime::{Backend, SeqChunk, StepBatch, Want};

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let Some(model) = a.first() else {
        eprintln!("usage: batch_step MODEL [THREADS] [NSEQ] [PROMPT] [GEN]");
        std::process::exit(2);
    };
    let num = |i: usize, d: usize| a.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (threads, nseq, prompt, gen) = (num(1, 2), num(2, 64), num(3, 48), num(4, 32));
    let opts = CpuOptions {
        threads: Some(threads),
        ctx_size: prompt + gen + 1,
        max_seqs: nseq + 1,
        max_batch_tokens: 512,
        ..CpuOptions::default()
    };
    let mut be = match CpuBackend::load(model, &opts) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    let n_vocab = be.config().n_vocab as u32;
    let tokens = |seq: usize, n: usize| -> Vec<u32> {
        (0..n as u32)
            .map(|i| (i.wrapping_add(seq as u32 * 977).wrapping_mul(2654435761) >> 7) % n_vocab)
            .collect()
    };
    // Prefill every sequence (as many per step as the batch holds).
    let per_step = (512 / prompt.max(1)).max(1);
    let t = Instant::now();
    for first in (0..nseq).step_by(per_step) {
        let chunks = (first..(first + per_step).min(nseq))
            .map(|s| SeqChunk {
                prompt_len: None,
                seq: s as u64,
                tokens: tokens(s, prompt),
                start_pos: 0,
                want: Want::Last,
            })
            .collect();
        if let Err(e) = be.step(&StepBatch { chunks }) {
            eprintln!("prefill: {e}");
            std::process::exit(1);
        }
    }
    let pp = t.elapsed();
    let params = SamplingParams {
        seed: Some(1),
        temperature: 0.7,
        ..SamplingParams::default()
    };
    let mut samplers: Vec<Sampler> = (0..nseq)
        .map(|_| Sampler::new(&params).expect("valid parameters"))
        .collect();
    let mut next: Vec<u32> = (0..nseq).map(|s| tokens(s, prompt + 1)[prompt]).collect();
    let hist: Vec<u32> = tokens(0, prompt);
    let (mut t_step, mut t_sample) = (Duration::ZERO, Duration::ZERO);
    let (mut c_step, mut c_one) = (Duration::ZERO, Duration::ZERO);
    for g in 0..gen {
        let chunks = (0..nseq)
            .map(|s| SeqChunk {
                prompt_len: None,
                seq: s as u64,
                tokens: vec![next[s]],
                start_pos: prompt + g,
                want: Want::Last,
            })
            .collect();
        let t = Instant::now();
        let c = cpu_time();
        let mut out = match be.step(&StepBatch { chunks }) {
            Ok(o) => o,
            Err(e) => {
                eprintln!("decode: {e}");
                std::process::exit(1);
            }
        };
        t_step += t.elapsed();
        c_step += cpu_time() - c;
        let t = Instant::now();
        let nv = out.n_vocab;
        for (s, row) in out.logits.chunks_exact_mut(nv).enumerate() {
            next[s] = samplers[s].sample(row, &hist);
        }
        t_sample += t.elapsed();
    }
    // One sequence alone at the same positions.
    let single_seq = nseq as u64;
    let mut one = Duration::ZERO;
    let t0 = Instant::now();
    let _ = be.step(&StepBatch {
        chunks: vec![SeqChunk {
            prompt_len: None,
            seq: single_seq,
            tokens: tokens(0, prompt),
            start_pos: 0,
            want: Want::Last,
        }],
    });
    let _ = t0;
    for g in 0..gen {
        let t = Instant::now();
        let c = cpu_time();
        if let Err(e) = be.step(&StepBatch {
            chunks: vec![SeqChunk {
                prompt_len: None,
                seq: single_seq,
                tokens: vec![next[0]],
                start_pos: prompt + g,
                want: Want::Last,
            }],
        }) {
            eprintln!("single: {e}");
            std::process::exit(1);
        }
        one += t.elapsed();
        c_one += cpu_time() - c;
    }
    let ms = |d: Duration, n: usize| d.as_secs_f64() * 1e3 / n as f64;
    let batch_tok_s = (nseq * gen) as f64 / (t_step + t_sample).as_secs_f64();
    let single_tok_s = gen as f64 / one.as_secs_f64();
    println!(
        "prefill {nseq} x {prompt}: {:.1} tok/s; decode step of {nseq}: {:.2} ms + sampling {:.2} ms \
         = {batch_tok_s:.1} tok/s; one sequence: {:.2} ms = {single_tok_s:.1} tok/s; ratio {:.2}x",
        (nseq * prompt) as f64 / pp.as_secs_f64(),
        ms(t_step, gen),
        ms(t_sample, gen),
        ms(one, gen),
        batch_tok_s / single_tok_s
    );
    if threads == 1 {
        println!(
            "CPU time per token: batched {:.3} ms, alone {:.3} ms, ratio {:.2}x",
            ms(c_step, gen * nseq),
            ms(c_one, gen),
            ms(c_one, gen) / ms(c_step, gen * nseq)
        );
    }
}
