//! The experiment page (`populora experiment`): the population against its
//! compute-matched single-adapter baseline and the untouched base model,
//! over several training seeds and both ways of matching compute.
//!
//! `DIR/report/index.html` shows the compute every run spent (the seeding
//! stage apart), the pooled differences with their seeds × problems
//! intervals for each matching, a row per seed beside them, each
//! benchmark's members against the baselines (`members.svg`/`.png`), and the
//! runs' dynamics figures side by side (linked from each run's own report).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::chart::{self, EndMark, LineChart, Panel, Series};
use super::html::STYLE;
use super::scene::{Stroke, BLACK, DASHES, MUTED, PALETTE};
use super::svg::escape;
use super::{raster, svg, ReportError};
use crate::compute::Cost;
use crate::eval::compare::Difference;
use crate::scenario::experiment::MATCH_TOLERANCE;

/// What an experiment produced (`DIR/experiment.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExperimentSummary {
    pub name: String,
    /// Each seed's runs, in the experiment file's order.
    pub seeds: Vec<SeedRuns>,
    /// The subset of HumanEval problems evaluated (`eval.problems`), when
    /// not every one was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subset: Option<Vec<String>>,
    /// The HumanEval problems that chose each seed's best and weakest
    /// member; every row is reported on the other ones.
    pub selection: Vec<String>,
    /// Problems reported on.
    pub report_problems: usize,
    /// The untouched base model per benchmark, on the reported problems.
    pub base_model: BTreeMap<String, f64>,
    pub comparisons: Vec<Comparison>,
    /// The evaluation's rows and wall time.
    pub evaluation: EvaluationTotals,
}

/// One seed of an experiment: its seeding stage and both arms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SeedRuns {
    pub seed: u64,
    /// The seeding stage both arms started from (none without `[seeding]`).
    pub seeding: Option<SeedingTotals>,
    pub population: RunTotals,
    /// Live members of the population at its end (teachers and students).
    pub members: usize,
    pub baseline: RunTotals,
    /// Where the baseline had spent what one population member spent.
    pub mark: ComputeMark,
}

/// What the seeding stage did; its compute is not part of either arm's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SeedingTotals {
    pub rounds: usize,
    pub proposals: usize,
    pub valid: usize,
    pub compute: Cost,
}

/// One run of an experiment: where it is, how far it went, what it spent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunTotals {
    pub dir: PathBuf,
    pub steps: u64,
    pub compute: Cost,
    /// Wall time of its steps (metrics.jsonl), seconds.
    pub wall_s: f64,
}

/// A baseline checkpoint at a compute target (`checkpoint.at_tflop`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ComputeMark {
    pub step: u64,
    pub target_tflop: f64,
    pub spent_tflop: f64,
}

impl ComputeMark {
    /// How far the spending is from the target, as a fraction of the target.
    pub fn gap(&self) -> f64 {
        (self.spent_tflop - self.target_tflop) / self.target_tflop.max(f64::MIN_POSITIVE)
    }
}

/// How much compute the baseline row got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Matching {
    /// What one population member spent: the population's total over its
    /// members (the paper's comparison).
    PerAdapter,
    /// What the whole population spent (the stricter test).
    Total,
}

impl Matching {
    pub const BOTH: [Matching; 2] = [Matching::PerAdapter, Matching::Total];

    pub fn name(self) -> &'static str {
        match self {
            Matching::PerAdapter => "per adapter",
            Matching::Total => "whole population",
        }
    }
}

/// One benchmark under one matching: a row per seed and the pooled
/// differences.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    pub benchmark: String,
    pub matching: Matching,
    /// Items reported on, per row.
    pub items: usize,
    pub per_seed: Vec<SeedRow>,
    /// `population group − baseline`, pooled over seeds.
    pub differences: Vec<Contrast>,
    /// Different seed multisets the bootstrap can draw (3 seeds: 10).
    pub distinct_seed_draws: u64,
}

/// One seed's scores on the reported problems.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SeedRow {
    pub seed: u64,
    /// Every member's score, by name.
    pub members: Vec<(String, f64)>,
    /// Mean over all members, over the students, over the teachers.
    pub all: f64,
    pub students: f64,
    pub teachers: f64,
    /// Chosen on the selection problems, scored on the others.
    pub best: (String, f64),
    pub weakest: (String, f64),
    pub baseline: f64,
}

