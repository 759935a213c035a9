//! The CUDA backend's host placement on a real GPU: the test double `cuda:0-lacking-q6_k` (its
//! Q6_K matmuls run on the CPU inside the CUDA plan) and `--layers-on-gpu 10` (layers 10.. keep
//! their matmul weights in host memory) against the same backend with everything on the GPU, on a
//! synthetic SmolLM2-shaped Q4_K_M model (Q5_0, Q6_K, Q4_K and Q8_0 matrices, made here).
//!
//! Needs a GPU: without one it prints why it is skipped and passes (CI has none; the GPU machine
//! runs it through scripts/gpu_placement.sh).

use std::path::PathBuf;
use std::sync::Arc;

use cuda::{CudaBackend, CudaOptions, HostPlan};
use gguf::{GgmlType, GgufFile};
use model::synth::{Preset, Shrink, SynthOptions, VocabSource};
use model::{FileType, ModelConfig, ModelWeights, QuantScheme};
use rand::{Rng, SeedableRng};
use runtime::{Backend, SeqChunk, StepBatch, Support, Want};

fn gpu_present() -> bool {
    match cuda::available() {
        Ok(_) => true,
        Err(e) => {
            eprintln!(
                "SKIPPED: no usable GPU ({e}); this test runs on the GPU machine \
                 (scripts/gpu_placement.sh)"
            );
            false
        }
    }
}

fn synth_model() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("crossover-placement-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("smol-q4_k_m.gguf");
    let opts = SynthOptions {
        preset: Preset::Smollm2_135m,
        scheme: QuantScheme::Mixture(FileType::MostlyQ4_K_M),
        seed: 3,
        vocab: VocabSource::ByteLevel,
        chat_template: None,
        shrink: Shrink::default(),
        threads: 0,
    };
    model::synth::synth_to_file(&opts, &out, &mut |_| {}).unwrap();
    out
}

