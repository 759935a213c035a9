//! Fault isolation and supervision (issue 7, item 1) on the real CPU backend with the real default
//! model: faults are planned inside the real `CpuBackend` (`from_file_with_faults`), not in a
//! mock. Every request's outcome is checked: an error event naming the backend for streams that
//! had tokens, the exact greedy tokens of a solo run (no loss, no duplicate) on the other backend
//! for those that had none; the backend restarts and serves again, or, when the fault repeats,
//! exhausts its attempts and is marked failed while the other backend keeps serving.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use runtime::fault::{Fault, FaultSwitch};
use runtime::{
    BackendHandle, Coordinator, GenerateRequest, Phase, RestartPolicy, RoutingPolicy, RuntimeError,
    SamplingParams, Summary, TokenEvent, TokenStream,
};
use tokenizer::Tokenizer;

#[derive(Debug)]
struct Outcome {
    ids: Vec<u32>,
    summary: Option<Summary>,
    error: Option<RuntimeError>,
    /// Events after the terminal one (must be none).
    after_end: usize,
}

fn finish(mut it: runtime::BlockingTokenStream, mut ids: Vec<u32>) -> Outcome {
    let mut o = Outcome {
        ids: Vec::new(),
        summary: None,
        error: None,
        after_end: 0,
    };
    for ev in it.by_ref() {
        if o.summary.is_some() || o.error.is_some() {
            o.after_end += 1;
        }
        match ev {
            TokenEvent::Token { id, .. } => ids.push(id),
            TokenEvent::Done(s) => o.summary = Some(s),
            TokenEvent::Error(e) => o.error = Some(e),
        }
    }
    o.ids = ids;
    o
}

fn greedy(max: usize) -> SamplingParams {
    SamplingParams {
        max_tokens: Some(max),
        ..SamplingParams::greedy()
    }
}

fn endless(max: usize) -> SamplingParams {
    SamplingParams {
        ignore_eos: true,
        ..greedy(max)
    }
}

