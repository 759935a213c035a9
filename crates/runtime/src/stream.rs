//! The caller's end of a generation: an async [`Stream`] of [`TokenEvent`]s (or a blocking
//! iterator), with failover before the first token.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_core::Stream;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::actor::BackendHandle;
use crate::event::{GenerateRequest, RuntimeError, TokenEvent};

/// Where to go if the current backend fails before producing a token.
pub(crate) struct Failover {
    pub req: GenerateRequest,
    pub next: VecDeque<BackendHandle>,
    pub reason: String,
}

/// Token events of one request. Ends after `Done` or `Error` (always one of them). Dropping it
/// cancels the request; its backend frees the sequence's KV blocks within one step.
///
/// If the serving backend fails before the first token (an error, an overload, its actor gone),
/// the request moves to the next eligible backend chosen by the router; the caller sees only the
/// new backend's tokens, so nothing is lost or duplicated. After the first token an error ends
/// the stream.
pub struct TokenStream {
    rx: UnboundedReceiver<TokenEvent>,
    backend: String,
    route_reason: String,
    route_code: String,
    failover: Option<Failover>,
    finished: bool,
}

impl std::fmt::Debug for TokenStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenStream")
            .field("backend", &self.backend)
            .field("route_reason", &self.route_reason)
            .field("finished", &self.finished)
            .finish()
    }
}

enum Next {
    Yield(TokenEvent),
    Retry,
}

impl TokenStream {
    pub(crate) fn new(
        rx: UnboundedReceiver<TokenEvent>,
        backend: String,
        route_reason: String,
        route_code: String,
        failover: Option<Failover>,
    ) -> Self {
        TokenStream {
            rx,
            backend,
            route_reason,
            route_code,
            failover,
            finished: false,
        }
    }

    /// The backend serving the request now (changes on failover).
    pub fn backend(&self) -> &str {
        &self.backend
    }

    /// Why it was chosen (failovers included).
    pub fn route_reason(&self) -> &str {
        &self.route_reason
    }

    /// Short label of the decision for metrics: `rule:NAME`, `default`, `builtin`, `failover`.
    pub fn route_code(&self) -> &str {
        &self.route_code
    }

    /// Next event, blocking the thread. Must not be called from inside an async runtime.
    pub fn blocking_next(&mut self) -> Option<TokenEvent> {
        loop {
            if self.finished {
                return None;
            }
            let ev = self.rx.blocking_recv();
            match self.on_event(ev) {
                Next::Yield(e) => return Some(e),
                Next::Retry => continue,
            }
        }
    }

    /// A blocking iterator over the events (for synchronous callers such as the CLI).
    pub fn into_blocking(self) -> BlockingTokenStream {
        BlockingTokenStream(self)
    }

    fn on_event(&mut self, ev: Option<TokenEvent>) -> Next {
        let ev = ev.unwrap_or_else(|| {
            TokenEvent::Error(RuntimeError::ActorGone {
                backend: self.backend.clone(),
            })
        });
        match ev {
            TokenEvent::Token { .. } => {
                // Tokens are out: from here on the request belongs to this backend.
                self.failover = None;
                Next::Yield(ev)
            }
            TokenEvent::Done(_) => {
                self.finished = true;
                self.failover = None;
                Next::Yield(ev)
            }
            TokenEvent::Error(e) => {
                if e.can_fail_over() && self.try_failover(&e) {
                    return Next::Retry;
                }
                self.finished = true;
                Next::Yield(TokenEvent::Error(e))
            }
        }
    }

    /// Submit to the next candidate that accepts; false when none is left.
    fn try_failover(&mut self, err: &RuntimeError) -> bool {
        let Some(f) = self.failover.as_mut() else {
            return false;
        };
        let mut why = format!("{} failed ({err})", self.backend);
        while let Some(h) = f.next.pop_front() {
            let reason = format!("failover from {why}; {}", f.reason);
            tracing::warn!(from = %self.backend, to = %h.name(), "{reason}");
            match h.submit(f.req.clone(), reason.clone()) {
                Ok(rx) => {
                    self.rx = rx;
                    self.backend = h.name().to_string();
                    self.route_reason = reason;
                    self.route_code = "failover".into();
                    return true;
                }
                Err(e) => why = format!("{} refused ({e})", h.name()),
            }
        }
        false
    }
}

impl Stream for TokenStream {
    type Item = TokenEvent;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<TokenEvent>> {
        let this = self.get_mut();
        loop {
            if this.finished {
                return Poll::Ready(None);
            }
            let ev = match this.rx.poll_recv(cx) {
                Poll::Ready(ev) => ev,
                Poll::Pending => return Poll::Pending,
            };
            match this.on_event(ev) {
                Next::Yield(e) => return Poll::Ready(Some(e)),
                Next::Retry => continue,
            }
        }
    }
}

/// Blocking iterator over a [`TokenStream`].
pub struct BlockingTokenStream(TokenStream);

impl BlockingTokenStream {
    /// The stream inside (backend and route reason accessors).
    pub fn stream(&self) -> &TokenStream {
        &self.0
    }
}

impl Iterator for BlockingTokenStream {
    type Item = TokenEvent;
    fn next(&mut self) -> Option<TokenEvent> {
        self.0.blocking_next()
    }
}
