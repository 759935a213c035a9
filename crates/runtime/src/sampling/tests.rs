//! Sampler tests on fresh random logits (seeded), against naive independent computations.

use super::*;
use rand::seq::SliceRandom;

fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// Logits spread like a real model's: a few strong tokens over a wide tail, both signs.
fn random_logits(r: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| r.gen_range(-8.0f32..8.0) + if r.gen_bool(0.02) { 6.0 } else { 0.0 })
        .collect()
}

fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        seed: Some(7),
        ..Default::default()
    }
}

/// Ids sorted by descending logit (ties by id), the naive way.
fn ranked(logits: &[f32]) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    ids.sort_by(|&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
    ids
}

fn softmax(xs: &[f64]) -> Vec<f64> {
    let m = xs.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = xs.iter().map(|x| (x - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

/// The chain computed from scratch: sorted candidate ids and their final probabilities.
fn reference(logits: &[f32], p: &SamplingParams) -> Vec<(u32, f64)> {
    let mut ids = ranked(logits);
    if p.top_k > 0 {
        ids.truncate(p.top_k);
    }
    if p.top_p < 1.0 {
        let probs = softmax(
            &ids.iter()
                .map(|&i| f64::from(logits[i as usize]))
                .collect::<Vec<_>>(),
        );
        let mut cum = 0.0;
        let mut keep = ids.len();
        for (j, q) in probs.iter().enumerate() {
            cum += q;
            if cum >= f64::from(p.top_p) {
                keep = j + 1;
                break;
            }
        }
        ids.truncate(keep);
    }
    if p.min_p > 0.0 {
        let probs = softmax(
            &ids.iter()
                .map(|&i| f64::from(logits[i as usize]))
                .collect::<Vec<_>>(),
        );
        let pmax = probs[0];
        let kept: Vec<u32> = ids
            .iter()
            .zip(&probs)
            .filter(|(_, &q)| q >= f64::from(p.min_p) * pmax)
            .map(|(&i, _)| i)
            .collect();
        ids = kept;
    }
    let t = f64::from(p.temperature);
    let probs = softmax(
        &ids.iter()
            .map(|&i| f64::from(logits[i as usize]) / t)
            .collect::<Vec<_>>(),
    );
    ids.into_iter().zip(probs).collect()
}

fn ids(c: &[(u32, f64)]) -> Vec<u32> {
    let mut v: Vec<u32> = c.iter().map(|x| x.0).collect();
    v.sort();
    v
}

#[test]
fn defaults_are_llama_cpp_defaults() {
    let d = SamplingParams::default();
    assert_eq!(
        (
            d.temperature,
            d.top_k,
            d.top_p,
            d.min_p,
            d.repeat_penalty,
            d.repeat_last_n
        ),
        (0.8, 40, 0.95, 0.05, 1.0, 64)
    );
    assert_eq!(
        (d.presence_penalty, d.frequency_penalty, d.ignore_eos),
        (0.0, 0.0, false)
    );
    d.validate().unwrap();
}

#[test]
fn validation_names_the_field() {
    let bad: Vec<(SamplingParams, &str)> = vec![
        (
            SamplingParams {
                temperature: -0.1,
                ..Default::default()
            },
            "temperature",
        ),
        (
            SamplingParams {
                temperature: f32::NAN,
                ..Default::default()
            },
            "temperature",
        ),
        (
            SamplingParams {
                top_p: 1.01,
                ..Default::default()
            },
            "top_p",
        ),
        (
            SamplingParams {
                top_p: f32::NAN,
                ..Default::default()
            },
            "top_p",
        ),
        (
            SamplingParams {
                min_p: -0.5,
                ..Default::default()
            },
            "min_p",
        ),
        (
            SamplingParams {
                repeat_penalty: 0.0,
                ..Default::default()
            },
            "repeat_penalty",
        ),
        (
            SamplingParams {
                presence_penalty: f32::INFINITY,
                ..Default::default()
            },
            "presence_penalty",
        ),
        (
            SamplingParams {
                frequency_penalty: f32::NAN,
                ..Default::default()
            },
            "frequency_penalty",
        ),
        (
            SamplingParams {
                max_tokens: Some(0),
                ..Default::default()
            },
            "max_tokens",
        ),
        (
            SamplingParams {
                stop: vec!["a".into(), String::new()],
                ..Default::default()
            },
            "stop[1]",
        ),
        (
            SamplingParams {
                stop: vec!["x".repeat(300)],
                ..Default::default()
            },
            "stop[0]",
        ),
        (
            SamplingParams {
                stop: vec!["s".into(); 17],
                ..Default::default()
            },
            "stop",
        ),
    ];
    for (p, field) in bad {
        let e = p.validate().expect_err(field);
        assert!(e.to_string().contains(field), "{e} should name {field}");
        assert!(Sampler::new(&p).is_err());
    }
}

#[test]
fn greedy_is_argmax_of_penalized_logits() {
    let mut r = rng(1);
    let mut s = Sampler::new(&SamplingParams::greedy()).unwrap();
    for _ in 0..50 {
        let mut l = random_logits(&mut r, 1000);
        let want = ranked(&l)[0];
        assert_eq!(s.sample(&mut l, &[]), want);
    }
    // A repeat penalty can move the argmax off a seen token.
    let p = SamplingParams {
        repeat_penalty: 100.0,
        ..SamplingParams::greedy()
    };
    let mut s = Sampler::new(&p).unwrap();
    let mut l = random_logits(&mut r, 1000);
    let top = ranked(&l);
    assert_eq!(s.sample(&mut l.clone(), &[]), top[0]);
    assert_ne!(s.sample(&mut l, &[top[0]]), top[0]);
}

#[test]
fn top_k_keeps_exactly_the_k_best() {
    let mut r = rng(2);
    for k in [1usize, 5, 40, 999] {
        let p = params(1.0, k, 1.0, 0.0);
        let mut s = Sampler::new(&p).unwrap();
        let l = random_logits(&mut r, 1000);
        let got = s.candidates(&mut l.clone(), &[]);
        assert_eq!(got.len(), k);
        let mut want: Vec<u32> = ranked(&l)[..k].to_vec();
        want.sort();
        assert_eq!(ids(&got), want);
        // Every draw comes from the set.
        for _ in 0..200 {
            let t = s.sample(&mut l.clone(), &[]);
            assert!(want.binary_search(&t).is_ok());
        }
    }
}

#[test]
fn top_k_scan_equals_a_full_sort_with_ties_and_nans() {
    // The one-pass selection must give the exact list (order included) of sorting every
    // candidate: logits rounded to a coarse grid make many ties (broken by id), some are NaN,
    // and rising rows make the bar move on every refill.
    let mut r = rng(11);
    for case in 0..40 {
        let n = [100usize, 1000, 5000, 49152][case % 4];
        let mut l: Vec<f32> = random_logits(&mut r, n)
            .into_iter()
            .map(|x| (x * 2.0).round() / 2.0)
            .collect();
        if case % 5 == 1 {
            l.sort_by(f32::total_cmp);
        }
        for _ in 0..case % 3 {
            let i = r.gen_range(0..n);
            l[i] = f32::NAN;
        }
        let k = [1usize, 2, 40, 63, 64, 65, 300][case % 7].min(n - 1);
        let mut got = Vec::new();
        top_k_sorted(&mut got, &l, k);
        let clean: Vec<f32> = l
            .iter()
            .map(|&x| if x.is_nan() { f32::NEG_INFINITY } else { x })
            .collect();
        let want = &ranked(&clean)[..k];
        let got_ids: Vec<u32> = got.iter().map(|c| c.id).collect();
        assert_eq!(got_ids, want, "case {case}: n {n}, k {k}");
    }
}

#[test]
fn top_k_block_skip_equals_the_one_by_one_scan() {
    // The block test may only skip what the one-by-one scan skips: the same candidates, in
    // the same order, with the same logits, on rows with ties, NaN, infinities, rising rows
    // (the bar moves inside blocks) and lengths around the block size.
    let mut r = rng(23);
    for case in 0..60 {
        let n = [63usize, 64, 65, 129, 1000, 4097, 49152][case % 7];
        let mut l: Vec<f32> = random_logits(&mut r, n)
            .into_iter()
            .map(|x| {
                if case % 2 == 0 {
                    (x * 2.0).round() / 2.0
                } else {
                    x
                }
            })
            .collect();
        if case % 5 == 1 {
            l.sort_by(f32::total_cmp);
        }
        for _ in 0..case % 4 {
            let i = r.gen_range(0..n);
            l[i] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][r.gen_range(0..3)];
        }
        let k = [1usize, 2, 15, 40, 64, 100][case % 6].min(n - 1);
        let (mut got, mut want) = (Vec::new(), Vec::new());
        top_k_sorted(&mut got, &l, k);
        top_k_sorted_reference(&mut want, &l, k);
        let bits = |c: &[Cand]| -> Vec<(u32, u32)> {
            c.iter().map(|c| (c.id, c.logit.to_bits())).collect()
        };
        assert_eq!(bits(&got), bits(&want), "case {case}: n {n}, k {k}");
    }
}

#[test]
fn top_p_and_min_p_cut_the_reference_sets() {
    let mut r = rng(3);
    for case in 0..60 {
        let top_k = [0usize, 40, 300][case % 3];
        let top_p = [1.0f32, 0.95, 0.5, 0.1][case % 4];
        let min_p = [0.0f32, 0.05, 0.3][case % 5 % 3];
        let temperature = [0.5f32, 1.0, 1.7][case % 7 % 3];
        let n = [50usize, 2000, 49152][case % 2 + usize::from(case % 11 == 0)];
        let p = params(temperature, top_k, top_p, min_p);
        let l = random_logits(&mut r, n);
        let want = reference(&l, &p);
        let got = Sampler::new(&p).unwrap().candidates(&mut l.clone(), &[]);
        assert_eq!(ids(&got), ids(&want), "case {case}: {p:?}");
        let mut want_sorted = want.clone();
        want_sorted.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        for (g, w) in got.iter().zip(&want_sorted) {
            assert_eq!(g.0, w.0);
            assert!(
                (g.1 - w.1).abs() < 1e-6,
                "case {case}: p {} vs {}",
                g.1,
                w.1
            );
        }
    }
}

#[test]
fn top_p_without_top_k_beyond_the_first_pass() {
    // A flat distribution needs far more than the first 256 sorted candidates to reach 0.9.
    let mut r = rng(4);
    let l: Vec<f32> = (0..5000).map(|_| r.gen_range(-0.1f32..0.1)).collect();
    let p = params(1.0, 0, 0.9, 0.0);
    let got = Sampler::new(&p).unwrap().candidates(&mut l.clone(), &[]);
    assert!(got.len() > 4000, "{}", got.len());
    assert_eq!(ids(&got), ids(&reference(&l, &p)));
}

#[test]
fn draws_follow_the_distribution() {
    let mut r = rng(5);
    let l: Vec<f32> = (0..6).map(|_| r.gen_range(-2.0f32..2.0)).collect();
    for temperature in [0.6f32, 1.0, 2.0] {
        let p = params(temperature, 0, 1.0, 0.0);
        let want = reference(&l, &p);
        let mut s = Sampler::new(&p).unwrap();
        let n = 40_000;
        let mut hist = [0usize; 6];
        for _ in 0..n {
            hist[s.sample(&mut l.clone(), &[]) as usize] += 1;
        }
        for (id, q) in want {
            let f = hist[id as usize] as f64 / n as f64;
            let sigma = (q * (1.0 - q) / n as f64).sqrt();
            assert!(
                (f - q).abs() < 5.0 * sigma + 1e-9,
                "t={temperature} id {id}: {f} vs {q}"
            );
        }
    }
}

#[test]
fn penalties_change_exactly_the_seen_tokens() {
    let mut r = rng(6);
    let n = 500;
    let window = 32;
    let p = SamplingParams {
        repeat_penalty: 1.3,
        frequency_penalty: 0.25,
        presence_penalty: 0.5,
        repeat_last_n: window,
        ..SamplingParams::greedy()
    };
    let mut s = Sampler::new(&p).unwrap();
    for _ in 0..20 {
        let before = random_logits(&mut r, n);
        // History with repeats; only its last `window` tokens count.
        let history: Vec<u32> = (0..100).map(|_| r.gen_range(0..60u32)).collect();
        let recent = &history[history.len() - window..];
        let mut after = before.clone();
        s.sample(&mut after, &history);
        for id in 0..n {
            let count = recent.iter().filter(|&&t| t as usize == id).count();
            let b = before[id];
            if count == 0 {
                assert_eq!(
                    after[id].to_bits(),
                    b.to_bits(),
                    "token {id} not seen recently"
                );
            } else {
                let rep = if b <= 0.0 { b * 1.3 } else { b / 1.3 };
                let want = rep - (count as f32 * 0.25 + 0.5);
                assert!(
                    (after[id] - want).abs() < 1e-5,
                    "token {id}: {} vs {want}",
                    after[id]
                );
            }
        }
    }
    // repeat_last_n = 0 disables them.
    let mut s = Sampler::new(&SamplingParams {
        repeat_last_n: 0,
        ..p
    })
    .unwrap();
    let before = random_logits(&mut r, n);
    let mut after = before.clone();
    s.sample(&mut after, &[1, 2, 3, 3]);
    assert_eq!(before, after);
}

#[test]
fn seed_fixes_the_sequence() {
    let mut r = rng(8);
    let rows: Vec<Vec<f32>> = (0..300).map(|_| random_logits(&mut r, 2000)).collect();
    let run = |seed: u64| {
        let p = SamplingParams {
            seed: Some(seed),
            temperature: 1.5,
            ..Default::default()
        };
        let mut s = Sampler::new(&p).unwrap();
        let mut hist = Vec::new();
        for row in &rows {
            let t = s.sample(&mut row.clone(), &hist);
            hist.push(t);
        }
        hist
    };
    let a = run(42);
    assert_eq!(a, run(42));
    let b = run(43);
    assert_ne!(a, b);
    // Not greedy in disguise: the draws spread over several tokens per row.
    let greedy: Vec<u32> = rows.iter().map(|row| ranked(row)[0]).collect();
    assert_ne!(a, greedy);
    // An unseeded sampler reports the seed it drew, and that seed replays it.
    let s = Sampler::new(&SamplingParams::default()).unwrap();
    let seed = s.seed();
    assert_eq!(run(seed), run(seed));
}

#[test]
fn nan_and_empty_rows_do_not_panic() {
    let mut s = Sampler::new(&params(1.0, 0, 0.9, 0.05)).unwrap();
    let l = vec![f32::NAN, 1.0, f32::NAN, 0.5];
    for _ in 0..50 {
        let t = s.sample(&mut l.clone(), &[9999]);
        assert!(t == 1 || t == 3);
    }
    assert!(s.sample(&mut [f32::NAN; 4], &[]) < 4);
    assert!(s.sample(&mut [f32::NEG_INFINITY; 4], &[]) < 4);
    assert_eq!(s.sample(&mut [], &[]), 0);
    assert_eq!(
        Sampler::new(&SamplingParams::greedy())
            .unwrap()
            .sample(&mut [], &[1]),
        0
    );
}

// ---- stop strings ----

fn run_stream(stops: &[&str], pieces: &[&str]) -> (String, bool) {
    let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
    let mut m = StopMatcher::new(&stops);
    let mut out = String::new();
    for p in pieces {
        let o = m.push(p);
        out.push_str(&o.text);
        if o.stopped {
            return (out, true);
        }
    }
    out.push_str(&m.finish());
    (out, false)
}

#[test]
fn stop_string_split_across_pieces_is_trimmed() {
    assert_eq!(
        run_stream(&["</s>"], &["Hello <", "/", "s> more"]),
        ("Hello ".into(), true)
    );
    assert_eq!(
        run_stream(&["\n\n"], &["a\n", "b\n", "\n", "c"]),
        ("a\nb".into(), true)
    );
    // A near miss is released once it can no longer be a stop string.
    assert_eq!(
        run_stream(&["abc"], &["xab", "d", "ab"]),
        ("xabdab".into(), false)
    );
    // The earliest stop wins.
    assert_eq!(run_stream(&["cd", "b"], &["abcd"]), ("a".into(), true));
}

#[test]
fn held_text_is_exactly_the_possible_stop_prefix() {
    let stops = vec!["world!".to_string()];
    let mut m = StopMatcher::new(&stops);
    assert_eq!(m.push("Hello wor").text, "Hello ");
    assert_eq!(m.push("ld").text, "");
    let o = m.push("?");
    assert_eq!((o.text.as_str(), o.stopped), ("world?", false));
}

#[test]
fn random_streams_match_a_whole_text_search() {
    let mut r = rng(9);
    let alphabet: Vec<&str> = vec!["a", "b", "c", " ", "é", "日", "\n", "<", ">", "/"];
    for _ in 0..2000 {
        let len = r.gen_range(0..40);
        let text: String = (0..len)
            .map(|_| *alphabet.choose(&mut r).unwrap())
            .collect();
        let n_stops = r.gen_range(1..4);
        let stops: Vec<String> = (0..n_stops)
            .map(|_| {
                let l = r.gen_range(1..4);
                (0..l).map(|_| *alphabet.choose(&mut r).unwrap()).collect()
            })
            .collect();
        // Split at random char boundaries.
        let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
        let mut pieces = Vec::new();
        let mut last = 0;
        for &b in &bounds {
            if b > last && r.gen_bool(0.4) {
                pieces.push(&text[last..b]);
                last = b;
            }
        }
        pieces.push(&text[last..]);
        // Reference: search the whole text at once.
        let first = stops.iter().filter_map(|s| text.find(s.as_str())).min();
        let want = match first {
            Some(at) => (text[..at].to_string(), true),
            None => (text.clone(), false),
        };
        let stop_refs: Vec<&str> = stops.iter().map(String::as_str).collect();
        assert_eq!(
            run_stream(&stop_refs, &pieces),
            want,
            "text {text:?} stops {stops:?}"
        );
    }
}

#[test]
fn sampling_from_the_top_k_list_picks_what_the_whole_row_picks() {
    // Fresh rows each run (the seed is printed to replay a failure): real-looking spreads,
    // coarse grids full of ties, NaN and infinities sprinkled in, rows of only -inf and NaN;
    // random chains of top-k, top-p, min-p and temperature. The same seed must draw the same
    // token from `top_k`'s list as from the whole row, step after step.
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    eprintln!("sampling_from_the_top_k_list: seed {seed}");
    let mut r = rng(seed);
    for case in 0..300 {
        let n = [50usize, 700, 4096, 49152][case % 4];
        let mut row = random_logits(&mut r, n);
        if case % 3 == 1 {
            for x in &mut row {
                *x = (*x * 2.0).round() / 2.0;
            }
        }
        for _ in 0..case % 4 {
            let i = r.gen_range(0..n);
            row[i] = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY][r.gen_range(0..3)];
        }
        if case % 50 == 7 {
            for x in &mut row {
                *x = if r.gen_bool(0.5) {
                    f32::NAN
                } else {
                    f32::NEG_INFINITY
                };
            }
        }
        let k = [1usize, 2, 40, 64, 100, 256][r.gen_range(0..6)].min(n - 1);
        let p = SamplingParams {
            temperature: [0.2f32, 0.7, 1.0, 1.5][r.gen_range(0..4)],
            top_k: k,
            top_p: [1.0f32, 0.95, 0.5, 0.05][r.gen_range(0..4)],
            min_p: [0.0f32, 0.05, 0.3][r.gen_range(0..3)],
            seed: Some(r.gen()),
            ..Default::default()
        };
        let mut whole = Sampler::new(&p).unwrap();
        let mut listed = Sampler::new(&p).unwrap();
        assert_eq!(listed.top_k_only(), Some(k), "case {case}");
        let best = top_k(&row, k);
        assert_eq!(best.len(), k, "case {case}");
        for step in 0..4 {
            let a = whole.sample(&mut row.clone(), &[]);
            // A longer list (a backend asked for the largest k of its rows) reads the same.
            let b = if step % 2 == 0 {
                listed.sample_top_k(&best)
            } else {
                listed.sample_top_k(&top_k(&row, (k + 7).min(n)))
            };
            assert_eq!(a, b, "case {case} step {step}: n {n}, {p:?}");
        }
    }
    // Whole-row lists: every logit, NaN as -inf, descending, lower id first among equals.
    let row = [1.0f32, f32::NAN, 3.0, 1.0, f32::NEG_INFINITY];
    assert_eq!(
        top_k(&row, 9),
        vec![
            (2, 3.0),
            (0, 1.0),
            (3, 1.0),
            (1, f32::NEG_INFINITY),
            (4, f32::NEG_INFINITY)
        ]
    );
    assert_eq!(top_k(&row, 2), vec![(2, 3.0), (0, 1.0)]);
    assert!(top_k(&row, 0).is_empty());
    // Penalties or temperature 0 read the whole row.
    let mut p = SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
    assert_eq!(Sampler::new(&p).unwrap().top_k_only(), None);
    p.temperature = 0.8;
    p.repeat_penalty = 1.1;
    assert_eq!(Sampler::new(&p).unwrap().top_k_only(), None);
    p.repeat_penalty = 1.0;
    p.top_k = 0;
    assert_eq!(Sampler::new(&p).unwrap().top_k_only(), None);
}
