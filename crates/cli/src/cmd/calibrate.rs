//! `crossover calibrate`: measure every backend across the user's prompt lengths, find where the
//! best backend changes for an objective, and write the routing policy `serve --routing` loads.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use bench::calibrate::{parse_contexts, Calibration, Distribution, Objective};
use bench::measure::Method;
use bench::workload::Workload;
use runtime::ShutdownMode;

/// Measure backends across your prompt lengths and write a routing policy from the crossovers.
#[derive(clap::Args, Debug)]
pub struct CalibrateArgs {
    /// Prompt lengths: one number per line, or the JSONL request log of `serve --log-requests`.
    #[arg(long, value_name = "FILE")]
    pub contexts: PathBuf,
    /// What "best" means: ttft (time to first token), throughput (tokens/s) or energy (J/token).
    #[arg(long, default_value = "ttft")]
    pub objective: Objective,
    /// Where to write the routing policy (TOML).
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    pub output: PathBuf,
    /// GGUF model file; default: SmolLM2-135M-Instruct Q4_1.
    #[arg(short = 'm', long)]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub backends: crate::backends::BackendArgs,
    /// Prompt lengths to measure: this many quantiles of the distribution (min and max
    /// included), plus p50, p95 and p99.
    #[arg(long, default_value_t = 6)]
    pub points: usize,
    /// Concurrencies to measure at (the highest one decides the `batch = true` rules).
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    pub concurrency: Vec<usize>,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 32)]
    pub gen: usize,
    /// Measured runs per point.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Warm-up runs per point (excluded).
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Context per sequence; default: the longest prompt measured + --gen.
    #[arg(short = 'c', long = "ctx-size")]
    pub ctx_size: Option<usize>,
    /// Most tokens in one step.
    #[arg(short = 'b', long = "batch-size", default_value_t = 512)]
    pub batch_size: usize,
    /// Seed of the prompts' random token ids.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Draw the objective against prompt length per backend with the crossovers (SVG).
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// Also write everything measured as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

pub fn run(a: CalibrateArgs) -> Result<()> {
    if a.runs == 0 || a.gen == 0 {
        bail!("--runs and --gen must be at least 1");
    }
    let mut concs = a.concurrency.clone();
    concs.sort_unstable();
    concs.dedup();
    if concs.first() == Some(&0) || concs.is_empty() {
        bail!("--concurrency needs whole numbers of at least 1");
    }
    if concs[0] != 1 {
        concs.insert(0, 1);
    }
    let shown = a.contexts.display().to_string();
    let text = std::fs::read_to_string(&a.contexts)
        .with_context(|| format!("reading --contexts {shown}"))?;
    let lengths = parse_contexts(&text, &shown)?;
    let dist = Distribution::of(&lengths).context("no prompt lengths")?;
    println!(
        "prompt lengths ({shown}): n {}, min {}, p50 {:.0}, p95 {:.0}, p99 {:.0}, max {}",
        dist.n, dist.min, dist.p50, dist.p95, dist.p99, dist.max
    );
    let (path, file, tok) = super::bench::open_model(&a.model)?;
    let ctx = a.ctx_size.unwrap_or(dist.max + a.gen);
    if ctx <= a.gen {
        bail!(
            "--ctx-size {ctx} leaves no room for a prompt before --gen {}",
            a.gen
        );
    }
    let grid = dist.grid(a.points, ctx - a.gen);
    println!(
        "measuring prompt lengths {grid:?} at concurrency {concs:?}, {} runs (+{} warm-up) each",
        a.runs, a.warmup
    );
    let sizing = crate::backends::Sizing {
        ctx_size: ctx,
        parallel: *concs.last().unwrap_or(&1),
        batch_size: a.batch_size,
        admission_timeout: Duration::from_secs(3600),
    };
    let label = path.display().to_string();
    let handles = crate::backends::start(&a.backends, &sizing, &file, &tok, &label, &[])?;
    if handles.len() < 2 {
        eprintln!(
            "note: only one backend ({}); the policy will send everything there",
            handles.first().map_or("none", |h| h.name())
        );
    }
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
    let started = bench::time::now_utc();
    let work: Vec<Workload> = concs
        .iter()
        .flat_map(|&c| grid.iter().map(move |&p| Workload::new(p, a.gen, c)))
        .collect();
    let pb = super::bench::progress(((a.runs + a.warmup) * work.len() * runners.len()) as u64);
    let mut measurements = Vec::new();
    for w in &work {
        for r in &mut runners {
            pb.set_message(format!("{} {w}", r.name()));
            measurements.push(r.measure(w, &prompts, &method, &mut |_| pb.inc(1))?);
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
    let cal = Calibration::decide(
        label,
        shown,
        started,
        a.objective,
        dist,
        a.gen,
        method,
        measurements,
    )?;
    let toml = cal.policy_toml();
    std::fs::write(&a.output, &toml)
        .with_context(|| format!("writing the policy to {}", a.output.display()))?;
    // What was written must load, as `serve --routing` will load it.
    runtime::RoutingPolicy::load(&a.output)
        .with_context(|| format!("reloading {}", a.output.display()))?;
    for line in toml
        .lines()
        .filter(|l| l.starts_with("#   ") || l.starts_with("# crossover"))
    {
        println!("{}", line.trim_start_matches("# "));
    }
    println!("policy written to {}", a.output.display());
    if let Some(p) = &a.json {
        let s = serde_json::to_string_pretty(&cal).context("serializing the calibration")?;
        std::fs::write(p, s).with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = &a.plot {
        bench::plot::draw(p, &cal.panels())?;
        eprintln!("plot written to {}", p.display());
    }
    Ok(())
}
