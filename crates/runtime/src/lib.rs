//! The runtime: the backend contract, KV block bookkeeping, sampling, actors and the coordinator.
//!
//! A backend lives on its own actor thread ([`actor::spawn`]); callers hold cheap
//! [`BackendHandle`]s. The [`Coordinator`] routes each request by a [`RoutingPolicy`] and returns a
//! [`TokenStream`] of [`TokenEvent`]s; dropping the stream cancels the request.

pub mod actor;
pub mod backend;
pub mod coordinator;
pub mod event;
pub mod fallback;
pub mod fault;
pub mod kv;
pub mod routing;
pub mod sampling;
pub mod scheduler;
pub mod stream;

pub use actor::{
    spawn, ActorConfig, ActorStatus, BackendFactory, BackendHandle, Factory, Phase, RestartFactory,
    RestartPolicy, ShutdownMode,
};
pub use backend::{
    Backend, BackendError, BackendInfo, KvStats, OpDesc, SeqChunk, SeqId, StepBatch, StepOutput,
    Support, Want,
};
pub use coordinator::Coordinator;
pub use event::{
    FinishReason, GenerateRequest, Priority, RouteHints, RuntimeError, Summary, Timings,
    TokenEvent, Usage,
};
pub use routing::{Decision, RoutingError, RoutingPolicy};
pub use sampling::{Sampler, SamplingError, SamplingParams, StopMatcher, StopOutput};
pub use stream::{BlockingTokenStream, TokenStream};
