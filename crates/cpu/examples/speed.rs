//! Quick engine-only timing for iterating on kernels: prompt processing of `PP` tokens in one
//! batch, then `TG` greedy tokens one at a time. The side-by-side benchmark against llama.cpp is
//! `bench/compare_cpu.py`; this skips the CLI and the tokenizer.
//!
//! Usage: speed MODEL [THREADS] [PP] [TG]
use std::time::Instant;

use cpu::{CpuBackend, CpuOptions};
use runtime::{Backend, SeqChunk, StepBatch, Want};

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let model = a.first().expect("usage: speed MODEL [THREADS] [PP] [TG]");
    let num = |i: usize, d: usize| a.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (threads, pp, tg) = (num(1, 2), num(2, 512), num(3, 128));
    let opts = CpuOptions {
        threads: Some(threads),
        ctx_size: pp + tg,
        max_batch_tokens: pp.max(1),
        ..CpuOptions::default()
    };
    let mut be = CpuBackend::load(model, &opts).expect("load");
    let n_vocab = be.config().n_vocab as u32;
    // A fixed pseudo-random prompt (the timing does not depend on the text).
    let prompt: Vec<u32> = (0..pp as u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 7) % n_vocab)
        .collect();
    for rep in 0..2 {
        be.release(0);
        let t = Instant::now();
        let out = be
            .step(&StepBatch {
                chunks: vec![SeqChunk {
                    prompt_len: None,
                    seq: 0,
                    tokens: prompt.clone(),
                    start_pos: 0,
                    want: Want::Last,
                }],
            })
            .expect("prompt");
        let pp_s = t.elapsed().as_secs_f64();
        let mut next = argmax(out.row(0).expect("row"));
        let t = Instant::now();
        for i in 0..tg {
            let out = be
                .step(&StepBatch {
                    chunks: vec![SeqChunk {
                        prompt_len: None,
                        seq: 0,
                        tokens: vec![next],
                        start_pos: pp + i,
                        want: Want::Last,
                    }],
                })
                .expect("decode");
            next = argmax(out.row(0).expect("row"));
        }
        let tg_s = t.elapsed().as_secs_f64();
        println!(
            "rep {rep}: pp{pp} {:.1} tok/s, tg{tg} {:.2} tok/s",
            pp as f64 / pp_s,
            tg as f64 / tg_s
        );
    }
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}
