//! The real server over HTTP, driven by the official `openai` Python client
//! (crates/server/tests/openai_client.py): chat and completions, streaming and whole, a client that
//! disconnects mid-stream (its KV blocks come back), a prompt over the context (400), a bad API
//! key (401), an unknown model (404), bad JSON (400), metrics. The server runs in this process on
//! the real CPU backend with the default model.

mod common;

use std::process::Command;

use common::*;
use runtime::{Coordinator, RoutingPolicy};
use server::{AppState, ServerConfig};

#[test]
fn openai_python_client_against_the_real_server() {
    let ok = Command::new("python3")
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "python3 with the `openai` package is needed: pip install -r scripts/requirements-test.txt"
    );

    let (file, tok) = open();
    let ctx = 512;
    let h = cpu_actor(
        &file,
        &tok,
        Cpu {
            ctx,
            max_seqs: 4,
            threads: 2,
            ..Cpu::default()
        },
    );
    let coord = Coordinator::new(vec![h], RoutingPolicy::default()).unwrap();
    let key = "test-key-0123";
    let model = "smollm2-135m-instruct-q4_1";
    let cfg = ServerConfig {
        model_id: model.into(),
        api_key: Some(key.into()),
        ..ServerConfig::default()
    };
    let state = AppState::new(coord, tok, cfg).unwrap();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = rt.spawn(server::serve(listener, state, async {
        let _ = stop_rx.await;
    }));

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let out = Command::new("python3")
        .arg(script)
        .args([
            "--base-url",
            &format!("http://{addr}"),
            "--api-key",
            key,
            "--model",
            model,
        ])
        .args(["--ctx", &ctx.to_string()])
        .output()
        .expect("run the client script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    eprintln!("{stderr}");
    let _ = stop_tx.send(());
    rt.block_on(server).unwrap().unwrap();
    assert!(
        out.status.success(),
        "client checks failed:\n{stdout}\n{stderr}"
    );
}
