//! Teacher-forced logits of the CPU engine against llama.cpp's (fixtures made by
//! scripts/ref_logits.py with llama-cpp-python 0.3.36): at every position, top-1 agreement and
//! the KL divergence of llama.cpp's distribution from ours, in both summation orders of the
//! 32-element block types: `ggml` (llama.cpp's own, bit-identical logits; the engine's default
//! for prompts) and `block` (whole-block integer sums, one f32 step per block; the engine's
//! default for one-token decode steps).

use conformance::{teacher_forced, Figures, Fixture};
use cpu::{CpuBackend, CpuOptions, SumOrder, AUTO_ORDERS};
use quant::dot::best_isa;
use runtime::Backend;

/// Runs the fixture's tokens through the engine in `chunk`-token chunks with the (prompt,
/// decode) product orders `orders` and returns the comparison with llama.cpp.
fn compare(fixture: &str, orders: (SumOrder, SumOrder), chunk: usize) -> Figures {
    let fx = Fixture::load(fixture).unwrap_or_else(|e| panic!("{e}"));
    let path = fx
        .model_path("run scripts/fetch_model.sh or scripts/synth_model.sh --for-fixture (CI does this first)")
        .unwrap_or_else(|e| panic!("{e}"));
    let opts = CpuOptions {
        ctx_size: fx.tokens.len(),
        max_batch_tokens: 128,
        prompt_order: orders.0,
        decode_order: orders.1,
        ..CpuOptions::default()
    };
    let mut be = CpuBackend::load(&path, &opts).unwrap_or_else(|e| panic!("load: {e}"));
    assert_eq!((be.prompt_order(), be.decode_order()), orders);
    let rows = teacher_forced(&mut be, &fx, chunk).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(be.kv().blocks_used, 0, "blocks left after release");
    let f = Figures::compare(&fx, &rows);
    eprintln!(
        "{} prompt / {} decode order, {chunk}-token chunks: {}",
        orders.0.name(),
        orders.1.name(),
        f.line(&fx)
    );
    assert_eq!(f.non_finite_rows, 0, "non-finite logits");
    f
}

/// Every product in `order`.
fn all(order: SumOrder) -> (SumOrder, SumOrder) {
    (order, order)
}

/// Every level mirrors llama.cpp's rounding op by op (docs/perf/cpu.md): the AVX-512 kernels
/// follow llama.cpp's AVX-512 build (where the fixtures were made), and the AVX2, NEON and
/// scalar products give the AVX-512 ones' bits, their attention taking the scalar primitives.
/// So every logit is llama.cpp's, on any machine.
fn assert_bit_identical(f: &Figures) {
    assert_eq!(
        f.logit_diff_max,
        0.0,
        "ggml order on {}: logits differ from llama.cpp's",
        best_isa().name()
    );
}

#[test]
fn smollm2_q4_1_matches_llama_cpp() {
    // The engine's default orders (`AUTO_ORDERS`): prompts, as here, in llama.cpp's.
    let f = compare("smollm2_q4_1_logits.json", AUTO_ORDERS, 128);
    // Issue 3's bounds. Measured: top-1 1.0000, KL 0, |logit diff| max 0 (`cargo test --release
    // -p cpu --test teacher_forced -- --nocapture`).
    assert!(f.top1 >= 0.98, "top-1 agreement {}", f.top1);
    assert!(f.kl <= 0.01, "mean KL {}", f.kl);
    assert_bit_identical(&f);
}

#[test]
fn smollm2_q4_1_block_order_agrees_with_llama_cpp() {
    // Every SmolLM2 matrix is Q4_1 or Q8_0: the whole-block order changes every product's
    // last-bit rounding, and the model carries such differences forward (each product's input
    // is requantized to 8 bits per 32 values and the KV cache rounded to f16, so a last-bit
    // change can move a quantized value by a whole step). Measured (docs/perf/cpu.md
    // "Session 6"; the scalar reference engine, CROSSOVER_ISA=scalar, gives the same figures):
    // top-1 0.9647, decisive top-1 0.9882 (5 of 424 rows), mean KL 2.21e-3, |logit diff| mean
    // 0.135, max 0.88. The bounds keep a margin over that, and sit far below what a wrong
    // product gives (garbage logits: top-1 near 0, KL of several nats).
    let f = compare("smollm2_q4_1_logits.json", all(SumOrder::Block), 128);
    assert!(f.top1 >= 0.95, "top-1 agreement {}", f.top1);
    assert!(
        f.decisive_top1 >= 0.98,
        "decisive top-1 agreement {}",
        f.decisive_top1
    );
    assert!(f.kl <= 5e-3, "mean KL {}", f.kl);
}

#[test]
fn synth_llama_1b_q4_k_m_matches_llama_cpp() {
    // The model is made by `scripts/synth_model.sh --for-fixture` (scripts/test.sh runs it); the
    // fixture pins its sha256.
    let f = compare("synth_llama1b_q4_k_m_logits.json", AUTO_ORDERS, 128);
    // Issue 3's bounds. Measured: top-1 1.0000, KL 0, logits bit-identical: the repacked Q4_K
    // gemm/gemv and tiled Q6_K orders of llama.cpp are mirrored (docs/perf/cpu.md). Random
    // weights give flat distributions where any rounding difference flips near-ties (llama.cpp
    // agrees with itself, batched vs token by token, on only 0.953), so this bound checks
    // exactly that mirroring.
    assert!(f.kl <= 0.01, "mean KL {}", f.kl);
    assert!(f.top1 >= 0.98, "top-1 agreement {}", f.top1);
    assert_bit_identical(&f);
}

#[test]
fn synth_llama_1b_q4_k_m_block_order_agrees_with_llama_cpp() {
    // Its matrices are Q4_K and Q6_K, which have one order each (the summation order only
    // concerns the 32-element block types): the logits stay llama.cpp's, bit for bit.
    let f = compare(
        "synth_llama1b_q4_k_m_logits.json",
        all(SumOrder::Block),
        128,
    );
    assert!(f.top1 >= 0.99, "top-1 agreement {}", f.top1);
    assert!(
        f.decisive_top1 >= 0.99,
        "decisive top-1 agreement {}",
        f.decisive_top1
    );
    assert!(f.kl <= 1e-3, "mean KL {}", f.kl);
    assert_bit_identical(&f);
}

#[test]
fn smollm2_q4_1_token_by_token_in_the_default_decode_order_agrees_with_llama_cpp() {
    // One token per step: every product takes the default decode order (whole-block sums) and
    // the attention its one-token order, against llama.cpp's logits of the whole text at once.
    // Measured (docs/perf/cpu.md "Session 6, lead"): top-1 0.9801, decisive 0.9929, mean KL
    // 2.30e-3; the bounds are the Block order's above.
    let f = compare("smollm2_q4_1_logits.json", AUTO_ORDERS, 1);
    assert!(f.top1 >= 0.95, "top-1 agreement {}", f.top1);
    assert!(
        f.decisive_top1 >= 0.98,
        "decisive top-1 agreement {}",
        f.decisive_top1
    );
    assert!(f.kl <= 5e-3, "mean KL {}", f.kl);
}
