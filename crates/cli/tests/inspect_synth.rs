//! `crossover inspect` and `crossover synth` end to end, through the binary.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn crossover(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_crossover"))
        .args(args)
        .current_dir(repo())
        .output()
        .expect("run crossover");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn inspect_json(path: &str) -> Value {
    let (ok, out, err) = crossover(&["inspect", "--json", path]);
    assert!(ok, "inspect {path} failed: {err}");
    serde_json::from_str(&out).expect("inspect --json prints JSON")
}

fn smollm2() -> String {
    let cache = std::env::var_os("CROSSOVER_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".cache"));
    let p = cache.join("models/smollm2-135m-instruct-q4_1.gguf");
    assert!(
        p.is_file(),
        "{} is missing: run scripts/fetch_model.sh first",
        p.display()
    );
    p.display().to_string()
}

/// The acceptance check of the model I/O issue, against what the `gguf` Python package reads
/// (fixture by scripts/model_fixtures.py).
#[test]
fn inspect_smollm2_matches_the_reference_reader() {
    let fx: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("crates/model/tests/fixtures/smollm2_layout.json"))
            .unwrap(),
    )
    .unwrap();
    let md = &fx["metadata"];
    let j = inspect_json(&smollm2());
    assert_eq!(j["runnable"], true, "{}", j["error"]);
    assert_eq!(j["architecture"], md["general.architecture"]);
    let c = &j["config"];
    assert_eq!(c["n_layer"], md["llama.block_count"]);
    assert_eq!(c["n_embd"], md["llama.embedding_length"]);
    assert_eq!(c["n_head"], md["llama.attention.head_count"]);
    assert_eq!(c["n_head_kv"], md["llama.attention.head_count_kv"]);
    assert_eq!(c["n_ff"], md["llama.feed_forward_length"]);
    assert_eq!(j["tokenizer"]["n_tokens"], fx["n_tokens"]);
    assert_eq!(j["tokenizer"]["chat_template"], true);
    // The tensor table, type for type and shape for shape.
    let ours = j["tensors"].as_array().unwrap();
    let theirs = fx["tensors"].as_array().unwrap();
    assert_eq!(ours.len(), theirs.len());
    for (o, t) in ours.iter().zip(theirs) {
        assert_eq!(o["name"], t[0]);
        assert_eq!(
            o["type"].as_str().unwrap().to_ascii_lowercase(),
            t[1].as_str().unwrap().to_ascii_lowercase(),
            "{}",
            t[0]
        );
        assert_eq!(o["shape"], t[2], "{}", t[0]);
    }
    // Totals agree with the table.
    let total: u64 = ours.iter().map(|t| t["bytes"].as_u64().unwrap()).sum();
    assert_eq!(j["memory"]["weights_bytes"].as_u64().unwrap(), total);
    let by_type: u64 = j["by_type"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v["bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(by_type, total);

    // The text form says the same things.
    let (ok, text, _) = crossover(&["inspect", &smollm2()]);
    assert!(ok);
    for needle in [
        "architecture:  llama",
        "blocks            30",
        "embedding width   576",
        "9 query / 3 key-value",
        "q4_1",
        "token_embd.weight                      q8_0",
        "chat template     present",
        "KV cache f16 @ 8192",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
    }
}

#[test]
fn inspect_reports_a_file_it_cannot_run() {
    // A valid GGUF naming an architecture this project does not run: inspectable, not runnable.
    let p = std::env::temp_dir().join(format!("crossover-cli-{}-vocab.gguf", std::process::id()));
    let (ok, _, err) = crossover(&[
        "synth",
        "-q",
        "--preset",
        "qwen2.5-0.5b",
        "--quant",
        "q8_0",
        "--layers",
        "1",
        "--heads-div",
        "2",
        "--byte-vocab",
        "-o",
        p.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let mut bytes = std::fs::read(&p).unwrap();
    // Corrupt general.architecture's value ("qwen2" -> "qwenX"): still a valid GGUF.
    let at = bytes
        .windows(5)
        .position(|w| w == b"qwen2")
        .expect("architecture string");
    bytes[at + 4] = b'X';
    std::fs::write(&p, &bytes).unwrap();
    let j = inspect_json(p.to_str().unwrap());
    assert_eq!(j["runnable"], false);
    assert!(
        j["error"].as_str().unwrap().contains("qwenX"),
        "{}",
        j["error"]
    );
    std::fs::remove_file(&p).ok();
}

#[test]
fn synth_is_deterministic_and_inspectable() {
    let dir = std::env::temp_dir();
    let path = |n: &str| dir.join(format!("crossover-cli-{}-{n}.gguf", std::process::id()));
    let run = |out: &PathBuf, seed: &str, threads: &str| {
        let (ok, _, err) = crossover(&[
            "synth",
            "-q",
            "--preset",
            "llama-3.1-8b",
            "--quant",
            "q4_k_m",
            "--layers",
            "3",
            "--heads-div",
            "8",
            "--byte-vocab",
            "--seed",
            seed,
            "-t",
            threads,
            "-o",
            out.to_str().unwrap(),
        ]);
        assert!(ok, "{err}");
        std::fs::read(out).unwrap()
    };
    let (a, b, c) = (path("a"), path("b"), path("c"));
    let ba = run(&a, "42", "1");
    assert_eq!(ba, run(&b, "42", "2"), "same seed, other thread count");
    assert_ne!(ba, run(&c, "43", "2"), "another seed");
    let j = inspect_json(a.to_str().unwrap());
    assert_eq!(j["runnable"], true, "{}", j["error"]);
    assert_eq!(j["config"]["n_layer"], 3);
    assert_eq!(j["config"]["tied_output"], false);
    assert_eq!(j["config"]["rope_freqs"], true);
    assert_eq!(j["file_type_name"], "q4_k_m (15)");
    let types = j["by_type"].as_object().unwrap();
    assert!(
        types.contains_key("q4_K") && types.contains_key("q6_K"),
        "{types:?}"
    );
    for p in [a, b, c] {
        std::fs::remove_file(p).ok();
    }
}

#[test]
fn synth_refuses_bad_options_with_the_list_of_choices() {
    let out = std::env::temp_dir().join("crossover-cli-never.gguf");
    let o = out.to_str().unwrap();
    let (ok, _, err) = crossover(&["synth", "--preset", "llama-9", "-o", o]);
    assert!(!ok && err.contains("llama-3.2-1b"), "{err}");
    let (ok, _, err) = crossover(&[
        "synth",
        "--preset",
        "llama-3.2-1b",
        "--quant",
        "iq2_xs",
        "-o",
        o,
    ]);
    assert!(!ok && err.contains("q4_k_m"), "{err}");
    assert!(!out.exists());
}
