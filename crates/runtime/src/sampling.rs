//! Token sampling with llama.cpp's defaults and semantics, and a stop-string matcher for streamed
//! text.
//!
//! The chain is llama.cpp's default one with its disabled members left out:
//! penalties -> top-k -> top-p -> min-p -> temperature -> draw. As there, top-p and min-p look at
//! the *untempered* distribution (temperature comes after them), a temperature of 0 means greedy
//! (argmax of the penalized logits), and the penalties act on the last `repeat_last_n` tokens of
//! the history (prompt and generated tokens alike).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;

/// Most stop strings one request may carry.
pub const MAX_STOP_STRINGS: usize = 16;
/// Longest stop string, in bytes.
pub const MAX_STOP_BYTES: usize = 256;

/// How to pick each next token and when to stop.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; 0 samples greedily. llama.cpp default 0.8.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables. Default 40.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`; 1 disables.
    /// Default 0.95.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 disables. Default 0.05.
    pub min_p: f32,
    /// Divide positive (multiply non-positive) logits of recently seen tokens; 1 disables.
    pub repeat_penalty: f32,
    /// How many of the last tokens the penalties look at; 0 disables them. Default 64.
    pub repeat_last_n: usize,
    /// Subtracted once from the logit of every recently seen token; 0 disables.
    pub presence_penalty: f32,
    /// Subtracted from a recently seen token's logit once per occurrence; 0 disables.
    pub frequency_penalty: f32,
    /// RNG seed; `None` draws one from the OS (see [`Sampler::seed`]).
    pub seed: Option<u64>,
    /// Most tokens to generate; `None` runs until end of generation or the context is full.
    pub max_tokens: Option<usize>,
    /// Generation stops before the first occurrence of any of these strings (not included).
    pub stop: Vec<String>,
    /// Keep generating past end-of-generation tokens.
    pub ignore_eos: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            max_tokens: None,
            stop: Vec::new(),
            ignore_eos: false,
        }
    }
}

/// A sampling parameter out of range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    #[error("{field} must be a finite number, got {value}")]
    NotFinite { field: &'static str, value: f32 },
    #[error("{field} must be in {range}, got {value}")]
    OutOfRange {
        field: &'static str,
        range: &'static str,
        value: f32,
    },
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error("stop: at most {max} stop strings are allowed, got {got}")]
    TooManyStops { got: usize, max: usize },
    #[error("stop[{index}] is empty")]
    EmptyStop { index: usize },
    #[error("stop[{index}] is {len} bytes long, at most {max} are allowed")]
    StopTooLong {
        index: usize,
        len: usize,
        max: usize,
    },
}

impl SamplingParams {
    /// Greedy decoding: always the most likely token after penalties.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        }
    }

    /// Check every field; the error names the first one out of range.
    pub fn validate(&self) -> Result<(), SamplingError> {
        fn finite(field: &'static str, value: f32) -> Result<(), SamplingError> {
            if value.is_finite() {
                Ok(())
            } else {
                Err(SamplingError::NotFinite { field, value })
            }
        }
        fn range(
            field: &'static str,
            value: f32,
            ok: bool,
            range: &'static str,
        ) -> Result<(), SamplingError> {
            finite(field, value)?;
            if ok {
                Ok(())
            } else {
                Err(SamplingError::OutOfRange {
                    field,
                    range,
                    value,
                })
            }
        }
        let t = self.temperature;
        range("temperature", t, t >= 0.0, "[0, inf)")?;
        let p = self.top_p;
        range("top_p", p, (0.0..=1.0).contains(&p), "[0, 1]")?;
        let m = self.min_p;
        range("min_p", m, (0.0..=1.0).contains(&m), "[0, 1]")?;
        let r = self.repeat_penalty;
        range("repeat_penalty", r, r > 0.0, "(0, inf)")?;
        finite("presence_penalty", self.presence_penalty)?;
        finite("frequency_penalty", self.frequency_penalty)?;
        if self.max_tokens == Some(0) {
            return Err(SamplingError::ZeroMaxTokens);
        }
        if self.stop.len() > MAX_STOP_STRINGS {
            return Err(SamplingError::TooManyStops {
                got: self.stop.len(),
                max: MAX_STOP_STRINGS,
            });
        }
        for (index, s) in self.stop.iter().enumerate() {
            if s.is_empty() {
                return Err(SamplingError::EmptyStop { index });
            }
            if s.len() > MAX_STOP_BYTES {
                return Err(SamplingError::StopTooLong {
                    index,
                    len: s.len(),
                    max: MAX_STOP_BYTES,
                });
            }
        }
        Ok(())
    }

    fn penalties_active(&self) -> bool {
        self.repeat_last_n > 0
            && (self.repeat_penalty != 1.0
                || self.presence_penalty != 0.0
                || self.frequency_penalty != 0.0)
    }
}

