//! What the kernel tests share about their inputs: the weight types under test and the seed of
//! a run's fresh random data.

use std::io::Write;

use gguf::GgmlType;

/// Every weight type the dot products take.
pub const WEIGHT_TYPES: [GgmlType; 13] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

/// A seed for this run (fresh inputs every run; `CROSSOVER_TEST_SEED` replays a printed one).
/// Written straight to stderr, not through the harness's capture, so it survives a crash.
pub fn run_seed(test: &str) -> u64 {
    let seed = std::env::var("CROSSOVER_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    // `std::io::stderr()` itself, not `eprintln!`: the harness captures the macros' output.
    let _ = writeln!(
        std::io::stderr(),
        "{test}: seed {seed} (CROSSOVER_TEST_SEED={seed} replays it)"
    );
    seed
}
