//! The conformance suite shared by every backend's tests: llama.cpp's teacher-forced logits
//! (fixtures under `crates/cpu/tests/fixtures`, made by `scripts/ref_logits.py` with
//! llama-cpp-python 0.3.36: at each position llama.cpp's top 20 token ids, their logits and the
//! log-sum-exp of the whole row) compared with a backend's own rows.
//!
//! A backend's test loads a [`Fixture`], opens its model ([`Fixture::model_path`], checked
//! against the pinned sha256), runs [`teacher_forced`] and judges the [`Figures`].

use std::path::{Path, PathBuf};

use runtime::{Backend, BackendError, SeqChunk, StepBatch, Want};
use serde::Deserialize;

/// llama.cpp's lead of its top-1 logit over its runner-up at which its choice counts as
/// decisive: random-weight models tie often, and any rounding difference flips a near-tie
/// (llama.cpp agrees with itself, batched vs token by token, on 0.953 of the synthetic 1B
/// file's rows).
pub const DECISIVE: f32 = 0.1;

/// What can go wrong before a comparison starts, or while the backend runs the tokens.
#[derive(Debug, thiserror::Error)]
pub enum ConformanceError {
    /// The fixture file is unreadable or not the expected JSON.
    #[error("fixture {path}: {reason} (fixtures are made by scripts/ref_logits.py)")]
    Fixture { path: PathBuf, reason: String },
    /// The model the fixture was made from is not on disk.
    #[error("model {path} is missing: {hint}")]
    ModelMissing { path: PathBuf, hint: String },
    /// The model on disk is another file than the one the fixture pins.
    #[error("{path} has sha256 {found}, the fixture was made from {expected}")]
    ModelMismatch {
        path: PathBuf,
        found: String,
        expected: String,
    },
    /// The backend failed a step.
    #[error("backend step at position {pos}: {source}")]
    Step {
        pos: usize,
        #[source]
        source: BackendError,
    },
    /// The backend returned another number of rows than positions fed, or a row of the wrong width.
    #[error("backend returned {got}, expected {expected}")]
    Shape { got: String, expected: String },
}

#[derive(Deserialize)]
struct ModelRef {
    file: String,
    sha256: String,
}

/// llama.cpp's view of one position.
#[derive(Deserialize)]
pub struct Position {
    /// Its top token ids, best first.
    pub ids: Vec<u32>,
    /// Their logits.
    pub logits: Vec<f32>,
    /// Log-sum-exp of the whole row.
    pub lse: f64,
}

/// One fixture: a model (by path and sha256), the tokens fed, llama.cpp's rows.
#[derive(Deserialize)]
pub struct Fixture {
    model: ModelRef,
    /// The tokens fed, one row per token.
    pub tokens: Vec<u32>,
    /// llama.cpp's rows, one per token.
    pub positions: Vec<Position>,
    #[serde(skip)]
    name: String,
}

/// The workspace root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

impl Fixture {
    /// Reads `crates/cpu/tests/fixtures/<name>`.
    pub fn load(name: &str) -> Result<Fixture, ConformanceError> {
        let path = repo().join("crates/cpu/tests/fixtures").join(name);
        let err = |reason: String| ConformanceError::Fixture {
            path: path.clone(),
            reason,
        };
        let text = std::fs::read_to_string(&path).map_err(|e| err(e.to_string()))?;
        let mut fx: Fixture = serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
        if fx.tokens.len() != fx.positions.len() {
            return Err(err(format!(
                "{} tokens but {} positions",
                fx.tokens.len(),
                fx.positions.len()
            )));
        }
        fx.name = name.to_string();
        Ok(fx)
    }

