//! The committed corpus of broken files (tests/malformed, made by scripts/make_gguf_fixtures.py): each
//! must give exactly the error kind and byte offset its manifest entry names, by both loading paths,
//! without panicking. Plus exhaustive truncations and byte corruptions of valid files.

use crate::test_dir;
use gguf::{ErrorKind, GgufError, GgufFile};
use std::panic::{catch_unwind, AssertUnwindSafe};

fn parse_no_panic(what: &str, bytes: &[u8]) -> Result<GgufFile, GgufError> {
    catch_unwind(AssertUnwindSafe(|| GgufFile::from_slice(bytes)))
        .unwrap_or_else(|_| panic!("{what}: the reader panicked"))
}

#[test]
fn malformed_corpus_yields_the_manifest_error() {
    let dir = test_dir("malformed");
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("manifest.json"))
            .expect("tests/malformed/manifest.json (run scripts/make_gguf_fixtures.py)"),
    )
    .expect("manifest JSON");
    let entries = manifest.as_array().expect("manifest is a list");
    assert!(
        entries.len() > 40,
        "corpus unexpectedly small: {}",
        entries.len()
    );
    let mut kinds_seen = std::collections::HashSet::new();
    let mut failures = Vec::new();
    for e in entries {
        let file = e["file"].as_str().expect("file");
        let path = dir.join(file);
        let bytes = std::fs::read(&path).unwrap_or_else(|err| panic!("{file}: {err}"));
        let by_bytes = parse_no_panic(file, &bytes);
        let by_map = catch_unwind(AssertUnwindSafe(|| GgufFile::open(&path)))
            .unwrap_or_else(|_| panic!("{file}: the reader panicked (mmap)"));
        match (e["kind"].as_str(), by_bytes, by_map) {
            (None, Ok(_), Ok(_)) => {}
            (None, a, b) => failures.push(format!(
                "{file}: should load, got {:?} / {:?}",
                a.err(),
                b.err()
            )),
            (Some(kind), Err(a), Err(b)) => {
                let want = ErrorKind::from_name(kind)
                    .unwrap_or_else(|| panic!("{file}: unknown kind {kind}"));
                kinds_seen.insert(want);
                let want_off = e["offset"].as_u64();
                for (how, err) in [("bytes", &a), ("mmap", &b)] {
                    if err.kind() != want || err.offset() != want_off {
                        failures.push(format!(
                            "{file} ({how}): want {kind} at {want_off:?}, got {} at {:?}: {err}",
                            err.kind(),
                            err.offset()
                        ));
                    }
                }
                // The message must say where.
                let msg = a.to_string();
                if let Some(off) = want_off {
                    if !msg.contains(&off.to_string()) {
                        failures.push(format!("{file}: message does not name byte {off}: {msg}"));
                    }
                }
            }
            (Some(kind), a, _) => failures.push(format!(
                "{file}: should fail with {kind}, got {:?}",
                a.map(|_| "Ok")
            )),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));

    use ErrorKind::*;
    for k in [
        Truncated,
        BadMagic,
        UnsupportedVersion,
        UnknownValueType,
        UnknownTensorType,
        CountOverrun,
        InvalidUtf8,
        InvalidBool,
        NestingTooDeep,
        TooManyDims,
        ElementCountOverflow,
        EmptyKey,
        DuplicateKey,
        DuplicateTensor,
        BadAlignment,
        MisalignedTensor,
        TensorOverlap,
        TensorOutOfBounds,
        TensorShapeMismatch,
    ] {
        assert!(kinds_seen.contains(&k), "no corpus file for {k}");
    }
}

fn valid_files() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for name in [
        "fixtures/py_align64.gguf",
        "fixtures/py_v2.gguf",
        "malformed/ok_baseline.gguf",
    ] {
        let (sub, file) = name.split_once('/').unwrap_or_default();
        out.push((
            name.to_owned(),
            std::fs::read(test_dir(sub).join(file)).expect("read"),
        ));
    }
    out
}

#[test]
fn every_truncation_is_an_error() {
    for (name, bytes) in valid_files() {
        parse_no_panic(&name, &bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        for len in 0..bytes.len() {
            let prefix = bytes.get(..len).unwrap_or_default();
            let r = parse_no_panic(&format!("{name}[..{len}]"), prefix);
            // Cutting only trailing padding after the last tensor's data is harmless; anything else
            // must fail.
            if let Ok(f) = r {
                let end = f
                    .tensors()
                    .iter()
                    .map(|t| f.data_offset() + t.offset + t.n_bytes())
                    .max();
                assert!(
                    end.is_some_and(|e| e <= len as u64),
                    "{name}[..{len}] accepted"
                );
            }
        }
    }
}

#[test]
fn every_single_byte_corruption_is_handled() {
    // Flip each byte of the header and tables (the data section carries no structure) to a few
    // values; the reader may accept or reject but must not panic, and what it accepts must be
    // internally consistent.
    for (name, bytes) in valid_files() {
        let f = GgufFile::from_slice(&bytes).expect("valid");
        let table_end = f.data_offset() as usize;
        for i in 0..table_end.min(bytes.len()) {
            for v in [0x00u8, 0xff, 0x80, 0x01, bytes[i] ^ 0x04] {
                let mut b = bytes.clone();
                b[i] = v;
                if let Ok(g) = parse_no_panic(&format!("{name} byte {i} = {v:#x}"), &b) {
                    for t in g.tensors() {
                        assert_eq!(g.tensor_data(t).len() as u64, t.n_bytes());
                        assert_eq!(t.offset % g.alignment(), 0);
                    }
                }
            }
        }
    }
}
