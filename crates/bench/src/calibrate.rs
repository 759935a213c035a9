//! Calibration: from the user's prompt lengths and measurements of every backend across them,
//! the crossover points where the best backend changes, and the routing policy that encodes them.

use std::fmt;
use std::str::FromStr;

use runtime::routing::Rule;
use runtime::RoutingPolicy;
use serde::Serialize;

use crate::measure::{Measurement, Method};
use crate::plot::{Panel, Series};
use crate::stats::percentile;
use crate::BenchError;

/// Read prompt lengths: one whole number per line, or JSON lines with a `prompt_tokens` field
/// (the request log `serve --log-requests` writes). Blank lines and lines starting with `#` are
/// skipped. `origin` names the file in errors.
pub fn parse_contexts(text: &str, origin: &str) -> Result<Vec<usize>, BenchError> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = |why: String| BenchError::Contexts {
            path: origin.to_string(),
            line: i + 1,
            why,
        };
        let n = if line.starts_with('{') {
            let v: serde_json::Value =
                serde_json::from_str(line).map_err(|e| bad(format!("not JSON: {e}")))?;
            let f = v
                .get("prompt_tokens")
                .ok_or_else(|| bad("JSON line without a prompt_tokens field".into()))?;
            f.as_u64()
                .ok_or_else(|| bad(format!("prompt_tokens is {f}, not a whole number")))?
        } else {
            line.parse::<u64>()
                .map_err(|_| bad(format!("`{line}` is not a whole number of tokens")))?
        };
        if n == 0 {
            return Err(bad("a prompt of 0 tokens".into()));
        }
        out.push(usize::try_from(n).map_err(|_| bad(format!("{n} is too large")))?);
    }
    if out.is_empty() {
        return Err(BenchError::EmptyContexts {
            path: origin.to_string(),
        });
    }
    Ok(out)
}

/// Summary of a prompt-length distribution.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Distribution {
    pub n: usize,
    pub min: usize,
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: usize,
    /// Sorted lengths (for the grid).
    #[serde(skip)]
    sorted: Vec<f64>,
}

impl Distribution {
    /// Of `lengths` (not empty).
    pub fn of(lengths: &[usize]) -> Option<Distribution> {
        let mut s: Vec<f64> = lengths.iter().map(|&l| l as f64).collect();
        if s.is_empty() {
            return None;
        }
        s.sort_by(f64::total_cmp);
        Some(Distribution {
            n: s.len(),
            min: s[0] as usize,
            p50: percentile(&s, 50.0),
            p95: percentile(&s, 95.0),
            p99: percentile(&s, 99.0),
            max: s[s.len() - 1] as usize,
            sorted: s,
        })
    }

    /// The prompt lengths to measure: `points` evenly spaced quantiles (min and max included)
    /// plus p50, p95 and p99, at most `max_prompt`, distinct, ascending.
    pub fn grid(&self, points: usize, max_prompt: usize) -> Vec<usize> {
        let mut qs: Vec<f64> = (0..points.max(2))
            .map(|i| 100.0 * i as f64 / (points.max(2) - 1) as f64)
            .collect();
        qs.extend([50.0, 95.0, 99.0]);
        let mut g: Vec<usize> = qs
            .iter()
            .map(|&q| (percentile(&self.sorted, q).round() as usize).clamp(1, max_prompt.max(1)))
            .collect();
        g.sort_unstable();
        g.dedup();
        g
    }
}

/// What "best backend" means.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Objective {
    /// Lowest median time to first token.
    Ttft,
    /// Highest median generated tokens/s.
    Throughput,
    /// Lowest median energy per generated token.
    Energy,
}

impl FromStr for Objective {
    type Err = String;
    fn from_str(s: &str) -> Result<Objective, String> {
        match s {
            "ttft" => Ok(Objective::Ttft),
            "throughput" => Ok(Objective::Throughput),
            "energy" => Ok(Objective::Energy),
            o => Err(format!(
                "unknown objective `{o}` (expected ttft, throughput or energy)"
            )),
        }
    }
}

impl fmt::Display for Objective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Objective::Ttft => "ttft",
            Objective::Throughput => "throughput",
            Objective::Energy => "energy",
        })
    }
}

