//! `Backend::recycle`: a step writes its logits into the buffer handed back from an earlier
//! step, stale contents and all, and gets the same bits as into a fresh one.

use conformance::Fixture;
use cpu::{CpuBackend, CpuOptions};
use runtime::{Backend, SeqChunk, StepBatch, Want};

#[test]
fn a_recycled_logits_buffer_gives_the_fresh_logits() {
    let fx = Fixture::load("smollm2_q4_1_logits.json").unwrap_or_else(|e| panic!("{e}"));
    let path = fx
        .model_path("run scripts/fetch_model.sh (CI does this first)")
        .unwrap_or_else(|e| panic!("{e}"));
    let opts = CpuOptions {
        threads: Some(2),
        ctx_size: 64,
        max_batch_tokens: 64,
        ..CpuOptions::default()
    };
    // Two sequences with the same 12-token prompt, its last token a step of its own: the
    // first into a fresh buffer, the second into a recycled one poisoned with NaN.
    let prompt = &fx.tokens[..12];
    let mut be = CpuBackend::load(&path, &opts).unwrap_or_else(|e| panic!("load: {e}"));
    let step = |be: &mut CpuBackend, seq: u64, tokens: &[u32], start_pos: usize| {
        be.step(&StepBatch {
            chunks: vec![SeqChunk {
                prompt_len: None,
                seq,
                tokens: tokens.to_vec(),
                start_pos,
                want: Want::Last,
            }],
        })
        .expect("step")
    };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let mut got = Vec::new();
    for seq in 1..=2u64 {
        step(&mut be, seq, &prompt[..11], 0);
        if seq == 2 {
            // A larger buffer than a one-row step needs, full of NaN.
            be.recycle(vec![f32::NAN; 3 * be.config().n_vocab]);
        }
        let o = step(&mut be, seq, &prompt[11..], 11);
        got.push(bits(&o.logits));
    }
    let fresh = got;
    assert_eq!(fresh[0], fresh[1], "seq 2 ran into the recycled buffer");
    assert!(fresh[1].iter().all(|&b| !f32::from_bits(b).is_nan()));
}
