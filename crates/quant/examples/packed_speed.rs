//! Packed against GGUF-layout matmul speed, one thread, one shape: prefill (64 tokens, the
//! matrix stays in cache) and decode (1 token, a rotation of copies streamed from memory). For
//! many tokens the packed legacy types run twice, with the `vpdpbusd` kernel (`packed`) and
//! with AMX (`amx`, where the CPU has it), alternating, best of `ROUNDS` rounds each. Every
//! variant runs in each summation order of `ORDER` (`ggml`, `block`, or `both`, the default;
//! alternating in the same process: an A/B on the same data).
//!
//! Usage: `cargo run --release -p quant --example packed_speed -- [TYPE] [ROWS] [COLS] [THREADS] [TOKENS] [ROUNDS] [ORDER]`
//! (defaults: q4_k 8192 2048 1 64 3 both). `ROT_MB=N` streams decode from copies filling N MiB
//! (default 512: from memory); `ROT_MB=1` keeps one copy, so a small matrix stays in cache and
//! the kernels' own speed shows.
use std::time::Instant;

/// CPU seconds this process has used: on a shared machine, with one thread, a steadier
/// measure of a kernel than wall time (time the thread waited for a core is not counted).
fn cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

use gguf::GgmlType;
use quant::dot::{self, ActBuf, PackedMat, Pool};

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let ty = match a.first().map(|s| s.as_str()).unwrap_or("q4_k") {
        "q4_0" => GgmlType::Q4_0,
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
    let rot_mb = std::env::var("ROT_MB")
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        .unwrap_or(512);
    let copies = (rot_mb << 20) / w.len() + 1;
    let ws: Vec<Vec<u8>> = (0..copies).map(|_| w.clone()).collect();
    let ps: Vec<Option<PackedMat>> = ws
        .iter()
        .map(|w| PackedMat::pack(ty, w, rows, cols).unwrap())
        .collect();
    let ntok: usize = a.get(4).and_then(|s| s.parse().ok()).unwrap_or(64);
    let rounds: usize = a.get(5).and_then(|s| s.parse().ok()).unwrap_or(3).max(1);
    let orders: Vec<dot::SumOrder> = match a.get(6).map(|s| s.as_str()) {
        Some("ggml") => vec![dot::SumOrder::Ggml],
        Some("block") => vec![dot::SumOrder::Block],
        _ => dot::SumOrder::ALL.to_vec(),
    };
    println!("amx available: {}", dot::amx_available());
    for n in [ntok, 1] {
        let xs: Vec<f32> = (0..n).flat_map(|_| x.iter().copied()).collect();
        let mut acts = ActBuf::new();
        dot::quantize_acts(ty, &xs, n, cols, &mut acts).unwrap();
        let mut out = vec![0f32; rows * n];
        let reps = if n == 1 { 200 } else { 20 };
        // 0: GGUF layout; 1: packed, vpdpbusd; 2: packed, AMX allowed.
        let kinds: Vec<usize> = (0..3)
            .filter(|&v| v == 0 || ps[0].is_some())
            .filter(|&v| v < 2 || (n > 1 && dot::amx_available()))
            .collect();
        let variants: Vec<(usize, dot::SumOrder)> = kinds
            .iter()
            .flat_map(|&k| orders.iter().map(move |&o| (k, o)))
            .collect();
        let mut best = vec![f64::INFINITY; variants.len()];
        let mut best_cpu = vec![f64::INFINITY; variants.len()];
        for _ in 0..rounds {
            for (vi, &(v, order)) in variants.iter().enumerate() {
                let t = Instant::now();
                let c0 = cpu_seconds();
                for i in 0..reps {
                    let c = if n == 1 { i % copies } else { 0 };
                    match (&ps[c], v) {
                        (Some(p), 1 | 2) => {
                            dot::matmul_packed_ordered(p, &acts, &mut out, &pool, v == 2, order)
                                .unwrap()
                        }
                        _ => dot::matmul_ordered(
                            ty,
                            &ws[c],
                            rows,
                            cols,
                            &acts,
                            &mut out,
                            &pool,
                            dot::best_isa(),
                            order,
                        )
                        .unwrap(),
                    }
                }
                best[vi] = best[vi].min(t.elapsed().as_secs_f64() / reps as f64);
                best_cpu[vi] = best_cpu[vi].min((cpu_seconds() - c0) / reps as f64);
            }
        }
        for (vi, &(v, order)) in variants.iter().enumerate() {
            let s = best[vi];
            let macs = (rows * cols * n) as f64;
            println!(
                "{ty} {rows}x{cols} tokens {n} {} {:5}: {:.3} ms, {:.1} GMAC/s, {:.1} GB/s; CPU time {:.3} ms, {:.1} GMAC/s per CPU-second",
                ["gguf  ", "packed", "amx   "][v],
                order.name(),
                s * 1e3,
                macs / s / 1e9,
                w.len() as f64 / s / 1e9,
                best_cpu[vi] * 1e3,
                macs / best_cpu[vi] / 1e9
            );
        }
    }
}
