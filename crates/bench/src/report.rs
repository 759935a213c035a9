//! The bench report: the classic table for people, JSON for machines.

use serde::Serialize;

use crate::measure::{Measurement, Method};
use crate::stats::Stat;

/// Everything a bench run produced.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    /// The model file.
    pub model: String,
    /// When the measurement started (UTC).
    pub started: String,
    pub method: Method,
    pub results: Vec<Measurement>,
}

fn cell(s: &Option<Stat>, decimals: usize, missing: &str) -> String {
    s.as_ref()
        .map_or_else(|| missing.to_string(), |s| s.show(decimals))
}

impl BenchReport {
    /// A plain-text table: one row per workload and backend; each figure is the median of the
    /// measured runs ± half their interquartile range.
    pub fn table(&self) -> String {
        let header = [
            "workload", "backend", "TTFT ms", "tok/s", "power W", "J/token", "runs",
        ];
        let mut rows: Vec<[String; 7]> = Vec::new();
        for m in &self.results {
            let na = m.power_note.clone().unwrap_or_else(|| "n/a".into());
            rows.push([
                m.workload.name.clone(),
                m.backend.clone(),
                cell(&m.ttft_ms, 1, "n/a"),
                cell(&m.tok_s, 1, "n/a"),
                cell(&m.power_w, 1, &na),
                cell(&m.j_per_token, 3, &na),
                format!("{} (+{} warm-up)", m.runs.len(), m.warmup.len()),
            ]);
        }
        let mut w = header.map(str::len);
        for r in &rows {
            for (i, c) in r.iter().enumerate() {
                w[i] = w[i].max(c.chars().count());
            }
        }
        let line = |cells: &[String]| -> String {
            cells
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let pad = w[i] - c.chars().count();
                    // Text columns left, numbers right.
                    if i < 2 {
                        format!("{c}{}", " ".repeat(pad))
                    } else {
                        format!("{}{c}", " ".repeat(pad))
                    }
                })
                .collect::<Vec<_>>()
                .join("  ")
                .trim_end()
                .to_string()
        };
        let mut out = String::new();
        out.push_str(&line(&header.map(String::from)));
        out.push('\n');
        out.push_str(&line(&w.map(|n| "-".repeat(n))));
        out.push('\n');
        for r in &rows {
            out.push_str(&line(r));
            out.push('\n');
        }
        out.push_str(&format!(
            "median ±half the interquartile range of {} runs after {} warm-up runs (excluded); \
             prompts: random token ids, seed {}; greedy, end-of-generation ignored\n",
            self.method.runs, self.method.warmup, self.method.seed
        ));
        let mut seen: Vec<&str> = Vec::new();
        for m in &self.results {
            if m.power_w.is_some() && !seen.contains(&m.backend.as_str()) {
                seen.push(&m.backend);
                out.push_str(&format!(
                    "power of {}: {} (whole device, energy counter over each run)\n",
                    m.backend, m.power_source
                ));
            }
        }
        out
    }

    /// The report as pretty JSON.
    pub fn json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}
