//! Files that are not models this project runs get a typed error naming the key or tensor, the
//! expected and the found value. Each case edits one thing in an otherwise valid tiny model.

mod common;

use gguf::{GgmlType, GgufFile, GgufWriter, Metadata, Value};
use model::mixture::{FileType, QuantScheme};
use model::synth::Preset;
use model::{Model, ModelError};

/// A tensor as the rebuilt file will hold it.
struct T {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    data: Vec<u8>,
}

/// A valid tiny model (qwen2: it has every optional feature but rope factors) to edit.
fn base(preset: Preset) -> (Metadata, Vec<T>) {
    let (path, _) = common::tiny(preset, QuantScheme::Mixture(FileType::MostlyQ8_0), 9);
    let f = GgufFile::open(&path).unwrap();
    let md = f.metadata().clone();
    let ts = f
        .tensors()
        .iter()
        .map(|t| T {
            name: t.name.clone(),
            dims: t.dims.clone(),
            ty: t.ty,
            data: f.tensor_data(t).to_vec(),
        })
        .collect();
    std::fs::remove_file(&path).ok();
    (md, ts)
}

/// Random bytes of the right size for a shape and type (F32 values drawn in [-1, 1)).
fn data_for(dims: &[u64], ty: GgmlType, seed: u64) -> Vec<u8> {
    use rand::{Rng, SeedableRng};
    let n: u64 = dims.iter().product();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let vals: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    quant::quantize_to_vec(ty, &vals).unwrap()
}

fn build(md: &Metadata, ts: &[T]) -> Result<Model, ModelError> {
    let mut w = GgufWriter::with_metadata(md.clone());
    for t in ts {
        w.add_tensor(t.name.clone(), &t.dims, t.ty, t.data.clone())
            .unwrap();
    }
    Model::from_file(GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap())
}

fn set_tensor(ts: &mut [T], name: &str, dims: &[u64], ty: GgmlType) {
    let t = ts.iter_mut().find(|t| t.name == name).expect(name);
    t.dims = dims.to_vec();
    t.ty = ty;
    t.data = data_for(dims, ty, 1);
}

#[test]
fn the_unedited_base_is_valid() {
    for p in [Preset::Qwen25_05b, Preset::Llama31_8b] {
        let (md, ts) = base(p);
        build(&md, &ts).unwrap();
    }
}

#[test]
fn wrong_shape_names_tensor_expected_and_found() {
    let (md, mut ts) = base(Preset::Qwen25_05b);
    let k = ts.iter().find(|t| t.name == "blk.1.attn_k.weight").unwrap();
    let expected = k.dims.clone();
    let wrong = vec![expected[0], expected[1] * 2];
    set_tensor(&mut ts, "blk.1.attn_k.weight", &wrong, GgmlType::Q8_0);
    match build(&md, &ts) {
        Err(ModelError::TensorShape {
            name,
            expected: e,
            found,
        }) => {
            assert_eq!(name, "blk.1.attn_k.weight");
            assert_eq!(e, expected);
            assert_eq!(found, wrong);
        }
        other => panic!("{other:?}"),
    }
    let msg = build(&md, &ts).unwrap_err().to_string();
    assert!(msg.contains("blk.1.attn_k.weight"), "{msg}");
}

#[test]
fn wrong_bias_and_norm_shapes() {
    for name in [
        "blk.0.attn_v.bias",
        "output_norm.weight",
        "blk.1.ffn_norm.weight",
    ] {
        let (md, mut ts) = base(Preset::Qwen25_05b);
        let dims = ts.iter().find(|t| t.name == name).unwrap().dims.clone();
        set_tensor(&mut ts, name, &[dims[0] + 32], GgmlType::F32);
        match build(&md, &ts) {
            Err(ModelError::TensorShape { name: n, .. }) => assert_eq!(n, name),
            other => panic!("{name}: {other:?}"),
        }
    }
}

