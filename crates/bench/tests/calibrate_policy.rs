//! The calibration's decision logic on fixed numbers, and the policy it writes round-tripping
//! through the runtime's loader to the same decisions.

use bench::calibrate::{self, Calibration, Distribution, Objective};
use bench::measure::{Measurement, Method};
use bench::stats::Stat;
use bench::workload::Workload;
use runtime::routing::{decide, BackendState, RequestShape};
use runtime::{Priority, RoutingPolicy};

fn m(
    backend: &str,
    prompt: usize,
    conc: usize,
    ttft: f64,
    tok_s: f64,
    j: Option<f64>,
) -> Measurement {
    Measurement {
        workload: Workload::new(prompt, 16, conc),
        backend: backend.into(),
        device: "test figures".into(),
        power_source: "none".into(),
        warmup: Vec::new(),
        runs: Vec::new(),
        ttft_ms: Stat::of(&[ttft]),
        tok_s: Stat::of(&[tok_s]),
        power_w: j.and_then(|_| Stat::of(&[100.0])),
        j_per_token: j.and_then(|j| Stat::of(&[j])),
        power_note: j.is_none().then(|| "n/a (no RAPL here)".to_string()),
    }
}

/// cpu:0 is quicker to the first token on short prompts, cuda:0 on long ones; at concurrency 4
/// cuda:0 wins everywhere.
fn figures() -> Vec<Measurement> {
    let mut v = Vec::new();
    for (p, c_cpu, c_gpu) in [
        (64, 5.0, 20.0),
        (512, 40.0, 30.0),
        (2048, 200.0, 50.0),
        (8192, 1000.0, 120.0),
    ] {
        v.push(m("cpu:0", p, 1, c_cpu, 50.0, None));
        v.push(m("cuda:0", p, 1, c_gpu, 200.0, None));
        v.push(m("cpu:0", p, 4, c_cpu * 3.0, 60.0, None));
        v.push(m("cuda:0", p, 4, c_gpu * 0.5, 500.0, None));
    }
    v
}

fn states() -> Vec<BackendState> {
    ["cpu:0", "cuda:0"]
        .iter()
        .map(|n| BackendState {
            name: n.to_string(),
            healthy: true,
            queue_depth: 0,
            free_kv_blocks: 1000,
            max_seq_tokens: 16384,
        })
        .collect()
}

fn shape(p: usize, batch: bool) -> RequestShape {
    RequestShape {
        prompt_tokens: p,
        max_new_tokens: Some(16),
        priority: Priority::Normal,
        batch,
    }
}

fn calibration(obj: Objective) -> Result<Calibration, bench::BenchError> {
    let lengths: Vec<usize> = (1..=101).map(|i| i * i).collect();
    Calibration::decide(
        "model.gguf".into(),
        "contexts.txt".into(),
        "2026-01-01T00:00:00Z".into(),
        obj,
        Distribution::of(&lengths).unwrap(),
        16,
        Method {
            runs: 3,
            warmup: 1,
            seed: 42,
        },
        figures(),
    )
}

#[test]
fn crossover_is_where_the_interpolated_figures_meet() {
    let cal = calibration(Objective::Ttft).unwrap();
    // Between 64 and 512: cpu - gpu goes from 5-20 = -15 to 40-30 = 10, zero at 15/25 = 0.6 of
    // the way: 64 + 0.6 * 448 = 332.8, so prompts from 333 tokens go to cuda:0.
    let single: Vec<_> = cal
        .crossovers
        .iter()
        .filter(|c| c.concurrency == 1)
        .collect();
    assert_eq!(single.len(), 1, "{:?}", cal.crossovers);
    assert_eq!(
        (single[0].at, single[0].from.as_str(), single[0].to.as_str()),
        (333, "cpu:0", "cuda:0")
    );
    assert_eq!(single[0].between, (64, 512));
    // At concurrency 4 cuda:0 is best everywhere: no crossover, one batch rule.
    assert!(cal.crossovers.iter().all(|c| c.concurrency == 1));
    let p = &cal.policy;
    assert_eq!(p.rules.len(), 3, "{p:?}");
    assert_eq!(p.rules[0].batch, Some(true));
    assert_eq!(p.rules[0].backend, "cuda:0");
    assert_eq!(
        (p.rules[1].prompt_tokens_max, p.rules[1].backend.as_str()),
        (Some(332), "cpu:0")
    );
    assert_eq!(
        (p.rules[2].prompt_tokens_min, p.rules[2].backend.as_str()),
        (Some(333), "cuda:0")
    );
    // Default order: by TTFT at the measured length nearest the median (p50 of i*i for i <= 101 = 2601 ->
    // 2048, where cuda:0 is quicker).
    assert_eq!(p.default, vec!["cuda:0", "cpu:0"]);
}

