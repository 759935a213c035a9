//! One actor per backend instance: a dedicated OS thread that builds the backend, owns it (weights
//! and KV cache) and runs the continuous-batching loop. Callers talk to it through a cheap,
//! cloneable [`BackendHandle`] over a bounded channel; the only thing flowing back besides token
//! events is a published status snapshot (a `watch` channel). Nothing mutable is shared.
//!
//! Loop: drain the mailbox; drop cancelled requests (their stream was dropped) and give their KV
//! blocks back; refuse requests that waited too long; admit waiting requests while their KV
//! reservation fits; run one step (every generating sequence feeds one token, prompts are fed
//! in chunks); sample; send events; finish sequences.
//!
//! Supervision: each actor has a supervisor thread that owns the mailbox between backend
//! lifetimes. When the backend panics (anywhere: load, step, release) or reports a device error,
//! the actor publishes itself unhealthy, ends every in-flight request with an error event (those
//! without a token yet fail over in their stream), drops the backend, and its thread ends. The
//! supervisor then rebuilds the backend from the factory on a fresh thread after a backoff that
//! doubles with each attempt, checks it with a one-token probe step, and serves again; requests
//! arriving meanwhile are refused as [`RuntimeError::Unavailable`] (they fail over too). After
//! [`RestartPolicy::max_restarts`] attempts in a row fail the backend is marked failed for good.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokenizer::{IncrementalDecoder, Tokenizer};
use tokio::sync::{mpsc as tmpsc, watch};

use crate::backend::{
    Backend, BackendError, BackendInfo, KvStats, SeqChunk, SeqId, StepBatch, StepOutput, Want,
};
use crate::event::{
    FinishReason, GenerateRequest, RuntimeError, Summary, Timings, TokenEvent, Usage,
};
use crate::sampling::{Sampler, StopMatcher};
use crate::scheduler::{self, RunView, SchedConfig};

/// Builds a backend on the actor's own thread (a CUDA context belongs to the thread that made it).
/// It runs once, so an actor started from it cannot be restarted after a crash: use a
/// [`RestartFactory`] for that.
pub type BackendFactory = Box<dyn FnOnce() -> Result<Box<dyn Backend>, BackendError> + Send>;

/// Builds a backend on the actor's thread, as often as needed: after a crash the supervisor runs
/// it again on a fresh thread.
pub type RestartFactory = Arc<dyn Fn() -> Result<Box<dyn Backend>, BackendError> + Send + Sync>;

/// How an actor's backend is built: once, or as often as restarts need.
pub enum Factory {
    /// Built once; a crash leaves the backend failed.
    Once(BackendFactory),
    /// Rebuilt after each crash, within the [`RestartPolicy`].
    Restartable(RestartFactory),
}

impl From<BackendFactory> for Factory {
    fn from(f: BackendFactory) -> Self {
        Factory::Once(f)
    }
}

impl From<RestartFactory> for Factory {
    fn from(f: RestartFactory) -> Self {
        Factory::Restartable(f)
    }
}

/// When and how often a crashed backend is rebuilt.
#[derive(Clone, Debug, PartialEq)]
pub struct RestartPolicy {
    /// Attempts in a row before the backend is marked failed (0: never restart).
    pub max_restarts: u32,
    /// Wait before the first attempt; each further attempt waits twice as long.
    pub backoff: Duration,
    /// Longest wait between attempts.
    pub max_backoff: Duration,
    /// A backend that served this long since its last start has its attempt count reset: a crash
    /// after that is a new incident, not a repeat of the last one.
    pub reset_after: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy {
            max_restarts: 5,
            backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(30),
            reset_after: Duration::from_secs(60),
        }
    }
}

impl RestartPolicy {
    /// Wait before attempt `attempt` (1-based).
    pub fn delay(&self, attempt: u32) -> Duration {
        let factor = 1u32 << attempt.saturating_sub(1).min(20);
        self.backoff
            .checked_mul(factor)
            .unwrap_or(self.max_backoff)
            .min(self.max_backoff)
    }
}

/// Settings of one actor.
#[derive(Clone, Debug)]
pub struct ActorConfig {
    /// Name used in routing, headers and metrics; `None` takes the backend's own name.
    pub name: Option<String>,
    /// Mailbox capacity; a full mailbox refuses new requests as overloaded.
    pub mailbox: usize,
    /// Most requests waiting for admission.
    pub max_waiting: usize,
    /// How long a request may wait for KV space before it is refused as overloaded.
    pub admission_timeout: Duration,
    /// Prompt tokens per step while other sequences are generating.
    pub prefill_chunk: usize,
    /// What an overloaded refusal suggests as Retry-After.
    pub retry_after: Duration,
    /// While unhealthy and idle, how often to try a probe step.
    pub probe_interval: Duration,
    /// Rebuilding the backend after a crash (only with a [`RestartFactory`]).
    pub restart: RestartPolicy,
    /// Start each prompt from KV blocks that already hold its beginning, when the backend has
    /// them ([`Backend::reuse_prefix`]). Default on (the CLI's `--no-prefix-cache` and its
    /// `CROSSOVER_PREFIX_CACHE=0` turn it off).
    pub prefix_cache: bool,
    /// Steps whose every sampled row is greedy without penalties take
    /// [`Backend::step_argmax`]: the backend picks the tokens (the CUDA backend on the GPU, so
    /// no logits row is copied back). Default on (`CROSSOVER_DEVICE_PICK=0` turns it off in the
    /// CLI); the tokens are the same either way.
    pub device_pick: bool,
    /// Most greedy decode steps taken at once ([`Backend::decode_greedy`]) while every running
    /// sequence is greedy, none is in its prompt and none waits for admission, on a backend
    /// whose steps then run without the host in between ([`Backend::pipelines_decode`]: the
    /// CUDA backend queues them all). Tokens then stream in bursts of up to this many, and a
    /// new request or a dropped stream waits up to that many steps. 1 takes one step at a
    /// time. Default 8 (the CLI's `CROSSOVER_DECODE_CHAIN=N`).
    pub decode_chain: usize,
}

impl Default for ActorConfig {
    fn default() -> Self {
        ActorConfig {
            name: None,
            mailbox: 1024,
            max_waiting: 1024,
            admission_timeout: Duration::from_secs(30),
            prefill_chunk: 256,
            retry_after: Duration::from_secs(1),
            probe_interval: Duration::from_secs(1),
            restart: RestartPolicy::default(),
            prefix_cache: true,
            device_pick: true,
            decode_chain: 8,
        }
    }
}

/// How to stop an actor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShutdownMode {
    /// Refuse new requests, finish the admitted and waiting ones, then stop.
    Drain,
    /// Refuse new requests, end every in-flight one with `FinishReason::Cancelled`, then stop.
    Cancel,
}