impl Objective {
    /// The figure this objective compares, from a measurement.
    pub fn value(self, m: &Measurement) -> Option<f64> {
        match self {
            Objective::Ttft => m.ttft_ms.as_ref().map(|s| s.median),
            Objective::Throughput => m.tok_s.as_ref().map(|s| s.median),
            Objective::Energy => m.j_per_token.as_ref().map(|s| s.median),
        }
    }

    /// Whether `a` beats `b`.
    pub fn better(self, a: f64, b: f64) -> bool {
        match self {
            Objective::Throughput => a > b,
            Objective::Ttft | Objective::Energy => a < b,
        }
    }

    /// Unit and direction, for reports.
    pub fn describe(self) -> &'static str {
        match self {
            Objective::Ttft => "median time to first token, ms (lower is better)",
            Objective::Throughput => "median generated tokens/s (higher is better)",
            Objective::Energy => "median joules per generated token (lower is better)",
        }
    }
}

/// One measured figure: a backend's objective value at a prompt length and concurrency.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Point {
    pub prompt: usize,
    pub concurrency: usize,
    pub backend: String,
    pub value: f64,
}

/// Where the best backend changes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Crossover {
    pub concurrency: usize,
    /// First prompt length that goes to `to`.
    pub at: usize,
    pub from: String,
    pub to: String,
    /// The measured lengths it lies between.
    pub between: (usize, usize),
}

/// A prompt-length range (inclusive; `None` = unbounded) and its best backend.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Segment {
    pub min: Option<usize>,
    pub max: Option<usize>,
    pub backend: String,
}

/// The best backend at each measured length of `concurrency`, then the crossovers between
/// neighbours: where the two backends' figures, interpolated linearly between the two measured
/// lengths, are equal (the midpoint when one figure is missing).
pub fn crossovers(
    points: &[Point],
    concurrency: usize,
    objective: Objective,
) -> (Vec<Segment>, Vec<Crossover>) {
    let mut lengths: Vec<usize> = points
        .iter()
        .filter(|p| p.concurrency == concurrency)
        .map(|p| p.prompt)
        .collect();
    lengths.sort_unstable();
    lengths.dedup();
    let value = |len: usize, b: &str| {
        points
            .iter()
            .find(|p| p.concurrency == concurrency && p.prompt == len && p.backend == b)
            .map(|p| p.value)
    };
    let mut best: Vec<(usize, String)> = Vec::new();
    for &len in &lengths {
        let mut win: Option<&Point> = None;
        for p in points
            .iter()
            .filter(|p| p.concurrency == concurrency && p.prompt == len)
        {
            if win.is_none_or(|w| objective.better(p.value, w.value)) {
                win = Some(p);
            }
        }
        if let Some(w) = win {
            best.push((len, w.backend.clone()));
        }
    }
    let mut cross = Vec::new();
    for pair in best.windows(2) {
        let ((l0, a), (l1, b)) = (&pair[0], &pair[1]);
        if a == b {
            continue;
        }
        let at = match (value(*l0, a), value(*l0, b), value(*l1, a), value(*l1, b)) {
            (Some(a0), Some(b0), Some(a1), Some(b1)) => {
                let (d0, d1) = (a0 - b0, a1 - b1);
                let t = if d0 != d1 { d0 / (d0 - d1) } else { 0.5 };
                let x = *l0 as f64 + t.clamp(0.0, 1.0) * (*l1 - *l0) as f64;
                x.ceil() as usize
            }
            _ => (l0 + l1).div_ceil(2),
        }
        .clamp(l0 + 1, *l1);
        cross.push(Crossover {
            concurrency,
            at,
            from: a.clone(),
            to: b.clone(),
            between: (*l0, *l1),
        });
    }
    let mut segs: Vec<Segment> = Vec::new();
    if let Some((_, first)) = best.first() {
        let mut cur = Segment {
            min: None,
            max: None,
            backend: first.clone(),
        };
        for c in &cross {
            cur.max = Some(c.at - 1);
            segs.push(cur);
            cur = Segment {
                min: Some(c.at),
                max: None,
                backend: c.to.clone(),
            };
        }
        segs.push(cur);
    }
    (segs, cross)
}