/// One sequence's sampler: its parameters and its own RNG stream.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    seed: u64,
    rng: ChaCha8Rng,
    cand: Vec<Cand>,
    counts: HashMap<u32, u32>,
}

#[derive(Clone, Copy, Debug)]
struct Cand {
    id: u32,
    logit: f32,
}

/// Descending by logit, ties by ascending id, so the order never depends on the sort algorithm.
fn by_logit_desc(a: &Cand, b: &Cand) -> std::cmp::Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

/// Candidates to sort first when top-p runs without top-k (llama.cpp's adaptive trick): most
/// distributions reach `p` well inside the first few hundred tokens, sparing a full-vocab sort.
const TOP_P_FIRST_PASS: usize = 256;

impl Sampler {
    /// A sampler for `params`, which must have passed [`SamplingParams::validate`].
    pub fn new(params: &SamplingParams) -> Result<Sampler, SamplingError> {
        params.validate()?;
        let seed = params.seed.unwrap_or_else(rand::random);
        Ok(Sampler {
            params: params.clone(),
            seed,
            rng: ChaCha8Rng::seed_from_u64(seed),
            cand: Vec::new(),
            counts: HashMap::new(),
        })
    }

    /// The seed in use (drawn from the OS when the parameters named none).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether [`Sampler::sample`] is the plain argmax of the row: temperature 0 and no
    /// penalties, so the pick needs neither the history nor any state (and a backend may make
    /// it on its device: [`crate::Backend::step_argmax`]).
    pub fn plain_greedy(&self) -> bool {
        self.params.temperature <= 0.0 && !self.params.penalties_active()
    }

    /// `Some(k)` when [`Sampler::sample`] on a row of more than `k` logits reads only the row's
    /// `k` best ([`top_k`]): temperature above 0, no penalties, top-k on. A backend may then
    /// return those instead of the row ([`crate::Backend::step_top_k`]) and
    /// [`Sampler::sample_top_k`] picks the token `sample` would.
    pub fn top_k_only(&self) -> Option<usize> {
        let p = &self.params;
        (p.temperature > 0.0 && !p.penalties_active() && p.top_k > 0).then_some(p.top_k)
    }

    /// [`Sampler::sample`] from the best logits of a row of more than
    /// [`Sampler::top_k_only`]'s `k` logits, as [`top_k`] lists them (at least `k` of them; the
    /// first `k` are read): the token `sample` picks from the whole row, with the same draw
    /// from the random stream. Only for a sampler whose `top_k_only` is `Some`.
    pub fn sample_top_k(&mut self, best: &[(u32, f32)]) -> u32 {
        let k = self.params.top_k.min(best.len());
        self.cand.clear();
        self.cand.extend(best[..k].iter().map(|&(id, l)| Cand {
            id,
            logit: if l.is_nan() { f32::NEG_INFINITY } else { l },
        }));
        self.narrow(true);
        // `sample` falls back to the row's argmax, which is the list's first entry (a row of
        // only -inf and NaN lists id 0 first, and argmax gives 0).
        draw(&self.cand, &mut self.rng).unwrap_or_else(|| best.first().map_or(0, |b| b.0))
    }

