//! Compiles the exact-mode kernels (kernels/exact.cu) for the host as plain C, so the tests run
//! the GPU's exact forward pass on a machine without a GPU (src/exact/host.rs). Linux only (64-bit);
//! elsewhere the host form is left out (`cfg(exact_host)` unset) and nothing else changes.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(exact_host)");
    println!("cargo::rerun-if-changed=kernels/exact.cu");
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let width = std::env::var("CARGO_CFG_TARGET_POINTER_WIDTH").unwrap_or_default();
    if os != "linux" || width != "64" {
        return;
    }
    cc::Build::new()
        .file("kernels/exact.cu")
        // The file is CUDA C written in the C subset for this build.
        .flag("-xc")
        .flag("-std=c11")
        // Every float operation rounds on its own, as the device intrinsics do.
        .flag("-ffp-contract=off")
        .flag("-fno-fast-math")
        .define("EXACT_HOST", None)
        .opt_level(2)
        .warnings(true)
        .compile("crossover_exact_host");
    println!("cargo::rustc-cfg=exact_host");
}
