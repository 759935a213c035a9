//! Chat templates rendered by minijinja against Python jinja2's renderings of the same templates
//! and conversations (tests/fixtures/chat_templates.json, made by scripts/gen_chat_fixtures.py).

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Deserialize;
use tokenizer::{ChatMessage, ChatTemplate, Tokenizer};

#[derive(Deserialize)]
struct Fixture {
    fixed_time: i64,
    templates: BTreeMap<String, TemplateInfo>,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct TemplateInfo {
    source: String,
    origin: String,
    bos_token: String,
    eos_token: String,
}

#[derive(Deserialize)]
struct Case {
    template: String,
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    expected: Option<String>,
    error: Option<String>,
}

fn fixture() -> Fixture {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat_templates.json");
    let text = std::fs::read_to_string(&p).expect("read chat fixture");
    serde_json::from_str(&text).expect("parse chat fixture")
}

#[test]
fn renderings_match_jinja2() {
    let fx = fixture();
    assert!(fx.cases.len() >= 50);
    let mut compiled = BTreeMap::new();
    for (name, t) in &fx.templates {
        let c = ChatTemplate::with_fixed_time(&t.source, fx.fixed_time)
            .unwrap_or_else(|e| panic!("{name} ({}): {e}", t.origin));
        compiled.insert(name.clone(), c);
    }
    let mut failures = Vec::new();
    let mut per_template: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, c) in fx.cases.iter().enumerate() {
        let info = &fx.templates[&c.template];
        let got = compiled[&c.template].render(
            &c.messages,
            c.add_generation_prompt,
            &info.bos_token,
            &info.eos_token,
        );
        match (&c.expected, &c.error, got) {
            (Some(want), _, Ok(got)) if *want == got => {}
            (None, Some(msg), Err(e)) if e.to_string().contains(msg.as_str()) => {}
            (want, err, got) => failures.push(format!(
                "case {i} ({}): expected {:?} / error {:?}\n  got {:?}",
                c.template, want, err, got
            )),
        }
        *per_template.entry(c.template.as_str()).or_default() += 1;
    }
    println!("cases per template: {per_template:?}");
    assert!(
        failures.is_empty(),
        "{} of {} renderings differ from jinja2:\n{}",
        failures.len(),
        fx.cases.len(),
        failures.join("\n")
    );
    for name in ["smollm2", "llama31", "llama32"] {
        assert!(per_template.contains_key(name), "fixture lacks {name}");
    }
}

fn cache() -> PathBuf {
    match std::env::var_os("CROSSOVER_CACHE") {
        Some(c) => PathBuf::from(c),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.cache"),
    }
}

fn load(path: &std::path::Path, script: &str) -> Tokenizer {
    assert!(path.exists(), "{} is missing: run {script}", path.display());
    let f = gguf::GgufFile::open(path).unwrap();
    Tokenizer::from_gguf(&f).unwrap()
}

/// The templates in the fixture are the ones the files carry, and `apply_chat_template` (which
/// takes the template, BOS and EOS from the GGUF) renders them as jinja2 did.
#[test]
fn gguf_templates_are_the_fixture_templates() {
    let fx = fixture();
    let c = cache();
    for (name, path, script) in [
        (
            "smollm2",
            c.join("models/smollm2-135m-instruct-q4_1.gguf"),
            "scripts/fetch_model.sh",
        ),
        (
            "qwen2",
            c.join("vocab/ggml-vocab-qwen2.gguf"),
            "scripts/fetch_vocabs.sh",
        ),
        (
            "phi3",
            c.join("vocab/ggml-vocab-phi-3.gguf"),
            "scripts/fetch_vocabs.sh",
        ),
    ] {
        let tok = load(&path, script);
        let info = &fx.templates[name];
        assert_eq!(tok.chat_template(), Some(info.source.as_str()), "{name}");
        let bos = tok.bos().and_then(|i| tok.token_text(i));
        let eos = tok.eos().and_then(|i| tok.token_text(i));
        assert_eq!(bos, Some(info.bos_token.as_str()), "{name} BOS");
        assert_eq!(eos, Some(info.eos_token.as_str()), "{name} EOS");
        // Templates without strftime_now render the same whatever the clock says.
        for case in fx.cases.iter().filter(|c| c.template == name) {
            let Some(want) = &case.expected else { continue };
            let got = tok
                .apply_chat_template(&case.messages, None, case.add_generation_prompt)
                .expect("template present")
                .unwrap();
            assert_eq!(&got, want, "{name}");
        }
    }
}

/// A system prompt passed separately renders as a leading system message.
#[test]
fn system_prompt_is_a_leading_message() {
    let fx = fixture();
    let info = &fx.templates["smollm2"];
    let t = ChatTemplate::new(&info.source).unwrap();
    let case = fx
        .cases
        .iter()
        .find(|c| {
            c.template == "smollm2"
                && c.messages.len() > 1
                && c.messages[0].role == "system"
                && c.expected.is_some()
        })
        .expect("a smollm2 case with a system message");
    let system = &case.messages[0].content;
    let rest = &case.messages[1..];
    let mut all = vec![ChatMessage::new("system", system.clone())];
    all.extend_from_slice(rest);
    let direct = t
        .render(
            &all,
            case.add_generation_prompt,
            &info.bos_token,
            &info.eos_token,
        )
        .unwrap();
    assert_eq!(Some(&direct), case.expected.as_ref());
}
