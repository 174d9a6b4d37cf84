//! The experiment page (`populora experiment`): the population against its
//! compute-matched single-adapter baseline and the untouched base model.
//!
//! `DIR/report/index.html` shows the compute both runs spent, the evaluation
//! table with paired-bootstrap intervals (population mean − baseline and
//! weakest member − baseline), each benchmark's members against the baseline
//! (`members.svg`/`.png`), and the two runs' dynamics figures side by side
//! (linked from `DIR/population/report/` and `DIR/baseline/report/`, which
//! the runs' own reports fill).

use std::fmt::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::chart::{self, EndMark, LineChart, Panel, Series};
use super::html::STYLE;
use super::scene::{Stroke, BLACK, MUTED, PALETTE};
use super::svg::escape;
use super::{raster, svg, ReportError};
use crate::compute::Cost;
use crate::eval::compare::{BenchmarkComparison, Difference};
use crate::scenario::experiment::MATCH_TOLERANCE;

/// What an experiment produced (`DIR/experiment.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExperimentSummary {
    pub name: String,
    pub population: RunTotals,
    pub baseline: RunTotals,
    pub benchmarks: Vec<BenchmarkComparison>,
}

/// One run of an experiment: where it is, how far it went, what it spent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunTotals {
    pub dir: PathBuf,
    pub steps: u64,
    pub compute: Cost,
}

/// How far the baseline's compute is from the population's, as a fraction
/// of the population's (+0.03: the baseline spent 3 % more).
pub fn compute_gap(population: &RunTotals, baseline: &RunTotals) -> f64 {
    let (p, b) = (population.compute.flops, baseline.compute.flops);
    (b - p) / p.max(1.0)
}

/// Dynamics figures shown for both runs, with what they show.
const SIDE_BY_SIDE: [(&str, &str); 5] = [
    (
        "solve_rate",
        "solve rate per task kind (does it oscillate or settle?)",
    ),
    ("complexity", "complexity of the valid programs"),
    ("coverage", "coverage: distinct program signatures"),
    ("proposals", "valid proposals and learnable problems"),
    ("ratings", "TrueSkill ratings (their spread)"),
];