#[test]
fn throughput_prefers_the_higher_figure() {
    let cal = calibration(Objective::Throughput).unwrap();
    assert!(cal.crossovers.is_empty(), "{:?}", cal.crossovers);
    assert!(cal.policy.rules.iter().all(|r| r.backend == "cuda:0"));
}

#[test]
fn energy_without_counters_is_an_error_naming_the_backend() {
    let e = calibration(Objective::Energy).unwrap_err().to_string();
    assert!(e.contains("cpu:0") && e.contains("no RAPL here"), "{e}");
}

#[test]
fn written_policy_loads_back_and_decides_the_same() {
    let cal = calibration(Objective::Ttft).unwrap();
    let text = cal.policy_toml();
    assert!(text.starts_with("# crossover routing policy, written by `crossover calibrate` at "));
    assert!(text.contains("# crossover (concurrency 1): cpu:0 -> cuda:0 from 333 prompt tokens"));
    assert!(text.contains("p50 2601"), "{text}");
    let dir = std::env::temp_dir().join(format!("crossover-cal-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("policy.toml");
    std::fs::write(&path, &text).unwrap();
    let loaded = RoutingPolicy::load(&path).unwrap();
    assert_eq!(loaded, cal.policy);
    let st = states();
    for p in [1usize, 64, 200, 332, 333, 334, 512, 4000, 16000] {
        let want = if p <= 332 { "cpu:0" } else { "cuda:0" };
        let d = decide(&loaded, &shape(p, false), &st).unwrap();
        assert_eq!(d.backend(), want, "prompt {p}: {}", d.reason);
        assert_eq!(d, decide(&cal.policy, &shape(p, false), &st).unwrap());
        let d = decide(&loaded, &shape(p, true), &st).unwrap();
        assert_eq!(d.backend(), "cuda:0", "batch prompt {p}: {}", d.reason);
    }
    // The reason names the rule and the numbers.
    let d = decide(&loaded, &shape(1000, false), &st).unwrap();
    assert!(
        d.reason.contains("prompt_tokens 1000 >= 333"),
        "{}",
        d.reason
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn contexts_parse_plain_and_request_logs_with_line_numbers() {
    let v = calibrate::parse_contexts("12\n\n# comment\n 300 \n", "f").unwrap();
    assert_eq!(v, vec![12, 300]);
    let log = r#"{"ts":"2026-01-01T00:00:00Z","prompt_tokens":41,"completion_tokens":3}
{"prompt_tokens":9}"#;
    assert_eq!(calibrate::parse_contexts(log, "log").unwrap(), vec![41, 9]);
    for (text, line, needle) in [
        ("5\nabc\n", 2, "not a whole number"),
        ("5\n0\n", 2, "0 tokens"),
        ("{\"x\":1}\n", 1, "prompt_tokens"),
        ("{\"prompt_tokens\":-3}\n", 1, "not a whole number"),
        ("{oops\n", 1, "not JSON"),
    ] {
        let e = calibrate::parse_contexts(text, "ctx.txt")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("ctx.txt: line {line}")) && e.contains(needle),
            "{e}"
        );
    }
    assert!(calibrate::parse_contexts("# nothing\n", "e").is_err());
}

#[test]
fn grid_covers_the_distribution_within_the_context() {
    let lengths: Vec<usize> = (1..=1000).collect();
    let d = Distribution::of(&lengths).unwrap();
    assert_eq!((d.min, d.max, d.n), (1, 1000, 1000));
    assert!((d.p50 - 500.5).abs() < 1e-9 && (d.p99 - 990.01).abs() < 1e-9);
    let g = d.grid(4, 800);
    assert_eq!(g.first(), Some(&1));
    assert_eq!(g.last(), Some(&800));
    assert!(g.windows(2).all(|w| w[0] < w[1]));
    assert!(
        g.contains(&334) && g.contains(&667) && g.contains(&501),
        "{g:?}"
    );
}