    /// The model file the fixture was made from, after checking its sha256 (`hint` says which
    /// script makes it, for the error when it is absent).
    pub fn model_path(&self, hint: &str) -> Result<PathBuf, ConformanceError> {
        let path = repo().join(&self.model.file);
        if !path.exists() {
            return Err(ConformanceError::ModelMissing {
                path,
                hint: hint.to_string(),
            });
        }
        use sha2::Digest;
        let bytes = std::fs::read(&path).map_err(|e| ConformanceError::ModelMissing {
            path: path.clone(),
            hint: e.to_string(),
        })?;
        let found = format!("{:x}", sha2::Sha256::digest(&bytes));
        if found != self.model.sha256 {
            return Err(ConformanceError::ModelMismatch {
                path,
                found,
                expected: self.model.sha256.clone(),
            });
        }
        Ok(path)
    }
}

/// Feeds the fixture's tokens to `be` as one sequence in chunks of `chunk` tokens, all rows
/// wanted, and returns the rows; the sequence is released afterwards.
pub fn teacher_forced<B: Backend + ?Sized>(
    be: &mut B,
    fx: &Fixture,
    chunk: usize,
) -> Result<Vec<Vec<f32>>, ConformanceError> {
    const SEQ: u64 = 7;
    let mut rows: Vec<Vec<f32>> = Vec::with_capacity(fx.tokens.len());
    for (ci, part) in fx.tokens.chunks(chunk.max(1)).enumerate() {
        let batch = StepBatch {
            chunks: vec![SeqChunk {
                prompt_len: None,
                seq: SEQ,
                tokens: part.to_vec(),
                start_pos: ci * chunk.max(1),
                want: Want::All,
            }],
        };
        let out = match be.step(&batch) {
            Ok(out) => out,
            Err(source) => {
                be.release(SEQ);
                return Err(ConformanceError::Step {
                    pos: ci * chunk.max(1),
                    source,
                });
            }
        };
        for r in 0..out.n_rows() {
            rows.push(out.row(r).unwrap_or(&[]).to_vec());
        }
    }
    be.release(SEQ);
    if rows.len() != fx.positions.len() {
        return Err(ConformanceError::Shape {
            got: format!("{} rows", rows.len()),
            expected: format!("{}", fx.positions.len()),
        });
    }
    Ok(rows)
}

/// How a backend's rows compare with llama.cpp's.
#[derive(Debug, Clone, Copy)]
pub struct Figures {
    /// Rows compared.
    pub rows: usize,
    /// Share of rows whose top-1 token is llama.cpp's.
    pub top1: f64,
    /// Rows where llama.cpp's top-1 leads its runner-up by at least [`DECISIVE`].
    pub decisive: usize,
    /// Top-1 agreement over those rows.
    pub decisive_top1: f64,
    /// Mean KL(llama.cpp || ours) over llama.cpp's top ids plus the rest of the mass.
    pub kl: f64,
    /// Mean and max |our logit - llama.cpp's| over llama.cpp's top ids.
    pub logit_diff_mean: f64,
    /// See `logit_diff_mean`.
    pub logit_diff_max: f64,
    /// Rows holding a NaN or an infinity.
    pub non_finite_rows: usize,
}