/// Where an actor is in its life.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Phase {
    /// The backend is being built for the first time.
    #[default]
    Starting,
    /// The backend serves.
    Running,
    /// The backend crashed; the supervisor is rebuilding it.
    Restarting,
    /// The backend crashed and every restart attempt failed: it serves nothing until the process
    /// restarts.
    Failed,
    /// The actor stopped (shutdown, or every handle dropped).
    Stopped,
}

impl Phase {
    /// Lower-case name for `/health` and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Starting => "starting",
            Phase::Running => "running",
            Phase::Restarting => "restarting",
            Phase::Failed => "failed",
            Phase::Stopped => "stopped",
        }
    }
}

/// A snapshot of an actor's state, published after every loop iteration.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ActorStatus {
    /// Requests waiting for admission.
    pub waiting: usize,
    /// Sequences in the running batch.
    pub running: usize,
    /// The backend's KV pool.
    pub kv: KvStats,
    /// Blocks promised to running sequences (in use or not yet).
    pub kv_reserved: usize,
    /// Steps run so far (over every restart).
    pub steps: u64,
    /// Tokens sampled so far (over every restart).
    pub tokens_generated: u64,
    /// Prompt tokens not computed because cached KV blocks held them (over every restart).
    pub prefix_tokens_reused: u64,
    /// Failed steps in a row (0 = healthy).
    pub consecutive_failures: u32,
    /// The loop is running (false while restarting, once failed, stopped).
    pub alive: bool,
    /// Shutting down: no new requests.
    pub draining: bool,
    /// Where the actor is in its life.
    pub phase: Phase,
    /// Times the backend crashed while serving (panic or device error).
    pub crashes: u32,
    /// Restart attempts made (successful or not).
    pub restarts: u32,
    /// The last crash or failed restart, as text.
    pub last_error: Option<String>,
}

impl ActorStatus {
    /// Alive, accepting work and its last step did not fail.
    pub fn healthy(&self) -> bool {
        self.alive
            && !self.draining
            && self.consecutive_failures == 0
            && self.phase == Phase::Running
    }

    /// One word for `/health`: `healthy`, `unhealthy` (running, its last step failed),
    /// `draining`, `starting`, `restarting`, `failed` or `stopped`.
    pub fn state(&self) -> &'static str {
        match self.phase {
            Phase::Running if self.draining => "draining",
            Phase::Running if self.healthy() => "healthy",
            Phase::Running => "unhealthy",
            p => p.as_str(),
        }
    }
}

enum Msg {
    Generate(Box<Submission>),
    Shutdown(ShutdownMode),
}

struct Submission {
    req: GenerateRequest,
    events: tmpsc::UnboundedSender<TokenEvent>,
    submitted: Instant,
    route_reason: String,
}

struct Shared {
    name: String,
    info: BackendInfo,
    tx: SyncSender<Msg>,
    status: watch::Receiver<ActorStatus>,
    thread: Mutex<Option<JoinHandle<()>>>,
    retry_after: Duration,
}

/// A cheap, cloneable handle to one backend actor. The actor stops once every handle is gone
/// and its in-flight work is finished.
#[derive(Clone)]
pub struct BackendHandle {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for BackendHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackendHandle")
            .field("name", &self.shared.name)
            .finish()
    }
}

/// Start an actor: spawn its supervisor, build the backend on a fresh thread with `factory`, and
/// return once it is ready (or failed to start). With a [`RestartFactory`] the backend is rebuilt
/// after a crash as `cfg.restart` says; with a [`BackendFactory`] a crash leaves it failed.
pub fn spawn(
    factory: impl Into<Factory>,
    tokenizer: Arc<Tokenizer>,
    cfg: ActorConfig,
) -> Result<BackendHandle, RuntimeError> {
    let factory = factory.into();
    let (tx, rx) = mpsc::sync_channel::<Msg>(cfg.mailbox.max(1));
    let (status_tx, status_rx) = watch::channel(ActorStatus::default());
    let (ready_tx, ready_rx) = mpsc::channel::<Result<BackendInfo, String>>();
    let label = cfg.name.clone().unwrap_or_else(|| "backend".into());
    let retry_after = cfg.retry_after;
    let name_override = cfg.name.clone();
    let sup = Supervisor {
        factory: Some(factory),
        tok: tokenizer,
        cfg,
        status_tx: Arc::new(status_tx),
        name: label.clone(),
    };
    let thread = std::thread::Builder::new()
        .name(format!("supervise-{label}"))
        .spawn(move || sup.run(rx, ready_tx))
        .map_err(|e| RuntimeError::StartFailed {
            backend: label.clone(),
            why: e.to_string(),
        })?;
    let info = match ready_rx.recv() {
        Ok(Ok(info)) => info,
        Ok(Err(why)) => {
            let _ = thread.join();
            return Err(RuntimeError::StartFailed {
                backend: label,
                why,
            });
        }
        Err(_) => {
            let _ = thread.join();
            return Err(RuntimeError::StartFailed {
                backend: label,
                why: "the actor thread exited during start".into(),
            });
        }
    };
    let name = name_override.unwrap_or_else(|| info.name.clone());
    Ok(BackendHandle {
        shared: Arc::new(Shared {
            name,
            info,
            tx,
            status: status_rx,
            thread: Mutex::new(Some(thread)),
            retry_after,
        }),
    })
}

/// How one backend lifetime (one worker thread) ended.
enum Exit {
    /// Stopped on purpose: shutdown, or every handle gone.
    Stopped,
    /// Never became ready (load failed or panicked, or the restart probe failed).
    StartFailed(String),
    /// Crashed while serving; every in-flight request has its error event.
    Crashed(String),
}

/// What a worker thread hands back to the supervisor.
struct WorkerEnd {
    rx: Receiver<Msg>,
    status: ActorStatus,
    exit: Exit,
    /// The actor's name once known (the backend's own name when the config gives none).
    name: Option<String>,
    /// When the backend became ready, if it did.
    ready_at: Option<Instant>,
}

/// Owns the mailbox between backend lifetimes and rebuilds crashed backends.
struct Supervisor {
    factory: Option<Factory>,
    tok: Arc<Tokenizer>,
    cfg: ActorConfig,
    status_tx: Arc<watch::Sender<ActorStatus>>,
    name: String,
}

impl Supervisor {
    /// The next build: the one-shot factory once, a restartable one every time.
    fn build(&mut self) -> Option<BackendFactory> {
        match self.factory.take()? {
            Factory::Once(f) => Some(f),
            Factory::Restartable(f) => {
                self.factory = Some(Factory::Restartable(f.clone()));
                Some(Box::new(move || f()))
            }
        }
    }

    fn publish(&self, s: &ActorStatus) {
        self.status_tx.send_replace(s.clone());
    }

