//! Experiment files (`experiments/*.toml`): a population scenario and a
//! single-adapter baseline scenario, run for several seeds on matched
//! compute and evaluated side by side (`populora experiment`).
//!
//! ```toml
//! name = "quick"                       # default: the file stem
//! population = "quick-population.toml" # a population-mode scenario, relative to this file
//! baseline = "quick-baseline.toml"     # a solo-mode scenario; its budget is set to
//!                                      # what the population spent, its `steps` bound it
//! seeds = [1, 2, 3]                    # default: the population scenario's seed
//! matching = ["per_adapter", "total"]  # the baseline rows to run and compare (default: both)
//! [eval]
//! benchmarks = ["humaneval", "humaneval-io"]
//! selection = 0.3                      # share of the problems that pick the best member
//! ```

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::source_map::SourceMap;
use super::{validate, ErrorKind, Mode, Scenario, ScenarioError};

/// How far the baseline's compute may be from the population's: 5 %.
pub const MATCH_TOLERANCE: f64 = 0.05;

/// The keys (and sections) in which an experiment's two arms may differ:
/// what defines an arm (its population, evolution, steps and proposals per
/// teacher, its scripted events), what the experiment sets itself (the name,
/// the seed, the budget and the checkpoints' compute marks), and where the
/// members run (`[cluster]`: placement, not settings). Everything else,
/// `[model]`, `[lora]`, `[training]`, `[rewards]`, `[verifier]`, `[seeding]`
/// and the rest of `[selfplay]`, must be equal.
pub const ARM_KEYS: [&str; 10] = [
    "name",
    "seed",
    "steps",
    "budget_tflop",
    "population",
    "evolution",
    "checkpoint",
    "events",
    "cluster",
    "selfplay.proposals_per_teacher",
];

/// The keys in which two arms' scenarios differ outside [`ARM_KEYS`].
pub fn arm_differences(population: &Scenario, baseline: &Scenario) -> Vec<String> {
    let exempt = |key: &str| {
        ARM_KEYS
            .iter()
            .any(|a| key == *a || key.starts_with(&format!("{a}.")))
    };
    population
        .differing_keys(baseline)
        .into_iter()
        .filter(|k| !exempt(k))
        .collect()
}

/// An experiment file as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Experiment {
    /// Experiment name. Default: the file's stem.
    #[serde(default)]
    pub name: String,
    /// The population's scenario file (population mode), relative to this file.
    pub population: PathBuf,
    /// The baseline's scenario file (solo mode), relative to this file. Its
    /// `steps` is an upper bound: the run ends when it has spent what the
    /// population spent.
    pub baseline: PathBuf,
    /// Training seeds: each runs both arms with that scenario seed. Distinct.
    /// Default: the population scenario's seed alone.
    #[serde(default)]
    pub seeds: Vec<u64>,
    /// The baseline rows to run, evaluate and compare: `per_adapter`
    /// (its compute mark where it had spent what one population member
    /// spent, the paper's comparison) and `total` (where it had spent what
    /// the whole population spent, the strict one). With `per_adapter`
    /// alone the baseline stops at that mark. Distinct, non-empty.
    /// Default: both.
    #[serde(default = "Matching::all")]
    pub matching: Vec<Matching>,
    /// What every row is evaluated on.
    #[serde(default)]
    pub eval: ExperimentEval,
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
    /// Both matchings, in the order they are reported.
    pub const BOTH: [Matching; 2] = [Matching::PerAdapter, Matching::Total];

    /// Both, the default of `matching`.
    pub fn all() -> Vec<Matching> {
        Matching::BOTH.to_vec()
    }

    /// As written in `matching`.
    pub fn key(self) -> &'static str {
        match self {
            Matching::PerAdapter => "per_adapter",
            Matching::Total => "total",
        }
    }

    /// As the report names it.
    pub fn name(self) -> &'static str {
        match self {
            Matching::PerAdapter => "per adapter",
            Matching::Total => "whole population",
        }
    }
}

/// `[eval]`: what every row is evaluated on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ExperimentEval {
    /// Benchmarks: `humaneval` (pass@1 greedy, or pass@k), `humaneval-io`
    /// (output and input prediction, answers decoded as in self-play), or
    /// any other of [`crate::eval::BENCHMARKS`] (`humaneval+`, `mbpp+`,
    /// `cruxeval-o`, `cruxeval-i`, the math sets). Default: the first two.
    pub benchmarks: Vec<String>,
    /// Items per benchmark, 0 = all (after `problems`). Default: 0.
    pub limit: usize,
    /// A fixed subset of each benchmark's problems (of HumanEval's: each with
    /// all its HumanEval-IO items; of CRUXEval's: each function with its O
    /// and I items), drawn with a stream keyed by the first seed and the
    /// same for every row (the report names them); 0 = every problem.
    /// Default: 0.
    pub problems: usize,
    /// Samples per item: 1 = greedy pass@1; more adds pass@k at temperature 0.8. Default: 1.
    pub samples: usize,
    /// k of pass@k, <= samples. Default: 10.
    pub k: usize,
    /// Longest answer, tokens. Default: 384.
    pub max_new_tokens: usize,
    /// Rows per generation batch. Default: 32.
    pub batch: usize,
    /// Bootstrap resamples for the intervals, >= 100. Default: 10000.
    pub bootstrap: usize,
    /// Share of the evaluated problems (each with all its items: a HumanEval
    /// problem with its HumanEval-IO items, a CRUXEval function with its O and
    /// I items), drawn once with a seeded stream and the same for every row, on which
    /// the best and the weakest member of each seed are chosen; every row is
    /// reported on the rest. 0 < selection < 1. Default: 0.3.
    pub selection: f64,
}

