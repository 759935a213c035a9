//! The GPU's exact mode (crates/cuda/src/exact.rs, kernels/exact.cu) run on the host: the same
//! kernel source compiled as C behind the same driver, held bit for bit against the CPU engine.
//! No GPU needed; the GPU itself runs `model_agree`'s exact test on the device machine.

#![cfg(exact_host)]

mod seed;

use std::path::{Path, PathBuf};

use cpu::{CpuBackend, CpuOptions};
use cuda::exact::host::{HostExact, HostModel};
use cuda::exact::{ExactOps, AUTO_ORDERS};
use cuda::kernels::{act_format, ActFormat, QTYPES};
use model::synth::{Preset, Shrink, SynthOptions, VocabSource};
use model::{FileType, QuantScheme};
use quant::dot::{self, Pool, SumOrder};
use rand::Rng;
use runtime::{Backend, SeqChunk, SeqId, StepBatch, Want};

fn bytes_of<T: Copy>(v: &[T]) -> Vec<u8> {
    // SAFETY: plain numbers, read as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
        .to_vec()
}

/// Every quantized type in both orders, 1 to 9 tokens (Q4_K's groups of 4 and its leftover
/// tokens), against the CPU engine's product on the scalar level (which every level equals).
#[test]
fn exact_products_equal_the_cpu_products() {
    let mut rng = seed::rng("exact_products");
    let pool = Pool::new(1).unwrap();
    let mut ops = HostExact::new();
    let (rows, cols) = (7usize, 512usize);
    let bufs = ops
        .alloc(&[
            4 * 9 * cols,
            9 * cols,
            9 * cols / 32 * 8,
            4 * 9 * rows,
            4 * 8 * (cols / 32) * 9 * 3,
        ])
        .unwrap();
    // Every quantized type the GPU takes, which are the types exact mode mirrors.
    for &(ty, _) in QTYPES {
        let wf: Vec<f32> = (0..rows * cols)
            .map(|_| rng.gen_range(-1.0f32..1.0))
            .collect();
        let w = quant::quantize_to_vec(ty, &wf).unwrap();
        for n_tok in [1usize, 4, 6, 9] {
            let x: Vec<f32> = (0..n_tok * cols)
                .map(|_| rng.gen_range(-2.0f32..2.0) * if rng.gen_bool(0.05) { 8.0 } else { 1.0 })
                .collect();
            for order in SumOrder::ALL {
                let mut want = vec![0f32; n_tok * rows];
                dot::matmul_f32_ordered(ty, &w, rows, cols, &x, n_tok, &mut want, &pool, order)
                    .unwrap();
                ops.write(bufs[0], &bytes_of(&x)).unwrap();
                let fmt: ActFormat = act_format(ty).unwrap();
                ops.quantize(bufs[0], n_tok, cols, fmt, bufs[1], bufs[2])
                    .unwrap();
                let mm = cuda::exact::MatMul {
                    ty,
                    order,
                    w: w.as_ptr() as u64,
                    rows,
                    cols,
                };
                // A scratch of a few rows' integers, so the rows go in several chunks.
                let part = (bufs[4], 4 * 8 * (cols / 32) * n_tok * 3);
                cuda::exact::matmul(&ops, &mm, n_tok, bufs[1], bufs[2], part, bufs[3]).unwrap();
                let mut got = vec![0u8; 4 * n_tok * rows];
                ops.read(bufs[3], &mut got).unwrap();
                let got: Vec<f32> = got
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{ty} {order:?} {n_tok} tokens: element {i}: CPU {a} vs exact {b}"
                    );
                }
            }
        }
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A step of `chunks` on both engines; the logits must be the same bits.
fn same_step(cpu: &mut CpuBackend, ex: &mut HostModel, chunks: Vec<SeqChunk>, what: &str) -> usize {
    let batch = StepBatch { chunks };
    let want = cpu.step(&batch).unwrap().logits;
    let got = ex.step(&batch).unwrap();
    assert_eq!(want.len(), got.len(), "{what}: rows");
    let mut max = 0f32;
    let mut first = None;
    for (i, (a, b)) in want.iter().zip(&got).enumerate() {
        if a.to_bits() != b.to_bits() {
            max = max.max((a - b).abs());
            first.get_or_insert(i);
        }
    }
    assert!(
        first.is_none(),
        "{what}: first different logit at {:?} (CPU {} vs exact {}), max |diff| {max}",
        first,
        first.map_or(0.0, |i| want[i]),
        first.map_or(0.0, |i| got[i])
    );
    want.len()
}