    fn run(mut self, rx: Receiver<Msg>, ready_tx: mpsc::Sender<Result<BackendInfo, String>>) {
        let mut rx = rx;
        let mut ready = Some(ready_tx);
        let mut status = ActorStatus::default();
        // Restart attempts of the current incident.
        let mut attempts: u32 = 0;
        loop {
            let Some(build) = self.build() else {
                break;
            };
            let restart = ready.is_none();
            let worker = {
                let tok = self.tok.clone();
                let cfg = self.cfg.clone();
                let status_tx = self.status_tx.clone();
                let carried = status.clone();
                let ready = ready.take();
                std::thread::Builder::new()
                    .name(format!("actor-{}", self.name))
                    .spawn(move || {
                        run_worker(build, &tok, &cfg, rx, status_tx, carried, restart, ready)
                    })
            };
            let end = match worker.map(|t| t.join()) {
                Ok(Ok(end)) => end,
                Ok(Err(p)) => {
                    // Only a panic outside every catch (a double panic aborts instead) gets here;
                    // the mailbox went with the thread, so handles now see the actor gone.
                    status.last_error = Some(format!("actor thread died: {}", panic_text(&p)));
                    status.phase = Phase::Failed;
                    status.alive = false;
                    self.publish(&status);
                    tracing::error!(backend = %self.name, "actor thread died; backend failed");
                    return;
                }
                Err(e) => {
                    status.last_error = Some(format!("cannot start the actor thread: {e}"));
                    status.phase = Phase::Failed;
                    status.alive = false;
                    self.publish(&status);
                    return;
                }
            };
            rx = end.rx;
            status = end.status;
            if let Some(n) = end.name {
                self.name = n;
            }
            match end.exit {
                Exit::Stopped => {
                    // Requests that raced the shutdown into the mailbox still get an answer.
                    while let Ok(m) = rx.try_recv() {
                        if let Msg::Generate(sub) = m {
                            let _ =
                                sub.events
                                    .send(TokenEvent::Error(RuntimeError::ShuttingDown {
                                        backend: self.name.clone(),
                                    }));
                        }
                    }
                    status.phase = Phase::Stopped;
                    status.alive = false;
                    self.publish(&status);
                    return;
                }
                Exit::StartFailed(_) if !restart => return,
                Exit::StartFailed(why) => {
                    tracing::warn!(backend = %self.name, attempt = attempts, "restart failed: {why}");
                    status.last_error = Some(why);
                }
                Exit::Crashed(why) => {
                    if end
                        .ready_at
                        .is_some_and(|t| t.elapsed() >= self.cfg.restart.reset_after)
                    {
                        attempts = 0;
                    }
                    // The actor logged the crash with the requests it ended.
                    status.last_error = Some(why);
                }
            }
            status.alive = false;
            status.running = 0;
            status.waiting = 0;
            status.kv_reserved = 0;
            status.kv = KvStats::default();
            if !matches!(self.factory, Some(Factory::Restartable(_))) {
                status.last_error = Some(format!(
                    "{}; its factory runs only once, so it is not restarted",
                    status.last_error.as_deref().unwrap_or("crashed")
                ));
                break;
            }
            if attempts >= self.cfg.restart.max_restarts {
                break;
            }
            attempts += 1;
            let wait = self.cfg.restart.delay(attempts);
            status.phase = Phase::Restarting;
            self.publish(&status);
            tracing::warn!(
                backend = %self.name,
                attempt = attempts,
                of = self.cfg.restart.max_restarts,
                "restarting in {:.2} s",
                wait.as_secs_f64()
            );
            let why = format!(
                "restarting after: {}",
                status.last_error.as_deref().unwrap_or("a crash")
            );
            if !self.refuse(&rx, Some(Instant::now() + wait), &why) {
                status.phase = Phase::Stopped;
                self.publish(&status);
                return;
            }
            status.restarts += 1;
        }
        // Gave up: answer every request until shutdown or every handle is gone.
        status.phase = Phase::Failed;
        status.alive = false;
        self.publish(&status);
        let why = format!(
            "failed after {} restart attempts; last error: {}",
            status.restarts,
            status.last_error.as_deref().unwrap_or("none")
        );
        tracing::error!(backend = %self.name, "{why}");
        self.refuse(&rx, None, &why);
        status.phase = Phase::Stopped;
        self.publish(&status);
    }

    /// Answer the mailbox while no backend runs: requests get `Unavailable` (their streams fail
    /// over), a shutdown ends it. Runs until `until` (true) or until the actor must stop (false).
    fn refuse(&self, rx: &Receiver<Msg>, until: Option<Instant>, why: &str) -> bool {
        loop {
            let m = match until {
                Some(t) => match rx.recv_timeout(t.saturating_duration_since(Instant::now())) {
                    Ok(m) => m,
                    Err(RecvTimeoutError::Timeout) => return true,
                    Err(RecvTimeoutError::Disconnected) => return false,
                },
                None => match rx.recv() {
                    Ok(m) => m,
                    Err(_) => return false,
                },
            };
            match m {
                Msg::Generate(sub) => {
                    let _ = sub
                        .events
                        .send(TokenEvent::Error(RuntimeError::Unavailable {
                            backend: self.name.clone(),
                            why: why.to_string(),
                        }));
                }
                Msg::Shutdown(_) => return false,
            }
        }
    }
}

