//! Teacher-forced logits of the CPU engine against llama.cpp's (fixtures made by
//! scripts/ref_logits.py with llama-cpp-python 0.3.36): at every position, top-1 agreement and
//! the KL divergence of llama.cpp's distribution from ours.

use conformance::{teacher_forced, Figures, Fixture};
use cpu::{CpuBackend, CpuOptions};
use runtime::Backend;

/// Runs the fixture's tokens through the engine (128-token chunks) and returns (top-1
/// agreement, mean KL).
fn compare(fixture: &str) -> (f64, f64) {
    let fx = Fixture::load(fixture).unwrap_or_else(|e| panic!("{e}"));
    let path = fx
        .model_path("run scripts/fetch_model.sh or scripts/synth_model.sh --for-fixture (CI does this first)")
        .unwrap_or_else(|e| panic!("{e}"));
    let opts = CpuOptions {
        ctx_size: fx.tokens.len(),
        max_batch_tokens: 128,
        ..CpuOptions::default()
    };
    let mut be = CpuBackend::load(&path, &opts).unwrap_or_else(|e| panic!("load: {e}"));
    let rows = teacher_forced(&mut be, &fx, 128).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(be.kv().blocks_used, 0, "blocks left after release");
    let f = Figures::compare(&fx, &rows);
    eprintln!("{}", f.line(&fx));
    assert_eq!(f.non_finite_rows, 0, "non-finite logits");
    (f.top1, f.kl)
}

#[test]
fn smollm2_q4_1_matches_llama_cpp() {
    let (top1, kl) = compare("smollm2_q4_1_logits.json");
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
    let (top1, kl) = compare("synth_llama1b_q4_k_m_logits.json");
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