impl Default for ExperimentEval {
    fn default() -> Self {
        ExperimentEval {
            benchmarks: vec!["humaneval".into(), "humaneval-io".into()],
            limit: 0,
            problems: 0,
            samples: 1,
            k: 10,
            max_new_tokens: 384,
            batch: 32,
            bootstrap: 10_000,
            selection: 0.3,
        }
    }
}

impl LoadedExperiment {
    /// The training seeds, in the file's order.
    pub fn seeds(&self) -> Vec<u64> {
        match self.experiment.seeds.is_empty() {
            true => vec![self.population.seed],
            false => self.experiment.seeds.clone(),
        }
    }
}

/// An experiment with its two scenarios read and checked.
#[derive(Debug, Clone)]
pub struct LoadedExperiment {
    /// The file as written (with its name resolved).
    pub experiment: Experiment,
    /// The population's scenario.
    pub population: Scenario,
    /// The baseline's scenario, before its budget is set.
    pub baseline: Scenario,
}

impl Experiment {
    /// Reads an experiment file and the two scenario files it names. Errors
    /// name the file, the line and the key, as scenario errors do.
    pub fn from_file(
        path: &Path,
        check_operator: impl Fn(&str) -> Result<(), String> + Copy,
    ) -> Result<LoadedExperiment, ScenarioError> {
        let origin = path.display().to_string();
        let text = super::read_file(path, "experiment")?;
        let map = SourceMap::build(&text).unwrap_or_else(|_| SourceMap::lines_only(&text));
        let mut experiment: Experiment =
            toml::from_str(&text).map_err(|error| match text.parse::<toml::Table>() {
                Err(syntax) => validate::syntax_error(&syntax, &map, &origin),
                Ok(_) => validate::schema_error(&error, &map, &origin),
            })?;
        if experiment.name.is_empty() {
            experiment.name = path
                .file_stem()
                .map_or("experiment".into(), |s| s.to_string_lossy().into_owned());
        }
        let fail = |key: &str, message: String| ScenarioError {
            origin: origin.clone(),
            line: map.line_of_key(key),
            key: Some(key.to_string()),
            kind: ErrorKind::Invalid,
            message,
        };
        experiment.check_eval().map_err(|(key, m)| fail(key, m))?;
        let mut matching = experiment.matching.clone();
        matching.sort_unstable();
        matching.dedup();
        if matching.is_empty() || matching.len() != experiment.matching.len() {
            let written: Vec<&str> = experiment.matching.iter().map(|m| m.key()).collect();
            let why = format!(
                "matching = {written:?}: name \"per_adapter\", \"total\" or both, each once"
            );
            return Err(fail("matching", why));
        }
        let mut seeds = experiment.seeds.clone();
        seeds.sort_unstable();
        seeds.dedup();
        if seeds.len() != experiment.seeds.len() {
            let why = format!("seeds = {:?}: each seed once", experiment.seeds);
            return Err(fail("seeds", why));
        }
        let dir = path.parent().unwrap_or(Path::new("."));
        let population = Scenario::from_file(dir.join(&experiment.population), check_operator)?;
        let baseline = Scenario::from_file(dir.join(&experiment.baseline), check_operator)?;
        if population.population.mode != Mode::Population {
            let why = "population must name a scenario with population.mode = \"population\"";
            return Err(fail("population", why.into()));
        }
        if baseline.population.mode != Mode::Solo {
            let why = "baseline must name a scenario with population.mode = \"solo\"";
            return Err(fail("baseline", why.into()));
        }
        let differing = arm_differences(&population, &baseline);
        if !differing.is_empty() {
            let why = format!(
                "the population and the baseline differ in {}: the two arms may differ only in what defines an arm or what the experiment sets ({})",
                differing.join(", "),
                ARM_KEYS.join(", ")
            );
            return Err(fail("baseline", why));
        }

        Ok(LoadedExperiment {
            experiment,
            population,
            baseline,
        })
    }

    /// Whether two experiment files' texts say the same thing (comments and
    /// layout aside): an experiment directory may be continued with either.
    pub fn same_settings(a: &str, b: &str) -> bool {
        a == b
            || matches!(
                (toml::from_str::<Experiment>(a), toml::from_str::<Experiment>(b)),
                (Ok(x), Ok(y)) if x == y
            )
    }

    /// `[eval]`'s ranges; `Err((key, message))`.
    fn check_eval(&self) -> Result<(), (&'static str, String)> {
        let e = &self.eval;
        let known = crate::eval::BENCHMARKS;
        if e.benchmarks.is_empty() || e.benchmarks.iter().any(|b| !known.contains(&b.as_str())) {
            let message = format!(
                "eval.benchmarks = {:?}: allowed a non-empty list of {known:?}",
                e.benchmarks
            );
            return Err(("eval.benchmarks", message));
        }
        let checks = [
            ("eval.samples", e.samples >= 1, "1.."),
            (
                "eval.k",
                e.k >= 1 && (e.samples == 1 || e.k <= e.samples),
                "1..=samples",
            ),
            (
                "eval.max_new_tokens",
                (16..=4096).contains(&e.max_new_tokens),
                "16..=4096",
            ),
            ("eval.batch", e.batch >= 1, "1.."),
            ("eval.bootstrap", e.bootstrap >= 100, "100.."),
            (
                "eval.selection",
                e.selection > 0.0 && e.selection < 1.0,
                "0 < selection < 1",
            ),
        ];
        match checks.iter().find(|(_, ok, _)| !ok) {
            Some((key, _, allowed)) => {
                Err((key, format!("{key} is out of range (allowed {allowed})")))
            }
            None => Ok(()),
        }
    }
}
