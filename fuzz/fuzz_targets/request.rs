//! Fuzzes the server's request parser (`server::RequestParser`: JSON body -> validated runtime
//! request, with the SmolLM2 chat template and tokenizer). The first byte picks the endpoint
//! (even: chat, odd: completions), the rest is the body.
//!
//! Every body must give either a request the runtime can take (a non-empty prompt of ids in
//! the vocabulary, inside the per-request context with room for at least one token, sampling
//! parameters that validate) or an error of status 400/404 in OpenAI's shape with a bounded
//! message. Never a panic.
#![no_main]

use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use server::request::{is_parse_status, MAX_ERROR_MESSAGE};
use server::RequestParser;
use tokenizer::{TemplateLimits, Tokenizer};

const MAX_CONTEXT: usize = 512;

fn parser() -> &'static RequestParser {
    static P: OnceLock<RequestParser> = OnceLock::new();
    P.get_or_init(|| {
        let path = std::env::var("CROSSOVER_FUZZ_MODEL").unwrap_or_else(|_| {
            concat!(env!("CARGO_MANIFEST_DIR"), "/../.cache/models/smollm2-135m-instruct-q4_1.gguf")
                .to_string()
        });
        let f = gguf::GgufFile::open(&path)
            .unwrap_or_else(|e| panic!("{path}: {e} (run scripts/fetch_model.sh)"));
        let tok = Arc::new(Tokenizer::from_gguf(&f).expect("SmolLM2 tokenizer"));
        // Small template bounds keep each run fast; the limits' own errors are then reached too.
        let limits = TemplateLimits {
            fuel: 200_000,
            max_output_bytes: 64 << 10,
        };
        RequestParser::new("m", tok, limits, Some(MAX_CONTEXT)).expect("template parses")
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&op, body)) = data.split_first() else {
        return;
    };
    let p = parser();
    let r = if op % 2 == 0 {
        p.chat(body)
    } else {
        p.completion(body)
    };
    match r {
        Ok(prep) => {
            let g = &prep.gen;
            assert!(!g.prompt.is_empty());
            assert!(g.prompt.len() < MAX_CONTEXT);
            let m = g.params.max_tokens.expect("bounded by the context cap");
            assert!(m >= 1 && g.prompt.len() + m <= MAX_CONTEXT, "{} + {m}", g.prompt.len());
            g.params.validate().expect("validated parameters");
            assert!(g.prompt.iter().all(|&t| (t as usize) < 49152));
        }
        Err(e) => {
            assert!(is_parse_status(e.status), "status {} for {e:?}", e.status);
            assert!(!e.message.is_empty());
            assert!(e.message.len() <= MAX_ERROR_MESSAGE + 16, "{} bytes", e.message.len());
            let b = e.body();
            assert!(b["error"]["message"].is_string() && b["error"]["type"].is_string());
        }
    }
});
