//! Writer -> reader round trips on seeded random contents.

use crate::{desc, gen, scratch};
use gguf::{GgmlType, GgufFile, GgufWriter, Value};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

#[test]
fn random_files_round_trip_exactly() {
    for seed in 0..40u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let md = gen::metadata(&mut rng);
        let tensors = gen::tensors(&mut rng);
        let mut w = gen::writer(md.clone(), &tensors);
        if seed % 3 == 1 {
            w.set_alignment(1 << (seed % 8));
        }
        let bytes = w.to_bytes().expect("write");
        let f = GgufFile::from_bytes(bytes.clone()).unwrap_or_else(|e| panic!("seed {seed}: {e}"));

        // What we read equals what we meant to write, described independently of the reader.
        let errs = desc::compare(&f, &desc::desc_of_writer(&w, &tensors));
        assert!(errs.is_empty(), "seed {seed}:\n{}", errs.join("\n"));
        assert_eq!(f.metadata(), w.metadata(), "seed {seed}");
        for (name, dims, ty, data) in &tensors {
            let t = f.tensor(name).expect("tensor present");
            assert_eq!((&t.dims, t.ty), (dims, *ty));
            assert_eq!(f.tensor_data(t), &data[..], "seed {seed} tensor {name}");
        }

        // Writing what we read gives the same bytes.
        let mut again = GgufWriter::with_metadata(f.metadata().clone());
        for t in f.tensors() {
            again
                .add_tensor(t.name.as_str(), &t.dims, t.ty, f.tensor_data(t))
                .expect("re-add");
        }
        assert_eq!(again.to_bytes().expect("rewrite"), bytes, "seed {seed}");
    }
}

#[test]
fn file_round_trip_through_mmap() {
    let mut rng = ChaCha8Rng::seed_from_u64(99);
    let tensors = gen::tensors(&mut rng);
    let w = gen::writer(gen::metadata(&mut rng), &tensors);
    let path = scratch("roundtrip.gguf");
    w.write_file(&path).expect("write file");
    let f = GgufFile::open(&path).expect("open");
    assert!(f.is_mmapped());
    assert_eq!(f.file_size(), std::fs::metadata(&path).expect("stat").len());
    for (name, _, _, data) in &tensors {
        assert_eq!(f.tensor_data_by_name(name), Some(&data[..]));
    }
    assert_eq!(f.bytes(), &w.to_bytes().expect("bytes")[..]);
    std::fs::remove_file(&path).ok();
}

#[test]
fn writer_rejects_what_the_reader_would() {
    let mut w = GgufWriter::new();
    let e = w
        .add_tensor("q", &[33], GgmlType::Q4_0, vec![0u8; 18])
        .unwrap_err();
    assert_eq!(e.kind(), gguf::ErrorKind::InvalidWrite, "{e}");
    let e = w
        .add_tensor("f", &[4], GgmlType::F32, vec![0u8; 15])
        .unwrap_err();
    assert_eq!(e.kind(), gguf::ErrorKind::TensorDataSize, "{e}");
    let e = w
        .add_tensor("d", &[1, 1, 1, 1, 1], GgmlType::F32, vec![0u8; 4])
        .unwrap_err();
    assert_eq!(e.kind(), gguf::ErrorKind::InvalidWrite, "{e}");
    w.add_tensor("ok", &[4], GgmlType::F32, vec![0u8; 16])
        .expect("valid");
    let e = w
        .add_tensor("ok", &[4], GgmlType::F32, vec![0u8; 16])
        .unwrap_err();
    assert_eq!(e.kind(), gguf::ErrorKind::InvalidWrite, "{e}");
    let long = "x".repeat(gguf::GGML_MAX_NAME);
    w.add_tensor(long.as_str(), &[1], GgmlType::F32, vec![0u8; 4])
        .expect("checked at write");
    assert!(w
        .to_bytes()
        .unwrap_err()
        .to_string()
        .contains("shorter than 64"));

    let mut w = GgufWriter::new();
    w.set_alignment(48);
    assert_eq!(
        w.to_bytes().unwrap_err().kind(),
        gguf::ErrorKind::InvalidWrite
    );
    let mut w = GgufWriter::new();
    w.add_kv("general.alignment", 64u64);
    assert_eq!(
        w.to_bytes().unwrap_err().kind(),
        gguf::ErrorKind::InvalidWrite
    );
    let mut w = GgufWriter::new();
    w.add_kv("", 1u8);
    assert_eq!(
        w.to_bytes().unwrap_err().kind(),
        gguf::ErrorKind::InvalidWrite
    );

    // Too deeply nested arrays are refused rather than written unreadable.
    let mut a = gguf::Array::U8(vec![]);
    for _ in 0..gguf::MAX_ARRAY_DEPTH {
        a = gguf::Array::Array(vec![a]);
    }
    let mut w = GgufWriter::new();
    w.add_kv("deep", Value::Array(a.clone()));
    assert_eq!(
        w.to_bytes().unwrap_err().kind(),
        gguf::ErrorKind::InvalidWrite
    );
    if let gguf::Array::Array(mut inner) = a {
        let mut w = GgufWriter::new();
        w.add_kv("deep", Value::Array(inner.remove(0)));
        let f = GgufFile::from_bytes(w.to_bytes().expect("16 levels are fine")).expect("read");
        assert!(f.metadata().get("deep").is_some());
    }
}

#[test]
fn add_kv_replaces_in_place() {
    let mut w = GgufWriter::new();
    w.add_kv("a", 1u32).add_kv("b", "x").add_kv("a", 2.5f32);
    let f = GgufFile::from_bytes(w.to_bytes().expect("write")).expect("read");
    let keys: Vec<_> = f.metadata().keys().collect();
    assert_eq!(keys, ["a", "b"]);
    assert_eq!(f.metadata().get("a"), Some(&Value::F32(2.5)));
}