/// One backend lifetime on its own thread: build, (after a crash) probe, serve until stopped or
/// crashed, then drop the backend. Catches every panic so the mailbox always goes back.
#[allow(clippy::too_many_arguments)]
fn run_worker(
    build: BackendFactory,
    tok: &Tokenizer,
    cfg: &ActorConfig,
    rx: Receiver<Msg>,
    status_tx: Arc<watch::Sender<ActorStatus>>,
    carried: ActorStatus,
    restart: bool,
    ready: Option<mpsc::Sender<Result<BackendInfo, String>>>,
) -> WorkerEnd {
    let start_failed = |rx, why: String| {
        if let Some(r) = &ready {
            let _ = r.send(Err(why.clone()));
        }
        WorkerEnd {
            rx,
            status: carried.clone(),
            exit: Exit::StartFailed(why),
            name: None,
            ready_at: None,
        }
    };
    let mut backend = match catch_unwind(AssertUnwindSafe(build)) {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => return start_failed(rx, e.to_string()),
        Err(p) => return start_failed(rx, format!("panicked while loading: {}", panic_text(&p))),
    };
    if restart {
        // A rebuilt backend must run a step before it is called healthy, or the router would
        // send requests straight back into a repeating fault.
        if let Err(why) = probe_step(&mut *backend, SeqId::MAX, tok.bos().unwrap_or(0)) {
            let _ = catch_unwind(AssertUnwindSafe(move || drop(backend)));
            return start_failed(rx, format!("probe step after restart failed: {why}"));
        }
    }
    let name = cfg.name.clone();
    let made = catch_unwind(AssertUnwindSafe(|| {
        let info = backend.info().clone();
        let name = name.unwrap_or_else(|| info.name.clone());
        (
            info,
            Actor::new(backend, tok, name, cfg, status_tx, carried.clone()),
        )
    }));
    let (info, mut actor) = match made {
        Ok(m) => m,
        Err(p) => return start_failed(rx, format!("panicked while starting: {}", panic_text(&p))),
    };
    if restart {
        tracing::info!(backend = %actor.name, "restarted: serving again");
    }
    if let Some(r) = &ready {
        let _ = r.send(Ok(info));
    }
    let ready_at = Instant::now();
    let exit = match catch_unwind(AssertUnwindSafe(|| actor.run(&rx))) {
        Ok(None) => Exit::Stopped,
        Ok(Some(e)) => {
            let why = e.to_string();
            actor.crash(e);
            Exit::Crashed(why)
        }
        Err(p) => {
            let e = BackendError::Device {
                backend: actor.name.clone(),
                msg: format!("panicked: {}", panic_text(&p)),
            };
            let why = e.to_string();
            actor.crash(e);
            Exit::Crashed(why)
        }
    };
    let status = actor.status.clone();
    let name = Some(actor.name.clone());
    // The backend goes with the actor; a panic while dropping it must not take the mailbox down.
    let _ = catch_unwind(AssertUnwindSafe(move || drop(actor)));
    WorkerEnd {
        rx,
        status,
        exit,
        name,
        ready_at: Some(ready_at),
    }
}

/// A one-token step on a throw-away sequence; Ok when it returns one row of logits.
fn probe_step(backend: &mut dyn Backend, seq: SeqId, token: u32) -> Result<(), String> {
    let batch = StepBatch {
        chunks: vec![SeqChunk {
            prompt_len: None,
            seq,
            tokens: vec![token],
            start_pos: 0,
            want: Want::Last,
        }],
    };
    let r = catch_unwind(AssertUnwindSafe(|| {
        let r = backend.step(&batch);
        backend.release(seq);
        r
    }));
    match r {
        Ok(Ok(out)) if out.n_rows() == 1 => Ok(()),
        Ok(Ok(out)) => Err(format!("{} logit rows, expected 1", out.n_rows())),
        Ok(Err(e)) => Err(e.to_string()),
        Err(p) => Err(format!("panicked: {}", panic_text(&p))),
    }
}

impl BackendHandle {
    /// The actor's name (routing, headers, metrics).
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The backend's description and limits.
    pub fn info(&self) -> &BackendInfo {
        &self.shared.info
    }

    /// The latest published status.
    pub fn status(&self) -> ActorStatus {
        self.shared.status.borrow().clone()
    }

    /// Queue a request. Returns the receiving end of its event stream; dropping it cancels the
    /// request. Refused at once (overloaded) when the mailbox is full.
    pub fn submit(
        &self,
        req: GenerateRequest,
        route_reason: String,
    ) -> Result<tmpsc::UnboundedReceiver<TokenEvent>, RuntimeError> {
        let (etx, erx) = tmpsc::unbounded_channel();
        let sub = Submission {
            req,
            events: etx,
            submitted: Instant::now(),
            route_reason,
        };
        match self.shared.tx.try_send(Msg::Generate(Box::new(sub))) {
            Ok(()) => Ok(erx),
            Err(TrySendError::Full(_)) => Err(RuntimeError::Overloaded {
                backend: self.shared.name.clone(),
                why: "request mailbox full".into(),
                retry_after: self.shared.retry_after,
            }),
            Err(TrySendError::Disconnected(_)) => Err(RuntimeError::ActorGone {
                backend: self.shared.name.clone(),
            }),
        }
    }

    /// Ask the actor to stop (returns at once; see [`BackendHandle::wait_stopped`]).
    pub fn shutdown(&self, mode: ShutdownMode) {
        // Blocks only while the mailbox is full, which the actor drains every step.
        let _ = self.shared.tx.send(Msg::Shutdown(mode));
    }

    /// Wait (async) until the actor's loop has ended.
    pub async fn wait_stopped(&self) {
        let mut rx = self.shared.status.clone();
        // The status sender lives as long as the loop: its end closes the channel.
        while rx.changed().await.is_ok() {}
    }

    /// Wait (blocking) until the actor's thread has ended.
    pub fn join(&self) {
        let t = self.shared.thread.lock().ok().and_then(|mut g| g.take());
        if let Some(t) = t {
            let _ = t.join();
        }
    }
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".into()
    }
}

struct Waiting {
    sub: Submission,
    sampler: Sampler,
    max_new: usize,
    blocks: usize,
}

struct Running<'t> {
    id: SeqId,
    tokens: Vec<u32>,
    prompt_len: usize,
    fed: usize,
    max_new: usize,
    generated: usize,
    blocks: usize,
    sampler: Sampler,
    decoder: IncrementalDecoder<'t>,
    stop: StopMatcher,
    events: tmpsc::UnboundedSender<TokenEvent>,
    route_reason: String,
    submitted: Instant,
    admitted: Instant,
    first_token: Option<Instant>,
    last_token: Instant,
}

struct Actor<'t> {
    backend: Box<dyn Backend>,
    tok: &'t Tokenizer,
    name: String,
    sched: SchedConfig,
    retry_after: Duration,
    probe_interval: Duration,
    prefix_cache: bool,
    device_pick: bool,
    decode_chain: usize,
    ctx: usize,
    waiting: VecDeque<Waiting>,
    running: Vec<Running<'t>>,
    next_id: SeqId,
    status: ActorStatus,
    status_tx: Arc<watch::Sender<ActorStatus>>,
    disconnected: bool,
    shutdown: Option<ShutdownMode>,
}

impl<'t> Actor<'t> {
    fn new(
        backend: Box<dyn Backend>,
        tok: &'t Tokenizer,
        name: String,
        cfg: &ActorConfig,
        status_tx: Arc<watch::Sender<ActorStatus>>,
        carried: ActorStatus,
    ) -> Self {
        let info = backend.info();
        let sched = SchedConfig {
            max_batch_tokens: info.max_batch_tokens.max(1),
            max_batch_seqs: info.max_batch_seqs.max(1),
            prefill_chunk: cfg.prefill_chunk.max(1),
            block_tokens: backend.kv().block_tokens.max(1),
            max_waiting: cfg.max_waiting,
            admission_timeout: cfg.admission_timeout,
        };
        let ctx = info.max_seq_tokens;
        // Counters and the crash history carry over a restart; the rest starts afresh.
        let status = ActorStatus {
            kv: backend.kv(),
            alive: true,
            phase: Phase::Running,
            steps: carried.steps,
            tokens_generated: carried.tokens_generated,
            prefix_tokens_reused: carried.prefix_tokens_reused,
            crashes: carried.crashes,
            restarts: carried.restarts,
            last_error: carried.last_error,
            ..Default::default()
        };
        status_tx.send_replace(status.clone());
        Actor {
            backend,
            tok,
            name,
            sched,
            retry_after: cfg.retry_after,
            probe_interval: cfg.probe_interval,
            prefix_cache: cfg.prefix_cache,
            device_pick: cfg.device_pick,
            decode_chain: cfg.decode_chain.max(1),
            ctx,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 1,
            status,
            status_tx,
            disconnected: false,
            shutdown: None,
        }
    }

