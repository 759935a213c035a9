//! The product order is chosen per chunk (`CpuOptions::prompt_order` for chunks of two or more
//! tokens, `decode_order` for one-token chunks): on SmolLM2 (every matrix a 32-element block
//! type, so the two orders round differently), the default policy gives a prompt the logits
//! of llama.cpp's order everywhere bit for bit, and its decode steps the logits of an engine
//! that runs the whole-block order on the same cache, not llama.cpp order's.

use conformance::Fixture;
use cpu::{CpuBackend, CpuOptions, SumOrder, AUTO_ORDERS};
use runtime::{Backend, SeqChunk, StepBatch, Want};

/// Every logit row of a 40-token prompt (one chunk) and then of 3 one-token steps, with the
/// (prompt, decode) orders `orders`.
fn rows(orders: (SumOrder, SumOrder)) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let fx = Fixture::load("smollm2_q4_1_logits.json").unwrap_or_else(|e| panic!("{e}"));
    let path = fx
        .model_path("run scripts/fetch_model.sh (CI does this first)")
        .unwrap_or_else(|e| panic!("{e}"));
    let opts = CpuOptions {
        threads: Some(2),
        ctx_size: 64,
        max_batch_tokens: 64,
        prompt_order: orders.0,
        decode_order: orders.1,
        ..CpuOptions::default()
    };
    let mut be = CpuBackend::load(&path, &opts).unwrap_or_else(|e| panic!("load: {e}"));
    let mut out = (Vec::new(), Vec::new());
    let mut pos = 0;
    for (i, part) in [
        &fx.tokens[..40],
        &fx.tokens[40..41],
        &fx.tokens[41..42],
        &fx.tokens[42..43],
    ]
    .into_iter()
    .enumerate()
    {
        let o = be
            .step(&StepBatch {
                chunks: vec![SeqChunk {
                    seq: 1,
                    tokens: part.to_vec(),
                    start_pos: pos,
                    want: Want::All,
                }],
            })
            .expect("step");
        pos += part.len();
        let dst = if i == 0 { &mut out.0 } else { &mut out.1 };
        for r in 0..o.n_rows() {
            dst.push(o.row(r).expect("row").iter().map(|v| v.to_bits()).collect());
        }
    }
    out
}

#[test]
fn prompts_take_the_prompt_order_and_decode_steps_the_decode_order() {
    assert_eq!(AUTO_ORDERS, (SumOrder::Ggml, SumOrder::Block));
    let (auto_prompt, auto_decode) = rows(AUTO_ORDERS);
    let (ggml_prompt, ggml_decode) = rows((SumOrder::Ggml, SumOrder::Ggml));
    let (block_prompt, _) = rows((SumOrder::Block, SumOrder::Block));
    let (_, mixed_decode) = rows((SumOrder::Ggml, SumOrder::Block));
    assert_eq!(auto_prompt.len(), 40);
    assert_eq!(auto_decode.len(), 3);
    assert_eq!(
        auto_prompt, ggml_prompt,
        "the default prompt order is ggml's"
    );
    assert_ne!(
        auto_prompt, block_prompt,
        "the two orders should round SmolLM2's products differently"
    );
    assert_eq!(auto_decode, mixed_decode, "decode steps take decode_order");
    assert_ne!(
        auto_decode, ggml_decode,
        "decode steps in the default policy should not take ggml's order"
    );
}
