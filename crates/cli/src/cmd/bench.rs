//! `crossover bench`: the classic table (time to first token, tokens/s, power, energy per
//! token) per workload and backend, measured through the real actors and coordinator.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use bench::measure::Method;
use bench::report::BenchReport;
use bench::workload::Workload;
use gguf::GgufFile;
use indicatif::{ProgressBar, ProgressStyle};
use runtime::{BackendHandle, ShutdownMode};
use tokenizer::Tokenizer;

/// Measure time to first token, tokens/s and power per workload and backend.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// GGUF model file (any; a synthetic one too); default: SmolLM2-135M-Instruct Q4_1.
    #[arg(short = 'm', long)]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub backends: crate::backends::BackendArgs,
    /// Measure only this backend (`cpu`, `cuda:0`, ...).
    #[arg(long)]
    pub backend: Option<String>,
    /// Measured runs per workload and backend.
    #[arg(long, default_value_t = 20)]
    pub runs: usize,
    /// Runs before the measured ones (reported, excluded from the statistics).
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Extra workload `prompt=N,gen=M,concurrency=C` (repeatable).
    #[arg(long = "workload")]
    pub workloads: Vec<String>,
    /// Leave out the built-in workloads (single@512, 4x@512, single@4096).
    #[arg(long = "no-builtin")]
    pub no_builtin: bool,
    /// Context per sequence; default: the largest workload's prompt + generated tokens.
    #[arg(short = 'c', long = "ctx-size")]
    pub ctx_size: Option<usize>,
    /// Most tokens in one step.
    #[arg(short = 'b', long = "batch-size", default_value_t = 512)]
    pub batch_size: usize,
    /// Seed of the prompts' random token ids.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Print the report as JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Draw time to first token and tokens/s against context length per backend (SVG).
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

/// The workloads to run: the built-ins (unless left out) then the `--workload` ones.
pub fn workloads(specs: &[String], no_builtin: bool) -> Result<Vec<Workload>> {
    let mut v = if no_builtin {
        Vec::new()
    } else {
        Workload::builtin()
    };
    for s in specs {
        v.push(s.parse::<Workload>()?);
    }
    if v.is_empty() {
        bail!("no workload: --no-builtin needs at least one --workload prompt=N,gen=M");
    }
    Ok(v)
}

/// Start the backends the flags ask for, keep `only` (when given) or all.
pub fn start_backends(
    args: &crate::backends::BackendArgs,
    only: Option<&str>,
    sizing: &crate::backends::Sizing,
    file: &Arc<GgufFile>,
    tok: &Arc<Tokenizer>,
    label: &str,
) -> Result<Vec<BackendHandle>> {
    let handles = crate::backends::start(args, sizing, file, tok, label, &[])?;
    let Some(name) = only else {
        return Ok(handles);
    };
    let names: Vec<String> = handles.iter().map(|h| h.name().to_string()).collect();
    let keep: Vec<BackendHandle> = handles.into_iter().filter(|h| h.name() == name).collect();
    if keep.is_empty() {
        bail!("no backend named {name:?}; available: {}", names.join(", "));
    }
    Ok(keep)
}

/// Open the model and its tokenizer.
pub fn open_model(model: &Option<PathBuf>) -> Result<(PathBuf, Arc<GgufFile>, Arc<Tokenizer>)> {
    let path = match model {
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
    Ok((path, file, tok))
}

/// A progress bar on stderr (hidden when stderr is not a terminal).
pub fn progress(total: u64) -> ProgressBar {
    let pb = ProgressBar::new(total);
    if let Ok(style) =
        ProgressStyle::with_template("{bar:30} {pos}/{len} runs  {elapsed_precise}  {msg}")
    {
        pb.set_style(style);
    }
    pb
}

pub fn run(a: BenchArgs) -> Result<()> {
    if a.runs == 0 {
        bail!("--runs must be at least 1");
    }
    let work = workloads(&a.workloads, a.no_builtin)?;
    let (path, file, tok) = open_model(&a.model)?;
    let need = work.iter().map(Workload::ctx_needed).max().unwrap_or(1);
    let ctx = a.ctx_size.unwrap_or(need);
    let parallel = work.iter().map(|w| w.concurrency).max().unwrap_or(1);
    let sizing = crate::backends::Sizing {
        ctx_size: ctx,
        parallel,
        batch_size: a.batch_size,
        // A queued request of a concurrent workload waits for the others; never refuse it.
        admission_timeout: Duration::from_secs(3600),
    };
    let label = path.display().to_string();
    let handles = start_backends(
        &a.backends,
        a.backend.as_deref(),
        &sizing,
        &file,
        &tok,
        &label,
    )?;
    let bench::Runners {
        prompts,
        method,
        mut runners,
    } = bench::runners_for(
        &handles,
        &tok,
        Method {
            runs: a.runs,
            warmup: a.warmup,
            seed: a.seed,
        },
    )?;
    // Every workload must fit every backend before anything runs.
    for r in &runners {
        for w in &work {
            r.check(w)?;
        }
    }
    let started = bench::time::now_utc();
    let per = (method.runs + method.warmup) as u64;
    let pb = progress(per * (work.len() * runners.len()) as u64);
    let mut results = Vec::new();
    for w in &work {
        for r in &mut runners {
            let mut i = 0usize;
            let name = r.name().to_string();
            let msg = |i: usize| {
                if i < method.warmup {
                    format!("{name} {w}: warm-up {}/{}", i + 1, method.warmup)
                } else {
                    format!("{name} {w}: run {}/{}", i + 1 - method.warmup, method.runs)
                }
            };
            pb.set_message(msg(0));
            let m = r.measure(w, &prompts, &method, &mut |_| {
                i += 1;
                pb.inc(1);
                pb.set_message(msg(i));
            })?;
            results.push(m);
        }
    }
    pb.finish_and_clear();
    for h in &handles {
        h.shutdown(ShutdownMode::Cancel);
    }
    // Let every backend drop on its own thread before the process exits (a CUDA context torn
    // down by the exit while its actor still runs crashed `bench` at exit on the H200).
    for h in &handles {
        h.join();
    }
    let report = BenchReport {
        model: label,
        started,
        method,
        results,
    };
    if a.json {
        println!("{}", report.json());
    } else {
        print!("{}", report.table());
    }
    if let Some(p) = &a.plot {
        bench::plot::draw(p, &bench::plot::bench_panels(&report.results))?;
        eprintln!("plot written to {}", p.display());
    }
    Ok(())
}
