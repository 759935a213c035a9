//! `crossover audit`: every op of a model's forward pass, where it runs on each backend (native,
//! or fallback to the host and why), and the share that falls back.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use bench::audit::{audit, support_matrix_csv, Audit};
use cpu::{CpuBackend, CpuOptions};
use cuda::{CudaBackend, CudaOptions};
use gguf::{GgmlType, GgufFile};
use model::{ModelConfig, ModelWeights};
use runtime::Backend;

/// List a model's ops with where they run on a backend, and the share that falls back.
#[derive(clap::Args, Debug)]
pub struct AuditArgs {
    /// GGUF model file; default: SmolLM2-135M-Instruct Q4_1.
    #[arg(short = 'm', long)]
    pub model: Option<PathBuf>,
    /// Backend to audit: `cpu`, `cuda:N`, or the test double `cpu-lacking-TYPE` (the CPU
    /// backend built without TYPE's matmul kernel, e.g. `cpu-lacking-q8_0`). Default: every
    /// backend this machine has.
    #[arg(long)]
    pub backend: Vec<String>,
    /// Tokens of the step audited (1 = a decode step).
    #[arg(long, default_value_t = 1)]
    pub tokens: u64,
    /// Cached positions the step attends over.
    #[arg(long, default_value_t = 512)]
    pub kv: u64,
    /// Exit with an error when a backend's fallback share (the larger of by-count and
    /// by-estimated-time) exceeds --max-fallback.
    #[arg(long)]
    pub strict: bool,
    /// Percent for --strict.
    #[arg(long = "max-fallback", default_value_t = 15.0)]
    pub max_fallback: f64,
    /// Write the op-by-backend support matrix (one row per op and type) as CSV.
    #[arg(long, value_name = "FILE")]
    pub csv: Option<PathBuf>,
    /// Print the audit as JSON instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Show placement with the first N layers on the GPU and the rest on the host.
    #[arg(long = "layers-on-gpu", value_name = "N")]
    pub layers_on_gpu: Option<usize>,
}

/// Build the named backend (small KV cache: only its answers are needed).
fn build(name: &str, file: &Arc<GgufFile>, label: &str) -> Result<Box<dyn Backend>> {
    let copts = CpuOptions {
        ctx_size: 64,
        max_seqs: 1,
        ..CpuOptions::default()
    };
    if name == "cpu" {
        return Ok(Box::new(CpuBackend::from_file(
            file.clone(),
            label,
            &copts,
        )?));
    }
    if let Some(ty) = name.strip_prefix("cpu-lacking-") {
        let t = GgmlType::from_name(&ty.to_uppercase())
            .with_context(|| format!("--backend {name}: `{ty}` is not a tensor type"))?;
        return Ok(Box::new(CpuBackend::lacking_kernel(
            file.clone(),
            label,
            &copts,
            t,
        )?));
    }
    if let Some(d) = name.strip_prefix("cuda:") {
        let device: usize = d
            .parse()
            .with_context(|| format!("--backend {name}: `{d}` is not a device index"))?;
        let opts = CudaOptions {
            device,
            ctx_size: 64,
            max_seqs: 1,
            ..CudaOptions::default()
        };
        let b = CudaBackend::from_file(file.clone(), label, &opts)
            .map_err(|e| anyhow::anyhow!("starting {name}: {e}"))?;
        return Ok(Box::new(b));
    }
    bail!("unknown backend {name:?} (expected cpu, cuda:N or cpu-lacking-TYPE)")
}

pub fn run(a: AuditArgs) -> Result<()> {
    let path = match &a.model {
        Some(p) => p.clone(),
        None => crate::default_model::path()?,
    };
    let file = Arc::new(
        GgufFile::open(&path).with_context(|| format!("opening model {}", path.display()))?,
    );
    let cfg = ModelConfig::from_gguf(&file)
        .with_context(|| format!("reading the architecture of {}", path.display()))?;
    let weights = ModelWeights::from_gguf(&cfg, &file)
        .with_context(|| format!("finding the weights of {}", path.display()))?;
    if a.tokens == 0 {
        bail!("--tokens must be at least 1");
    }
    let names: Vec<String> = if a.backend.is_empty() {
        let mut v = vec!["cpu".to_string()];
        match cuda::available() {
            Ok(n) => v.extend((0..n).map(|d| format!("cuda:{d}"))),
            Err(e) => eprintln!("no CUDA backend audited: {e}"),
        }
        v
    } else {
        a.backend.clone()
    };
    let label = path.display().to_string();
    let mut audits: Vec<Audit> = Vec::new();
    for n in &names {
        let be = build(n, &file, &label)?;
        // The KV cache of both backends is f16.
        audits.push(audit(
            &cfg,
            &weights,
            be.as_ref(),
            a.tokens,
            a.kv,
            GgmlType::F16,
        ));
    }
    let placement_note = a.layers_on_gpu.map(|n| {
        format!(
            "--layers-on-gpu {n}: partial placement is not supported: the CUDA backend keeps \
             every layer on the device (all {} layers here), and no backend splits layers \
             between device and host; the audit shows the placement the backends really use",
            cfg.n_layer
        )
    });
    if a.json {
        let v = serde_json::json!({
            "model": label,
            "audits": audits,
            "layers_on_gpu": placement_note,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("model: {label}");
        if let Some(n) = &placement_note {
            println!("{n}");
        }
        for au in &audits {
            println!("\n== {} ({})", au.backend, au.device);
            print!("{}", au.table());
            println!("{}", au.summary());
        }
    }
    if let Some(p) = &a.csv {
        std::fs::write(p, support_matrix_csv(&audits))
            .with_context(|| format!("writing {}", p.display()))?;
        eprintln!("support matrix written to {}", p.display());
    }
    if a.strict {
        let over: Vec<String> = audits
            .iter()
            .filter(|au| au.fallback_pct() > a.max_fallback)
            .map(|au| {
                format!(
                    "{} falls back {:.1}% by count, {:.1}% by estimated time",
                    au.backend, au.fallback_count_pct, au.fallback_time_pct
                )
            })
            .collect();
        if !over.is_empty() {
            bail!(
                "--strict: above --max-fallback {}%: {}",
                a.max_fallback,
                over.join("; ")
            );
        }
    }
    Ok(())
}