    /// Serve until stopped (`None`) or until the backend crashes (`Some`: a panic or a device
    /// error, with every in-flight request still in place for [`Actor::crash`]).
    fn run(&mut self, rx: &Receiver<Msg>) -> Option<BackendError> {
        loop {
            if self.running.is_empty() {
                if self.waiting.is_empty() {
                    if self.disconnected || self.shutdown.is_some() {
                        break;
                    }
                    self.publish();
                    if self.status.consecutive_failures > 0 {
                        // Unhealthy and idle: the router sends nothing here, so probe the
                        // backend now and then to find out when it works again.
                        match rx.recv_timeout(self.probe_interval) {
                            Ok(m) => self.handle(m),
                            Err(RecvTimeoutError::Timeout) => {
                                if let Some(e) = self.probe() {
                                    return Some(e);
                                }
                            }
                            Err(RecvTimeoutError::Disconnected) => self.disconnected = true,
                        }
                    } else {
                        match rx.recv() {
                            Ok(m) => self.handle(m),
                            Err(_) => self.disconnected = true,
                        }
                    }
                } else if !self.disconnected {
                    // The last running sequence may just have finished: admit first, and sleep
                    // (until a message or the head's deadline) only if the head still does not
                    // fit. Sleeping unconditionally left a queue behind a finished sequence
                    // waiting for its admission timeout.
                    self.admit();
                    if self.running.is_empty() {
                        let now = Instant::now();
                        let deadline = self
                            .waiting
                            .iter()
                            .map(|w| w.sub.submitted + self.sched.admission_timeout)
                            .min()
                            .unwrap_or(now);
                        match rx.recv_timeout(deadline.saturating_duration_since(now)) {
                            Ok(m) => self.handle(m),
                            Err(RecvTimeoutError::Timeout) => {}
                            Err(RecvTimeoutError::Disconnected) => self.disconnected = true,
                        }
                    }
                }
            }
            while !self.disconnected {
                match rx.try_recv() {
                    Ok(m) => self.handle(m),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => self.disconnected = true,
                }
            }
            self.reap_cancelled();
            self.expire_waiting();
            self.admit();
            if !self.running.is_empty() {
                if let Err(e) = self.step() {
                    return Some(e);
                }
            } else if self.disconnected && !self.waiting.is_empty() {
                // No handle can add work, nothing runs and the head cannot be admitted: wait
                // for deadlines without spinning.
                let now = Instant::now();
                if let Some(d) = self
                    .waiting
                    .iter()
                    .map(|w| w.sub.submitted + self.sched.admission_timeout)
                    .min()
                {
                    std::thread::sleep(
                        d.saturating_duration_since(now)
                            .min(Duration::from_millis(50)),
                    );
                }
            }
            self.publish();
        }
        self.status.alive = false;
        self.status.phase = Phase::Stopped;
        self.publish();
        None
    }

    /// A one-token step on a throw-away sequence; success clears the failure count. A panic or
    /// a device error is a crash (returned).
    fn probe(&mut self) -> Option<BackendError> {
        let id = self.next_id;
        self.next_id += 1;
        let token = self.tok.bos().unwrap_or(0);
        let batch = StepBatch {
            chunks: vec![SeqChunk {
                prompt_len: None,
                seq: id,
                tokens: vec![token],
                start_pos: 0,
                want: Want::Last,
            }],
        };
        let r = catch_unwind(AssertUnwindSafe(|| self.backend.step(&batch)));
        match r {
            Ok(Ok(out)) if out.n_rows() == 1 => {
                self.backend.release(id);
                tracing::info!(backend = %self.name, "probe step succeeded: healthy again");
                self.status.consecutive_failures = 0;
                None
            }
            Ok(Err(e @ BackendError::Device { .. })) => Some(e),
            Ok(_) => {
                self.backend.release(id);
                None
            }
            Err(p) => Some(BackendError::Device {
                backend: self.name.clone(),
                msg: format!("panicked in a probe step: {}", panic_text(&p)),
            }),
        }
    }

    /// The backend crashed: publish that first (so no new request is routed here), then end
    /// every in-flight request. Those that have no token yet fail over in their stream. The
    /// backend is not called again: its state is unknown.
    fn crash(&mut self, e: BackendError) {
        self.status.alive = false;
        self.status.phase = Phase::Restarting;
        self.status.crashes += 1;
        self.status.last_error = Some(e.to_string());
        self.status.running = 0;
        self.status.waiting = 0;
        self.status.kv_reserved = 0;
        self.status.kv = KvStats::default();
        self.status_tx.send_replace(self.status.clone());
        let n = self.running.len() + self.waiting.len();
        for r in std::mem::take(&mut self.running) {
            let _ = r.events.send(TokenEvent::Error(RuntimeError::Backend {
                backend: self.name.clone(),
                source: e.clone(),
            }));
        }
        for w in std::mem::take(&mut self.waiting) {
            let _ = w
                .sub
                .events
                .send(TokenEvent::Error(RuntimeError::Unavailable {
                    backend: self.name.clone(),
                    why: format!("crashed before this request started ({e})"),
                }));
        }
        tracing::error!(backend = %self.name, requests = n, "backend crashed: {e}");
    }

    fn publish(&mut self) {
        self.status.waiting = self.waiting.len();
        self.status.running = self.running.len();
        self.status.kv = self.backend.kv();
        self.status.kv_reserved = self.running.iter().map(|r| r.blocks).sum();
        self.status.draining = self.shutdown.is_some();
        self.status_tx.send_replace(self.status.clone());
    }

    fn handle(&mut self, m: Msg) {
        match m {
            Msg::Shutdown(mode) => {
                self.shutdown = Some(match (self.shutdown, mode) {
                    (Some(ShutdownMode::Cancel), _) => ShutdownMode::Cancel,
                    _ => mode,
                });
                if mode == ShutdownMode::Cancel {
                    for w in std::mem::take(&mut self.waiting) {
                        let _ = w.sub.events.send(TokenEvent::Done(cancelled_summary(
                            &w.sub,
                            &self.name,
                            w.sampler.seed(),
                        )));
                    }
                    for mut r in std::mem::take(&mut self.running) {
                        self.backend.release(r.id);
                        let s = self.summary(&mut r, FinishReason::Cancelled);
                        let _ = r.events.send(TokenEvent::Done(s));
                    }
                }
            }
            Msg::Generate(sub) => self.enqueue(*sub),
        }
    }

