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
pub mod request;

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use runtime::{Coordinator, FinishReason, RuntimeError, Summary, TokenEvent, TokenStream};
use serde_json::{json, Value};
use tokenizer::{TemplateLimits, Tokenizer};

pub use error::ApiError;
pub use metrics::Metrics;
pub use request::{Prepared, RequestParser};

tokio::task_local! {
    /// The id of the request being handled (`x-request-id`), for the log lines of errors whose
    /// details stay out of responses.
    static REQUEST_ID: Arc<str>;
}

/// The current request's id, or `-` outside a request.
fn request_id() -> Arc<str> {
    REQUEST_ID
        .try_with(Arc::clone)
        .unwrap_or_else(|_| Arc::from("-"))
}

/// Server settings.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The model id clients name (`model` field, `/v1/models`).
    pub model_id: String,
    /// Bearer token required on every endpoint but `/health`; `None` = open.
    pub api_key: Option<String>,
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
    /// Largest request head (request line and headers), in bytes: 431 beyond.
    pub max_header_bytes: usize,
    /// Time a client gets to send a request head, counted from the connection's opening or the
    /// end of its previous response (so it is also the keep-alive idle timeout); the connection
    /// is closed after it.
    pub header_timeout: Duration,
    /// Time a client gets to send the whole body once the head is in: 408 after.
    pub body_timeout: Duration,
    /// Longest a request may take from its body's arrival to its last token: 504 before the
    /// response starts, an error event in a stream that has.
    pub request_timeout: Duration,
    /// Most open connections; one more gets 503 and is closed.
    pub max_connections: usize,
    /// Per-request cap on prompt plus generated tokens (`None`: the backend's context).
    pub max_context: Option<usize>,
    /// Bounds on one chat-template rendering.
    pub template_limits: TemplateLimits,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            model_id: "default".into(),
            api_key: None,
            max_body_bytes: 2 << 20,
            max_header_bytes: 16 << 10,
            header_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(600),
            max_connections: 256,
            max_context: None,
            template_limits: TemplateLimits::default(),
        }
    }
}

