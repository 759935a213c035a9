//! Shared set-up of the end-to-end tests: the real CPU backend on the real default model.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use cpu::{CpuBackend, CpuOptions};
use gguf::GgufFile;
use runtime::fault::FaultSwitch;
use runtime::{ActorConfig, Backend, BackendHandle, RestartPolicy};
use tokenizer::Tokenizer;

/// The default model, fetched by scripts/fetch_model.sh.
pub fn model_path() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../.cache/models/smollm2-135m-instruct-q4_1.gguf");
    assert!(
        p.exists(),
        "model {} is missing: run scripts/fetch_model.sh (CI does this first)",
        p.display()
    );
    p
}

pub fn open() -> (Arc<GgufFile>, Arc<Tokenizer>) {
    let file = Arc::new(GgufFile::open(model_path()).expect("open model"));
    let tok = Arc::new(Tokenizer::from_gguf(&file).expect("tokenizer"));
    (file, tok)
}

/// Options of one test actor.
pub struct Cpu {
    pub name: &'static str,
    pub threads: usize,
    pub ctx: usize,
    pub max_seqs: usize,
    pub max_batch_tokens: usize,
    /// Faults planned inside the real CPU backend (every rebuilt one shares the plan).
    pub fault: Option<FaultSwitch>,
    pub admission_timeout: Duration,
    pub prefill_chunk: usize,
    pub restart: RestartPolicy,
}

impl Default for Cpu {
    fn default() -> Self {
        Cpu {
            name: "cpu",
            threads: 1,
            ctx: 512,
            max_seqs: 4,
            max_batch_tokens: 256,
            fault: None,
            admission_timeout: Duration::from_secs(30),
            prefill_chunk: 64,
            restart: RestartPolicy::default(),
        }
    }
}

/// Start a CPU actor; the backend is built on the actor's thread.
pub fn cpu_actor(file: &Arc<GgufFile>, tok: &Arc<Tokenizer>, c: Cpu) -> BackendHandle {
    let file = file.clone();
    let opts = CpuOptions {
        threads: Some(c.threads),
        ctx_size: c.ctx,
        max_seqs: c.max_seqs,
        block_tokens: 16,
        max_batch_tokens: c.max_batch_tokens,
        ..CpuOptions::default()
    };
    let fault = c.fault.clone();
    // Restartable: the supervisor rebuilds the backend from this after a crash.
    let factory: runtime::RestartFactory = std::sync::Arc::new(move || {
        let be = match &fault {
            Some(sw) => {
                CpuBackend::from_file_with_faults(file.clone(), "smollm2", &opts, sw.clone())
            }
            None => CpuBackend::from_file(file.clone(), "smollm2", &opts),
        }
        .map_err(|e| runtime::BackendError::Unsupported {
            backend: "cpu".into(),
            why: e.to_string(),
        })?;
        Ok(Box::new(be) as Box<dyn Backend>)
    });
    let cfg = ActorConfig {
        name: Some(c.name.to_string()),
        admission_timeout: c.admission_timeout,
        prefill_chunk: c.prefill_chunk,
        restart: c.restart,
        ..ActorConfig::default()
    };
    runtime::spawn(factory, tok.clone(), cfg).expect("actor starts")
}

/// Chat-formatted prompt ids.
pub fn chat_prompt(tok: &Tokenizer, user: &str) -> Vec<u32> {
    let msgs = [tokenizer::ChatMessage::new("user", user)];
    let text = tok
        .apply_chat_template(&msgs, Some("You are a helpful assistant."), true)
        .expect("model has a chat template")
        .expect("template renders");
    tok.encode(&text, true, true).expect("encode")
}

/// Greedy generation of `n` tokens straight on a backend, one sequence, no actor: the reference
/// the actor's output must equal.
pub fn direct_greedy(
    file: &Arc<GgufFile>,
    prompt: &[u32],
    n: usize,
    eog: &dyn Fn(u32) -> bool,
) -> Vec<u32> {
    use runtime::{SeqChunk, StepBatch, Want};
    let opts = CpuOptions {
        threads: Some(1),
        ctx_size: 512,
        max_seqs: 1,
        block_tokens: 16,
        max_batch_tokens: 512,
        ..CpuOptions::default()
    };
    let mut be = CpuBackend::from_file(file.clone(), "smollm2", &opts).expect("backend");
    let mut out = Vec::new();
    let mut feed = prompt.to_vec();
    let mut pos = 0;
    for _ in 0..n {
        let batch = StepBatch {
            chunks: vec![SeqChunk {
                // The prompt's length for its chunk (the CPU backend's order rule, as the
                // actor says it), none for the generated tokens.
                prompt_len: (pos == 0).then_some(prompt.len()),
                seq: 1,
                tokens: feed.clone(),
                start_pos: pos,
                want: Want::Last,
            }],
        };
        let o = be.step(&batch).expect("step");
        pos += feed.len();
        let row = o.row(0).expect("row");
        let mut best = 0;
        for (i, &l) in row.iter().enumerate() {
            if l > row[best] {
                best = i;
            }
        }
        let t = best as u32;
        out.push(t);
        if eog(t) {
            break;
        }
        feed = vec![t];
    }
    out
}

/// A whole HTTP/1.1 response.
pub struct Reply {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl Reply {
    /// A response header's value (case-insensitive name).
    pub fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    }
}

/// One HTTP/1.1 request on a fresh connection, with extra header lines (`Name: value`).
pub fn http_with(
    addr: &std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[&str],
    body: &str,
) -> Reply {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let extra: String = headers.iter().map(|h| format!("{h}\r\n")).collect();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{extra}\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status line");
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((out.as_str(), ""));
    Reply {
        status,
        head: head.to_string(),
        body: body.to_string(),
    }
}

/// One HTTP/1.1 request on a fresh connection, with the API key if given; (status, body).
pub fn http(
    addr: &std::net::SocketAddr,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: &str,
) -> (u16, String) {
    let auth = key.map(|k| format!("Authorization: Bearer {k}"));
    let headers: Vec<&str> = auth.iter().map(String::as_str).collect();
    let r = http_with(addr, method, path, &headers, body);
    (r.status, r.body)
}

/// The real server on a loopback port, in its own runtime; stopped when dropped.
pub struct TestServer {
    pub addr: std::net::SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    rt: tokio::runtime::Runtime,
}

impl TestServer {
    pub fn start(
        coord: runtime::Coordinator,
        tok: Arc<Tokenizer>,
        cfg: server::ServerConfig,
    ) -> TestServer {
        let state = server::AppState::new(coord, tok, cfg).expect("server state");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime");
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let task = rt.spawn(server::serve(listener, state, async {
            let _ = stop_rx.await;
        }));
        TestServer {
            addr,
            stop: Some(stop),
            task: Some(task),
            rt,
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = self.rt.block_on(t);
        }
    }
}
