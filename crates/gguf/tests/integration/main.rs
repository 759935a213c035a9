//! Integration tests for the gguf crate (one binary).

mod accessors;
mod desc;
mod fixtures;
mod gen;
mod gguf_py;
mod malformed;
mod roundtrip;
mod streaming;

use std::path::PathBuf;

/// `crates/gguf/tests/<sub>`.
pub fn test_dir(sub: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(sub)
}

/// A scratch path unique to this test process.
pub fn scratch(name: &str) -> PathBuf {
    let dir =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir.join(name)
}