    fn enqueue(&mut self, sub: Submission) {
        let refuse = |sub: &Submission, e: RuntimeError| {
            let _ = sub.events.send(TokenEvent::Error(e));
        };
        if self.shutdown.is_some() {
            return refuse(
                &sub,
                RuntimeError::ShuttingDown {
                    backend: self.name.clone(),
                },
            );
        }
        let prompt_len = sub.req.prompt.len();
        if prompt_len == 0 {
            return refuse(&sub, RuntimeError::EmptyPrompt);
        }
        if prompt_len >= self.ctx {
            return refuse(
                &sub,
                RuntimeError::PromptTooLong {
                    prompt_tokens: prompt_len,
                    ctx: self.ctx,
                },
            );
        }
        let n_vocab = self.tok.vocab_size();
        if let Some((index, &id)) = sub
            .req
            .prompt
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= n_vocab)
        {
            return refuse(&sub, RuntimeError::InvalidToken { index, id, n_vocab });
        }
        let sampler = match Sampler::new(&sub.req.params) {
            Ok(s) => s,
            Err(e) => return refuse(&sub, RuntimeError::InvalidParams(e)),
        };
        let max_new = scheduler::max_new_tokens(prompt_len, sub.req.params.max_tokens, self.ctx);
        let blocks = scheduler::blocks_for(
            scheduler::kv_tokens_needed(prompt_len, max_new),
            self.sched.block_tokens,
        );
        let total = self.backend.kv().blocks_total;
        if blocks > total {
            return refuse(
                &sub,
                RuntimeError::PromptTooLong {
                    prompt_tokens: prompt_len,
                    ctx: total * self.sched.block_tokens,
                },
            );
        }
        if self.waiting.len() >= self.sched.max_waiting {
            let e = RuntimeError::Overloaded {
                backend: self.name.clone(),
                why: format!("{} requests already waiting", self.waiting.len()),
                retry_after: self.retry_after,
            };
            return refuse(&sub, e);
        }
        let ranks: Vec<u8> = self
            .waiting
            .iter()
            .map(|w| w.sub.req.hints.priority.rank())
            .collect();
        let at = scheduler::queue_position(&ranks, sub.req.hints.priority.rank());
        self.waiting.insert(
            at,
            Waiting {
                sub,
                sampler,
                max_new,
                blocks,
            },
        );
    }

    fn reap_cancelled(&mut self) {
        self.waiting.retain(|w| !w.sub.events.is_closed());
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].events.is_closed() {
                let r = self.running.remove(i);
                self.backend.release(r.id);
            } else {
                i += 1;
            }
        }
    }

    fn expire_waiting(&mut self) {
        let now = Instant::now();
        let timeout = self.sched.admission_timeout;
        let name = &self.name;
        let retry_after = self.retry_after;
        self.waiting.retain(|w| {
            let waited = now.saturating_duration_since(w.sub.submitted);
            if waited < timeout {
                return true;
            }
            let _ = w
                .sub
                .events
                .send(TokenEvent::Error(RuntimeError::Overloaded {
                    backend: name.clone(),
                    why: format!("no KV space within {:.1} s", timeout.as_secs_f64()),
                    retry_after,
                }));
            false
        });
    }

    fn admit(&mut self) {
        if self.shutdown == Some(ShutdownMode::Cancel) {
            return;
        }
        let total = self.backend.kv().blocks_total;
        let reserved: usize = self.running.iter().map(|r| r.blocks).sum();
        let needs: Vec<usize> = self.waiting.iter().map(|w| w.blocks).collect();
        let n = scheduler::admit_count(&self.sched, total, reserved, self.running.len(), &needs);
        let now = Instant::now();
        for _ in 0..n {
            let Some(w) = self.waiting.pop_front() else {
                break;
            };
            let id = self.next_id;
            self.next_id += 1;
            let prompt_len = w.sub.req.prompt.len();
            let stop = StopMatcher::new(&w.sub.req.params.stop);
            self.running.push(Running {
                id,
                tokens: w.sub.req.prompt,
                prompt_len,
                fed: 0,
                max_new: w.max_new,
                generated: 0,
                blocks: w.blocks,
                sampler: w.sampler,
                decoder: IncrementalDecoder::new(self.tok),
                stop,
                events: w.sub.events,
                route_reason: w.sub.route_reason,
                submitted: w.sub.submitted,
                admitted: now,
                first_token: None,
                last_token: now,
            });
        }
    }

    /// One step. `Err` when the backend crashed (a panic or a device error): its state is
    /// unknown, so the actor ends and the supervisor rebuilds it.
    fn step(&mut self) -> Result<(), BackendError> {
        if self.prefix_cache {
            // Asked again every step until the prompt's first chunk is fed, so a prompt waiting
            // behind others finds the blocks their steps have just filled.
            for r in self.running.iter_mut().filter(|r| r.fed == 0) {
                let n = self.backend.reuse_prefix(r.id, &r.tokens[..r.prompt_len]);
                if n > 0 {
                    r.fed = n.min(r.prompt_len - 1);
                    self.status.prefix_tokens_reused += r.fed as u64;
                }
            }
        }
        let views: Vec<RunView> = self
            .running
            .iter()
            .map(|r| RunView {
                pending: r.tokens.len() - r.fed,
                decoding: r.fed >= r.prompt_len,
            })
            .collect();
        let plan = scheduler::plan_step(&self.sched, &views);
        if plan.is_empty() {
            return Ok(());
        }
        let mut batch = StepBatch {
            chunks: Vec::with_capacity(plan.len()),
        };
        for &(i, n) in &plan {
            let r = &self.running[i];
            let end = r.fed + n;
            let prefill = r.fed < r.prompt_len;
            batch.chunks.push(SeqChunk {
                seq: r.id,
                tokens: r.tokens[r.fed..end].to_vec(),
                start_pos: r.fed,
                want: if end == r.tokens.len() {
                    Want::Last
                } else {
                    Want::None
                },
                prompt_len: prefill.then_some(r.prompt_len),
            });
        }
        // Every sampled row greedy without penalties: the backend picks the tokens itself (on
        // its device, where it has one) and no logits come back.
        let greedy = self.device_pick
            && plan
                .iter()
                .zip(&batch.chunks)
                .all(|(&(i, _), c)| c.want != Want::Last || self.running[i].sampler.plain_greedy());
        // Greedy decode of every running sequence with nobody waiting: several steps at once,
        // each feeding the last one's picks ([`Backend::decode_greedy`]), no more than any of
        // them may still generate or its context holds.
        let chain = if greedy
            && self.decode_chain > 1
            && self.backend.pipelines_decode()
            && self.waiting.is_empty()
            && plan.len() == self.running.len()
            && batch
                .chunks
                .iter()
                .all(|c| c.tokens.len() == 1 && c.want == Want::Last && c.prompt_len.is_none())
        {
            plan.iter()
                .map(|&(i, _)| {
                    let r = &self.running[i];
                    let room = self.ctx.saturating_sub(r.fed);
                    r.max_new.saturating_sub(r.generated).min(room)
                })
                .min()
                .unwrap_or(1)
                .clamp(1, self.decode_chain)
        } else {
            1
        };
        // Every sampled row reads only its k best logits (top-k without penalties), on a
        // backend that selects them on its device: those come back instead of the rows.
        let most = self.backend.device_top_k();
        let top_k = if !greedy && self.device_pick && most > 0 {
            let n_vocab = self.tok.vocab_size();
            plan.iter()
                .zip(&batch.chunks)
                .filter(|(_, c)| c.want == Want::Last)
                .map(|(&(i, _), _)| {
                    self.running[i]
                        .sampler
                        .top_k_only()
                        .filter(|&k| k < n_vocab && k <= most)
                })
                .try_fold(0usize, |m, k| k.map(|k| m.max(k)))
                .filter(|&k| k > 0)
        } else {
            None
        };
        let result = catch_unwind(AssertUnwindSafe(|| {
            if chain > 1 {
                self.backend.decode_greedy(&batch, chain).map(Picked::Chain)
            } else if greedy {
                self.backend.step_argmax(&batch).map(Picked::Ids)
            } else if let Some(k) = top_k {
                self.backend.step_top_k(&batch, k).map(Picked::TopK)
            } else {
                self.backend.step(&batch).map(Picked::Logits)
            }
        }));
        self.status.steps += chain as u64;
        let out = match result {
            Ok(Ok(out)) => out,
            Ok(Err(e @ BackendError::Device { .. })) => {
                self.status.consecutive_failures += 1;
                return Err(e);
            }
            Ok(Err(e)) => {
                // An error about this batch (not the device): fail its sequences, keep serving.
                self.status.consecutive_failures += 1;
                tracing::warn!(backend = %self.name, error = %e, "step failed");
                let failed: Vec<usize> = plan.iter().map(|p| p.0).collect();
                self.fail(&failed, |name| RuntimeError::Backend {
                    backend: name.to_string(),
                    source: e.clone(),
                });
                return Ok(());
            }
            Err(p) => {
                self.status.consecutive_failures += 1;
                return Err(BackendError::Device {
                    backend: self.name.clone(),
                    msg: format!("panicked in step: {}", panic_text(&p)),
                });
            }
        };
        let want_rows = batch.chunks.iter().filter(|c| c.want == Want::Last).count();
        let got_rows = match &out {
            Picked::Logits(o) => o.n_rows(),
            Picked::Ids(ids) => ids.len(),
            Picked::TopK(rows) => rows.len(),
            Picked::Chain(steps) if steps.len() == chain => {
                steps.iter().map(Vec::len).min().unwrap_or(0)
            }
            Picked::Chain(_) => usize::MAX,
        };
        if got_rows != want_rows {
            self.status.consecutive_failures += 1;
            let what = match &out {
                Picked::Logits(_) => "logit rows",
                Picked::Ids(_) => "greedy picks",
                Picked::TopK(_) => "top-k lists",
                Picked::Chain(_) => "greedy picks per chained step",
            };
            let msg = format!("step returned {got_rows} {what}, expected {want_rows}");
            let failed: Vec<usize> = plan.iter().map(|p| p.0).collect();
            self.fail(&failed, |name| RuntimeError::Backend {
                backend: name.to_string(),
                source: BackendError::Device {
                    backend: name.to_string(),
                    msg: msg.clone(),
                },
            });
            return Ok(());
        }
        self.status.consecutive_failures = 0;
        // The sequences given a row of logits, in row order.
        let mut sampled: Vec<usize> = Vec::with_capacity(want_rows);
        for (k, &(i, n)) in plan.iter().enumerate() {
            self.running[i].fed += n;
            if batch.chunks[k].want == Want::Last {
                sampled.push(i);
            }
        }
        let (steps, logits) = match out {
            Picked::Logits(mut o) => {
                let ids = sample_rows(&mut self.running, &sampled, &mut o.logits, o.n_vocab);
                (vec![ids], Some(o.logits))
            }
            Picked::Ids(ids) => (vec![ids.into_iter().map(Some).collect()], None),
            Picked::TopK(rows) => {
                let ids = sampled
                    .iter()
                    .zip(&rows)
                    .map(|(&i, best)| Some(self.running[i].sampler.sample_top_k(best)))
                    .collect();
                (vec![ids], None)
            }
            Picked::Chain(steps) => (
                steps
                    .into_iter()
                    .map(|ids| ids.into_iter().map(Some).collect())
                    .collect(),
                None,
            ),
        };
        let mut finished: Vec<(usize, Option<FinishReason>)> = Vec::new();
        for (k, ids) in steps.into_iter().enumerate() {
            for (&i, id) in sampled.iter().zip(ids) {
                let Some(id) = id else {
                    continue;
                };
                // A chained step's picks past a sequence's end are dropped (its KV rows go
                // with the sequence).
                if finished.iter().any(|f| f.0 == i) {
                    continue;
                }
                let r = &mut self.running[i];
                if k > 0 {
                    // Step k fed the pick of step k - 1.
                    r.fed += 1;
                }
                if let Some(reason) = send_token(r, id, self.tok) {
                    finished.push((i, Some(reason)));
                } else if r.events.is_closed() {
                    finished.push((i, None));
                }
                self.status.tokens_generated += 1;
            }
        }
        if let Some(l) = logits {
            self.backend.recycle(l);
        }
        // Remove from the back so indices stay valid.
        finished.sort_by_key(|f| std::cmp::Reverse(f.0));
        for (i, reason) in finished {
            let mut r = self.running.remove(i);
            self.backend.release(r.id);
            if let Some(reason) = reason {
                let s = self.summary(&mut r, reason);
                let _ = r.events.send(TokenEvent::Done(s));
            }
        }
        Ok(())
    }

    /// End the running sequences at `idx` with an error, releasing their KV blocks.
    fn fail(&mut self, idx: &[usize], err: impl Fn(&str) -> RuntimeError) {
        let mut idx = idx.to_vec();
        idx.sort_unstable_by(|a, b| b.cmp(a));
        idx.dedup();
        for i in idx {
            if i >= self.running.len() {
                continue;
            }
            let r = self.running.remove(i);
            self.backend.release(r.id);
            let _ = r.events.send(TokenEvent::Error(err(&self.name)));
        }
    }

    fn summary(&self, r: &mut Running<'_>, finish_reason: FinishReason) -> Summary {
        let first = r.first_token.unwrap_or(r.last_token);
        Summary {
            usage: Usage {
                prompt_tokens: r.prompt_len,
                completion_tokens: r.generated,
            },
            timings: Timings {
                queue_wait: r.admitted.saturating_duration_since(r.submitted),
                time_to_first_token: first.saturating_duration_since(r.submitted),
                prompt_time: first.saturating_duration_since(r.admitted),
                generation_time: r.last_token.saturating_duration_since(first),
            },
            backend: self.name.clone(),
            route_reason: r.route_reason.clone(),
            finish_reason,
            seed: r.sampler.seed(),
        }
    }
}

