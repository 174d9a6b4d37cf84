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
use crate::run_files::MetricsLine;
pub use crate::scenario::experiment::Matching;
use crate::scenario::experiment::MATCH_TOLERANCE;

/// What an experiment produced (`DIR/experiment.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExperimentSummary {
    pub name: String,
    /// Each arm's resolved-settings hash (`Scenario::settings_hash`), by
    /// arm, recorded when the experiment started: every piece ran under it.
    pub scenarios: BTreeMap<String, String>,
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
    /// Where the baseline had spent what one population member spent
    /// (`None` when the experiment's `matching` leaves it out).
    #[serde(default)]
    pub mark: Option<ComputeMark>,
    /// Where the baseline had spent what the whole population spent: the
    /// nearer of its last step and the one before it (`None` when the
    /// experiment's `matching` leaves it out).
    #[serde(default)]
    pub total_mark: Option<ComputeMark>,
    /// What each arm trained on, up to its evaluated step.
    pub trained: ArmsTrained,
}

impl SeedRuns {
    /// The baseline's compute mark under `matching`, if it was run.
    pub fn mark(&self, matching: Matching) -> Option<&ComputeMark> {
        match matching {
            Matching::PerAdapter => self.mark.as_ref(),
            Matching::Total => self.total_mark.as_ref(),
        }
    }

    /// The marks of the matchings that were run, in report order.
    pub fn marks(&self) -> impl Iterator<Item = (Matching, &ComputeMark)> {
        Matching::BOTH
            .into_iter()
            .filter_map(|m| Some((m, self.mark(m)?)))
    }
}

/// What each evaluated arm trained on: FLOPs are the matching rule, and
/// these say what the FLOPs bought.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArmsTrained {
    pub population: TrainedOn,
    /// The baseline up to its per-adapter mark, and up to its total mark
    /// (each `None` when the experiment's `matching` leaves it out).
    #[serde(default)]
    pub baseline_per_adapter: Option<TrainedOn>,
    #[serde(default)]
    pub baseline_total: Option<TrainedOn>,
}

impl ArmsTrained {
    /// The baseline up to its mark under `matching`, if it was run.
    pub fn baseline(&self, matching: Matching) -> Option<&TrainedOn> {
        match matching {
            Matching::PerAdapter => self.baseline_per_adapter.as_ref(),
            Matching::Total => self.baseline_total.as_ref(),
        }
    }
}

/// A run's rollouts and updates up to one of its steps (`metrics.jsonl`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainedOn {
    pub steps: u64,
    /// Rollouts generated (proposer and solver).
    pub rollouts: usize,
    /// Rollouts with a non-zero TRR++ advantage: the ones that move the
    /// policy (the train step skips the others).
    pub nonzero_rollouts: usize,
    /// Optimizer steps summed over the adapters, and the adapters that
    /// took them (every member that ever trained, evolution's newborns
    /// included; 1 for the baseline).
    pub optimizer_steps: usize,
    pub adapters: usize,
    /// Solver rollouts, and those on buffer problems rather than a matched
    /// teacher's (`None` for runs from before they were counted).
    pub solver_rollouts: Option<usize>,
    pub buffer_rollouts: Option<usize>,
}

impl TrainedOn {
    /// From a run's metrics lines, steps `1..=until`.
    pub fn of(lines: &[MetricsLine], until: u64) -> TrainedOn {
        let lines: Vec<&MetricsLine> = lines.iter().filter(|l| l.step <= until).collect();
        let groups = || {
            lines
                .iter()
                .flat_map(|l| &l.members)
                .flat_map(|m| &m.groups)
        };
        let counted = |field: fn(&MetricsLine) -> Option<usize>| {
            lines.iter().map(|l| field(l)).sum::<Option<usize>>()
        };
        let updates: Vec<&str> = lines
            .iter()
            .flat_map(|l| &l.members)
            .filter(|m| m.grad_norm.is_some())
            .map(|m| m.id.as_str())
            .collect();
        let adapters: std::collections::BTreeSet<&str> = updates.iter().copied().collect();
        TrainedOn {
            steps: lines.len() as u64,
            rollouts: groups().map(|g| g.rollouts).sum(),
            nonzero_rollouts: groups().map(|g| g.nonzero_advantage).sum(),
            optimizer_steps: updates.len(),
            adapters: adapters.len(),
            solver_rollouts: counted(|l| l.solver_rollouts),
            buffer_rollouts: counted(|l| l.buffer_rollouts),
        }
    }

