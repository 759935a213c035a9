//! Which compute backends this machine has, and one actor for each.
//!
//! Every command that generates (`run`, `chat`, `serve`) starts its backends here, so they all see
//! the same set: the CPU (one actor, or one per `--cpu-threads` entry) and every CUDA GPU the
//! driver reports (one actor per device, `cuda:0`, `cuda:1`, ...). A GPU that cannot be used is
//! reported once on stderr with the reason and left out, unless `--gpus` named it, which makes
//! that an error.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use cpu::{CpuBackend, CpuOptions};
use cuda::{CudaBackend, CudaOptions};
use gguf::GgufFile;
use runtime::fault::{Fault, FaultSwitch, Faulty};
use runtime::{ActorConfig, Backend, BackendError, BackendHandle};
use tokenizer::Tokenizer;

/// Flags that choose the backends and size them (shared by `run`, `chat` and `serve`).
#[derive(clap::Args, Clone, Debug)]
pub struct BackendArgs {
    /// Threads of the CPU backend (default: every core).
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// One CPU actor per listed thread count (`1,1` = two actors of one thread, `cpu:0` and
    /// `cpu:1`), to split work by policy without a GPU.
    #[arg(long = "cpu-threads", value_delimiter = ',')]
    pub cpu_threads: Vec<usize>,
    /// GPUs to start an actor for: `all` (every CUDA device found; none is fine), `none`, or
    /// device indices such as `0,1` (then a missing or repeated device is an error).
    #[arg(long = "gpus", default_value = "all")]
    pub gpus: String,
    /// Leave the CPU backend out (with a GPU present).
    #[arg(long = "no-cpu")]
    pub no_cpu: bool,
    /// Restart attempts in a row for a crashed backend before it is marked failed (0: never).
    #[arg(long = "max-restarts", default_value_t = 5)]
    pub max_restarts: u32,
    /// Seconds before the first restart attempt of a crashed backend; doubles with each attempt
    /// (at most 30 s).
    #[arg(long = "restart-backoff", default_value_t = 0.5)]
    pub restart_backoff: f64,
    /// Most requests waiting for admission on one backend; one more is refused as overloaded
    /// (HTTP 429 from `serve`).
    #[arg(long = "max-queued", default_value_t = 64)]
    pub max_queued: usize,
    /// Partial placement for models bigger than GPU memory: layers 0..N keep their matmul
    /// weights on each GPU; the matmuls of layers N and above stay in host memory and run on the
    /// CPU inside the GPU backend's plan (everything else of those layers stays on the GPU).
    /// Default: every layer on the GPU.
    #[arg(
        long = "layers-on-gpu",
        visible_alias = "n-gpu-layers",
        value_name = "N"
    )]
    pub layers_on_gpu: Option<usize>,
    /// Keep the CPU backend's weights memory-mapped, zero-copy (`-nr` as in llama.cpp): they
    /// stay pageable page-cache pages shared with other processes mapping the file, but run on
    /// the slower GGUF-layout kernels (same logits bit for bit). Default: repacked at load into
    /// owned memory for faster kernels (each weight still held once).
    #[arg(long = "no-repack")]
    pub no_repack: bool,
    /// Compute every prompt from its first token instead of starting it from cached KV blocks
    /// that already hold its beginning (the prefix cache; docs/server.md). The environment
    /// variable `CROSSOVER_PREFIX_CACHE=0` does the same.
    #[arg(long = "no-prefix-cache")]
    pub no_prefix_cache: bool,
    /// GPU backends reproduce the CPU backend's logits bit for bit (its summation orders, op by
    /// op; much slower than the default kernels), so a request gives the same tokens whichever
    /// backend serves it. `CROSSOVER_CUDA_EXACT=1` does the same (docs/operations.md).
    #[arg(long = "exact")]
    pub exact: bool,
}

impl BackendArgs {
    /// The host placement each CUDA backend gets from these flags.
    pub fn host_plan(&self) -> cuda::HostPlan {
        cuda::HostPlan {
            layers_on_gpu: self.layers_on_gpu,
            ..cuda::HostPlan::default()
        }
    }
}

