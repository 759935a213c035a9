//! Audit: every op of a model's forward pass, where it runs on a backend (native, or fallback
//! to the host and why), and the share that falls back by count and by estimated time.
//!
//! **How time is estimated.** Each op gets a roofline estimate on a nominal device,
//! `max(bytes / B, flops / F)` with `B` = [`NOMINAL_BYTES_PER_S`] and `F` =
//! [`NOMINAL_FLOPS_PER_S`]: bytes are what the op must read and write (weights in their stored
//! type, only the rows a `get_rows` looks up, the KV cache in its type, f32 activations), flops
//! its arithmetic (`2 k n t` for a matmul, `4 d h t kv` for attention, a few per element for the
//! rest). Only shares are reported, so the nominal device matters only through `F / B`
//! (10 flop/byte): decode steps come out memory-bound, as they are on real hardware. It
//! estimates the op itself, not the transfers a fallback adds.

use gguf::GgmlType;
use model::{ModelConfig, ModelWeights, OpKind};
use runtime::{Backend, Support};
use serde::Serialize;

/// Nominal memory bandwidth of the estimate (bytes/s).
pub const NOMINAL_BYTES_PER_S: f64 = 100e9;
/// Nominal arithmetic rate of the estimate (flop/s).
pub const NOMINAL_FLOPS_PER_S: f64 = 1e12;

/// Where one op runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "placement", rename_all = "lowercase")]
pub enum Placement {
    Native,
    /// Runs on `to` inside the backend's plan.
    Fallback {
        to: String,
        why: String,
    },
    /// The backend cannot run it at all (the model does not load there).
    Unsupported {
        why: String,
    },
}

impl From<Support> for Placement {
    fn from(s: Support) -> Placement {
        match s {
            Support::Native => Placement::Native,
            // The backends' way of saying "nowhere".
            Support::Fallback { to, why } if to == "none" => Placement::Unsupported { why },
            Support::Fallback { to, why } => Placement::Fallback { to, why },
        }
    }
}

impl Placement {
    /// Short form for tables and the CSV.
    pub fn short(&self) -> String {
        match self {
            Placement::Native => "native".into(),
            Placement::Fallback { to, .. } => format!("fallback:{to}"),
            Placement::Unsupported { .. } => "unsupported".into(),
        }
    }

    /// Not native.
    pub fn is_fallback(&self) -> bool {
        !matches!(self, Placement::Native)
    }
}

/// One op of the forward pass on one backend.
#[derive(Clone, Debug, Serialize)]
pub struct OpRow {
    pub layer: Option<usize>,
    /// `mat_mul`, `rms_norm`, ... (`model::OpKind::name`).
    pub op: String,
    /// The weight it reads, or a label.
    pub name: String,
    /// Type of the weight it reads (the KV cache type for attention and the KV store).
    pub ty: String,
    pub inputs: Vec<Vec<u64>>,
    pub output: Vec<u64>,
    pub placement: Placement,
    pub bytes: u64,
    pub flops: u64,
    /// Estimated time on the nominal device, microseconds.
    pub est_us: f64,
}

/// A model's ops on one backend.
#[derive(Clone, Debug, Serialize)]
pub struct Audit {
    pub backend: String,
    pub device: String,
    /// Tokens of the step audited and KV positions after it.
    pub n_tokens: u64,
    pub n_kv: u64,
    pub ops: Vec<OpRow>,
    /// Percent of ops that are not native.
    pub fallback_count_pct: f64,
    /// Percent of estimated time in ops that are not native.
    pub fallback_time_pct: f64,
}

fn elems(shape: &[u64]) -> u64 {
    shape.iter().product()
}

fn type_bytes(ty: GgmlType, n: u64) -> u64 {
    let bs = ty.block_size() as u64;
    n.div_ceil(bs) * ty.type_size() as u64
}