    pub fn steps_per_adapter(&self) -> f64 {
        self.optimizer_steps as f64 / self.adapters.max(1) as f64
    }

    pub fn nonzero_share(&self) -> f64 {
        self.nonzero_rollouts as f64 / self.rollouts.max(1) as f64
    }

    pub fn buffer_share(&self) -> Option<f64> {
        Some(self.buffer_rollouts? as f64 / self.solver_rollouts?.max(1) as f64)
    }
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
    /// The members that tied for best (weakest) on the selection problems,
    /// among which a draw seeded by the first seed, the benchmark and this
    /// seed chose it (the weakest among those left once the best was
    /// drawn); empty when one member was alone.
    #[serde(default)]
    pub best_drawn_from: Vec<String>,
    #[serde(default)]
    pub weakest_drawn_from: Vec<String>,
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

/// A chosen member's name, saying so when it was drawn from a tie.
fn chosen(name: &str, drawn_from: &[String]) -> String {
    match drawn_from.len() {
        0 => name.to_string(),
        n => format!("{name} (drawn from {n} tied)"),
    }
}

/// The comparison as plain text (what `populora experiment` prints).
pub fn text(summary: &ExperimentSummary) -> String {
    let mut out = String::new();
    for s in &summary.seeds {
        let (p, b) = (&s.population, &s.baseline);
        let marks: String = s
            .marks()
            .map(|(m, mark)| {
                format!(
                    ", baseline matched {} {:.2} of {:.2} TFLOP at step {} ({:+.1} %)",
                    m.name(),
                    mark.spent_tflop,
                    mark.target_tflop,
                    mark.step,
                    100.0 * mark.gap()
                )
            })
            .collect();
        let _ = writeln!(
            out,
            "seed {}: compute: population {:.2} TFLOP in {} steps, baseline {:.2} TFLOP in {} steps{marks}{}",
            s.seed,
            p.compute.flops / 1e12,
            p.steps,
            b.compute.flops / 1e12,
            b.steps,
            s.seeding.as_ref().map_or(String::new(), |sd| format!(
                "; seeding {:.2} TFLOP apart",
                sd.compute.flops / 1e12
            )),
        );
        for (label, line) in trained_lines(s) {
            let _ = writeln!(out, "  {label}: {line}");
        }
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
                chosen(&row.best.0, &row.best_drawn_from),
                percent(row.best.1),
                chosen(&row.weakest.0, &row.weakest_drawn_from),
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
    trained_table(&mut out, summary);
    for matching in Matching::BOTH {
        eval_table(&mut out, summary, matching);
    }
    out.push_str("<figure><img src=\"members.svg\" alt=\"members against the baselines\"/><figcaption>Each benchmark's population members of every seed, sorted by score, against the baselines (black: whole-population matching, dashed: per adapter; black alone: per adapter, where it is the only matching run) and the base model (grey), on the reported problems.</figcaption></figure>\n");
    dynamics(&mut out, summary, dir);
    out.push_str("</main>\n</body>\n</html>\n");
    out
}

/// Each arm's rows of what it trained on, labelled: the population, then
/// the baseline under each matching that was run.
fn arms(s: &SeedRuns) -> Vec<(String, &TrainedOn)> {
    let baselines = Matching::BOTH
        .iter()
        .filter_map(|&m| Some((format!("baseline {}", m.name()), s.trained.baseline(m)?)));
    std::iter::once(("population".to_string(), &s.trained.population))
        .chain(baselines)
        .collect()
}

/// What an arm's FLOPs bought, as cells: steps, rollouts, those with a
/// non-zero advantage, optimizer steps per adapter, the buffer share.
fn trained_cells(t: &TrainedOn) -> [String; 5] {
    [
        t.steps.to_string(),
        t.rollouts.to_string(),
        format!(
            "{} ({:.0} %)",
            t.nonzero_rollouts,
            100.0 * t.nonzero_share()
        ),
        format!(
            "{:.1} ({} adapters ever)",
            t.steps_per_adapter(),
            t.adapters
        ),
        t.buffer_share()
            .map_or("not counted".into(), |b| format!("{:.0} %", 100.0 * b)),
    ]
}

/// What the FLOPs bought: one line per arm, `(label, text)`.
fn trained_lines(s: &SeedRuns) -> Vec<(String, String)> {
    arms(s)
        .into_iter()
        .map(|(label, t)| {
            let [steps, rollouts, nonzero, per_adapter, buffer] = trained_cells(t);
            let text = format!(
                "{steps} steps, {rollouts} rollouts, {nonzero} with a non-zero advantage, optimizer steps per adapter {per_adapter}, solver rollouts on buffer problems {buffer}"
            );
            (label, text)
        })
        .collect()
}

fn trained_table(out: &mut String, summary: &ExperimentSummary) {
    out.push_str("<h2>What each arm trained on</h2>\n<table>\n<tr><th>seed</th><th>arm</th><th>steps</th><th>rollouts</th><th>non-zero advantage</th><th>optimizer steps per adapter</th><th>solver rollouts on buffer problems</th></tr>\n");
    for s in &summary.seeds {
        for (label, t) in arms(s) {
            let cells: String = trained_cells(t)
                .iter()
                .map(|c| format!("<td class=\"num\">{}</td>", escape(c)))
                .collect();
            let _ = writeln!(out, "<tr><td>{}</td><td>{label}</td>{cells}</tr>", s.seed);
        }
    }
    out.push_str("</table>\n<p class=\"small\">Compute is matched on FLOPs; a rollout whose advantage is 0 adds nothing to the gradient and costs no train-step FLOPs, so an arm with smaller advantage groups buys fewer trained rollouts than generated ones. Up to each row's evaluated step.</p>\n");
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
        for (matching, mark) in s.marks() {
            let label = format!("baseline {}", matching.name());
            let _ = writeln!(
                out,
                "<tr><td>{}</td><td>{label} (step {})</td><td class=\"num\">{}</td><td class=\"num\">{:.2} of {:.2} ({:+.2} %)</td><td class=\"num\">–</td><td class=\"num\">–</td><td class=\"num\">–</td></tr>",
                s.seed,
                mark.step,
                mark.step,
                mark.spent_tflop,
                mark.target_tflop,
                100.0 * mark.gap(),
            );
        }
    }
    let e = &summary.evaluation;
    let _ = writeln!(
        out,
        "</table>\n<p class=\"small\">The baseline ran until it had spent what the whole population spent (with the per-adapter matching alone, what one member spent); the whole-population row is the nearer of its last step and the one before, and the per-adapter row its step nearest what one member spent (the population's total over its members), each chosen after the fact among checkpoints kept around its target, within ±{:.0} %. FLOPs of the frozen base's forward and input-gradient backward, 2 per multiply-add, each shared prompt counted once (metrics.jsonl's <code>compute</code>); the seeding stage is reported apart and matched by neither. Evaluation: {} rows, {} answers, {:.0} min.</p>",
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
                escape(&chosen(&row.best.0, &row.best_drawn_from)),
                percent(row.weakest.1),
                escape(&chosen(&row.weakest.0, &row.weakest_drawn_from)),
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

/// Per benchmark, every seed's members sorted (x: rank), with each seed's
/// baselines (solid: the whole-population matching where it was run, else
/// the per-adapter one; dashed: the per-adapter one beside it) and the base
/// model as flat lines.
fn members_chart(summary: &ExperimentSummary) -> LineChart {
    let by_benchmark = |matching| {
        summary
            .comparisons
            .iter()
            .filter(move |c| c.matching == matching)
    };
    let ran_total = summary
        .comparisons
        .iter()
        .any(|c| c.matching == Matching::Total);
    let (solid, dashed) = match ran_total {
        true => (Matching::Total, Some(Matching::PerAdapter)),
        false => (Matching::PerAdapter, None),
    };
    let per_adapter: BTreeMap<&str, &Comparison> = dashed
        .into_iter()
        .flat_map(by_benchmark)
        .map(|c| (c.benchmark.as_str(), c))
        .collect();
    let panels = by_benchmark(solid)
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
                    format!("seed {} baseline {}", row.seed, solid.name()),
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