/// Writes `DIR/report/index.html` and the members figure; returns the page's path.
pub fn write(dir: &Path, summary: &ExperimentSummary) -> Result<PathBuf, ReportError> {
    let out = dir.join("report");
    std::fs::create_dir_all(&out).map_err(|source| ReportError::Io {
        path: out.clone(),
        source,
    })?;
    let scene = chart::render(&members_chart(summary));
    write_file(&out.join("members.svg"), svg::to_svg(&scene).as_bytes())?;
    let png_path = out.join("members.png");
    let png = raster::to_png(&scene).map_err(|message| ReportError::Png {
        path: png_path.clone(),
        message,
    })?;
    write_file(&png_path, &png)?;
    let index = out.join(super::INDEX);
    write_file(&index, page(summary).as_bytes())?;
    Ok(index)
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), ReportError> {
    std::fs::write(path, bytes).map_err(|source| ReportError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// The comparison as plain text (what `populora experiment` prints).
pub fn text(summary: &ExperimentSummary) -> String {
    let mut out = String::new();
    let (p, b) = (&summary.population.compute, &summary.baseline.compute);
    let _ = writeln!(
        out,
        "compute: population {:.1} TFLOP in {} steps, baseline {:.1} TFLOP in {} steps ({:+.1} %)",
        p.flops / 1e12,
        summary.population.steps,
        b.flops / 1e12,
        summary.baseline.steps,
        100.0 * compute_gap(&summary.population, &summary.baseline)
    );
    for c in &summary.benchmarks {
        let _ = writeln!(
            out,
            "{} ({} items): population mean {} (best {} {}, weakest {} {}), baseline {}, base model {}",
            c.benchmark,
            c.items,
            percent(c.population_mean),
            c.best.0,
            percent(c.best.1),
            c.weakest.0,
            percent(c.weakest.1),
            percent(c.baseline),
            c.base_model.map_or("-".into(), percent)
        );
        for (label, d) in [
            ("population mean − baseline", c.mean_minus_baseline),
            ("weakest − baseline", c.weakest_minus_baseline),
        ] {
            let _ = writeln!(out, "  {label}: {}", interval(d.as_ref()));
        }
    }
    out
}

fn percent(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

/// `+1.2 pts [−0.5, +2.9], 95 %` and whether it excludes 0.
fn interval(d: Option<&Difference>) -> String {
    match d {
        Some(d) => format!(
            "{:+.1} pts [{:+.1}, {:+.1}] (95 %, {} resamples): {}",
            100.0 * d.estimate,
            100.0 * d.low,
            100.0 * d.high,
            d.resamples,
            if d.excludes_zero() {
                "excludes 0"
            } else {
                "includes 0: no difference shown"
            }
        ),
        None => "-".into(),
    }
}

fn page(summary: &ExperimentSummary) -> String {
    let mut out = String::with_capacity(16 * 1024);
    let name = escape(&summary.name);
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n<title>populora experiment: {name}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n<main>\n<h1>populora experiment: {name}</h1>\n"
    );
    compute_table(&mut out, summary);
    eval_table(&mut out, summary);
    out.push_str("<figure><img src=\"members.svg\" alt=\"members against the baseline\"/><figcaption>Each benchmark's population members, sorted by score, against the baseline (black) and the base model (grey).</figcaption></figure>\n");
    out.push_str(
        "<h2>Dynamics, side by side</h2>\n<table>\n<tr><th>population</th><th>baseline</th></tr>\n",
    );
    for (figure, caption) in SIDE_BY_SIDE {
        let _ = writeln!(
            out,
            "<tr><td colspan=\"2\" class=\"small\">{}</td></tr>\n<tr><td><img src=\"../population/report/{figure}.svg\" width=\"460\" alt=\"population {figure}\"/></td><td><img src=\"../baseline/report/{figure}.svg\" width=\"460\" alt=\"baseline {figure}\"/></td></tr>",
            escape(caption)
        );
    }
    out.push_str("</table>\n<p class=\"small\">Each run's own report: <a href=\"../population/report/index.html\">population</a>, <a href=\"../baseline/report/index.html\">baseline</a>.</p>\n</main>\n</body>\n</html>\n");
    out
}

fn compute_table(out: &mut String, summary: &ExperimentSummary) {
    out.push_str("<h2>Compute</h2>\n<table>\n<tr><th>run</th><th>steps</th><th>TFLOP</th><th>generated tokens</th><th>prompt tokens</th><th>trained tokens</th></tr>\n");
    for (label, run) in [
        ("population", &summary.population),
        ("baseline", &summary.baseline),
    ] {
        let c = &run.compute;
        let _ = writeln!(
            out,
            "<tr><td>{label}</td><td class=\"num\">{}</td><td class=\"num\">{:.1}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td></tr>",
            run.steps,
            c.flops / 1e12,
            c.generated_tokens,
            c.prompt_tokens,
            c.trained_tokens
        );
    }
    let _ = writeln!(
        out,
        "</table>\n<p class=\"small\">The baseline ran until it had spent what the population spent: {:+.1} % apart (allowed ±{:.0} %). FLOPs of the frozen base's forward and input-gradient backward, 2 per multiply-add (metrics.jsonl's <code>compute</code>).</p>",
        100.0 * compute_gap(&summary.population, &summary.baseline),
        100.0 * MATCH_TOLERANCE
    );
}

fn eval_table(out: &mut String, summary: &ExperimentSummary) {
    out.push_str("<h2>Evaluation</h2>\n<table>\n<tr><th>benchmark</th><th>items</th><th>population mean</th><th>best</th><th>weakest</th><th>baseline</th><th>base model</th><th>mean − baseline</th><th>weakest − baseline</th></tr>\n");
    for c in &summary.benchmarks {
        let _ = writeln!(
            out,
            "<tr><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{} <span class=\"small\">{}</span></td><td class=\"num\">{} <span class=\"small\">{}</span></td><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td><td>{}</td></tr>",
            escape(&c.benchmark),
            c.items,
            percent(c.population_mean),
            percent(c.best.1),
            escape(&c.best.0),
            percent(c.weakest.1),
            escape(&c.weakest.0),
            percent(c.baseline),
            c.base_model.map_or("–".into(), percent),
            escape(&interval(c.mean_minus_baseline.as_ref())),
            escape(&interval(c.weakest_minus_baseline.as_ref())),
        );
    }
    out.push_str("</table>\n<p class=\"small\">Scores are pass@1 (the mean fraction of an item's samples that passed). Intervals: paired bootstrap over items, 95 %; a difference is claimed only when its interval excludes 0. The interval covers which items the benchmark holds, not the spread between training runs: each side is one run of one seed.</p>\n");
}

/// Per benchmark, the members' scores sorted (x: rank), with the baseline
/// and the base model as flat lines.
fn members_chart(summary: &ExperimentSummary) -> LineChart {
    let panels = summary
        .benchmarks
        .iter()
        .map(|c| {
            let mut scores: Vec<f64> = c.members.iter().map(|(_, s)| *s).collect();
            scores.sort_by(f64::total_cmp);
            let n = scores.len().max(1) as f64;
            let flat = |name: &str, y: f64, stroke| Series {
                name: name.to_string(),
                points: vec![(1.0, Some(y)), (n, Some(y))],
                stroke,
                end: EndMark::None,
            };
            let mut series = vec![Series {
                name: "members (sorted)".to_string(),
                points: scores
                    .iter()
                    .enumerate()
                    .map(|(i, &s)| ((i + 1) as f64, Some(s)))
                    .collect(),
                stroke: Stroke::solid(PALETTE[0], 2.0),
                end: EndMark::None,
            }];
            series.push(flat("baseline", c.baseline, Stroke::solid(BLACK, 2.0)));
            if let Some(base) = c.base_model {
                series.push(flat("base model", base, Stroke::solid(MUTED, 1.6)));
            }
            Panel {
                title: Some(c.benchmark.clone()),
                y_label: "pass@1".to_string(),
                series,
                y_range: None,
            }
        })
        .collect();
    LineChart {
        title: "Population members against the baseline".to_string(),
        x_label: "member, by score".to_string(),
        panels,
        notes: Vec::new(),
    }
}
