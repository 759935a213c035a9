//! llama.cpp's own tokenizer test vectors: `models/ggml-vocab-*.gguf` with `.gguf.inp` (inputs
//! separated by `\n__ggml_vocab_test__\n`) and `.gguf.out` (one line of token ids per input),
//! tokenized as `tests/test-tokenizer-0.cpp` does: `add_special = false`, `parse_special = false`.
//! Fetched by `scripts/fetch_vocabs.sh` into `.cache/vocab/`.

use std::path::PathBuf;

use tokenizer::{IncrementalDecoder, Tokenizer, TokenizerError};

fn vocab_dir() -> PathBuf {
    match std::env::var_os("CROSSOVER_CACHE") {
        Some(c) => PathBuf::from(c).join("vocab"),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.cache/vocab"),
    }
}

fn vocab_path(name: &str) -> PathBuf {
    let p = vocab_dir().join(format!("ggml-vocab-{name}.gguf"));
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch_vocabs.sh (it fetches llama.cpp's tokenizer test vectors)",
        p.display()
    );
    p
}

struct Case {
    input: String,
    expected: Vec<u32>,
}

fn read_cases(gguf: &std::path::Path) -> Vec<Case> {
    let inp = std::fs::read_to_string(gguf.with_extension("gguf.inp")).expect("read .inp");
    let out = std::fs::read_to_string(gguf.with_extension("gguf.out")).expect("read .out");
    const SEP: &str = "\n__ggml_vocab_test__\n";
    let mut inputs = Vec::new();
    let mut pos = 0;
    while pos < inp.len() {
        match inp[pos..].find(SEP) {
            Some(n) => {
                inputs.push(inp[pos..pos + n].to_owned());
                pos += n + SEP.len();
            }
            None => {
                inputs.push(inp[pos..].to_owned());
                break;
            }
        }
    }
    let outputs: Vec<&str> = out.lines().collect();
    assert_eq!(
        inputs.len(),
        outputs.len(),
        "{}: .inp/.out counts",
        gguf.display()
    );
    inputs
        .into_iter()
        .zip(outputs)
        .map(|(input, o)| Case {
            input,
            expected: o
                .split_whitespace()
                .map(|t| t.parse().expect("token id"))
                .collect(),
        })
        .collect()
}

fn load(path: &std::path::Path) -> Result<Tokenizer, TokenizerError> {
    let f = gguf::GgufFile::open(path)?;
    Tokenizer::from_gguf(&f)
}

/// Runs every case; returns (passed, failures as printable lines).
fn run_cases(tok: &Tokenizer, cases: &[Case]) -> (usize, Vec<String>) {
    let mut passed = 0;
    let mut failures = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        match tok.encode(&c.input, false, false) {
            Ok(ids) if ids == c.expected => passed += 1,
            Ok(ids) => failures.push(format!(
                "case {i} {:?}\n    expected {:?}\n    got      {:?}",
                c.input, c.expected, ids
            )),
            Err(e) => failures.push(format!("case {i} {:?}: error {e}", c.input)),
        }
    }
    (passed, failures)
}

fn check_all_match(name: &str) {
    let path = vocab_path(name);
    let tok = load(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
    let cases = read_cases(&path);
    assert!(cases.len() > 10, "{name}: too few cases");
    let (passed, failures) = run_cases(&tok, &cases);
    println!("{name}: {passed}/{} match llama.cpp", cases.len());
    assert!(
        failures.is_empty(),
        "{name}: {} of {} cases differ from llama.cpp:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn llama_bpe_matches_llama_cpp() {
    check_all_match("llama-bpe");
}

#[test]
fn llama_spm_matches_llama_cpp() {
    check_all_match("llama-spm");
}

#[test]
fn gpt2_matches_llama_cpp() {
    check_all_match("gpt-2");
}

#[test]
fn qwen2_matches_llama_cpp() {
    check_all_match("qwen2");
}

#[test]
fn phi3_matches_llama_cpp() {
    check_all_match("phi-3");
}

/// Every vocab file in the folder: tokenizes the ones that load and have vectors, reports the
/// match count, and lists the ones that cannot be loaded and why. Only the five vocabularies
/// above are required to match; this test fails only if the folder is missing or empty.
#[test]
fn report_every_vocab() {
    let dir = vocab_dir();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e}: run scripts/fetch_vocabs.sh (it fetches llama.cpp's tokenizer test vectors)",
                dir.display()
            )
        })
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
        .collect();
    files.sort();
    assert!(
        !files.is_empty(),
        "no ggml-vocab-*.gguf in {}",
        dir.display()
    );
    let mut unsupported = Vec::new();
    println!("vocab                      kind  pre              result");
    for path in &files {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("?")
            .trim_start_matches("ggml-vocab-")
            .trim_end_matches(".gguf")
            .to_owned();
        let tok = match load(path) {
            Ok(t) => t,
            Err(e) => {
                println!("{name:<26} -     -                unsupported: {e}");
                unsupported.push(name);
                continue;
            }
        };
        let kind = format!("{:?}", tok.kind());
        let result = if path.with_extension("gguf.inp").exists() {
            let cases = read_cases(path);
            let (passed, failures) = run_cases(&tok, &cases);
            let mut r = format!("{passed}/{} match", cases.len());
            if let Some(f) = failures.first() {
                r.push_str(&format!("; first difference: {f}"));
            }
            r
        } else {
            "loads (no test vectors)".to_owned()
        };
        println!("{name:<26} {kind:<5} {:<16} {result}", tok.pre_name());
    }
    println!("unsupported: {unsupported:?}");
}

/// Decoding the ids of every test input gives the input back, byte for byte, through both the
/// whole-sequence detokenizer (without the clean-up passes, which by design alter text) and the
/// streaming decoder; with clean-up, `decode` equals the clean-up applied to the input.
#[test]
fn decode_round_trips_the_vectors() {
    for name in ["llama-bpe", "llama-spm", "gpt-2", "qwen2", "phi-3"] {
        let path = vocab_path(name);
        let tok = load(&path).unwrap();
        for c in read_cases(&path) {
            let ids = tok.encode(&c.input, false, false).unwrap();
            let mut dec = IncrementalDecoder::new_sequence(&tok);
            let mut streamed = String::new();
            for &id in &ids {
                streamed.push_str(&dec.push(id).unwrap());
            }
            streamed.push_str(&dec.finish());
            assert_eq!(
                streamed, c.input,
                "{name}: streamed decode of {:?}",
                c.input
            );
            let whole = tok.decode(&ids).unwrap();
            if !tok_cleans_spaces(&tok) {
                assert_eq!(whole, c.input, "{name}: decode of {:?}", c.input);
            }
        }
    }
}

fn tok_cleans_spaces(tok: &Tokenizer) -> bool {
    // The clean-up passes only ever delete spaces; a vocabulary without them round-trips.
    let probe = tok.encode("a , b", false, false).unwrap();
    tok.decode(&probe).unwrap() != "a , b"
}
