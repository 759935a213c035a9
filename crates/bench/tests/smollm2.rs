//! bench, audit and the host fallback on the real CPU backend with SmolLM2-135M (Q4_1 layers,
//! Q8_0 embedding/head), through real actors and the coordinator.

use std::path::PathBuf;
use std::sync::Arc;

use bench::audit::{self, Placement};
use bench::measure::{Method, Runner};
use bench::power::PowerSource;
use bench::workload::{PromptMaker, Workload};
use bench::BenchError;
use cpu::{CpuBackend, CpuOptions};
use gguf::{GgmlType, GgufFile};
use model::{ModelConfig, ModelWeights};
use runtime::{
    ActorConfig, Backend, BackendHandle, Coordinator, GenerateRequest, RoutingPolicy,
    SamplingParams, SeqChunk, StepBatch, TokenEvent, Want,
};
use tokenizer::Tokenizer;

fn model_path() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../.cache/models/smollm2-135m-instruct-q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch_model.sh first",
        p.display()
    );
    p
}

fn open() -> (Arc<GgufFile>, Arc<Tokenizer>) {
    let f = Arc::new(GgufFile::open(model_path()).unwrap());
    let t = Arc::new(Tokenizer::from_gguf(&f).unwrap());
    (f, t)
}

fn opts(ctx: usize, seqs: usize) -> CpuOptions {
    CpuOptions {
        threads: Some(2),
        ctx_size: ctx,
        max_seqs: seqs,
        max_batch_tokens: 256,
        // The host fallback executor runs ggml's summation order (`runtime::fallback`): the
        // doubles equal a backend in that order bit for bit.
        prompt_order: cpu::SumOrder::Ggml,
        decode_order: cpu::SumOrder::Ggml,
        ..CpuOptions::default()
    }
}

fn actor(
    file: &Arc<GgufFile>,
    tok: &Arc<Tokenizer>,
    o: CpuOptions,
    lacking: Option<GgmlType>,
) -> BackendHandle {
    let file = file.clone();
    let factory: runtime::BackendFactory = Box::new(move || {
        let be = match lacking {
            None => CpuBackend::from_file(file, "smollm2", &o),
            Some(ty) => CpuBackend::lacking_kernel(file, "smollm2", &o, ty),
        };
        be.map(|b| Box::new(b) as Box<dyn Backend>).map_err(|e| {
            runtime::BackendError::Unsupported {
                backend: "cpu".into(),
                why: e.to_string(),
            }
        })
    });
    runtime::spawn(factory, tok.clone(), ActorConfig::default()).unwrap()
}

#[test]
fn audit_of_the_cpu_backend_has_no_fallback() {
    let (file, _) = open();
    let cfg = ModelConfig::from_gguf(&file).unwrap();
    let w = ModelWeights::from_gguf(&cfg, &file).unwrap();
    let be = CpuBackend::from_file(file.clone(), "smollm2", &opts(64, 1)).unwrap();
    let a = audit::audit(&cfg, &w, &be, 1, 512, GgmlType::F16);
    assert_eq!(
        a.ops.len(),
        model::ops(&cfg, &w, 1, 512, GgmlType::F16).len()
    );
    assert!(a.ops.iter().all(|r| r.placement == Placement::Native));
    assert_eq!((a.fallback_count_pct, a.fallback_time_pct), (0.0, 0.0));
    // 30 layers x 7 matmuls + the head.
    assert_eq!(
        a.ops.iter().filter(|r| r.op == "mat_mul").count(),
        30 * 7 + 1
    );
    let sum = a.summary();
    assert!(
        sum.contains("0 not native: 0.0% by count, 0.0% by estimated time"),
        "{sum}"
    );
}

