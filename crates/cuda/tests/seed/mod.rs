//! Fresh random inputs for every run of the CUDA crate's tests: the seed is printed with the
//! test's name, and `CROSSOVER_TEST_SEED` replays a printed one.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// A generator seeded for this run of `test`.
pub fn rng(test: &str) -> ChaCha8Rng {
    let seed = std::env::var("CROSSOVER_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    eprintln!("{test}: seed {seed} (CROSSOVER_TEST_SEED={seed} replays it)");
    ChaCha8Rng::seed_from_u64(seed)
}
