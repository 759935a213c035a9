//! Matrix-product micro-benchmark: weight bytes streamed per second (decode, 1 token) and
//! multiply-adds per second (prefill, many tokens), at 1 and N threads, per weight type and
//! instruction set.
//!
//! `cargo bench -p quant --bench dot_matmul -- [--threads N] [--types q4_0,q6_k] [--isa avx2]
//!  [--shapes 576x1536,2048x8192] [--prefill 64] [--quick]`
//!
//! "hot": the same matrix every call (it stays in cache: kernel speed). "cold": a rotation of
//! copies totalling at least 512 MiB, so every call streams its weights from memory, as a whole
//! model does during generation.

use std::time::{Duration, Instant};

use gguf::GgmlType;
use quant::dot::{self, ActBuf, Isa, Pool};

struct Rng(u64);
impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn f32(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// Random weight bytes with sane f16 scales (speed does not depend on the values, and
/// quantizing 16M floats per matrix would dominate the run).
fn weights(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let n = dot::row_bytes(ty, cols).unwrap() * rows;
    let mut b: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
    let fields: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q2K => &[80, 82],
        GgmlType::Q3K => &[108],
        GgmlType::Q6K => &[208],
        _ => &[],
    };
    let bs = ty.type_size();
    for blk in b.chunks_exact_mut(bs) {
        for &o in fields {
            let v = half::f16::from_f32(0.001 + 0.01 * rng.f32().abs()).to_bits();
            blk[o..o + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    if matches!(ty, GgmlType::F16 | GgmlType::BF16 | GgmlType::F32) {
        for (i, v) in b.iter_mut().enumerate() {
            // Keep exponents small so the values are finite.
            if i % 2 == 1 {
                *v &= 0x3b;
            }
        }
    }
    b
}

#[repr(C)]
struct Timespec {
    tv_sec: i64,
    tv_nsec: i64,
}

extern "C" {
    fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
}

/// CPU time of the calling thread, in seconds: on a shared machine this leaves out the time
/// other processes hold the core, which wall time would charge to the kernel.
fn thread_cpu_seconds() -> f64 {
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    let mut ts = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec (two i64 on x86-64 Linux).
    let rc = unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return f64::NAN;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Seconds per call of `f`: the fastest of the batches filling about `budget` (on a shared
/// machine interference only ever adds time, so the minimum is the least disturbed estimate).
/// With `cpu` the clock is this thread's CPU time (for single-threaded runs), else wall time.
fn time_it(budget: Duration, cpu: bool, mut f: impl FnMut()) -> f64 {
    let now = || {
        if cpu {
            thread_cpu_seconds()
        } else {
            Instant::now()
                .duration_since(*START.get_or_init(Instant::now))
                .as_secs_f64()
        }
    };
    f();
    let t0 = now();
    f();
    let one = (now() - t0).max(1e-7);
    // Wall-clock runs time single calls: on a busy machine a batch almost always contains a
    // call that waited for a descheduled worker.
    let per_batch = if cpu {
        ((0.005 / one) as usize).clamp(1, 10_000)
    } else {
        1
    };
    let mut samples = Vec::new();
    let start = Instant::now();
    while start.elapsed() < budget || samples.len() < 5 {
        let t = now();
        for _ in 0..per_batch {
            f();
        }
        samples.push((now() - t) / per_batch as f64);
    }
    samples.iter().copied().fold(f64::INFINITY, f64::min)
}

static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let get = |k: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let quick = args.iter().any(|a| a == "--quick");
    let budget = Duration::from_millis(if quick { 150 } else { 500 });
    let n_max = get("--threads")
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        });
    let types: Vec<GgmlType> = get("--types")
        .map(|s| s.split(',').filter_map(GgmlType::from_name).collect())
        .unwrap_or_else(|| {
            vec![
                GgmlType::Q4_0,
                GgmlType::Q4_1,
                GgmlType::Q8_0,
                GgmlType::Q4K,
                GgmlType::Q6K,
            ]
        });
    let isas: Vec<Isa> = get("--isa")
        .map(|s| s.split(',').filter_map(Isa::from_name).collect())
        .unwrap_or_else(|| vec![dot::best_isa()]);
    let shapes: Vec<(usize, usize)> = get("--shapes")
        .map(|s| {
            s.split(',')
                .filter_map(|p| {
                    let (r, c) = p.split_once('x')?;
                    Some((r.parse().ok()?, c.parse().ok()?))
                })
                .collect()
        })
        .unwrap_or_else(|| vec![(576, 1536), (2048, 8192)]);
    let prefill: usize = get("--prefill").and_then(|s| s.parse().ok()).unwrap_or(64);
    let mut threads = vec![1];
    if n_max > 1 {
        threads.push(n_max);
    }
    println!(
        "matmul benchmark: rows x cols, decode = 1 token (GB/s of weights), prefill = {prefill} tokens (GMAC/s)"
    );
    println!(
        "1-thread times: thread CPU time, best batch; N-thread times: wall time, best single call"
    );
    for &nt in &threads {
        if nt > 1 {
            let pool = Pool::new(nt).unwrap();
            let t = time_it(budget, false, || pool.run(|_| {}));
            println!("pool of {nt}: empty run() round trip {:.2} us", t * 1e6);
        }
    }
    let mut rng = Rng(42);
    for &isa in &isas {
        if !isa.available() {
            println!("{}: not available, skipped", isa.name());
            continue;
        }
        for &ty in &types {
            for &(rows, cols) in &shapes {
                let w = weights(&mut rng, ty, rows, cols);
                let bytes = w.len();
                let copies = ((512usize << 20) / bytes).clamp(2, 4096);
                let cold: Vec<Vec<u8>> = if quick {
                    Vec::new()
                } else {
                    (0..copies).map(|_| w.clone()).collect()
                };
                let x1: Vec<f32> = (0..cols).map(|_| rng.f32()).collect();
                let xp: Vec<f32> = (0..cols * prefill).map(|_| rng.f32()).collect();
                let mut a1 = ActBuf::new();
                let mut ap = ActBuf::new();
                dot::quantize_acts_with_isa(ty, &x1, 1, cols, &mut a1, isa).unwrap();
                dot::quantize_acts_with_isa(ty, &xp, prefill, cols, &mut ap, isa).unwrap();
                let mut o1 = vec![0f32; rows];
                let mut op = vec![0f32; rows * prefill];
                for &nt in &threads {
                    let pool = Pool::new(nt).unwrap();
                    let cpu = nt == 1;
                    let hot = time_it(budget, cpu, || {
                        dot::matmul_with_isa(ty, &w, rows, cols, &a1, &mut o1, &pool, isa).unwrap()
                    });
                    let mut k = 0;
                    let cold_t = if cold.is_empty() {
                        f64::NAN
                    } else {
                        time_it(budget, cpu, || {
                            k = (k + 1) % cold.len();
                            dot::matmul_with_isa(ty, &cold[k], rows, cols, &a1, &mut o1, &pool, isa)
                                .unwrap()
                        })
                    };
                    let pf = time_it(budget, cpu, || {
                        dot::matmul_with_isa(ty, &w, rows, cols, &ap, &mut op, &pool, isa).unwrap()
                    });
                    let qt = time_it(budget / 4, true, || {
                        dot::quantize_acts_with_isa(ty, &x1, 1, cols, &mut a1, isa).unwrap()
                    });
                    println!(
                        "{:<6} {:<5} {:>4}x{:<5} {:>2} thr | decode hot {:>7.1} us {:>6.1} GB/s | cold {:>7.1} us {:>6.1} GB/s | prefill {:>7.2} ms {:>6.1} GMAC/s | quantize row {:>5.2} us",
                        isa.name(),
                        ty.name(),
                        rows,
                        cols,
                        nt,
                        hot * 1e6,
                        bytes as f64 / hot / 1e9,
                        cold_t * 1e6,
                        bytes as f64 / cold_t / 1e9,
                        pf * 1e3,
                        (rows * cols * prefill) as f64 / pf / 1e9,
                        qt * 1e6,
                    );
                }
            }
        }
    }
}
