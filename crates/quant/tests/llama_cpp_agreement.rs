//! Agreement with llama.cpp's own quantizer on the fixtures of `scripts/gen_quant_fixtures.py`:
//! `llama_model_quantize` (no importance matrix, `pure`) for the K-quants, which the `gguf`
//! package cannot quantize, and for the legacy types again; ggml's reference quantizers for the
//! activation formats Q8_1 and Q8_K.

mod common;

use common::{cases, Case, REGEN};
use gguf::GgmlType;
use quant::{dequantize_to_vec, quantize_to_vec};

fn rmse(a: &[f32], b: &[f32]) -> f64 {
    let s: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    (s / a.len() as f64).sqrt()
}

/// Bit-identical output is the aim, and what this test demands. It also reports the round-trip
/// RMSE of both quantizers, which is what would matter if the bytes ever differed.
#[test]
fn quantize_matches_llama_cpp_byte_for_byte() {
    let cases: Vec<Case> = cases()
        .into_iter()
        .filter(|c| c.source == "llama.cpp")
        .collect();
    use GgmlType::*;
    for ty in [
        Q2K, Q3K, Q4K, Q5K, Q6K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q8K,
    ] {
        assert!(
            cases.iter().any(|c| c.ty == ty),
            "no llama.cpp fixture for {ty}: {REGEN} on a machine with llama-cpp-python"
        );
    }
    let mut failures = Vec::new();
    for c in &cases {
        let input = c.input.as_ref().expect("llama.cpp cases have an input");
        let ours = quantize_to_vec(c.ty, input).unwrap_or_else(|e| panic!("{}: {e}", c.name));
        assert_eq!(ours.len(), c.quant.len(), "{}: size", c.name);
        let bs = c.ty.type_size();
        let blocks = ours.len() / bs;
        let differing = (0..blocks)
            .filter(|&b| ours[b * bs..(b + 1) * bs] != c.quant[b * bs..(b + 1) * bs])
            .count();
        let ours_deq = dequantize_to_vec(c.ty, &ours, c.n).expect("dequantize ours");
        let ref_deq = dequantize_to_vec(c.ty, &c.quant, c.n).expect("dequantize llama.cpp's");
        let (r_ours, r_ref) = (rmse(input, &ours_deq), rmse(input, &ref_deq));
        eprintln!(
            "{:>5}: {differing:>3}/{blocks:<3} blocks differ; round-trip RMSE ours {r_ours:.6e}, llama.cpp {r_ref:.6e}, ratio {:.6}",
            c.ty.name(),
            r_ours / r_ref
        );
        if differing != 0 {
            failures.push(format!(
                "{}: {differing} of {blocks} blocks differ (RMSE ratio {:.6})",
                c.name,
                r_ours / r_ref
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "llama.cpp mismatches:\n{}",
        failures.join("\n")
    );
}