/// How big each backend's KV pool and steps are.
#[derive(Clone, Copy, Debug)]
pub struct Sizing {
    /// Tokens one sequence may hold.
    pub ctx_size: usize,
    /// Sequences generated at once per backend.
    pub parallel: usize,
    /// Most tokens in one step.
    pub batch_size: usize,
    /// How long a request may wait for KV space before it is refused.
    pub admission_timeout: Duration,
}

/// Which GPUs `--gpus` asks for.
enum GpuChoice {
    All,
    None,
    These(Vec<usize>),
}

fn parse_gpus(s: &str) -> Result<GpuChoice> {
    match s.trim() {
        "all" => Ok(GpuChoice::All),
        "none" | "" => Ok(GpuChoice::None),
        list => {
            let v = list
                .split(',')
                .map(|p| {
                    p.trim()
                        .parse::<usize>()
                        .with_context(|| format!("--gpus: `{p}` is not a device index"))
                })
                .collect::<Result<Vec<_>>>()?;
            // One actor owns each GPU: two backends on one device would share its context
            // (docs/perf/cuda.md session 21 saw cuBLAS and graph-capture failures that way).
            if let Some((i, d)) = v.iter().enumerate().find(|(i, d)| v[..*i].contains(d)) {
                bail!(
                    "--gpus: device {d} is named twice (entry {}); one actor owns each GPU",
                    i + 1
                );
            }
            Ok(GpuChoice::These(v))
        }
    }
}

