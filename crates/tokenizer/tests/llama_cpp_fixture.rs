//! The tokenizer against llama.cpp itself on fresh random text: special ids, end-of-generation
//! set, token attributes, every token's piece, and tokenize/detokenize in all special-token
//! modes. Expected values come from llama-cpp-python 0.3.36 through
//! scripts/gen_tokenizer_fixtures.py (tests/fixtures/llama_cpp_tokenizer.json); the vocabulary
//! files themselves are fetched by scripts/fetch_vocabs.sh and scripts/fetch_model.sh.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Deserialize;
use sha2::{Digest, Sha256};
use tokenizer::{IncrementalDecoder, Tokenizer};

#[derive(Deserialize)]
struct Fixture {
    vocabs: Vec<VocabRec>,
}

#[derive(Deserialize)]
struct Hashes {
    special: String,
    plain: String,
}

#[derive(Deserialize)]
struct VocabRec {
    name: String,
    file: String,
    n_vocab: usize,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    eog: Vec<u32>,
    attrs: Vec<(u32, u32)>,
    pieces_sha256: Hashes,
    piece_samples: Vec<(u32, String, String)>,
    cases: Vec<CaseRec>,
}

#[derive(Deserialize)]
struct CaseRec {
    text: String,
    tokens: BTreeMap<String, Vec<u32>>,
    detok: BTreeMap<String, String>,
}

fn fixture() -> Fixture {
    let p =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama_cpp_tokenizer.json");
    let text = std::fs::read_to_string(&p).expect("read llama.cpp tokenizer fixture");
    serde_json::from_str(&text).expect("parse llama.cpp tokenizer fixture")
}

fn resolve(rel: &str) -> PathBuf {
    let rest = rel.strip_prefix(".cache/").unwrap_or(rel);
    let cache = match std::env::var_os("CROSSOVER_CACHE") {
        Some(c) => PathBuf::from(c),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.cache"),
    };
    let p = cache.join(rest);
    let script = if rest.starts_with("models/") {
        "scripts/fetch_model.sh"
    } else {
        "scripts/fetch_vocabs.sh"
    };
    assert!(p.exists(), "{} is missing: run {script}", p.display());
    p
}

fn load(v: &VocabRec) -> Tokenizer {
    let f = gguf::GgufFile::open(resolve(&v.file)).unwrap_or_else(|e| panic!("{}: {e}", v.name));
    Tokenizer::from_gguf(&f).unwrap_or_else(|e| panic!("{}: {e}", v.name))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn pieces_hash(tok: &Tokenizer, special: bool) -> String {
    let mut h = Sha256::new();
    for id in 0..tok.vocab_size() as u32 {
        let p = tok.token_to_piece(id, special).unwrap();
        h.update((p.len() as u32).to_le_bytes());
        h.update(p);
    }
    hex(&h.finalize())
}

#[test]
fn vocab_rules_match_llama_cpp() {
    let fx = fixture();
    assert!(fx.vocabs.len() >= 10);
    let mut eot_ties = 0;
    for v in &fx.vocabs {
        let tok = load(v);
        let n = &v.name;
        assert_eq!(tok.vocab_size(), v.n_vocab, "{n}: vocab size");
        assert_eq!(tok.bos(), v.bos, "{n}: BOS");
        assert_eq!(tok.eos(), v.eos, "{n}: EOS");
        if tok.eot() != v.eot {
            // When several tokens carry an end-of-turn name (`<|endoftext|>` and `<|im_end|>`),
            // llama.cpp keeps whichever its hash map yields first, an order that depends on the
            // standard library's hashing; this crate keeps the highest id. Both must then be
            // end-of-turn-named, end-of-generation tokens.
            let named = |id: Option<u32>| {
                id.and_then(|i| tok.token_text(i))
                    .is_some_and(|t| EOT_NAMES.contains(&t))
            };
            assert!(
                named(tok.eot()) && named(v.eot) && tok.is_eog(v.eot.unwrap_or(u32::MAX)),
                "{n}: EOT {:?} vs llama.cpp {:?}",
                tok.eot(),
                v.eot
            );
            eot_ties += 1;
        }
        assert_eq!(tok.add_bos(), v.add_bos, "{n}: add_bos");
        assert_eq!(tok.add_eos(), v.add_eos, "{n}: add_eos");
        assert_eq!(tok.eog_ids(), v.eog, "{n}: end-of-generation ids");
        let ours: Vec<(u32, u32)> = (0..tok.vocab_size() as u32)
            .filter_map(|i| {
                let a = tok.token_attr(i).unwrap().0;
                (a != tokenizer::TokenAttr::NORMAL.0).then_some((i, a))
            })
            .collect();
        assert_eq!(ours, v.attrs, "{n}: token attributes");
        for (id, special, plain) in &v.piece_samples {
            assert_eq!(
                hex(tok.token_to_piece(*id, true).unwrap()),
                *special,
                "{n}: piece {id}"
            );
            assert_eq!(
                hex(tok.token_to_piece(*id, false).unwrap()),
                *plain,
                "{n}: piece {id}"
            );
        }
        assert_eq!(
            pieces_hash(&tok, true),
            v.pieces_sha256.special,
            "{n}: all pieces"
        );
        assert_eq!(
            pieces_hash(&tok, false),
            v.pieces_sha256.plain,
            "{n}: all plain pieces"
        );
    }
    println!("end-of-turn ties resolved differently from llama.cpp: {eot_ties}");
    assert!(eot_ties <= 1, "too many EOT choices differ from llama.cpp");
}

/// The end-of-turn names llama.cpp looks for (llama-vocab.cpp).
const EOT_NAMES: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<\u{FF5C}end\u{2581}of\u{2581}sentence\u{FF5C}>",
    "<end_of_utterance>",
];

