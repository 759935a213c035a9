//! Fuzzes the GGUF reader: any input must parse or fail with a typed error, never panic, never
//! allocate beyond what the input could hold (libFuzzer's -rss_limit_mb / -malloc_limit_mb catch that).
//! What parses must be self-consistent, and must survive a write/read round trip unchanged.
#![no_main]

use gguf::{ErrorKind, GgufFile, GgufWriter, GGML_MAX_NAME};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let f = match GgufFile::from_slice(data) {
        Ok(f) => f,
        Err(e) => {
            // Every read error must render and carry a kind.
            let _ = (e.to_string(), e.kind(), e.offset());
            return;
        }
    };

    // Accessors must not panic on whatever types the file has.
    let md = f.metadata();
    let _ = md.architecture();
    for (k, v) in md.iter() {
        let _ = (md.get_u32(k), md.get_i64(k), md.get_f32(k), md.get_str(k), md.opt_bool(k));
        let _ = (md.get_str_array(k), md.get_f32_array(k), md.get_i32_array(k), v.type_name());
        if let Some(a) = v.as_array() {
            let _ = a.iter().take(4).count();
        }
    }

    // Every tensor's range was validated: exact size, aligned, inside the file.
    for t in f.tensors() {
        assert_eq!(f.tensor_data(t).len() as u64, t.n_bytes(), "tensor {}", t.name);
        assert_eq!(t.offset % f.alignment(), 0);
        assert!(f.data_offset() + t.offset + t.n_bytes() <= f.file_size());
        assert!(f.tensor(&t.name).is_some());
    }

    // Rewrite what was read; the result must parse to the same tables and data, and rewriting it
    // again must give identical bytes (compared as bytes: NaN metadata is not == itself).
    let mut w = GgufWriter::with_metadata(md.clone());
    for t in f.tensors() {
        w.add_tensor(t.name.as_str(), &t.dims, t.ty, f.tensor_data(t))
            .expect("a validated tensor must be accepted by the writer");
    }
    let bytes = match w.to_bytes() {
        Ok(b) => b,
        Err(e) => {
            // The writer refuses names llama.cpp cannot load; the reader accepts them.
            assert_eq!(e.kind(), ErrorKind::InvalidWrite, "{e}");
            assert!(f.tensors().iter().any(|t| t.name.len() >= GGML_MAX_NAME), "{e}");
            return;
        }
    };
    let g = GgufFile::from_slice(&bytes).expect("our own output must parse");
    assert_eq!(g.tensors().len(), f.tensors().len());
    for (a, b) in f.tensors().iter().zip(g.tensors()) {
        assert_eq!((&a.name, &a.dims, a.ty), (&b.name, &b.dims, b.ty));
        assert_eq!(f.tensor_data(a), g.tensor_data(b));
    }
    assert_eq!(g.metadata().len(), md.len());
    let mut w2 = GgufWriter::with_metadata(g.metadata().clone());
    for t in g.tensors() {
        w2.add_tensor(t.name.as_str(), &t.dims, t.ty, g.tensor_data(t))
            .expect("re-add");
    }
    assert_eq!(w2.to_bytes().expect("rewrite"), bytes);
});
