//! The caller's say in scheduling (issue 4): a request's `priority` orders the admission queue,
//! and a request may name the backend to serve it (`x-crossover-backend`), honoured when that
//! backend is eligible. Real CPU backend, real default model.

mod common;

use std::time::{Duration, Instant};

use common::*;
use runtime::fault::{Fault, FaultSwitch};
use runtime::{
    Coordinator, GenerateRequest, Phase, Priority, RestartPolicy, RoutingPolicy, RuntimeError,
    SamplingParams, Summary, TokenEvent, TokenStream,
};

fn greedy(max: usize) -> SamplingParams {
    SamplingParams {
        max_tokens: Some(max),
        ..SamplingParams::greedy()
    }
}

/// Drain a stream: (token ids, summary, when it ended).
fn drain(st: TokenStream) -> (Vec<u32>, Summary, Instant) {
    let mut ids = Vec::new();
    for ev in st.into_blocking() {
        match ev {
            TokenEvent::Token { id, .. } => ids.push(id),
            TokenEvent::Done(s) => return (ids, s, Instant::now()),
            TokenEvent::Error(e) => panic!("stream failed: {e}"),
        }
    }
    panic!("stream ended without a final event")
}

/// (priority, prompt, generated ids, summary, when it ended).
type Finished = (Priority, Vec<u32>, Vec<u32>, Summary, Instant);

#[test]
fn higher_priority_requests_are_admitted_before_waiting_lower_ones() {
    let (file, tok) = open();
    let h = cpu_actor(
        &file,
        &tok,
        Cpu {
            max_seqs: 1,
            ..Cpu::default()
        },
    );
    let coord = Coordinator::new(vec![h], RoutingPolicy::default()).unwrap();
    // One sequence at a time: this one holds the slot while the others queue.
    let mut holder = coord
        .submit(GenerateRequest::new(
            chat_prompt(&tok, "Tell me a story."),
            SamplingParams {
                ignore_eos: true,
                ..greedy(24)
            },
        ))
        .unwrap()
        .into_blocking();
    assert!(matches!(holder.next(), Some(TokenEvent::Token { .. })));
    // Arrival order low, normal, high, normal; admission order must be high, normal, normal, low.
    let arrivals = [
        (Priority::Low, "Name three colors."),
        (Priority::Normal, "What is the capital of France?"),
        (Priority::High, "Which planet is the largest?"),
        (Priority::Normal, "Name a large animal."),
    ];
    let n = 3;
    let streams: Vec<(Priority, Vec<u32>, TokenStream)> = arrivals
        .iter()
        .map(|&(p, q)| {
            let prompt = chat_prompt(&tok, q);
            let mut req = GenerateRequest::new(prompt.clone(), greedy(n));
            req.hints.priority = p;
            (p, prompt, coord.submit(req).unwrap())
        })
        .collect();
    let done: Vec<Finished> = std::thread::scope(|s| {
        let hs: Vec<_> = streams
            .into_iter()
            .map(|(p, prompt, st)| {
                s.spawn(move || {
                    let (ids, sum, t) = drain(st);
                    (p, prompt, ids, sum, t)
                })
            })
            .collect();
        for _ in holder.by_ref() {}
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut order: Vec<usize> = (0..done.len()).collect();
    order.sort_by_key(|&i| done[i].4);
    assert_eq!(order, [2, 1, 3, 0], "completion order by arrival index");
    // Queue waits follow the same order: each waited for the ones admitted before it.
    for w in order.windows(2) {
        assert!(
            done[w[0]].3.timings.queue_wait < done[w[1]].3.timings.queue_wait,
            "{:?} waited longer than {:?}",
            done[w[0]].0,
            done[w[1]].0
        );
    }
    for (_, prompt, ids, sum, _) in &done {
        assert_eq!(ids, &direct_greedy(&file, prompt, n, &|t| tok.is_eog(t)));
        assert_eq!(sum.usage.completion_tokens, ids.len());
    }
}

#[test]
fn a_named_backend_serves_when_eligible_and_is_routed_around_when_not() {
    let (file, tok) = open();
    let sw = FaultSwitch::default();
    let a = cpu_actor(&file, &tok, Cpu::default());
    let b = cpu_actor(
        &file,
        &tok,
        Cpu {
            name: "cpu-b",
            fault: Some(sw.clone()),
            restart: RestartPolicy {
                max_restarts: 0,
                ..RestartPolicy::default()
            },
            ..Cpu::default()
        },
    );
    let policy = RoutingPolicy::from_toml(r#"default = ["cpu", "cpu-b"]"#, "test").unwrap();
    let coord = Coordinator::new(vec![a, b.clone()], policy).unwrap();
    let prompt = tok.encode("The capital of France is", true, false).unwrap();
    let want = direct_greedy(&file, &prompt, 4, &|t| tok.is_eog(t));

    // Library: named and eligible.
    let (ids, s, _) = drain(
        coord
            .submit_to(
                GenerateRequest::new(prompt.clone(), greedy(4)),
                Some("cpu-b"),
            )
            .unwrap(),
    );
    assert_eq!(
        (s.backend.as_str(), ids.as_slice()),
        ("cpu-b", want.as_slice())
    );
    assert_eq!(s.route_reason, "requested: the caller named cpu-b");
    // Unknown: a request error listing what there is.
    match coord.submit_to(
        GenerateRequest::new(prompt.clone(), greedy(4)),
        Some("cuda:9"),
    ) {
        Err(e @ RuntimeError::UnknownBackend { .. }) => {
            assert!(e.is_request_error());
            assert!(e.to_string().contains("cpu, cpu-b"), "{e}");
        }
        other => panic!("{:?}", other.map(|s| s.backend().to_string())),
    }

    // Over HTTP: the header chooses, the response headers say so; unknown is a 400.
    let srv = TestServer::start(coord.clone(), tok.clone(), server::ServerConfig::default());
    let body = serde_json::json!({
        "model": "default", "prompt": "The capital of France is", "max_tokens": 4,
        "temperature": 0
    })
    .to_string();
    let r = http_with(
        &srv.addr,
        "POST",
        "/v1/completions",
        &["x-crossover-backend: cpu-b"],
        &body,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-crossover-backend").as_deref(), Some("cpu-b"));
    assert_eq!(
        r.header("x-crossover-route-reason").as_deref(),
        Some("requested: the caller named cpu-b")
    );
    let r = http_with(&srv.addr, "POST", "/v1/completions", &[], &body);
    assert_eq!(r.header("x-crossover-backend").as_deref(), Some("cpu"));
    let r = http_with(
        &srv.addr,
        "POST",
        "/v1/completions",
        &["x-crossover-backend: cuda:9"],
        &body,
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("cuda:9"), "{}", r.body);

    // cpu-b crashes and, with no restarts allowed, is failed: a request naming it is served by
    // cpu, and the reason says why.
    sw.fail_step_in(1, Fault::Panic);
    let _ = coord
        .submit_to(
            GenerateRequest::new(prompt.clone(), greedy(4)),
            Some("cpu-b"),
        )
        .map(drain);
    let t0 = Instant::now();
    while b.status().phase != Phase::Failed {
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", b.status());
        std::thread::sleep(Duration::from_millis(10));
    }
    let r = http_with(
        &srv.addr,
        "POST",
        "/v1/completions",
        &["x-crossover-backend: cpu-b"],
        &body,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-crossover-backend").as_deref(), Some("cpu"));
    let reason = r.header("x-crossover-route-reason").unwrap_or_default();
    assert!(
        reason.starts_with("requested cpu-b is not eligible (unhealthy); "),
        "{reason}"
    );
}
