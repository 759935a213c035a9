//! `crossover audit`: every op of a model's forward pass, where it runs on each backend (native,
//! or fallback to the host and why), and the share that falls back.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use bench::audit::{audit, audit_with, support_matrix_csv, Audit};
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
    /// Backend to audit: `cpu`, `cuda:N`, or a test double built without one tensor type's
    /// matmul kernel: `cpu-lacking-TYPE` (e.g. `cpu-lacking-q8_0`) or `cuda:N-lacking-TYPE`
    /// (e.g. `cuda:0-lacking-q6_k`), whose matmuls of that type run on the host. Default: every
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
    /// Audit the CUDA backends with layers 0..N's matmul weights on the GPU and the rest in
    /// host memory, run on the CPU (the placement `run`/`serve`/`bench --layers-on-gpu N` use).
    /// Without a GPU, `cuda:0` is audited from the file with the CUDA backend's own support
    /// function.
    #[arg(
        long = "layers-on-gpu",
        visible_alias = "n-gpu-layers",
        value_name = "N"
    )]
    pub layers_on_gpu: Option<usize>,
    /// Keep the CPU backend's weights memory-mapped, zero-copy (`-nr`; see `run --help`).
    #[arg(long = "no-repack")]
    pub no_repack: bool,
}

/// One audited backend, as built (or, for CUDA without a GPU, as planned).
struct Audited {
    audit: Audit,
    /// The CUDA backend's placement of the matmul weights (CUDA only).
    split: Option<cuda::WeightSplit>,
    /// GPU memory the backend took at load (a real CUDA backend only).
    loaded: Option<u64>,
}

