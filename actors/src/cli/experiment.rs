//! `populora experiment EXPERIMENT.toml [--out DIR]`: a population and a
//! compute-matched single-adapter baseline, run, evaluated and compared.
//!
//! Stages, each skipped when its output is complete, so an interrupted
//! experiment continues with the same command:
//! 1. `DIR/population/`: the population scenario (resumed from its last
//!    checkpoint when it was interrupted);
//! 2. `DIR/baseline/`: the baseline scenario with its compute budget set to
//!    what the population spent (`budget_tflop`); the two totals must agree
//!    within 5 %;
//! 3. `DIR/eval/`: every live population member, the baseline and the
//!    untouched base model on the benchmarks, every answer recorded (batch
//!    by batch in `progress-<benchmark>.jsonl` while it runs, so an
//!    interrupted evaluation continues after its last whole batch);
//! 4. `DIR/experiment.json` (rows, paired-bootstrap intervals, compute) and
//!    `DIR/report/index.html` (with each run's own report beside it).
//!
//! A run stage counts as done once its journal holds an `end` event (a run
//! stopped with `ctl stop` included). The experiment file is compared with
//! the copy kept in `DIR`; the two scenario files are read again on every
//! invocation, so an edit reaches only the stages not yet done: to re-run a
//! stage with an edited scenario, delete its directory (and `DIR/eval`).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Parser;
use populora::eval::compare::{compare, BenchmarkComparison};
use populora::eval::ItemRecord;
use populora::keyed_stream;
use populora::report::experiment::{compute_gap, ExperimentSummary, RunTotals};
use populora::run_files::MetricsLine;
use populora::scenario::experiment::{Experiment, LoadedExperiment, MATCH_TOLERANCE};
use populora::scenario::{check_operator, Scenario};
use populora::verify::{SandboxConfig, VerifierPool};

use super::eval::{self, Options, BASE_ROW};
use crate::runtime::engine::Engine;
use crate::runtime::journal::{self, Event};
use crate::runtime::replay;
use crate::runtime::rundir::RunDir;

#[derive(Parser)]
pub struct Args {
    /// An experiment file (see experiments/).
    pub experiment: PathBuf,
    /// Where everything goes (default: runs/<name>-experiment). Running the
    /// same command again continues an interrupted experiment.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let loaded = Experiment::from_file(&args.experiment, check_operator)?;
    let name = loaded.experiment.name.clone();
    let out = args
        .out
        .unwrap_or_else(|| PathBuf::from("runs").join(format!("{name}-experiment")));
    claim(&out, &args.experiment)?;
    eprintln!("experiment {name}: {}", out.display());

    let population = run_stage(&out.join("population"), loaded.population.clone())?;
    let mut baseline_scenario = loaded.baseline.clone();
    baseline_scenario.budget_tflop = Some(population.compute.flops / 1e12);
    let baseline = run_stage(&out.join("baseline"), baseline_scenario)?;
    check_match(&population, &baseline)?;

    let records = evaluate(&out, &loaded)?;
    let benchmarks = comparisons(&loaded, &out, &records)?;
    let summary = ExperimentSummary {
        name,
        population,
        baseline,
        benchmarks,
    };
    std::fs::write(
        out.join("experiment.json"),
        serde_json::to_vec_pretty(&summary)?,
    )?;
    for run in ["population", "baseline"] {
        let dir = out.join(run);
        populora::report::write(&dir, dir.join("report"))?;
    }
    let index = populora::report::experiment::write(&out, &summary)?;
    println!("{}", populora::report::experiment::text(&summary));
    println!("{}", index.display());
    Ok(())
}

/// `DIR` holds this experiment: a copy of its file is kept there, and an
/// experiment directory of another file (other settings, not just other
/// comments) is refused rather than mixed.
fn claim(out: &Path, file: &Path) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(file)?;
    let copy = out.join("experiment.toml");
    match std::fs::read_to_string(&copy) {
        Ok(existing) if !Experiment::same_settings(&existing, &text) => bail!(
            "{} holds another experiment (its experiment.toml differs from {}); choose another --out",
            out.display(),
            file.display()
        ),
        Ok(_) => Ok(()),
        Err(_) => {
            std::fs::create_dir_all(out)?;
            Ok(std::fs::write(copy, text)?)
        }
    }
}

/// Run `scenario` in `dir`, or finish it there, or read what it did.
fn run_stage(dir: &Path, scenario: Scenario) -> anyhow::Result<RunTotals> {
    let journal_path = RunDir::new(dir).journal();
    let ended = journal_path.exists()
        && journal::read(&journal_path)?
            .iter()
            .any(|e| matches!(e, Event::End { .. }));
    if !ended {
        let has_checkpoint = RunDir::new(dir).latest_checkpoint()?.is_some();
        if has_checkpoint {
            eprintln!("{}: resuming", dir.display());
            replay::resume(dir)?;
        } else {
            // Nothing to resume: start over (an interrupted first step leaves only logs).
            if dir.exists() {
                std::fs::remove_dir_all(dir)?;
            }
            eprintln!("{}: running {}", dir.display(), scenario.name);
            replay::fresh(scenario, dir)?;
        }
    }
    totals(dir)
}