fn step(b: &mut CudaBackend, tokens: &[u32], start_pos: usize, want: Want) -> Vec<Vec<f32>> {
    let batch = StepBatch {
        chunks: vec![SeqChunk {
            prompt_len: None,
            seq: 1,
            tokens: tokens.to_vec(),
            start_pos,
            want,
        }],
    };
    let out = b.step(&batch).unwrap();
    (0..out.n_rows())
        .map(|i| out.row(i).unwrap().to_vec())
        .collect()
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

fn margin(row: &[f32]) -> f32 {
    let mut v = row.to_vec();
    v.sort_by(|a, b| b.total_cmp(a));
    v[0] - v[1]
}

/// Prompt prefill then `n` one-token decode steps (graph replays where the backend can).
fn greedy(b: &mut CudaBackend, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut last = step(b, prompt, 0, Want::Last).pop().unwrap();
    let mut out = Vec::new();
    for i in 0..n {
        let t = argmax(&last);
        out.push(t);
        if i + 1 < n {
            last = step(b, &[t], prompt.len() + i, Want::Last).pop().unwrap();
        }
    }
    b.release(1);
    out
}

/// Teacher-forced logits of every position, one token per step (the decode path).
fn forced(b: &mut CudaBackend, seq: &[u32]) -> Vec<Vec<f32>> {
    let rows = seq
        .iter()
        .enumerate()
        .map(|(p, &t)| step(b, &[t], p, Want::Last).pop().unwrap())
        .collect();
    b.release(1);
    rows
}

fn log_softmax(r: &[f32]) -> Vec<f64> {
    let m = r.iter().cloned().fold(f32::MIN, f32::max) as f64;
    let z: f64 = r.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m;
    r.iter().map(|&x| x as f64 - z).collect()
}

/// A top-two margin under this is a near-tie that GPU and CPU float orders may break apart.
const NEAR_TIE: f32 = 0.2;

/// Mean KL(reference || other), top-1 agreement over the positions, and the positions with a
/// clear winner (margin >= [`NEAR_TIE`]) whose winner differs.
fn agreement(reference: &[Vec<f32>], other: &[Vec<f32>]) -> (f64, f64, Vec<usize>) {
    let mut kl = 0.0;
    let mut same = 0;
    let mut clear_diff = Vec::new();
    for (i, (a, b)) in reference.iter().zip(other).enumerate() {
        if argmax(a) != argmax(b) && margin(a) >= NEAR_TIE {
            clear_diff.push(i);
        }
        let (la, lb) = (log_softmax(a), log_softmax(b));
        kl += la
            .iter()
            .zip(&lb)
            .map(|(p, q)| p.exp() * (p - q))
            .sum::<f64>();
        same += usize::from(argmax(a) == argmax(b));
    }
    let n = reference.len() as f64;
    (kl / n, same as f64 / n, clear_diff)
}

#[test]
fn host_placement_runs_the_model_with_the_gpu_tokens() {
    if !gpu_present() {
        return;
    }
    let path = synth_model();
    let file = Arc::new(GgufFile::open(&path).unwrap());
    let cfg = ModelConfig::from_gguf(&file).unwrap();
    let weights = ModelWeights::from_gguf(&cfg, &file).unwrap();
    let base = CudaOptions {
        ctx_size: 256,
        max_seqs: 1,
        ..CudaOptions::default()
    };
    let mut all = CudaBackend::from_file(file.clone(), "synth", &base).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let prompt: Vec<u32> = (0..24)
        .map(|_| rng.gen_range(0..cfg.n_vocab as u32))
        .collect();
    let n_gen = 32;
    let want = greedy(&mut all, &prompt, n_gen);
    assert!(
        all.stats.graph_steps > 0,
        "the all-GPU decode replays graphs"
    );
    let mut seq = prompt.clone();
    seq.extend(&want);
    let ref_rows = forced(&mut all, &seq);
    let loaded_all = all.memory_loaded();

    let q6k_mats = weights
        .layers
        .iter()
        .flat_map(|l| {
            [
                &l.attn_q,
                &l.attn_k,
                &l.attn_v,
                &l.attn_output,
                &l.ffn_gate,
                &l.ffn_up,
                &l.ffn_down,
            ]
        })
        .filter(|t| t.ty == GgmlType::Q6K)
        .count();
    assert!(q6k_mats > 0, "the Q4_K_M mixture has Q6_K matrices");
    let plans = [
        (
            HostPlan {
                lacking: Some(GgmlType::Q6K),
                ..HostPlan::default()
            },
            "cuda:0-lacking-q6_k",
            q6k_mats,
        ),
        (
            HostPlan {
                layers_on_gpu: Some(10),
                ..HostPlan::default()
            },
            "cuda:0",
            (cfg.n_layer - 10) * 7,
        ),
    ];
    let mut failures: Vec<String> = Vec::new();
    for (plan, name, n_host) in plans {
        let split = cuda::host::weight_split(&cfg, &weights, &plan);
        assert_eq!(split.host_mats, n_host);
        let opts = CudaOptions {
            host: plan.clone(),
            ..base.clone()
        };
        let mut b = CudaBackend::from_file(file.clone(), "synth", &opts).unwrap();
        assert_eq!(b.info().name, name);
        // support() names exactly these matmuls as host fallbacks.
        let fb = model::ops(&cfg, &weights, 1, 64, GgmlType::F16)
            .iter()
            .filter(|op| {
                matches!(
                    b.support(&runtime::OpDesc::from_model(op)),
                    Support::Fallback { ref to, .. } if to == "host"
                )
            })
            .count();
        assert_eq!(fb, n_host, "{name} {plan:?}");

        let got = greedy(&mut b, &prompt, n_gen);
        let rows = forced(&mut b, &seq);
        assert_eq!(b.stats.graph_steps, 0, "steps with host ops run eagerly");
        assert!(b.stats.eager_steps > 0);
        let hs = b.host_stats();
        assert!(hs.calls as usize >= n_host, "{hs:?}");
        let (kl, top1, clear_diff) = agreement(&ref_rows, &rows);
        // Generated token i is the argmax of position prompt.len() - 1 + i.
        let first_diff = (0..n_gen).find(|&i| got[i] != want[i]);
        let tie = (0..n_gen)
            .find(|&i| margin(&ref_rows[prompt.len() - 1 + i]) < NEAR_TIE)
            .unwrap_or(n_gen);
        let drop = loaded_all.saturating_sub(b.memory_loaded());
        eprintln!(
            "{name} {plan:?}: {n_host} matmuls on the host ({} calls, {:.1} ms); greedy tokens \
             {}; teacher-forced top-1 {:.4}, mean KL {kl:.2e}; GPU memory at load {:.1} MiB \
             vs {:.1} MiB all on the GPU (drop {:.1} MiB; {:.1} MiB of weights left on the host)",
            hs.calls,
            hs.time.as_secs_f64() * 1e3,
            match first_diff {
                None => format!("all {n_gen} equal"),
                Some(i) => format!("equal up to {i} (first near-tie of the reference at {tie})"),
            },
            top1,
            b.memory_loaded() as f64 / 1048576.0,
            loaded_all as f64 / 1048576.0,
            drop as f64 / 1048576.0,
            split.host_bytes as f64 / 1048576.0,
        );
        // The host ops compute what the CPU backend computes; the GPU's kernels differ from the
        // CPU's in float order, so the bounds are issue 5's GPU-vs-CPU ones: mean KL <= 0.01 and
        // the same winner wherever the reference has a clear one; greedy tokens equal up to the
        // reference's first near-tie.
        if kl > 0.01 || !clear_diff.is_empty() {
            failures.push(format!(
                "{name}: mean KL {kl}, clear winners differ at positions {clear_diff:?}"
            ));
        }
        if first_diff.is_some_and(|i| i < tie) {
            failures.push(format!(
                "{name}: tokens differ at {first_diff:?} before a near-tie ({tie}): {got:?} vs {want:?}"
            ));
        }
        // The weights left on the host are not on the GPU (nor their f16 copies).
        if drop < split.host_bytes {
            failures.push(format!(
                "{name}: GPU memory dropped by {drop} bytes, {} bytes of weights stayed on the host",
                split.host_bytes
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    let _ = std::fs::remove_file(&path);
}