/// A named difference with its interval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Contrast {
    pub label: String,
    pub difference: Difference,
}

/// The evaluation stage's size and wall time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct EvaluationTotals {
    pub rows: usize,
    pub answers: usize,
    /// Wall time of the stage as it last ran (0 when it was already done).
    pub wall_s: f64,
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
    write_file(&index, page(summary, dir).as_bytes())?;
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
    for s in &summary.seeds {
        let (p, b) = (&s.population, &s.baseline);
        let _ = writeln!(
            out,
            "seed {}: compute: population {:.2} TFLOP in {} steps, baseline {:.2} TFLOP in {} steps ({:+.1} %), per-adapter mark {:.2} of {:.2} TFLOP at step {} ({:+.1} %){}",
            s.seed,
            p.compute.flops / 1e12,
            p.steps,
            b.compute.flops / 1e12,
            b.steps,
            100.0 * compute_gap(p, b),
            s.mark.spent_tflop,
            s.mark.target_tflop,
            s.mark.step,
            100.0 * s.mark.gap(),
            s.seeding.as_ref().map_or(String::new(), |sd| format!(
                "; seeding {:.2} TFLOP apart",
                sd.compute.flops / 1e12
            )),
        );
    }
    for c in &summary.comparisons {
        let _ = writeln!(
            out,
            "{} ({} items), baseline matched {}: base model {}",
            c.benchmark,
            c.items,
            c.matching.name(),
            summary
                .base_model
                .get(&c.benchmark)
                .map_or("-".into(), |&b| percent(b)),
        );
        for row in &c.per_seed {
            let _ = writeln!(
                out,
                "  seed {}: all {}, students {}, teachers {}, best {} {}, weakest {} {}, baseline {}",
                row.seed,
                percent(row.all),
                percent(row.students),
                percent(row.teachers),
                row.best.0,
                percent(row.best.1),
                row.weakest.0,
                percent(row.weakest.1),
                percent(row.baseline),
            );
        }
        for contrast in &c.differences {
            let _ = writeln!(
                out,
                "  {}: {}",
                contrast.label,
                interval(&contrast.difference)
            );
        }
        let _ = writeln!(out, "  ({})", seed_note(c));
    }
    out
}

/// What the seed level of the intervals can resolve.
fn seed_note(c: &Comparison) -> String {
    format!(
        "intervals: bootstrap over {} seed(s) and over problems; the seed level has only {} distinct draws",
        c.per_seed.len(),
        c.distinct_seed_draws
    )
}

fn percent(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

/// `+1.2 pts [−0.5, +2.9], 95 %` and whether it excludes 0.
fn interval(d: &Difference) -> String {
    format!(
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
    )
}

fn page(summary: &ExperimentSummary, dir: &Path) -> String {
    let mut out = String::with_capacity(32 * 1024);
    let name = escape(&summary.name);
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n<title>populora experiment: {name}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n<main>\n<h1>populora experiment: {name}</h1>\n"
    );
    compute_table(&mut out, summary);
    for matching in Matching::BOTH {
        eval_table(&mut out, summary, matching);
    }
    out.push_str("<figure><img src=\"members.svg\" alt=\"members against the baselines\"/><figcaption>Each benchmark's population members of every seed, sorted by score, against the baselines (black: whole-population matching, dashed: per adapter) and the base model (grey), on the reported problems.</figcaption></figure>\n");
    dynamics(&mut out, summary, dir);
    out.push_str("</main>\n</body>\n</html>\n");
    out
}