    /// Pick the next token from one row of logits. `history` is every token of the sequence so
    /// far (prompt then generated); the penalties read its last `repeat_last_n` entries. The
    /// logits are modified in place (penalties). NaN logits count as impossible; ids in `history`
    /// outside the vocabulary are ignored. An empty row yields token 0.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        self.penalize(logits, history);
        if self.params.temperature <= 0.0 {
            return argmax(logits);
        }
        self.filter(logits);
        draw(&self.cand, &mut self.rng).unwrap_or_else(|| argmax(logits))
    }

    /// The distribution the next draw would use: `(token, probability)` in descending
    /// probability, after every sampler of the chain (greedy gives one token with probability 1).
    /// Modifies `logits` like [`Sampler::sample`] and consumes no randomness.
    pub fn candidates(&mut self, logits: &mut [f32], history: &[u32]) -> Vec<(u32, f64)> {
        self.penalize(logits, history);
        if self.params.temperature <= 0.0 {
            if logits.is_empty() {
                return Vec::new();
            }
            return vec![(argmax(logits), 1.0)];
        }
        self.filter(logits);
        let max = self
            .cand
            .iter()
            .map(|c| c.logit)
            .fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            return Vec::new();
        }
        let w: Vec<f64> = self
            .cand
            .iter()
            .map(|c| f64::from((c.logit - max).exp()))
            .collect();
        let total: f64 = w.iter().sum();
        let mut out: Vec<(u32, f64)> = self
            .cand
            .iter()
            .zip(&w)
            .map(|(c, &w)| (c.id, w / total))
            .collect();
        out.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        out
    }

    fn penalize(&mut self, logits: &mut [f32], history: &[u32]) {
        if self.params.penalties_active() {
            let start = history.len().saturating_sub(self.params.repeat_last_n);
            apply_penalties(&mut self.counts, &self.params, logits, &history[start..]);
        }
    }

    /// Run top-k, top-p, min-p and temperature, leaving the survivors (tempered) in `self.cand`.
    fn filter(&mut self, logits: &[f32]) {
        self.cand.clear();
        let p = &self.params;
        let mut sorted = false;
        if p.top_k > 0 && p.top_k < logits.len() {
            top_k_sorted(&mut self.cand, logits, p.top_k);
            sorted = true;
        } else {
            self.cand
                .extend(logits.iter().enumerate().map(|(i, &l)| Cand {
                    id: i as u32,
                    logit: if l.is_nan() { f32::NEG_INFINITY } else { l },
                }));
        }
        self.narrow(sorted);
    }

    /// Top-p, min-p and temperature on the candidates in `self.cand` (`sorted`: in
    /// [`by_logit_desc`] order).
    fn narrow(&mut self, sorted: bool) {
        let p = &self.params;
        if p.top_p < 1.0 {
            let keep = top_p_len(&mut self.cand, p.top_p, sorted);
            self.cand.truncate(keep);
        }
        if p.min_p > 0.0 && !self.cand.is_empty() {
            // p_i >= min_p * p_max  <=>  logit_i >= max_logit + ln(min_p); the top token always
            // passes since ln(min_p) <= 0.
            let max = self
                .cand
                .iter()
                .map(|c| c.logit)
                .fold(f32::NEG_INFINITY, f32::max);
            let min_logit = max + p.min_p.ln();
            self.cand.retain(|c| c.logit >= min_logit);
        }
        let temp = p.temperature;
        for c in &mut self.cand {
            c.logit /= temp;
        }
    }
}

/// The penalty rule of llama.cpp: every distinct token among the recent ones gets its logit divided
/// (if positive) or multiplied (if not) by `repeat_penalty`, then `count * frequency + presence`
/// subtracted.
fn apply_penalties(
    counts: &mut HashMap<u32, u32>,
    p: &SamplingParams,
    logits: &mut [f32],
    recent: &[u32],
) {
    counts.clear();
    for &t in recent {
        *counts.entry(t).or_insert(0) += 1;
    }
    for (&t, &n) in counts.iter() {
        let Some(l) = logits.get_mut(t as usize) else {
            continue;
        };
        if *l <= 0.0 {
            *l *= p.repeat_penalty;
        } else {
            *l /= p.repeat_penalty;
        }
        *l -= n as f32 * p.frequency_penalty + p.presence_penalty;
    }
}

/// The `k` best candidates of `logits` (NaN counting as impossible) into `cand`, sorted by
/// [`by_logit_desc`]: the same list as selecting and sorting all of them, without building a
/// candidate per vocabulary entry (64 sequences a step at a 49k vocabulary made that a
/// noticeable share of a batched step). One pass keeps a bounded buffer; each time it fills,
/// its `k` best stay and the `k`-th of them becomes the bar a later logit must beat strictly
/// (an equal logit has a higher id, so it ranks behind the bar and at least `k` candidates
/// rank before it).
fn top_k_sorted(cand: &mut Vec<Cand>, logits: &[f32], k: usize) {
    debug_assert!(k > 0 && k < logits.len());
    cand.clear();
    let cap = (4 * k).max(64);
    let mut scan = TopKScan {
        cand,
        k,
        cap,
        bar: f32::NEG_INFINITY,
        have_bar: false,
    };
    // Once the bar is set almost no logit beats it: a block of `SKIP_BLOCK` logits is first
    // tested as a whole (one compare-and-or the compiler turns into vector instructions) and
    // only a block holding a logit above the bar is walked one by one. The bar only rises, so
    // a logit at or below the bar at the block's start is at or below it at its turn too:
    // the walk skips exactly what the one-by-one scan would (`top_k_sorted_reference`). NaN
    // compares false, as its stand-in -inf does.
    let mut blocks = logits.chunks_exact(SKIP_BLOCK);
    let mut base = 0usize;
    for b in blocks.by_ref() {
        if scan.have_bar {
            let bar = scan.bar;
            if !b.iter().fold(false, |any, &l| any | (l > bar)) {
                base += SKIP_BLOCK;
                continue;
            }
        }
        for (j, &l) in b.iter().enumerate() {
            scan.offer(base + j, l);
        }
        base += SKIP_BLOCK;
    }
    for (j, &l) in blocks.remainder().iter().enumerate() {
        scan.offer(base + j, l);
    }
    scan.finish();
}

