//! The experiment's stages and their files: the directory claimed for one
//! experiment file, each seed's seeding stage and runs (started, resumed or
//! read back), and the evaluation of every row. Each stage's output says
//! whether it is done, so running the same command again continues.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use populora::compute::Cost;
use populora::eval::ItemRecord;
use populora::keyed_stream;
use populora::report::experiment::{
    EvaluationTotals, Matching, RunTotals, SeedRuns, SeedingTotals,
};
use populora::run_files::MetricsLine;
use populora::scenario::experiment::{Experiment, LoadedExperiment};
use populora::scenario::{check_operator, Scenario};
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
/// comments) is refused rather than mixed; so is one whose scenario files
/// now say something else than when it started ([`scenario_hashes`]).
pub fn claim(out: &Path, file: &Path, loaded: &LoadedExperiment) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(file)?;
    let copy = out.join("experiment.toml");
    match std::fs::read_to_string(&copy) {
        Ok(existing) if !Experiment::same_settings(&existing, &text) => bail!(
            "{} holds another experiment (its experiment.toml differs from {}); choose another --out",
            out.display(),
            file.display()
        ),
        Ok(_) => {}
        Err(_) => {
            std::fs::create_dir_all(out)?;
            std::fs::write(copy, text)?;
        }
    }
    check_scenarios(out, loaded)
}

/// Each arm's resolved settings hash ([`Scenario::settings_hash`]), by arm.
pub fn scenario_hashes(loaded: &LoadedExperiment) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("population".into(), loaded.population.settings_hash()),
        ("baseline".into(), loaded.baseline.settings_hash()),
    ])
}

/// The scenarios' hashes are written to `DIR/experiment.json` when the
/// experiment starts; a later piece under other settings is refused, naming
/// the keys that changed where a run of that arm shows them.
fn check_scenarios(out: &Path, loaded: &LoadedExperiment) -> anyhow::Result<()> {
    let path = out.join("experiment.json");
    let mut doc: serde_json::Value = match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .with_context(|| format!("{} is corrupt", path.display()))?,
        Err(_) => serde_json::json!({ "name": loaded.experiment.name }),
    };
    let current = scenario_hashes(loaded);
    let Some(recorded) = doc.get("scenarios") else {
        doc["scenarios"] = serde_json::to_value(&current)?;
        return Ok(std::fs::write(&path, serde_json::to_vec_pretty(&doc)?)?);
    };
    let recorded: BTreeMap<String, String> = serde_json::from_value(recorded.clone())
        .with_context(|| format!("{}: `scenarios` is corrupt", path.display()))?;
    for (arm, scenario) in [
        ("population", &loaded.population),
        ("baseline", &loaded.baseline),
    ] {
        if recorded.get(arm) == current.get(arm) {
            continue;
        }
        let file = match arm {
            "population" => &loaded.experiment.population,
            _ => &loaded.experiment.baseline,
        };
        bail!(
            "the {arm} scenario ({}) is not the one this experiment started with (settings hash {} in {}, now {}){}: a resumed piece would mix settings across seeds; restore the file, or start the experiment in another --out",
            file.display(),
            recorded.get(arm).map_or("none", String::as_str),
            path.display(),
            current[arm],
            changed_keys(out, arm, scenario)
        );
    }
    Ok(())
}