#[test]
fn audit_of_a_backend_lacking_q8_0_shows_the_head_falling_back() {
    let (file, _) = open();
    let cfg = ModelConfig::from_gguf(&file).unwrap();
    let w = ModelWeights::from_gguf(&cfg, &file).unwrap();
    let be =
        CpuBackend::lacking_kernel(file.clone(), "smollm2", &opts(64, 1), GgmlType::Q8_0).unwrap();
    assert_eq!(be.info().name, "cpu-lacking-q8_0");
    let a = audit::audit(&cfg, &w, &be, 1, 512, GgmlType::F16);
    let fb: Vec<_> = a.ops.iter().filter(|r| r.placement.is_fallback()).collect();
    // SmolLM2 ties its head to the Q8_0 embedding: that matmul (the largest of the pass) falls
    // back; the embedding lookup (a row dequantization) does not.
    assert_eq!(fb.len(), 1, "{fb:?}");
    assert_eq!(
        (fb[0].op.as_str(), fb[0].name.as_str(), fb[0].ty.as_str()),
        ("mat_mul", "token_embd.weight", "q8_0")
    );
    assert!(
        matches!(&fb[0].placement, Placement::Fallback { to, why } if to == "host" && why.contains("q8_0"))
    );
    let n = a.ops.len() as f64;
    assert!((a.fallback_count_pct - 100.0 / n).abs() < 1e-9);
    // By time: the head's bytes over the step's (a decode step is memory-bound), recomputed
    // here from the tensor sizes.
    let head_bytes = GgmlType::Q8_0.bytes_for(576 * 49152).unwrap() as f64;
    assert!(
        a.fallback_time_pct > 15.0 && a.fallback_time_pct < 60.0,
        "{}",
        a.fallback_time_pct
    );
    let total_us: f64 = a.ops.iter().map(|r| r.est_us).sum();
    assert!(
        (fb[0].est_us * 1e-6 - head_bytes / audit::NOMINAL_BYTES_PER_S).abs() / fb[0].est_us < 0.01
    );
    assert!((a.fallback_time_pct - 100.0 * fb[0].est_us / total_us).abs() < 1e-9);
    let csv = audit::support_matrix_csv(&[a]);
    assert!(
        csv.lines()
            .any(|l| l.starts_with("mat_mul,q8_0,1,fallback:host,")),
        "{csv}"
    );
    assert!(
        csv.lines()
            .any(|l| l.starts_with("mat_mul,q4_1,210,native,")),
        "{csv}"
    );
}

fn greedy_tokens(h: &BackendHandle, prompt: &[u32], n: usize) -> Vec<u32> {
    let coord = Coordinator::new(vec![h.clone()], RoutingPolicy::default()).unwrap();
    let params = SamplingParams {
        max_tokens: Some(n),
        ignore_eos: true,
        ..SamplingParams::greedy()
    };
    let s = coord
        .submit(GenerateRequest::new(prompt.to_vec(), params))
        .unwrap();
    let mut out = Vec::new();
    for ev in s.into_blocking() {
        match ev {
            TokenEvent::Token { id, .. } => out.push(id),
            TokenEvent::Done(_) => break,
            TokenEvent::Error(e) => panic!("{e}"),
        }
    }
    out
}

/// Logits of every position of `tokens`, run directly on a backend (teacher forcing).
fn all_logits(be: &mut dyn Backend, tokens: &[u32]) -> Vec<Vec<f32>> {
    let batch = StepBatch {
        chunks: vec![SeqChunk {
            prompt_len: None,
            seq: 1,
            tokens: tokens.to_vec(),
            start_pos: 0,
            want: Want::All,
        }],
    };
    let out = be.step(&batch).unwrap();
    be.release(1);
    (0..out.n_rows())
        .map(|i| out.row(i).unwrap().to_vec())
        .collect()
}