/// The routing policy for the segments: for requests that say they are part of a batch
/// (`batch = true`), the segments measured at `batch_segments`' concurrency, then the
/// single-request segments; `default` is the failover order.
pub fn policy(
    objective: Objective,
    single: &[Segment],
    batch: Option<(usize, &[Segment])>,
    default: Vec<String>,
) -> RoutingPolicy {
    let mut rules = Vec::new();
    let mut push = |segs: &[Segment], prefix: String, batch: Option<bool>| {
        for (i, s) in segs.iter().enumerate() {
            rules.push(Rule {
                name: format!("{prefix}-{}", i + 1),
                backend: s.backend.clone(),
                prompt_tokens_min: s.min,
                prompt_tokens_max: s.max,
                batch,
                ..Rule::default()
            });
        }
    };
    if let Some((c, segs)) = batch {
        push(segs, format!("{objective}-batch{c}"), Some(true));
    }
    push(single, objective.to_string(), None);
    RoutingPolicy { default, rules }
}

/// A finished calibration: what was measured and what it decided.
#[derive(Clone, Debug, Serialize)]
pub struct Calibration {
    pub model: String,
    pub contexts_file: String,
    pub started: String,
    pub finished: String,
    pub objective: Objective,
    pub distribution: Distribution,
    pub gen: usize,
    pub method: Method,
    pub measurements: Vec<Measurement>,
    pub points: Vec<Point>,
    pub crossovers: Vec<Crossover>,
    #[serde(skip)]
    pub policy: RoutingPolicy,
}

impl Calibration {
    /// Decide from `measurements`: points of the objective, crossovers at concurrency 1 and at
    /// the highest concurrency measured, the policy. Errors when the objective is energy and a
    /// backend has no energy figure.
    #[allow(clippy::too_many_arguments)]
    pub fn decide(
        model: String,
        contexts_file: String,
        started: String,
        objective: Objective,
        distribution: Distribution,
        gen: usize,
        method: Method,
        measurements: Vec<Measurement>,
    ) -> Result<Calibration, BenchError> {
        let mut points = Vec::new();
        for m in &measurements {
            match objective.value(m) {
                Some(v) => points.push(Point {
                    prompt: m.workload.prompt,
                    concurrency: m.workload.concurrency,
                    backend: m.backend.clone(),
                    value: v,
                }),
                None if objective == Objective::Energy => {
                    return Err(BenchError::NoEnergy {
                        backend: m.backend.clone(),
                        why: m.power_note.clone().unwrap_or_else(|| "n/a".into()),
                    })
                }
                None => {}
            }
        }
        let (single, mut cross) = crossovers(&points, 1, objective);
        let top = points.iter().map(|p| p.concurrency).max().unwrap_or(1);
        let batch = if top > 1 {
            let (segs, c) = crossovers(&points, top, objective);
            cross.extend(c);
            Some((top, segs))
        } else {
            None
        };
        // Failover order: backends by their figure at the length nearest the median.
        let mut lens: Vec<usize> = points
            .iter()
            .filter(|p| p.concurrency == 1)
            .map(|p| p.prompt)
            .collect();
        lens.sort_unstable();
        lens.dedup();
        let near = lens
            .iter()
            .copied()
            .min_by(|a, b| {
                (*a as f64 - distribution.p50)
                    .abs()
                    .total_cmp(&(*b as f64 - distribution.p50).abs())
            })
            .unwrap_or(0);
        let mut at_median: Vec<&Point> = points
            .iter()
            .filter(|p| p.concurrency == 1 && p.prompt == near)
            .collect();
        at_median.sort_by(|a, b| {
            if objective.better(a.value, b.value) {
                std::cmp::Ordering::Less
            } else if objective.better(b.value, a.value) {
                std::cmp::Ordering::Greater
            } else {
                a.backend.cmp(&b.backend)
            }
        });
        let default: Vec<String> = at_median.iter().map(|p| p.backend.clone()).collect();
        let policy = policy(
            objective,
            &single,
            batch.as_ref().map(|(c, s)| (*c, s.as_slice())),
            default,
        );
        Ok(Calibration {
            model,
            contexts_file,
            started,
            finished: crate::time::now_utc(),
            objective,
            distribution,
            gen,
            method,
            measurements,
            points,
            crossovers: cross,
            policy,
        })
    }