/// `; changed: keys` against the first run of `arm` in `out`, if any.
fn changed_keys(out: &Path, arm: &str, scenario: &Scenario) -> String {
    let Ok(entries) = std::fs::read_dir(out) else {
        return String::new();
    };
    let mut seeds: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
    seeds.sort();
    let saved = seeds
        .iter()
        .map(|dir| RunDir::new(&dir.join(arm)).scenario())
        .find_map(|file| Scenario::from_recorded_file(&file, check_operator).ok());
    let set_by_experiment = ["seed", "budget_tflop", "checkpoint.at_tflop"];
    match saved {
        Some(saved) => {
            let keys: Vec<String> = saved
                .differing_keys(scenario)
                .into_iter()
                .filter(|k| !set_by_experiment.contains(&k.as_str()))
                .collect();
            format!("; changed: {}", keys.join(", "))
        }
        None => String::new(),
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

/// Run `scenario` in `dir`, or finish it there, or read what it did. A run
/// begun under other settings, or one that ended before its time (a `ctl
/// stop`), is refused.
pub fn run(dir: &Path, scenario: Scenario, seeded: Option<Seeded>) -> anyhow::Result<RunTotals> {
    let saved = RunDir::new(dir).scenario();
    if saved.exists() {
        same_settings(&saved, &scenario)?;
    }
    let journal_path = RunDir::new(dir).journal();
    let end = match journal_path.exists() {
        true => journal::read(&journal_path)?
            .iter()
            .rev()
            .find_map(|e| match e {
                Event::End { step, .. } => Some(*step),
                _ => None,
            }),
        false => None,
    };
    match end {
        Some(end) => finished(dir, end, &scenario)?,
        None if RunDir::new(dir).latest_checkpoint()?.is_some() => {
            eprintln!("{}: resuming", dir.display());
            replay::resume(dir)?;
        }
        None => {
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

/// The run in `dir` was begun with `scenario`'s settings (its saved
/// `scenario.toml`), or the keys that differ are named.
fn same_settings(saved: &Path, scenario: &Scenario) -> anyhow::Result<()> {
    let recorded = Scenario::from_recorded_file(saved, check_operator)
        .with_context(|| format!("reading {}", saved.display()))?;
    let keys = recorded.differing_keys(scenario);
    if keys.is_empty() {
        return Ok(());
    }
    bail!(
        "{} was run with other settings than the experiment's scenario now gives (differing: {}); restore the scenario file, or delete {} to run it again",
        saved.display(),
        keys.join(", "),
        saved.parent().unwrap_or(Path::new(".")).display()
    )
}

/// A run that ended did so at its time: a population after all its
/// `steps`, a baseline on its budget (or after all its steps), not where a
/// `ctl stop` or a failure left it.
fn finished(dir: &Path, end: u64, scenario: &Scenario) -> anyhow::Result<()> {
    let lines = metrics(dir)?;
    let flops = |c: Option<Cost>| c.map_or(0.0, |c| c.flops);
    let last = lines.last();
    let (spent, last_step) = (
        flops(last.and_then(|l| l.compute_total)),
        flops(last.and_then(|l| l.compute)),
    );
    // The budget's rule before marks were chosen after the fact ended a
    // run at most half a step short; such records still count as finished.
    let budget_spent = scenario
        .budget_tflop
        .is_some_and(|b| spent + last_step / 2.0 >= b * 1e12);
    if end == scenario.steps || budget_spent {
        return Ok(());
    }
    bail!(
        "{} ended at step {end} of its {} steps{} (stopped early: `ctl stop`?); continue it with `populora resume {}` or delete it, then run the experiment again",
        dir.display(),
        scenario.steps,
        scenario
            .budget_tflop
            .map_or(String::new(), |b| format!(", before its budget of {b:.3} TFLOP")),
        dir.display()
    )
}

/// A run's metrics lines.
pub fn metrics(dir: &Path) -> anyhow::Result<Vec<MetricsLine>> {
    let path = RunDir::new(dir).metrics();
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .with_context(|| format!("{} holds a line that is not a metrics line", path.display()))
}

/// Steps, compute and wall time of a finished run, from its metrics lines.
fn totals(dir: &Path) -> anyhow::Result<RunTotals> {
    let path = RunDir::new(dir).metrics();
    let lines = metrics(dir)?;
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
    let items = answers_file(&eval_dir);
    let mut rows = Vec::new();
    let mut adapters = Vec::new();
    for run in runs {
        let members = live_members(&run.population.dir)?;
        let solo = live_members(&run.baseline.dir)?;
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
            for (matching, mark) in run.marks() {
                let row = seed_rows.baseline(matching);
                let prefix = row.trim_end_matches(baseline.as_str());
                let saved = mark_members(&run.baseline.dir, mark.step);
                adapters.extend(evaluate::members_under(&saved, prefix)?);
            }
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

/// The members alive at a finished run's end, by name: those of its last
/// metrics line (its `members/` holds their adapters, which an experiment's
/// committed record leaves out).
fn live_members(dir: &Path) -> anyhow::Result<Vec<String>> {
    let lines = metrics(dir)?;
    let last = lines
        .last()
        .with_context(|| format!("{} has no steps", RunDir::new(dir).metrics().display()))?;
    let mut names: Vec<String> = last.members.iter().map(|m| m.id.clone()).collect();
    names.sort();
    Ok(names)
}

/// The members saved in the baseline's checkpoint of `step`.
fn mark_members(baseline: &Path, step: u64) -> PathBuf {
    RunDir::new(baseline).checkpoint(step).join("members")
}

/// Where a finished evaluation's answers are: `items.jsonl`, or gzipped
/// (`items.jsonl.gz`) in an experiment's committed record; the first when
/// neither is there yet.
fn answers_file(eval_dir: &Path) -> PathBuf {
    let plain = eval_dir.join("items.jsonl");
    let gzipped = eval_dir.join("items.jsonl.gz");
    match !plain.exists() && gzipped.exists() {
        true => gzipped,
        false => plain,
    }
}

fn read_records(items: &Path) -> anyhow::Result<Vec<ItemRecord>> {
    let mut text = String::new();
    let file =
        std::fs::File::open(items).with_context(|| format!("reading {}", items.display()))?;
    let read = match items.extension().is_some_and(|e| e == "gz") {
        true => std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(file), &mut text),
        false => std::io::Read::read_to_string(&mut std::io::BufReader::new(file), &mut text),
    };
    read.with_context(|| format!("reading {}", items.display()))?;
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
