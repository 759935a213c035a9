//! Fuzzes the tokenizer with the SmolLM2 vocabulary (byte-level BPE, the default model): the
//! first input byte picks an operation and flags, the rest is its input.
//!
//! - encode of arbitrary bytes: valid UTF-8 gives ids inside the vocabulary that decode back to
//!   the text (printable ASCII exactly; otherwise less the bytes the vocabulary has no token
//!   for, which llama.cpp drops too); anything else is `InvalidUtf8` at the offset the standard
//!   library finds;
//! - decode/detokenize of arbitrary ids: text, or `InvalidTokenId` naming the bad id's index;
//! - a chat rendered with the model's template and encoded with the contents kept plain: the
//!   contents come back at their ranges and add no control token.
//!
//! The model is read once from `.cache/models/smollm2-135m-instruct-q4_1.gguf` (or
//! `CROSSOVER_FUZZ_MODEL`).
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tokenizer::{ChatMessage, ChatTemplate, Tokenizer, TokenizerError};

struct Ctx {
    tok: Tokenizer,
    template: ChatTemplate,
}

fn ctx() -> &'static Ctx {
    static CTX: OnceLock<Ctx> = OnceLock::new();
    CTX.get_or_init(|| {
        let path = std::env::var("CROSSOVER_FUZZ_MODEL").unwrap_or_else(|_| {
            concat!(env!("CARGO_MANIFEST_DIR"), "/../.cache/models/smollm2-135m-instruct-q4_1.gguf")
                .to_string()
        });
        let f = gguf::GgufFile::open(&path)
            .unwrap_or_else(|e| panic!("{path}: {e} (run scripts/fetch_model.sh)"));
        let tok = Tokenizer::from_gguf(&f).expect("SmolLM2 tokenizer");
        let template = ChatTemplate::new(tok.chat_template().expect("template")).expect("parses");
        Ctx { tok, template }
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&op, body)) = data.split_first() else {
        return;
    };
    let c = ctx();
    let tok = &c.tok;
    let n_vocab = tok.vocab_size();
    let add_special = op & 0x10 != 0;
    let flag = op & 0x20 != 0;
    match op % 3 {
        0 => match tok.encode_bytes(body, add_special, flag) {
            Ok(ids) => {
                assert!(ids.iter().all(|&i| (i as usize) < n_vocab));
                let text = std::str::from_utf8(body).expect("encoded, so UTF-8");
                if !add_special && !flag {
                    // Bytes the vocabulary has no token for are dropped, as llama.cpp drops
                    // them (SmolLM2 has none for some control bytes, e.g. 0x13): what decodes
                    // back is the text with some bytes left out, in order, nothing added.
                    let back = tok.detokenize(&ids, false, false).expect("own ids decode");
                    let mut rest = text.as_bytes().iter();
                    assert!(
                        back.iter().all(|b| rest.any(|t| t == b)),
                        "{back:?} is not a subsequence of {text:?}"
                    );
                    if text.bytes().all(|b| b.is_ascii_graphic() || b == b' ' || b == b'\n') {
                        assert_eq!(back, text.as_bytes(), "round trip of {text:?}");
                    }
                }
            }
            Err(TokenizerError::InvalidUtf8 { offset }) => {
                let e = std::str::from_utf8(body).expect_err("typed as invalid UTF-8");
                assert_eq!(offset, e.valid_up_to());
            }
            // The regex engine's backtracking limit is a typed refusal, not a crash.
            Err(e @ TokenizerError::RegexRuntime { .. }) => {
                let _ = e.to_string();
            }
            Err(e) => panic!("unexpected error {e}"),
        },
        1 => {
            // Ids of 16 bits reach past the vocabulary (49152 tokens) now and then.
            let ids: Vec<u32> = body
                .chunks_exact(2)
                .map(|b| u32::from(u16::from_le_bytes([b[0], b[1]])))
                .collect();
            match tok.detokenize(&ids, add_special, flag) {
                Ok(_) => assert!(ids.iter().all(|&i| (i as usize) < n_vocab)),
                Err(TokenizerError::InvalidTokenId { id, index, .. }) => {
                    assert_eq!(ids[index], id);
                    assert!(id as usize >= n_vocab);
                }
                Err(e) => panic!("unexpected error {e}"),
            }
            let _ = tok.decode(&ids);
        }
        _ => {
            // Messages separated by 0xFF (never in UTF-8), roles cycling.
            let Ok(msgs) = body
                .split(|&b| b == 0xFF)
                .take(8)
                .enumerate()
                .map(|(i, m)| {
                    let role = ["system", "user", "assistant"][i % 3];
                    std::str::from_utf8(m).map(|s| ChatMessage::new(role, s))
                })
                .collect::<Result<Vec<_>, _>>()
            else {
                return;
            };
            let r = match c.template.render_marked(&msgs, flag, "", "") {
                Ok(r) => r,
                Err(e) => panic!("SmolLM2's template failed: {e}"),
            };
            let non_empty: Vec<&str> = msgs
                .iter()
                .map(|m| m.content.as_str())
                .filter(|s| !s.is_empty())
                .collect();
            assert_eq!(r.content_ranges.len(), non_empty.len());
            for (range, want) in r.content_ranges.iter().zip(&non_empty) {
                assert_eq!(&r.text[range.clone()], *want);
            }
            let ids = match tok.encode_with_plain(&r.text, add_special, &r.content_ranges) {
                Ok(ids) => ids,
                Err(TokenizerError::RegexRuntime { .. }) => return,
                Err(e) => panic!("unexpected error {e}"),
            };
            // Control tokens come from the template only: as many as with placeholder contents.
            let placeholder: Vec<ChatMessage> = msgs
                .iter()
                .map(|m| {
                    let x = if m.content.is_empty() { "" } else { "x" };
                    ChatMessage::new(m.role.clone(), x)
                })
                .collect();
            let r0 = c.template.render_marked(&placeholder, flag, "", "").expect("renders");
            let ids0 = tok
                .encode_with_plain(&r0.text, add_special, &r0.content_ranges)
                .expect("encodes");
            let controls = |v: &[u32]| v.iter().filter(|&&i| tok.is_control(i)).count();
            assert_eq!(controls(&ids), controls(&ids0));
        }
    }
});