#[test]
fn a_wrong_vocabulary_size_is_caught() {
    let (md, mut ts) = base(Preset::Llama31_8b);
    let dims = ts
        .iter()
        .find(|t| t.name == "output.weight")
        .unwrap()
        .dims
        .clone();
    set_tensor(
        &mut ts,
        "output.weight",
        &[dims[0], dims[1] + 1],
        GgmlType::Q8_0,
    );
    match build(&md, &ts) {
        Err(ModelError::TensorShape { name, found, .. }) => {
            assert_eq!(name, "output.weight");
            assert_eq!(found, vec![dims[0], dims[1] + 1]);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn missing_tensors() {
    for name in [
        "blk.1.ffn_down.weight",
        "blk.0.attn_k.bias",
        "output_norm.weight",
    ] {
        let (md, mut ts) = base(Preset::Qwen25_05b);
        ts.retain(|t| t.name != name);
        match build(&md, &ts) {
            Err(ModelError::MissingTensor { name: n, .. }) => assert_eq!(n, name),
            other => panic!("{name}: {other:?}"),
        }
    }
    let (md, mut ts) = base(Preset::Qwen25_05b);
    ts.retain(|t| t.name != "token_embd.weight");
    assert!(matches!(
        build(&md, &ts),
        Err(ModelError::MissingTensor { name, .. }) if name == "token_embd.weight"
    ));
}

#[test]
fn tensors_the_forward_pass_would_ignore_are_refused() {
    // A block beyond block_count, a fused QKV, an output bias, a bias on one layer only.
    let cases: [(&str, Vec<u64>); 4] = [
        ("blk.2.attn_norm.weight", vec![448]),
        ("blk.0.attn_qkv.weight", vec![448, 576]),
        ("output.bias", vec![258]),
        ("blk.0.attn_output.bias", vec![448]),
    ];
    for (name, dims) in cases {
        let (md, mut ts) = base(Preset::Qwen25_05b);
        assert_eq!(ts[0].dims[0], 448, "qwen2.5 at heads/2 is 448 wide");
        ts.push(T {
            name: name.into(),
            dims: dims.clone(),
            ty: GgmlType::F32,
            data: data_for(&dims, GgmlType::F32, 2),
        });
        match build(&md, &ts) {
            Err(ModelError::UnsupportedLayout(why)) => assert!(why.contains(name), "{why}"),
            other => panic!("{name}: {other:?}"),
        }
    }
    // Biases on block 1 only (llama has none on block 0).
    let (md, mut ts) = base(Preset::Llama31_8b);
    let n = ts
        .iter()
        .find(|t| t.name == "blk.1.attn_q.weight")
        .unwrap()
        .dims[1];
    ts.push(T {
        name: "blk.1.attn_q.bias".into(),
        dims: vec![n],
        ty: GgmlType::F32,
        data: data_for(&[n], GgmlType::F32, 3),
    });
    match build(&md, &ts) {
        Err(ModelError::UnsupportedLayout(why)) => {
            assert!(why.contains("blk.1.attn_q.bias"), "{why}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn unsupported_tensor_types_list_the_supported_ones() {
    let (md, mut ts) = base(Preset::Llama31_8b);
    let dims = ts
        .iter()
        .find(|t| t.name == "blk.0.ffn_up.weight")
        .unwrap()
        .dims
        .clone();
    set_tensor(&mut ts, "blk.0.ffn_up.weight", &dims, GgmlType::Q8_1);
    let e = build(&md, &ts).unwrap_err();
    assert!(
        matches!(&e, ModelError::UnsupportedTensorType { name, ty: GgmlType::Q8_1, .. } if name == "blk.0.ffn_up.weight"),
        "{e:?}"
    );
    let msg = e.to_string();
    for t in model::MATRIX_TYPES {
        assert!(msg.contains(t.name()), "{msg}");
    }
    // Norms must be F32.
    let (md, mut ts) = base(Preset::Llama31_8b);
    let dims = ts
        .iter()
        .find(|t| t.name == "blk.1.attn_norm.weight")
        .unwrap()
        .dims
        .clone();
    set_tensor(&mut ts, "blk.1.attn_norm.weight", &dims, GgmlType::F16);
    assert!(matches!(
        build(&md, &ts),
        Err(ModelError::UnsupportedTensorType { name, ty: GgmlType::F16, .. }) if name == "blk.1.attn_norm.weight"
    ));
}

#[test]
fn bad_metadata() {
    let arch = |md: &mut Metadata| md.insert("general.architecture", "gemma3");
    let (mut md, ts) = base(Preset::Llama31_8b);
    arch(&mut md);
    let e = build(&md, &ts).unwrap_err();
    assert!(
        matches!(&e, ModelError::UnsupportedArch { found, .. } if found == "gemma3"),
        "{e:?}"
    );
    assert!(e.to_string().contains("llama, qwen2"), "{e}");

    // Key/value heads that do not divide the query heads.
    let (mut md, ts) = base(Preset::Llama31_8b);
    md.insert("llama.attention.head_count_kv", 3u32);
    let e = build(&md, &ts).unwrap_err();
    assert!(
        matches!(&e, ModelError::InvalidValue { key, .. } if key == "llama.attention.head_count_kv"),
        "{e:?}"
    );

    // A required key missing.
    let (mut md, ts) = base(Preset::Llama31_8b);
    md.remove("llama.attention.layer_norm_rms_epsilon");
    let e = build(&md, &ts).unwrap_err().to_string();
    assert!(e.contains("llama.attention.layer_norm_rms_epsilon"), "{e}");

    // A key with the wrong type.
    let (mut md, ts) = base(Preset::Llama31_8b);
    md.insert("llama.block_count", "two");
    let e = build(&md, &ts).unwrap_err().to_string();
    assert!(e.contains("llama.block_count"), "{e}");

    // A rope scaling this project does not run.
    let (mut md, ts) = base(Preset::Llama31_8b);
    md.insert("llama.rope.scaling.type", "yarn");
    let e = build(&md, &ts).unwrap_err();
    assert!(
        matches!(&e, ModelError::UnsupportedRopeScaling { found, .. } if found == "yarn"),
        "{e:?}"
    );

    // Per-layer head counts must agree.
    let (mut md, ts) = base(Preset::Llama31_8b);
    md.insert("llama.attention.head_count", Value::from(vec![4u32, 8]));
    let e = build(&md, &ts).unwrap_err();
    assert!(matches!(&e, ModelError::UnsupportedLayout(_)), "{e:?}");
    let (mut md, ts) = base(Preset::Llama31_8b);
    md.insert("llama.attention.head_count", Value::from(vec![4u32, 4]));
    build(&md, &ts).expect("equal per-layer head counts are fine");

    // The tokenizer must cover the embedding exactly.
    let (mut md, ts) = base(Preset::Llama31_8b);
    let mut toks = md.get_str_array("tokenizer.ggml.tokens").unwrap().to_vec();
    toks.pop();
    md.insert(
        "tokenizer.ggml.tokens",
        Value::Array(gguf::Array::String(toks)),
    );
    let e = build(&md, &ts).unwrap_err();
    assert!(
        matches!(&e, ModelError::InvalidValue { key, .. } if key == "tokenizer.ggml.tokens"),
        "{e:?}"
    );
}