fn compute_table(out: &mut String, summary: &ExperimentSummary) {
    out.push_str("<h2>Compute</h2>\n<table>\n<tr><th>seed</th><th>run</th><th>steps</th><th>TFLOP</th><th>wall time</th><th>prompt tokens (computed)</th><th>trained tokens (computed)</th></tr>\n");
    for s in &summary.seeds {
        if let Some(sd) = &s.seeding {
            let _ = writeln!(
                out,
                "<tr><td>{}</td><td>seeding ({} rounds, {} of {} valid)</td><td class=\"num\">–</td><td class=\"num\">{:.2}</td><td class=\"num\">–</td><td class=\"num\">{} ({})</td><td class=\"num\">–</td></tr>",
                s.seed,
                sd.rounds,
                sd.valid,
                sd.proposals,
                sd.compute.flops / 1e12,
                sd.compute.prompt_tokens,
                sd.compute.computed_prompt_tokens,
            );
        }
        for (label, run) in [("population", &s.population), ("baseline", &s.baseline)] {
            let c = &run.compute;
            let _ = writeln!(
                out,
                "<tr><td>{}</td><td>{label}</td><td class=\"num\">{}</td><td class=\"num\">{:.2}</td><td class=\"num\">{:.0} min</td><td class=\"num\">{} ({})</td><td class=\"num\">{} ({})</td></tr>",
                s.seed,
                run.steps,
                c.flops / 1e12,
                run.wall_s / 60.0,
                c.prompt_tokens,
                c.computed_prompt_tokens,
                c.trained_tokens,
                c.computed_trained_tokens,
            );
        }
        let _ = writeln!(
            out,
            "<tr><td>{}</td><td>baseline per adapter (step {})</td><td class=\"num\">{}</td><td class=\"num\">{:.2} of {:.2}</td><td class=\"num\">–</td><td class=\"num\">–</td><td class=\"num\">–</td></tr>",
            s.seed, s.mark.step, s.mark.step, s.mark.spent_tflop, s.mark.target_tflop,
        );
    }
    let e = &summary.evaluation;
    let _ = writeln!(
        out,
        "</table>\n<p class=\"small\">The baseline ran until it had spent what the whole population spent; its checkpoint where it had spent what one member spent (the population's total over its members) is the per-adapter row. Both within ±{:.0} %. FLOPs of the frozen base's forward and input-gradient backward, 2 per multiply-add, each shared prompt counted once (metrics.jsonl's <code>compute</code>); the seeding stage is reported apart and matched by neither. Evaluation: {} rows, {} answers, {:.0} min.</p>",
        100.0 * MATCH_TOLERANCE,
        e.rows,
        e.answers,
        e.wall_s / 60.0,
    );
}

fn eval_table(out: &mut String, summary: &ExperimentSummary, matching: Matching) {
    let comparisons: Vec<&Comparison> = summary
        .comparisons
        .iter()
        .filter(|c| c.matching == matching)
        .collect();
    let Some(first) = comparisons.first() else {
        return;
    };
    let _ = writeln!(
        out,
        "<h2>Baseline matched {}</h2>\n<table>\n<tr><th>benchmark</th><th>items</th><th>base model</th>{}</tr>",
        matching.name(),
        first
            .differences
            .iter()
            .map(|c| format!("<th>{}</th>", escape(&c.label)))
            .collect::<String>()
    );
    for c in &comparisons {
        let base = summary
            .base_model
            .get(&c.benchmark)
            .map_or("–".into(), |&b| percent(b));
        let cells: String = c
            .differences
            .iter()
            .map(|d| format!("<td>{}</td>", escape(&interval(&d.difference))))
            .collect();
        let _ = writeln!(
            out,
            "<tr><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{base}</td>{cells}</tr>",
            escape(&c.benchmark),
            c.items
        );
    }
    out.push_str("</table>\n<table>\n<tr><th>benchmark</th><th>seed</th><th>all</th><th>students</th><th>teachers</th><th>best</th><th>weakest</th><th>baseline</th></tr>\n");
    for c in &comparisons {
        for row in &c.per_seed {
            let _ = writeln!(
                out,
                "<tr><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{} <span class=\"small\">{}</span></td><td class=\"num\">{} <span class=\"small\">{}</span></td><td class=\"num\">{}</td></tr>",
                escape(&c.benchmark),
                row.seed,
                percent(row.all),
                percent(row.students),
                percent(row.teachers),
                percent(row.best.1),
                escape(&row.best.0),
                percent(row.weakest.1),
                escape(&row.weakest.0),
                percent(row.baseline),
            );
        }
    }
    let _ = writeln!(
        out,
        "</table>\n<p class=\"small\">Scores are pass@1 on the problems not used to choose the best and weakest members ({} chose them). Intervals: 95 %, {}; a difference is claimed only when its interval excludes 0.</p>",
        summary.selection.len(),
        escape(&seed_note(first)),
    );
}

