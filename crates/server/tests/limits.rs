//! Every server limit hit over real HTTP, with the status docs/operations.md promises: request
//! head size (431), body size (413), a trickled body (408, and the connection slot comes back),
//! head/idle timeout (closed), request timeout (504 or a stream error event, KV freed),
//! connection cap (503), per-backend queue cap (429), per-request context cap (400 / length);
//! and the security defaults: internal errors answer with a generic message and the request id
//! (details only in the log), the exposure warning, the API key check.

mod harness;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harness::*;
use server::ServerConfig;

fn cfg() -> ServerConfig {
    ServerConfig::default()
}

#[test]
fn oversized_request_head_gets_431() {
    let s = Server::start(
        ServerConfig {
            max_header_bytes: 4096,
            ..cfg()
        },
        Actor::default(),
    );
    let head = |n: usize| {
        format!(
            "GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Pad: {}\r\nConnection: close\r\n\r\n",
            "a".repeat(n)
        )
    };
    assert_eq!(exchange(s.addr, head(2000).as_bytes()).status, 200);
    assert_eq!(exchange(s.addr, head(6000).as_bytes()).status, 431);
}

#[test]
fn oversized_body_gets_413() {
    let s = Server::start(
        ServerConfig {
            max_body_bytes: 1024,
            ..cfg()
        },
        Actor::default(),
    );
    // Declared too large: refused before reading.
    let r = post(s.addr, "/v1/chat/completions", &[b' '; 2000]);
    let v = r.assert_openai_error(413);
    assert_eq!(v["error"]["code"], "body_too_large");
    // Chunked, no length given: refused once it grows past the limit.
    let mut raw = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\
         Connection: close\r\n\r\n"
        .to_vec();
    for _ in 0..3 {
        raw.extend_from_slice(format!("258\r\n{}\r\n", " ".repeat(600)).as_bytes());
    }
    raw.extend_from_slice(b"0\r\n\r\n");
    exchange(s.addr, &raw).assert_openai_error(413);
    // Just under the limit is parsed (and is bad JSON here: 400).
    post(s.addr, "/v1/completions", &[b'{'; 1000]).assert_openai_error(400);
}

