//! Helpers shared by the model crate's integration tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use model::mixture::QuantScheme;
use model::synth::{synth_to_file, Preset, Shrink, SynthOptions, SynthReport, VocabSource};

/// The repository root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The cache folder the fetch scripts fill (`$CROSSOVER_CACHE`, default `<repo>/.cache`).
pub fn cache() -> PathBuf {
    std::env::var_os("CROSSOVER_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".cache"))
}

/// A fetched file, or a panic naming the script that fetches it.
pub fn fetched(rel: &str, script: &str) -> PathBuf {
    let p = cache().join(rel);
    assert!(
        p.is_file(),
        "{} is missing: run {script} first (CI runs it through scripts/test.sh)",
        p.display()
    );
    p
}

/// A fresh path in a per-process scratch folder.
pub fn scratch(name: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!("crossover-model-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir.join(format!("{}-{name}", N.fetch_add(1, Ordering::Relaxed)))
}

/// The smallest version of a preset that keeps its head size, grouped-query ratio and features:
/// two blocks, one key/value head, a byte-level vocabulary.
pub fn tiny_options(preset: Preset, scheme: QuantScheme, seed: u64) -> SynthOptions {
    SynthOptions {
        preset,
        scheme,
        seed,
        vocab: VocabSource::ByteLevel,
        chat_template: None,
        shrink: Shrink {
            layers: Some(2),
            heads_div: preset.spec().n_head_kv,
        },
        threads: 0,
    }
}

/// Writes a tiny synthetic model and returns its path and report.
pub fn tiny(preset: Preset, scheme: QuantScheme, seed: u64) -> (PathBuf, SynthReport) {
    let opts = tiny_options(preset, scheme, seed);
    let path = scratch(&format!("{}.gguf", preset.name()));
    let report = synth_to_file(&opts, &path, &mut |_| {}).expect("synth");
    (path, report)
}