/// Rows of a step at least this many are sampled on several threads.
const PARALLEL_SAMPLE_ROWS: usize = 8;

/// Sample the next token of `running[seqs[j]]` from row `j` of `logits` (`n_vocab` values
/// each), for every `j`; `None` where the row is missing. Each sequence has its own sampler
/// and random stream, so the rows are independent and the tokens do not depend on how they
/// are shared out: with many rows (a batched decode step: 64 rows of a 49k vocabulary are a
/// few milliseconds of work, during which the backend's threads would wait) they are split
/// over up to `available_parallelism` threads, in contiguous runs.
fn sample_rows(
    running: &mut [Running<'_>],
    seqs: &[usize],
    logits: &mut [f32],
    n_vocab: usize,
) -> Vec<Option<u32>> {
    let mut ids = vec![None; seqs.len()];
    // Position in `seqs` of each running sequence given a row (a sequence has one chunk per
    // step, so at most one row).
    let mut slot = vec![usize::MAX; running.len()];
    for (j, &i) in seqs.iter().enumerate() {
        if let Some(s) = slot.get_mut(i) {
            *s = j;
        }
    }
    let mut rows: Vec<Option<&mut [f32]>> = (0..seqs.len()).map(|_| None).collect();
    for (j, row) in logits.chunks_exact_mut(n_vocab.max(1)).enumerate() {
        if let Some(r) = rows.get_mut(j) {
            *r = Some(row);
        }
    }
    type Job<'a> = (
        &'a mut Sampler,
        &'a [u32],
        &'a mut [f32],
        &'a mut Option<u32>,
    );
    let mut jobs: Vec<Job<'_>> = Vec::with_capacity(seqs.len());
    let mut id_slots: Vec<Option<&mut Option<u32>>> = ids.iter_mut().map(Some).collect();
    for (i, r) in running.iter_mut().enumerate() {
        let Some(&j) = slot.get(i).filter(|&&j| j != usize::MAX) else {
            continue;
        };
        let (Some(row), Some(out)) = (
            rows.get_mut(j).and_then(Option::take),
            id_slots.get_mut(j).and_then(Option::take),
        ) else {
            continue;
        };
        if n_vocab == 0 {
            continue;
        }
        jobs.push((&mut r.sampler, &r.tokens, row, out));
    }
    let run = |part: &mut [Job<'_>]| {
        for (sampler, history, row, out) in part.iter_mut() {
            **out = Some(sampler.sample(row, history));
        }
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let parts = threads
        .min(jobs.len() / (PARALLEL_SAMPLE_ROWS / 2).max(1))
        .max(1);
    if parts <= 1 || jobs.len() < PARALLEL_SAMPLE_ROWS {
        run(&mut jobs);
        return ids;
    }
    let per = jobs.len().div_ceil(parts);
    std::thread::scope(|sc| {
        let mut chunks = jobs.chunks_mut(per);
        let mine = chunks.next();
        for part in chunks {
            let spawned = std::thread::Builder::new()
                .name("sampler".into())
                .spawn_scoped(sc, || run(part));
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "sampling thread did not start");
            }
        }
        if let Some(part) = mine {
            run(part);
        }
    });
    // The part of a thread that could not start is sampled here.
    for (sampler, history, row, out) in jobs.iter_mut().filter(|j| j.3.is_none()) {
        **out = Some(sampler.sample(row, history));
    }
    ids
}