#[test]
fn a_trickled_body_times_out_and_frees_the_connection_slot() {
    let s = Server::start(
        ServerConfig {
            body_timeout: Duration::from_millis(800),
            max_connections: 1,
            ..cfg()
        },
        Actor::default(),
    );
    let mut slow = TcpStream::connect(s.addr).unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    slow.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\
          Connection: close\r\n\r\n{\"model\":",
    )
    .unwrap();
    let t0 = Instant::now();
    // While it holds the only slot, another connection is refused.
    std::thread::sleep(Duration::from_millis(200));
    let v = get(s.addr, "/v1/models").assert_openai_error(503);
    assert_eq!(v["error"]["code"], "too_many_connections");
    // One more byte now and then does not extend the deadline.
    slow.write_all(b" ").unwrap();
    let mut buf = Vec::new();
    let _ = slow.read_to_end(&mut buf);
    let dt = t0.elapsed();
    let r = parse_response(&buf).expect("a response");
    let v = r.assert_openai_error(408);
    assert_eq!(v["error"]["code"], "body_timeout");
    assert!(dt < Duration::from_secs(5), "took {dt:?}");
    // The slot is free again.
    let mut ok = false;
    for _ in 0..40 {
        if get(s.addr, "/v1/models").status == 200 {
            ok = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(ok, "the slot did not come back");
}

#[test]
fn a_slow_or_idle_head_gets_the_connection_closed() {
    let s = Server::start(
        ServerConfig {
            header_timeout: Duration::from_millis(700),
            ..cfg()
        },
        Actor::default(),
    );
    for first in [
        &b"POST /v1/chat/completions HTTP/1.1\r\nHost:"[..],
        &b""[..],
    ] {
        let mut c = TcpStream::connect(s.addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(first).unwrap();
        let t0 = Instant::now();
        let mut buf = Vec::new();
        let _ = c.read_to_end(&mut buf);
        let dt = t0.elapsed();
        assert!(
            dt >= Duration::from_millis(500) && dt < Duration::from_secs(5),
            "closed after {dt:?}"
        );
    }
    // A kept-alive connection idle after its response is closed too.
    let mut c = TcpStream::connect(s.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let t0 = Instant::now();
    let mut buf = Vec::new();
    let _ = c.read_to_end(&mut buf);
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert_eq!(parse_response(&buf).unwrap().status, 200);
}

#[test]
fn the_request_timeout_cancels_generation() {
    let s = Server::start(
        ServerConfig {
            request_timeout: Duration::from_millis(1500),
            ..cfg()
        },
        Actor::default(),
    );
    // About 480 tokens on one thread: far longer than the limit.
    let long = r#""max_tokens":100000,"ignore_eos":true,"temperature":0"#;
    let t0 = Instant::now();
    let r = post(
        s.addr,
        "/v1/chat/completions",
        chat_body("Count.", long).as_bytes(),
    );
    let v = r.assert_openai_error(504);
    assert_eq!(v["error"]["code"], "request_timeout");
    assert!(t0.elapsed() < Duration::from_secs(10));
    assert_eq!(s.kv_used_settled(), 0, "KV blocks of the timed-out request");

    let stream = format!("{long},\"stream\":true");
    let r = post(
        s.addr,
        "/v1/chat/completions",
        chat_body("Count.", &stream).as_bytes(),
    );
    if r.status == 200 {
        // The stream started: it ends with the error event and no [DONE].
        let text = r.text();
        let last = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .next_back()
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(last).unwrap();
        assert_eq!(v["error"]["code"], "request_timeout", "{text}");
    } else {
        // A slow machine may not have produced the first token in time.
        r.assert_openai_error(504);
    }
    assert_eq!(s.kv_used_settled(), 0, "KV blocks of the timed-out stream");
}

#[test]
fn the_connection_cap_refuses_with_503() {
    let s = Server::start(
        ServerConfig {
            max_connections: 2,
            ..cfg()
        },
        Actor::default(),
    );
    let a = TcpStream::connect(s.addr).unwrap();
    let b = TcpStream::connect(s.addr).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let r = get(s.addr, "/health");
    let v = r.assert_openai_error(503);
    assert_eq!(v["error"]["code"], "too_many_connections");
    assert_eq!(r.header("retry-after"), Some("1"));
    drop((a, b));
    let mut ok = false;
    for _ in 0..40 {
        if get(s.addr, "/v1/models").status == 200 {
            ok = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(ok, "closed connections did not free their slots");
}

#[test]
fn the_backend_queue_cap_refuses_with_429() {
    // Two sequences run, one request may wait, the fourth is refused at once.
    let s = Server::start(
        cfg(),
        Actor {
            max_seqs: 2,
            max_waiting: 1,
            ..Actor::default()
        },
    );
    let addr = s.addr;
    let backend = s.coord.backends()[0].clone();
    let wait_for = |what: &str, f: &dyn Fn(usize, usize) -> bool| {
        let t0 = Instant::now();
        loop {
            let st = backend.status();
            if f(st.running, st.waiting) {
                return;
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "never {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    // Different lengths, so a slot frees while the other sequence still runs. Each request is
    // sent once the previous one is in place: two running, then one waiting.
    let lengths = [80, 40, 20, 20];
    let mut handles = Vec::new();
    for (i, &n) in lengths.iter().enumerate() {
        match i {
            1 => wait_for("one running", &|r, _| r == 1),
            2 => wait_for("two running", &|r, _| r == 2),
            3 => wait_for("one waiting", &|r, w| r == 2 && w == 1),
            _ => {}
        }
        let body = chat_body(
            "Tell a story.",
            &format!(r#""max_tokens":{n},"ignore_eos":true,"temperature":0"#),
        );
        handles.push(std::thread::spawn(move || {
            let t0 = Instant::now();
            let r = post(addr, "/v1/chat/completions", body.as_bytes());
            (r, t0.elapsed())
        }));
    }
    let rs: Vec<(Resp, Duration)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let statuses: Vec<u16> = rs.iter().map(|(r, _)| r.status).collect();
    assert_eq!(statuses, [200, 200, 200, 429]);
    let (refused, dt) = &rs[3];
    let v = refused.assert_openai_error(429);
    assert_eq!(v["error"]["code"], "overloaded");
    assert!(refused.header("retry-after").is_some());
    // Refused for the queue, not after waiting out the admission timeout.
    assert!(*dt < Duration::from_secs(10), "refused after {dt:?}");
    for ((r, _), n) in rs.iter().zip(lengths).take(3) {
        assert_eq!(r.json()["usage"]["completion_tokens"], n);
    }
    assert_eq!(s.kv_used_settled(), 0);
}

#[test]
fn the_per_request_context_cap() {
    let s = Server::start(
        ServerConfig {
            max_context: Some(64),
            ..cfg()
        },
        Actor::default(),
    );
    let long = "word ".repeat(80);
    let r = post(
        s.addr,
        "/v1/chat/completions",
        chat_body(&long, "").as_bytes(),
    );
    let v = r.assert_openai_error(400);
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    assert_eq!(v["error"]["param"], "messages");
    let r = post(
        s.addr,
        "/v1/completions",
        format!(r#"{{"model":"{MODEL}","prompt":"{long}"}}"#).as_bytes(),
    );
    assert_eq!(r.assert_openai_error(400)["error"]["param"], "prompt");
    // A short prompt asking for far more tokens stops at the cap.
    let r = post(
        s.addr,
        "/v1/chat/completions",
        chat_body("Hi", r#""max_tokens":100000,"ignore_eos":true"#).as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let u = &v["usage"];
    assert_eq!(
        u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap(),
        64
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length");
}

/// Log lines of this test binary (a global subscriber writing to memory).
fn logs() -> Arc<Mutex<Vec<u8>>> {
    static LOGS: std::sync::OnceLock<Arc<Mutex<Vec<u8>>>> = std::sync::OnceLock::new();
    LOGS.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let w = buf.clone();
        let make = move || Sink(w.clone());
        let sub = tracing_subscriber::fmt()
            .with_writer(make)
            .with_ansi(false)
            .finish();
        tracing::subscriber::set_global_default(sub).expect("first subscriber");
        buf
    })
    .clone()
}

struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn internal_errors_answer_generically_with_the_request_id() {
    let logs = logs();
    let s = Server::start(
        cfg(),
        Actor {
            fault: true,
            ..Actor::default()
        },
    );
    let r = post(
        s.addr,
        "/v1/chat/completions",
        chat_body("Hi", r#""max_tokens":4"#).as_bytes(),
    );
    let v = r.assert_openai_error(500);
    let id = r
        .header("x-request-id")
        .expect("request id header")
        .to_string();
    let msg = v["error"]["message"].as_str().unwrap();
    assert_eq!(msg, format!("internal server error (request id {id})"));
    assert_eq!(v["error"]["type"], "server_error");
    // The details are in the log under that id, not in the response.
    let log = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
    let line = log
        .lines()
        .find(|l| l.contains(&id) && l.contains("injected fault"))
        .unwrap_or_else(|| panic!("no log line with {id}:\n{log}"));
    assert!(line.contains("ERROR"), "{line}");
    assert!(!r.text().contains("injected"));
}

#[test]
fn every_response_has_a_request_id_and_models_come_from_start_only() {
    let s = Server::start(cfg(), Actor::default());
    let r = get(s.addr, "/v1/models");
    assert!(r
        .header("x-request-id")
        .is_some_and(|v| v.starts_with("req-")));
    // A path in `model` is a name that does not match: 404, nothing is opened.
    let body = r#"{"model":"/etc/passwd","messages":[{"role":"user","content":"x"}]}"#;
    let v = post(s.addr, "/v1/chat/completions", body.as_bytes()).assert_openai_error(404);
    assert_eq!(v["error"]["code"], "model_not_found");
}

#[test]
fn exposure_warning_only_for_public_addresses_without_a_key() {
    let w = |a: &str, key| server::exposure_warning(&a.parse().unwrap(), key);
    assert!(w("127.0.0.1:8080", false).is_none());
    assert!(w("[::1]:8080", false).is_none());
    assert!(w("0.0.0.0:8080", true).is_none());
    let msg = w("0.0.0.0:8080", false).expect("warning");
    assert!(
        msg.contains("0.0.0.0:8080") && msg.contains("--api-key"),
        "{msg}"
    );
    assert!(w("192.168.1.10:80", false).is_some());
    assert!(w("[::]:80", false).is_some());
}

#[test]
fn api_key_is_required_and_compared_whole() {
    let s = Server::start(
        ServerConfig {
            api_key: Some("secret-key-1".into()),
            ..cfg()
        },
        Actor::default(),
    );
    let with = |auth: &str| {
        exchange(
            s.addr,
            format!("GET /v1/models HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n")
                .as_bytes(),
        )
    };
    assert_eq!(with("Authorization: Bearer secret-key-1\r\n").status, 200);
    for bad in [
        "",
        "Authorization: Bearer secret-key-\r\n",
        "Authorization: Bearer secret-key-12\r\n",
        "Authorization: Bearer secret-key-2\r\n",
        "Authorization: Bearer \r\n",
        "Authorization: secret-key-1\r\n",
    ] {
        let v = with(bad).assert_openai_error(401);
        assert_eq!(v["error"]["code"], "invalid_api_key", "{bad}");
    }
    // /health stays open.
    assert_eq!(with("").status, 401);
    assert_ne!(get(s.addr, "/health").status, 401);
}