/// Start every backend the flags ask for and the machine has. `faults` names backends whose steps
/// fail from the start (a hidden testing aid of `serve`).
pub fn start(
    a: &BackendArgs,
    size: &Sizing,
    file: &Arc<GgufFile>,
    tok: &Arc<Tokenizer>,
    label: &str,
    faults: &[String],
) -> Result<Vec<BackendHandle>> {
    let gpus = parse_gpus(&a.gpus)?;
    let backoff = Duration::try_from_secs_f64(a.restart_backoff).with_context(|| {
        format!(
            "--restart-backoff must be a non-negative number of seconds, got {}",
            a.restart_backoff
        )
    })?;
    let restart = runtime::RestartPolicy {
        max_restarts: a.max_restarts,
        backoff,
        ..runtime::RestartPolicy::default()
    };
    let defaults = ActorConfig::default();
    let prefix_cache = !a.no_prefix_cache
        && !matches!(
            std::env::var("CROSSOVER_PREFIX_CACHE").as_deref(),
            Ok("0" | "off" | "false")
        );
    let device_pick = !matches!(
        std::env::var("CROSSOVER_DEVICE_PICK").as_deref(),
        Ok("0" | "off" | "false")
    );
    let decode_chain = std::env::var("CROSSOVER_DECODE_CHAIN")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(defaults.decode_chain);
    let cfg = |name: &str| ActorConfig {
        name: Some(name.to_string()),
        admission_timeout: size.admission_timeout,
        restart: restart.clone(),
        max_waiting: a.max_queued,
        prefix_cache,
        device_pick,
        decode_chain,
        ..defaults.clone()
    };
    let mut handles = Vec::new();

    let devices: Vec<usize> = match &gpus {
        GpuChoice::None => Vec::new(),
        GpuChoice::All => match cuda::available() {
            Ok(n) => (0..n).collect(),
            Err(e) => {
                tracing::debug!("no CUDA backend: {e}");
                Vec::new()
            }
        },
        GpuChoice::These(list) => {
            let n = cuda::available().context("--gpus names devices but CUDA is not usable")?;
            if let Some(bad) = list.iter().find(|&&d| d >= n) {
                bail!("--gpus: device {bad} does not exist (this machine has {n})");
            }
            list.clone()
        }
    };
    let split = placement(file, &a.host_plan());
    for d in devices {
        let name = format!("cuda:{d}");
        let opts = CudaOptions {
            device: d,
            ctx_size: size.ctx_size,
            max_seqs: size.parallel.max(1),
            max_batch_tokens: size.batch_size.max(1),
            host: a.host_plan(),
            // The CPU backend's orders in this process (`CROSSOVER_CPU_ORDER` included).
            exact: a.exact.then(|| {
                let c = CpuOptions::default();
                (c.prompt_order, c.decode_order)
            }),
            ..CudaOptions::default()
        };
        let (file, label) = (file.clone(), label.to_string());
        let factory = factory(&name, faults, move || {
            CudaBackend::from_file(file.clone(), &label, &opts)
                .map(|b| Box::new(b) as Box<dyn Backend>)
                .map_err(|e| e.to_string())
        });
        match runtime::spawn(factory, tok.clone(), cfg(&name)) {
            Ok(h) => {
                eprintln!("backend {name}: {}", h.info().device);
                if let Some(split) = &split {
                    eprintln!("backend {name}: {split}");
                }
                handles.push(h);
            }
            Err(e) if matches!(gpus, GpuChoice::All) => {
                eprintln!("backend {name}: not started: {e}");
            }
            Err(e) => return Err(e).with_context(|| format!("starting backend {name}")),
        }
    }

    if let Some(n) = a.layers_on_gpu {
        if !handles.iter().any(|h| h.name().starts_with("cuda:")) {
            eprintln!(
                "--layers-on-gpu {n}: no GPU backend started; the CPU backend runs every layer"
            );
        }
    }

    if !a.no_cpu {
        let threads: Vec<Option<usize>> = if a.cpu_threads.is_empty() {
            vec![a.threads]
        } else {
            a.cpu_threads.iter().map(|&t| Some(t)).collect()
        };
        let many = threads.len() > 1;
        for (i, t) in threads.into_iter().enumerate() {
            let name = if many {
                format!("cpu:{i}")
            } else {
                "cpu".to_string()
            };
            let opts = CpuOptions {
                threads: t,
                ctx_size: size.ctx_size,
                max_seqs: size.parallel.max(1),
                max_batch_tokens: size.batch_size.max(1),
                no_repack: a.no_repack,
                ..CpuOptions::default()
            };
            let (file, label) = (file.clone(), label.to_string());
            let factory = factory(&name, faults, move || {
                CpuBackend::from_file(file.clone(), &label, &opts)
                    .map(|b| Box::new(b) as Box<dyn Backend>)
                    .map_err(|e| e.to_string())
            });
            let h = runtime::spawn(factory, tok.clone(), cfg(&name))
                .with_context(|| format!("starting backend {name}"))?;
            eprintln!(
                "backend {name}: {} (ctx {} x {} sequences)",
                h.info().device,
                size.ctx_size,
                size.parallel.max(1)
            );
            handles.push(h);
        }
    }
    for f in faults {
        if !handles.iter().any(|h| h.name() == f) {
            bail!("--inject-fault {f}: no such backend");
        }
    }
    if handles.is_empty() {
        bail!("no backend to run on (--no-cpu and no usable GPU)");
    }
    Ok(handles)
}

/// How a GPU backend's matmul weights are split under `plan`, when it puts any on the host.
fn placement(file: &GgufFile, plan: &cuda::HostPlan) -> Option<cuda::WeightSplit> {
    if *plan == cuda::HostPlan::default() {
        return None;
    }
    let cfg = model::ModelConfig::from_gguf(file).ok()?;
    let w = model::ModelWeights::from_gguf(&cfg, file).ok()?;
    Some(cuda::host::weight_split(&cfg, &w, plan))
}

/// The factory an actor runs on its own thread: build the backend, wrapped in the fault switch
/// when `faults` names it.
fn factory<F>(name: &str, faults: &[String], build: F) -> runtime::RestartFactory
where
    F: Fn() -> Result<Box<dyn Backend>, String> + Send + Sync + 'static,
{
    let name = name.to_string();
    // Restartable: the actor's supervisor runs it again after a crash. One switch for every
    // rebuilt backend, so `--inject-fault` keeps failing it after a restart.
    let switch = faults
        .contains(&name)
        .then(|| FaultSwitch::new(Fault::Error));
    Arc::new(move || {
        let be = build().map_err(|why| BackendError::Unsupported {
            backend: name.clone(),
            why,
        })?;
        Ok(match &switch {
            Some(sw) => Box::new(Faulty::new(be, sw.clone())) as Box<dyn Backend>,
            None => be,
        })
    })
}
