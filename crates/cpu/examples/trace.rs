//! Compares the engine's intermediate tensors with llama.cpp's, op by op.
//!
//! `scripts/dump_llama_tensors.py --model M --out DIR --tokens-from FIXTURE --layers 0` writes
//! llama.cpp's tensors (one raw f32 file per graph node, `attn_norm-0#0.f32`, ...) and the
//! tokens; this runs the same tokens in one batch, and for every traced tensor of ours prints how
//! far it is from llama.cpp's: max |diff|, that relative to max |ref|, and the share of
//! bit-identical elements. `--override NAME,...` replaces ours by llama.cpp's at those points, so
//! one op can be checked on exactly llama.cpp's input.
//!
//! Usage: trace MODEL DIR [--override attn_norm-0#0,...]
use std::collections::HashSet;
use std::path::PathBuf;

use cpu::{CpuBackend, CpuOptions};
use runtime::{Backend, SeqChunk, StepBatch, Want};

fn read_f32(p: &std::path::Path) -> Option<Vec<f32>> {
    let b = std::fs::read(p).ok()?;
    Some(
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    )
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (model, dir) = match (args.first(), args.get(1)) {
        (Some(m), Some(d)) => (m.clone(), PathBuf::from(d)),
        _ => {
            eprintln!("usage: trace MODEL DUMP_DIR [--override NAME,...]");
            std::process::exit(2);
        }
    };
    let overrides: HashSet<String> = args
        .iter()
        .position(|a| a == "--override")
        .and_then(|i| args.get(i + 1))
        .map(|s| s.split(',').map(str::to_string).collect())
        .unwrap_or_default();
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("meta.json")).expect("meta.json in the dump directory"),
    )
    .expect("meta.json is JSON");
    let tokens: Vec<u32> = meta["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|v| v.as_u64().expect("token id") as u32)
        .collect();
    let opts = CpuOptions {
        ctx_size: tokens.len(),
        max_batch_tokens: tokens.len(),
        ..CpuOptions::default()
    };
    let mut be = CpuBackend::load(&model, &opts).expect("load");
    let d2 = dir.clone();
    be.set_trace(Some(Box::new(move |name, layer, occ, data| {
        let key = format!("{name}-{layer}#{occ}");
        let Some(r) = read_f32(&d2.join(format!("{key}.f32"))) else {
            return;
        };
        if r.len() != data.len() {
            println!("{key:24} length {} vs llama.cpp {}", data.len(), r.len());
            return;
        }
        let (mut maxd, mut maxr, mut same) = (0f32, 0f32, 0usize);
        for (&a, &b) in data.iter().zip(&r) {
            maxd = maxd.max((a - b).abs());
            maxr = maxr.max(b.abs());
            same += usize::from(a.to_bits() == b.to_bits());
        }
        let o = overrides.contains(&key);
        println!(
            "{key:24} max|d| {maxd:.3e}  rel {:.3e}  identical {:.4}{}",
            maxd / maxr.max(1e-30),
            same as f64 / data.len() as f64,
            if o { "  (replaced by llama.cpp's)" } else { "" }
        );
        if o {
            data.copy_from_slice(&r);
        }
    })));
    be.step(&StepBatch {
        chunks: vec![SeqChunk {
            prompt_len: None,
            seq: 0,
            tokens,
            start_pos: 0,
            want: Want::Last,
        }],
    })
    .expect("step");
}
