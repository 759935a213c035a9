//! The coordinator: the one place requests are routed. It holds a handle to every backend actor
//! and the routing policy, reads the actors' published status at each decision, and returns the
//! request's [`TokenStream`] (which fails over along the decision's order before the first token).

use std::collections::VecDeque;

use crate::actor::{BackendHandle, ShutdownMode};
use crate::event::{GenerateRequest, RuntimeError};
use crate::routing::{self, BackendState, Decision, RequestShape, RoutingPolicy};
use crate::stream::{Failover, TokenStream};

/// Routes requests over a set of backend actors.
#[derive(Clone, Debug)]
pub struct Coordinator {
    backends: Vec<BackendHandle>,
    policy: RoutingPolicy,
}

impl Coordinator {
    /// A coordinator over `backends` (names must be unique) with `policy`. Policy rules naming
    /// absent backends never fire; they are logged as a warning.
    pub fn new(backends: Vec<BackendHandle>, policy: RoutingPolicy) -> Result<Self, RuntimeError> {
        for (i, b) in backends.iter().enumerate() {
            if backends[..i].iter().any(|o| o.name() == b.name()) {
                return Err(RuntimeError::NoBackend {
                    why: format!("two backends are named {:?}", b.name()),
                });
            }
        }
        let names: Vec<&str> = backends.iter().map(BackendHandle::name).collect();
        for n in policy.unknown_backends(&names) {
            tracing::warn!(backend = %n, "routing policy names a backend that is not present");
        }
        Ok(Coordinator { backends, policy })
    }

    /// Keep only the backend named `name` (`--backend`); an unknown name is an error listing the
    /// available ones.
    pub fn restrict(self, name: &str) -> Result<Self, RuntimeError> {
        let available = self.names().join(", ");
        let keep: Vec<BackendHandle> = self
            .backends
            .into_iter()
            .filter(|b| b.name() == name)
            .collect();
        if keep.is_empty() {
            return Err(RuntimeError::UnknownBackend {
                name: name.to_string(),
                available,
            });
        }
        Ok(Coordinator {
            backends: keep,
            policy: self.policy,
        })
    }

    /// The backends, in construction order.
    pub fn backends(&self) -> &[BackendHandle] {
        &self.backends
    }

    /// Backend names.
    pub fn names(&self) -> Vec<String> {
        self.backends.iter().map(|b| b.name().to_string()).collect()
    }

    /// The policy in force.
    pub fn policy(&self) -> &RoutingPolicy {
        &self.policy
    }

    /// Live state of every backend, as the router sees it.
    pub fn states(&self) -> Vec<BackendState> {
        self.backends
            .iter()
            .map(|b| {
                let s = b.status();
                let free =
                    s.kv.blocks_total
                        .saturating_sub(s.kv_reserved.max(s.kv.blocks_used));
                BackendState {
                    name: b.name().to_string(),
                    healthy: s.healthy(),
                    queue_depth: s.waiting + s.running,
                    free_kv_blocks: free,
                    max_seq_tokens: b.info().max_seq_tokens,
                }
            })
            .collect()
    }

    /// Decide where `req` would go now.
    pub fn route(&self, req: &GenerateRequest) -> Result<Decision, RuntimeError> {
        self.route_requested(req, None)
    }

    /// Decide where `req` would go now when its caller may have named a backend.
    pub fn route_requested(
        &self,
        req: &GenerateRequest,
        requested: Option<&str>,
    ) -> Result<Decision, RuntimeError> {
        let shape = RequestShape {
            prompt_tokens: req.prompt.len(),
            max_new_tokens: req.params.max_tokens,
            priority: req.hints.priority,
            batch: req.hints.batch,
        };
        match requested {
            Some(name) => routing::decide_requested(&self.policy, &shape, &self.states(), name),
            None => routing::decide(&self.policy, &shape, &self.states()),
        }
    }

    /// Validate, route and submit `req`. Request errors (empty or too long prompt, bad
    /// parameters) come back here; later failures arrive as stream events.
    pub fn submit(&self, req: GenerateRequest) -> Result<TokenStream, RuntimeError> {
        self.submit_to(req, None)
    }

    /// [`Coordinator::submit`] for a caller that may name the backend to serve it
    /// (`x-crossover-backend`): honoured when that backend is eligible (the rest of the normal
    /// order stays behind it for failover), otherwise routed normally with the reason saying
    /// why; an unknown name is a request error.
    pub fn submit_to(
        &self,
        req: GenerateRequest,
        requested: Option<&str>,
    ) -> Result<TokenStream, RuntimeError> {
        if req.prompt.is_empty() {
            return Err(RuntimeError::EmptyPrompt);
        }
        req.params.validate()?;
        let decision = self.route_requested(&req, requested)?;
        tracing::info!(
            backend = %decision.backend(),
            prompt_tokens = req.prompt.len(),
            "route: {}",
            decision.reason
        );
        let mut next: VecDeque<BackendHandle> = decision
            .order
            .iter()
            .filter_map(|n| self.backends.iter().find(|b| b.name() == n).cloned())
            .collect();
        let mut reason = decision.reason.clone();
        let mut code = decision.code.clone();
        let mut last_err = None;
        while let Some(h) = next.pop_front() {
            match h.submit(req.clone(), reason.clone()) {
                Ok(rx) => {
                    let failover = Failover {
                        req,
                        next,
                        reason: decision.reason.clone(),
                    };
                    return Ok(TokenStream::new(
                        rx,
                        h.name().to_string(),
                        reason,
                        code,
                        Some(failover),
                    ));
                }
                Err(e) if e.can_fail_over() => {
                    code = "failover".into();
                    reason = format!(
                        "failover from {} refused ({e}); {}",
                        h.name(),
                        decision.reason
                    );
                    last_err = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        Err(last_err.unwrap_or(RuntimeError::NoBackend {
            why: "no backend in the decision".into(),
        }))
    }

    /// The most tokens a prompt may have on the backend with the longest context, minus one.
    pub fn max_prompt_tokens(&self) -> usize {
        self.backends
            .iter()
            .map(|b| b.info().max_seq_tokens)
            .max()
            .unwrap_or(0)
            .saturating_sub(1)
    }

    /// Ask every actor to stop.
    pub fn shutdown(&self, mode: ShutdownMode) {
        for b in &self.backends {
            b.shutdown(mode);
        }
    }

    /// Wait until every actor has stopped.
    pub async fn wait_stopped(&self) {
        for b in &self.backends {
            b.wait_stopped().await;
        }
    }
}