/// Teacher-forced on fresh random tokens: a long prompt (the prompt order, two slices of 64 and
/// the rest) and a short one (the decode order) in one step, then one-token steps of both
/// sequences (the decode order, ggml's single-token attention order).
fn exact_forward_matches(path: &Path, test: &str, prompt: usize, steps: usize) {
    let mut rng = seed::rng(test);
    let ctx = 256;
    let opts = CpuOptions {
        ctx_size: ctx,
        max_seqs: 2,
        max_batch_tokens: 256,
        threads: Some(2),
        ..CpuOptions::default()
    };
    let mut cpu = CpuBackend::load(path, &opts).unwrap();
    let mut ex = HostModel::load(path, ctx, 2, 256, AUTO_ORDERS).unwrap();
    let nv = cpu.config().n_vocab;
    let mut toks = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.gen_range(0..nv as u32)).collect() };
    let (s0, s1): (SeqId, SeqId) = (1, 2);
    let (p0, p1) = (toks(prompt), toks(prompt / 5));
    let rows = same_step(
        &mut cpu,
        &mut ex,
        vec![
            SeqChunk {
                seq: s0,
                tokens: p0.clone(),
                start_pos: 0,
                want: Want::All,
                prompt_len: Some(p0.len()),
            },
            SeqChunk {
                seq: s1,
                tokens: p1.clone(),
                start_pos: 0,
                want: Want::All,
                prompt_len: Some(p1.len()),
            },
        ],
        "prompts",
    );
    let mut n_rows = rows;
    let (mut l0, mut l1) = (p0.len(), p1.len());
    for s in 0..steps {
        let (t0, t1) = (toks(1), toks(1));
        n_rows += same_step(
            &mut cpu,
            &mut ex,
            vec![
                SeqChunk {
                    seq: s0,
                    tokens: t0,
                    start_pos: l0,
                    want: Want::Last,
                    prompt_len: None,
                },
                SeqChunk {
                    seq: s1,
                    tokens: t1,
                    start_pos: l1,
                    want: Want::Last,
                    prompt_len: None,
                },
            ],
            &format!("decode step {s}"),
        );
        l0 += 1;
        l1 += 1;
    }
    println!("{test}: {} logits rows bit-identical", n_rows / nv);
}

#[test]
fn exact_forward_equals_the_cpu_engine_on_smollm2() {
    let path = root().join(".cache/models/smollm2-135m-instruct-q4_1.gguf");
    assert!(
        path.exists(),
        "{} missing: run scripts/fetch_model.sh (scripts/test.sh does)",
        path.display()
    );
    exact_forward_matches(&path, "smollm2", 150, 4);
}

/// A synthetic file of `preset`, shrunk, in Q4_K_M (llama.cpp's mixture: Q4_K and Q6_K, and
/// legacy types for matrices whose width is no multiple of 256), checked as above.
fn synth_matches(preset: Preset, layers: usize, heads_div: usize, name: &str, prompt: usize) {
    let dir = std::env::temp_dir().join(format!("crossover-exact-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}.gguf"));
    let opts = SynthOptions {
        preset,
        scheme: QuantScheme::Mixture(FileType::MostlyQ4_K_M),
        seed: 5,
        vocab: VocabSource::ByteLevel,
        chat_template: None,
        shrink: Shrink {
            layers: Some(layers),
            heads_div,
        },
        threads: 2,
    };
    model::synth::synth_to_file(&opts, &path, &mut |_| {}).unwrap();
    exact_forward_matches(&path, name, prompt, 3);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn exact_forward_equals_the_cpu_engine_on_a_q4_k_m_llama() {
    synth_matches(Preset::Llama32_1b, 3, 4, "llama-q4_k_m", 70);
}

/// Qwen2.5: Q/K/V biases, NeoX rotation, a 896-wide model (its Q4_K_M mixes in legacy types).
#[test]
fn exact_forward_equals_the_cpu_engine_on_a_q4_k_m_qwen() {
    synth_matches(Preset::Qwen25_05b, 2, 1, "qwen-q4_k_m", 70);
}

/// The same at full width and depth: a Llama-3.2-1B-shaped Q4_K_M (16 layers, 32 heads of 64)
/// and one full-width Llama-3.2-3B layer (heads of 128). Slow on two cores (about 80 and 20 s),
/// so run by hand: `cargo test --release -p cuda --test exact_host -- --ignored`.
#[test]
#[ignore]
fn exact_forward_equals_the_cpu_engine_on_a_full_width_llama_1b() {
    synth_matches(Preset::Llama32_1b, 16, 1, "llama-1b-full", 20);
}

#[test]
#[ignore]
fn exact_forward_equals_the_cpu_engine_on_a_full_width_llama_3b_layer() {
    synth_matches(Preset::Llama32_3b, 1, 1, "llama-3b-layer", 70);
}
