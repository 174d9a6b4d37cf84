//! Reading a run directory: `metrics.jsonl` and `journal.jsonl` (their lines
//! are [`crate::run_files`]'s types, which the runtime writes) and the optional
//! `eval.json`. Unknown journal events ([`Event::Unknown`]) are kept and
//! ignored, so a newer runtime's journal stays readable.
//!
//! Corrupt lines: a line that does not parse is an error naming the file and the
//! line number, with one exception. A *last* line that does not parse and is not
//! terminated by a newline is what `kill -9` leaves behind in the middle of a
//! write: it is skipped with a warning. Blank lines are skipped.

use std::io::ErrorKind;
use std::path::Path;

use serde::de::DeserializeOwned;
use serde::Deserialize;

use super::order::{distinct_steps, rank_key, sorted};
use super::ReportError;
pub(crate) use crate::run_files::{Event, MetricsLine, JOURNAL_FILE, METRICS_FILE};

pub(crate) const EVAL_FILE: &str = "eval.json";

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
    pub metrics: Vec<MetricsLine>,
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
        let records = parse_lines::<MetricsLine>(&metrics_path, &text, &mut data.warnings)?;
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
fn dedup_steps(records: Vec<MetricsLine>, warnings: &mut Vec<String>) -> Vec<MetricsLine> {
    let mut out: Vec<MetricsLine> = Vec::with_capacity(records.len());
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
