//! OpenAI-compatible HTTP server over the crossover coordinator.
//!
//! `POST /v1/chat/completions` and `POST /v1/completions` (streaming as server-sent events ending
//! in `data: [DONE]`, or whole), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus).
//! Every response of a routed request carries `x-crossover-backend` and
//! `x-crossover-route-reason`. A request waits for its first event before the response starts, so
//! refusals (prompt too long, overloaded) get a proper status instead of a broken stream. A
//! client that disconnects drops its token stream, which cancels the sequence and frees its KV
//! blocks.

pub mod error;
pub mod metrics;
pub mod openai;

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use runtime::{
    Coordinator, FinishReason, GenerateRequest, RuntimeError, Summary, TokenEvent, TokenStream,
};
use serde_json::{json, Value};
use tokenizer::{ChatTemplate, Tokenizer};

pub use error::ApiError;
pub use metrics::Metrics;

/// Server settings.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The model id clients name (`model` field, `/v1/models`).
    pub model_id: String,
    /// Bearer token required on every endpoint but `/health`; `None` = open.
    pub api_key: Option<String>,
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            model_id: "default".into(),
            api_key: None,
            max_body_bytes: 2 << 20,
        }
    }
}

/// Shared state of the handlers. Holds the coordinator (cheap handles to the actors), the
/// tokenizer and chat template, and the metrics.
pub struct AppState {
    pub coord: Coordinator,
    pub tok: Arc<Tokenizer>,
    template: Option<ChatTemplate>,
    pub cfg: ServerConfig,
    pub metrics: Metrics,
    draining: AtomicBool,
    next_id: AtomicU64,
    started: u64,
}

impl AppState {
    /// State for `coord`. Fails if the model's chat template does not parse.
    pub fn new(
        coord: Coordinator,
        tok: Arc<Tokenizer>,
        cfg: ServerConfig,
    ) -> Result<Arc<AppState>, tokenizer::TokenizerError> {
        let template = tok.chat_template().map(ChatTemplate::new).transpose()?;
        Ok(Arc::new(AppState {
            coord,
            tok,
            template,
            cfg,
            metrics: Metrics::default(),
            draining: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
            started: unix_now(),
        }))
    }

    /// Stop admitting: new generation requests get 503 and `/health` reports shutting down.
    pub fn begin_drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    fn id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:x}{n:06x}", self.started)
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The HTTP routes.
pub fn router(state: Arc<AppState>) -> Router {
    let limit = state.cfg.max_body_bytes;
    let api = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model_by_id))
        .route("/metrics", get(metrics_text))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .route("/health", get(health))
        .merge(api)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// Serve on `listener` until `shutdown` resolves, then stop accepting and let open requests end.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}

async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.cfg.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        let ok = given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes()));
        if !ok {
            let e = if given.is_none() {
                ApiError::unauthorized("missing bearer token (Authorization: Bearer KEY)")
            } else {
                ApiError::unauthorized("incorrect API key")
            };
            st.metrics.error(401, "invalid_api_key");
            return e.into_response();
        }
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found() -> ApiError {
    ApiError::status(StatusCode::NOT_FOUND, "not_found_error", "no such endpoint")
}

async fn method_not_allowed() -> ApiError {
    ApiError::status(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "method not allowed",
    )
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    let backends: Vec<Value> = st
        .coord
        .backends()
        .iter()
        .map(|b| {
            let s = b.status();
            json!({
                "name": b.name(),
                "device": b.info().device,
                "healthy": s.healthy(),
                "queue_depth": s.waiting + s.running,
                "kv_blocks_used": s.kv.blocks_used,
                "kv_blocks_total": s.kv.blocks_total,
            })
        })
        .collect();
    let draining = st.draining.load(Ordering::SeqCst);
    let any = st.coord.backends().iter().any(|b| b.status().healthy());
    let (code, status) = match (draining, any) {
        (true, _) => (StatusCode::SERVICE_UNAVAILABLE, "shutting_down"),
        (false, true) => (StatusCode::OK, "ok"),
        (false, false) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
    };
    (
        code,
        Json(json!({ "status": status, "backends": backends })),
    )
        .into_response()
}

async fn metrics_text(State(st): State<Arc<AppState>>) -> Response {
    let body = st.metrics.render(&st.coord);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

fn model_card(st: &AppState) -> Value {
    json!({ "id": st.cfg.model_id, "object": "model", "created": st.started, "owned_by": "crossover" })
}

async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({ "object": "list", "data": [model_card(&st)] }))
}