#[test]
fn tokenize_matches_llama_cpp_on_random_text() {
    let fx = fixture();
    let mut failures = Vec::new();
    let mut checked = 0;
    for v in &fx.vocabs {
        let tok = load(v);
        for (i, c) in v.cases.iter().enumerate() {
            for (mode, want) in &c.tokens {
                let b = mode.as_bytes();
                let (add_special, parse_special) = (b[0] == b'T', b[1] == b'T');
                checked += 1;
                match tok.encode(&c.text, add_special, parse_special) {
                    Ok(got) if got == *want => {}
                    got => failures.push(format!(
                        "{} case {i} mode {mode} {:?}\n  want {want:?}\n  got  {got:?}",
                        v.name, c.text
                    )),
                }
            }
        }
    }
    assert!(checked > 400, "only {checked} tokenizations checked");
    assert!(
        failures.is_empty(),
        "{} of {checked} tokenizations differ from llama.cpp:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn detokenize_matches_llama_cpp() {
    let fx = fixture();
    let mut failures = Vec::new();
    for v in &fx.vocabs {
        let tok = load(v);
        for (i, c) in v.cases.iter().enumerate() {
            let ids = &c.tokens["TT"];
            for (mode, want) in &c.detok {
                let b = mode.as_bytes();
                let got = tok.detokenize(ids, b[0] == b'T', b[1] == b'T').unwrap();
                if hex(&got) != *want {
                    failures.push(format!(
                        "{} case {i} mode {mode}: {:?} vs {:?}",
                        v.name,
                        String::from_utf8_lossy(&got),
                        c.text
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Streaming the tokens one by one yields, in total, exactly the concatenated pieces (which the
/// tests above tie to llama.cpp), never a broken character in between.
#[test]
fn incremental_decoder_streams_the_pieces() {
    let fx = fixture();
    for v in &fx.vocabs {
        let tok = load(v);
        for c in &v.cases {
            let ids = &c.tokens["TT"];
            let mut whole = Vec::new();
            for &id in ids {
                whole.extend_from_slice(tok.token_to_piece(id, true).unwrap());
            }
            let mut dec = IncrementalDecoder::new(&tok).with_special(true);
            let mut streamed = String::new();
            for &id in ids {
                streamed.push_str(&dec.push(id).unwrap());
            }
            streamed.push_str(&dec.finish());
            assert_eq!(streamed, String::from_utf8_lossy(&whole), "{}", v.name);
        }
    }
}

/// A character spelled with byte-fallback tokens comes out only once it is complete.
#[test]
fn incremental_decoder_holds_back_partial_characters() {
    let fx = fixture();
    let v = fx
        .vocabs
        .iter()
        .find(|v| v.name == "llama-spm")
        .expect("llama-spm in fixture");
    let tok = load(v);
    let mut fallback_seen = false;
    for text in [
        "\u{1F999}",
        "\u{9F98}\u{672C}",
        "x\u{1F680}y",
        "a\u{10348}b",
    ] {
        let ids = tok.encode(text, false, false).unwrap();
        let mut dec = IncrementalDecoder::new_sequence(&tok);
        let mut out = String::new();
        let mut emitted_partial = false;
        for &id in &ids {
            let s = dec.push(id).unwrap();
            // Whatever is emitted must be whole characters of the text, in order.
            out.push_str(&s);
            emitted_partial |= !text.starts_with(&out);
        }
        out.push_str(&dec.finish());
        assert!(!emitted_partial, "{text:?}: emitted a partial prefix");
        assert_eq!(out, text);
        fallback_seen |= ids.len() > text.chars().count() + 1;
    }
    assert!(fallback_seen, "no text needed byte-fallback tokens");
}
