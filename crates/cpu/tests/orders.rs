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
    let mut all = fed(
        orders,
        &[
            (0..40, None),
            (40..41, None),
            (41..42, None),
            (42..43, None),
        ],
    );
    let decode = all.split_off(40);
    (all, decode)
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

/// Every logit row of the fixture's tokens fed as `parts` (token ranges, each one step of one
/// chunk that says `prompt_len`), with the (prompt, decode) orders `orders`.
fn fed(
    orders: (SumOrder, SumOrder),
    parts: &[(std::ops::Range<usize>, Option<usize>)],
) -> Vec<Vec<u32>> {
    let fx = Fixture::load("smollm2_q4_1_logits.json").unwrap_or_else(|e| panic!("{e}"));
    let path = fx
        .model_path("run scripts/fetch_model.sh (CI does this first)")
        .unwrap_or_else(|e| panic!("{e}"));
    let opts = CpuOptions {
        threads: Some(2),
        ctx_size: 128,
        max_batch_tokens: 128,
        prompt_order: orders.0,
        decode_order: orders.1,
        ..CpuOptions::default()
    };
    let mut be = CpuBackend::load(&path, &opts).unwrap_or_else(|e| panic!("load: {e}"));
    let mut out = Vec::new();
    for (r, prompt_len) in parts {
        let o = be
            .step(&StepBatch {
                chunks: vec![SeqChunk {
                    seq: 1,
                    tokens: fx.tokens[r.clone()].to_vec(),
                    start_pos: r.start,
                    want: Want::All,
                    prompt_len: *prompt_len,
                }],
            })
            .expect("step");
        for i in 0..o.n_rows() {
            out.push(o.row(i).expect("row").iter().map(|v| v.to_bits()).collect());
        }
    }
    out
}

/// Session 9: the order of a prompt's chunks follows the prompt's length (`prompt_len`), not
/// the chunks': under `SHORT_PROMPT` tokens the decode order, else llama.cpp's, however the
/// prompt is split.
#[test]
fn short_prompts_take_the_decode_order_whatever_their_chunks() {
    use runtime::backend::SHORT_PROMPT;
    let (ggml, block) = (
        (SumOrder::Ggml, SumOrder::Ggml),
        (SumOrder::Block, SumOrder::Block),
    );
    // A prompt of 12 tokens takes the decode order, in one chunk or in three: the rows of an
    // engine that runs the whole-block order everywhere.
    let short = 12;
    assert!(short < SHORT_PROMPT);
    let one = fed(AUTO_ORDERS, &[(0..short, Some(short))]);
    assert_eq!(one.len(), short);
    assert_eq!(
        one,
        fed(block, &[(0..short, None)]),
        "short prompt: decode order"
    );
    assert_ne!(
        one,
        fed(ggml, &[(0..short, None)]),
        "the orders should differ on SmolLM2"
    );
    let split = fed(
        AUTO_ORDERS,
        &[
            (0..5, Some(short)),
            (5..6, Some(short)),
            (6..short, Some(short)),
        ],
    );
    assert_eq!(
        split,
        fed(block, &[(0..5, None), (5..6, None), (6..short, None)])
    );
    // A prompt of SHORT_PROMPT or more keeps llama.cpp's order in every chunk, a one-token
    // remainder chunk included (the scheduler may split it so under load).
    let long = SHORT_PROMPT + 8;
    let parts = [
        (0..20, Some(long)),
        (20..long - 1, Some(long)),
        (long - 1..long, Some(long)),
    ];
    let rows = fed(AUTO_ORDERS, &parts);
    assert_eq!(rows.len(), long);
    let ggml_parts: Vec<_> = parts.iter().map(|(r, _)| (r.clone(), None)).collect();
    // `None` judges a one-token chunk as decode, so the reference runs ggml everywhere.
    assert_eq!(
        rows,
        fed(ggml, &ggml_parts),
        "long prompt: llama.cpp's order in every chunk"
    );
}