async fn model_by_id(
    State(st): State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Json<Value>, ApiError> {
    if id != st.cfg.model_id {
        return Err(ApiError::unknown_model(&id, &st.cfg.model_id));
    }
    Ok(Json(model_card(&st)))
}

/// Parse a JSON body, mapping every failure to OpenAI's 400 (413 for size).
fn parse_body<T: serde::de::DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let bytes = body.map_err(|r| {
        let status = r.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::status(status, "invalid_request_error", "request body too large")
        } else {
            ApiError::invalid(format!("cannot read the request body: {r}"), None)
        }
    })?;
    serde_json::from_slice(&bytes).map_err(|e| {
        let what = if e.is_data() {
            "invalid request"
        } else {
            "invalid JSON"
        };
        ApiError::invalid(format!("{what}: {e}"), None)
    })
}

fn check_model(st: &AppState, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        Some(m) if *m == st.cfg.model_id => Ok(()),
        Some(m) => Err(ApiError::unknown_model(m, &st.cfg.model_id)),
        None => Err(ApiError::invalid("`model` is required", Some("model"))),
    }
}

/// Which response shape to produce.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

async fn chat_completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        let req: openai::ChatRequest = parse_body(body)?;
        check_model(&st, &req.common.model)?;
        req.common.check_supported()?;
        let params = req.common.sampling()?;
        let messages = req.messages()?;
        let template = st.template.as_ref().ok_or_else(|| {
            ApiError::invalid(
                "the model has no chat template; use /v1/completions",
                Some("messages"),
            )
        })?;
        let bos = st
            .tok
            .bos()
            .and_then(|i| st.tok.token_text(i))
            .unwrap_or("");
        let eos = st
            .tok
            .eos()
            .and_then(|i| st.tok.token_text(i))
            .unwrap_or("");
        let text = template.render(&messages, true, bos, eos).map_err(|e| {
            ApiError::invalid(format!("the chat template failed: {e}"), Some("messages"))
        })?;
        // A template that writes BOS itself must not get a second one from the tokenizer.
        let add_special = !(st.tok.add_bos() && !bos.is_empty() && text.starts_with(bos));
        let prompt = st
            .tok
            .encode(&text, add_special, true)
            .map_err(|e| ApiError::invalid(format!("cannot tokenize: {e}"), Some("messages")))?;
        let gen = GenerateRequest {
            prompt,
            params,
            hints: req.common.hints(),
        };
        Ok::<_, ApiError>((gen, req.common.stream, req.common.include_usage()))
    }
    .await;
    match r {
        Ok((gen, stream, usage)) => generate(st, gen, Kind::Chat, stream, usage, "messages").await,
        Err(e) => fail(&st, e),
    }
}

async fn completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = (|| {
        let req: openai::CompletionRequest = parse_body(body)?;
        check_model(&st, &req.common.model)?;
        req.common.check_supported()?;
        if req.echo == Some(true) {
            return Err(ApiError::invalid("echo is not supported", Some("echo")));
        }
        if req.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid("suffix is not supported", Some("suffix")));
        }
        let params = req.common.sampling()?;
        let prompt = match &req.prompt {
            openai::Prompt::Text(t) => st.tok.encode(t, true, true),
            openai::Prompt::Texts(v) if v.len() == 1 => st.tok.encode(&v[0], true, true),
            openai::Prompt::Texts(v) => {
                return Err(ApiError::invalid(
                    format!("only one prompt per request is supported, got {}", v.len()),
                    Some("prompt"),
                ))
            }
            openai::Prompt::Tokens(ids) => {
                let mut out = Vec::with_capacity(ids.len());
                for (i, &id) in ids.iter().enumerate() {
                    let t = u32::try_from(id).map_err(|_| {
                        ApiError::invalid(
                            format!("prompt[{i}] = {id} is not a token id"),
                            Some("prompt"),
                        )
                    })?;
                    out.push(t);
                }
                Ok(out)
            }
        }
        .map_err(|e| ApiError::invalid(format!("cannot tokenize: {e}"), Some("prompt")))?;
        let gen = GenerateRequest {
            prompt,
            params,
            hints: req.common.hints(),
        };
        Ok((gen, req.common.stream, req.common.include_usage()))
    })();
    match r {
        Ok((gen, stream, usage)) => {
            generate(st, gen, Kind::Completion, stream, usage, "prompt").await
        }
        Err(e) => fail(&st, e),
    }
}

fn fail(st: &AppState, e: ApiError) -> Response {
    st.metrics
        .error(e.status.as_u16(), e.code.unwrap_or(e.kind));
    if e.status.is_server_error() || e.status == StatusCode::TOO_MANY_REQUESTS {
        tracing::warn!(status = %e.status, "{}", e.message);
    }
    e.into_response()
}

fn runtime_error(e: RuntimeError, prompt_param: &str) -> ApiError {
    let mut a = ApiError::from(e);
    if a.param.as_deref() == Some("messages") || a.param.as_deref() == Some("prompt") {
        a.param = Some(prompt_param.to_string());
    }
    a
}