/// The `k` best logits of `logits` as `(token, logit)`, in the order [`Sampler::sample`]'s top-k
/// keeps them: descending logit, the lower id first among equals, NaN counted (and returned) as
/// negative infinity; the whole row so ordered when `k` is not below its length. What
/// [`crate::Backend::step_top_k`] returns per row.
pub fn top_k(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut cand = Vec::new();
    if k == 0 {
        return Vec::new();
    }
    if k < logits.len() {
        top_k_sorted(&mut cand, logits, k);
    } else {
        cand.extend(logits.iter().enumerate().map(|(i, &l)| Cand {
            id: i as u32,
            logit: if l.is_nan() { f32::NEG_INFINITY } else { l },
        }));
        cand.sort_unstable_by(by_logit_desc);
    }
    cand.into_iter().map(|c| (c.id, c.logit)).collect()
}

/// Logits per block of the skipping scan in [`top_k_sorted`].
const SKIP_BLOCK: usize = 64;

/// The state of [`top_k_sorted`]'s one pass: a bounded buffer and the bar a logit must beat.
struct TopKScan<'a> {
    cand: &'a mut Vec<Cand>,
    k: usize,
    cap: usize,
    bar: f32,
    have_bar: bool,
}

impl TopKScan<'_> {
    /// Consider logit `l` of token `i`.
    #[inline]
    fn offer(&mut self, i: usize, l: f32) {
        let l = if l.is_nan() { f32::NEG_INFINITY } else { l };
        if self.have_bar && l <= self.bar {
            return;
        }
        self.cand.push(Cand {
            id: i as u32,
            logit: l,
        });
        if self.cand.len() == self.cap {
            self.cand.select_nth_unstable_by(self.k - 1, by_logit_desc);
            self.cand.truncate(self.k);
            self.bar = self.cand[self.k - 1].logit;
            self.have_bar = true;
        }
    }

    /// Keep the `k` best of what is left, sorted.
    fn finish(self) {
        if self.cand.len() > self.k {
            self.cand.select_nth_unstable_by(self.k - 1, by_logit_desc);
            self.cand.truncate(self.k);
        }
        self.cand.sort_unstable_by(by_logit_desc);
    }
}

/// [`top_k_sorted`] one logit at a time, without the block test: the reference the skipping
/// scan is tested against.
#[cfg(test)]
fn top_k_sorted_reference(cand: &mut Vec<Cand>, logits: &[f32], k: usize) {
    cand.clear();
    let mut scan = TopKScan {
        cand,
        k,
        cap: (4 * k).max(64),
        bar: f32::NEG_INFINITY,
        have_bar: false,
    };
    for (i, &l) in logits.iter().enumerate() {
        scan.offer(i, l);
    }
    scan.finish();
}

/// Index of the largest logit, lowest index on ties; NaN never wins (0 for a row of NaN or
/// negative infinity, and for an empty row): the greedy pick ([`Sampler::sample`] at
/// temperature 0 without penalties, and [`crate::Backend::step_argmax`]'s contract).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_l = f32::NEG_INFINITY;
    for (i, &l) in logits.iter().enumerate() {
        if l > best_l {
            best = i;
            best_l = l;
        }
    }
    best as u32
}

