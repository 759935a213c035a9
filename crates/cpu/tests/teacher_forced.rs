//! Teacher-forced logits of the CPU engine against llama.cpp's (fixtures made by
//! scripts/ref_logits.py with llama-cpp-python 0.3.36): at every position, top-1 agreement and
//! the KL divergence of llama.cpp's distribution from ours.

use std::path::{Path, PathBuf};

use cpu::{CpuBackend, CpuOptions};
use runtime::{Backend, SeqChunk, StepBatch, Want};
use serde::Deserialize;

#[derive(Deserialize)]
struct Fixture {
    model: ModelRef,
    tokens: Vec<u32>,
    positions: Vec<Position>,
}

#[derive(Deserialize)]
struct ModelRef {
    file: String,
    sha256: String,
}

#[derive(Deserialize)]
struct Position {
    ids: Vec<u32>,
    logits: Vec<f32>,
    lse: f64,
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn sha256(p: &Path) -> String {
    use sha2::Digest;
    let bytes = std::fs::read(p).unwrap();
    format!("{:x}", sha2::Sha256::digest(&bytes))
}

/// Runs the fixture's tokens through the engine and returns (top-1 agreement, mean KL).
pub fn compare(fixture: &str, model_override: Option<PathBuf>) -> (f64, f64) {
    let fx: Fixture = serde_json::from_str(
        &std::fs::read_to_string(repo().join("crates/cpu/tests/fixtures").join(fixture))
            .unwrap_or_else(|e| panic!("fixture {fixture}: {e} (made by scripts/ref_logits.py)")),
    )
    .unwrap();
    let path = model_override.unwrap_or_else(|| repo().join(&fx.model.file));
    assert!(
        path.exists(),
        "model {} is missing: run scripts/fetch_model.sh (CI does this first)",
        path.display()
    );
    assert_eq!(
        sha256(&path),
        fx.model.sha256,
        "{} is not the file the fixture was made from",
        path.display()
    );
    let opts = CpuOptions {
        ctx_size: fx.tokens.len(),
        max_batch_tokens: 128,
        ..CpuOptions::default()
    };
    let mut be = CpuBackend::load(&path, &opts).unwrap();
    let mut ours: Vec<Vec<f32>> = Vec::new();
    for (ci, chunk) in fx.tokens.chunks(128).enumerate() {
        let batch = StepBatch {
            chunks: vec![SeqChunk {
                seq: 7,
                tokens: chunk.to_vec(),
                start_pos: ci * 128,
                want: Want::All,
            }],
        };
        let out = be.step(&batch).unwrap();
        for r in 0..out.n_rows() {
            ours.push(out.row(r).unwrap().to_vec());
        }
    }
    be.release(7);
    assert_eq!(be.kv().blocks_used, 0);
    assert_eq!(ours.len(), fx.positions.len());
    let (mut agree, mut kl_sum) = (0usize, 0.0f64);
    let (mut diff_sum, mut diff_n, mut diff_max) = (0.0f64, 0usize, 0.0f64);
    for (row, p) in ours.iter().zip(&fx.positions) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = max
            + row
                .iter()
                .map(|&v| (v as f64 - max).exp())
                .sum::<f64>()
                .ln();
        let our_top = row
            .iter()
            .enumerate()
            .fold((0usize, f32::NEG_INFINITY), |b, (i, &v)| {
                if v > b.1 {
                    (i, v)
                } else {
                    b
                }
            })
            .0;
        if our_top as u32 == p.ids[0] {
            agree += 1;
        }
        for (&id, &l) in p.ids.iter().zip(&p.logits) {
            let d = (row[id as usize] - l).abs() as f64;
            diff_sum += d;
            diff_n += 1;
            diff_max = diff_max.max(d);
        }
        let (mut kl, mut pr_in, mut q_in) = (0.0f64, 0.0f64, 0.0f64);
        for (&id, &l) in p.ids.iter().zip(&p.logits) {
            let pr = (l as f64 - p.lse).exp();
            let q = (row[id as usize] as f64 - lse).exp();
            pr_in += pr;
            q_in += q;
            if pr > 0.0 {
                kl += pr * (pr / q.max(1e-30)).ln();
            }
        }
        let (pr_rest, q_rest) = ((1.0 - pr_in).max(0.0), (1.0 - q_in).max(1e-30));
        if pr_rest > 1e-12 {
            kl += pr_rest * (pr_rest / q_rest).ln();
        }
        kl_sum += kl.max(0.0);
    }
    let n = fx.positions.len() as f64;
    eprintln!(
        "{fixture}: |logit - llama.cpp| over the reference top-{}: mean {:.3e}, max {:.3e}",
        fx.positions.first().map_or(0, |p| p.ids.len()),
        diff_sum / diff_n.max(1) as f64,
        diff_max
    );
    (agree as f64 / n, kl_sum / n)
}

#[test]
fn smollm2_q4_1_matches_llama_cpp() {
    let (top1, kl) = compare("smollm2_q4_1_logits.json", None);
    eprintln!(
        "SmolLM2 Q4_1 vs llama.cpp: top-1 agreement {:.4}, mean KL {:.6}",
        top1, kl
    );
    // Issue 3's bounds. Measured: top-1 1.0000, KL 0 (`cargo test --release -p cpu --test
    // teacher_forced -- --nocapture`): the engine mirrors the rounding of llama.cpp's CPU path
    // for this graph (docs/perf/cpu.md), so the logits are bit-identical.
    assert!(top1 >= 0.98, "top-1 agreement {top1}");
    assert!(kl <= 0.01, "mean KL {kl}");
}

#[test]
fn synth_llama_1b_q4_k_m_matches_llama_cpp() {
    // The model is made by `scripts/synth_model.sh --for-fixture` (scripts/test.sh runs it); the
    // fixture pins its sha256.
    let (top1, kl) = compare("synth_llama1b_q4_k_m_logits.json", None);
    eprintln!(
        "synthetic llama-3.2-1b Q4_K_M vs llama.cpp: top-1 agreement {top1:.4}, mean KL {kl:.6}"
    );
    // Issue 3's bounds. Measured: top-1 1.0000, KL 0, logits bit-identical: the repacked Q4_K
    // gemm/gemv and tiled Q6_K orders of llama.cpp are mirrored (docs/perf/cpu.md). Random
    // weights give flat distributions where any rounding difference flips near-ties (llama.cpp
    // agrees with itself, batched vs token by token, on only 0.953), so this bound checks
    // exactly that mirroring.
    assert!(kl <= 0.01, "mean KL {kl}");
    assert!(top1 >= 0.98, "top-1 agreement {top1}");
}