/// Every seed's runs, their dynamics figures side by side.
fn dynamics(out: &mut String, summary: &ExperimentSummary, dir: &Path) {
    out.push_str("<h2>Dynamics, side by side</h2>\n");
    for s in &summary.seeds {
        let rel = |run: &RunTotals| {
            let path = run.dir.strip_prefix(dir).unwrap_or(&run.dir);
            format!("../{}/report", path.display())
        };
        let (p, b) = (rel(&s.population), rel(&s.baseline));
        let _ = writeln!(
            out,
            "<h3>seed {}</h3>\n<table>\n<tr><th>population</th><th>baseline</th></tr>",
            s.seed
        );
        for (figure, caption) in SIDE_BY_SIDE {
            let _ = writeln!(
                out,
                "<tr><td colspan=\"2\" class=\"small\">{}</td></tr>\n<tr><td><img src=\"{p}/{figure}.svg\" width=\"460\" alt=\"population {figure}\"/></td><td><img src=\"{b}/{figure}.svg\" width=\"460\" alt=\"baseline {figure}\"/></td></tr>",
                escape(caption)
            );
        }
        let _ = writeln!(
            out,
            "</table>\n<p class=\"small\">Each run's own report: <a href=\"{p}/index.html\">population</a>, <a href=\"{b}/index.html\">baseline</a>.</p>"
        );
    }
}

/// Per benchmark (whole-population matching), every seed's members sorted
/// (x: rank), with each seed's baselines and the base model as flat lines.
fn members_chart(summary: &ExperimentSummary) -> LineChart {
    let by_benchmark = |matching| {
        summary
            .comparisons
            .iter()
            .filter(move |c| c.matching == matching)
    };
    let per_adapter: BTreeMap<&str, &Comparison> = by_benchmark(Matching::PerAdapter)
        .map(|c| (c.benchmark.as_str(), c))
        .collect();
    let panels = by_benchmark(Matching::Total)
        .map(|c| {
            let n = summary
                .seeds
                .iter()
                .map(|s| s.members)
                .max()
                .unwrap_or(1)
                .max(1) as f64;
            let flat = |name: String, y: f64, stroke| Series {
                name,
                points: vec![(1.0, Some(y)), (n, Some(y))],
                stroke,
                end: EndMark::None,
            };
            let mut series = Vec::new();
            for (i, row) in c.per_seed.iter().enumerate() {
                let color = PALETTE[i % PALETTE.len()];
                let mut scores: Vec<f64> = row.members.iter().map(|m| m.1).collect();
                scores.sort_by(f64::total_cmp);
                series.push(Series {
                    name: format!("seed {} members", row.seed),
                    points: scores
                        .iter()
                        .enumerate()
                        .map(|(j, &s)| ((j + 1) as f64, Some(s)))
                        .collect(),
                    stroke: Stroke::solid(color, 2.0),
                    end: EndMark::None,
                });
                series.push(flat(
                    format!("seed {} baseline", row.seed),
                    row.baseline,
                    Stroke::solid(BLACK, 1.6),
                ));
                if let Some(p) = per_adapter.get(c.benchmark.as_str()) {
                    if let Some(r) = p.per_seed.iter().find(|r| r.seed == row.seed) {
                        series.push(flat(
                            format!("seed {} baseline per adapter", row.seed),
                            r.baseline,
                            Stroke {
                                dash: DASHES[1],
                                ..Stroke::solid(BLACK, 1.2)
                            },
                        ));
                    }
                }
            }
            if let Some(&base) = summary.base_model.get(&c.benchmark) {
                series.push(flat("base model".into(), base, Stroke::solid(MUTED, 1.6)));
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
        title: "Population members against the baselines".to_string(),
        x_label: "member, by score".to_string(),
        panels,
        notes: Vec::new(),
    }
}
