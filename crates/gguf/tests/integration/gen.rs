//! Seeded random GGUF contents: every value type, nested and empty arrays, tensors of every type.

use gguf::{Array, GgmlType, GgufWriter, Metadata, Value};
use rand::{seq::SliceRandom, Rng};

const WORDS: &[&str] = &[
    "", "a", "héllo", "✓", "🦀", "Ġthe", "▁la", "\n", "\t", "<s>", "日本",
];

fn rand_string<R: Rng>(rng: &mut R) -> String {
    (0..rng.gen_range(0..5))
        .map(|_| *WORDS.choose(rng).unwrap_or(&""))
        .collect()
}

/// A finite float of varied magnitude (NaN payloads would survive too, but keep descriptions plain).
fn rand_f32<R: Rng>(rng: &mut R) -> f32 {
    rng.gen_range(-1.0f32..1.0) * 10f32.powi(rng.gen_range(-20..20))
}

fn rand_array<R: Rng>(rng: &mut R, depth: usize) -> Array {
    let n = if rng.gen_bool(0.1) {
        0
    } else {
        rng.gen_range(1..12)
    };
    let pick = rng.gen_range(0..if depth < 2 { 13 } else { 12 });
    macro_rules! v {
        ($e:expr) => {
            (0..n).map(|_| $e).collect()
        };
    }
    match pick {
        0 => Array::U8(v!(rng.gen())),
        1 => Array::I8(v!(rng.gen())),
        2 => Array::U16(v!(rng.gen())),
        3 => Array::I16(v!(rng.gen())),
        4 => Array::U32(v!(rng.gen())),
        5 => Array::I32(v!(rng.gen())),
        6 => Array::U64(v!(rng.gen())),
        7 => Array::I64(v!(rng.gen())),
        8 => Array::F32(v!(rand_f32(rng))),
        9 => Array::F64(v!(rng.gen::<f64>() * 1e300 - 5e299)),
        10 => Array::Bool(v!(rng.gen())),
        11 => Array::String(v!(rand_string(rng))),
        _ => Array::Array(v!(rand_array(rng, depth + 1))),
    }
}

/// One value of each scalar type and one array of each kind, plus a few random extra arrays.
pub fn metadata<R: Rng>(rng: &mut R) -> Metadata {
    let mut m = Metadata::new();
    m.insert("general.architecture", "llama");
    m.insert("t.u8", Value::U8(rng.gen()));
    m.insert("t.i8", Value::I8(rng.gen()));
    m.insert("t.u16", Value::U16(rng.gen()));
    m.insert("t.i16", Value::I16(rng.gen()));
    m.insert("t.u32", Value::U32(rng.gen()));
    m.insert("t.i32", Value::I32(rng.gen()));
    m.insert("t.u64", Value::U64(rng.gen()));
    m.insert("t.i64", Value::I64(rng.gen()));
    m.insert("t.f32", Value::F32(rand_f32(rng)));
    m.insert("t.f64", Value::F64(rng.gen::<f64>() * 1e-300));
    m.insert("t.bool", Value::Bool(rng.gen()));
    m.insert("t.string", Value::String(rand_string(rng)));
    m.insert("t.empty_string", Value::String(String::new()));
    m.insert("t.empty_array_f32", Value::Array(Array::F32(vec![])));
    m.insert(
        "t.nested",
        Value::Array(Array::Array(vec![
            Array::I32(vec![rng.gen(), rng.gen()]),
            Array::String(vec![rand_string(rng)]),
            Array::Array(vec![Array::U8(vec![rng.gen()])]),
            Array::Bool(vec![]),
        ])),
    );
    for i in 0..rng.gen_range(5..15) {
        m.insert(format!("t.arr.{i}"), Value::Array(rand_array(rng, 0)));
    }
    m
}

/// Random tensors of every type and rank 0..=4; returns (name, dims, type, bytes).
pub fn tensors<R: Rng>(rng: &mut R) -> Vec<(String, Vec<u64>, GgmlType, Vec<u8>)> {
    let mut out = Vec::new();
    for (i, &ty) in GgmlType::ALL.iter().enumerate() {
        let n_dims = rng.gen_range(0..=4usize);
        let bs = ty.block_size() as u64;
        let mut dims: Vec<u64> = (0..n_dims).map(|_| rng.gen_range(1..4)).collect();
        if let Some(d0) = dims.first_mut() {
            *d0 = bs * rng.gen_range(1..3);
        } else if bs > 1 {
            dims.push(bs); // a scalar of a block type is not a whole block
        }
        if rng.gen_bool(0.05) {
            if let Some(d) = dims.last_mut() {
                *d = 0; // empty tensors are legal
            }
        }
        let n = gguf::TensorInfo {
            name: String::new(),
            dims: dims.clone(),
            ty,
            offset: 0,
        }
        .n_bytes();
        let data: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
        out.push((format!("blk.{i}.{}.weight", ty.name()), dims, ty, data));
    }
    out.shuffle(rng);
    out
}

/// An in-memory writer with the given contents.
pub fn writer(md: Metadata, tensors: &[(String, Vec<u64>, GgmlType, Vec<u8>)]) -> GgufWriter {
    let mut w = GgufWriter::with_metadata(md);
    for (name, dims, ty, data) in tensors {
        if let Err(e) = w.add_tensor(name.as_str(), dims, *ty, data.clone()) {
            panic!("generator made an invalid tensor: {e}");
        }
    }
    w
}