impl Figures {
    /// Compares `rows` (ours, one per position) with the fixture's.
    pub fn compare(fx: &Fixture, rows: &[Vec<f32>]) -> Figures {
        let (mut agree, mut kl_sum, mut decisive, mut decisive_agree) = (0usize, 0.0f64, 0, 0);
        let (mut diff_sum, mut diff_n, mut diff_max, mut non_finite) = (0.0f64, 0usize, 0.0f64, 0);
        for (row, p) in rows.iter().zip(&fx.positions) {
            if !row.iter().all(|v| v.is_finite()) {
                non_finite += 1;
            }
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = max
                + row
                    .iter()
                    .map(|&v| (v as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            let mut top = 0;
            for (i, &v) in row.iter().enumerate() {
                if v > row[top] {
                    top = i;
                }
            }
            let same = p.ids.first() == Some(&(top as u32));
            agree += same as usize;
            if let [a, b, ..] = p.logits[..] {
                if a - b >= DECISIVE {
                    decisive += 1;
                    decisive_agree += same as usize;
                }
            }
            let ours = |id: u32| row.get(id as usize).copied().unwrap_or(f32::NEG_INFINITY);
            let (mut kl, mut pr_in, mut q_in) = (0.0f64, 0.0f64, 0.0f64);
            for (&id, &l) in p.ids.iter().zip(&p.logits) {
                let d = (ours(id) - l).abs() as f64;
                diff_sum += d;
                diff_n += 1;
                diff_max = diff_max.max(d);
                let pr = (l as f64 - p.lse).exp();
                let q = (ours(id) as f64 - lse).exp();
                pr_in += pr;
                q_in += q;
                if pr > 0.0 {
                    kl += pr * (pr / q.max(1e-30)).ln();
                }
            }
            let (pr_rest, q_rest) = ((1.0 - pr_in).max(0.0), (1.0 - q_in).max(1e-30));
            if pr_rest > 1e-12 {
                kl += pr_rest * (pr_rest / q_rest).ln();
            }
            kl_sum += kl.max(0.0);
        }
        let n = rows.len().min(fx.positions.len()).max(1) as f64;
        Figures {
            rows: rows.len().min(fx.positions.len()),
            top1: agree as f64 / n,
            decisive,
            decisive_top1: decisive_agree as f64 / decisive.max(1) as f64,
            kl: kl_sum / n,
            logit_diff_mean: diff_sum / diff_n.max(1) as f64,
            logit_diff_max: diff_max,
            non_finite_rows: non_finite,
        }
    }

    /// One line for the test log, naming the fixture.
    pub fn line(&self, fx: &Fixture) -> String {
        format!(
            "{}: {} rows, top-1 {:.4}, decisive top-1 {:.4} ({} rows), mean KL {:.2e}, |logit - llama.cpp| mean {:.3e} max {:.3e}, non-finite rows {}",
            fx.name,
            self.rows,
            self.top1,
            self.decisive_top1,
            self.decisive,
            self.kl,
            self.logit_diff_mean,
            self.logit_diff_max,
            self.non_finite_rows
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture_of(rows: &[Vec<f32>]) -> Fixture {
        // llama.cpp's side computed independently here: its top 3 of each row and the exact lse.
        let positions = rows
            .iter()
            .map(|r| {
                let mut ids: Vec<u32> = (0..r.len() as u32).collect();
                ids.sort_by(|&a, &b| r[b as usize].total_cmp(&r[a as usize]));
                ids.truncate(3);
                let lse = r.iter().map(|&v| (v as f64).exp()).sum::<f64>().ln();
                Position {
                    logits: ids.iter().map(|&i| r[i as usize]).collect(),
                    ids,
                    lse,
                }
            })
            .collect();
        Fixture {
            model: ModelRef {
                file: String::new(),
                sha256: String::new(),
            },
            tokens: vec![0; rows.len()],
            positions,
            name: "synthetic".into(),
        }
    }

    #[test]
    fn identical_rows_agree_fully_and_a_swapped_top_does_not() {
        // Seeded pseudo-random rows (xorshift), not zeros.
        let mut s = 0x9e37_79b9_7f4a_7c15u64 ^ std::process::id() as u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 8.0 - 4.0
        };
        let rows: Vec<Vec<f32>> = (0..6).map(|_| (0..40).map(|_| next()).collect()).collect();
        let fx = fixture_of(&rows);
        let same = Figures::compare(&fx, &rows);
        assert_eq!(same.top1, 1.0);
        assert!(same.kl.abs() < 1e-9, "KL of identical rows {}", same.kl);
        assert_eq!(same.logit_diff_max, 0.0);

        let mut other = rows.clone();
        let r = &mut other[0];
        let top = fx.positions[0].ids[0] as usize;
        r[top] -= 20.0;
        let f = Figures::compare(&fx, &other);
        assert!((f.top1 - 5.0 / 6.0).abs() < 1e-12, "top-1 {}", f.top1);
        assert!(f.kl > 0.01, "KL after moving the top logit {}", f.kl);
        assert!((f.logit_diff_max - 20.0).abs() < 1e-4);
    }
}