/// Shared state of the handlers. Holds the coordinator (cheap handles to the actors), the
/// tokenizer and chat template, and the metrics.
pub struct AppState {
    pub coord: Coordinator,
    pub tok: Arc<Tokenizer>,
    /// Body to runtime request: parsing, validation, chat template, tokenization.
    pub parser: RequestParser,
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
        let parser = RequestParser::new(
            cfg.model_id.clone(),
            tok.clone(),
            cfg.template_limits,
            cfg.max_context,
        )?;
        Ok(Arc::new(AppState {
            coord,
            tok,
            parser,
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

/// The warning to give when the server listens beyond this machine without an API key: anyone
/// who can reach the address can use the model. `None` for loopback or with a key.
pub fn exposure_warning(addr: &std::net::SocketAddr, has_api_key: bool) -> Option<String> {
    if has_api_key || addr.ip().is_loopback() {
        return None;
    }
    Some(format!(
        "listening on {addr}, which is not a loopback address, without --api-key: anyone who \
         can reach it can run requests; set --api-key (or CROSSOVER_API_KEY) or bind 127.0.0.1"
    ))
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
        .layer(middleware::from_fn_with_state(
            state.clone(),
            with_request_id,
        ))
        .with_state(state)
}

/// Gives every request an id (`x-request-id` on the response) that error log lines carry.
async fn with_request_id(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let id: Arc<str> = Arc::from(st.id("req"));
    let mut resp = REQUEST_ID.scope(id.clone(), next.run(req)).await;
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

/// Serve on `listener` until `shutdown` resolves, then stop accepting and let open requests end.
///
/// Connection limits come from the state's [`ServerConfig`]: at most `max_connections` open
/// (one more gets a 503 and is closed), request heads of at most `max_header_bytes` (431), and
/// `header_timeout` to send a head (also the keep-alive idle time).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let cfg = state.cfg.clone();
    let app = router(state);
    let permits = Arc::new(tokio::sync::Semaphore::new(cfg.max_connections.max(1)));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut conns = tokio::task::JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            accepted = listener.accept() => {
                let (stream, _) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        tracing::warn!("accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                match permits.clone().try_acquire_owned() {
                    Ok(permit) => {
                        let conn = connection(stream, app.clone(), cfg.clone(), stop_rx.clone());
                        conns.spawn(async move {
                            conn.await;
                            drop(permit);
                        });
                    }
                    Err(_) => {
                        tracing::warn!(max = cfg.max_connections, "connection refused: too many open");
                        conns.spawn(refuse_connection(stream));
                    }
                }
            }
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    while conns.join_next().await.is_some() {}
    Ok(())
}

/// One HTTP/1.1 connection with the head limits, until it closes or the server stops (then it
/// finishes the response in progress and closes).
async fn connection(
    stream: tokio::net::TcpStream,
    app: Router,
    cfg: ServerConfig,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let io = hyper_util::rt::TokioIo::new(stream);
    let svc = hyper_util::service::TowerToHyperService::new(app);
    let mut b = hyper::server::conn::http1::Builder::new();
    b.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(cfg.header_timeout)
        .max_header_size(cfg.max_header_bytes)
        .keep_alive(true);
    let conn = b.serve_connection(io, svc);
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => {
            if let Err(e) = r {
                tracing::debug!("connection ended: {e}");
            }
        }
        _ = async { let _ = stop.wait_for(|s| *s).await; } => {
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
    }
}

/// The answer to a connection over the cap: 503 in OpenAI's shape, then close.
async fn refuse_connection(mut stream: tokio::net::TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = ApiError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        message: "too many open connections; retry later".into(),
        kind: "server_error",
        param: None,
        code: Some("too_many_connections"),
        retry_after: Some(Duration::from_secs(1)),
    }
    .body()
    .to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        // Read what the client sent first, so closing does not reset the connection before
        // the client reads the answer.
        let mut buf = [0u8; 4096];
        let _ = tokio::time::timeout(Duration::from_millis(200), stream.read(&mut buf)).await;
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await?;
        while stream.read(&mut buf).await? > 0 {}
        Ok::<_, std::io::Error>(())
    })
    .await;
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

/// Whether `given` equals `key`, in time that depends on `key`'s length only: no early exit on
/// the first differing byte or on a length mismatch, so response times do not reveal how much
/// of a guess was right.
fn constant_time_eq(given: &[u8], key: &[u8]) -> bool {
    let mut diff = u64::from(given.len() != key.len());
    for (i, &k) in key.iter().enumerate() {
        // Past the end of `given`, compare against a byte that differs from `k`.
        let g = given.get(i).copied().unwrap_or(!k);
        diff |= u64::from(std::hint::black_box(g ^ k));
    }
    std::hint::black_box(diff) == 0
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

/// Whether the request carries the API key (or none is configured).
fn authorized(st: &AppState, headers: &HeaderMap) -> bool {
    let Some(key) = &st.cfg.api_key else {
        return true;
    };
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes()))
}

async fn health(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    // `/health` is open; a backend's last error text is internal, so a server with a key shows
    // it only to callers that present the key.
    let show_errors = authorized(&st, &headers);
    let backends: Vec<Value> = st
        .coord
        .backends()
        .iter()
        .map(|b| {
            let s = b.status();
            let mut v = json!({
                "name": b.name(),
                "device": b.info().device,
                "healthy": s.healthy(),
                "state": s.state(),
                "restarts": s.restarts,
                "crashes": s.crashes,
                "queue_depth": s.waiting + s.running,
                "kv_blocks_used": s.kv.blocks_used,
                "kv_blocks_total": s.kv.blocks_total,
            });
            if show_errors {
                v["last_error"] = json!(s.last_error);
            }
            v
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

/// Reads the body: at most `max_body_bytes` (413), all of it within `body_timeout` (408), so a
/// client that trickles its body cannot hold a connection and a slot for long.
async fn read_body(st: &AppState, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    let limit = st.cfg.max_body_bytes;
    let too_large = || {
        ApiError::status(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("request body too large (limit {limit} bytes)"),
        )
        .with_code("body_too_large")
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let read = async {
        let mut stream = body.into_data_stream();
        let mut buf = Vec::with_capacity(declared.map_or(0, |n| n as usize));
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| {
                ApiError::invalid(format!("cannot read the request body: {e}"), None)
            })?;
            if buf.len() + chunk.len() > limit {
                return Err(too_large());
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(buf))
    };
    match tokio::time::timeout(st.cfg.body_timeout, read).await {
        Ok(r) => r,
        Err(_) => Err(ApiError::status(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!(
                "the request body did not arrive within {} s",
                st.cfg.body_timeout.as_secs_f64()
            ),
        )
        .with_code("body_timeout")),
    }
}

/// Which response shape to produce.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// Reads and parses a request on a blocking thread (templates and tokenization of megabyte
/// prompts take a while), then generates.
async fn handle(st: Arc<AppState>, headers: HeaderMap, body: Body, kind: Kind) -> Response {
    let bytes = match read_body(&st, &headers, body).await {
        Ok(b) => b,
        Err(e) => return fail(&st, e),
    };
    let started = tokio::time::Instant::now();
    let st2 = st.clone();
    let parsed = tokio::task::spawn_blocking(move || match kind {
        Kind::Chat => st2.parser.chat(&bytes),
        Kind::Completion => st2.parser.completion(&bytes),
    })
    .await;
    let p = match parsed {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => return fail(&st, e),
        Err(e) => {
            return fail(
                &st,
                ApiError::status(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    format!("request parsing failed: {e}"),
                ),
            )
        }
    };
    let param = if kind == Kind::Chat {
        "messages"
    } else {
        "prompt"
    };
    let deadline = started + st.cfg.request_timeout;
    // The caller may name the backend (`x-crossover-backend`, as in the response); the
    // coordinator honours it when that backend is eligible.
    let requested = match headers.get("x-crossover-backend").map(|v| v.to_str()) {
        None => None,
        Some(Ok(v)) => Some(v.trim().to_string()),
        Some(Err(_)) => {
            return fail(
                &st,
                ApiError::invalid("header x-crossover-backend is not visible ASCII", None),
            )
        }
    };
    generate(st, p, kind, param, deadline, requested).await
}

async fn chat_completions(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(st, headers, body, Kind::Chat).await
}

async fn completions(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    handle(st, headers, body, Kind::Completion).await
}

/// Internal failures (500) reach the client as a generic message with the request id; the
/// details (which may name files, devices, or code paths) go to the log under that id.
fn public(e: ApiError, id: &str) -> ApiError {
    if e.status != StatusCode::INTERNAL_SERVER_ERROR {
        return e;
    }
    tracing::error!(request_id = id, "internal error: {}", e.message);
    ApiError {
        message: format!("internal server error (request id {id})"),
        param: None,
        ..e
    }
}

fn timeout_error(limit: Duration) -> ApiError {
    ApiError::status(
        StatusCode::GATEWAY_TIMEOUT,
        "server_error",
        format!(
            "the request did not finish within the server's limit of {} s",
            limit.as_secs_f64()
        ),
    )
    .with_code("request_timeout")
}

fn fail(st: &AppState, e: ApiError) -> Response {
    st.metrics
        .error(e.status.as_u16(), e.code.unwrap_or(e.kind));
    let id = request_id();
    // 500s are logged (at ERROR, with their details) by `public`.
    if (e.status.is_server_error() && e.status != StatusCode::INTERNAL_SERVER_ERROR)
        || e.status == StatusCode::TOO_MANY_REQUESTS
    {
        tracing::warn!(request_id = %id, status = %e.status, "{}", e.message);
    }
    public(e, &id).into_response()
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
    p: Prepared,
    kind: Kind,
    prompt_param: &str,
    deadline: tokio::time::Instant,
    requested: Option<String>,
) -> Response {
    let Prepared {
        gen: req,
        stream,
        include_usage,
    } = p;
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
    let mut ts = match st.coord.submit_to(req, requested.as_deref()) {
        Ok(ts) => ts,
        Err(e) => return fail(&st, runtime_error(e, prompt_param)),
    };
    // Wait for the first event (failovers happen inside), so a refusal gets its status.
    let first = match tokio::time::timeout_at(deadline, ts.next()).await {
        Err(_) => return fail(&st, timeout_error(st.cfg.request_timeout)),
        Ok(Some(TokenEvent::Error(e))) => return fail(&st, runtime_error(e, prompt_param)),
        Ok(Some(ev)) => ev,
        Ok(None) => {
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
            ev = match tokio::time::timeout_at(deadline, ts.next()).await {
                Ok(ev) => ev,
                // Dropping the stream on return cancels the sequence.
                Err(_) => return fail(&st, timeout_error(st.cfg.request_timeout)),
            };
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
        request_id: request_id(),
        deadline,
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
    request_id: Arc<str>,
    deadline: tokio::time::Instant,
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
                None => match tokio::time::timeout_at(self.ctx.deadline, self.ts.next()).await {
                    Ok(ev) => ev,
                    Err(_) => {
                        // The phase ends the stream; dropping it then cancels the sequence.
                        let a = timeout_error(self.ctx.st.cfg.request_timeout);
                        self.ctx
                            .st
                            .metrics
                            .error(a.status.as_u16(), "request_timeout");
                        tracing::warn!(request_id = %self.ctx.request_id, "{}", a.message);
                        self.phase = Phase::End;
                        return Some(data(&a.body()));
                    }
                },
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
                    let a = public(ApiError::from(e), &self.ctx.request_id);
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

#[cfg(test)]
mod tests {
    use super::constant_time_eq;

    #[test]
    fn key_comparison() {
        assert!(constant_time_eq(b"secret", b"secret"));
        for bad in [
            &b""[..],
            b"secre",
            b"secreT",
            b"secret!",
            b"Secret",
            b"\0ecret",
        ] {
            assert!(!constant_time_eq(bad, b"secret"), "{bad:?}");
        }
        assert!(constant_time_eq(b"", b""));
        assert!(!constant_time_eq(b"x", b""));
    }
}
