//! Shared set-up of the end-to-end tests: the real CPU backend on the real default model.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use cpu::{CpuBackend, CpuOptions};
use gguf::GgufFile;
use runtime::fault::FaultSwitch;
use runtime::{ActorConfig, Backend, BackendHandle, RestartPolicy};
use tokenizer::Tokenizer;

/// The default model, fetched by scripts/fetch_model.sh.
pub fn model_path() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../.cache/models/smollm2-135m-instruct-q4_1.gguf");
    assert!(
        p.exists(),
        "model {} is missing: run scripts/fetch_model.sh (CI does this first)",
        p.display()
    );
    p
}

pub fn open() -> (Arc<GgufFile>, Arc<Tokenizer>) {
    let file = Arc::new(GgufFile::open(model_path()).expect("open model"));
    let tok = Arc::new(Tokenizer::from_gguf(&file).expect("tokenizer"));
    (file, tok)
}

/// Options of one test actor.
pub struct Cpu {
    pub name: &'static str,
    pub threads: usize,
    pub ctx: usize,
    pub max_seqs: usize,
    pub max_batch_tokens: usize,
    /// Faults planned inside the real CPU backend (every rebuilt one shares the plan).
    pub fault: Option<FaultSwitch>,
    pub admission_timeout: Duration,
    pub prefill_chunk: usize,
    pub restart: RestartPolicy,
}

impl Default for Cpu {
    fn default() -> Self {
        Cpu {
            name: "cpu",
            threads: 1,
            ctx: 512,
            max_seqs: 4,
            max_batch_tokens: 256,
            fault: None,
            admission_timeout: Duration::from_secs(30),
            prefill_chunk: 64,
            restart: RestartPolicy::default(),
        }
    }
}

/// Start a CPU actor; the backend is built on the actor's thread.
pub fn cpu_actor(file: &Arc<GgufFile>, tok: &Arc<Tokenizer>, c: Cpu) -> BackendHandle {
    let file = file.clone();
    let opts = CpuOptions {
        threads: Some(c.threads),
        ctx_size: c.ctx,
        max_seqs: c.max_seqs,
        block_tokens: 16,
        max_batch_tokens: c.max_batch_tokens,
    };
    let fault = c.fault.clone();
    // Restartable: the supervisor rebuilds the backend from this after a crash.
    let factory: runtime::RestartFactory = std::sync::Arc::new(move || {
        let be = match &fault {
            Some(sw) => {
                CpuBackend::from_file_with_faults(file.clone(), "smollm2", &opts, sw.clone())
            }
            None => CpuBackend::from_file(file.clone(), "smollm2", &opts),
        }
        .map_err(|e| runtime::BackendError::Unsupported {
            backend: "cpu".into(),
            why: e.to_string(),
        })?;
        Ok(Box::new(be) as Box<dyn Backend>)
    });
    let cfg = ActorConfig {
        name: Some(c.name.to_string()),
        admission_timeout: c.admission_timeout,
        prefill_chunk: c.prefill_chunk,
        restart: c.restart,
        ..ActorConfig::default()
    };
    runtime::spawn(factory, tok.clone(), cfg).expect("actor starts")
}

/// Chat-formatted prompt ids.
pub fn chat_prompt(tok: &Tokenizer, user: &str) -> Vec<u32> {
    let msgs = [tokenizer::ChatMessage::new("user", user)];
    let text = tok
        .apply_chat_template(&msgs, Some("You are a helpful assistant."), true)
        .expect("model has a chat template")
        .expect("template renders");
    tok.encode(&text, true, true).expect("encode")
}

/// Greedy generation of `n` tokens straight on a backend, one sequence, no actor: the reference
/// the actor's output must equal.
pub fn direct_greedy(
    file: &Arc<GgufFile>,
    prompt: &[u32],
    n: usize,
    eog: &dyn Fn(u32) -> bool,
) -> Vec<u32> {
    use runtime::{SeqChunk, StepBatch, Want};
    let opts = CpuOptions {
        threads: Some(1),
        ctx_size: 512,
        max_seqs: 1,
        block_tokens: 16,
        max_batch_tokens: 512,
    };
    let mut be = CpuBackend::from_file(file.clone(), "smollm2", &opts).expect("backend");
    let mut out = Vec::new();
    let mut feed = prompt.to_vec();
    let mut pos = 0;
    for _ in 0..n {
        let batch = StepBatch {
            chunks: vec![SeqChunk {
                seq: 1,
                tokens: feed.clone(),
                start_pos: pos,
                want: Want::Last,
            }],
        };
        let o = be.step(&batch).expect("step");
        pos += feed.len();
        let row = o.row(0).expect("row");
        let mut best = 0;
        for (i, &l) in row.iter().enumerate() {
            if l > row[best] {
                best = i;
            }
        }
        let t = best as u32;
        out.push(t);
        if eog(t) {
            break;
        }
        feed = vec![t];
    }
    out
}
