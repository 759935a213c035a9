//! `crossover bench`, `calibrate` and `audit` end to end through the binary, on SmolLM2 with the
//! CPU backend (small run counts so CI stays fast).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use runtime::routing::{decide, BackendState, RequestShape};
use runtime::{Priority, RoutingPolicy};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn model() -> PathBuf {
    let m = repo().join(".cache/models/smollm2-135m-instruct-q4_1.gguf");
    assert!(
        m.exists(),
        "{} is missing: run scripts/fetch_model.sh (CI does)",
        m.display()
    );
    m
}

fn crossover(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_crossover"))
        .args(args)
        .arg("--model")
        .arg(model())
        .output()
        .expect("run crossover")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("crossover-measure-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

fn no_rapl() -> bool {
    !["intel-rapl:0", "amd-rapl:0"]
        .iter()
        .any(|z| Path::new("/sys/class/powercap").join(z).exists())
}

const CPU_ONLY: [&str; 5] = ["--gpus", "none", "-t", "2", "--no-builtin"];

#[test]
fn bench_prints_the_table_json_and_plot() {
    let svg = tmp("bench.svg");
    let svg_s = svg.display().to_string();
    let mut args = vec!["bench"];
    args.extend(CPU_ONLY);
    args.extend([
        "--workload",
        "prompt=24,gen=4,concurrency=2",
        "--workload",
        "prompt=48,gen=4",
        "--runs",
        "2",
        "--warmup",
        "1",
        "--plot",
        &svg_s,
    ]);
    let out = crossover(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    let header = table.lines().next().unwrap();
    for col in [
        "workload", "backend", "TTFT ms", "tok/s", "power W", "J/token", "runs",
    ] {
        assert!(header.contains(col), "{table}");
    }
    let rows: Vec<&str> = table.lines().filter(|l| l.contains(" cpu ")).collect();
    assert_eq!(rows.len(), 2, "{table}");
    assert!(
        rows[0].starts_with("2x@24") && rows[1].starts_with("single@48"),
        "{table}"
    );
    assert!(rows.iter().all(|r| r.contains("2 (+1 warm-up)")), "{table}");
    if no_rapl() {
        assert!(
            rows.iter().all(|r| r.contains("n/a (no RAPL here)")),
            "{table}"
        );
    }
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(plot.starts_with("<svg") && plot.contains("time to first token"));
    assert!(
        plot.contains("cpu x2") && plot.contains("tokens/s"),
        "legend and axes"
    );

    let out = crossover(&[
        "bench",
        "--gpus",
        "none",
        "-t",
        "2",
        "--no-builtin",
        "--workload",
        "prompt=16,gen=3",
        "--runs",
        "2",
        "--warmup",
        "1",
        "--json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json report");
    let r = &v["results"][0];
    assert_eq!(r["backend"], "cpu");
    assert_eq!(r["runs"].as_array().unwrap().len(), 2);
    assert_eq!(r["warmup"].as_array().unwrap().len(), 1);
    assert_eq!(r["ttft_ms"]["n"], 2);
    assert!(r["tok_s"]["median"].as_f64().unwrap() > 0.0);
    assert_eq!(v["method"]["runs"], 2);
    if no_rapl() {
        assert!(r["power_w"].is_null());
        assert_eq!(r["power_note"], "n/a (no RAPL here)");
    }
}

#[test]
fn bench_refuses_what_cannot_run() {
    let out = crossover(&[
        "bench",
        "--gpus",
        "none",
        "--no-builtin",
        "--workload",
        "prompt=100,gen=10",
        "--ctx-size",
        "64",
        "--runs",
        "1",
    ]);
    assert!(!out.status.success());
    let e = text(&out.stderr);
    assert!(
        e.contains("single@100") && e.contains("does not fit the context of 64"),
        "{e}"
    );
    let out = crossover(&[
        "bench",
        "--gpus",
        "none",
        "--backend",
        "cuda:7",
        "--runs",
        "1",
    ]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("no backend named \"cuda:7\"; available: cpu"));
    let out = crossover(&["bench", "--gpus", "none", "--workload", "prompt=4,turbo=1"]);
    assert!(text(&out.stderr).contains("unknown key `turbo`"));
    // Session 21: a device named twice would give one GPU two actors.
    let out = crossover(&["bench", "--gpus", "0,1,0", "--runs", "1"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--gpus: device 0 is named twice (entry 3)"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn audit_shows_native_ops_and_a_test_double_falling_back() {
    let out = crossover(&["audit", "--backend", "cpu", "--strict"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    assert!(
        s.contains("blk.29.ffn_down.weight") && s.contains("q4_1"),
        "{s}"
    );
    assert!(
        s.contains("ops for a step of 1 token(s) over 512 cached positions"),
        "{s}"
    );
    assert!(
        s.contains("0 not native: 0.0% by count, 0.0% by estimated time"),
        "{s}"
    );

    let csv = tmp("matrix.csv");
    let csv_s = csv.display().to_string();
    let out = crossover(&[
        "audit",
        "--backend",
        "cpu",
        "--backend",
        "cpu-lacking-q8_0",
        "--strict",
        "--csv",
        &csv_s,
    ]);
    assert!(!out.status.success(), "--strict must fail");
    let s = text(&out.stdout);
    assert!(
        s.contains("FALLBACK to host (test double built without a q8_0 matmul kernel"),
        "{s}"
    );
    let e = text(&out.stderr);
    assert!(
        e.contains("--strict: above --max-fallback 15%: cpu-lacking-q8_0 falls back"),
        "{e}"
    );
    assert!(
        !e.contains("cpu falls back"),
        "the normal backend passes: {e}"
    );
    let m = std::fs::read_to_string(&csv).unwrap();
    let mut lines = m.lines();
    assert_eq!(lines.next(), Some("op,type,count,cpu,cpu-lacking-q8_0,why"));
    assert!(
        m.lines()
            .any(|l| l.starts_with("mat_mul,q8_0,1,native,fallback:host,")),
        "{m}"
    );
    assert!(
        m.lines()
            .any(|l| l.starts_with("rms_norm,f32,61,native,native,")),
        "{m}"
    );

    // A higher threshold lets the same audit pass.
    let out = crossover(&[
        "audit",
        "--backend",
        "cpu-lacking-q8_0",
        "--strict",
        "--max-fallback",
        "60",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

/// A skewed distribution (mostly short prompts, a long tail) calibrated over two CPU actors: the
/// policy written loads in the runtime and routes every measured length to the backend the
/// measurements (the JSON written beside it) found best.
#[test]
fn calibrate_writes_a_policy_that_follows_its_measurements() {
    let ctx_file = tmp("contexts.txt");
    let mut lines = String::new();
    for i in 0..200u64 {
        // 90% in 4..40, 10% in 100..160: a long tail.
        let n = if i % 10 == 9 {
            100 + (i * 7) % 60
        } else {
            4 + (i * 13) % 36
        };
        lines.push_str(&format!("{n}\n"));
    }
    std::fs::write(&ctx_file, lines).unwrap();
    let (policy, json, svg) = (tmp("policy.toml"), tmp("cal.json"), tmp("cal.svg"));
    let s = |p: &PathBuf| p.display().to_string();
    let out = crossover(&[
        "calibrate",
        "--gpus",
        "none",
        "--cpu-threads",
        "1,2",
        "--contexts",
        &s(&ctx_file),
        "--objective",
        "ttft",
        "-o",
        &s(&policy),
        "--points",
        "3",
        "--concurrency",
        "1",
        "--gen",
        "2",
        "--runs",
        "2",
        "--warmup",
        "1",
        "--json",
        &s(&json),
        "--plot",
        &s(&svg),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let so = text(&out.stdout);
    assert!(so.contains("prompt lengths") && so.contains("p95"), "{so}");
    let toml = std::fs::read_to_string(&policy).unwrap();
    assert!(toml.starts_with("# crossover routing policy, written by `crossover calibrate` at "));
    assert!(toml.contains("# objective: ttft"), "{toml}");
    let p = RoutingPolicy::load(&policy).unwrap();
    let cal: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let points = cal["points"].as_array().unwrap();
    let mut distinct: Vec<u64> = points
        .iter()
        .map(|p| p["prompt"].as_u64().unwrap())
        .collect();
    distinct.sort_unstable();
    distinct.dedup();
    assert!(distinct.len() >= 3, "{distinct:?}");
    assert_eq!(
        points.len(),
        2 * distinct.len(),
        "both backends at every length"
    );
    let states: Vec<BackendState> = ["cpu:0", "cpu:1"]
        .iter()
        .map(|n| BackendState {
            name: n.to_string(),
            healthy: true,
            queue_depth: 0,
            free_kv_blocks: 100,
            max_seq_tokens: 4096,
        })
        .collect();
    for len in distinct {
        let at: Vec<&serde_json::Value> = points.iter().filter(|p| p["prompt"] == len).collect();
        let best = at
            .iter()
            .min_by(|a, b| {
                a["value"]
                    .as_f64()
                    .unwrap()
                    .total_cmp(&b["value"].as_f64().unwrap())
            })
            .unwrap();
        let shape = RequestShape {
            prompt_tokens: len as usize,
            max_new_tokens: Some(2),
            priority: Priority::Normal,
            batch: false,
        };
        let d = decide(&p, &shape, &states).unwrap();
        assert_eq!(
            d.backend(),
            best["backend"].as_str().unwrap(),
            "prompt {len}: {}",
            d.reason
        );
    }
    assert!(std::fs::read_to_string(&svg)
        .unwrap()
        .contains("ttft at concurrency 1"));
}

/// `serve --log-requests` writes one JSON line per finished request, which `calibrate
/// --contexts` reads.
#[test]
fn serve_logs_requests_for_calibration() {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::process::Stdio;
    let log = tmp("requests.jsonl");
    let _ = std::fs::remove_file(&log);
    let mut child = Command::new(env!("CARGO_BIN_EXE_crossover"))
        .args([
            "serve", "--port", "0", "--alias", "m", "-c", "256", "--gpus", "none", "-t", "2",
        ])
        .arg("--model")
        .arg(model())
        .arg("--log-requests")
        .arg(&log)
        .env("CROSSOVER_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn serve");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let l = lines.next().expect("serve exited").expect("stderr");
        if let Some(a) = l
            .split("http://")
            .nth(1)
            .filter(|_| l.starts_with("serving model"))
        {
            break a.trim().to_string();
        }
    };
    let mut sent = Vec::new();
    for prompt in [
        "Hello there",
        "One two three four five six seven eight nine ten",
    ] {
        let body = format!(r#"{{"model":"m","prompt":"{prompt}","max_tokens":3,"temperature":0}}"#);
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).unwrap();
        let json = raw.split_once("\r\n\r\n").unwrap().1;
        let v: serde_json::Value = serde_json::from_str(json).expect(json);
        sent.push(v["usage"]["prompt_tokens"].as_u64().unwrap());
    }
    let _ = child.kill();
    let _ = child.wait();
    let text = std::fs::read_to_string(&log).unwrap();
    let rows: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2, "{text}");
    for (r, &p) in rows.iter().zip(&sent) {
        assert_eq!(r["prompt_tokens"].as_u64(), Some(p), "{r}");
        assert_eq!(r["completion_tokens"].as_u64(), Some(3), "{r}");
        assert_eq!(r["backend"], "cpu");
        assert!(
            r["ts"].as_str().unwrap().ends_with('Z') && r["route"].is_string(),
            "{r}"
        );
    }
    let parsed = bench::calibrate::parse_contexts(&text, "log").unwrap();
    assert_eq!(parsed.iter().map(|&n| n as u64).collect::<Vec<_>>(), sent);
}

/// `--layers-on-gpu`: the CUDA backend's matmuls of layers N.. fall back to the host with reason
/// "layer placement", everything else stays native; the shares and the weight split are checked
/// against the op rows and the file's own tensor sizes. Runs without a GPU (the placement is then
/// planned from the file with the CUDA backend's support function) and with one (the real
/// backend answers).
#[test]
fn audit_shows_layer_placement_of_a_cuda_backend() {
    let out = crossover(&[
        "audit",
        "--backend",
        "cuda:0",
        "--layers-on-gpu",
        "10",
        "--json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["layers_on_gpu"], 10);
    let a = &v["audits"][0];
    assert_eq!(a["backend"], "cuda:0");
    let ops = a["ops"].as_array().unwrap();
    let (mut host, mut host_us, mut total_us) = (0usize, 0f64, 0f64);
    for op in ops {
        let us = op["est_us"].as_f64().unwrap();
        total_us += us;
        let layer = op["layer"].as_u64();
        let placed = op["op"] == "mat_mul" && layer.is_some_and(|l| l >= 10);
        if placed {
            assert_eq!(op["placement"]["placement"], "fallback", "{op}");
            assert_eq!(op["placement"]["to"], "host", "{op}");
            let why = op["placement"]["why"].as_str().unwrap();
            let want = format!("layer placement: layer {} ", layer.unwrap());
            assert!(why.starts_with(&want), "{why}");
            host += 1;
            host_us += us;
        } else {
            assert_eq!(op["placement"]["placement"], "native", "{op}");
        }
    }
    assert_eq!(host, 20 * 7);
    let count_pct = a["fallback_count_pct"].as_f64().unwrap();
    assert!((count_pct - 100.0 * host as f64 / ops.len() as f64).abs() < 1e-9);
    let time_pct = a["fallback_time_pct"].as_f64().unwrap();
    assert!((time_pct - 100.0 * host_us / total_us).abs() < 1e-6);
    let p = &v["placement"][0];
    assert_eq!(p["matmuls_on_host"], 140);
    let reasons = p["fallback_by_reason"].as_array().unwrap();
    assert_eq!(reasons.len(), 1, "{reasons:?}");
    assert_eq!(reasons[0]["reason"], "layer placement");
    assert_eq!(reasons[0]["ops"], 140);
    // Bytes from the file's tensor table.
    let f = gguf::GgufFile::open(model()).unwrap();
    let (mut on_host, mut on_gpu) = (0u64, 0u64);
    for t in f.tensors() {
        let n = &t.name;
        let layer = n
            .strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|l| l.parse::<u64>().ok());
        let mat = [
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ]
        .iter()
        .any(|m| n.ends_with(&format!(".{m}.weight")));
        let bytes = f.tensor_data(t).len() as u64;
        match layer {
            Some(l) if mat && l >= 10 => on_host += bytes,
            Some(_) if mat => on_gpu += bytes,
            // SmolLM2 ties the head to the embedding table, which stays on the GPU.
            None if n == "token_embd.weight" => on_gpu += bytes,
            _ => {}
        }
    }
    assert_eq!(p["weights_on_host_bytes"], on_host);
    assert_eq!(p["weights_on_gpu_bytes"], on_gpu);

    // The text form names the reason and its shares; --strict fails on them.
    let out = crossover(&[
        "audit",
        "--backend",
        "cuda:0",
        "--layers-on-gpu",
        "10",
        "--strict",
    ]);
    assert!(!out.status.success());
    let s = text(&out.stdout);
    assert!(
        s.contains(&format!(
            "layer placement: 140 ops, {count_pct:.1}% by count, {time_pct:.1}% by estimated time"
        )),
        "{s}"
    );
    assert!(s.contains("weights: 140 of 211 matmuls on the host"), "{s}");
    assert!(text(&out.stderr).contains("--strict: above --max-fallback 15%: cuda:0 falls back"));

    let out = crossover(&["audit", "--backend", "cuda:0", "--layers-on-gpu", "31"]);
    assert!(text(&out.stderr).contains("--layers-on-gpu 31: the model has 30 layers"));
    let out = crossover(&["audit", "--backend", "cpu", "--layers-on-gpu", "3"]);
    assert!(text(&out.stderr).contains("no cuda:N backend is audited"));
}
