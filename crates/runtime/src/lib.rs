//! The runtime: the backend contract, KV block bookkeeping, sampling, actors and the coordinator.

pub mod backend;
pub mod kv;
pub mod sampling;

pub use backend::{
    Backend, BackendError, BackendInfo, KvStats, OpDesc, SeqChunk, SeqId, StepBatch, StepOutput,
    Support, Want,
};
pub use sampling::{Sampler, SamplingError, SamplingParams, StopMatcher, StopOutput};
