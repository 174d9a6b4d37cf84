//! Reading a run directory: `metrics.jsonl`, `journal.jsonl` and the optional
//! `eval.json`.
//!
//! Every field the plots do not strictly need is optional and unknown fields and
//! unknown journal events are ignored, so older and newer runtimes stay readable.
//!
//! Corrupt lines: a line that does not parse is an error naming the file and the
//! line number, with one exception. A *last* line that does not parse and is not
//! terminated by a newline is what `kill -9` leaves behind in the middle of a
//! write: it is skipped with a warning. Blank lines are skipped.

use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::path::Path;

use serde::de::DeserializeOwned;
use serde::Deserialize;

use super::order::{distinct_steps, rank_key, sorted};
use super::ReportError;

/// File names inside a run directory.
pub(crate) const METRICS_FILE: &str = "metrics.jsonl";
pub(crate) const JOURNAL_FILE: &str = "journal.jsonl";
pub(crate) const EVAL_FILE: &str = "eval.json";

/// One line of `metrics.jsonl`: everything measured in one completed step.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct StepMetrics {
    pub step: u64,
    #[serde(default)]
    pub wall_ms: Option<f64>,
    #[serde(default)]
    pub phase_ms: BTreeMap<String, Option<f64>>,
    #[serde(default)]
    pub members: Vec<MemberMetrics>,
    #[serde(default)]
    pub groups: Vec<GroupMetrics>,
    #[serde(default)]
    pub solve_rate: BTreeMap<String, Option<f64>>,
    #[serde(default)]
    pub programs: Vec<ProgramMetrics>,
    #[serde(default)]
    pub proposals: Option<ProposalCounts>,
}

/// How many problems were proposed in one step, valid, and learnable.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct ProposalCounts {
    pub total: u64,
    pub valid: u64,
    /// Absent in runs written before the count existed.
    #[serde(default)]
    pub learnable: Option<u64>,
}

/// One member's numbers in one step.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct MemberMetrics {
    pub id: String,
    #[serde(default)]
    pub role: Option<String>,
    #[serde(default)]
    pub fitness: Option<f64>,
    #[serde(default)]
    pub rating: Option<Rating>,
}

/// A member's TrueSkill rating after a step.
#[derive(Debug, Clone, Copy, Deserialize)]
pub(crate) struct Rating {
    pub mu: f64,
    pub sigma: f64,
}

/// Reward statistics of one (task kind × role) group in one step.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct GroupMetrics {
    pub kind: String,
    pub role: String,
    #[serde(default)]
    pub reward_mean: Option<f64>,
}

/// Complexity features of one valid proposed program.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct ProgramMetrics {
    #[serde(default)]
    pub author: Option<String>,
    #[serde(default)]
    pub kind: Option<String>,
    #[serde(default)]
    pub ast_nodes: Option<u64>,
    #[serde(default)]
    pub max_depth: Option<u64>,
    #[serde(default)]
    pub node_types: Option<u64>,
    #[serde(default)]
    pub cyclomatic: Option<u64>,
}

impl ProgramMetrics {
    /// The coverage signature, when all four features are present.
    pub fn signature(&self) -> Option<(u64, u64, u64, u64)> {
        Some((
            self.ast_nodes?,
            self.max_depth?,
            self.node_types?,
            self.cyclomatic?,
        ))
    }
}

/// A member as listed by the `start` event.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct InitialMember {
    pub id: String,
    #[serde(default)]
    pub role: Option<String>,
}

/// One line of `journal.jsonl`. Events this module does not know are kept as
/// [`Event::Other`] and ignored.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub(crate) enum Event {
    Start {
        #[serde(default)]
        seed: Option<u64>,
        #[serde(default)]
        scenario: Option<String>,
        #[serde(default)]
        members: Vec<InitialMember>,
    },
    Step {
        step: u64,
    },
    Control {
        #[serde(default)]
        step: Option<u64>,
        #[serde(default)]
        command: serde_json::Value,
        #[serde(default)]
        source: Option<String>,
    },
    Spawn {
        step: u64,
        id: String,
        #[serde(default)]
        role: Option<String>,
        #[serde(default)]
        parents: Vec<String>,
        #[serde(default)]
        operators: Vec<String>,
    },
    Cull {
        step: u64,
        id: String,
    },
    Kill {
        step: u64,
        id: String,
    },
    Fault {
        #[serde(default)]
        step: Option<u64>,
        #[serde(default)]
        member: Option<String>,
        #[serde(default)]
        message: Option<String>,
        #[serde(default)]
        action: Option<String>,
    },
    Checkpoint {
        #[serde(default)]
        step: Option<u64>,
    },
    End {
        #[serde(default)]
        step: Option<u64>,
    },
    #[serde(other)]
    Other,
}