fn wait_until(
    what: &str,
    h: &BackendHandle,
    within: Duration,
    ok: impl Fn(&BackendHandle) -> bool,
) {
    let t0 = Instant::now();
    while !ok(h) {
        assert!(
            t0.elapsed() < within,
            "{what}: not reached within {within:?}: {:?}",
            h.status()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn quick_restarts(max_restarts: u32) -> RestartPolicy {
    RestartPolicy {
        max_restarts,
        backoff: Duration::from_millis(30),
        max_backoff: Duration::from_millis(200),
        reset_after: Duration::from_secs(600),
    }
}

/// `cpu` (faults planned on the returned switch) and `cpu-b`, everything routed to `cpu` first.
fn two_backends(
    max_restarts: u32,
) -> (
    Coordinator,
    BackendHandle,
    BackendHandle,
    FaultSwitch,
    Arc<Tokenizer>,
    Arc<gguf::GgufFile>,
) {
    let (file, tok) = open();
    let sw = FaultSwitch::default();
    let a = cpu_actor(
        &file,
        &tok,
        Cpu {
            name: "cpu",
            max_seqs: 3,
            max_batch_tokens: 64,
            prefill_chunk: 16,
            fault: Some(sw.clone()),
            restart: quick_restarts(max_restarts),
            ..Cpu::default()
        },
    );
    let b = cpu_actor(
        &file,
        &tok,
        Cpu {
            name: "cpu-b",
            max_seqs: 3,
            ..Cpu::default()
        },
    );
    let policy = RoutingPolicy::from_toml(r#"default = ["cpu", "cpu-b"]"#, "test").unwrap();
    let coord = Coordinator::new(vec![a.clone(), b.clone()], policy).unwrap();
    (coord, a, b, sw, tok, file)
}

/// Two streams mid-generation, one still prefilling a long prompt and two waiting for admission
/// when `cpu` fails in a step; then the fault's aftermath is checked end to end.
fn fault_mid_step(fault: Fault, load_panics_once: bool) {
    let (coord, a, b, sw, tok, file) = two_backends(3);
    let streaming: Vec<Vec<u32>> = ["Tell me a story.", "Count from one to one hundred."]
        .iter()
        .map(|q| chat_prompt(&tok, q))
        .collect();
    let text = "The quick brown fox jumps over the lazy dog near the river bank. ".repeat(25);
    let long = tok.encode(&text, true, false).unwrap();
    assert!(long.len() > 300 && long.len() < 450, "{}", long.len());
    let queued: Vec<Vec<u32>> = ["What is the capital of France?", "Name three colors."]
        .iter()
        .map(|q| chat_prompt(&tok, q))
        .collect();
    let n_short = 6;

    // Admission is first come, first served with 3 sequences: the two streams and the long
    // prompt run, the last two wait.
    let mut live: Vec<runtime::BlockingTokenStream> = streaming
        .iter()
        .map(|p| {
            coord
                .submit(GenerateRequest::new(p.clone(), endless(200)))
                .unwrap()
                .into_blocking()
        })
        .collect();
    let prefilling = coord
        .submit(GenerateRequest::new(long.clone(), greedy(n_short)))
        .unwrap();
    let waiting: Vec<TokenStream> = queued
        .iter()
        .map(|p| {
            coord
                .submit(GenerateRequest::new(p.clone(), greedy(n_short)))
                .unwrap()
        })
        .collect();
    // Both streams have a token out; the long prompt needs ~20 more steps of 16 tokens.
    let firsts: Vec<u32> = live
        .iter_mut()
        .map(|it| match it.next() {
            Some(TokenEvent::Token { id, .. }) => id,
            other => panic!("expected a first token, got {other:?}"),
        })
        .collect();
    if load_panics_once {
        sw.fail_load_in(1, Fault::Panic);
    }
    sw.fail_step_in(1, fault);

    let (live_out, prefill_out, wait_out) = std::thread::scope(|s| {
        let l: Vec<_> = live
            .into_iter()
            .zip(firsts)
            .map(|(it, first)| s.spawn(move || finish(it, vec![first])))
            .collect();
        let p = s.spawn(move || finish(prefilling.into_blocking(), Vec::new()));
        let w: Vec<_> = waiting
            .into_iter()
            .map(|st| s.spawn(move || finish(st.into_blocking(), Vec::new())))
            .collect();
        (
            l.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>(),
            p.join().unwrap(),
            w.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>(),
        )
    });

    // Mid-stream: an error event naming the backend, after the tokens already sent.
    for o in &live_out {
        assert_eq!(o.after_end, 0, "{o:?}");
        assert!(o.summary.is_none(), "{o:?}");
        assert!(!o.ids.is_empty() && o.ids.len() < 200, "{}", o.ids.len());
        match &o.error {
            Some(e @ RuntimeError::Backend { backend, .. }) => {
                assert_eq!(backend, "cpu");
                let msg = e.to_string();
                let want = match fault {
                    Fault::Panic => "injected panic at step",
                    _ => "injected device fault at step",
                };
                assert!(msg.contains(want), "{msg}");
            }
            other => panic!("expected a backend error, got {other:?}"),
        }
    }
    // No token yet (prefilling or waiting): moved to cpu-b, with exactly a solo run's tokens.
    let moved = std::iter::once((&long, &prefill_out)).chain(queued.iter().zip(&wait_out));
    for (prompt, o) in moved {
        assert!(o.error.is_none(), "{:?}", o.error);
        assert_eq!(o.after_end, 0);
        let s = o.summary.as_ref().expect("summary");
        assert_eq!(s.backend, "cpu-b");
        assert!(
            s.route_reason.contains("failover from cpu failed"),
            "{}",
            s.route_reason
        );
        let want = direct_greedy(&file, prompt, n_short, &|t| tok.is_eog(t));
        assert_eq!(o.ids, want);
        assert_eq!(s.usage.completion_tokens, o.ids.len());
        assert_eq!(s.usage.prompt_tokens, prompt.len());
    }

    // Restarted on a fresh thread, probed, healthy; cpu-b's blocks all came back.
    wait_until("restarted", &a, Duration::from_secs(20), |h| {
        h.status().healthy()
    });
    let st = a.status();
    assert_eq!(st.phase, Phase::Running);
    assert_eq!(st.crashes, 1);
    assert_eq!(st.restarts, if load_panics_once { 2 } else { 1 });
    assert_eq!(st.kv.blocks_used, 0);
    let last = st.last_error.unwrap_or_default();
    if load_panics_once {
        assert!(last.contains("injected panic while loading"), "{last}");
    } else {
        assert!(last.contains("injected"), "{last}");
    }
    wait_until("cpu-b idle", &b, Duration::from_secs(5), |h| {
        let s = h.status();
        s.running == 0 && s.kv.blocks_used == 0
    });

    // The restarted backend serves again: routed to it (the default), the solo run's tokens.
    let prompt = &queued[0];
    let o = finish(
        coord
            .submit(GenerateRequest::new(prompt.clone(), greedy(n_short)))
            .unwrap()
            .into_blocking(),
        Vec::new(),
    );
    assert!(o.error.is_none(), "{:?}", o.error);
    let s = o.summary.unwrap();
    assert_eq!(s.backend, "cpu");
    assert!(!s.route_reason.contains("failover"), "{}", s.route_reason);
    assert_eq!(
        o.ids,
        direct_greedy(&file, prompt, n_short, &|t| tok.is_eog(t))
    );
    assert_eq!(a.status().restarts, st.restarts, "no further restart");
}

#[test]
fn panic_mid_step_errors_streams_moves_the_rest_and_restarts() {
    fault_mid_step(Fault::Panic, false);
}

#[test]
fn device_error_mid_step_then_a_panicking_reload_is_retried() {
    fault_mid_step(Fault::Error, true);
}

#[test]
fn repeating_fault_exhausts_restarts_and_the_other_backend_keeps_serving() {
    let (coord, a, b, sw, tok, file) = two_backends(2);
    let prompt = chat_prompt(&tok, "What is the capital of France?");
    let want = direct_greedy(&file, &prompt, 5, &|t| tok.is_eog(t));
    sw.set(Fault::Panic);
    // Crashes on its first step (no token yet): moved to cpu-b.
    let o = finish(
        coord
            .submit(GenerateRequest::new(prompt.clone(), greedy(5)))
            .unwrap()
            .into_blocking(),
        Vec::new(),
    );
    assert!(o.error.is_none(), "{:?}", o.error);
    let s = o.summary.unwrap();
    assert_eq!(s.backend, "cpu-b");
    assert!(
        s.route_reason.contains("failover from cpu"),
        "{}",
        s.route_reason
    );
    assert_eq!(o.ids, want);

    // Every rebuilt backend panics in its probe step: two attempts, then failed for good.
    wait_until("failed", &a, Duration::from_secs(10), |h| {
        h.status().phase == Phase::Failed
    });
    let st = a.status();
    assert!(!st.healthy() && !st.alive);
    assert_eq!((st.crashes, st.restarts), (1, 2));
    let last = st.last_error.clone().unwrap_or_default();
    assert!(
        last.contains("probe step after restart failed") && last.contains("injected panic"),
        "{last}"
    );
    assert_eq!(st.state(), "failed");

    // The router leaves it out (no failover needed); asked directly, it refuses clearly.
    let o = finish(
        coord
            .submit(GenerateRequest::new(prompt.clone(), greedy(5)))
            .unwrap()
            .into_blocking(),
        Vec::new(),
    );
    let s = o.summary.expect("served");
    assert_eq!(s.backend, "cpu-b");
    assert!(!s.route_reason.contains("failover"), "{}", s.route_reason);
    assert_eq!(o.ids, want);
    let mut rx = a
        .submit(
            GenerateRequest::new(prompt.clone(), greedy(5)),
            "direct".into(),
        )
        .unwrap();
    match rx.blocking_recv() {
        Some(TokenEvent::Error(RuntimeError::Unavailable { backend, why })) => {
            assert_eq!(backend, "cpu");
            assert!(why.contains("failed after 2 restart attempts"), "{why}");
        }
        other => panic!("expected unavailable, got {other:?}"),
    }
    assert_eq!(a.status().restarts, 2, "no attempt after giving up");
    assert!(b.status().healthy());
}

#[test]
fn a_one_shot_factory_is_not_restarted() {
    use cpu::{CpuBackend, CpuOptions};
    let (file, tok) = open();
    let sw = FaultSwitch::default();
    let f = file.clone();
    let s2 = sw.clone();
    let factory: runtime::BackendFactory = Box::new(move || {
        let opts = CpuOptions {
            threads: Some(1),
            ctx_size: 256,
            max_seqs: 1,
            max_batch_tokens: 64,
            ..CpuOptions::default()
        };
        CpuBackend::from_file_with_faults(f, "smollm2", &opts, s2)
            .map(|b| Box::new(b) as Box<dyn runtime::Backend>)
            .map_err(|e| runtime::BackendError::Unsupported {
                backend: "cpu".into(),
                why: e.to_string(),
            })
    });
    let cfg = runtime::ActorConfig {
        name: Some("once".into()),
        restart: quick_restarts(3),
        ..runtime::ActorConfig::default()
    };
    let h = runtime::spawn(factory, tok.clone(), cfg).unwrap();
    let prompt = tok.encode("The capital of France is", true, false).unwrap();
    sw.fail_step_in(2, Fault::Panic);
    let coord = Coordinator::new(vec![h.clone()], RoutingPolicy::default()).unwrap();
    let o = finish(
        coord
            .submit(GenerateRequest::new(prompt, endless(10)))
            .unwrap()
            .into_blocking(),
        Vec::new(),
    );
    // One token (step 1), then the panic: an error, and nowhere to fail over to anyway.
    assert_eq!(o.ids.len(), 1);
    assert!(
        matches!(&o.error, Some(RuntimeError::Backend { backend, .. }) if backend == "once"),
        "{:?}",
        o.error
    );
    wait_until("failed", &h, Duration::from_secs(5), |h| {
        h.status().phase == Phase::Failed
    });
    let st = h.status();
    assert_eq!((st.crashes, st.restarts), (1, 0));
    assert!(
        st.last_error.unwrap_or_default().contains("not restarted"),
        "one-shot factory named as the reason"
    );
}

fn backend_json<'v>(health: &'v serde_json::Value, name: &str) -> &'v serde_json::Value {
    health["backends"]
        .as_array()
        .and_then(|a| a.iter().find(|b| b["name"] == name))
        .unwrap_or_else(|| panic!("no backend {name} in {health}"))
}

fn metric(text: &str, line_start: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(line_start).map(str::trim))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no metric {line_start} in\n{text}"))
}

#[test]
fn health_and_metrics_show_crashes_restarts_and_failure() {
    let (coord, a, _b, sw, tok, _file) = two_backends(2);
    let key = "sup-key";
    let cfg = server::ServerConfig {
        api_key: Some(key.into()),
        ..server::ServerConfig::default()
    };
    let srv = TestServer::start(coord, tok, cfg);
    let addr = srv.addr;
    let health = |k: Option<&str>| {
        let (code, body) = http(&addr, "GET", "/health", k, "");
        (
            code,
            serde_json::from_str::<serde_json::Value>(&body).expect("health json"),
        )
    };
    let metrics = || {
        let (code, body) = http(&addr, "GET", "/metrics", Some(key), "");
        assert_eq!(code, 200, "{body}");
        body
    };
    let complete = || {
        let body = serde_json::json!({
            "model": "default", "prompt": "The capital of France is", "max_tokens": 4,
            "temperature": 0
        });
        http(
            &addr,
            "POST",
            "/v1/completions",
            Some(key),
            &body.to_string(),
        )
    };

    let (code, h) = health(None);
    assert_eq!(code, 200);
    let c = backend_json(&h, "cpu");
    assert_eq!(
        (c["state"].as_str(), c["restarts"].as_u64()),
        (Some("healthy"), Some(0))
    );

    // A panic in a step: the request is served by cpu-b; cpu restarts once and is healthy.
    sw.fail_step_in(1, Fault::Panic);
    let (code, body) = complete();
    assert_eq!(code, 200, "{body}");
    wait_until("restarted", &a, Duration::from_secs(20), |h| {
        h.status().healthy()
    });
    let (_, h) = health(Some(key));
    let c = backend_json(&h, "cpu");
    assert_eq!(c["state"], "healthy", "{h}");
    assert_eq!(
        (c["restarts"].as_u64(), c["crashes"].as_u64()),
        (Some(1), Some(1))
    );
    assert!(
        c["last_error"]
            .as_str()
            .unwrap_or("")
            .contains("injected panic"),
        "{h}"
    );
    // Without the key, /health still answers but keeps the error text to itself.
    let (_, h) = health(None);
    assert!(backend_json(&h, "cpu").get("last_error").is_none(), "{h}");
    let m = metrics();
    assert_eq!(
        metric(&m, "crossover_backend_restarts_total{backend=\"cpu\"}"),
        1.0
    );
    assert_eq!(
        metric(&m, "crossover_backend_crashes_total{backend=\"cpu\"}"),
        1.0
    );
    assert_eq!(
        metric(&m, "crossover_backend_healthy{backend=\"cpu\"}"),
        1.0
    );
    assert_eq!(
        metric(
            &m,
            "crossover_backend_state{backend=\"cpu\",state=\"healthy\"}"
        ),
        1.0
    );
    assert!(
        m.contains("crossover_requests_total{backend=\"cpu-b\",reason=\"failover\"} 1"),
        "{m}"
    );

    // The fault repeats: one attempt (its probe panics), then failed; the server keeps serving.
    sw.set(Fault::Panic);
    let (code, body) = complete();
    assert_eq!(code, 200, "{body}");
    wait_until("failed", &a, Duration::from_secs(10), |h| {
        h.status().phase == Phase::Failed
    });
    let (code, h) = health(Some(key));
    assert_eq!(code, 200, "cpu-b still serves: {h}");
    assert_eq!(h["status"], "ok");
    let c = backend_json(&h, "cpu");
    assert_eq!(c["state"], "failed", "{h}");
    assert_eq!(c["healthy"], false);
    assert_eq!(
        (c["restarts"].as_u64(), c["crashes"].as_u64()),
        (Some(2), Some(2))
    );
    assert_eq!(backend_json(&h, "cpu-b")["state"], "healthy");
    let m = metrics();
    assert_eq!(
        metric(&m, "crossover_backend_healthy{backend=\"cpu\"}"),
        0.0
    );
    assert_eq!(
        metric(&m, "crossover_backend_restarts_total{backend=\"cpu\"}"),
        2.0
    );
    assert_eq!(
        metric(
            &m,
            "crossover_backend_state{backend=\"cpu\",state=\"failed\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(
            &m,
            "crossover_backend_state{backend=\"cpu\",state=\"healthy\"}"
        ),
        0.0
    );
    let (code, body) = complete();
    assert_eq!(code, 200, "{body}");
    sw.set(Fault::Off);
    drop(srv);
}
