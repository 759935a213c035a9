//! The CPU backend's conformance suite (crates/cpu/tests/teacher_forced.rs: teacher-forced logits
//! against llama.cpp's, fixtures made by scripts/ref_logits.py with llama-cpp-python 0.3.36) run
//! on the CUDA backend: at every position, top-1 agreement with llama.cpp's choice and the KL
//! divergence of llama.cpp's distribution (its top 20 plus the rest) from ours.
//!
//! The models are the fixtures' own (`scripts/synth_model.sh --for-fixture`, the SmolLM2 file
//! from scripts/fetch_model.sh); a fixture whose model is absent fails naming the script, and
//! the whole test skips, saying so, without a GPU.

use conformance::{teacher_forced, Figures, Fixture};
use cuda::{CudaBackend, CudaOptions};
use runtime::Backend;

fn compare(fixture: &str, exact: bool) -> Figures {
    let fx = Fixture::load(fixture).unwrap_or_else(|e| panic!("{e}"));
    let path = fx
        .model_path(&format!(
            "run scripts/synth_model.sh --for-fixture crates/cpu/tests/fixtures/{fixture} (or scripts/fetch_model.sh)"
        ))
        .unwrap_or_else(|e| panic!("{e}"));
    // CROSSOVER_CUDA_GEMM_MIN (as in model_agree): prompt chunks of up to that many tokens take
    // the integer products instead of cuBLAS's f16 operands (a diagnostic; default 8).
    let gemm_min_tokens = std::env::var("CROSSOVER_CUDA_GEMM_MIN")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(CudaOptions::default().gemm_min_tokens);
    let opts = CudaOptions {
        ctx_size: fx.tokens.len(),
        max_seqs: 1,
        max_batch_tokens: 128,
        gemm_min_tokens,
        exact: exact.then_some(cuda::exact::AUTO_ORDERS),
        ..CudaOptions::default()
    };
    let mut be = CudaBackend::load(&path, &opts).unwrap_or_else(|e| panic!("gpu load: {e}"));
    let rows = teacher_forced(&mut be, &fx, 128).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(be.kv().blocks_used, 0, "blocks left after release");
    let f = Figures::compare(&fx, &rows);
    eprintln!(
        "on the GPU{} vs llama.cpp: {}",
        if exact { " (exact mode)" } else { "" },
        f.line(&fx)
    );
    assert_eq!(f.non_finite_rows, 0, "non-finite GPU logits");
    f
}

fn check(fixture: &str) {
    let f = compare(fixture, false);
    assert!(f.kl <= 0.01, "mean KL {}", f.kl);
    assert!(
        f.decisive >= 20,
        "only {} decisive rows: too few to judge",
        f.decisive
    );
    assert!(
        f.decisive_top1 >= 0.99,
        "top-1 agreement on decisive rows {}",
        f.decisive_top1
    );
}

#[test]
fn synth_llama_1b_q4_k_m_matches_llama_cpp_on_gpu() {
    if let Err(e) = cuda::available() {
        eprintln!("SKIPPED synth_llama_1b_q4_k_m_matches_llama_cpp_on_gpu: {e}");
        return;
    }
    check("synth_llama1b_q4_k_m_logits.json");
}

#[test]
fn smollm2_q4_1_matches_llama_cpp_on_gpu() {
    if let Err(e) = cuda::available() {
        eprintln!("SKIPPED smollm2_q4_1_matches_llama_cpp_on_gpu: {e}");
        return;
    }
    check("smollm2_q4_1_logits.json");
}

/// Exact mode (crates/cuda/src/exact.rs) gives the CPU backend's logits, which are llama.cpp's
/// bit for bit on both fixtures (crates/cpu/tests/teacher_forced.rs): so must the GPU's.
fn check_exact(fixture: &str) {
    let f = compare(fixture, true);
    assert_eq!(
        f.logit_diff_max, 0.0,
        "{fixture}: exact-mode logits differ from llama.cpp's"
    );
}

#[test]
fn exact_mode_gives_llama_cpps_logits_on_synth_llama_1b() {
    if let Err(e) = cuda::available() {
        eprintln!("SKIPPED exact_mode_gives_llama_cpps_logits_on_synth_llama_1b: {e}");
        return;
    }
    check_exact("synth_llama1b_q4_k_m_logits.json");
}

#[test]
fn exact_mode_gives_llama_cpps_logits_on_smollm2() {
    if let Err(e) = cuda::available() {
        eprintln!("SKIPPED exact_mode_gives_llama_cpps_logits_on_smollm2: {e}");
        return;
    }
    check_exact("smollm2_q4_1_logits.json");
}