/// Sort `cand` by descending logit (partially when possible) and return how many of them the
/// smallest prefix whose softmax mass reaches `p` holds (at least one).
fn top_p_len(cand: &mut [Cand], p: f32, sorted: bool) -> usize {
    if cand.is_empty() {
        return 0;
    }
    let max = cand
        .iter()
        .map(|c| c.logit)
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return cand.len();
    }
    let total: f64 = cand.iter().map(|c| f64::from((c.logit - max).exp())).sum();
    let mut sorted_len = cand.len();
    if !sorted {
        sorted_len = TOP_P_FIRST_PASS.min(cand.len());
        if sorted_len < cand.len() {
            cand.select_nth_unstable_by(sorted_len - 1, by_logit_desc);
        }
        cand[..sorted_len].sort_unstable_by(by_logit_desc);
    }
    let target = f64::from(p) * total;
    let mut cum = 0.0f64;
    let mut i = 0;
    while i < cand.len() {
        if i == sorted_len {
            // The first pass was not enough: sort the rest too.
            cand[sorted_len..].sort_unstable_by(by_logit_desc);
            sorted_len = cand.len();
        }
        cum += f64::from((cand[i].logit - max).exp());
        if cum >= target {
            return i + 1;
        }
        i += 1;
    }
    cand.len()
}

/// Draw one candidate by softmax of its (already tempered) logits. `None` when there is nothing
/// to draw from (no candidates or all impossible).
fn draw(cand: &[Cand], rng: &mut ChaCha8Rng) -> Option<u32> {
    let max = cand
        .iter()
        .map(|c| c.logit)
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return None;
    }
    let total: f64 = cand.iter().map(|c| f64::from((c.logit - max).exp())).sum();
    // One draw per token whatever the candidate count, so a seed's stream stays aligned.
    let target = rng.gen::<f64>() * total;
    let mut cum = 0.0f64;
    let mut last = None;
    for c in cand {
        let w = f64::from((c.logit - max).exp());
        if w > 0.0 {
            last = Some(c.id);
        }
        cum += w;
        if cum > target && w > 0.0 {
            return Some(c.id);
        }
    }
    last
}

/// What the stop matcher lets through after a piece of text.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopOutput {
    /// Text that is certainly not part of a stop string: safe to send now.
    pub text: String,
    /// A stop string was found; `text` ends right before it and generation should end.
    pub stopped: bool,
}

/// Finds stop strings in streamed text. Text that might be the beginning of a stop string is held
/// back until the next piece decides it; the stop string itself and everything after it are
/// dropped.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
    stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> StopMatcher {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
            stopped: false,
        }
    }

    /// Whether a stop string has been seen.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Feed the next piece of generated text.
    pub fn push(&mut self, piece: &str) -> StopOutput {
        if self.stopped {
            return StopOutput {
                text: String::new(),
                stopped: true,
            };
        }
        self.pending.push_str(piece);
        // Earliest occurrence of any stop string; the longest wins on a tie.
        let mut hit: Option<(usize, usize)> = None;
        for s in &self.stops {
            if let Some(at) = self.pending.find(s.as_str()) {
                let better = match hit {
                    None => true,
                    Some((a, l)) => at < a || (at == a && s.len() > l),
                };
                if better {
                    hit = Some((at, s.len()));
                }
            }
        }
        if let Some((at, _)) = hit {
            self.stopped = true;
            let mut text = std::mem::take(&mut self.pending);
            text.truncate(at);
            return StopOutput {
                text,
                stopped: true,
            };
        }
        let hold = self.held_suffix_len();
        let cut = self.pending.len() - hold;
        let rest = self.pending.split_off(cut);
        let text = std::mem::replace(&mut self.pending, rest);
        StopOutput {
            text,
            stopped: false,
        }
    }

    /// End of generation: release whatever was held back (nothing once stopped).
    pub fn finish(&mut self) -> String {
        if self.stopped {
            self.pending.clear();
            return String::new();
        }
        std::mem::take(&mut self.pending)
    }

    /// Length of the longest suffix of `pending` that is a proper prefix of some stop string.
    fn held_suffix_len(&self) -> usize {
        let max_stop = self.stops.iter().map(String::len).max().unwrap_or(0);
        if max_stop == 0 {
            return 0;
        }
        let from = self.pending.len().saturating_sub(max_stop - 1);
        for (start, _) in self.pending.char_indices() {
            if start < from {
                continue;
            }
            let suffix = &self.pending[start..];
            if self
                .stops
                .iter()
                .any(|s| s.len() > suffix.len() && s.starts_with(suffix))
            {
                return suffix.len();
            }
        }
        0
    }
}

#[cfg(test)]
mod tests;
