//! Read bandwidth of this machine's memory, the bound of a memory-bound decode step: 1 GiB
//! (more than the last-level cache), streamed by 1..=THREADS threads, each reading its own
//! contiguous share once per pass (as a matmul's chunks do), best of several passes.
//!
//! Usage: `cargo run --release -p quant --example membw -- [THREADS] [MIB]` (defaults: every
//! core, 1024).
use std::time::Instant;

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let max_t: usize = a
        .first()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let mib: usize = a.get(1).and_then(|s| s.parse().ok()).unwrap_or(1024);
    let n = (mib << 20) / 8;
    // Huge pages, as the engine asks for its weights (`MADV_HUGEPAGE` before first touch),
    // then every page touched with non-zero data (zero pages could be shared).
    let mut buf: Vec<u64> = Vec::with_capacity(n);
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let (s, e) = (buf.as_ptr() as usize, buf.as_ptr() as usize + n * 8);
        let (s, e) = (s.div_ceil(HUGE) * HUGE, e / HUGE * HUGE);
        if e > s {
            // SAFETY: [s, e) lies inside `buf`'s allocation; the advice changes only how the
            // kernel backs the pages.
            unsafe { libc::madvise(s as *mut libc::c_void, e - s, libc::MADV_HUGEPAGE) };
        }
    }
    buf.extend((0..n as u64).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1));
    for t in 1..=max_t {
        let mut best = f64::INFINITY;
        let mut sink = 0u64;
        for _ in 0..5 {
            let start = Instant::now();
            let per = n.div_ceil(t);
            sink ^= std::thread::scope(|s| {
                let hs: Vec<_> = buf
                    .chunks(per)
                    .map(|c| s.spawn(move || xor_all(c)))
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().unwrap_or(0))
                    .fold(0, |a, b| a ^ b)
            });
            best = best.min(start.elapsed().as_secs_f64());
        }
        println!(
            "{t} thread(s): {:.1} GB/s over {mib} MiB (best of 5; checksum {:x})",
            (n * 8) as f64 / best / 1e9,
            sink & 0xff
        );
    }
}

/// XOR of every word, so the loads, not the arithmetic, bound it: 64-byte loads into four
/// independent accumulators where AVX-512 is available.
fn xor_all(c: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512 F was just detected.
        return unsafe { xor_all_avx512(c) };
    }
    c.iter().fold(0, |a, b| a ^ b)
}

/// # Safety
/// AVX-512 F available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn xor_all_avx512(c: &[u64]) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_si512(); 4];
    let mut blocks = c.chunks_exact(32);
    for b in &mut blocks {
        for (k, a) in acc.iter_mut().enumerate() {
            // SAFETY: `b` holds 32 words, so words 8k..8k+8 are in bounds; unaligned load.
            let v = unsafe { _mm512_loadu_si512(b.as_ptr().add(8 * k) as *const __m512i) };
            *a = _mm512_xor_si512(*a, v);
        }
    }
    let v = _mm512_xor_si512(
        _mm512_xor_si512(acc[0], acc[1]),
        _mm512_xor_si512(acc[2], acc[3]),
    );
    let mut w = [0u64; 8];
    // SAFETY: `w` holds 8 words.
    unsafe { _mm512_storeu_si512(w.as_mut_ptr() as *mut __m512i, v) };
    let tail = blocks.remainder().iter().fold(0, |a, b| a ^ b);
    w.iter().fold(tail, |a, b| a ^ b)
}
