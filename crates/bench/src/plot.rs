//! SVG charts (plotters' SVG backend: text is written as `<text>` elements, so no font or
//! system library is needed).

use std::path::Path;

use plotters::prelude::*;

use crate::measure::Measurement;
use crate::BenchError;

/// One line of a chart.
#[derive(Clone, Debug)]
pub struct Series {
    pub label: String,
    /// `(x, y)`, in x order.
    pub points: Vec<(f64, f64)>,
}

/// One chart: lines, and vertical markers (`(x, label)`).
#[derive(Clone, Debug)]
pub struct Panel {
    pub title: String,
    pub x_desc: String,
    pub y_desc: String,
    pub series: Vec<Series>,
    pub markers: Vec<(f64, String)>,
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// Draw `panels` side by side into an SVG file at `path`.
pub fn draw(path: &Path, panels: &[Panel]) -> Result<(), BenchError> {
    let err = |e: String| BenchError::Output {
        path: path.display().to_string(),
        why: e,
    };
    let n = panels.len().max(1) as u32;
    let root = SVGBackend::new(path, (560 * n, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let areas = root.split_evenly((1, n as usize));
    for (p, area) in panels.iter().zip(areas.iter()) {
        let pts = p.series.iter().flat_map(|s| s.points.iter());
        let (mut x1, mut y1) = (1.0f64, 1.0f64);
        for &(x, y) in pts {
            x1 = x1.max(x);
            y1 = y1.max(y);
        }
        for (x, _) in &p.markers {
            x1 = x1.max(*x);
        }
        let mut chart = ChartBuilder::on(area)
            .caption(&p.title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..x1 * 1.05, 0f64..y1 * 1.1)
            .map_err(|e| err(e.to_string()))?;
        chart
            .configure_mesh()
            .x_desc(p.x_desc.as_str())
            .y_desc(p.y_desc.as_str())
            .draw()
            .map_err(|e| err(e.to_string()))?;
        for (i, s) in p.series.iter().enumerate() {
            let c = COLORS[i % COLORS.len()];
            chart
                .draw_series(LineSeries::new(s.points.iter().copied(), c.stroke_width(2)))
                .map_err(|e| err(e.to_string()))?
                .label(s.label.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c));
            chart
                .draw_series(
                    s.points
                        .iter()
                        .map(|&(x, y)| Circle::new((x, y), 3, c.filled())),
                )
                .map_err(|e| err(e.to_string()))?;
        }
        for (x, label) in &p.markers {
            let top = y1 * 1.1;
            chart
                .draw_series(LineSeries::new(vec![(*x, 0.0), (*x, top)], BLACK.mix(0.5)))
                .map_err(|e| err(e.to_string()))?;
            chart
                .draw_series(std::iter::once(Text::new(
                    label.clone(),
                    (*x, top * 0.97),
                    ("sans-serif", 12),
                )))
                .map_err(|e| err(e.to_string()))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(e.to_string()))?;
    }
    root.present().map_err(|e| err(e.to_string()))
}

/// Bench chart: time to first token and tokens/s against prompt length, one line per backend
/// and concurrency (medians).
pub fn bench_panels(results: &[Measurement]) -> Vec<Panel> {
    let mut keys: Vec<(String, usize)> = Vec::new();
    for m in results {
        let k = (m.backend.clone(), m.workload.concurrency);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    let series = |f: &dyn Fn(&Measurement) -> Option<f64>| -> Vec<Series> {
        keys.iter()
            .map(|(b, c)| {
                let mut points: Vec<(f64, f64)> = results
                    .iter()
                    .filter(|m| &m.backend == b && m.workload.concurrency == *c)
                    .filter_map(|m| f(m).map(|y| (m.workload.prompt as f64, y)))
                    .collect();
                points.sort_by(|a, b| a.0.total_cmp(&b.0));
                Series {
                    label: if *c == 1 {
                        b.clone()
                    } else {
                        format!("{b} x{c}")
                    },
                    points,
                }
            })
            .filter(|s| !s.points.is_empty())
            .collect()
    };
    vec![
        Panel {
            title: "time to first token".into(),
            x_desc: "prompt tokens".into(),
            y_desc: "ms (median)".into(),
            series: series(&|m| m.ttft_ms.as_ref().map(|s| s.median)),
            markers: Vec::new(),
        },
        Panel {
            title: "generation".into(),
            x_desc: "prompt tokens".into(),
            y_desc: "tokens/s (median)".into(),
            series: series(&|m| m.tok_s.as_ref().map(|s| s.median)),
            markers: Vec::new(),
        },
    ]
}
