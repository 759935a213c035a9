//! Bit-exact agreement with the references on fixtures made by `scripts/gen_quant_fixtures.py`:
//! dequantization of every type against the PyPI `gguf` package (`gguf.quants`; on bytes it
//! quantized and on random block bytes) and of Q8_1/Q8_K against ggml, and quantization to F16,
//! BF16 and the legacy block types against `gguf`.

mod common;

use common::{bit_diff, cases, REGEN};
use gguf::GgmlType;
use quant::{dequantize, quantize_to_vec};

#[test]
fn dequantize_matches_references_bit_for_bit() {
    let cases = cases();
    let mut failures = Vec::new();
    for c in &cases {
        let Some(expected) = &c.dequant else { continue };
        assert_eq!(expected.len(), c.n, "{}: fixture length", c.name);
        let mut out = vec![0f32; c.n];
        if let Err(e) = dequantize(c.ty, &c.quant, &mut out) {
            failures.push(format!("{}: {e}", c.name));
            continue;
        }
        if let Some((i, ours, theirs, count)) = bit_diff(&out, expected) {
            failures.push(format!(
                "{}: {count} of {} elements differ; first at {i}: ours {:e} ({ours:#010x}) vs gguf {:e} ({theirs:#010x})",
                c.name, c.n, f32::from_bits(ours), f32::from_bits(theirs)
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "dequantize mismatches:\n{}",
        failures.join("\n")
    );

    // Every type the project needs must be covered by some fixture.
    use GgmlType::*;
    for ty in [
        F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2K, Q3K, Q4K, Q5K, Q6K,
    ] {
        assert!(
            cases.iter().any(|c| c.ty == ty && c.dequant.is_some()),
            "no dequantize fixture for {ty}; {REGEN}"
        );
    }
}

#[test]
fn quantize_matches_gguf_byte_for_byte() {
    let mut failures = Vec::new();
    let mut covered = Vec::new();
    for c in cases().iter().filter(|c| c.source == "gguf") {
        let Some(input) = &c.input else { continue };
        covered.push(c.ty);
        let ours = quantize_to_vec(c.ty, input).unwrap_or_else(|e| panic!("{}: {e}", c.name));
        if ours != c.quant {
            let bs = c.ty.type_size();
            let bad: Vec<usize> = (0..ours.len() / bs)
                .filter(|&b| ours[b * bs..(b + 1) * bs] != c.quant[b * bs..(b + 1) * bs])
                .collect();
            failures.push(format!(
                "{}: {} of {} blocks differ, first block {}",
                c.name,
                bad.len(),
                ours.len() / bs,
                bad[0]
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "quantize mismatches:\n{}",
        failures.join("\n")
    );
    use GgmlType::*;
    for ty in [F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0] {
        assert!(
            covered.contains(&ty),
            "no gguf quantize fixture for {ty}; {REGEN}"
        );
    }
}