/// Header-safe text: printable ASCII only.
fn header_value(s: &str) -> HeaderValue {
    let clean: String = s
        .chars()
        .map(|c| if (' '..='~').contains(&c) { c } else { '?' })
        .collect();
    HeaderValue::from_str(&clean).unwrap_or_else(|_| HeaderValue::from_static("-"))
}

fn route_headers(stream: &TokenStream) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("x-crossover-backend", header_value(stream.backend()));
    h.insert(
        "x-crossover-route-reason",
        header_value(stream.route_reason()),
    );
    h
}

/// Per-stream bookkeeping for metrics.
struct Clock {
    start: Instant,
    last: Option<Instant>,
}

impl Clock {
    fn token(&mut self, m: &Metrics, backend: &str) {
        let now = Instant::now();
        match self.last {
            None => m
                .time_to_first_token
                .observe((now - self.start).as_secs_f64()),
            Some(prev) => m.inter_token.observe((now - prev).as_secs_f64()),
        }
        self.last = Some(now);
        m.tokens(backend, 1);
    }
}

async fn generate(
    st: Arc<AppState>,
    req: GenerateRequest,
    kind: Kind,
    stream: bool,
    include_usage: bool,
    prompt_param: &str,
) -> Response {
    if st.draining.load(Ordering::SeqCst) {
        let e = RuntimeError::ShuttingDown {
            backend: "server".into(),
        };
        return fail(&st, ApiError::from(e));
    }
    let mut clock = Clock {
        start: Instant::now(),
        last: None,
    };
    let mut ts = match st.coord.submit(req) {
        Ok(ts) => ts,
        Err(e) => return fail(&st, runtime_error(e, prompt_param)),
    };
    // Wait for the first event (failovers happen inside), so a refusal gets its status.
    let first = match ts.next().await {
        Some(TokenEvent::Error(e)) => return fail(&st, runtime_error(e, prompt_param)),
        Some(ev) => ev,
        None => {
            let e = RuntimeError::ActorGone {
                backend: ts.backend().to_string(),
            };
            return fail(&st, ApiError::from(e));
        }
    };
    st.metrics.request(ts.backend(), ts.route_code());
    let headers = route_headers(&ts);
    let id = st.id(if kind == Kind::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    });
    let created = unix_now();
    if !stream {
        let mut text = String::new();
        let mut ev = Some(first);
        let mut summary = None;
        while let Some(e) = ev {
            match e {
                TokenEvent::Token { text: t, .. } => {
                    clock.token(&st.metrics, ts.backend());
                    text.push_str(&t);
                }
                TokenEvent::Done(s) => summary = Some(s),
                TokenEvent::Error(e) => return fail(&st, runtime_error(e, prompt_param)),
            }
            ev = ts.next().await;
        }
        let Some(s) = summary else {
            let e = RuntimeError::ActorGone {
                backend: ts.backend().to_string(),
            };
            return fail(&st, ApiError::from(e));
        };
        log_summary(kind, &s);
        let body = whole_response(&st, kind, &id, created, &text, &s);
        return (headers, Json(body)).into_response();
    }
    let ctx = SseCtx {
        st: st.clone(),
        kind,
        id,
        created,
        include_usage,
        backend: ts.backend().to_string(),
    };
    let events = futures_util::stream::unfold(
        SseState {
            ts,
            pending: Some(first),
            clock,
            started: false,
            phase: Phase::Tokens,
            ctx,
        },
        |mut s| async move {
            let ev = s.next_event().await?;
            Some((Ok::<Event, Infallible>(ev), s))
        },
    );
    let sse = Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)));
    (headers, sse).into_response()
}

/// One log line per finished request.
fn log_summary(kind: Kind, s: &Summary) {
    tracing::info!(
        endpoint = if kind == Kind::Chat { "chat" } else { "completion" },
        backend = %s.backend,
        prompt_tokens = s.usage.prompt_tokens,
        completion_tokens = s.usage.completion_tokens,
        ttft_ms = (s.timings.time_to_first_token.as_secs_f64() * 1e3).round(),
        gen_tok_s = (s.timings.generation_tokens_per_s(&s.usage) * 10.0).round() / 10.0,
        finish = s.finish_reason.as_str(),
        "request done; route: {}",
        s.route_reason
    );
}

fn usage_json(s: &Summary) -> Value {
    json!({
        "prompt_tokens": s.usage.prompt_tokens,
        "completion_tokens": s.usage.completion_tokens,
        "total_tokens": s.usage.prompt_tokens + s.usage.completion_tokens,
    })
}

fn timings_json(s: &Summary) -> Value {
    let t = &s.timings;
    json!({
        "queue_wait_ms": t.queue_wait.as_secs_f64() * 1e3,
        "time_to_first_token_ms": t.time_to_first_token.as_secs_f64() * 1e3,
        "prompt_per_second": t.prompt_tokens_per_s(&s.usage),
        "predicted_per_second": t.generation_tokens_per_s(&s.usage),
        "backend": s.backend,
        "route_reason": s.route_reason,
        "seed": s.seed,
    })
}

