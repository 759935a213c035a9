//! The streaming writer: same bytes as the in-memory writer, and misuse is a typed error.

use crate::{gen, scratch};
use gguf::{ErrorKind, GgmlType, GgufFile, Metadata, StreamingWriter, TensorDecl};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::io::Write;

#[test]
fn streaming_matches_in_memory_writer_byte_for_byte() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let md = gen::metadata(&mut rng);
    let tensors = gen::tensors(&mut rng);
    let expected = gen::writer(md.clone(), &tensors)
        .to_bytes()
        .expect("in-memory");

    let decls: Vec<TensorDecl> = tensors
        .iter()
        .map(|(n, d, t, _)| TensorDecl::new(n.as_str(), d, *t))
        .collect();
    let path = scratch("streamed.gguf");
    let mut w = StreamingWriter::create(&path, &md, decls).expect("create");
    for (i, (name, _, _, data)) in tensors.iter().enumerate() {
        assert_eq!(
            w.next_tensor().map(|t| t.name.as_str()),
            Some(name.as_str())
        );
        if i % 2 == 0 {
            w.write_tensor(name, data).expect("write tensor");
        } else {
            // in random-sized pieces
            let mut sink = w.begin_tensor(name).expect("begin");
            let mut rest = &data[..];
            while !rest.is_empty() {
                let n = rng.gen_range(1..=rest.len());
                sink.write_all(&rest[..n]).expect("piece");
                rest = &rest[n..];
            }
            assert_eq!(sink.remaining(), 0);
            sink.finish().expect("finish tensor");
        }
    }
    assert!(w.next_tensor().is_none());
    w.finish().expect("finish");
    assert_eq!(std::fs::read(&path).expect("read back"), expected);
    GgufFile::open(&path).expect("valid");
    std::fs::remove_file(&path).ok();
}

fn two() -> Vec<TensorDecl> {
    vec![
        TensorDecl::new("a", &[8], GgmlType::F32),
        TensorDecl::new("b", &[32], GgmlType::Q8_0),
    ]
}

#[test]
fn streaming_misuse_is_a_typed_error() {
    let md = Metadata::new();
    let mut w = StreamingWriter::new(Vec::new(), &md, two()).expect("new");
    assert_eq!(
        w.write_tensor("b", &[0; 34]).unwrap_err().kind(),
        ErrorKind::TensorOrder
    );
    assert_eq!(
        w.write_tensor("a", &[0; 31]).unwrap_err().kind(),
        ErrorKind::TensorDataSize
    );
    w.write_tensor("a", &[1; 32]).expect("a");
    {
        let mut sink = w.begin_tensor("b").expect("begin b");
        assert!(sink.write_all(&[0; 35]).is_err(), "overlong write accepted");
        sink.write_all(&[0; 10]).expect("part");
        assert_eq!(sink.finish().unwrap_err().kind(), ErrorKind::TensorDataSize);
    }
    // The abandoned partial tensor blocks everything after it.
    assert_eq!(
        w.write_tensor("b", &[0; 34]).unwrap_err().kind(),
        ErrorKind::TensorOrder
    );
    assert_eq!(w.finish().unwrap_err().kind(), ErrorKind::TensorOrder);

    let w = StreamingWriter::new(Vec::new(), &md, two()).expect("new");
    assert_eq!(w.finish().unwrap_err().kind(), ErrorKind::TensorOrder);

    let mut w = StreamingWriter::new(Vec::new(), &md, two()).expect("new");
    w.write_tensor("a", &[1; 32]).expect("a");
    w.write_tensor("b", &[2; 34]).expect("b");
    assert_eq!(
        w.write_tensor("c", &[]).unwrap_err().kind(),
        ErrorKind::TensorOrder
    );
    let bytes = w.finish().expect("finish");
    let f = GgufFile::from_bytes(bytes).expect("valid");
    assert_eq!(f.tensor_data_by_name("b"), Some(&[2u8; 34][..]));

    let dup = vec![
        TensorDecl::new("a", &[1], GgmlType::F32),
        TensorDecl::new("a", &[1], GgmlType::F32),
    ];
    assert_eq!(
        StreamingWriter::new(Vec::new(), &md, dup)
            .err()
            .map(|e| e.kind()),
        Some(ErrorKind::InvalidWrite)
    );
    // A bad declaration creates no file.
    let path = scratch("never.gguf");
    let bad = vec![TensorDecl::new("q", &[3], GgmlType::Q4K)];
    assert!(StreamingWriter::create(&path, &md, bad).is_err());
    assert!(!path.exists());
}

#[test]
fn io_errors_are_reported() {
    struct Full;
    impl Write for Full {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(std::io::Error::new(
                std::io::ErrorKind::StorageFull,
                "disk full",
            ))
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let e = StreamingWriter::new(Full, &Metadata::new(), two())
        .err()
        .expect("must fail");
    assert_eq!(e.kind(), ErrorKind::Io);
    let e = GgufFile::open("/nonexistent/dir/x.gguf").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Io);
    assert!(e.to_string().contains("/nonexistent/dir/x.gguf"), "{e}");
}
