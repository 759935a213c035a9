//! Files written by the reference writer (gguf-py's GGUFWriter, via scripts/make_gguf_fixtures.py):
//! our reader must see exactly what the script put in, and our writer must reproduce the same bytes.

use crate::desc;
use crate::test_dir;
use gguf::GgufFile;
use serde_json::Value as J;

fn fixtures() -> Vec<(String, J)> {
    let dir = test_dir("fixtures");
    let mut out = Vec::new();
    for name in ["py_all_types", "py_align64", "py_v2"] {
        let path = dir.join(format!("{name}.json"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (run scripts/make_gguf_fixtures.py)",
                path.display()
            )
        });
        out.push((
            name.to_owned(),
            serde_json::from_str(&text).expect("fixture JSON"),
        ));
    }
    out
}

#[test]
fn reader_matches_gguf_py_fixtures_mmap_and_owned() {
    for (name, d) in fixtures() {
        let path = test_dir("fixtures").join(format!("{name}.gguf"));
        let mapped = GgufFile::open(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(mapped.is_mmapped());
        let errs = desc::compare(&mapped, &d);
        assert!(errs.is_empty(), "{name} (mmap):\n{}", errs.join("\n"));

        let owned = GgufFile::from_bytes(std::fs::read(&path).expect("read")).expect("parse");
        let errs = desc::compare(&owned, &d);
        assert!(errs.is_empty(), "{name} (owned):\n{}", errs.join("\n"));
    }
}

#[test]
fn fixtures_cover_every_value_and_tensor_type() {
    let (_, d) = fixtures().remove(0);
    let f = GgufFile::open(test_dir("fixtures").join("py_all_types.gguf")).expect("open");
    let mut scalar = std::collections::HashSet::new();
    let mut elems = std::collections::HashSet::new();
    for (_, v) in f.metadata().iter() {
        scalar.insert(v.value_type());
        if let Some(a) = v.as_array() {
            elems.insert(a.elem_type());
        }
    }
    assert_eq!(scalar.len(), 13, "scalar types present: {scalar:?}");
    assert_eq!(elems.len(), 13, "array element types present: {elems:?}");
    let types: std::collections::HashSet<_> = f.tensors().iter().map(|t| t.ty).collect();
    for ty in gguf::GgmlType::ALL {
        // Q8_1 and Q8_K are ggml's intermediate types; gguf-py never writes them
        if !matches!(ty, gguf::GgmlType::Q8_1 | gguf::GgmlType::Q8K) {
            assert!(types.contains(&ty), "no {ty} tensor in the fixture");
        }
    }
    assert!(f.tensors().iter().any(|t| t.dims.len() == 4));
    assert_eq!(
        d["tensors"].as_array().map(Vec::len),
        Some(f.tensors().len())
    );
}

#[test]
fn writer_reproduces_gguf_py_bytes_exactly() {
    for (name, d) in fixtures() {
        if name == "py_v2" {
            continue; // a byte-patched v3 file; we write v3
        }
        let w = desc::writer_from_desc(&d).unwrap_or_else(|e| panic!("{name}: {e}"));
        let ours = w.to_bytes().expect("write");
        let theirs =
            std::fs::read(test_dir("fixtures").join(format!("{name}.gguf"))).expect("read");
        assert_eq!(ours.len(), theirs.len(), "{name}: size differs");
        if let Some(i) = ours.iter().zip(&theirs).position(|(a, b)| a != b) {
            panic!("{name}: first difference at byte {i}");
        }
    }
}

#[test]
fn version_2_is_read() {
    let f = GgufFile::open(test_dir("fixtures").join("py_v2.gguf")).expect("open v2");
    assert_eq!(f.version(), 2);
}

#[test]
fn owned_tensor_data_is_aligned_like_a_map() {
    let f = GgufFile::from_bytes(
        std::fs::read(test_dir("fixtures").join("py_align64.gguf")).expect("read"),
    )
    .expect("parse");
    for t in f.tensors() {
        let p = f.tensor_data(t).as_ptr() as usize;
        assert_eq!(p % 64, 0, "tensor {} at {p:#x}", t.name);
    }
}