/// Steps and compute of a finished run, from its last metrics line.
fn totals(dir: &Path) -> anyhow::Result<RunTotals> {
    let path = RunDir::new(dir).metrics();
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let last = text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .with_context(|| format!("{} has no steps", path.display()))?;
    let line: MetricsLine = serde_json::from_str(last)
        .with_context(|| format!("{}: the last line is not a metrics line", path.display()))?;
    let compute = line.compute_total.with_context(|| {
        format!(
            "{}: no compute_total (a run from before compute was counted)",
            path.display()
        )
    })?;
    Ok(RunTotals {
        dir: dir.to_path_buf(),
        steps: line.step,
        compute,
    })
}

/// The baseline spent what the population spent, within [`MATCH_TOLERANCE`].
fn check_match(population: &RunTotals, baseline: &RunTotals) -> anyhow::Result<()> {
    let (p, b) = (population.compute.flops, baseline.compute.flops);
    let gap = compute_gap(population, baseline);
    if gap.abs() <= MATCH_TOLERANCE {
        return Ok(());
    }
    let base_dir = baseline.dir.display();
    let why = if gap < 0.0 {
        format!(
            "it ran out of steps ({}) first; raise `steps` in the baseline scenario, delete {base_dir}",
            baseline.steps
        )
    } else {
        format!(
            "one baseline step is too large a share of the budget; run the population longer \
             (raise its `steps`, delete {} and {base_dir})",
            population.dir.display()
        )
    };
    bail!(
        "the baseline spent {:.3} TFLOP against the population's {:.3} ({:+.1} %, allowed ±{:.0} %): {why}, then run the experiment again",
        b / 1e12,
        p / 1e12,
        100.0 * gap,
        100.0 * MATCH_TOLERANCE,
    )
}

/// Every answer of every row, from `DIR/eval/items.jsonl` when the stage is
/// done, else by evaluating now.
fn evaluate(out: &Path, loaded: &LoadedExperiment) -> anyhow::Result<Vec<ItemRecord>> {
    let items = out.join("eval").join("items.jsonl");
    if !items.exists() {
        let e = &loaded.experiment.eval;
        let options = Options {
            benchmarks: e.benchmarks.join(","),
            gsm8k: None,
            math: None,
            tasks: None,
            limit: e.limit,
            samples: e.samples,
            k: e.k,
            max_new_tokens: e.max_new_tokens,
            batch: e.batch,
            constrained: true,
            progress: Some(out.join("eval")),
        };
        let engine = Engine::load(&loaded.population, &mut |m| eprintln!("{m}"))?;
        let pool = VerifierPool::new(SandboxConfig::default())?;
        let mut rows = eval::members(&out.join("population"), "")?;
        rows.extend(eval::members(&out.join("baseline"), "baseline/")?);
        rows.push((BASE_ROW.to_string(), None));
        let seed = loaded.population.seed;
        std::fs::create_dir_all(out.join("eval"))?;
        let evaluation = eval::evaluate_rows(&options, &engine, &pool, &rows, seed)?;
        // Writes items.jsonl last, whole: its presence means the stage is done.
        eval::write(out, &evaluation)?;
        remove_progress(&out.join("eval"))?;
    }
    let text = std::fs::read_to_string(&items)?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l).with_context(|| format!("{} line {}", items.display(), i + 1))
        })
        .collect()
}

/// The per-batch answer files of a finished evaluation (items.jsonl holds them all).
fn remove_progress(dir: &Path) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().to_string());
        if name.is_some_and(|n| n.starts_with("progress-") && n.ends_with(".jsonl")) {
            std::fs::remove_file(&path)?;
        }
    }
    Ok(())
}

/// Each benchmark's rows and intervals.
fn comparisons(
    loaded: &LoadedExperiment,
    out: &Path,
    records: &[ItemRecord],
) -> anyhow::Result<Vec<BenchmarkComparison>> {
    let members = eval::member_names(&out.join("population"))?;
    let baseline = eval::member_names(&out.join("baseline"))?
        .into_iter()
        .next()
        .map(|name| format!("baseline/{name}"))
        .context("the baseline run saved no member")?;
    let mut benchmarks: Vec<&str> = Vec::new();
    for r in records {
        if !benchmarks.contains(&r.benchmark.as_str()) {
            benchmarks.push(&r.benchmark);
        }
    }
    let seed = loaded.population.seed;
    let resamples = loaded.experiment.eval.bootstrap;
    benchmarks
        .into_iter()
        .map(|b| {
            let mut rng = keyed_stream!(seed, "experiment-bootstrap", b);
            compare(
                records,
                b,
                &members,
                &baseline,
                Some(BASE_ROW),
                resamples,
                &mut rng,
            )
            .with_context(|| {
                format!("{b}: the records hold no answers of the population or of {baseline}")
            })
        })
        .collect()
}
