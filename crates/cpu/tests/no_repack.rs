//! `CpuOptions::no_repack` (`--no-repack`): every weight stays memory-mapped and runs on the
//! GGUF-layout kernels, and the logits are bit-identical to the default repacked mode's, on a
//! prompt (64-token slices, groups of 4 tokens and the tokens left over) and on decode steps,
//! in both summation orders (`SumOrder`: the GGUF-layout and packed kernels of each order agree).

use std::path::{Path, PathBuf};

use cpu::{CpuBackend, CpuOptions, SumOrder};
use runtime::{Backend, SeqChunk, StepBatch, Want};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The model file and tokens of a teacher-forced fixture (scripts/ref_logits.py).
fn fixture(name: &str) -> (PathBuf, Vec<u32>) {
    let p = repo().join("crates/cpu/tests/fixtures").join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| {
        panic!(
            "fixture {}: {e} (made by scripts/ref_logits.py)",
            p.display()
        )
    });
    let v: serde_json::Value = serde_json::from_str(&text).expect("fixture JSON");
    let file = v["model"]["file"].as_str().expect("model.file");
    let tokens = v["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("token id") as u32)
        .collect();
    let path = repo().join(file);
    assert!(
        path.exists(),
        "model {} is missing: run scripts/fetch_model.sh and scripts/synth_model.sh --for-fixture \
         (CI does this first)",
        path.display()
    );
    (path, tokens)
}

/// Logits of every position: a 67-token prompt in one step, then 3 decode steps.
fn run(
    path: &Path,
    tokens: &[u32],
    no_repack: bool,
    order: SumOrder,
) -> (Vec<Vec<f32>>, usize, String) {
    let opts = CpuOptions {
        threads: Some(2),
        ctx_size: 96,
        max_batch_tokens: 128,
        no_repack,
        prompt_order: order,
        decode_order: order,
        ..CpuOptions::default()
    };
    let mut be = CpuBackend::load(path, &opts).expect("load");
    let mut rows = Vec::new();
    let mut pos = 0;
    for part in [
        &tokens[..67],
        &tokens[67..68],
        &tokens[68..69],
        &tokens[69..70],
    ] {
        let out = be
            .step(&StepBatch {
                chunks: vec![SeqChunk {
                    prompt_len: None,
                    seq: 1,
                    tokens: part.to_vec(),
                    start_pos: pos,
                    want: Want::All,
                }],
            })
            .expect("step");
        pos += part.len();
        for r in 0..out.n_rows() {
            rows.push(out.row(r).expect("row").to_vec());
        }
    }
    (rows, be.owned_weight_bytes(), be.info().device.clone())
}

fn check(fixture_name: &str, order: SumOrder) {
    let (path, tokens) = fixture(fixture_name);
    let (packed, owned, dev) = run(&path, &tokens, false, order);
    let (mapped, owned_nr, dev_nr) = run(&path, &tokens, true, order);
    let file_len = std::fs::metadata(&path).expect("model size").len() as usize;
    // Repacked: the layer and output matrices (most of the file) live in owned memory.
    assert!(
        owned > file_len / 2 && owned <= file_len,
        "repacked: {owned} owned bytes of a {file_len}-byte file"
    );
    assert_eq!(owned_nr, 0, "--no-repack must copy no weight");
    match quant::dot::best_isa() {
        quant::dot::Isa::Avx512 | quant::dot::Isa::Avx2 => {
            assert!(
                dev.contains("repacked") && !dev.contains("not repacked"),
                "{dev}"
            )
        }
        _ => assert!(dev.contains("not repacked"), "{dev}"),
    }
    assert!(dev_nr.contains("memory-mapped"), "{dev_nr}");
    assert_eq!(packed.len(), 70);
    assert_eq!(mapped.len(), 70);
    for (p, (a, b)) in packed.iter().zip(&mapped).enumerate() {
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert_eq!(
                x.to_bits(),
                y.to_bits(),
                "{fixture_name} ({order} order): position {p}, logit {i}: repacked {x} vs no-repack {y}"
            );
        }
    }
}

#[test]
fn no_repack_gives_bit_identical_logits_smollm2() {
    check("smollm2_q4_1_logits.json", SumOrder::Block);
}

#[test]
fn no_repack_gives_bit_identical_logits_smollm2_ggml_order() {
    check("smollm2_q4_1_logits.json", SumOrder::Ggml);
}

#[test]
fn no_repack_gives_bit_identical_logits_1b_q4_k_m() {
    check("synth_llama1b_q4_k_m_logits.json", SumOrder::Block);
}