/// One row of `eval.json`.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct EvalResult {
    pub benchmark: String,
    pub member: String,
    #[serde(default)]
    pub n: Option<u64>,
    #[serde(default)]
    pub correct: Option<u64>,
    #[serde(default)]
    pub pass_at_1: Option<f64>,
    #[serde(default)]
    pub pass_at_k: Option<(u64, f64)>,
}

/// Everything read from a run directory, plus what was missing or odd.
#[derive(Debug, Default)]
pub(crate) struct RunData {
    /// Sorted by step, one record per step (the last one when a step repeats).
    pub metrics: Vec<StepMetrics>,
    pub events: Vec<Event>,
    /// `None` when `eval.json` is absent.
    pub eval: Option<Vec<EvalResult>>,
    pub has_metrics_file: bool,
    pub has_journal_file: bool,
    pub warnings: Vec<String>,
}

/// Reads the run directory. Missing files become warnings; a missing directory
/// and corrupt lines are errors.
pub(crate) fn read_run(run_dir: &Path) -> Result<RunData, ReportError> {
    if !run_dir.is_dir() {
        return Err(ReportError::NotADirectory {
            path: run_dir.to_path_buf(),
        });
    }
    let mut data = RunData::default();
    let metrics_path = run_dir.join(METRICS_FILE);
    if let Some(text) = read_optional(&metrics_path)? {
        data.has_metrics_file = true;
        let records = parse_lines::<StepMetrics>(&metrics_path, &text, &mut data.warnings)?;
        data.metrics = dedup_steps(records, &mut data.warnings);
    } else {
        data.warnings.push(format!(
            "{METRICS_FILE} is missing: no step metrics to plot"
        ));
    }
    let journal_path = run_dir.join(JOURNAL_FILE);
    if let Some(text) = read_optional(&journal_path)? {
        data.has_journal_file = true;
        data.events = parse_lines::<Event>(&journal_path, &text, &mut data.warnings)?;
    } else {
        data.warnings.push(format!(
            "{JOURNAL_FILE} is missing: no lineage, seed or scenario"
        ));
    }
    let eval_path = run_dir.join(EVAL_FILE);
    if let Some(text) = read_optional(&eval_path)? {
        data.eval = Some(parse_eval(&eval_path, &text)?);
    }
    Ok(data)
}

/// The file's text, or `None` when it does not exist.
fn read_optional(path: &Path) -> Result<Option<String>, ReportError> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(Some(String::from_utf8_lossy(&bytes).into_owned())),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
        Err(source) => Err(ReportError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Parses one JSON value per line (see the module doc for the error policy).
fn parse_lines<T: DeserializeOwned>(
    path: &Path,
    text: &str,
    warnings: &mut Vec<String>,
) -> Result<Vec<T>, ReportError> {
    let unterminated = !text.is_empty() && !text.ends_with('\n');
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::with_capacity(lines.len());
    for (index, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<T>(line) {
            Ok(value) => out.push(value),
            Err(_) if unterminated && index + 1 == lines.len() => {
                warnings.push(format!(
                    "{}: the last line ({}) is cut short (the run was killed mid-write?) and was skipped",
                    file_name(path),
                    index + 1
                ));
            }
            Err(e) => {
                return Err(ReportError::Parse {
                    path: path.to_path_buf(),
                    line: index + 1,
                    message: e.to_string(),
                })
            }
        }
    }
    Ok(out)
}

/// Sorts by step and keeps the last record of a repeated step (a resumed run
/// may write a step again).
fn dedup_steps(records: Vec<StepMetrics>, warnings: &mut Vec<String>) -> Vec<StepMetrics> {
    let mut out: Vec<StepMetrics> = Vec::with_capacity(records.len());
    let mut repeated = Vec::new();
    for record in sorted(records, |r| rank_key(r.step)) {
        match out.last_mut() {
            Some(last) if last.step == record.step => {
                repeated.push(record.step);
                *last = record;
            }
            _ => out.push(record),
        }
    }
    if !repeated.is_empty() {
        warnings.push(format!(
            "{METRICS_FILE}: steps {} appear more than once; the last record of each is used",
            list_steps(&distinct_steps(repeated))
        ));
    }
    out
}

fn parse_eval(path: &Path, text: &str) -> Result<Vec<EvalResult>, ReportError> {
    serde_json::from_str(text).map_err(|e| ReportError::Parse {
        path: path.to_path_buf(),
        line: e.line(),
        message: e.to_string(),
    })
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

/// "1, 2, 3" with at most ten steps named.
pub(crate) fn list_steps(steps: &[u64]) -> String {
    const SHOWN: usize = 10;
    let mut text: Vec<String> = steps.iter().take(SHOWN).map(u64::to_string).collect();
    if steps.len() > SHOWN {
        text.push(format!("… ({} in all)", steps.len()));
    }
    text.join(", ")
}
