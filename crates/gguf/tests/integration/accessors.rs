//! Typed metadata accessors: conversions, ranges, and the errors for missing keys and wrong types.

use gguf::{Array, ErrorKind, GgufFile, GgufWriter, Metadata, Value};

fn md() -> Metadata {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "llama")
        .add_kv("u8", 200u8)
        .add_kv("i8", -3i8)
        .add_kv("i64_small", 4096i64)
        .add_kv("u64_big", u64::MAX)
        .add_kv("f32", 1.5f32)
        .add_kv("f64", 0.1f64)
        .add_kv("flag", true)
        .add_kv("toks", vec!["a", "b", "c"])
        .add_kv("scores", vec![0.5f32, -1.0])
        .add_kv("scores64", vec![0.25f64])
        .add_kv("types", vec![1i32, 2, 3])
        .add_kv("u8s", vec![1u8, 255])
        .add_kv("neg", vec![-1i64])
        .add_kv("nested", vec![Array::U8(vec![1])]);
    // Through bytes, so the accessors are exercised on what the reader produced.
    GgufFile::from_bytes(w.to_bytes().expect("write"))
        .expect("read")
        .metadata()
        .clone()
}

#[test]
fn integers_convert_when_they_fit() {
    let m = md();
    assert_eq!(m.get_u32("u8").unwrap(), 200);
    assert_eq!(m.get_u64("i64_small").unwrap(), 4096);
    assert_eq!(m.get_i64("i8").unwrap(), -3);
    assert_eq!(m.get_i32("i8").unwrap(), -3);
    assert_eq!(m.get_usize("u8").unwrap(), 200);
    assert_eq!(m.get_u64("u64_big").unwrap(), u64::MAX);
    assert_eq!(m.get_u32("i8").unwrap_err().kind(), ErrorKind::OutOfRange);
    assert_eq!(
        m.get_u32("u64_big").unwrap_err().kind(),
        ErrorKind::OutOfRange
    );
    assert_eq!(
        m.get_i64("u64_big").unwrap_err().kind(),
        ErrorKind::OutOfRange
    );
    assert_eq!(m.get_u32("f32").unwrap_err().kind(), ErrorKind::WrongType);
    assert_eq!(m.get_u32("flag").unwrap_err().kind(), ErrorKind::WrongType);
}

#[test]
fn floats_bools_strings() {
    let m = md();
    assert_eq!(m.get_f32("f32").unwrap(), 1.5);
    assert_eq!(m.get_f32("f64").unwrap(), 0.1f64 as f32);
    assert_eq!(m.get_f64("f64").unwrap(), 0.1);
    assert_eq!(m.get_f32("u8").unwrap_err().kind(), ErrorKind::WrongType);
    assert!(m.get_bool("flag").unwrap());
    assert_eq!(m.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(m.architecture().unwrap(), "llama");
    let e = m.get_str("u8").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::WrongType);
    assert!(
        e.to_string().contains("'u8'") && e.to_string().contains("string"),
        "{e}"
    );
    let e = m.get_u32("llama.block_count").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::KeyMissing);
    assert!(e.to_string().contains("llama.block_count"));
}

#[test]
fn arrays() {
    let m = md();
    assert_eq!(m.get_str_array("toks").unwrap(), ["a", "b", "c"]);
    assert_eq!(m.get_f32_array("scores").unwrap(), [0.5, -1.0]);
    assert_eq!(m.get_f32_array("scores64").unwrap(), [0.25]);
    assert_eq!(m.get_i32_array("types").unwrap(), [1, 2, 3]);
    assert_eq!(m.get_u32_array("u8s").unwrap(), [1, 255]);
    assert_eq!(m.get_i32_array("u8s").unwrap(), [1, 255]);
    assert_eq!(m.get_u64_array("types").unwrap(), [1, 2, 3]);
    let e = m.get_u32_array("neg").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfRange);
    assert!(e.to_string().contains("neg[0]"), "{e}");
    assert_eq!(
        m.get_str_array("types").unwrap_err().kind(),
        ErrorKind::WrongType
    );
    assert_eq!(
        m.get_i32_array("scores").unwrap_err().kind(),
        ErrorKind::WrongType
    );
    assert_eq!(
        m.get_i32_array("nested").unwrap_err().kind(),
        ErrorKind::WrongType
    );
    assert_eq!(
        m.get_f32_array("u8").unwrap_err().kind(),
        ErrorKind::WrongType
    );
    let a = m.get_array("toks").unwrap();
    assert_eq!(a.len(), 3);
    assert_eq!(a.get(1), Some(Value::String("b".into())));
    assert_eq!(a.iter().count(), 3);
    assert_eq!(a.get(3), None);
}

#[test]
fn optional_accessors() {
    let m = md();
    assert_eq!(m.opt_u32("missing").unwrap(), None);
    assert_eq!(m.opt_u32("u8").unwrap(), Some(200));
    assert_eq!(m.opt_f32("f32").unwrap(), Some(1.5));
    assert_eq!(m.opt_bool("missing").unwrap(), None);
    assert_eq!(m.opt_str("general.architecture").unwrap(), Some("llama"));
    assert_eq!(m.opt_str("u8").unwrap_err().kind(), ErrorKind::WrongType);
    assert_eq!(m.opt_bool("u8").unwrap_err().kind(), ErrorKind::WrongType);
    assert_eq!(
        m.opt_str_array("toks").unwrap().map(<[String]>::len),
        Some(3)
    );
    assert_eq!(m.opt_i32_array("missing").unwrap(), None);
}

#[test]
fn metadata_map_keeps_order_on_insert_and_remove() {
    let mut m: Metadata = [("a", 1u32), ("b", 2), ("c", 3)].into_iter().collect();
    assert_eq!(m.insert("b", Value::Bool(true)), Some(Value::U32(2)));
    assert_eq!(m.remove("a"), Some(Value::U32(1)));
    m.insert("d", 4u8);
    assert_eq!(m.keys().collect::<Vec<_>>(), ["b", "c", "d"]);
    assert_eq!(m.get("c"), Some(&Value::U32(3)));
    assert_eq!(m.get("d"), Some(&Value::U8(4)));
    assert!(!m.contains_key("a"));
}