/// Build the named backend (small KV cache: only its answers are needed) and audit it. A CUDA
/// backend on a machine where CUDA is not usable is audited from the file with
/// `cuda::host::cuda_support` (the function `CudaBackend::support` calls), labelled as planned.
fn audit_one(
    name: &str,
    a: &AuditArgs,
    file: &Arc<GgufFile>,
    label: &str,
    cfg: &ModelConfig,
    weights: &ModelWeights,
) -> Result<Audited> {
    // The KV cache of both backends is f16.
    let run = |be: &dyn Backend| audit(cfg, weights, be, a.tokens, a.kv, GgmlType::F16);
    let copts = CpuOptions {
        ctx_size: 64,
        max_seqs: 1,
        no_repack: a.no_repack,
        ..CpuOptions::default()
    };
    let parse_ty = |ty: &str| {
        GgmlType::from_name(&ty.to_uppercase())
            .with_context(|| format!("--backend {name}: `{ty}` is not a tensor type"))
    };
    if name == "cpu" || name.starts_with("cpu-lacking-") {
        let be = match name.strip_prefix("cpu-lacking-") {
            None => CpuBackend::from_file(file.clone(), label, &copts)?,
            Some(ty) => CpuBackend::lacking_kernel(file.clone(), label, &copts, parse_ty(ty)?)?,
        };
        return Ok(Audited {
            audit: run(&be),
            split: None,
            loaded: None,
        });
    }
    if let Some(rest) = name.strip_prefix("cuda:") {
        let (device, lacking) = match cuda::HostPlan::parse_name(name) {
            Some(p) => p,
            None => {
                // Say which part is wrong.
                match rest.split_once("-lacking-") {
                    Some((_, ty)) => {
                        parse_ty(ty)?;
                        bail!("--backend {name}: not a device index before -lacking-")
                    }
                    None => bail!("--backend {name}: `{rest}` is not a device index"),
                }
            }
        };
        let plan = cuda::HostPlan {
            layers_on_gpu: a.layers_on_gpu,
            lacking,
            ..cuda::HostPlan::default()
        };
        let split = Some(cuda::host::weight_split(cfg, weights, &plan));
        match cuda::available() {
            Ok(n) if device < n => {
                let opts = CudaOptions {
                    device,
                    ctx_size: 64,
                    max_seqs: 1,
                    host: plan,
                    ..CudaOptions::default()
                };
                let b = CudaBackend::from_file(file.clone(), label, &opts)
                    .map_err(|e| anyhow::anyhow!("starting {name}: {e}"))?;
                Ok(Audited {
                    audit: run(&b),
                    split,
                    loaded: Some(b.memory_loaded()),
                })
            }
            Ok(n) => {
                bail!("--backend {name}: device {device} does not exist (this machine has {n})")
            }
            Err(why) => {
                let desc = format!(
                    "planned from the file: no GPU here ({why}); answers from the CUDA \
                     backend's own support function"
                );
                Ok(Audited {
                    audit: audit_with(
                        cfg,
                        weights,
                        (&plan.backend_name(device), &desc),
                        &|op| cuda::host::cuda_support(&plan, op),
                        a.tokens,
                        a.kv,
                        GgmlType::F16,
                    ),
                    split,
                    loaded: None,
                })
            }
        }
    } else {
        bail!("unknown backend {name:?} (expected cpu, cuda:N, cpu-lacking-TYPE or cuda:N-lacking-TYPE)")
    }
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
    if let Some(n) = a.layers_on_gpu {
        if n > cfg.n_layer {
            bail!("--layers-on-gpu {n}: the model has {} layers", cfg.n_layer);
        }
    }
    let names: Vec<String> = if a.backend.is_empty() {
        let mut v = vec!["cpu".to_string()];
        match cuda::available() {
            Ok(n) => v.extend((0..n).map(|d| format!("cuda:{d}"))),
            // The placement asked for is still shown, planned from the file.
            Err(_) if a.layers_on_gpu.is_some() => v.push("cuda:0".into()),
            Err(e) => eprintln!("no CUDA backend audited: {e}"),
        }
        v
    } else {
        a.backend.clone()
    };
    if a.layers_on_gpu.is_some() && !names.iter().any(|n| n.starts_with("cuda:")) {
        bail!("--layers-on-gpu places layers of a CUDA backend; no cuda:N backend is audited");
    }
    let label = path.display().to_string();
    let mut done: Vec<Audited> = Vec::new();
    for n in &names {
        done.push(audit_one(n, &a, &file, &label, &cfg, &weights)?);
    }
    let audits: Vec<Audit> = done.iter().map(|d| d.audit.clone()).collect();
    if a.json {
        let per: Vec<serde_json::Value> = done
            .iter()
            .map(|d| {
                serde_json::json!({
                    "backend": d.audit.backend,
                    "weights_on_gpu_bytes": d.split.map(|s| s.device_bytes),
                    "weights_on_host_bytes": d.split.map(|s| s.host_bytes),
                    "matmuls_on_host": d.split.map(|s| s.host_mats),
                    "gpu_memory_loaded_bytes": d.loaded,
                    "fallback_by_reason": d.audit.by_reason().iter().map(|(why, n, c, t)| {
                        serde_json::json!({"reason": why, "ops": n, "count_pct": c, "time_pct": t})
                    }).collect::<Vec<_>>(),
                })
            })
            .collect();
        let v = serde_json::json!({
            "model": label,
            "layers_on_gpu": a.layers_on_gpu,
            "audits": audits,
            "placement": per,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("model: {label}");
        for d in &done {
            let au = &d.audit;
            println!("\n== {} ({})", au.backend, au.device);
            print!("{}", au.table());
            println!("{}", au.summary());
            for (why, n, c, t) in au.by_reason() {
                println!("  {why}: {n} ops, {c:.1}% by count, {t:.1}% by estimated time");
            }
            if let Some(s) = &d.split {
                println!("  weights: {s}");
            }
            if let Some(b) = d.loaded {
                println!(
                    "  GPU memory taken at load: {:.1} MiB (weights, f16 copies, a 64-token KV cache, scratch)",
                    b as f64 / (1u64 << 20) as f64
                );
            }
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