    /// The policy file: a comment block saying what was measured, when and what it found, then
    /// the policy as TOML (which `runtime::RoutingPolicy::load` reads).
    pub fn policy_toml(&self) -> String {
        let d = &self.distribution;
        let mut s = String::new();
        s.push_str(&format!(
            "# crossover routing policy, written by `crossover calibrate` at {}\n",
            self.finished
        ));
        s.push_str(&format!("# model: {}\n", self.model));
        s.push_str(&format!(
            "# objective: {} = {}\n",
            self.objective,
            self.objective.describe()
        ));
        s.push_str(&format!(
            "# prompt lengths from {}: n {}, min {}, p50 {:.0}, p95 {:.0}, p99 {:.0}, max {}\n",
            self.contexts_file, d.n, d.min, d.p50, d.p95, d.p99, d.max
        ));
        s.push_str(&format!(
            "# measured {} .. {}: {} runs after {} warm-up per point, {} generated tokens per \
             request, greedy, random prompts (seed {})\n",
            self.started,
            self.finished,
            self.method.runs,
            self.method.warmup,
            self.gen,
            self.method.seed
        ));
        let mut backends: Vec<&str> = self.points.iter().map(|p| p.backend.as_str()).collect();
        backends.sort_unstable();
        backends.dedup();
        let mut keys: Vec<(usize, usize)> = self
            .points
            .iter()
            .map(|p| (p.concurrency, p.prompt))
            .collect();
        keys.sort_unstable();
        keys.dedup();
        s.push_str(&format!(
            "#   {:>6} {:>5} {}\n",
            "prompt",
            "conc",
            backends
                .iter()
                .map(|b| format!("{b:>12}"))
                .collect::<String>()
        ));
        for (c, len) in keys {
            let cells: String = backends
                .iter()
                .map(|b| {
                    self.points
                        .iter()
                        .find(|p| p.concurrency == c && p.prompt == len && p.backend == *b)
                        .map_or_else(|| format!("{:>12}", "-"), |p| format!("{:>12.3}", p.value))
                })
                .collect();
            s.push_str(&format!("#   {len:>6} {c:>5} {cells}\n"));
        }
        if self.crossovers.is_empty() {
            s.push_str("# crossovers: none (one backend is best across the measured range)\n");
        }
        for c in &self.crossovers {
            s.push_str(&format!(
                "# crossover (concurrency {}): {} -> {} from {} prompt tokens (measured {} and {})\n",
                c.concurrency, c.from, c.to, c.at, c.between.0, c.between.1
            ));
        }
        s.push('\n');
        s.push_str(&self.policy.to_toml());
        s
    }

    /// Chart: the objective against prompt length per backend, at concurrency 1 and the highest
    /// measured, with the crossovers marked.
    pub fn panels(&self) -> Vec<Panel> {
        let mut concs: Vec<usize> = self.points.iter().map(|p| p.concurrency).collect();
        concs.sort_unstable();
        concs.dedup();
        let mut backends: Vec<&str> = self.points.iter().map(|p| p.backend.as_str()).collect();
        backends.sort_unstable();
        backends.dedup();
        concs
            .iter()
            .map(|&c| Panel {
                title: format!("{} at concurrency {c}", self.objective),
                x_desc: "prompt tokens".into(),
                y_desc: self.objective.describe().into(),
                series: backends
                    .iter()
                    .map(|b| {
                        let mut points: Vec<(f64, f64)> = self
                            .points
                            .iter()
                            .filter(|p| p.concurrency == c && p.backend == *b)
                            .map(|p| (p.prompt as f64, p.value))
                            .collect();
                        points.sort_by(|a, b| a.0.total_cmp(&b.0));
                        Series {
                            label: b.to_string(),
                            points,
                        }
                    })
                    .collect(),
                markers: self
                    .crossovers
                    .iter()
                    .filter(|x| x.concurrency == c)
                    .map(|x| (x.at as f64, format!("{} -> {}", x.from, x.to)))
                    .collect(),
            })
            .collect()
    }
}