/// Bytes moved and flops of one op (see the module docs).
pub fn cost(op: &model::OpDesc) -> (u64, u64) {
    let out = elems(&op.output);
    let input = |i: usize| op.inputs.get(i).map_or(0, |s| elems(s));
    let act = |n: u64| 4 * n;
    match op.kind {
        OpKind::GetRows => {
            // Only the looked-up rows of the table are read.
            let row = op
                .inputs
                .first()
                .and_then(|s| s.first())
                .copied()
                .unwrap_or(0);
            let t = op
                .inputs
                .get(1)
                .and_then(|s| s.first())
                .copied()
                .unwrap_or(0);
            (type_bytes(op.ty, row) * t + act(out), 2 * out)
        }
        OpKind::MatMul => {
            let w = op.inputs.first().cloned().unwrap_or_default();
            let (k, n) = (
                w.first().copied().unwrap_or(0),
                w.get(1).copied().unwrap_or(1),
            );
            let t = op
                .inputs
                .get(1)
                .and_then(|s| s.get(1))
                .copied()
                .unwrap_or(1);
            (
                type_bytes(op.ty, k * n) + act(input(1)) + act(out),
                2 * k * n * t,
            )
        }
        OpKind::Attention => {
            let q = op.inputs.first().cloned().unwrap_or_default();
            let kv = op.inputs.get(1).cloned().unwrap_or_default();
            let (d, h, t) = (
                q.first().copied().unwrap_or(0),
                q.get(1).copied().unwrap_or(0),
                q.get(2).copied().unwrap_or(0),
            );
            let n_kv = kv.get(2).copied().unwrap_or(0);
            (
                act(input(0)) + type_bytes(op.ty, input(1) + input(2)) + act(out),
                4 * d * h * t * n_kv,
            )
        }
        OpKind::KvStore => (
            act(input(0) + input(1)) + type_bytes(op.ty, input(0) + input(1)),
            0,
        ),
        OpKind::RmsNorm => (act(input(0)) + act(input(1)) + act(out), 3 * out),
        OpKind::Rope => (act(input(0)) + act(out), 6 * out),
        OpKind::SwiGlu => (act(input(0) + input(1)) + act(out), 6 * out),
        OpKind::Add | OpKind::AddBias => (act(input(0) + input(1)) + act(out), out),
    }
}

/// Estimated seconds of an op on the nominal device.
pub fn estimate_s(bytes: u64, flops: u64) -> f64 {
    (bytes as f64 / NOMINAL_BYTES_PER_S).max(flops as f64 / NOMINAL_FLOPS_PER_S)
}

/// Ask `backend` about every op of a step of `n_tokens` tokens with `n_kv` cached positions
/// after it (KV cache in `kv_type`).
pub fn audit(
    cfg: &ModelConfig,
    weights: &ModelWeights,
    backend: &dyn Backend,
    n_tokens: u64,
    n_kv: u64,
    kv_type: GgmlType,
) -> Audit {
    let info = backend.info();
    audit_with(
        cfg,
        weights,
        (&info.name, &info.device),
        &|op| backend.support(op),
        n_tokens,
        n_kv,
        kv_type,
    )
}

/// [`audit`] with the backend's answer function given directly (`(name, device)` label the
/// result): for a placement computed without the device, e.g. `cuda::host::cuda_support` on a
/// machine without a GPU.
pub fn audit_with(
    cfg: &ModelConfig,
    weights: &ModelWeights,
    (name, device): (&str, &str),
    support: &dyn Fn(&runtime::OpDesc) -> Support,
    n_tokens: u64,
    n_kv: u64,
    kv_type: GgmlType,
) -> Audit {
    let ops = model::ops(cfg, weights, n_tokens, n_kv.max(n_tokens), kv_type);
    let rows: Vec<OpRow> = ops
        .iter()
        .map(|op| {
            let placement = Placement::from(support(&runtime::OpDesc::from_model(op)));
            let (bytes, flops) = cost(op);
            OpRow {
                layer: op.layer,
                op: op.kind.name().to_string(),
                name: op.name.clone(),
                ty: op.ty.to_string(),
                inputs: op.inputs.clone(),
                output: op.output.clone(),
                placement,
                bytes,
                flops,
                est_us: estimate_s(bytes, flops) * 1e6,
            }
        })
        .collect();
    let n = rows.len().max(1) as f64;
    let fb = rows.iter().filter(|r| r.placement.is_fallback());
    let fallback_count_pct = 100.0 * fb.clone().count() as f64 / n;
    let total: f64 = rows.iter().map(|r| r.est_us).sum();
    // A fold from +0.0: an empty f64 sum is -0.0, which prints as "-0.0%".
    let fb_time: f64 = fb.fold(0.0, |acc, r| acc + r.est_us);
    let fallback_time_pct = if total > 0.0 {
        100.0 * fb_time / total
    } else {
        0.0
    };
    Audit {
        backend: name.to_string(),
        device: device.to_string(),
        n_tokens,
        n_kv: n_kv.max(n_tokens),
        ops: rows,
        fallback_count_pct,
        fallback_time_pct,
    }
}

fn shape(s: &[u64]) -> String {
    format!(
        "[{}]",
        s.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
    )
}

impl Audit {
    /// The larger of the two fallback shares (what `--strict` compares).
    pub fn fallback_pct(&self) -> f64 {
        self.fallback_count_pct.max(self.fallback_time_pct)
    }

