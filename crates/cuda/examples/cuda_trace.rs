//! Where the CUDA backend's numbers part from the CPU backend's, op by op, and how much parting
//! the model itself amplifies.
//!
//! `cuda_trace MODEL [--tokens N] [--seed S] [--layers L] [--cpu-only]`
//!
//! 1. CPU reference: one N-token prompt step then one decode step of random tokens, every traced
//!    tensor recorded (`CpuBackend::set_trace`).
//! 2. CPU against itself (no GPU needed): the same tokens with (a) a relative perturbation of
//!    2^-22 (a few f32 ulps) on layer 0's `attn_norm`, (b) the prompt fed token by token. The
//!    logits agreement of these with the reference is what rounding-level differences alone
//!    give on this file: a bound on what any other backend can reach without bit-identity.
//! 3. GPU (unless `--cpu-only`), prompt path cuBLAS then integer (`gemm_min_tokens` = N), each
//!    twice: `free` (the GPU runs on its own numbers; the table shows the parting grow over the
//!    layers) and `override` (after each point the GPU continues from the CPU's tensor, so each
//!    row measures one op on exactly the CPU's input). Entries are ||gpu - cpu|| / ||cpu||.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cpu::{CpuBackend, CpuOptions};
use cuda::{CudaBackend, CudaOptions};
use rand::{Rng, SeedableRng};
use runtime::{Backend, SeqChunk, StepBatch, Want};

#[path = "../tests/agree/mod.rs"]
mod agree;
use agree::Agree;

type Tensors = Arc<Mutex<HashMap<String, Vec<f32>>>>;

const POINTS: [(&str, usize); 10] = [
    ("attn_norm", 0),
    ("Qcur", 0),
    ("Kcur", 0),
    ("Vcur", 0),
    ("Qcur", 2),
    ("kqv_out", 0),
    ("ffn_inp", 0),
    ("ffn_norm", 0),
    ("ffn_swiglu", 0),
    ("l_out", 0),
];

fn rel(a: &[f32], r: &[f32]) -> f64 {
    let (mut d, mut n) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(r) {
        d += ((x - y) as f64).powi(2);
        n += (y as f64).powi(2);
    }
    (d / n.max(1e-300)).sqrt()
}

fn batch(tokens: Vec<u32>, start_pos: usize, want: Want) -> StepBatch {
    StepBatch {
        chunks: vec![SeqChunk {
            prompt_len: None,
            seq: 1,
            tokens,
            start_pos,
            want,
        }],
    }
}

fn rows(out: &runtime::StepOutput) -> Vec<Vec<f32>> {
    (0..out.n_rows())
        .map(|i| out.row(i).unwrap_or(&[]).to_vec())
        .collect()
}

