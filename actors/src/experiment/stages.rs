//! The experiment's stages and their files: the directory claimed for one
//! experiment file, each seed's seeding stage and runs (started, resumed or
//! read back), and the evaluation of every row. Each stage's output says
//! whether it is done, so running the same command again continues.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use populora::eval::ItemRecord;
use populora::keyed_stream;
use populora::report::experiment::{
    EvaluationTotals, Matching, RunTotals, SeedRuns, SeedingTotals,
};
use populora::run_files::MetricsLine;
use populora::scenario::experiment::{Experiment, LoadedExperiment};
use populora::scenario::Scenario;
use populora::selfplay::{Seeded, SeedingConfig};
use populora::verify::{SandboxConfig, VerifierPool};
use rand::seq::SliceRandom;

use super::evaluate::{self, Options, BASE_ROW};
use crate::runtime::engine::Engine;
use crate::runtime::journal::{self, Event};
use crate::runtime::replay;
use crate::runtime::rundir::RunDir;
use crate::runtime::seeding;

/// `DIR` holds this experiment: a copy of its file is kept there, and an
/// experiment directory of another file (other settings, not just other
/// comments) is refused rather than mixed.
pub fn claim(out: &Path, file: &Path) -> anyhow::Result<()> {
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

/// `scenario` with its seed set to `seed`.
pub fn with_seed(scenario: &Scenario, seed: u64) -> Scenario {
    Scenario {
        seed,
        ..scenario.clone()
    }
}

/// The seed's seeding stage (`DIR/seeding.json`), run once and then read
/// back; `None` when the scenario has none.
pub fn seeding(dir: &Path, population: &Scenario) -> anyhow::Result<Option<Seeded>> {
    if SeedingConfig::of(&population.seeding).is_none() {
        return Ok(None);
    }
    let path = dir.join(seeding::SEEDING_FILE);
    if path.exists() {
        let (seeded, _) = seeding::load(&path)?;
        seeding::check(&seeded, population, &path)?;
        return Ok(Some(seeded));
    }
    std::fs::create_dir_all(dir)?;
    let engine = Engine::load(population, &mut |m| eprintln!("{m}"))?;
    let seeded = seeding::run_stage(population, &engine)?;
    seeding::save(dir, &seeded)?;
    Ok(Some(seeded))
}

pub fn seeding_totals(seeded: &Seeded) -> SeedingTotals {
    SeedingTotals {
        rounds: seeded.rounds,
        proposals: seeded.proposals,
        valid: seeded.valid,
        compute: seeded.cost,
    }
}

/// Run `scenario` in `dir`, or finish it there, or read what it did.
pub fn run(dir: &Path, scenario: Scenario, seeded: Option<Seeded>) -> anyhow::Result<RunTotals> {
    let journal_path = RunDir::new(dir).journal();
    let ended = journal_path.exists()
        && journal::read(&journal_path)?
            .iter()
            .any(|e| matches!(e, Event::End { .. }));
    if !ended {
        if RunDir::new(dir).latest_checkpoint()?.is_some() {
            eprintln!("{}: resuming", dir.display());
            replay::resume(dir)?;
        } else {
            // Nothing to resume: start over (an interrupted first step leaves only logs).
            if dir.exists() {
                std::fs::remove_dir_all(dir)?;
            }
            eprintln!("{}: running {}", dir.display(), scenario.name);
            match seeded {
                Some(seeded) => replay::fresh_seeded(scenario, dir, seeded)?,
                None => replay::fresh(scenario, dir)?,
            };
        }
    }
    totals(dir)
}

/// Steps, compute and wall time of a finished run, from its metrics lines.
fn totals(dir: &Path) -> anyhow::Result<RunTotals> {
    let path = RunDir::new(dir).metrics();
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let lines: Vec<MetricsLine> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .with_context(|| format!("{} holds a line that is not a metrics line", path.display()))?;
    let last = lines
        .last()
        .with_context(|| format!("{} has no steps", path.display()))?;
    let compute = last.compute_total.with_context(|| {
        format!(
            "{}: no compute_total (a run from before compute was counted)",
            path.display()
        )
    })?;
    Ok(RunTotals {
        dir: dir.to_path_buf(),
        steps: last.step,
        compute,
        wall_s: lines.iter().map(|l| l.wall_ms).sum::<f64>() / 1e3,
    })
}

/// Who each evaluated row is.
pub struct Evaluated {
    pub records: Vec<ItemRecord>,
    /// Per seed: the population's members and the baseline's member.
    pub rows: Vec<SeedRows>,
    pub totals: EvaluationTotals,
}

pub struct SeedRows {
    pub seed: u64,
    pub members: Vec<String>,
    pub baseline: String,
}

impl SeedRows {
    pub fn member(&self, name: &str) -> String {
        format!("seed-{}/{name}", self.seed)
    }

    pub fn baseline(&self, matching: Matching) -> String {
        match matching {
            Matching::PerAdapter => {
                format!("seed-{}/baseline-per-adapter/{}", self.seed, self.baseline)
            }
            Matching::Total => format!("seed-{}/baseline/{}", self.seed, self.baseline),
        }
    }
}

/// Every row's answers: from `DIR/eval/items.jsonl` when the stage is
/// done, else by evaluating now (continuing after the last whole batch of
/// an interrupted evaluation).
pub fn evaluate(
    loaded: &LoadedExperiment,
    out: &Path,
    runs: &[SeedRuns],
) -> anyhow::Result<Evaluated> {
    let eval_dir = out.join("eval");
    let items = eval_dir.join("items.jsonl");
    let mut rows = Vec::new();
    let mut adapters = Vec::new();
    for run in runs {
        let members = evaluate::member_names(&run.population.dir)?;
        let solo = evaluate::member_names(&run.baseline.dir)?;
        let [baseline] = solo.as_slice() else {
            bail!(
                "{} holds {} members, not one",
                run.baseline.dir.display(),
                solo.len()
            );
        };
        let seed_rows = SeedRows {
            seed: run.seed,
            members,
            baseline: baseline.clone(),
        };
        if !items.exists() {
            adapters.extend(evaluate::members(
                &run.population.dir,
                &format!("seed-{}/", run.seed),
            )?);
            let mark = mark_members(&run.baseline.dir, run.mark.step);
            let per_adapter = seed_rows.baseline(Matching::PerAdapter);
            let prefix = per_adapter.trim_end_matches(baseline.as_str());
            adapters.extend(evaluate::members_under(&mark, prefix)?);
            let total = seed_rows.baseline(Matching::Total);
            adapters.extend(evaluate::members(
                &run.baseline.dir,
                total.trim_end_matches(baseline.as_str()),
            )?);
        }
        rows.push(seed_rows);
    }
    let totals_path = eval_dir.join("totals.json");
    let mut totals = EvaluationTotals::default();
    if !items.exists() {
        adapters.push((BASE_ROW.to_string(), None));
        totals.rows = adapters.len();
        let started = Instant::now();
        let e = &loaded.experiment.eval;
        let options = Options {
            benchmarks: e.benchmarks.join(","),
            gsm8k: None,
            math: None,
            math_prompt: Default::default(),
            tasks: subset(loaded)?.map(|ids| ids.into_iter().collect()),
            limit: e.limit,
            samples: e.samples,
            k: e.k,
            max_new_tokens: e.max_new_tokens,
            batch: e.batch,
            constrained: true,
            progress: Some(eval_dir.clone()),
        };
        let engine = Engine::load(&loaded.population, &mut |m| eprintln!("{m}"))?;
        let pool = VerifierPool::new(SandboxConfig::default())?;
        std::fs::create_dir_all(&eval_dir)?;
        let seed = loaded.seeds()[0];
        let evaluation = evaluate::evaluate_rows(&options, &engine, &pool, &adapters, seed)?;
        totals.wall_s = started.elapsed().as_secs_f64();
        totals.answers = evaluation.items.len();
        std::fs::write(&totals_path, serde_json::to_vec_pretty(&totals)?)?;
        // Writes items.jsonl last, whole: its presence means the stage is done.
        evaluate::write(out, &evaluation)?;
        remove_progress(&eval_dir)?;
    }
    let records = read_records(&items)?;
    if let Ok(bytes) = std::fs::read(&totals_path) {
        totals = serde_json::from_slice(&bytes)
            .with_context(|| format!("{} is corrupt", totals_path.display()))?;
    }
    Ok(Evaluated {
        records,
        rows,
        totals,
    })
}

/// The problems of `eval.problems`: that many of each benchmark's problems,
/// drawn with a stream keyed by the first seed, in benchmark order (the
/// benchmarks of one problem set, such as HumanEval, HumanEval-IO and
/// HumanEval+, or CRUXEval-O and -I, share one draw); `None` for all.
pub fn subset(loaded: &LoadedExperiment) -> anyhow::Result<Option<Vec<String>>> {
    let n = loaded.experiment.eval.problems;
    if n == 0 {
        return Ok(None);
    }
    let mut drawn: Vec<Vec<String>> = Vec::new();
    let mut chosen = Vec::new();
    for (_, order) in evaluate::problem_ids(&loaded.experiment.eval.benchmarks.join(","))? {
        if drawn.contains(&order) {
            continue;
        }
        let mut ids = order.clone();
        ids.shuffle(&mut keyed_stream!(loaded.seeds()[0], "experiment-problems"));
        ids.truncate(n);
        chosen.extend(order.iter().filter(|id| ids.contains(id)).cloned());
        drawn.push(order);
    }
    Ok(Some(chosen))
}

/// The members saved in the baseline's checkpoint of `step`.
fn mark_members(baseline: &Path, step: u64) -> PathBuf {
    RunDir::new(baseline).checkpoint(step).join("members")
}

fn read_records(items: &Path) -> anyhow::Result<Vec<ItemRecord>> {
    let text = std::fs::read_to_string(items)?;
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