    /// One line per op.
    pub fn table(&self) -> String {
        let mut out = format!(
            "{:<5} {:<10} {:<28} {:<6} {:<34} {:>9} {}\n",
            "layer", "op", "tensor", "type", "shapes (ggml order) -> result", "est µs", "runs"
        );
        for r in &self.ops {
            let shapes = format!(
                "{} -> {}",
                r.inputs
                    .iter()
                    .map(|s| shape(s))
                    .collect::<Vec<_>>()
                    .join(" x "),
                shape(&r.output)
            );
            let place = match &r.placement {
                Placement::Native => "native".to_string(),
                Placement::Fallback { to, why } => format!("FALLBACK to {to} ({why})"),
                Placement::Unsupported { why } => format!("UNSUPPORTED ({why})"),
            };
            out.push_str(&format!(
                "{:<5} {:<10} {:<28} {:<6} {:<34} {:>9.2} {}\n",
                r.layer.map_or("-".into(), |l| l.to_string()),
                r.op,
                r.name,
                r.ty,
                shapes,
                r.est_us,
                place
            ));
        }
        out
    }

    /// The ops that are not native grouped by reason (the text of `why` before its first `:`,
    /// so every `layer placement: layer N ...` counts as one): reason, ops, percent of ops,
    /// percent of estimated time. In order of first appearance.
    pub fn by_reason(&self) -> Vec<(String, usize, f64, f64)> {
        let n = self.ops.len().max(1) as f64;
        let total: f64 = self.ops.iter().map(|r| r.est_us).sum();
        let mut out: Vec<(String, usize, f64, f64)> = Vec::new();
        for r in &self.ops {
            let why = match &r.placement {
                Placement::Native => continue,
                Placement::Fallback { why, .. } | Placement::Unsupported { why } => why,
            };
            let key = why.split(':').next().unwrap_or(why).trim().to_string();
            let i = match out.iter().position(|e| e.0 == key) {
                Some(i) => i,
                None => {
                    out.push((key, 0, 0.0, 0.0));
                    out.len() - 1
                }
            };
            out[i].1 += 1;
            out[i].3 += r.est_us;
        }
        for e in &mut out {
            e.2 = 100.0 * e.1 as f64 / n;
            e.3 = if total > 0.0 {
                100.0 * e.3 / total
            } else {
                0.0
            };
        }
        out
    }

    /// The summary lines.
    pub fn summary(&self) -> String {
        let fb = self
            .ops
            .iter()
            .filter(|r| r.placement.is_fallback())
            .count();
        format!(
            "{}: {} ops for a step of {} token(s) over {} cached positions; {} not native: \
             {:.1}% by count, {:.1}% by estimated time (roofline on a nominal device: \
             max(bytes / {:.0} GB/s, flops / {:.0} GFLOP/s))",
            self.backend,
            self.ops.len(),
            self.n_tokens,
            self.n_kv,
            fb,
            self.fallback_count_pct,
            self.fallback_time_pct,
            NOMINAL_BYTES_PER_S / 1e9,
            NOMINAL_FLOPS_PER_S / 1e9
        )
    }
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// The op-by-backend support matrix: one row per (op, type) with how many such ops the pass has,
/// and per backend `native`, `fallback:TO` or `unsupported` (several when they differ between
/// ops of that row, joined with `|`), and the reasons.
pub fn support_matrix_csv(audits: &[Audit]) -> String {
    let mut keys: Vec<(String, String)> = Vec::new();
    if let Some(a) = audits.first() {
        for r in &a.ops {
            let k = (r.op.clone(), r.ty.clone());
            if !keys.contains(&k) {
                keys.push(k);
            }
        }
    }
    let mut out = String::from("op,type,count");
    for a in audits {
        out.push(',');
        out.push_str(&csv_field(&a.backend));
    }
    out.push_str(",why\n");
    for (op, ty) in keys {
        let count = audits.first().map_or(0, |a| {
            a.ops.iter().filter(|r| r.op == op && r.ty == ty).count()
        });
        out.push_str(&format!("{},{},{count}", csv_field(&op), csv_field(&ty)));
        let mut whys: Vec<String> = Vec::new();
        for a in audits {
            let mut cells: Vec<String> = Vec::new();
            for r in a.ops.iter().filter(|r| r.op == op && r.ty == ty) {
                let c = r.placement.short();
                if !cells.contains(&c) {
                    cells.push(c);
                }
                let why = match &r.placement {
                    Placement::Native => None,
                    Placement::Fallback { why, .. } | Placement::Unsupported { why } => {
                        Some(format!("{}: {why}", a.backend))
                    }
                };
                if let Some(w) = why {
                    if !whys.contains(&w) {
                        whys.push(w);
                    }
                }
            }
            out.push(',');
            out.push_str(&csv_field(&cells.join("|")));
        }
        out.push(',');
        out.push_str(&csv_field(&whys.join("; ")));
        out.push('\n');
    }
    out
}
