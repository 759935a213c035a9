//! `crossover inspect FILE.gguf`: what a GGUF file holds and what running it would cost.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;

use anyhow::Context;
use gguf::{GgmlType, GgufFile, Metadata, Value};
use model::{FileType, ModelConfig, ModelWeights};
use serde_json::json;

/// Show a GGUF file's architecture, hyper-parameters, tokenizer, tensors and memory needs.
#[derive(clap::Args)]
pub struct InspectArgs {
    /// The GGUF file.
    pub file: PathBuf,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Leave out the per-tensor table.
    #[arg(long)]
    pub no_tensors: bool,
}

/// `writeln!` into a `String`, which cannot fail.
macro_rules! out {
    ($o:expr, $($t:tt)*) => {{
        let _ = writeln!($o, $($t)*);
    }};
}

/// Writes the report to stdout; a closed pipe (`| head`) is not an error.
fn emit(text: &str) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

/// Context length of the second KV-cache estimate (a typical `-c`).
const KV_CTX: usize = 4096;

pub fn run(args: InspectArgs) -> anyhow::Result<()> {
    let file =
        GgufFile::open(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let info = Info::gather(&file);
    if args.json {
        let mut text = serde_json::to_string_pretty(&info.json(&args, &file))?;
        text.push('\n');
        emit(&text)?;
    } else {
        emit(&info.print(&args, &file))?;
    }
    Ok(())
}

/// What inspect derives from the file.
struct Info {
    /// The model configuration, or why the file is not a model this project runs.
    config: Result<ModelConfig, String>,
    /// Weights check (only when the configuration parsed).
    weights: Option<Result<ModelWeights, String>>,
    /// Per type: (tensor count, elements, bytes).
    by_type: BTreeMap<GgmlType, (usize, u64, u64)>,
    tensor_bytes: u64,
}

impl Info {
    fn gather(file: &GgufFile) -> Info {
        let config = ModelConfig::from_gguf(file).map_err(|e| e.to_string());
        let weights = config
            .as_ref()
            .ok()
            .map(|c| ModelWeights::from_gguf(c, file).map_err(|e| e.to_string()));
        let mut by_type: BTreeMap<GgmlType, (usize, u64, u64)> = BTreeMap::new();
        let mut tensor_bytes = 0;
        for t in file.tensors() {
            let e = by_type.entry(t.ty).or_default();
            e.0 += 1;
            e.1 += t.n_elements();
            e.2 += t.n_bytes();
            tensor_bytes += t.n_bytes();
        }
        Info {
            config,
            weights,
            by_type,
            tensor_bytes,
        }
    }

    fn runnable(&self) -> Result<(), String> {
        match (&self.config, &self.weights) {
            (Err(e), _) => Err(e.clone()),
            (Ok(_), Some(Err(e))) => Err(e.clone()),
            _ => Ok(()),
        }
    }

    fn print(&self, args: &InspectArgs, file: &GgufFile) -> String {
        let mut o = String::new();
        let md = file.metadata();
        out!(o, "file:          {}", args.file.display());
        out!(
            o,
            "size:          {} (GGUF v{}, {} metadata keys, {} tensors, alignment {})",
            human(file.file_size()),
            file.version(),
            md.len(),
            file.tensors().len(),
            file.alignment()
        );
        let arch = md.opt_str("general.architecture").ok().flatten();
        out!(o, "architecture:  {}", arch.unwrap_or("(none)"));
        if let Ok(Some(n)) = md.opt_str("general.name") {
            out!(o, "name:          {n}");
        }
        if let Ok(Some(ft)) = md.opt_u32("general.file_type") {
            out!(o, "file type:     {}", file_type_name(ft));
        }
        match self.runnable() {
            Ok(()) => out!(o, "runnable:      yes"),
            Err(e) => out!(o, "runnable:      no: {e}"),
        }

        if let Ok(c) = &self.config {
            out!(o, "\nhyper-parameters");
            out!(o, "  blocks            {}", c.n_layer);
            out!(o, "  embedding width   {}", c.n_embd);
            out!(
                o,
                "  heads             {} query / {} key-value (GQA {}), head size {}",
                c.n_head,
                c.n_head_kv,
                c.n_gqa(),
                c.head_dim
            );
            out!(o, "  feed-forward      {}", c.n_ff);
            out!(o, "  vocabulary        {}", c.n_vocab);
            out!(o, "  training context  {}", c.n_ctx_train);
            out!(o, "  rms norm eps      {:e}", c.rms_norm_eps);
            out!(
                o,
                "  rope              theta {}, {} dims, {}{}{}",
                c.rope_freq_base,
                c.n_rot,
                match c.rope_style {
                    model::RopeStyle::Normal => "adjacent pairs (normal)",
                    model::RopeStyle::Neox => "half-split pairs (neox)",
                },
                match c.rope_scaling.kind {
                    model::RopeScalingKind::None => String::new(),
                    model::RopeScalingKind::Linear => format!(
                        ", linear scaling x{} (original context {})",
                        c.rope_scaling.factor, c.rope_scaling.original_ctx
                    ),
                },
                if c.rope_freqs {
                    ", llama3 frequency factors (rope_freqs.weight)"
                } else {
                    ""
                }
            );
            out!(
                o,
                "  output            {}",
                if c.tied_output {
                    "tied to token_embd"
                } else {
                    "output.weight"
                }
            );
            out!(
                o,
                "  q/k/v bias        {}",
                if c.qkv_bias { "yes" } else { "no" }
            );
        }

        let tok = Tokenizer::read(md);
        out!(o, "\ntokenizer");
        out!(
            o,
            "  model             {}",
            tok.model.as_deref().unwrap_or("(none)")
        );
        if let Some(p) = &tok.pre {
            out!(o, "  pre-tokenizer     {p}");
        }
        out!(o, "  tokens            {}", tok.n_tokens);
        if let Some(m) = tok.n_merges {
            out!(o, "  merges            {m}");
        }
        for (label, id, text) in &tok.specials {
            out!(o, "  {label:<17} {id} {text:?}");
        }
        for (label, v) in &tok.flags {
            out!(o, "  {label:<17} {v}");
        }
        match tok.chat_template_len {
            Some(n) => out!(o, "  chat template     present ({n} bytes)"),
            None => out!(o, "  chat template     absent"),
        }

        if !args.no_tensors {
            out!(o, "\ntensors");
            out!(
                o,
                "  {:<36} {:>6}  {:<22} {:>12}",
                "name",
                "type",
                "shape",
                "bytes"
            );
            for t in file.tensors() {
                out!(
                    o,
                    "  {:<36} {:>6}  {:<22} {:>12}",
                    t.name,
                    t.ty.name(),
                    format!("{:?}", t.dims),
                    t.n_bytes()
                );
            }
        }

        out!(o, "\ntotals by type");
        for (ty, (n, elems, bytes)) in &self.by_type {
            out!(
                o,
                "  {:>6}  {:>4} tensors  {:>14} elements  {:>10}  ({:.2} bits/weight)",
                ty.name(),
                n,
                elems,
                human(*bytes),
                *bytes as f64 * 8.0 / (*elems).max(1) as f64
            );
        }

        out!(o, "\nmemory estimate");
        out!(o, "  weights                  {}", human(self.tensor_bytes));
        if let Ok(c) = &self.config {
            for ctx in kv_contexts(c) {
                let kv = c.kv_cache_bytes(ctx, 2);
                out!(
                    o,
                    "  KV cache f16 @ {:<8}  {}  (total {})",
                    ctx,
                    human(kv),
                    human(kv + self.tensor_bytes)
                );
            }
        }
        o
    }

    fn json(&self, args: &InspectArgs, file: &GgufFile) -> serde_json::Value {
        let md = file.metadata();
        let metadata: serde_json::Map<String, serde_json::Value> = md
            .iter()
            .map(|(k, v)| (k.to_owned(), value_summary_json(v)))
            .collect();
        let config = match &self.config {
            Ok(c) => json!({
                "arch": c.arch.name(),
                "name": c.name,
                "n_layer": c.n_layer,
                "n_embd": c.n_embd,
                "n_head": c.n_head,
                "n_head_kv": c.n_head_kv,
                "head_dim": c.head_dim,
                "n_ff": c.n_ff,
                "n_vocab": c.n_vocab,
                "n_ctx_train": c.n_ctx_train,
                "rms_norm_eps": c.rms_norm_eps,
                "rope_freq_base": c.rope_freq_base,
                "n_rot": c.n_rot,
                "rope_style": format!("{:?}", c.rope_style).to_lowercase(),
                "rope_scaling": {
                    "type": format!("{:?}", c.rope_scaling.kind).to_lowercase(),
                    "factor": c.rope_scaling.factor,
                    "original_ctx": c.rope_scaling.original_ctx,
                },
                "rope_freqs": c.rope_freqs,
                "tied_output": c.tied_output,
                "qkv_bias": c.qkv_bias,
                "file_type": c.file_type,
            }),
            Err(_) => serde_json::Value::Null,
        };
        let tok = Tokenizer::read(md);
        let tensors: Vec<serde_json::Value> = if args.no_tensors {
            Vec::new()
        } else {
            file.tensors()
                .iter()
                .map(|t| {
                    json!({"name": t.name, "type": t.ty.name(), "shape": t.dims, "bytes": t.n_bytes()})
                })
                .collect()
        };
        let by_type: serde_json::Map<String, serde_json::Value> = self
            .by_type
            .iter()
            .map(|(ty, (n, e, b))| {
                (
                    ty.name().to_owned(),
                    json!({"tensors": n, "elements": e, "bytes": b}),
                )
            })
            .collect();
        let kv: Vec<serde_json::Value> = match &self.config {
            Ok(c) => kv_contexts(c)
                .into_iter()
                .map(|ctx| json!({"n_ctx": ctx, "kv_f16_bytes": c.kv_cache_bytes(ctx, 2)}))
                .collect(),
            Err(_) => Vec::new(),
        };
        json!({
            "file": args.file.display().to_string(),
            "file_bytes": file.file_size(),
            "gguf_version": file.version(),
            "alignment": file.alignment(),
            "architecture": md.opt_str("general.architecture").ok().flatten(),
            "file_type": md.opt_u32("general.file_type").ok().flatten(),
            "file_type_name": md.opt_u32("general.file_type").ok().flatten().map(file_type_name),
            "runnable": self.runnable().is_ok(),
            "error": self.runnable().err(),
            "config": config,
            "tokenizer": {
                "model": tok.model,
                "pre": tok.pre,
                "n_tokens": tok.n_tokens,
                "n_merges": tok.n_merges,
                "special": tok.specials.iter().map(|(l, id, t)| json!({"role": l.trim_end_matches(" id"), "id": id, "text": t})).collect::<Vec<_>>(),
                "chat_template": tok.chat_template_len.is_some(),
                "chat_template_bytes": tok.chat_template_len,
            },
            "metadata": metadata,
            "tensors": tensors,
            "by_type": by_type,
            "memory": {"weights_bytes": self.tensor_bytes, "kv_cache": kv},
        })
    }
}

/// The contexts the memory estimate is given for: the training context and [`KV_CTX`].
fn kv_contexts(c: &ModelConfig) -> Vec<usize> {
    let mut v = vec![c.n_ctx_train];
    if c.n_ctx_train != KV_CTX {
        v.push(KV_CTX);
    }
    v
}

/// The tokenizer facts inspect shows.
struct Tokenizer {
    model: Option<String>,
    pre: Option<String>,
    n_tokens: usize,
    n_merges: Option<usize>,
    /// (label, id, token text)
    specials: Vec<(String, u64, String)>,
    flags: Vec<(String, bool)>,
    chat_template_len: Option<usize>,
}

impl Tokenizer {
    fn read(md: &Metadata) -> Tokenizer {
        let s = |k: &str| md.opt_str(k).ok().flatten().map(str::to_owned);
        let tokens = md.opt_str_array("tokenizer.ggml.tokens").ok().flatten();
        let mut specials = Vec::new();
        for role in [
            "bos", "eos", "eot", "eom", "unknown", "padding", "sep", "mask",
        ] {
            let key = format!("tokenizer.ggml.{role}_token_id");
            if let Ok(Some(id)) = md.opt_u64(&key) {
                let text = tokens
                    .and_then(|t| t.get(id as usize))
                    .cloned()
                    .unwrap_or_else(|| "(out of range)".into());
                specials.push((format!("{role} id"), id, text));
            }
        }
        let mut flags = Vec::new();
        for f in ["add_bos_token", "add_eos_token", "add_space_prefix"] {
            if let Ok(Some(b)) = md.opt_bool(&format!("tokenizer.ggml.{f}")) {
                flags.push((f.replace('_', " "), b));
            }
        }
        Tokenizer {
            model: s("tokenizer.ggml.model"),
            pre: s("tokenizer.ggml.pre"),
            n_tokens: tokens.map_or(0, <[String]>::len),
            n_merges: md
                .get("tokenizer.ggml.merges")
                .and_then(Value::as_array)
                .map(|a| a.len()),
            specials,
            flags,
            chat_template_len: md
                .get("tokenizer.chat_template")
                .and_then(Value::as_str)
                .map(str::len),
        }
    }
}

fn file_type_name(id: u32) -> String {
    match FileType::from_id(id) {
        Some(f) => format!("{} ({id})", f.name()),
        None => format!("{id}"),
    }
}

/// A metadata value for JSON: scalars as they are, long arrays summarised by type and length.
fn value_summary_json(v: &Value) -> serde_json::Value {
    match v {
        Value::Array(a) if a.len() > 16 => {
            json!({"array": a.elem_type().name(), "len": a.len()})
        }
        Value::Array(a) => {
            serde_json::Value::Array(a.iter().map(|x| value_summary_json(&x)).collect())
        }
        Value::String(s) => json!(s),
        Value::Bool(b) => json!(b),
        Value::F32(f) => json!(f),
        Value::F64(f) => json!(f),
        other => match other.as_int() {
            Some(i) => json!(i64::try_from(i)
                .map(serde_json::Value::from)
                .unwrap_or_else(|_| json!(i.to_string()))),
            None => serde_json::Value::Null,
        },
    }
}

/// Bytes in binary units.
fn human(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}
