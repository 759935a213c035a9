//! What callers send (a [`GenerateRequest`]) and what they get back (a stream of [`TokenEvent`]s).

use std::time::Duration;

use crate::backend::BackendError;
use crate::sampling::{SamplingError, SamplingParams};

/// How urgent a request is, for routing rules.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    /// Interactive: latency matters.
    #[default]
    Normal,
    /// Latency matters most.
    High,
    /// Throughput matters; the caller can wait.
    Low,
}

impl Priority {
    /// Admission order: a higher rank is admitted before every waiting request of a lower one.
    pub fn rank(self) -> u8 {
        match self {
            Priority::High => 2,
            Priority::Normal => 1,
            Priority::Low => 0,
        }
    }
}

/// Request-shape hints a caller may give the router (and, for priority, the admission queue).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RouteHints {
    pub priority: Priority,
    /// The caller is sending many requests at once (offline/batch work).
    pub batch: bool,
}

/// One generation request: prompt token ids and how to sample.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    /// Prompt token ids (already including BOS / chat markup as the caller wants).
    pub prompt: Vec<u32>,
    /// Sampling and stopping.
    pub params: SamplingParams,
    /// Routing hints.
    pub hints: RouteHints,
}

impl GenerateRequest {
    /// A request with default hints.
    pub fn new(prompt: Vec<u32>, params: SamplingParams) -> Self {
        GenerateRequest {
            prompt,
            params,
            hints: RouteHints::default(),
        }
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens` reached, or the context is full.
    Length,
    /// The request was cancelled (shutdown, or the caller went away).
    Cancelled,
    /// A failure; the stream carries it as [`TokenEvent::Error`].
    Error,
}

impl FinishReason {
    /// The OpenAI-style name.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
            FinishReason::Error => "error",
        }
    }
}

/// Token counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Every sampled token, an end-of-generation token included.
    pub completion_tokens: usize,
}

/// Where the time went.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timings {
    /// From submission to admission into the running batch (the backend that served it).
    pub queue_wait: Duration,
    /// From submission to the first sampled token.
    pub time_to_first_token: Duration,
    /// From admission to the first sampled token (prompt processing).
    pub prompt_time: Duration,
    /// From the first to the last sampled token.
    pub generation_time: Duration,
}

impl Timings {
    /// Prompt tokens per second of prompt processing.
    pub fn prompt_tokens_per_s(&self, usage: &Usage) -> f64 {
        rate(usage.prompt_tokens, self.prompt_time)
    }
    /// Generated tokens per second after the first one.
    pub fn generation_tokens_per_s(&self, usage: &Usage) -> f64 {
        rate(
            usage.completion_tokens.saturating_sub(1),
            self.generation_time,
        )
    }
}

fn rate(n: usize, d: Duration) -> f64 {
    let s = d.as_secs_f64();
    if s > 0.0 {
        n as f64 / s
    } else {
        0.0
    }
}

/// The final event of a successful (or cancelled) stream.
#[derive(Clone, Debug)]
pub struct Summary {
    pub usage: Usage,
    pub timings: Timings,
    /// The backend that produced the tokens.
    pub backend: String,
    /// Why the router chose it (failovers included).
    pub route_reason: String,
    pub finish_reason: FinishReason,
    /// The sampler's seed (drawn from the OS when the request named none).
    pub seed: u64,
}

/// One item of a token stream. A stream ends after `Done` or `Error`, and always with one of
/// them.
#[derive(Debug)]
pub enum TokenEvent {
    /// A sampled token and the text it completed. Text may lag behind ids (an incomplete UTF-8
    /// character, a possible stop-string prefix) and is released with a later token; an
    /// end-of-generation token's own text is never included. A token that completes a stop
    /// string carries the text before the stop string.
    Token { id: u32, text: String },
    /// Generation ended.
    Done(Summary),
    /// Generation failed; nothing follows.
    Error(RuntimeError),
}

/// Why a request failed. Request errors (`EmptyPrompt`, `PromptTooLong`, `InvalidToken`,
/// `InvalidParams`) are the caller's; the others are the server's or the backends'.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error(
        "the prompt has {prompt_tokens} tokens but the context holds {ctx} \
         (at least one token must remain for generation)"
    )]
    PromptTooLong { prompt_tokens: usize, ctx: usize },
    #[error("prompt token {index} is id {id}, outside the vocabulary of {n_vocab}")]
    InvalidToken {
        index: usize,
        id: u32,
        n_vocab: usize,
    },
    #[error("invalid sampling parameters: {0}")]
    InvalidParams(#[from] SamplingError),
    #[error("backend {backend} is overloaded: {why}")]
    Overloaded {
        backend: String,
        why: String,
        retry_after: Duration,
    },
    #[error("backend {backend} failed: {source}")]
    Backend {
        backend: String,
        #[source]
        source: BackendError,
    },
    #[error("backend {backend} stopped unexpectedly")]
    ActorGone { backend: String },
    #[error("backend {backend} is shutting down")]
    ShuttingDown { backend: String },
    /// The backend crashed and is being restarted, or gave up after its restart attempts.
    #[error("backend {backend} is unavailable: {why}")]
    Unavailable { backend: String, why: String },
    #[error("backend {backend} could not start: {why}")]
    StartFailed { backend: String, why: String },
    #[error("no backend named {name:?}; available: {available}")]
    UnknownBackend { name: String, available: String },
    #[error("no backend can take this request: {why}")]
    NoBackend { why: String },
    #[error("detokenizing token {id}: {why}")]
    Detokenize { id: u32, why: String },
}

impl RuntimeError {
    /// Whether the request itself is at fault (HTTP 4xx), as opposed to the server.
    pub fn is_request_error(&self) -> bool {
        matches!(
            self,
            RuntimeError::EmptyPrompt
                | RuntimeError::PromptTooLong { .. }
                | RuntimeError::InvalidToken { .. }
                | RuntimeError::InvalidParams(_)
                | RuntimeError::UnknownBackend { .. }
        )
    }

    /// Whether another backend might serve the request (before its first token).
    pub fn can_fail_over(&self) -> bool {
        matches!(
            self,
            RuntimeError::Overloaded { .. }
                | RuntimeError::Backend { .. }
                | RuntimeError::ActorGone { .. }
                | RuntimeError::ShuttingDown { .. }
                | RuntimeError::Unavailable { .. }
        )
    }

    /// For overload errors: when to retry.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            RuntimeError::Overloaded { retry_after, .. } => Some(*retry_after),
            _ => None,
        }
    }
}
