//! Speed of the CUDA backend on one model: prompt processing (pp), batch-1 generation (tg) at
//! empty and deep context, aggregate generation of parallel sequences, and GPU energy per token.
//! Prints one line per measurement, the same workloads llama-bench and llama-batched-bench run.
//!
//! `cargo run --release -p cuda --example cuda_bench -- MODEL.gguf [--depth 4096] [--par 4,16,64]`

use std::time::Instant;

use cuda::{
    CudaBackend, CudaOptions, DecodeV10, KvPf, PowerMeter, SideCfg, SIDE_ONE, SIDE_ONE_NEXT,
    SIDE_WIDE,
};
use rand::{Rng, SeedableRng};
use runtime::{Backend, SeqChunk, StepBatch, Want};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    v[v.len() / 2]
}

/// Median time of `reps` prompt steps of `n` tokens (after one warm-up), each in a fresh sequence.
fn prompt_ms(
    b: &mut CudaBackend,
    r: &mut rand_chacha::ChaCha8Rng,
    n: usize,
    reps: usize,
    seq: &mut u64,
) -> f64 {
    let nv = b.config().n_vocab as u32;
    let mut v = Vec::new();
    for rep in 0..=reps {
        *seq += 1;
        let batch = StepBatch {
            chunks: vec![SeqChunk {
                prompt_len: None,
                seq: *seq,
                tokens: (0..n).map(|_| r.gen_range(0..nv)).collect(),
                start_pos: 0,
                want: Want::Last,
            }],
        };
        let t = Instant::now();
        let out = b.step(&batch).unwrap_or_else(|e| panic!("{e}"));
        let dt = t.elapsed().as_secs_f64();
        assert_eq!(out.n_rows(), 1);
        b.release(*seq);
        if rep > 0 {
            v.push(dt);
        }
    }
    median(v) * 1e3
}

/// One A/B row per depth: `a/b LABEL: tg128 @ depth D: X ms/token (Y tok/s)` (median of 3
/// after a warm-up).
fn ab_tg(
    b: &mut CudaBackend,
    power: &Result<PowerMeter, String>,
    toks: &mut dyn FnMut(usize) -> Vec<u32>,
    seq: &mut u64,
    depths: &[usize],
    label: &str,
) {
    for &d in depths {
        let (m, _) = tg128(b, power, toks, seq, d, 4);
        println!(
            "a/b {label}: tg128 @ depth {d}: {:.3} ms/token ({:.0} tok/s)",
            m * 1e3 / 128.0,
            128.0 / m
        );
    }
}

/// The per-class one-token product times ([`CudaBackend::bench_matvecs`]) as A/B rows, the
/// classes named in `only` (all when empty).
fn ab_kernels(b: &mut CudaBackend, label: &str, only: &[&str]) {
    match b.bench_matvecs(20) {
        Ok(rows) => {
            for (name, n, us, bytes) in rows {
                if only.is_empty() || only.contains(&name.as_str()) {
                    println!(
                        "a/b {label}: kernel {name:<18} x{n:<3} {us:8.2} us/launch {:7.0} GB/s",
                        bytes / us / 1e3
                    );
                }
            }
        }
        Err(e) => println!("kernel bench failed: {e}"),
    }
}

/// 128 greedy decode steps after a `d`-token prompt, `reps` times (the first a warm-up):
/// median seconds and GPU energy per token.
fn tg128(
    b: &mut CudaBackend,
    power: &Result<PowerMeter, String>,
    toks: &mut dyn FnMut(usize) -> Vec<u32>,
    seq: &mut u64,
    d: usize,
    reps: usize,
) -> (f64, String) {
    tg128_by(b, power, toks, seq, d, reps, pick_on_gpu)
}

/// The greedy pick on the GPU: one id comes back ([`CudaBackend::step_greedy`]).
fn pick_on_gpu(b: &mut CudaBackend, batch: &StepBatch) -> u32 {
    b.step_greedy(batch).unwrap_or_else(|e| panic!("{e}"))[0]
}

/// The greedy pick on the host from the copied logits row (what the runtime's actor did for
/// greedy requests before session 18): `Backend::step`, then the lowest index of the largest.
fn pick_on_host(b: &mut CudaBackend, batch: &StepBatch) -> u32 {
    let out = b.step(batch).unwrap_or_else(|e| panic!("{e}"));
    runtime::sampling::argmax(out.row(0).unwrap_or(&[]))
}

/// [`tg128`] as 128 / `k` chains of `k` greedy steps queued back to back
/// ([`CudaBackend::decode_greedy`]: no host round trip inside a chain).
fn tg128_chain(
    b: &mut CudaBackend,
    toks: &mut dyn FnMut(usize) -> Vec<u32>,
    seq: &mut u64,
    d: usize,
    reps: usize,
    k: usize,
) -> f64 {
    let mut runs = Vec::new();
    for rep in 0..reps {
        *seq += 1;
        let (mut pos, mut last) = (d, prefill(b, toks, *seq, d));
        b.synchronize().unwrap_or_else(|e| panic!("{e}"));
        let t = Instant::now();
        while pos < d + 128 {
            let steps = k.min(d + 128 - pos);
            let batch = StepBatch {
                chunks: vec![SeqChunk {
                    prompt_len: None,
                    seq: *seq,
                    tokens: vec![last],
                    start_pos: pos,
                    want: Want::Last,
                }],
            };
            let out = b
                .decode_greedy(&batch, steps)
                .unwrap_or_else(|e| panic!("{e}"));
            last = out.last().map_or(0, |r| r[0]);
            pos += steps;
        }
        let dt = t.elapsed().as_secs_f64();
        b.release(*seq);
        if rep > 0 {
            runs.push(dt);
        }
    }
    median(runs)
}