fn finish_str(f: FinishReason) -> &'static str {
    f.as_str()
}

fn whole_response(
    st: &AppState,
    kind: Kind,
    id: &str,
    created: u64,
    text: &str,
    s: &Summary,
) -> Value {
    let choice = match kind {
        Kind::Chat => json!({
            "index": 0,
            "message": { "role": "assistant", "content": text },
            "logprobs": null,
            "finish_reason": finish_str(s.finish_reason),
        }),
        Kind::Completion => json!({
            "index": 0,
            "text": text,
            "logprobs": null,
            "finish_reason": finish_str(s.finish_reason),
        }),
    };
    json!({
        "id": id,
        "object": if kind == Kind::Chat { "chat.completion" } else { "text_completion" },
        "created": created,
        "model": st.cfg.model_id,
        "choices": [choice],
        "usage": usage_json(s),
        "timings": timings_json(s),
    })
}

struct SseCtx {
    st: Arc<AppState>,
    kind: Kind,
    id: String,
    created: u64,
    include_usage: bool,
    backend: String,
}

impl SseCtx {
    fn chunk(&self, delta_or_text: Value, finish: Option<&str>) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                json!({ "index": 0, "delta": delta_or_text, "logprobs": null, "finish_reason": finish })
            }
            Kind::Completion => {
                json!({ "index": 0, "text": delta_or_text, "logprobs": null, "finish_reason": finish })
            }
        };
        json!({
            "id": self.id,
            "object": if self.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created,
            "model": self.st.cfg.model_id,
            "choices": [choice],
        })
    }

    fn content(&self, text: &str) -> Value {
        match self.kind {
            Kind::Chat => json!({ "content": text }),
            Kind::Completion => json!(text),
        }
    }
}

enum Phase {
    Tokens,
    Usage(Box<Value>),
    Done,
    End,
}

struct SseState {
    ts: TokenStream,
    pending: Option<TokenEvent>,
    clock: Clock,
    started: bool,
    phase: Phase,
    ctx: SseCtx,
}

fn data(v: &Value) -> Event {
    Event::default().data(v.to_string())
}

impl SseState {
    /// The next SSE event, or `None` when the stream is over. Dropping this state (the client
    /// went away) drops the token stream, which cancels the request.
    async fn next_event(&mut self) -> Option<Event> {
        loop {
            match std::mem::replace(&mut self.phase, Phase::Tokens) {
                Phase::End => {
                    self.phase = Phase::End;
                    return None;
                }
                Phase::Done => {
                    self.phase = Phase::End;
                    return Some(Event::default().data("[DONE]"));
                }
                Phase::Usage(chunk) => {
                    self.phase = Phase::Done;
                    return Some(data(&chunk));
                }
                Phase::Tokens => {}
            }
            if self.ctx.kind == Kind::Chat && !self.started {
                self.started = true;
                let role = json!({ "role": "assistant", "content": "" });
                return Some(data(&self.ctx.chunk(role, None)));
            }
            let ev = match self.pending.take() {
                Some(ev) => Some(ev),
                None => self.ts.next().await,
            };
            match ev {
                Some(TokenEvent::Token { text, .. }) => {
                    self.clock.token(&self.ctx.st.metrics, &self.ctx.backend);
                    if text.is_empty() {
                        continue;
                    }
                    return Some(data(&self.ctx.chunk(self.ctx.content(&text), None)));
                }
                Some(TokenEvent::Done(s)) => {
                    log_summary(self.ctx.kind, &s);
                    let empty = match self.ctx.kind {
                        Kind::Chat => json!({}),
                        Kind::Completion => json!(""),
                    };
                    let mut last = self.ctx.chunk(empty, Some(finish_str(s.finish_reason)));
                    last["timings"] = timings_json(&s);
                    self.phase = if self.ctx.include_usage {
                        let mut u = self.ctx.chunk(Value::Null, None);
                        u["choices"] = json!([]);
                        u["usage"] = usage_json(&s);
                        Phase::Usage(Box::new(u))
                    } else {
                        Phase::Done
                    };
                    return Some(data(&last));
                }
                Some(TokenEvent::Error(e)) => {
                    let a = ApiError::from(e);
                    self.ctx
                        .st
                        .metrics
                        .error(a.status.as_u16(), a.code.unwrap_or(a.kind));
                    tracing::warn!("stream failed: {}", a.message);
                    self.phase = Phase::End;
                    return Some(data(&a.body()));
                }
                None => {
                    self.phase = Phase::End;
                    return None;
                }
            }
        }
    }
}