/// The fallback is real and exact: with the op on the host the model still runs, and since the
/// host executor runs the CPU's own kernels (same activation quantization, same float order),
/// every logit equals the normal backend's bit for bit and greedy decoding through actors and
/// the coordinator gives the normal backend's tokens, with the head alone on the host (Q8_0)
/// and with all 210 layer matmuls there (Q4_1).
#[test]
fn test_doubles_generate_the_same_greedy_tokens() {
    let (file, tok) = open();
    let normal = actor(&file, &tok, opts(128, 1), None);
    let prompt = tok.encode("def fibonacci(n):", true, false).unwrap();
    let want = greedy_tokens(&normal, &prompt, 20);
    assert_eq!(want.len(), 20);
    let mut seq = prompt.clone();
    seq.extend(&want);
    let mut be = CpuBackend::from_file(file.clone(), "smollm2", &opts(128, 1)).unwrap();
    let ref_logits = all_logits(&mut be, &seq);
    // Q8_0: only the head falls back. Q4_1: every layer's matmuls do.
    for ty in [GgmlType::Q8_0, GgmlType::Q4_1] {
        let double = actor(&file, &tok, opts(128, 1), Some(ty));
        assert_eq!(
            double.name(),
            format!("cpu-lacking-{}", ty.to_string().to_lowercase())
        );
        let got = greedy_tokens(&double, &prompt, 20);
        assert_eq!(
            got,
            want,
            "lacking {ty}: {:?} vs {:?}",
            tok.decode(&got).unwrap_or_default(),
            tok.decode(&want).unwrap_or_default()
        );
        // Teacher-forced, every position of prompt and generation.
        let mut dbe =
            CpuBackend::lacking_kernel(file.clone(), "smollm2", &opts(128, 1), ty).unwrap();
        let logits = all_logits(&mut dbe, &seq);
        assert_eq!(logits.len(), ref_logits.len());
        for (i, (a, b)) in ref_logits.iter().zip(&logits).enumerate() {
            let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "lacking {ty}: logits of position {i} differ");
        }
        eprintln!("lacking {ty}: 20/20 greedy tokens and every logit equal");
    }
}

#[test]
fn bench_measures_through_the_actor_and_never_invents_power() {
    let (file, tok) = open();
    let h = actor(&file, &tok, opts(128, 2), None);
    let prompts = PromptMaker::new(&tok).unwrap();
    let mut r = Runner::new(h, PowerSource::for_backend("cpu")).unwrap();
    let w: Workload = "prompt=40,gen=6,concurrency=2".parse().unwrap();
    let method = Method {
        runs: 3,
        warmup: 1,
        seed: 42,
    };
    let mut calls = 0;
    let m = r
        .measure(&w, &prompts, &method, &mut |_| calls += 1)
        .unwrap();
    assert_eq!(calls, 4);
    assert_eq!((m.warmup.len(), m.runs.len()), (1, 3));
    for s in m.warmup.iter().chain(&m.runs) {
        assert_eq!(s.ttft_ms.len(), 2);
        assert_eq!(s.generated, 12);
        assert!(s.ttft_ms.iter().all(|&t| t > 0.0 && t < s.wall_s * 1e3));
        assert!(s.tok_s.is_some_and(|t| t > 0.0));
    }
    let ttft = m.ttft_ms.as_ref().unwrap();
    assert_eq!(ttft.n, 6);
    assert!(m.tok_s.as_ref().unwrap().n == 3);
    let rapl = ["intel-rapl:0", "amd-rapl:0"].iter().any(|z| {
        std::path::Path::new(bench::power::RAPL_ROOT)
            .join(z)
            .exists()
    });
    if !rapl {
        assert!(m.power_w.is_none() && m.j_per_token.is_none());
        assert_eq!(m.power_note.as_deref(), Some("n/a (no RAPL here)"));
    }
    // A prompt that cannot fit is a typed error before anything runs.
    let big: Workload = "prompt=120,gen=16".parse().unwrap();
    let e = r.measure(&big, &prompts, &method, &mut |_| {}).unwrap_err();
    assert!(
        matches!(
            e,
            BenchError::PromptTooLong {
                prompt: 120,
                gen: 16,
                ctx: 128,
                ..
            }
        ),
        "{e}"
    );
}
