//! The experiment protocol: does a co-evolving population beat a
//! compute-matched single adapter that plays both roles (Absolute-Zero
//! self-play)? What follows is the method, in the order it runs.
//!
//! 1. **Seeds.** Every training seed (`seeds = [..]`) runs both arms with
//!    that scenario seed, under `DIR/seed-<s>/`.
//! 2. **Seeding** (AZR's `_init_seed_dataset`, with `[seeding]`): the base
//!    model, no adapter, proposes until each task kind's buffer holds N
//!    valid, distinct tasks. Run once per seed (`seed-<s>/seeding.json`),
//!    both arms start from it; its compute is reported apart and matched by
//!    neither arm.
//! 3. **Population**: the population scenario runs to its end.
//! 4. **Baseline, compute matched two ways from one run**: the solo scenario
//!    runs until it has spent what the whole population spent (its
//!    `budget_tflop`: the strict test), and keeps a checkpoint where it had
//!    spent what one member spent, the population's total over its T + S
//!    members (a compute mark: the paper's per-adapter comparison). Both
//!    are checked against [`MATCH_TOLERANCE`]. The experiment's `matching`
//!    may name one of the two: with `["per_adapter"]` the baseline's budget
//!    is one member's share and it stops there.
//! 5. **Evaluation**: every seed's population members at the end, the
//!    baseline at its mark and at its end, and once the untouched base
//!    model, answer every item of HumanEval and HumanEval-IO
//!    ([`evaluate`]).
//! 6. **Statistics** ([`statistics`]): HumanEval problems are split once,
//!    seeded: a selection share chooses each seed's best and weakest member,
//!    and every row is reported on the rest. For each benchmark and
//!    matching: population group (all, students, teachers, best, weakest)
//!    minus baseline, per seed and pooled over seeds, with a bootstrap over
//!    seeds and problems (HumanEval-IO items clustered under their problem).
//!
//! Every stage is skipped when its output is complete, so an interrupted
//! experiment continues with the same command: runs resume from their
//! checkpoints, the seeding file is reused, the evaluation continues after
//! its last whole batch.

pub mod evaluate;
mod matching;
mod stages;
mod statistics;

use std::path::Path;

use populora::report::experiment::{
    ArmsTrained, ComputeMark, ExperimentSummary, Matching, SeedRuns, TrainedOn,
};
use populora::scenario::experiment::LoadedExperiment;

pub use populora::scenario::experiment::MATCH_TOLERANCE;

/// Runs (or continues) the experiment in `out`; what it found.
pub fn run(
    loaded: &LoadedExperiment,
    file: &Path,
    out: &Path,
) -> anyhow::Result<ExperimentSummary> {
    stages::claim(out, file, loaded)?;
    let seeds = loaded.seeds();
    if seeds.len() < 3 {
        eprintln!(
            "note: {} seed(s); intervals over seeds need at least 3 to mean much",
            seeds.len()
        );
    }
    let runs: Vec<SeedRuns> = seeds
        .iter()
        .map(|&seed| seed_runs(loaded, out, seed))
        .collect::<anyhow::Result<_>>()?;
    let evaluated = stages::evaluate(loaded, out, &runs)?;
    let summary = statistics::summarize(loaded, &runs, &evaluated)?;
    std::fs::write(
        out.join("experiment.json"),
        serde_json::to_vec_pretty(&summary)?,
    )?;
    for seed in &runs {
        for run in [&seed.population.dir, &seed.baseline.dir] {
            populora::report::write(run, run.join("report"))?;
        }
    }
    Ok(summary)
}

/// Steps 2 to 4 for one seed.
fn seed_runs(loaded: &LoadedExperiment, out: &Path, seed: u64) -> anyhow::Result<SeedRuns> {
    let dir = out.join(format!("seed-{seed}"));
    let population = stages::with_seed(&loaded.population, seed);
    let seeded = stages::seeding(&dir, &population)?;
    let pop = stages::run(&dir.join("population"), population, seeded.clone())?;
    let members = loaded.population.population.teachers + loaded.population.population.students;
    let targets = matching::Targets::of(&pop, members);
    let mut baseline = stages::with_seed(&loaded.baseline, seed);
    let matchings = &loaded.experiment.matching;
    targets.apply(&mut baseline, matchings);
    let base = stages::run(&dir.join("baseline"), baseline, seeded.clone())?;
    let mark = match matchings.contains(&Matching::PerAdapter) {
        true => Some(matching::per_adapter_mark(
            &base,
            targets.per_adapter_tflop,
        )?),
        false => None,
    };
    let total_mark = match matchings.contains(&Matching::Total) {
        true => Some(matching::total_mark(&pop, &base)?),
        false => None,
    };
    let (pop_lines, base_lines) = (stages::metrics(&pop.dir)?, stages::metrics(&base.dir)?);
    let up_to = |mark: Option<ComputeMark>| mark.map(|m| TrainedOn::of(&base_lines, m.step));
    let trained = ArmsTrained {
        population: TrainedOn::of(&pop_lines, pop.steps),
        baseline_per_adapter: up_to(mark),
        baseline_total: up_to(total_mark),
    };
    Ok(SeedRuns {
        seed,
        seeding: seeded.map(|s| stages::seeding_totals(&s)),
        population: pop,
        members,
        baseline: base,
        mark,
        total_mark,
        trained,
    })
}
