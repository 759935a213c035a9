//! OpenAI-compatible HTTP server over the crossover coordinator.
