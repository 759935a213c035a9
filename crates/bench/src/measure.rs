//! Running workloads against backend actors through the coordinator, and what one run yields.

use std::time::Instant;

use runtime::{
    BackendHandle, Coordinator, GenerateRequest, RoutingPolicy, SamplingParams, TokenEvent,
};
use serde::Serialize;

use crate::power::PowerSource;
use crate::stats::Stat;
use crate::workload::{PromptMaker, Workload};
use crate::BenchError;

/// How many runs, and the prompts' seed.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Method {
    /// Measured runs.
    pub runs: usize,
    /// Runs before them, reported but left out of the statistics (cold caches, first-touch
    /// page faults of the weights, lazy kernel compilation).
    pub warmup: usize,
    /// Seed of the prompts' random token ids.
    pub seed: u64,
}

impl Default for Method {
    fn default() -> Self {
        Method {
            runs: 20,
            warmup: 2,
            seed: 42,
        }
    }
}

/// One run of a workload: its requests submitted together and waited for.
#[derive(Clone, Debug, Serialize)]
pub struct RunSample {
    /// Time to first token of each request (submission to first sampled token, as the actor
    /// measures it), in milliseconds.
    pub ttft_ms: Vec<f64>,
    /// Generated tokens per second: tokens after each request's first, summed over requests,
    /// over the time from the earliest first token to the latest last token. For one request
    /// this is its decode rate.
    pub tok_s: Option<f64>,
    /// From the first submission to the last request's end.
    pub wall_s: f64,
    /// Tokens generated, all requests.
    pub generated: usize,
    /// Energy over the whole run (prompt processing included), from the backend's counter.
    pub energy_j: Option<f64>,
}

/// A workload measured on one backend.
#[derive(Clone, Debug, Serialize)]
pub struct Measurement {
    pub workload: Workload,
    pub backend: String,
    pub device: String,
    /// The energy counter used, or why there is none.
    pub power_source: String,
    /// Excluded from the statistics.
    pub warmup: Vec<RunSample>,
    pub runs: Vec<RunSample>,
    /// Over every request of every measured run.
    pub ttft_ms: Option<Stat>,
    pub tok_s: Option<Stat>,
    /// Mean power of each run (energy / wall time).
    pub power_w: Option<Stat>,
    /// Energy of each run / tokens it generated.
    pub j_per_token: Option<Stat>,
    /// Set when there is no power figure: "n/a (no RAPL here)" and the like.
    pub power_note: Option<String>,
}

impl Measurement {
    fn summarize(&mut self) {
        let ttft: Vec<f64> = self
            .runs
            .iter()
            .flat_map(|r| r.ttft_ms.iter().copied())
            .collect();
        self.ttft_ms = Stat::of(&ttft);
        let tps: Vec<f64> = self.runs.iter().filter_map(|r| r.tok_s).collect();
        self.tok_s = Stat::of(&tps);
        let energy: Option<Vec<(f64, &RunSample)>> = self
            .runs
            .iter()
            .map(|r| r.energy_j.map(|e| (e, r)))
            .collect();
        if let Some(e) = energy.filter(|e| !e.is_empty()) {
            let w: Vec<f64> = e.iter().map(|(j, r)| j / r.wall_s).collect();
            let jt: Vec<f64> = e.iter().map(|(j, r)| j / r.generated as f64).collect();
            self.power_w = Stat::of(&w);
            self.j_per_token = Stat::of(&jt);
        }
    }
}

/// What a measuring command (`bench`, `calibrate`) needs: the prompt maker, the method, and one
/// [`Runner`] per backend.
pub struct Runners {
    pub prompts: PromptMaker,
    pub method: Method,
    pub runners: Vec<Runner>,
}

/// One [`Runner`] per handle (each reading its backend's energy counter,
/// [`PowerSource::for_backend`]), prompts drawn from `tok`'s vocabulary, and `method`.
pub fn runners_for(
    handles: &[BackendHandle],
    tok: &tokenizer::Tokenizer,
    method: Method,
) -> Result<Runners, BenchError> {
    let runners = handles
        .iter()
        .map(|h| Runner::new(h.clone(), PowerSource::for_backend(h.name())))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Runners {
        prompts: PromptMaker::new(tok)?,
        method,
        runners,
    })
}

/// Runs workloads on one backend actor, through a coordinator that holds only it (the request
/// path of `serve` and `run`: validation, routing, the actor's mailbox, continuous batching).
pub struct Runner {
    coord: Coordinator,
    handle: BackendHandle,
    power: PowerSource,
}

impl Runner {
    /// A runner for `handle`, reading energy from `power`.
    pub fn new(handle: BackendHandle, power: PowerSource) -> Result<Runner, BenchError> {
        let coord =
            Coordinator::new(vec![handle.clone()], RoutingPolicy::default()).map_err(|e| {
                BenchError::Setup {
                    what: format!("coordinator for {}", handle.name()),
                    why: e.to_string(),
                }
            })?;
        Ok(Runner {
            coord,
            handle,
            power,
        })
    }

    /// The backend's name.
    pub fn name(&self) -> &str {
        self.handle.name()
    }

