//! Packed against GGUF-layout matmul speed, one thread, one shape: prefill (64 tokens, the
//! matrix stays in cache) and decode (1 token, a rotation of copies streamed from memory).
//!
//! Usage: `cargo run --release -p quant --example packed_speed -- [TYPE] [ROWS] [COLS] [THREADS] [TOKENS]`
//! (defaults: q4_k 8192 2048 1 64).
use std::time::Instant;

use gguf::GgmlType;
use quant::dot::{self, ActBuf, PackedMat, Pool};

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let ty = match a.first().map(|s| s.as_str()).unwrap_or("q4_k") {
        "q4_1" => GgmlType::Q4_1,
        "q6_k" => GgmlType::Q6K,
        "q8_0" => GgmlType::Q8_0,
        _ => GgmlType::Q4K,
    };
    let rows: usize = a.get(1).and_then(|s| s.parse().ok()).unwrap_or(8192);
    let cols: usize = a.get(2).and_then(|s| s.parse().ok()).unwrap_or(2048);
    let threads: usize = a.get(3).and_then(|s| s.parse().ok()).unwrap_or(1);
    let pool = Pool::new(threads).unwrap();
    let mut seed = 0x1234_5678_u64;
    let mut rnd = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let x: Vec<f32> = (0..cols)
        .map(|_| (rnd() % 2000) as f32 / 1000.0 - 1.0)
        .collect();
    let w = quant::quantize_to_vec(ty, &x).unwrap();
    let w: Vec<u8> = (0..rows).flat_map(|_| w.iter().copied()).collect();
    let copies = (512 << 20) / w.len() + 1;
    let ws: Vec<Vec<u8>> = (0..copies).map(|_| w.clone()).collect();
    let ps: Vec<Option<PackedMat>> = ws
        .iter()
        .map(|w| PackedMat::pack(ty, w, rows, cols).unwrap())
        .collect();
    let ntok: usize = a.get(4).and_then(|s| s.parse().ok()).unwrap_or(64);
    for n in [ntok, 1] {
        let xs: Vec<f32> = (0..n).flat_map(|_| x.iter().copied()).collect();
        let mut acts = ActBuf::new();
        dot::quantize_acts(ty, &xs, n, cols, &mut acts).unwrap();
        let mut out = vec![0f32; rows * n];
        let reps = if n == 1 { 200 } else { 20 };
        for packed in [false, true] {
            if packed && ps[0].is_none() {
                continue;
            }
            let t = Instant::now();
            for i in 0..reps {
                let c = if n == 1 { i % copies } else { 0 };
                match (&ps[c], packed) {
                    (Some(p), true) => dot::matmul_packed(p, &acts, &mut out, &pool).unwrap(),
                    _ => dot::matmul(ty, &ws[c], rows, cols, &acts, &mut out, &pool).unwrap(),
                }
            }
            let s = t.elapsed().as_secs_f64() / reps as f64;
            println!(
                "{ty} {rows}x{cols} tokens {n} {}: {:.3} ms, {:.1} GMAC/s, {:.1} GB/s",
                if packed { "packed" } else { "gguf  " },
                s * 1e3,
                (rows * cols * n) as f64 / s / 1e9,
                w.len() as f64 / s / 1e9
            );
        }
    }
}
