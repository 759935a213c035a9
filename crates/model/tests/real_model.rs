//! The default model (SmolLM2-135M-Instruct Q4_1) read by this crate agrees with what the `gguf`
//! Python package reads from it (fixture by scripts/model_fixtures.py).

mod common;

use gguf::GgmlType;
use model::{Arch, Model, RopeScalingKind, RopeStyle};
use serde_json::Value;

fn fixture() -> Value {
    let p = common::repo().join("crates/model/tests/fixtures/smollm2_layout.json");
    serde_json::from_str(&std::fs::read_to_string(&p).expect("fixture")).expect("json")
}

fn open() -> Model {
    let path = common::fetched(
        "models/smollm2-135m-instruct-q4_1.gguf",
        "scripts/fetch_model.sh",
    );
    Model::open(path).expect("SmolLM2 is a model this project runs")
}

#[test]
fn smollm2_config_matches_the_reference_reader() {
    let fx = fixture();
    let md = &fx["metadata"];
    let u = |k: &str| md[k].as_u64().unwrap_or_else(|| panic!("{k}")) as usize;
    let f = |k: &str| md[k].as_f64().unwrap_or_else(|| panic!("{k}")) as f32;
    let m = open();
    let c = &m.config;
    assert_eq!(md["general.architecture"], "llama");
    assert_eq!(c.arch, Arch::Llama);
    assert_eq!(c.n_layer, u("llama.block_count"));
    assert_eq!(c.n_embd, u("llama.embedding_length"));
    assert_eq!(c.n_head, u("llama.attention.head_count"));
    assert_eq!(c.n_head_kv, u("llama.attention.head_count_kv"));
    assert_eq!(c.n_ff, u("llama.feed_forward_length"));
    assert_eq!(c.n_ctx_train, u("llama.context_length"));
    assert_eq!(c.n_rot, u("llama.rope.dimension_count"));
    assert_eq!(c.head_dim, c.n_embd / c.n_head);
    assert_eq!(c.n_vocab, fx["n_tokens"].as_u64().unwrap() as usize);
    assert_eq!(c.n_vocab, u("llama.vocab_size"));
    assert_eq!(c.rms_norm_eps, f("llama.attention.layer_norm_rms_epsilon"));
    assert_eq!(c.rope_freq_base, f("llama.rope.freq_base"));
    assert_eq!(c.file_type, Some(u("general.file_type") as u32));
    assert_eq!(c.name.as_deref(), md["general.name"].as_str());
    assert_eq!(c.rope_style, RopeStyle::Normal);
    assert_eq!(c.rope_scaling.kind, RopeScalingKind::None);
    let names: Vec<&str> = fx["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t[0].as_str().unwrap())
        .collect();
    assert_eq!(c.tied_output, !names.contains(&"output.weight"));
    assert_eq!(c.rope_freqs, names.contains(&"rope_freqs.weight"));
    assert_eq!(c.qkv_bias, names.contains(&"blk.0.attn_q.bias"));
}

#[test]
fn smollm2_weights_match_the_reference_reader() {
    let fx = fixture();
    let m = open();
    let mut seen = 0;
    let mut check = |t: &gguf::TensorInfo| {
        let row = fx["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r[0] == t.name.as_str())
            .unwrap_or_else(|| panic!("{} not in the fixture", t.name));
        let ty = GgmlType::from_name(row[1].as_str().unwrap()).expect("type name");
        let dims: Vec<u64> = row[2]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!((t.ty, &t.dims), (ty, &dims), "{}", t.name);
        seen += 1;
    };
    let w = &m.weights;
    check(&w.token_embd);
    check(&w.output_norm);
    check(&w.output);
    for l in &w.layers {
        for t in model::LayerTensor::ALL {
            if let Some(t) = l.get(t) {
                check(t);
            }
        }
    }
    // Every tensor of the file is used (the tied output counted once more).
    assert_eq!(seen, fx["tensors"].as_array().unwrap().len() + 1);
    assert_eq!(m.weights.layers.len(), m.config.n_layer);
    assert_eq!(
        m.weights.n_bytes(),
        m.file.tensors().iter().map(|t| t.n_bytes()).sum::<u64>()
    );
}

#[test]
fn smollm2_op_list_covers_every_weight_once_per_use() {
    let m = open();
    let ops = model::ops(&m.config, &m.weights, 7, 7, GgmlType::F16);
    let matmuls: Vec<_> = ops
        .iter()
        .filter(|o| o.kind == model::OpKind::MatMul)
        .collect();
    // 7 projections per block, plus the LM head.
    assert_eq!(matmuls.len(), 7 * m.config.n_layer + 1);
    for o in &matmuls {
        let w = &o.inputs[0];
        // A matmul consumes activations as long as the weight's rows and makes one value per row.
        assert_eq!(o.inputs[1][0], w[0], "{}", o.name);
        assert_eq!(o.output[0], w[1], "{}", o.name);
    }
    let head = matmuls.last().unwrap();
    assert_eq!(head.name, "token_embd.weight", "tied output");
    assert_eq!(head.output, vec![m.config.n_vocab as u64, 1]);
    let att: Vec<_> = ops
        .iter()
        .filter(|o| o.kind == model::OpKind::Attention)
        .collect();
    assert_eq!(att.len(), m.config.n_layer);
    assert!(att.iter().all(|o| o.ty == GgmlType::F16));
}