    /// Check that `w` fits this backend's context.
    pub fn check(&self, w: &Workload) -> Result<(), BenchError> {
        let ctx = self.handle.info().max_seq_tokens;
        if w.ctx_needed() > ctx {
            return Err(BenchError::PromptTooLong {
                workload: w.name.clone(),
                backend: self.name().to_string(),
                prompt: w.prompt,
                gen: w.gen,
                ctx,
            });
        }
        Ok(())
    }

    /// `method.warmup` runs then `method.runs` runs of `w`; `on_run` is called after each.
    pub fn measure(
        &mut self,
        w: &Workload,
        prompts: &PromptMaker,
        method: &Method,
        on_run: &mut dyn FnMut(&RunSample),
    ) -> Result<Measurement, BenchError> {
        self.check(w)?;
        let mut m = Measurement {
            workload: w.clone(),
            backend: self.name().to_string(),
            device: self.handle.info().device.clone(),
            power_source: self.power.describe(),
            warmup: Vec::new(),
            runs: Vec::new(),
            ttft_ms: None,
            tok_s: None,
            power_w: None,
            j_per_token: None,
            power_note: None,
        };
        for run in 0..method.warmup + method.runs {
            let s = self.run_once(w, prompts, method.seed, run)?;
            on_run(&s);
            if run < method.warmup {
                m.warmup.push(s);
            } else {
                m.runs.push(s);
            }
        }
        m.summarize();
        if m.power_w.is_none() {
            m.power_note = Some(match self.power.read_j() {
                Err(why) => why,
                Ok(_) => "n/a (the counter did not advance)".into(),
            });
        }
        Ok(m)
    }

    fn run_once(
        &mut self,
        w: &Workload,
        prompts: &PromptMaker,
        seed: u64,
        run: usize,
    ) -> Result<RunSample, BenchError> {
        let params = SamplingParams {
            max_tokens: Some(w.gen),
            ignore_eos: true,
            ..SamplingParams::greedy()
        };
        let fail = |request: usize, source| BenchError::Run {
            workload: w.name.clone(),
            backend: self.handle.name().to_string(),
            run,
            request,
            source: Box::new(source),
        };
        let e0 = self.power.read_j().ok();
        let t0 = Instant::now();
        let mut streams = Vec::with_capacity(w.concurrency);
        for i in 0..w.concurrency {
            let stream = (run * w.concurrency + i) as u64;
            let req = GenerateRequest::new(prompts.prompt(w.prompt, seed, stream), params.clone());
            streams.push(self.coord.submit(req).map_err(|e| fail(i, e))?);
        }
        // One reader per request, so a slow consumer never holds another request's events.
        let results: Vec<Result<Option<ReqResult>, runtime::RuntimeError>> =
            std::thread::scope(|s| {
                let readers: Vec<_> = streams
                    .into_iter()
                    .map(|st| s.spawn(move || read_stream(st)))
                    .collect();
                readers
                    .into_iter()
                    .map(|h| {
                        h.join().unwrap_or_else(|_| {
                            Err(runtime::RuntimeError::NoBackend {
                                why: "a stream reader panicked".into(),
                            })
                        })
                    })
                    .collect()
            });
        let wall_s = t0.elapsed().as_secs_f64();
        let e1 = self.power.read_j().ok();
        let mut reqs = Vec::with_capacity(results.len());
        for (i, r) in results.into_iter().enumerate() {
            match r {
                Ok(Some(r)) => reqs.push(r),
                Ok(None) => {
                    return Err(BenchError::NoSummary {
                        workload: w.name.clone(),
                        backend: self.handle.name().to_string(),
                        run,
                        request: i,
                    })
                }
                Err(e) => return Err(fail(i, e)),
            }
        }
        let generated: usize = reqs.iter().map(|r| r.tokens).sum();
        let after_first: usize = reqs.iter().map(|r| r.tokens.saturating_sub(1)).sum();
        let first = reqs.iter().filter_map(|r| r.first).min();
        let last = reqs.iter().filter_map(|r| r.last).max();
        let tok_s = match (first, last) {
            (Some(a), Some(b)) if b > a && after_first > 0 => {
                Some(after_first as f64 / (b - a).as_secs_f64())
            }
            _ => None,
        };
        Ok(RunSample {
            ttft_ms: reqs.iter().map(|r| r.ttft_ms).collect(),
            tok_s,
            wall_s,
            generated,
            energy_j: match (e0, e1) {
                (Some(a), Some(b)) if b > a => Some(b - a),
                _ => None,
            },
        })
    }
}

struct ReqResult {
    ttft_ms: f64,
    tokens: usize,
    first: Option<Instant>,
    last: Option<Instant>,
}

fn read_stream(st: runtime::TokenStream) -> Result<Option<ReqResult>, runtime::RuntimeError> {
    let (mut first, mut last, mut tokens) = (None, None, 0usize);
    for ev in st.into_blocking() {
        match ev {
            TokenEvent::Token { .. } => {
                let now = Instant::now();
                first.get_or_insert(now);
                last = Some(now);
                tokens += 1;
            }
            TokenEvent::Done(s) => {
                return Ok(Some(ReqResult {
                    ttft_ms: s.timings.time_to_first_token.as_secs_f64() * 1e3,
                    tokens,
                    first,
                    last,
                }))
            }
            TokenEvent::Error(e) => return Err(e),
        }
    }
    Ok(None)
}
