//! The host fallback is the CPU backend's arithmetic, bit for bit, for every weight type of a
//! Q4_K_M mixture (Q4_K, Q6_K, Q5_0, Q8_0), on the prompt path (many tokens per step) and the
//! decode path (one token per step): `cpu-lacking-TYPE` against the normal CPU backend on a
//! synthetic SmolLM2-shaped model with four layers, made here.

use std::sync::Arc;

use cpu::{CpuBackend, CpuOptions};
use gguf::{GgmlType, GgufFile};
use model::synth::{Preset, Shrink, SynthOptions, VocabSource};
use model::{FileType, QuantScheme};
use rand::{Rng, SeedableRng};
use runtime::{Backend, SeqChunk, StepBatch, Want};

fn logits(be: &mut dyn Backend, prompt: &[u32], decode: &[u32]) -> Vec<Vec<f32>> {
    let mut rows = Vec::new();
    let mut pos = 0;
    for (tokens, want) in std::iter::once((prompt, Want::All))
        .chain(decode.iter().map(|t| (std::slice::from_ref(t), Want::Last)))
    {
        let batch = StepBatch {
            chunks: vec![SeqChunk {
                prompt_len: None,
                seq: 1,
                tokens: tokens.to_vec(),
                start_pos: pos,
                want,
            }],
        };
        let out = be.step(&batch).unwrap();
        rows.extend((0..out.n_rows()).map(|i| out.row(i).unwrap().to_vec()));
        pos += tokens.len();
    }
    be.release(1);
    rows
}

#[test]
fn every_type_falls_back_bit_for_bit() {
    let dir = std::env::temp_dir().join(format!("crossover-fallback-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("smol4-q4_k_m.gguf");
    let opts = SynthOptions {
        preset: Preset::Smollm2_135m,
        scheme: QuantScheme::Mixture(FileType::MostlyQ4_K_M),
        seed: 9,
        vocab: VocabSource::ByteLevel,
        chat_template: None,
        shrink: Shrink {
            layers: Some(4),
            heads_div: 1,
        },
        threads: 2,
    };
    let report = model::synth::synth_to_file(&opts, &path, &mut |_| {}).unwrap();
    let file = Arc::new(GgufFile::open(&path).unwrap());
    let copts = CpuOptions {
        threads: Some(2),
        ctx_size: 64,
        max_seqs: 1,
        // The host fallback executor runs ggml's summation order (`runtime::fallback`): the
        // doubles equal a backend in that order bit for bit.
        prompt_order: cpu::SumOrder::Ggml,
        decode_order: cpu::SumOrder::Ggml,
        ..CpuOptions::default()
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
    let n_vocab = report.config.n_vocab as u32;
    // 19 prompt tokens: groups of 4 and a left-over, as the CPU's matmul tiles them.
    let prompt: Vec<u32> = (0..19).map(|_| rng.gen_range(0..n_vocab)).collect();
    let decode: Vec<u32> = (0..4).map(|_| rng.gen_range(0..n_vocab)).collect();
    let mut normal = CpuBackend::from_file(file.clone(), "synth", &copts).unwrap();
    let want = logits(&mut normal, &prompt, &decode);
    assert_eq!(want.len(), prompt.len() + decode.len());
    for ty in [GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q5_0, GgmlType::Q8_0] {
        let n = report.tensors.iter().filter(|t| t.ty == ty).count();
        assert!(n > 0, "the mixture has {ty} tensors");
        let mut double = CpuBackend::lacking_kernel(file.clone(), "synth", &copts, ty).unwrap();
        let got = logits(&mut double, &prompt, &decode);
        for (i, (a, b)) in want.iter().zip(&got).enumerate() {
            let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "lacking {ty}: logits of row {i} differ");
        }
    }
    let _ = std::fs::remove_file(&path);
}
