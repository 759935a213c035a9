//! Speed of the CUDA backend on one model: prompt processing (pp), batch-1 generation (tg) at
//! empty and deep context, aggregate generation of parallel sequences, and GPU energy per token.
//! Prints one line per measurement, the same workloads llama-bench and llama-batched-bench run.
//!
//! `cargo run --release -p cuda --example cuda_bench -- MODEL.gguf [--depth 4096] [--par 4,16,64]`

use std::time::Instant;

use cuda::{CudaBackend, CudaOptions, PowerMeter};
use rand::{Rng, SeedableRng};
use runtime::{Backend, SeqChunk, StepBatch, Want};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(path) = args.get(1) else {
        eprintln!("usage: cuda_bench MODEL.gguf [--depth N] [--par a,b,c] [--no-graphs]");
        std::process::exit(2);
    };
    let get = |k: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1))
    };
    let depth: usize = get("--depth").and_then(|s| s.parse().ok()).unwrap_or(4096);
    let par: Vec<usize> = get("--par")
        .map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| vec![4, 16, 64]);
    let graphs = !args.iter().any(|a| a == "--no-graphs");
    if let Err(e) = cuda::available() {
        eprintln!("no GPU: {e}");
        std::process::exit(1);
    }
    let power = PowerMeter::open(0);
    if let Err(e) = &power {
        println!("power: n/a ({e})");
    }
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(1);

    let t = Instant::now();
    let opts = CudaOptions {
        ctx_size: depth + 1024,
        max_seqs: 2,
        max_batch_tokens: 512,
        graphs,
        ..Default::default()
    };
    let mut b = CudaBackend::load(path, &opts).unwrap_or_else(|e| panic!("{e}"));
    println!(
        "loaded {} on {} in {:.2} s (kernels {} in {:.2} s)",
        path,
        b.info().device,
        t.elapsed().as_secs_f64(),
        if b.gpu().kernels_cached {
            "from cache"
        } else {
            "compiled"
        },
        b.gpu().kernel_load_s
    );
    let nv = b.config().n_vocab as u32;
    let mut toks = |n: usize| -> Vec<u32> { (0..n).map(|_| r.gen_range(0..nv)).collect() };
    let mut seq = 100u64;

    // pp512: one 512-token prompt step including the copy of its logits row (time to first token).
    let mut pp = Vec::new();
    for rep in 0..6 {
        seq += 1;
        let batch = StepBatch {
            chunks: vec![SeqChunk {
                seq,
                tokens: toks(512),
                start_pos: 0,
                want: Want::Last,
            }],
        };
        let t = Instant::now();
        let out = b.step(&batch).unwrap_or_else(|e| panic!("{e}"));
        let dt = t.elapsed().as_secs_f64();
        assert_eq!(out.n_rows(), 1);
        b.release(seq);
        if rep > 0 {
            pp.push(dt);
        }
    }
    let ppm = median(pp);
    println!("pp512: {:.2} ms  ({:.0} tok/s)", ppm * 1e3, 512.0 / ppm);

    // tg128 at depth 0 and `depth`: greedy decode, argmax on the GPU.
    for d in [0usize, depth] {
        let mut runs = Vec::new();
        let mut joules = Vec::new();
        for rep in 0..4 {
            seq += 1;
            let mut pos = 0;
            let mut last = toks(1)[0];
            while pos < d {
                let n = (d - pos).min(512);
                let batch = StepBatch {
                    chunks: vec![SeqChunk {
                        seq,
                        tokens: toks(n),
                        start_pos: pos,
                        want: Want::Last,
                    }],
                };
                last = b.step_greedy(&batch).unwrap_or_else(|e| panic!("{e}"))[0];
                pos += n;
            }
            b.synchronize().unwrap_or_else(|e| panic!("{e}"));
            let e0 = power.as_ref().ok().and_then(|p| p.energy_j().ok());
            let t = Instant::now();
            for _ in 0..128 {
                let batch = StepBatch {
                    chunks: vec![SeqChunk {
                        seq,
                        tokens: vec![last],
                        start_pos: pos,
                        want: Want::Last,
                    }],
                };
                last = b.step_greedy(&batch).unwrap_or_else(|e| panic!("{e}"))[0];
                pos += 1;
            }
            let dt = t.elapsed().as_secs_f64();
            let e1 = power.as_ref().ok().and_then(|p| p.energy_j().ok());
            b.release(seq);
            if rep > 0 {
                runs.push(dt);
                if let (Some(a), Some(c)) = (e0, e1) {
                    joules.push(c - a);
                }
            }
        }
        let m = median(runs);
        let jt = if joules.is_empty() {
            "n/a".to_string()
        } else {
            format!("{:.3} J/token", median(joules) / 128.0)
        };
        println!(
            "tg128 @ depth {d}: {:.3} ms/token  ({:.0} tok/s), GPU energy {jt}",
            m * 1e3 / 128.0,
            128.0 / m
        );
    }
    println!(
        "steps: {} from graphs, {} eager; graph failure: {:?}",
        b.stats.graph_steps,
        b.stats.eager_steps,
        b.graph_failure()
    );
    drop(b);

    // Aggregate generation: P sequences with 512-token prompts, 128 tokens each, decoded together.
    let pmax = par.iter().copied().max().unwrap_or(1);
    if pmax > 0 {
        let opts = CudaOptions {
            ctx_size: 512 + 160,
            max_seqs: pmax,
            max_batch_tokens: 512,
            graphs,
            ..Default::default()
        };
        let mut b = CudaBackend::load(path, &opts).unwrap_or_else(|e| panic!("{e}"));
        for &p in &par {
            let mut last = Vec::new();
            for s in 0..p {
                let batch = StepBatch {
                    chunks: vec![SeqChunk {
                        seq: s as u64,
                        tokens: toks(512),
                        start_pos: 0,
                        want: Want::Last,
                    }],
                };
                last.push(b.step_greedy(&batch).unwrap_or_else(|e| panic!("{e}"))[0]);
            }
            b.synchronize().unwrap_or_else(|e| panic!("{e}"));
            let t = Instant::now();
            for i in 0..128 {
                let batch = StepBatch {
                    chunks: (0..p)
                        .map(|s| SeqChunk {
                            seq: s as u64,
                            tokens: vec![last[s]],
                            start_pos: 512 + i,
                            want: Want::Last,
                        })
                        .collect(),
                };
                last = b.step_greedy(&batch).unwrap_or_else(|e| panic!("{e}"));
            }
            let dt = t.elapsed().as_secs_f64();
            for s in 0..p {
                b.release(s as u64);
            }
            println!(
                "aggregate tg128 x {p} sequences: {:.0} tok/s ({:.3} ms/step)",
                (p * 128) as f64 / dt,
                dt * 1e3 / 128.0
            );
        }
    }
}
