//! The real server on loopback (in this process, on the real CPU backend with the default
//! model) and a raw HTTP/1.1 client that can misbehave: oversized heads, trickled bodies,
//! connections that never send anything.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use cpu::{CpuBackend, CpuOptions};
use gguf::GgufFile;
use runtime::fault::{Fault, FaultSwitch, Faulty};
use runtime::{ActorConfig, Backend, BackendHandle, Coordinator, RoutingPolicy};
use server::{AppState, ServerConfig};
use tokenizer::Tokenizer;

pub const MODEL: &str = "smollm2";

/// The default model and its tokenizer, loaded once per test binary.
pub fn model() -> (Arc<GgufFile>, Arc<Tokenizer>) {
    static M: std::sync::OnceLock<(Arc<GgufFile>, Arc<Tokenizer>)> = std::sync::OnceLock::new();
    M.get_or_init(|| {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../.cache/models/smollm2-135m-instruct-q4_1.gguf");
        assert!(
            p.exists(),
            "model {} is missing: run scripts/fetch_model.sh (CI does this first)",
            p.display()
        );
        let file = Arc::new(GgufFile::open(&p).expect("open model"));
        let tok = Arc::new(Tokenizer::from_gguf(&file).expect("tokenizer"));
        (file, tok)
    })
    .clone()
}

/// The backend actor of a test server.
pub struct Actor {
    pub ctx: usize,
    pub max_seqs: usize,
    /// Requests allowed to wait for admission (the per-backend queue cap).
    pub max_waiting: usize,
    /// Every step fails (an internal error).
    pub fault: bool,
}

impl Default for Actor {
    fn default() -> Self {
        Actor {
            ctx: 512,
            max_seqs: 2,
            max_waiting: 64,
            fault: false,
        }
    }
}

pub fn actor(a: &Actor) -> BackendHandle {
    let (file, tok) = model();
    let opts = CpuOptions {
        threads: Some(1),
        ctx_size: a.ctx,
        max_seqs: a.max_seqs,
        block_tokens: 16,
        max_batch_tokens: 256,
        ..CpuOptions::default()
    };
    let fault = a.fault;
    let factory: runtime::BackendFactory = Box::new(move || {
        let be = CpuBackend::from_file(file, MODEL, &opts).map_err(|e| {
            runtime::BackendError::Unsupported {
                backend: "cpu".into(),
                why: e.to_string(),
            }
        })?;
        let be: Box<dyn Backend> = Box::new(be);
        Ok(if fault {
            Box::new(Faulty::new(be, FaultSwitch::new(Fault::Error)))
        } else {
            be
        })
    });
    let cfg = ActorConfig {
        name: Some("cpu".into()),
        max_waiting: a.max_waiting,
        prefill_chunk: 64,
        ..ActorConfig::default()
    };
    runtime::spawn(factory, tok, cfg).expect("actor starts")
}

/// A server on 127.0.0.1, stopped on drop.
pub struct Server {
    pub addr: SocketAddr,
    pub state: Arc<AppState>,
    pub coord: Coordinator,
    rt: tokio::runtime::Runtime,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl Server {
    pub fn start(cfg: ServerConfig, a: Actor) -> Server {
        let (_, tok) = model();
        let coord = Coordinator::new(vec![actor(&a)], RoutingPolicy::default()).unwrap();
        let cfg = ServerConfig {
            model_id: MODEL.into(),
            ..cfg
        };
        let state = AppState::new(coord.clone(), tok, cfg).unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        let task = rt.spawn(server::serve(listener, state.clone(), async {
            let _ = rx.await;
        }));
        Server {
            addr,
            state,
            coord,
            rt,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// KV blocks in use on the backend, once it has settled (cancellations take a step).
    pub fn kv_used_settled(&self) -> usize {
        let b = &self.coord.backends()[0];
        for _ in 0..100 {
            let s = b.status();
            if s.kv.blocks_used == 0 && s.running == 0 && s.waiting == 0 {
                return 0;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        b.status().kv.blocks_used
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = self
                .rt
                .block_on(async { tokio::time::timeout(Duration::from_secs(10), t).await });
        }
    }
}

/// A parsed HTTP response.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "status {}: body is not JSON ({e}): {:?}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// An OpenAI error body: `error.message` and `error.type` strings.
    pub fn assert_openai_error(&self, status: u16) -> serde_json::Value {
        assert_eq!(self.status, status, "{}", self.text());
        let v = self.json();
        let e = &v["error"];
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(e["type"].is_string(), "{v}");
        assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
        v
    }
}

/// Parses a whole response (read to EOF); `None` if the bytes are not one.
pub fn parse_response(raw: &[u8]) -> Option<Resp> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..end]).ok()?;
    let mut lines = head.split("\r\n");
    let status: u16 = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| {
            let (k, v) = l.split_once(':')?;
            Some((k.trim().to_string(), v.trim().to_string()))
        })
        .collect();
    let mut body = raw[end + 4..].to_vec();
    let chunked = headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
    });
    if chunked {
        let mut out = Vec::new();
        let mut rest = &body[..];
        while let Some(nl) = rest.windows(2).position(|w| w == b"\r\n") {
            let size_text = std::str::from_utf8(&rest[..nl]).ok()?;
            let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
            rest = &rest[nl + 2..];
            if size == 0 || rest.len() < size {
                break;
            }
            out.extend_from_slice(&rest[..size]);
            rest = rest.get(size + 2..).unwrap_or(&[]);
        }
        body = out;
    }
    Some(Resp {
        status,
        headers,
        body,
    })
}

/// Sends `raw` on a new connection and reads until the server closes it.
pub fn exchange(addr: SocketAddr, raw: &[u8]) -> Resp {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    s.write_all(raw).unwrap();
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    parse_response(&buf)
        .unwrap_or_else(|| panic!("not an HTTP response: {:?}", String::from_utf8_lossy(&buf)))
}

/// `POST path` with a JSON (or any) body, `Connection: close`.
pub fn post(addr: SocketAddr, path: &str, body: &[u8]) -> Resp {
    let mut raw = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    raw.extend_from_slice(body);
    exchange(addr, &raw)
}

/// `GET path`, `Connection: close`.
pub fn get(addr: SocketAddr, path: &str) -> Resp {
    exchange(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
}

/// A chat request body.
pub fn chat_body(user: &str, extra: &str) -> String {
    let content = serde_json::to_string(user).unwrap();
    format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":{content}}}]{}{extra}}}"#,
        if extra.is_empty() { "" } else { "," }
    )
}
