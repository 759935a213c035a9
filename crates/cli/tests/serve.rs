//! `crossover serve` as a process: two CPU actors routed by a policy file, failover when one is
//! made to fail, graceful SIGTERM (in-flight stream finishes, exit 0), and a clear error for an
//! unknown `--backend`. Plain HTTP/1.1 over a TcpStream, loopback only.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

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

struct Server {
    child: Child,
    addr: String,
    log: mpsc::Receiver<String>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Start `crossover serve` on a free port and wait until it listens.
fn start(args: &[&str]) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_crossover"))
        .arg("serve")
        .arg("--model")
        .arg(model())
        .args(["--port", "0", "--alias", "m", "-c", "256"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn crossover serve");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let t0 = Instant::now();
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(120).saturating_sub(t0.elapsed()))
            .unwrap_or_else(|_| panic!("server did not start (status {:?})", child.try_wait()));
        if let Some(addr) = line
            .split("http://")
            .nth(1)
            .filter(|_| line.starts_with("serving model"))
        {
            return Server {
                child,
                addr: addr.trim().to_string(),
                log: rx,
            };
        }
    }
}

struct Reply {
    status: u16,
    head: String,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
    }
}

fn request(addr: &str, method: &str, path: &str, body: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("send");
    s
}

fn call(addr: &str, method: &str, path: &str, body: &str) -> Reply {
    let mut s = request(addr, method, path, body);
    let mut raw = String::new();
    s.read_to_string(&mut raw).expect("read reply");
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Reply {
        status,
        head: head.to_string(),
        body: body.to_string(),
    }
}

fn completion(addr: &str, prompt: &str, max_tokens: u32) -> Reply {
    let body = serde_json::json!({
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0
    });
    call(addr, "POST", "/v1/completions", &body.to_string())
}

fn sigterm(child: &Child) {
    let ok = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    assert!(ok.is_ok_and(|s| s.success()), "kill -TERM failed");
}

fn wait_exit(child: &mut Child, within: Duration) -> i32 {
    let t0 = Instant::now();
    loop {
        if let Some(st) = child.try_wait().expect("wait") {
            return st.code().unwrap_or(-1);
        }
        assert!(
            t0.elapsed() < within,
            "server still running {within:?} after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

const POLICY: &str = r#"
default = ["cpu:0", "cpu:1"]

[[rule]]
name = "long"
backend = "cpu:1"
prompt_tokens_min = 20
"#;

#[test]
fn two_cpu_actors_split_by_policy_and_fail_over() {
    let dir = std::env::temp_dir().join(format!("crossover-serve-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let policy = dir.join("routing.toml");
    std::fs::write(&policy, POLICY).unwrap();
    let policy = policy.to_str().unwrap().to_string();

    let s = start(&[
        "--cpu-threads",
        "1,1",
        "--parallel",
        "2",
        "--routing",
        &policy,
    ]);
    let short = completion(&s.addr, "The capital of France is", 4);
    assert_eq!(short.status, 200, "{}", short.body);
    assert_eq!(
        short.header("x-crossover-backend").as_deref(),
        Some("cpu:0")
    );
    let reason = short.header("x-crossover-route-reason").unwrap_or_default();
    assert!(reason.contains("no rule matched; default"), "{reason}");
    let long_prompt = "Please answer carefully. ".repeat(6) + "What is the capital of France?";
    let long = completion(&s.addr, &long_prompt, 4);
    assert_eq!(long.status, 200, "{}", long.body);
    assert_eq!(long.header("x-crossover-backend").as_deref(), Some("cpu:1"));
    let reason = long.header("x-crossover-route-reason").unwrap_or_default();
    assert!(
        reason.contains("rule 1 \"long\": prompt_tokens") && reason.contains(">= 20"),
        "{reason}"
    );
    let metrics = call(&s.addr, "GET", "/metrics", "").body;
    assert!(
        metrics.contains("crossover_requests_total{backend=\"cpu:0\",reason=\"default\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("crossover_requests_total{backend=\"cpu:1\",reason=\"rule:long\"} 1"),
        "{metrics}"
    );
    drop(s);

    // cpu:0 fails every step: the short request moves to cpu:1, with the same greedy text.
    let s = start(&[
        "--cpu-threads",
        "1,1",
        "--parallel",
        "2",
        "--routing",
        &policy,
        "--inject-fault",
        "cpu:0",
    ]);
    let moved = completion(&s.addr, "The capital of France is", 4);
    assert_eq!(moved.status, 200, "{}", moved.body);
    assert_eq!(
        moved.header("x-crossover-backend").as_deref(),
        Some("cpu:1")
    );
    let reason = moved.header("x-crossover-route-reason").unwrap_or_default();
    assert!(reason.contains("failover from cpu:0"), "{reason}");
    let text = |r: &Reply| -> String {
        let v: serde_json::Value = serde_json::from_str(&r.body).expect("json body");
        v["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    assert_eq!(text(&moved), text(&short));
    let metrics = call(&s.addr, "GET", "/metrics", "").body;
    assert!(
        metrics.contains("crossover_requests_total{backend=\"cpu:1\",reason=\"failover\"} 1"),
        "{metrics}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sigterm_lets_the_stream_finish_then_exits_0() {
    let mut s = start(&["--parallel", "2", "-t", "1"]);
    let body = serde_json::json!({
        "model": "m", "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 24, "temperature": 0, "ignore_eos": true, "stream": true,
        "stream_options": {"include_usage": true}
    });
    let stream = request(&s.addr, "POST", "/v1/chat/completions", &body.to_string());
    let mut lines = BufReader::new(stream).lines().map_while(Result::ok);
    // Read until the first data line, then ask the server to stop.
    let first = lines
        .by_ref()
        .find(|l| l.starts_with("data: "))
        .expect("first event");
    assert!(first.contains("chat.completion.chunk"), "{first}");
    sigterm(&s.child);
    let rest: Vec<String> = lines.filter(|l| l.starts_with("data: ")).collect();
    assert_eq!(
        rest.last().map(String::as_str),
        Some("data: [DONE]"),
        "{rest:?}"
    );
    let usage = rest
        .iter()
        .find(|l| l.contains("\"usage\""))
        .expect("usage chunk");
    assert!(usage.contains("\"completion_tokens\":24"), "{usage}");
    assert!(
        rest.iter()
            .any(|l| l.contains("\"finish_reason\":\"length\"")),
        "{rest:?}"
    );
    assert_eq!(wait_exit(&mut s.child, Duration::from_secs(60)), 0);
    let log: Vec<String> = s.log.try_iter().collect();
    assert!(
        log.iter().any(|l| l.starts_with("shutting down")),
        "{log:?}"
    );
}

#[test]
fn unknown_backend_is_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_crossover"))
        .arg("serve")
        .arg("--model")
        .arg(model())
        .args(["--port", "0", "-c", "128", "--backend", "cuda:7"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no backend named \"cuda:7\"; available: cpu"),
        "{err}"
    );
}