/// What a step gave back: logits rows for the host's samplers, or the backend's own greedy
/// picks ([`Backend::step_argmax`]).
enum Picked {
    Logits(StepOutput),
    Ids(Vec<u32>),
    /// [`Backend::step_top_k`]'s lists, one per sampled row.
    TopK(Vec<Vec<(u32, f32)>>),
    /// [`Backend::decode_greedy`]'s picks, step after step.
    Chain(Vec<Vec<u32>>),
}

/// Record token `id` of `r`, send its event, and say whether the sequence is finished.
fn send_token(r: &mut Running<'_>, id: u32, tok: &Tokenizer) -> Option<FinishReason> {
    let now = Instant::now();
    r.first_token.get_or_insert(now);
    r.last_token = now;
    r.generated += 1;
    let mut finish = None;
    let text = if !r.sampler.params().ignore_eos && tok.is_eog(id) {
        finish = Some(FinishReason::Stop);
        flush(r, &mut finish)
    } else {
        let piece = match r.decoder.push(id) {
            Ok(p) => p,
            Err(e) => {
                // An id past the tokenizer's vocabulary (a padded output layer): no text.
                tracing::warn!(id, error = %e, "sampled a token without text");
                String::new()
            }
        };
        let o = r.stop.push(&piece);
        if o.stopped {
            finish = Some(FinishReason::Stop);
            o.text
        } else if r.generated >= r.max_new {
            finish = Some(FinishReason::Length);
            let mut t = o.text;
            t.push_str(&flush(r, &mut finish));
            t
        } else {
            r.tokens.push(id);
            o.text
        }
    };
    if r.events.send(TokenEvent::Token { id, text }).is_err() {
        return None;
    }
    finish
}

/// Release held-back text at the end of generation; a stop string completed by the flushed
/// bytes still counts.
fn flush(r: &mut Running<'_>, finish: &mut Option<FinishReason>) -> String {
    let tail = r.decoder.finish();
    let o = r.stop.push(&tail);
    if o.stopped {
        *finish = Some(FinishReason::Stop);
        return o.text;
    }
    let mut t = o.text;
    t.push_str(&r.stop.finish());
    t
}

fn cancelled_summary(sub: &Submission, name: &str, seed: u64) -> Summary {
    let waited = sub.submitted.elapsed();
    Summary {
        usage: Usage {
            prompt_tokens: sub.req.prompt.len(),
            completion_tokens: 0,
        },
        timings: Timings {
            queue_wait: waited,
            ..Default::default()
        },
        backend: name.to_string(),
        route_reason: sub.route_reason.clone(),
        finish_reason: FinishReason::Cancelled,
        seed,
    }
}
