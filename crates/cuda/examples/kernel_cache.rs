//! Fill the kernel disk cache for an architecture without a GPU, so a device run loads the
//! kernels instead of spending ~100 s compiling them there. The cache key holds the NVRTC
//! version, so run it with the device's NVRTC on the loader path (e.g. the PyPI wheel
//! `nvidia-cuda-nvrtc==13.0.88` for a CUDA 13.0 driver), and copy the folder to the device's
//! `CROSSOVER_CUDA_CACHE`.
//!
//! `CROSSOVER_CUDA_CACHE=DIR cargo run --release -p cuda --example kernel_cache -- sm_90`

fn main() {
    let arch = std::env::args().nth(1).unwrap_or_else(|| "sm_90".into());
    let t = std::time::Instant::now();
    match cuda::compile::compile_cached(&arch) {
        Ok((img, cached)) => {
            let (maj, min) = cuda::compile::nvrtc_version().unwrap_or((0, 0));
            println!(
                "{arch}: {} bytes, NVRTC {maj}.{min}, {} in {:.1} s, cache {}",
                img.bytes().len(),
                if cached { "already cached" } else { "compiled" },
                t.elapsed().as_secs_f64(),
                cuda::compile::cache_dir().map_or("none".into(), |d| d.display().to_string())
            );
        }
        Err(e) => {
            eprintln!("{arch}: {e}");
            std::process::exit(1);
        }
    }
}