/// [`tg128`] with the steps' token picked by `pick`.
fn tg128_by(
    b: &mut CudaBackend,
    power: &Result<PowerMeter, String>,
    toks: &mut dyn FnMut(usize) -> Vec<u32>,
    seq: &mut u64,
    d: usize,
    reps: usize,
    pick: fn(&mut CudaBackend, &StepBatch) -> u32,
) -> (f64, String) {
    let mut runs = Vec::new();
    let mut joules = Vec::new();
    for rep in 0..reps {
        *seq += 1;
        let (mut pos, mut last) = (d, prefill(b, toks, *seq, d));
        b.synchronize().unwrap_or_else(|e| panic!("{e}"));
        let e0 = power.as_ref().ok().and_then(|p| p.energy_j().ok());
        let t = Instant::now();
        for _ in 0..128 {
            let batch = StepBatch {
                chunks: vec![SeqChunk {
                    prompt_len: None,
                    seq: *seq,
                    tokens: vec![last],
                    start_pos: pos,
                    want: Want::Last,
                }],
            };
            last = pick(b, &batch);
            pos += 1;
        }
        let dt = t.elapsed().as_secs_f64();
        let e1 = power.as_ref().ok().and_then(|p| p.energy_j().ok());
        b.release(*seq);
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
    (m, jt)
}

/// `--ncu N` (v11): the one-token step as Nsight Compute sees it. At depth 0 and at `depth`:
/// a prompt to that depth, 32 greedy steps (the graph captured and warm), 64 timed steps, then
/// `N` steps between `cuProfilerStart` and `cuProfilerStop`, so `ncu --profile-from-start off`
/// profiles the replayed graph of those steps alone (per node with `--graph-profiling node`).
/// Sequence `seq`'s first `d` positions from random tokens in chunks of up to 512; the greedy
/// next token (a random one when `d` is 0).
fn prefill(
    b: &mut CudaBackend,
    toks: &mut dyn FnMut(usize) -> Vec<u32>,
    seq: u64,
    d: usize,
) -> u32 {
    let mut pos = 0;
    let mut last = toks(1)[0];
    while pos < d {
        let n = (d - pos).min(512);
        let batch = StepBatch {
            chunks: vec![SeqChunk {
                prompt_len: None,
                seq,
                tokens: toks(n),
                start_pos: pos,
                want: Want::Last,
            }],
        };
        last = b.step_greedy(&batch).unwrap_or_else(|e| panic!("{e}"))[0];
        pos += n;
    }
    last
}

fn ncu_steps(
    b: &mut CudaBackend,
    toks: &mut dyn FnMut(usize) -> Vec<u32>,
    seq: &mut u64,
    depth: usize,
    steps: usize,
) {
    for d in [0usize, depth] {
        *seq += 1;
        let (mut pos, mut last) = (d, prefill(b, toks, *seq, d));
        let one = |b: &mut CudaBackend, pos: &mut usize, last: &mut u32| {
            let batch = StepBatch {
                chunks: vec![SeqChunk {
                    prompt_len: None,
                    seq: *seq,
                    tokens: vec![*last],
                    start_pos: *pos,
                    want: Want::Last,
                }],
            };
            *last = b.step_greedy(&batch).unwrap_or_else(|e| panic!("{e}"))[0];
            *pos += 1;
        };
        for _ in 0..32 {
            one(b, &mut pos, &mut last);
        }
        b.synchronize().unwrap_or_else(|e| panic!("{e}"));
        let t = Instant::now();
        for _ in 0..64 {
            one(b, &mut pos, &mut last);
        }
        b.synchronize().unwrap_or_else(|e| panic!("{e}"));
        let ms = t.elapsed().as_secs_f64() * 1e3 / 64.0;
        println!("ncu: depth {d}: {ms:.3} ms/token over 64 steps before the profiled ones");
        // SAFETY: plain driver calls on this thread's current context (the backend's).
        unsafe { cudarc::driver::sys::cuProfilerStart() }
            .result()
            .unwrap_or_else(|e| panic!("cuProfilerStart: {e:?}"));
        for _ in 0..steps {
            one(b, &mut pos, &mut last);
        }
        b.synchronize().unwrap_or_else(|e| panic!("{e}"));
        // SAFETY: as above.
        unsafe { cudarc::driver::sys::cuProfilerStop() }
            .result()
            .unwrap_or_else(|e| panic!("cuProfilerStop: {e:?}"));
        println!(
            "ncu: depth {d}: {steps} profiled steps from position {}",
            pos - steps
        );
        b.release(*seq);
    }
}

/// Run one step with a timing event after every kernel and print where its time goes.
fn report_profile(b: &mut CudaBackend, what: &str, batch: StepBatch) {
    b.gpu().profile_start().unwrap_or_else(|e| panic!("{e}"));
    b.step_greedy(&batch).unwrap_or_else(|e| panic!("{e}"));
    let p = b.gpu().profile_stop().unwrap_or_else(|e| panic!("{e}"));
    let total: f64 = p.iter().map(|x| x.1).sum();
    let mut by: Vec<(String, usize, f64)> = Vec::new();
    for (name, ms) in p {
        match by.iter_mut().find(|x| x.0 == name) {
            Some(x) => {
                x.1 += 1;
                x.2 += ms;
            }
            None => by.push((name, 1, ms)),
        }
    }
    by.sort_by(|a, b| b.2.partial_cmp(&a.2).unwrap_or(std::cmp::Ordering::Equal));
    println!("profile {what}: {total:.3} ms on the GPU (eager launches)");
    for (name, n, ms) in by.iter().take(12) {
        println!(
            "  {name:<28} x{n:<4} {ms:8.3} ms  {:5.1}%",
            100.0 * ms / total
        );
    }
}

/// Print per-kernel times of a 512-token prompt step and of a decode step at context `depth`.
fn profile(b: &mut CudaBackend, r: &mut rand_chacha::ChaCha8Rng, depth: usize, seq: &mut u64) {
    let nv = b.config().n_vocab as u32;
    *seq += 1;
    let s = *seq;
    let mut toks = |n: usize| -> Vec<u32> { (0..n).map(|_| r.gen_range(0..nv)).collect() };
    let mut pos = 0;
    let report = report_profile;
    while pos < depth {
        let n = (depth - pos).min(512);
        let batch = StepBatch {
            chunks: vec![SeqChunk {
                prompt_len: None,
                seq: s,
                tokens: toks(n),
                start_pos: pos,
                want: Want::Last,
            }],
        };
        if pos == 0 {
            report(b, "prompt step (512 tokens)", batch);
        } else {
            b.step_greedy(&batch).unwrap_or_else(|e| panic!("{e}"));
        }
        pos += n;
    }
    let batch = StepBatch {
        chunks: vec![SeqChunk {
            prompt_len: None,
            seq: s,
            tokens: toks(1),
            start_pos: pos,
            want: Want::Last,
        }],
    };
    // Graphs are kept only for decode steps; this one must run eagerly to be timed per kernel.
    b.set_graphs(false);
    report(b, &format!("decode step at depth {pos}"), batch);
    b.set_graphs(true);
    b.release(s);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(path) = args.get(1) else {
        eprintln!("usage: cuda_bench MODEL.gguf [--depth N] [--par a,b,c] [--no-graphs] [--quick] [--profile] [--profile-only] [--ab] [--ab-prep] [--ab-one] [--ab-v9] [--ab-v10] [--ab-v11] [--ab-skip] [--ncu N] [--ab-mmq] [--ab-mmf] [--ab-mmk] [--ab-lt] [--ab-merge] [--ab-side] [--side-cfgs K:B:T:C[:MiB];...] [--ab-wp] [--roofline] [--ab-ss] [--ab-ss-mq] [--ab-mvr] [--ab-fq] [--ab-adapt] [--ab-mvqp] [--ab-wave] [--ab-host] [--ab-s18] [--ab-downss] [--ab-mvsm] [--ab-q6u] [--ab-mvsm-prep] [--ab-downcl] [--ab-tiles] [--ab-mvp] [--ab-mvqe] [--ab-mvps] [--ab-mvpq] [--ab-mvpd] [--launches] [--ab-hop] [--ab-small] [--ab-rms1s] [--ab-kvpf]");
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
    // --quick: pp512, tg128 and the aggregate only (no per-kernel profile, no integer path).
    let quick = args.iter().any(|a| a == "--quick");
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
    if let Some(n) = get("--ncu").and_then(|s| s.parse::<usize>().ok()) {
        ncu_steps(&mut b, &mut toks, &mut seq, depth, n);
        return;
    }

    // --roofline (session 15): the one-token product classes next to chains of pure streaming
    // reads of the same bytes per launch (probe.cu), then exit.
    if args.iter().any(|a| a == "--roofline") {
        let rows = b.bench_matvecs(20).unwrap_or_else(|e| panic!("{e}"));
        let mut sizes = Vec::new();
        for (name, n, us, bytes) in &rows {
            println!(
                "roofline kernel {name:<18} x{n:<3} {us:8.2} us/launch {:8.2} MB {:7.0} GB/s",
                bytes / 1e6,
                bytes / us / 1e3
            );
            sizes.push(*bytes as usize);
        }
        for rep in 0..2 {
            for (probe, pf, bytes, n, us) in b
                .bench_roofline(20, &sizes)
                .unwrap_or_else(|e| panic!("{e}"))
            {
                println!(
                    "roofline probe {rep} {probe:<9} prefetch={} x{n:<3} {us:8.2} us/launch {:8.2} MB {:7.0} GB/s",
                    pf as u8,
                    bytes as f64 / 1e6,
                    bytes as f64 / us / 1e3
                );
            }
        }
        return;
    }

    // --profile-only: the kernels of one prompt step and one decode step at `depth`, timed one
    // by one, and nothing else (exact mode's breakdown fits a short call).
    if args.iter().any(|a| a == "--profile-only") {
        profile(
            &mut b,
            &mut rand_chacha::ChaCha8Rng::seed_from_u64(3),
            depth,
            &mut seq,
        );
        return;
    }

    // pp512: one 512-token prompt step including the copy of its logits row (time to first token).
    let mut pp = Vec::new();
    for rep in 0..6 {
        seq += 1;
        let batch = StepBatch {
            chunks: vec![SeqChunk {
                prompt_len: None,
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
        let (m, jt) = tg128(&mut b, &power, &mut toks, &mut seq, d, 4);
        println!(
            "tg128 @ depth {d}: {:.3} ms/token  ({:.0} tok/s), GPU energy {jt}",
            m * 1e3 / 128.0,
            128.0 / m
        );
    }
    // --ab-host (session 18): what the host's part of a step costs. The default (one metadata
    // copy, the pick on the GPU) against six metadata copies and against the pick on the host
    // from the copied logits row, alternating; then the same graph replayed back to back with
    // its argmax and one wait at the end (the step's GPU work alone).
    if args.iter().any(|a| a == "--ab-host") {
        for round in 0..3 {
            for d in [0usize, depth] {
                for (label, copies, pick) in [
                    (
                        "meta=1 pick=gpu",
                        false,
                        pick_on_gpu as fn(&mut CudaBackend, &StepBatch) -> u32,
                    ),
                    ("meta=6 pick=gpu", true, pick_on_gpu),
                    ("meta=1 pick=host", false, pick_on_host),
                ] {
                    b.set_meta_copies(copies);
                    let (m, _) = tg128_by(&mut b, &power, &mut toks, &mut seq, d, 3, pick);
                    println!(
                        "a/b host {label}: tg128 @ depth {d}: {:.3} ms/token ({:.0} tok/s)",
                        m * 1e3 / 128.0,
                        128.0 / m
                    );
                }
                b.set_meta_copies(false);
                for k in [8usize, 32] {
                    let m = tg128_chain(&mut b, &mut toks, &mut seq, d, 3, k);
                    println!(
                        "a/b host chain={k}: tg128 @ depth {d}: {:.3} ms/token ({:.0} tok/s)",
                        m * 1e3 / 128.0,
                        128.0 / m
                    );
                }
                // The GPU work alone: a step at depth d + 64 (the middle of tg128's range).
                seq += 1;
                let mut last = prefill(&mut b, &mut toks, seq, d + 64);
                for k in 0..2 {
                    let batch = StepBatch {
                        chunks: vec![SeqChunk {
                            prompt_len: None,
                            seq,
                            tokens: vec![last],
                            start_pos: d + 64 + k,
                            want: Want::Last,
                        }],
                    };
                    last = pick_on_gpu(&mut b, &batch);
                }
                let per = b.replay_last(128).unwrap_or_else(|e| panic!("{e}"));
                b.release(seq);
                println!(
                    "a/b host replay-only {round}: tg @ depth {}: {:.3} ms/step ({:.0} steps/s)",
                    d + 64,
                    per * 1e3,
                    1.0 / per
                );
            }
        }
    }
    // Per-kernel bandwidth of the one-token products, and (--ab) the v6 decode kernels and
    // programmatic dependent launch each switched off, same binary, same file.
    let combos: &[(bool, bool)] = if args.iter().any(|a| a == "--ab") {
        &[(true, true), (false, true), (true, false), (false, false)]
    } else {
        &[(true, true)]
    };
    let (mvr0, pdl0) = (b.gpu().mvr.get(), b.gpu().pdl.get());
    for &(mvr, pdl) in combos {
        b.set_kernels(mvr && mvr0, pdl && pdl0);
        let label = format!("mvr={} pdl={}", mvr && mvr0, pdl && pdl0);
        if combos.len() > 1 {
            for d in [0usize, depth] {
                let (m, _) = tg128(&mut b, &power, &mut toks, &mut seq, d, 3);
                println!(
                    "a/b {label}: tg128 @ depth {d}: {:.3} ms/token ({:.0} tok/s)",
                    m * 1e3 / 128.0,
                    128.0 / m
                );
            }
        }
        match b.bench_matvecs(20) {
            Ok(rows) => {
                for (name, n, us, bytes) in rows {
                    println!(
                        "kernel {label}: {name:<18} x{n:<3} {us:8.2} us/launch {:8.2} MB {:7.0} GB/s",
                        bytes / 1e6,
                        bytes / us / 1e3
                    );
                }
            }
            Err(e) => println!("kernel bench failed: {e}"),
        }
    }
    b.set_kernels(mvr0, pdl0);
    // --ab-prep: v7's one-token fusions (products preparing their own activations, attention
    // merging its own slices) on with several slice lengths and block counts, and off.
    if args.iter().any(|a| a == "--ab-prep") {
        let g = b.gpu();
        let (p0, m0, s0, k0) = (
            g.fuse_prep.get(),
            g.fuse_merge.get(),
            g.dec_slice.get(),
            g.prep_blocks.get(),
        );
        let combos = [
            (p0, m0, s0, k0),
            (p0, false, s0, k0),
            (p0, true, 96, k0),
            (p0, true, 192, k0),
            (!p0, m0, s0, k0),
            (p0, m0, s0, k0),
        ];
        for (prep, merge, slice, blocks) in combos {
            b.set_decode_fusion(prep, merge, slice, blocks);
            for d in [0usize, depth] {
                let (m, _) = tg128(&mut b, &power, &mut toks, &mut seq, d, 3);
                println!(
                    "a/b prep={prep} merge={merge} slice={slice} blocks/SM={blocks}: tg128 @ \
                     depth {d}: {:.3} ms/token ({:.0} tok/s)",
                    m * 1e3 / 128.0,
                    128.0 / m
                );
            }
        }
        b.set_decode_fusion(p0, m0, s0, k0);
        // With the preparing products: the down projection on the block-wide kernel that
        // quantizes its own activation (mvw) against quantize_act + the block-per-row kernel.
        let w0 = b.gpu().wide.get();
        b.gpu().wide.set(!w0);
        b.set_decode_fusion(true, m0, s0, k0);
        for d in [0usize, depth] {
            let (m, _) = tg128(&mut b, &power, &mut toks, &mut seq, d, 3);
            println!(
                "a/b prep=true wide={}: tg128 @ depth {d}: {:.3} ms/token ({:.0} tok/s)",
                !w0,
                m * 1e3 / 128.0,
                128.0 / m
            );
        }
        b.gpu().wide.set(w0);
        b.set_decode_fusion(p0, m0, s0, k0);
    }
    // --ab-one: v8's one-token attention (pipelined split kernel over B blocks per SM, early
    // copies, attn_merge) against v7's one-tile kernel + attn_combine and each piece alone.
    if args.iter().any(|a| a == "--ab-one") {
        let (b0, e0, m0) = b.one_attn();
        let combos = [
            (b0, e0, m0),
            (0, e0, false),
            (0, e0, true),
            (b0, !e0, m0),
            (b0, e0, !m0),
            (1, e0, m0),
            (4, e0, m0),
            (b0, e0, m0),
        ];
        for (blocks, early, merge) in combos {
            b.set_one_attn(blocks, early, merge);
            for d in [0usize, depth] {
                let (m, _) = tg128(&mut b, &power, &mut toks, &mut seq, d, 4);
                println!(
                    "a/b one-token attention blocks/SM={blocks} early={early} merge={merge}: \
                     tg128 @ depth {d}: {:.3} ms/token ({:.0} tok/s)",
                    m * 1e3 / 128.0,
                    128.0 / m
                );
            }
        }
        b.set_one_attn(b0, e0, m0);
    }
    // --ab-v9: v9's one-token changes (merge that quantizes O's activation, mixed-type Q/K/V
    // launch), each alone and both, alternating, in one process.
    if args.iter().any(|a| a == "--ab-v9") {
        let d0 = b.decode_v9();
        let combos = [
            d0,
            (false, false),
            (false, true),
            (true, true),
            (true, false),
            d0,
            (false, false),
        ];
        for (merge_q, mixed) in combos {
            b.set_decode_v9(merge_q, mixed);
            for d in [0usize, depth] {
                let (m, _) = tg128(&mut b, &power, &mut toks, &mut seq, d, 4);
                println!(
                    "a/b v9 merge_q={merge_q} qkv_mixed={mixed}: tg128 @ \
                     depth {d}: {:.3} ms/token ({:.0} tok/s)",
                    m * 1e3 / 128.0,
                    128.0 / m
                );
            }
        }
        b.set_decode_v9(d0.0, d0.1);
    }
    // --ab-v10: v10's one-token product variants (see DecodeV10), alternating, in one
    // process, with the per-class product times of each.
    if args.iter().any(|a| a == "--ab-v10") {
        let d0 = b.decode_v10();
        let off = DecodeV10::default();
        let lb4 = DecodeV10 {
            mvr_lb4: true,
            ..off
        };
        let pf = DecodeV10 {
            mvq_pf: true,
            ..off
        };
        let both = DecodeV10 {
            mvr_lb4: true,
            mvq_pf: true,
            ..off
        };
        let wave4 = DecodeV10 { wave: true, ..lb4 };
        let combos = [d0, off, lb4, pf, both, wave4, off, both, d0];
        for c in combos {
            b.set_decode_v10(c);
            let label = format!(
                "wave={} q6_half={} mvd={} mvr4={} mvq_pf={}",
                c.wave, c.q6_half, c.warp_rows, c.mvr_lb4, c.mvq_pf
            );
            for d in [0usize, depth] {
                let (m, _) = tg128(&mut b, &power, &mut toks, &mut seq, d, 4);
                println!(
                    "a/b v10 {label}: tg128 @ depth {d}: {:.3} ms/token ({:.0} tok/s)",
                    m * 1e3 / 128.0,
                    128.0 / m
                );
            }
            match b.bench_matvecs(20) {
                Ok(rows) => {
                    for (name, n, us, bytes) in rows {
                        println!(
                            "a/b v10 {label}: kernel {name:<18} x{n:<3} {us:8.2} us/launch \
                             {:7.0} GB/s",
                            bytes / us / 1e3
                        );
                    }
                }
                Err(e) => println!("kernel bench failed: {e}"),
            }
        }
        b.set_decode_v10(d0);
    }
    // --ab-v11: v11's one-token choices (RMSNorm a warp per group, the many-block argmax),
    // each alone, both and neither, alternating, in one process.
    if args.iter().any(|a| a == "--ab-v11") {
        let d0 = b.decode_v11();
        let combos = [
            d0,
            (false, false),
            (true, false),
            (false, true),
            (true, true),
            (false, false),
            (true, true),
            (false, false),
            d0,
        ];
        for (rms1, amb) in combos {
            b.set_decode_v11(rms1, amb);
            for d in [0usize, depth] {
                let (m, _) = tg128(&mut b, &power, &mut toks, &mut seq, d, 4);
                println!(
                    "a/b v11 rms1={rms1} argmax_mb={amb}: tg128 @ depth {d}: {:.3} ms/token \
                     ({:.0} tok/s)",
                    m * 1e3 / 128.0,
                    128.0 / m
                );
            }
        }
        b.set_decode_v11(d0.0, d0.1);
    }
    // --ab-ss (session 16): one-token RMSNorms from the products' partial sums of squares
    // (on) or from the row (off), alternating, in one process.
    // With each, the half-unit Q4_K SwiGLU product (mvh) on and off; `--ab-ss-mq` instead
    // alternates v9's merge that quantizes the output projection's activation.
    if args.iter().any(|a| a == "--ab-ss-mq") {
        let (d0, v9) = (b.rms_ss(), b.decode_v9());
        let combos = [
            (d0, v9.0),
            (false, false),
            (true, false),
            (false, true),
            (true, true),
            (false, false),
            (true, false),
            (false, true),
            (true, true),
            (true, false),
            (true, true),
            (d0, v9.0),
        ];
        for (on, mq) in combos {
            b.set_rms_ss(on);
            b.set_decode_v9(mq, v9.1);
            for d in [0usize, depth] {
                let (m, _) = tg128(&mut b, &power, &mut toks, &mut seq, d, 4);
                println!(
                    "a/b rms_ss={on} merge_q={mq}: tg128 @ depth {d}: {:.3} ms/token \
                     ({:.0} tok/s)",
                    m * 1e3 / 128.0,
                    128.0 / m
                );
            }
        }
        b.set_rms_ss(d0);
        b.set_decode_v9(v9.0, v9.1);
    }
    if args.iter().any(|a| a == "--ab-ss") {
        let (d0, h0) = (b.rms_ss(), b.gpu().mvh.get());
        let combos = [
            (d0, h0),
            (false, false),
            (false, true),
            (true, false),
            (true, true),
            (false, false),
            (false, true),
            (true, false),
            (true, true),
            (d0, h0),
        ];
        for (on, mvh) in combos {
            b.set_rms_ss(on);
            b.set_mvh(mvh);
            for d in [0usize, depth] {
                let (m, _) = tg128(&mut b, &power, &mut toks, &mut seq, d, 4);
                println!(
                    "a/b rms_ss={on} mvh={mvh}: tg128 @ depth {d}: {:.3} ms/token ({:.0} tok/s)",
                    m * 1e3 / 128.0,
                    128.0 / m
                );
            }
        }
        b.set_rms_ss(d0);
        b.set_mvh(h0);
    }
    // --ab-adapt (session 17): one-token attention splits sized to the context (a graph per
    // class of lengths) and the fixed count of earlier sessions, alternating, in one process.
    if args.iter().any(|a| a == "--ab-adapt") {
        let a0 = b.one_adapt();
        for on in [a0, !a0, a0, !a0, a0, !a0] {
            b.set_one_adapt(on);
            let label = format!("one_adapt={on}");
            ab_tg(
                &mut b,
                &power,
                &mut toks,
                &mut seq,
                &[0, 1024, depth],
                &label,
            );
        }
        b.set_one_adapt(a0);
    }
    // --ab-tiles (sessions 26-27): the longest context, in 64-position tiles, that the
    // context-sized one-token attention runs as one split (1: contexts over 64 positions merge
    // their splits in a second launch; 2 or 4: up to 128 or 256 positions take one split that
    // writes its rows itself; longer contexts one tile per split either way), alternating, in
    // one process.
    if args.iter().any(|a| a == "--ab-tiles") {
        let t0 = b.one_tiles();
        for tiles in [t0, 2, 4, t0, 2, 4, t0, 2, 4] {
            b.set_one_tiles(tiles);
            let label = format!("one_tiles={tiles}");
            ab_tg(
                &mut b,
                &power,
                &mut toks,
                &mut seq,
                &[0, 256, depth],
                &label,
            );
        }
        b.set_one_tiles(t0);
    }
    // --ab-mvqp (session 17): threads per block of the down projection's block-per-row
    // product, alternating, in one process, with the per-class product times.
    if args.iter().any(|a| a == "--ab-mvqp") {
        let t0 = b.gpu().mvqp_threads.get();
        for th in [t0, 64, 32, t0, 64, 32, t0] {
            b.gpu().mvqp_threads.set(th);
            b.reset_graphs();
            let label = format!("mvqp_threads={th}");
            ab_tg(&mut b, &power, &mut toks, &mut seq, &[0, depth], &label);
            ab_kernels(&mut b, &label, &["down"]);
        }
        b.gpu().mvqp_threads.set(t0);
        b.reset_graphs();
    }
    // --ab-wave (session 17): the default one-token path with and without v10's one-wave
    // mvr grids (each warp several row pairs, L2 prefetch ahead), and with Q6_K by half
    // super-blocks, alternating, in one process.
    if args.iter().any(|a| a == "--ab-wave") {
        let d0 = b.decode_v10();
        let wave = DecodeV10 { wave: true, ..d0 };
        let half = DecodeV10 {
            q6_half: true,
            ..d0
        };
        for (label, c) in [
            ("default", d0),
            ("wave", wave),
            ("q6_half", half),
            ("default", d0),
            ("wave", wave),
            ("q6_half", half),
            ("default", d0),
        ] {
            b.set_decode_v10(c);
            let label = format!("v10 {label}");
            ab_tg(&mut b, &power, &mut toks, &mut seq, &[0, depth], &label);
        }
        b.set_decode_v10(d0);
    }
    // --ab-s18 (session 18): this session's one-token defaults (the Q6_K head and down
    // projections from their aligned copies; a one-split attention writing its merged rows)
    // against each switched off, alternating, in one process; then the product classes' own
    // timings with and without the aligned copies.
    if args.iter().any(|a| a == "--ab-s18") {
        for _ in 0..3 {
            for (label, q6a, direct) in [
                ("default", true, true),
                ("q6a=false", false, true),
                ("direct=false", true, false),
            ] {
                b.gpu().q6a.set(q6a);
                b.set_one_direct(direct);
                b.reset_graphs();
                ab_tg(
                    &mut b,
                    &power,
                    &mut toks,
                    &mut seq,
                    &[0, 64, depth],
                    &format!("s18 {label}"),
                );
            }
        }
        b.set_one_direct(true);
        for on in [true, false] {
            b.gpu().q6a.set(on);
            b.reset_graphs();
            ab_kernels(&mut b, &format!("q6a={on}"), &[]);
        }
        b.gpu().q6a.set(true);
        b.reset_graphs();
    }
    // --ab-downss (session 18): the default down projection adding its row's squares for the
    // next attention norm (the default) or not, alternating, decode chains of 8 and
    // `step_greedy` steps both.
    if args.iter().any(|a| a == "--ab-downss") {
        for on in [true, false, true, false, true, false] {
            b.set_down_ss(on);
            for d in [0usize, depth] {
                let m = tg128_chain(&mut b, &mut toks, &mut seq, d, 4, 8);
                println!(
                    "a/b down_ss={on} chain=8: tg128 @ depth {d}: {:.3} ms/token ({:.0} tok/s)",
                    m * 1e3 / 128.0,
                    128.0 / m
                );
            }
            ab_tg(
                &mut b,
                &power,
                &mut toks,
                &mut seq,
                &[0, depth],
                &format!("down_ss={on}"),
            );
        }
        b.set_down_ss(true);
    }
    // --ab-mvsm (session 19): the one-token products of rows up to `Gpu::mvsm_cols` wide
    // staging their rows in shared memory before the PDL wait or not, alternating over three
    // rounds, decode chains of 8; then each mode's product-class timings.
    if args.iter().any(|a| a == "--ab-mvsm") {
        let orig = b.gpu().mvsm.get();
        for on in [true, false, true, false, true, false] {
            b.gpu().mvsm.set(on);
            b.reset_graphs();
            for d in [0usize, depth] {
                let m = tg128_chain(&mut b, &mut toks, &mut seq, d, 4, 8);
                println!(
                    "a/b mvsm={on} chain=8: tg128 @ depth {d}: {:.3} ms/token ({:.0} tok/s)",
                    m * 1e3 / 128.0,
                    128.0 / m
                );
            }
        }
        for on in [true, false] {
            b.gpu().mvsm.set(on);
            b.reset_graphs();
            ab_kernels(&mut b, &format!("mvsm={on}"), &[]);
        }
        b.gpu().mvsm.set(orig);
        b.reset_graphs();
    }
    // --ab-mvsm-prep (session 20): the staged output projection quantizing the attention's
    // merged rows itself (`Gpu::mvsm_prep`, no quantize_act / no quantizing merge before it) or
    // not, alternating over three rounds, decode chains of 8.
    if args.iter().any(|a| a == "--ab-mvsm-prep") {
        let orig = b.gpu().mvsm_prep.get();
        for on in [true, false, true, false, true, false] {
            b.gpu().mvsm_prep.set(on);
            b.reset_graphs();
            for d in [0usize, depth] {
                let m = tg128_chain(&mut b, &mut toks, &mut seq, d, 4, 8);
                println!(
                    "a/b mvsm_prep={on} chain=8: tg128 @ depth {d}: {:.3} ms/token ({:.0} tok/s)",
                    m * 1e3 / 128.0,
                    128.0 / m
                );
            }
        }
        b.gpu().mvsm_prep.set(orig);
        b.reset_graphs();
    }
    // --ab-downcl (session 21): the down projection quantizing the SwiGLU output itself on
    // thread block clusters (`Gpu::down_cl`, no quantize_act launch) or not, alternating over
    // three rounds, decode chains of 8.
    // Modes: (on, blocks per cluster, blocks per SM looping over rows; 0: a block per row).
    if args.iter().any(|a| a == "--ab-downcl") {
        let g = b.gpu();
        let orig = (g.down_cl.get(), g.mvqc_cluster.get(), g.mvqc_per_sm.get());
        let modes = [
            (false, 8u32, 0usize),
            (true, 8, 0),
            (true, 4, 0),
            (true, 2, 0),
            (true, 1, 0),
            (true, 8, 4),
            (true, 8, 8),
            (true, 4, 8),
        ];
        for (on, cl, per_sm) in modes.iter().chain(&modes).copied() {
            b.gpu().down_cl.set(on);
            b.gpu().mvqc_cluster.set(cl);
            b.gpu().mvqc_per_sm.set(per_sm);
            b.reset_graphs();
            let m = tg128_chain(&mut b, &mut toks, &mut seq, 0, 4, 8);
            println!(
                "a/b down_cl={on} cluster={cl} per_sm={per_sm} chain=8: tg128 @ depth 0: {:.3} ms/token ({:.0} tok/s)",
                m * 1e3 / 128.0,
                128.0 / m
            );
        }
        b.gpu().down_cl.set(orig.0);
        b.gpu().mvqc_cluster.set(orig.1);
        b.gpu().mvqc_per_sm.set(orig.2);
        b.reset_graphs();
    }
    // --ab-q6u (session 20): the one-token products on the Q6_KA copies (head, down, and V in
    // the mixed Q/K/V launch) with Q6_KU's decoding (the default), with it except for the
    // rows wider than the mvr kernels take (the down projection, `Gpu::q6u_wide` off), or with
    // Q6_KA's, alternating over three rounds, decode chains of 8; then the product-class
    // timings of the first and last.
    if args.iter().any(|a| a == "--ab-q6u") {
        let (orig, orig_w) = (b.gpu().q6u.get(), b.gpu().q6u_wide.get());
        let modes = [(true, true), (true, false), (false, false)];
        for (on, wide) in modes.iter().chain(&modes).chain(&modes).copied() {
            b.gpu().q6u.set(on);
            b.gpu().q6u_wide.set(wide);
            b.reset_graphs();
            for d in [0usize, depth] {
                let m = tg128_chain(&mut b, &mut toks, &mut seq, d, 4, 8);
                println!(
                    "a/b q6u={on} wide={wide} chain=8: tg128 @ depth {d}: {:.3} ms/token ({:.0} tok/s)",
                    m * 1e3 / 128.0,
                    128.0 / m
                );
            }
        }
        b.gpu().q6u_wide.set(orig_w);
        for on in [true, false] {
            b.gpu().q6u.set(on);
            b.reset_graphs();
            ab_kernels(&mut b, &format!("q6u={on}"), &[]);
        }
        b.gpu().q6u.set(orig);
        b.reset_graphs();
    }
    // --ab-fq (session 17): the down projection's activation quantized inside the SwiGLU
    // product (fuse_quant; down then also writes the RMS slots) off and on, and on with the
    // half-unit SwiGLU product (mvh, which needs it), alternating, in one process.
    if args.iter().any(|a| a == "--ab-fq") {
        let (f0, h0) = (b.gpu().fuse_quant.get(), b.gpu().mvh.get());
        let combos = [
            (f0, h0),
            (false, false),
            (true, false),
            (true, true),
            (false, false),
            (true, false),
            (true, true),
            (false, false),
            (true, false),
            (f0, h0),
        ];
        for (fq, mvh) in combos {
            b.set_fuse_quant(fq);
            b.set_mvh(mvh);
            let label = format!("fuse_quant={fq} mvh={mvh}");
            ab_tg(&mut b, &power, &mut toks, &mut seq, &[0, depth], &label);
        }
        b.set_fuse_quant(f0);
        b.set_mvh(h0);
    }
    // --ab-mvp (session 29): the SwiGLU product with its row's weights in registers before
    // the wait (mvp3, 1 row per warp) against the unit kernel (the default before), five rounds
    // alternating in one process.
    if args.iter().any(|a| a == "--ab-mvp") {
        let m0 = b.gpu().mvp.get();
        for round in 0..5 {
            for rpw in [0, 1] {
                b.set_mvp(rpw);
                let label = format!("mvp={rpw} (round {round})");
                ab_tg(&mut b, &power, &mut toks, &mut seq, &[0, depth], &label);
            }
        }
        b.set_mvp(m0);
    }
    // --ab-mvqe (session 30): the block-per-row down projection with its units decoded before
    // the wait (`mvqe_*`, the default since) against `mvqp_*`, five rounds alternating in one process, with each
    // one's per-class product times once.
    if args.iter().any(|a| a == "--ab-mvqe") {
        let e0 = b.gpu().mvqe.get();
        for round in 0..5 {
            for on in [false, true] {
                b.gpu().mvqe.set(on);
                b.reset_graphs();
                let label = format!("mvqe={on} (round {round})");
                ab_tg(&mut b, &power, &mut toks, &mut seq, &[0, depth], &label);
                if round == 0 {
                    ab_kernels(&mut b, &label, &[]);
                }
            }
        }
        b.gpu().mvqe.set(e0);
        b.reset_graphs();
    }
    // --ab-mvps (session 33): the cursor-free SwiGLU product (`mvps3`, headers decoded before
    // the wait) against mvp3 at one row per warp, five rounds alternating in one process, with
    // each one's per-class product times once.
    if args.iter().any(|a| a == "--ab-mvps") {
        let (m0, s0) = (b.gpu().mvp.get(), b.gpu().mvps.get());
        b.set_mvp(1);
        for round in 0..5 {
            for on in [false, true] {
                b.set_mvps(on);
                let label = format!("mvps={on} (round {round})");
                ab_tg(&mut b, &power, &mut toks, &mut seq, &[0, depth], &label);
                if round == 0 {
                    ab_kernels(&mut b, &label, &[]);
                }
            }
        }
        b.set_mvp(m0);
        b.set_mvps(s0);
    }
    // --ab-mvpd (session 36): the one-token down projection as a warp per row, Q4_K with its
    // weights in registers before the wait (`mvpd<S>_q4_k`) and the other K-quants (the Q6_K
    // copies) with their units decoded before it (`mvqw_*`), against `mvqe`: (mvpd, mvqw) off
    // and on, three rounds alternating in one process, with each one's per-class product
    // times once.
    if args.iter().any(|a| a == "--ab-mvpd") {
        let (d0, w0) = (b.gpu().mvpd.get(), b.gpu().mvqw.get());
        for round in 0..3 {
            for (pd, qw) in [(false, false), (true, false), (true, true), (false, true)] {
                b.gpu().mvpd.set(pd);
                b.gpu().mvqw.set(qw);
                b.reset_graphs();
                let label = format!("mvpd={pd} mvqw={qw} (round {round})");
                ab_tg(&mut b, &power, &mut toks, &mut seq, &[0, depth], &label);
                if round == 0 {
                    ab_kernels(&mut b, &label, &[]);
                }
            }
        }
        b.gpu().mvpd.set(d0);
        b.gpu().mvqw.set(w0);
        b.reset_graphs();
    }
    // --launches (session 39): the kernels one tg128 run at depth 0 issues, each with its
    // count (its prompt and eager steps launch by launch, the captured step once, not its
    // replays), so a form switched on is seen to be taken.
    if args.iter().any(|a| a == "--launches") {
        *b.gpu().launch_log.borrow_mut() = Some(Default::default());
        b.reset_graphs();
        ab_tg(&mut b, &power, &mut toks, &mut seq, &[0], "launches");
        if let Some(log) = b.gpu().launch_log.borrow_mut().take() {
            for (k, n) in &log {
                println!("launches: {k} x{n}");
            }
        }
    }
    // --ab-mvpq (session 33): the one-token Q/K/V launch as a warp per Q4_K rotation pair
    // with its weights in registers before the wait (`mvpq3`) against the mvr kernels, five
    // rounds alternating in one process, with each one's per-class product times once.
    if args.iter().any(|a| a == "--ab-mvpq") {
        let q0 = b.gpu().mvpq.get();
        for round in 0..5 {
            for on in [false, true] {
                b.set_mvpq(on);
                let label = format!("mvpq={on} (round {round})");
                ab_tg(&mut b, &power, &mut toks, &mut seq, &[0, depth], &label);
                if round == 0 {
                    ab_kernels(&mut b, &label, &[]);
                }
            }
        }
        b.set_mvpq(q0);
    }
    // --ab-hop (session 34): what a small kernel costs against the bare link of the chain it
    // occupies: each class left out, then replaced by one empty block that only waits for
    // its predecessor (`pdl_hop`, the "~" prefix of set_skip), three rounds alternating in
    // one process (the step's results are wrong while either is set).
    if args.iter().any(|a| a == "--ab-hop") {
        let sets: &[&[&str]] = &[
            &[],
            &["rms_norm"],
            &["~rms_norm"],
            &["quantize_act"],
            &["~quantize_act"],
            &["attn_merge"],
            &["~attn_merge"],
        ];
        for round in 0..3 {
            for set in sets {
                b.set_skip(set);
                let label = format!("hop [{}] (round {round})", set.join(","));
                ab_tg(&mut b, &power, &mut toks, &mut seq, &[0, depth], &label);
            }
        }
        b.set_skip(&[]);
    }
    // --ab-small (session 35): the small kernels of the one-token chain launching their
    // successor before their own wait (`Gpu::set_pdl_small` masks), with and without their
    // warp-per-group forms (`rms1s`, `quant1`), three rounds alternating in one process
    // (AB_SMALL_MODES picks the modes). Session 35's first call also ran the empty link of
    // `--ab-hop` in both orders (`~rms_norm` with and without the PDL_SMALL_HOP bit).
    if args.iter().any(|a| a == "--ab-small") {
        let m0 = b.gpu().pdl_small();
        let (r0, q0) = (b.gpu().rms1s.get(), b.gpu().quant1.get());
        use cuda::device::{
            PDL_SMALL_ATTN as A, PDL_SMALL_MERGE as M, PDL_SMALL_QUANT as Q, PDL_SMALL_RMS as R,
            PDL_SMALL_RMS_FFN as F,
        };
        // (mask, the warp-per-group RMSNorm `rms1s`, the warp-per-group quantize_act `quant1`)
        let modes: Vec<(u32, bool, bool)> = match std::env::var("AB_SMALL_MODES") {
            // "mask:rms1s:quant1,..." with 0/1 flags, e.g. "0:0:0,6:1:1"
            Ok(v) => v
                .split(',')
                .filter_map(|m| {
                    let f: Vec<u32> = m.split(':').filter_map(|x| x.trim().parse().ok()).collect();
                    (f.len() == 3).then(|| (f[0], f[1] == 1, f[2] == 1))
                })
                .collect(),
            Err(_) => vec![
                (0, false, false),
                (Q | M, false, false),
                (Q | M, true, true),
                (Q | M | R, true, true),
                (Q | M | F, true, true),
                (Q | M | R | F, true, true),
                (Q | M | A, true, true),
                (0, true, true),
            ],
        };
        for round in 0..3 {
            for &(m, r1, q1) in &modes {
                if let Err(e) = b.gpu().set_pdl_small(m) {
                    println!("a/b small: {e}");
                    break;
                }
                b.gpu().quant1.set(q1);
                b.set_rms1s(r1);
                let label = format!("small={m} rms1s={r1} quant1={q1} (round {round})");
                ab_tg(&mut b, &power, &mut toks, &mut seq, &[0, depth], &label);
            }
        }
        let _ = b.gpu().set_pdl_small(m0);
        b.gpu().quant1.set(q0);
        b.set_rms1s(r0);
    }
    // --ab-rms1s (session 34): the one-token RMSNorms from the slot sums as a warp per group
    // (`rms_norm1s`) against rms_norm's block per group, five rounds alternating in one
    // process.
    if args.iter().any(|a| a == "--ab-rms1s") {
        let r0 = b.gpu().rms1s.get();
        for round in 0..5 {
            for on in [false, true] {
                b.set_rms1s(on);
                let label = format!("rms1s={on} (round {round})");
                ab_tg(&mut b, &power, &mut toks, &mut seq, &[0, depth], &label);
            }
        }
        b.set_rms1s(r0);
    }
    // --ab-kvpf (session 30): one-token steps asking L2 for the next layer's cached K and V
    // rows from the main chain (`KvPf`: before the down projection or before gate/up, plain
    // or L2::evict_last), against none, at depth 4096 only (shorter classes never take it),
    // three rounds alternating in one process.
    if args.iter().any(|a| a == "--ab-kvpf") {
        let p0 = b.kv_pf();
        let modes = ["0", "1:1024", "5:1024", "2:1024", "6:1024"];
        for round in 0..3 {
            for m in modes {
                let pf = KvPf::parse(m).unwrap_or_default();
                b.set_kv_pf(pf);
                let label = format!("kvpf={m} (round {round})");
                ab_tg(&mut b, &power, &mut toks, &mut seq, &[depth], &label);
            }
        }
        b.set_kv_pf(p0);
    }
    // --ab-mvr (session 17): the one-token mvr launches' register cap (mvr4, at most 64) and
    // warps per block (plain and Q/K/V; SwiGLU), alternating, in one process, with each
    // one's per-class product times.
    if args.iter().any(|a| a == "--ab-mvr") {
        let g = b.gpu();
        let d0 = (g.mvr_lb4.get(), g.mvr_warps.get(), g.mvr_warps_glu.get());
        let combos = [
            d0,
            (true, 8, 8),
            (true, 2, 8),
            (true, 2, 4),
            (true, 2, 2),
            (true, 1, 4),
            (true, 4, 4),
            (false, 2, 4),
            (true, 8, 8),
            (true, 2, 4),
            (true, 1, 2),
            (false, 4, 4),
            (true, 2, 2),
            d0,
        ];
        for (lb4, nw, ng) in combos {
            b.set_mvr(lb4, nw, ng);
            let label = format!("mvr4={lb4} warps={nw} glu={ng}");
            ab_tg(&mut b, &power, &mut toks, &mut seq, &[0, depth], &label);
            ab_kernels(&mut b, &label, &[]);
        }
        b.set_mvr(d0.0, d0.1, d0.2);
    }
    // --side-cfgs (session 11): the side stream's launch forms the --ab-side runs try
    // (SideCfg::parse, `;` between them); default the one in use.
    let side_cfgs: Vec<SideCfg> = get("--side-cfgs")
        .map(|s| s.split(';').filter_map(SideCfg::parse).collect())
        .filter(|v: &Vec<SideCfg>| !v.is_empty())
        .unwrap_or_else(|| vec![b.gpu().side_cfg.get()]);
    let side_ab = args.iter().any(|a| a == "--ab-side");
    // --ab-side: one-token steps without and with the side stream's L2 prefetches (O and
    // gate/up after Q/K/V, down after O; then also the next Q/K/V after gate/up), alternating,
    // twice over, under each launch form, in one process.
    if side_ab {
        let (s0, c0) = (b.side_l2(), b.gpu().side_cfg.get());
        for round in 0..2 {
            for cfg in &side_cfgs {
                b.gpu().side_cfg.set(*cfg);
                for bits in [0u8, SIDE_ONE, SIDE_ONE | SIDE_ONE_NEXT] {
                    b.set_side_l2(bits);
                    for d in [0usize, depth] {
                        let (m, _) = tg128(&mut b, &power, &mut toks, &mut seq, d, 3);
                        println!(
                            "a/b side round {round} bits={bits} cfg={}:{}:{}:{}: tg128 @ depth \
                             {d}: {:.3} ms/token ({:.0} tok/s)",
                            cfg.kind,
                            cfg.blocks,
                            cfg.threads,
                            cfg.chunk,
                            m * 1e3 / 128.0,
                            128.0 / m
                        );
                    }
                }
            }
        }
        b.set_side_l2(s0);
        b.gpu().side_cfg.set(c0);
    }
    // --ab-wp (session 11): one-token steps with the split attention's warp-private and
    // block-wide loaders, alternating, three times over, in one process.
    let wp_ab = args.iter().any(|a| a == "--ab-wp");
    if wp_ab {
        let w0 = b.gpu().attn_wp.get();
        for round in 0..3 {
            for wp in [w0, !w0] {
                b.set_attn_wp(wp);
                for d in [0usize, depth] {
                    let (m, _) = tg128(&mut b, &power, &mut toks, &mut seq, d, 3);
                    println!(
                        "a/b wp round {round} attn_wp={wp}: tg128 @ depth {d}: {:.3} ms/token \
                         ({:.0} tok/s)",
                        m * 1e3 / 128.0,
                        128.0 / m
                    );
                }
            }
        }
        b.set_attn_wp(w0);
    }
    // --ab-skip (v11): the step with each kernel class left out (timing only: the results
    // of those steps are wrong), alternating with the full step, in one process: what each
    // class costs inside the real captured step, PDL overlap and launch gaps included.
    if args.iter().any(|a| a == "--ab-skip") {
        let small: &[&str] = &["rms_norm", "quantize_act", "attn_one", "attn_merge"];
        let products: &[&str] = &[
            "mvr4_rope",
            "mvr_rope",
            "mvr4_q",
            "mvr_q",
            "mvr_swiglu",
            "mvp3_",
            "mvps",
            "mvpq",
            "mvh_",
            "mvqp_",
            "mvqe_",
            "mvqc_",
            "mvpd",
            "mvsm",
        ];
        // Session 21: the staged output projection (mvsm*), the cluster down (mvqc_) and the
        // greedy pick (argmax) have classes of their own; session 38 adds the warp-per-row down
        // (mvpd*, session 36) to the down class.
        let sets: &[&[&str]] = &[
            &[],
            &["rms_norm"],
            &["quantize_act"],
            &["attn_one"],
            &["attn_merge"],
            &["mvr4_rope", "mvr_rope", "mvpq"],
            &["mvr4_q4_k", "mvr_q4_k", "mvsm"],
            &["mvr_swiglu", "mvp3_", "mvps", "mvh_"],
            &["mvqp_", "mvqe_", "mvq_", "mvqc_", "mvpd"],
            &["mvr4_q6_k", "mvr_q6_k"],
            &["argmax"],
            &[],
            small,
            products,
            &[],
        ];
        for set in sets {
            b.set_skip(set);
            for d in [0usize, depth] {
                let (m, _) = tg128(&mut b, &power, &mut toks, &mut seq, d, 3);
                println!(
                    "a/b skip [{}]: tg128 @ depth {d}: {:.3} ms/token ({:.0} tok/s)",
                    set.join(","),
                    m * 1e3 / 128.0,
                    128.0 / m
                );
            }
        }
        b.set_skip(&[]);
    }
    println!(
        "steps: {} from graphs, {} eager; graph failure: {:?}",
        b.stats.graph_steps,
        b.stats.eager_steps,
        b.graph_failure()
    );
    // Where the time goes: one prompt step and one decode step at `depth`, launched eagerly with
    // a timing event after each kernel (so decode times include launch gaps).
    let mut r3 = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    if !quick || args.iter().any(|a| a == "--profile") {
        profile(&mut b, &mut r3, depth, &mut seq);
    }
    // Prompt steps through cuBLAS (f16 weights and activations) against the integer path
    // (activations quantized like the CPU's, 8 tokens per weight pass), which numerically
    // matches the CPU backend.
    let mut r2 = rand_chacha::ChaCha8Rng::seed_from_u64(2);
    if quick {
        drop(b);
    } else {
        integer_path(b, path, &opts, &mut r2, &mut seq);
    }
    let prof = !quick || args.iter().any(|a| a == "--profile");
    // --ab-mmq: each aggregate also with the batched products on cuBLAS (f16 copies) instead of
    // the tensor-core integer GEMM, same process, same file.
    let mmq_ab = args.iter().any(|a| a == "--ab-mmq");
    // --ab-mmf: each aggregate also with the batched products switched between cuBLAS on the
    // f16 copies (the default) and the f16 tensor-core kernels on the quantized weights, and
    // each product class timed both ways at 16 and 64 tokens.
    let mmf_ab = args.iter().any(|a| a == "--ab-mmf");
    // --ab-mmk: each aggregate also with the Q4_K tensor-core products in the CPU's integer order
    // switched over (session 10), and each product class timed every way at 16 and 64 tokens.
    let mmk_ab = args.iter().any(|a| a == "--ab-mmk");
    // --ab-lt: each aggregate also with v10's batched products switched (fused Q/K/V and
    // gate/up GEMMs, cuBLASLt algorithms timed per shape) in the other three combinations, then
    // every tuned shape's cublasGemmEx and best cuBLASLt time.
    let lt_ab = args.iter().any(|a| a == "--ab-lt");
    // --ab-merge: each aggregate also with the wide steps' attention slices merged by
    // attn_merge instead of attn_combine (or the other way round).
    let merge_ab = args.iter().any(|a| a == "--ab-merge");
    let side = side_ab.then_some(&side_cfgs[..]);
    aggregate(
        path,
        &par,
        graphs,
        prof,
        (mmq_ab, mmf_ab, lt_ab, merge_ab, mmk_ab),
        (side, wp_ab),
        &mut toks,
    );
}

/// Prompt steps through cuBLAS against the integer path at 16..128 and 512 tokens.
fn integer_path(
    mut b: CudaBackend,
    path: &str,
    opts: &CudaOptions,
    r2: &mut rand_chacha::ChaCha8Rng,
    seq: &mut u64,
) {
    let mut gemm_ms = Vec::new();
    for n in [16usize, 32, 64, 128] {
        gemm_ms.push(prompt_ms(&mut b, r2, n, 5, seq));
    }
    drop(b);
    let iopts = CudaOptions {
        gemm_min_tokens: 512,
        gemm_weights: cuda::GemmWeights::OnTheFly,
        ..opts.clone()
    };
    let mut bi = CudaBackend::load(path, &iopts).unwrap_or_else(|e| panic!("{e}"));
    for (i, n) in [16usize, 32, 64, 128].into_iter().enumerate() {
        let im = prompt_ms(&mut bi, r2, n, 5, seq);
        println!(
            "pp{n}: cuBLAS f16 {:.2} ms, integer path {im:.2} ms",
            gemm_ms[i]
        );
    }
    let im = prompt_ms(&mut bi, r2, 512, 3, seq);
    println!("pp512: integer path {im:.2} ms ({:.0} tok/s)", 512e3 / im);
}

/// Aggregate generation: P sequences with 512-token prompts, 128 tokens each, decoded together.
fn aggregate(
    path: &str,
    par: &[usize],
    graphs: bool,
    prof: bool,
    (mmq_ab, mmf_ab, lt_ab, merge_ab, mmk_ab): (bool, bool, bool, bool, bool),
    (side_cfgs, wp_ab): (Option<&[SideCfg]>, bool),
    toks: &mut dyn FnMut(usize) -> Vec<u32>,
) {
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
        let (mmq0, mmf0, mmk0) = (b.gpu().mmq.get(), b.gpu().mmf.get(), b.gpu().mmk.get());
        let prod0 = b.batched_products();
        let fm0 = b.ab_fast_merge();
        if lt_ab {
            // The other product form's shapes tuned now too, outside the timed steps.
            b.tune_products(!prod0.0).unwrap_or_else(|e| panic!("{e}"));
        }
        // (integer GEMM, many-sequence attention, f16 products on quantized weights): the
        // default, then (--ab-mmq) the integer GEMM switched over and the many-sequence
        // attention off, (--ab-mmf) the f16 products on quantized weights switched over.
        let (side0, cfg0) = (b.side_l2(), b.gpu().side_cfg.get());
        let wp0 = b.gpu().attn_wp.get();
        let sd = (side0, cfg0, wp0);
        let mut modes = vec![(mmq0, true, mmf0, prod0, fm0, mmk0, sd)];
        if mmq_ab {
            modes.extend([
                (!mmq0, true, mmf0, prod0, fm0, mmk0, sd),
                (mmq0, false, mmf0, prod0, fm0, mmk0, sd),
            ]);
        }
        if mmf_ab {
            modes.push((mmq0, true, !mmf0, prod0, fm0, mmk0, sd));
        }
        if mmk_ab {
            modes.push((mmq0, true, mmf0, prod0, fm0, !mmk0, sd));
        }
        if lt_ab {
            // v9's products (neither), then each of v10's two changes alone.
            let (f, l) = prod0;
            modes.extend([
                (mmq0, true, mmf0, (!f, !l), fm0, mmk0, sd),
                (mmq0, true, mmf0, (f, !l), fm0, mmk0, sd),
                (mmq0, true, mmf0, (!f, l), fm0, mmk0, sd),
            ]);
        }
        if merge_ab {
            modes.push((mmq0, true, mmf0, prod0, !fm0, mmk0, sd));
        }
        if let Some(cfgs) = side_cfgs {
            // Without, then with the wide steps' prefetches under each launch form, twice.
            let base = modes[0];
            for _ in 0..2 {
                modes.push((
                    base.0,
                    base.1,
                    base.2,
                    base.3,
                    base.4,
                    base.5,
                    (0, cfg0, wp0),
                ));
                for c in cfgs {
                    let m = (SIDE_WIDE, *c, wp0);
                    modes.push((base.0, base.1, base.2, base.3, base.4, base.5, m));
                }
            }
        }
        if wp_ab {
            // The split attention's other loader, then the default, three times.
            let base = modes[0];
            for _ in 0..3 {
                for wp in [!wp0, wp0] {
                    let m = (side0, cfg0, wp);
                    modes.push((base.0, base.1, base.2, base.3, base.4, base.5, m));
                }
            }
        }
        let modes = &modes;
        for (&p, &(mmq, battn, mmf, prod, fm, mmk, (side, cfg, wp))) in
            par.iter().flat_map(|p| modes.iter().map(move |m| (p, m)))
        {
            b.set_mmq(mmq);
            b.set_batch_attn(battn);
            b.set_mmf(mmf);
            b.set_mmk(mmk);
            b.set_batched_products(prod.0, prod.1);
            b.set_ab_fast_merge(fm);
            b.gpu().side_cfg.set(cfg);
            b.set_side_l2(side);
            b.set_attn_wp(wp);
            let mut last = Vec::new();
            for s in 0..p {
                let batch = StepBatch {
                    chunks: vec![SeqChunk {
                        prompt_len: None,
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
                            prompt_len: None,
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
            let (gs, es) = (b.stats.graph_steps, b.stats.eager_steps);
            if p == pmax
                && p > 8
                && prof
                && mmq == mmq0
                && battn
                && mmf == mmf0
                && (mmk == mmk0 || mmk_ab)
                && prod == prod0
                && fm == fm0
                && (side, cfg, wp) == (side0, cfg0, wp0)
            {
                // Where one step of the widest batch goes (eagerly, to time each kernel).
                b.set_graphs(false);
                let batch = StepBatch {
                    chunks: (0..p)
                        .map(|s| SeqChunk {
                            prompt_len: None,
                            seq: s as u64,
                            tokens: vec![last[s]],
                            start_pos: 512 + 128,
                            want: Want::Last,
                        })
                        .collect(),
                };
                report_profile(&mut b, &format!("aggregate decode step x {p}"), batch);
                b.set_graphs(graphs);
            }
            for s in 0..p {
                b.release(s as u64);
            }
            println!(
                "aggregate tg128 x {p} sequences (mmq={mmq} attn_batch={battn} mmf={mmf} mmk={mmk} fused_gemm={} lt={} fast_merge={fm} side={side} cfg={}:{}:{}:{}:{} attn_wp={wp}): {:.0} tok/s ({:.3} ms/step; {} graph / {} eager steps so far, graph failure {:?})",
                prod.0,
                prod.1,
                cfg.kind,
                cfg.blocks,
                cfg.threads,
                cfg.chunk,
                cfg.cap >> 20,
                (p * 128) as f64 / dt,
                dt * 1e3 / 128.0,
                gs,
                es,
                b.graph_failure()
            );
        }
        b.set_mmf(mmf0);
        b.set_mmk(mmk0);
        b.set_batched_products(prod0.0, prod0.1);
        b.set_ab_fast_merge(fm0);
        b.gpu().side_cfg.set(cfg0);
        b.set_side_l2(side0);
        b.set_attn_wp(wp0);
        if lt_ab || prof {
            // Every product shape tuned in this process (f16 weight bytes read per product).
            for t in b.gpu().gemm_tunings() {
                let sh = t.shape;
                let tb = |us: f64| (sh.m * sh.k * 2) as f64 / (us * 1e-6) / 1e12;
                println!(
                    "gemm shape m={} n={} k={} acc={}: cublasGemmEx {:.1} us ({:.2} TB/s), best of {} cuBLASLt candidates {:.1} us ({:.2} TB/s, K split {}), kept {}",
                    sh.m,
                    sh.n,
                    sh.k,
                    sh.acc,
                    t.gemm_ex_us,
                    tb(t.gemm_ex_us),
                    t.candidates,
                    t.best_lt_us,
                    tb(t.best_lt_us),
                    t.best_split_k,
                    if t.lt_kept { "cuBLASLt" } else { "cublasGemmEx" }
                );
            }
        }
        if mmf_ab || mmk_ab {
            for n in [16usize, 64] {
                match b.bench_batched(n, 20) {
                    Ok(rows) => {
                        for (name, k, [mk, w8, off], bytes) in rows {
                            let tb = |ms: f64| bytes / (ms * 1e-3) / 1e12;
                            println!(
                                "batched product {name} x{n} tokens ({k} launches, {:.2} MB): mmk \
                                 {:.1} us ({:.2} TB/s of quantized weights), mmf 8 warps \
                                 {:.1} us ({:.2} TB/s), cuBLAS f16 {:.1} us ({:.2}x mmk)",
                                bytes / 1e6,
                                mk * 1e3,
                                tb(mk),
                                w8 * 1e3,
                                tb(w8),
                                off * 1e3,
                                off / mk
                            );
                        }
                    }
                    Err(e) => println!("batched products x{n}: {e}"),
                }
            }
        }
    }
}