fn agree(r: &[Vec<f32>], o: &[Vec<f32>]) -> Agree {
    let mut a = Agree::default();
    for (c, g) in r.iter().zip(o) {
        a.add(c, g);
    }
    a
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(model) = args.first().cloned() else {
        eprintln!("usage: cuda_trace MODEL [--tokens N] [--seed S] [--layers L] [--cpu-only]");
        std::process::exit(2);
    };
    let opt = |k: &str, d: u64| -> u64 {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let n = opt("--tokens", 64) as usize;
    let seed = opt("--seed", 1);
    let cpu_only = args.iter().any(|a| a == "--cpu-only");
    let t0 = std::time::Instant::now();

    let copts = CpuOptions {
        ctx_size: n + 8,
        max_seqs: 2,
        max_batch_tokens: n,
        ..CpuOptions::default()
    };
    let mut cpu = CpuBackend::load(&model, &copts).unwrap_or_else(|e| panic!("cpu load: {e}"));
    let n_layer = cpu_layers(&model);
    let shown: Vec<usize> = {
        let l = opt("--layers", 0) as usize;
        let mut v = vec![0, 1, 2, n_layer / 2, n_layer.saturating_sub(1)];
        if l > 0 {
            v = (0..l.min(n_layer)).collect();
        }
        v.dedup();
        v
    };
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let nv = 32000u32.min(vocab(&model));
    let prompt: Vec<u32> = (0..n).map(|_| r.gen_range(0..nv)).collect();
    let next: Vec<u32> = vec![r.gen_range(0..nv)];

    // 1. The CPU reference, every point recorded.
    let rec = |store: &Tensors| -> Box<cpu::TraceFn> {
        let st = store.clone();
        Box::new(move |name: &str, layer: usize, occ: usize, d: &mut [f32]| {
            if let Ok(mut m) = st.lock() {
                m.insert(format!("{name}-{layer}#{occ}"), d.to_vec());
            }
        })
    };
    let ref_p: Tensors = Arc::default();
    let ref_d: Tensors = Arc::default();
    cpu.set_trace(Some(rec(&ref_p)));
    let c_prompt = rows(
        &cpu.step(&batch(prompt.clone(), 0, Want::All))
            .expect("cpu step"),
    );
    cpu.set_trace(Some(rec(&ref_d)));
    let c_dec = rows(
        &cpu.step(&batch(next.clone(), n, Want::Last))
            .expect("cpu step"),
    );
    cpu.release(1);
    println!(
        "model {model}: {n_layer} layers, {n}-token prompt + 1 decode step, seed {seed} (cpu reference {:.1} s)",
        t0.elapsed().as_secs_f64()
    );

    // 2. The CPU against itself.
    let mut pr = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
    let eps = (2f32).powi(-22);
    let pert: Box<cpu::TraceFn> =
        Box::new(move |name: &str, layer: usize, _o: usize, d: &mut [f32]| {
            if name == "attn_norm" && layer == 0 {
                for v in d.iter_mut() {
                    *v *= 1.0 + eps * pr.gen_range(-1.0f32..1.0);
                }
            }
        });
    cpu.set_trace(Some(pert));
    let p_prompt = rows(
        &cpu.step(&batch(prompt.clone(), 0, Want::All))
            .expect("cpu step"),
    );
    cpu.release(1);
    cpu.set_trace(None);
    println!(
        "cpu vs cpu, attn_norm-0 x (1 + 2^-22 u): {}",
        agree(&c_prompt, &p_prompt).line()
    );
    let mut tbt = Vec::new();
    for (i, &tok) in prompt.iter().enumerate() {
        tbt.extend(rows(
            &cpu.step(&batch(vec![tok], i, Want::Last))
                .expect("cpu step"),
        ));
    }
    cpu.release(1);
    println!(
        "cpu vs cpu, prompt token by token: {}",
        agree(&c_prompt, &tbt).line()
    );
    if cpu_only {
        return;
    }
    if let Err(e) = cuda::available() {
        println!("no GPU: {e}");
        return;
    }

    // 3. The GPU against the reference.
    for integer in [false, true] {
        let mut gopts = CudaOptions {
            ctx_size: n + 8,
            max_seqs: 2,
            max_batch_tokens: n,
            ..CudaOptions::default()
        };
        if integer {
            gopts.gemm_min_tokens = n;
        }
        let mut gpu = CudaBackend::load(&model, &gopts).unwrap_or_else(|e| panic!("gpu load: {e}"));
        for overriding in [false, true] {
            let mut out = Vec::new();
            for (step, refs) in [("prompt", &ref_p), ("decode", &ref_d)] {
                let got: Arc<Mutex<HashMap<String, f64>>> = Arc::default();
                let (g2, r2) = (got.clone(), refs.clone());
                gpu.set_trace(Some(Box::new(move |name, layer, occ, d| {
                    let key = format!("{name}-{layer}#{occ}");
                    let Ok(refs) = r2.lock() else { return };
                    let Some(c) = refs.get(&key) else { return };
                    if c.len() != d.len() {
                        println!("{key}: {} values vs the cpu's {}", d.len(), c.len());
                        return;
                    }
                    if let Ok(mut g) = g2.lock() {
                        g.insert(key, rel(d, c));
                    }
                    if overriding {
                        d.copy_from_slice(c);
                    }
                })));
                let lg = if step == "prompt" {
                    rows(
                        &gpu.step(&batch(prompt.clone(), 0, Want::All))
                            .expect("gpu step"),
                    )
                } else {
                    rows(
                        &gpu.step(&batch(next.clone(), n, Want::Last))
                            .expect("gpu step"),
                    )
                };
                let c = if step == "prompt" { &c_prompt } else { &c_dec };
                out.push(format!("  logits ({step}): {}", agree(c, &lg).line()));
                let g = got.lock().map(|g| g.clone()).unwrap_or_default();
                println!(
                    "gpu {} prompt path, {}, {step} step: ||gpu-cpu||/||cpu|| at layers {:?} | max over all layers",
                    if integer { "integer" } else { "cuBLAS" },
                    if overriding { "override (each op on the cpu's input)" } else { "free" },
                    shown
                );
                for (name, occ) in POINTS {
                    let mut line = format!("  {:<14}", format!("{name}#{occ}"));
                    for &l in &shown {
                        match g.get(&format!("{name}-{l}#{occ}")) {
                            Some(v) => line += &format!(" {v:9.2e}"),
                            None => line += "         -",
                        }
                    }
                    let mx = (0..n_layer)
                        .filter_map(|l| g.get(&format!("{name}-{l}#{occ}")))
                        .fold(0f64, |a, &b| a.max(b));
                    line += &format!(" | {mx:9.2e}");
                    println!("{line}");
                }
            }
            gpu.set_trace(None);
            gpu.release(1);
            for l in out {
                println!("{l}");
            }
        }
    }
    println!("done in {:.1} s", t0.elapsed().as_secs_f64());
}

fn cpu_layers(model: &str) -> usize {
    let f = gguf::GgufFile::open(model).unwrap_or_else(|e| panic!("{model}: {e}"));
    model::ModelConfig::from_gguf(&f).map_or(0, |c| c.n_layer)
}

fn vocab(model: &str) -> u32 {
    let f = gguf::GgufFile::open(model).unwrap_or_else(|e| panic!("{model}: {e}"));
    model::ModelConfig::from_gguf(&f).map_or(32000, |c| c.n_vocab as u32)
}
