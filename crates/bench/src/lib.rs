//! crossover's measurements: the methodology of the design as a library the CLI calls.
//!
//! - [`measure`]: runs [`workload::Workload`]s against backend actors through the real
//!   [`runtime::Coordinator`] (the same path `serve` takes) and collects time to first token,
//!   generation throughput and energy per run; [`stats::Stat`] summarizes runs as a median
//!   with its spread.
//! - [`power`]: energy counters: NVML for NVIDIA GPUs, RAPL (`/sys/class/powercap`) for the CPU
//!   package; absent counters are reported as "n/a" with the reason, never estimated.
//! - [`report`]: the table, JSON, and [`plot`] SVG charts.
//! - [`calibrate`]: prompt-length distributions, crossover points per objective, and the routing
//!   policy TOML `serve --routing` loads.
//! - [`audit`]: every op of a model's forward pass with where it runs on a backend, and the share
//!   that falls back to the host, by count and by estimated time.

pub mod audit;
pub mod calibrate;
pub mod measure;
pub mod plot;
pub mod power;
pub mod report;
pub mod stats;
pub mod time;
pub mod workload;

pub use measure::{runners_for, Runners};

/// What can go wrong while measuring.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("workload {spec:?}: {why}")]
    Workload { spec: String, why: String },
    #[error(
        "workload {workload}: prompt of {prompt} tokens + {gen} generated does not fit the \
         context of {ctx} tokens on {backend} (raise --ctx-size)"
    )]
    PromptTooLong {
        workload: String,
        backend: String,
        prompt: usize,
        gen: usize,
        ctx: usize,
    },
    #[error("workload {workload} on {backend}: request {request} of run {run} failed: {source}")]
    Run {
        workload: String,
        backend: String,
        run: usize,
        request: usize,
        #[source]
        source: Box<runtime::RuntimeError>,
    },
    #[error(
        "workload {workload} on {backend}: request {request} of run {run} ended without a summary"
    )]
    NoSummary {
        workload: String,
        backend: String,
        run: usize,
        request: usize,
    },
    #[error("{what}: {why}")]
    Setup { what: String, why: String },
    #[error("{path}: line {line}: {why}")]
    Contexts {
        path: String,
        line: usize,
        why: String,
    },
    #[error("{path}: no prompt lengths found")]
    EmptyContexts { path: String },
    #[error(
        "objective energy needs an energy reading on every backend; {backend} has none: {why}"
    )]
    NoEnergy { backend: String, why: String },
    #[error("writing {path}: {why}")]
    Output { path: String, why: String },
}
