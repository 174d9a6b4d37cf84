//! Held-out evaluation: benchmark data, prompts, answer extraction, scoring
//! and result tables. Everything here is pure apart from scoring, which runs
//! code through the sandbox ([`crate::verify::VerifierPool`]).
//!
//! The flow for every benchmark is the same and leaves generation to the
//! caller: load the items, build a [`ChatPrompt`] per item, let the model
//! answer, then hand the response text back here to be extracted and scored.
//!
//! | file | owns |
//! |---|---|
//! | [`data`] | the shipped benchmark files (`data/`) and their checksums |
//! | [`humaneval`] | HumanEval problems, code extraction, sandboxed tests, pass@k, `samples.jsonl` |
//! | [`humaneval_io`] | output/input-prediction items built from HumanEval tests |
//! | [`evalplus`] | HumanEval+ and MBPP+, scored by EvalPlus's rules, its samples file |
//! | [`cruxeval`] | CRUXEval-O and -I, scored by its harness's rule, its generations file |
//! | [`math`] | the math sets (GSM8K, MATH-500, Minerva, OlympiadBench, AIME, AMC), answer extraction and equivalence |
//! | [`compare`] | per-item scores and a paired bootstrap over items |
//! | `harness.py` | the official harnesses' checks, run in the sandbox |
//! | `mod.rs` | [`EvalError`], [`ChatPrompt`], JSONL reading, [`BenchmarkResult`] and [`table`] |

pub mod compare;
pub mod cruxeval;
pub mod data;
pub mod evalplus;
pub mod humaneval;
pub mod humaneval_io;
pub mod math;

/// The benchmarks `eval --benchmarks` and an experiment's `[eval]
/// benchmarks` name (the runtime's `experiment::evaluate` builds them).
pub const BENCHMARKS: [&str; 13] = [
    "humaneval",
    "humaneval-io",
    "humaneval+",
    "mbpp+",
    "cruxeval-o",
    "cruxeval-i",
    "gsm8k",
    "math500",
    "minerva",
    "olympiadbench",
    "aime24",
    "aime25",
    "amc23",
];

/// The official harnesses' checks (EvalPlus's, CRUXEval's), as the Python a
/// [`crate::verify::Job::Harness`] runs.
pub(crate) const HARNESS: &str = include_str!("harness.py");

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::io::Read;
use std::path::{Path, PathBuf};

/// Everything that can go wrong while loading data or scoring.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}, line {line}: {message}")]
    BadRecord {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("the sandbox failed: {0}")]
    Sandbox(#[from] crate::verify::Error),
    #[error("{path} is not the file the project ships: its SHA-256 is {found}, expected {expected} (restore it, e.g. with `git checkout -- data/`)")]
    Checksum {
        path: PathBuf,
        expected: &'static str,
        found: String,
    },
}

pub use crate::task::ChatPrompt;

/// Read a JSON-lines file, gzip-compressed or not (decided by the gzip magic
/// bytes), into one `(1-based line number, record)` per non-blank line.
/// Errors name the file and the line.
pub(crate) fn read_jsonl<T: DeserializeOwned>(path: &Path) -> Result<Vec<(usize, T)>, EvalError> {
    let text = read_text(path)?;
    let mut records = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let record = serde_json::from_str(line).map_err(|e| EvalError::BadRecord {
            path: path.to_path_buf(),
            line: index + 1,
            message: e.to_string(),
        })?;
        records.push((index + 1, record));
    }
    Ok(records)
}

/// Write one JSON line per record.
pub(crate) fn write_jsonl<T: Serialize>(path: &Path, records: &[T]) -> Result<(), EvalError> {
    let write_error = |source| EvalError::Write {
        path: path.to_path_buf(),
        source,
    };
    let mut out = Vec::new();
    for record in records {
        serde_json::to_writer(&mut out, record).map_err(|e| write_error(e.into()))?;
        out.push(b'\n');
    }
    std::fs::write(path, out).map_err(write_error)
}

/// An error about one record of a JSONL file.
pub(crate) fn bad_record(path: &Path, line: usize, message: impl Into<String>) -> EvalError {
    EvalError::BadRecord {
        path: path.to_path_buf(),
        line,
        message: message.into(),
    }
}

pub(crate) fn read_text(path: &Path) -> Result<String, EvalError> {
    let read_error = |source| EvalError::Read {
        path: path.to_path_buf(),
        source,
    };
    let bytes = std::fs::read(path).map_err(read_error)?;
    let bytes = if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut plain = Vec::new();
        flate2::read::MultiGzDecoder::new(bytes.as_slice())
            .read_to_end(&mut plain)
            .map_err(read_error)?;
        plain
    } else {
        bytes
    };
    String::from_utf8(bytes).map_err(|e| {
        read_error(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not UTF-8: {e}"),
        ))
    })
}

/// One answer to one item: who answered, whether it passed, and what it said.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ItemRecord {
    pub benchmark: String,
    /// The item's id (HumanEval's `task_id`, `gsm8k/N` or `math/N` for the
    /// Nth problem of a math set; one HumanEval problem gives several
    /// HumanEval-IO items).
    pub task_id: String,
    /// The item's position in its whole benchmark (whatever was selected).
    pub item: usize,
    pub member: String,
    /// Which sample of the item (0 when greedy).
    pub sample: usize,
    /// Whether the answer is right (HumanEval+ and MBPP+: on the base and
    /// the plus inputs).
    pub passed: bool,
    /// HumanEval+ and MBPP+: whether it passed the base inputs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_passed: Option<bool>,
    /// The response as generated (stop token removed).
    pub response: String,
    /// The answer as the benchmark's official harness takes it: HumanEval's
    /// `completion`, EvalPlus's `solution`, CRUXEval's generation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion: Option<String>,
}

/// One member's (or the baseline's) score on one benchmark.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchmarkResult {
    pub benchmark: String,
    pub member: String,
    /// Problems (items) evaluated.
    pub n: usize,
    /// Problems solved by at least one sample.
    pub correct: usize,
    /// Mean over problems of the fraction of correct samples (the unbiased
    /// pass@1). With one sample per problem this is `correct / n`.
    pub pass_at_1: f64,
    /// `(k, pass@k)`, when more than one sample per problem was drawn.
    pub pass_at_k: Option<(usize, f64)>,
}

impl BenchmarkResult {
    /// Summarise per-problem `(samples, correct samples)` counts. `k` adds
    /// pass@k (see [`humaneval::pass_at_k`]); it needs `samples >= k` to be
    /// meaningful.
    pub fn from_counts(
        benchmark: &str,
        member: &str,
        per_problem: &[(usize, usize)],
        k: Option<usize>,
    ) -> BenchmarkResult {
        let mean_pass_at = |k: usize| {
            if per_problem.is_empty() {
                return 0.0;
            }
            let total: f64 = per_problem
                .iter()
                .map(|&(n, c)| humaneval::pass_at_k(n, c, k))
                .sum();
            total / per_problem.len() as f64
        };
        BenchmarkResult {
            benchmark: benchmark.to_string(),
            member: member.to_string(),
            n: per_problem.len(),
            correct: per_problem.iter().filter(|&&(_, c)| c > 0).count(),
            pass_at_1: mean_pass_at(1),
            pass_at_k: k.map(|k| (k, mean_pass_at(k))),
        }
    }
}

/// A plain-text table of pass@1 (and pass@k) in percent: one row per member,
/// one column per benchmark (and per benchmark's pass@k), then the population
/// mean, the best and weakest member in each column (named in brackets) and
/// one row per labelled reference (the baseline, the base model), each its
/// results' first member. Members and benchmarks keep their first-seen order.
pub fn table(results: &[BenchmarkResult], references: &[(&str, &[BenchmarkResult])]) -> String {
    let all_references: Vec<BenchmarkResult> = references
        .iter()
        .flat_map(|(_, r)| r.iter().cloned())
        .collect();
    let columns = columns(results, &all_references);
    let members = first_seen(results.iter().map(|r| r.member.as_str()));

    let mut header = vec!["member".to_string()];
    header.extend(columns.iter().map(Column::title));
    let mut rows = vec![header];
    for member in &members {
        let mut row = vec![member.to_string()];
        row.extend(columns.iter().map(|c| cell(c.value(results, member))));
        rows.push(row);
    }
    if !members.is_empty() {
        rows.push(summary_row("population mean", &columns, |c| {
            mean(&c.values(results, &members)).map(percent)
        }));
        rows.push(summary_row("best", &columns, |c| {
            extreme(&c.values(results, &members), &members, f64::gt)
        }));
        rows.push(summary_row("weakest", &columns, |c| {
            extreme(&c.values(results, &members), &members, f64::lt)
        }));
    }
    for (label, reference) in references {
        rows.push(summary_row(label, &columns, |c| {
            let value = first_seen(reference.iter().map(|r| r.member.as_str()))
                .first()
                .and_then(|m| c.value(reference, m));
            value.map(percent)
        }));
    }
    render(&rows)
}

/// One numeric column of the table.
struct Column {
    benchmark: String,
    /// `None`: pass@1; `Some(k)`: pass@k.
    k: Option<usize>,
    /// Problems in the benchmark (of its first result).
    n: usize,
}

impl Column {
    fn title(&self) -> String {
        match self.k {
            None => format!("{} pass@1 (n={})", self.benchmark, self.n),
            Some(k) => format!("{} pass@{k}", self.benchmark),
        }
    }

    fn value(&self, results: &[BenchmarkResult], member: &str) -> Option<f64> {
        let result = results
            .iter()
            .find(|r| r.benchmark == self.benchmark && r.member == member)?;
        match self.k {
            None => Some(result.pass_at_1),
            Some(k) => result.pass_at_k.filter(|&(rk, _)| rk == k).map(|(_, v)| v),
        }
    }

    fn values(&self, results: &[BenchmarkResult], members: &[&str]) -> Vec<Option<f64>> {
        members.iter().map(|m| self.value(results, m)).collect()
    }
}

fn columns(results: &[BenchmarkResult], baseline: &[BenchmarkResult]) -> Vec<Column> {
    let all: Vec<&BenchmarkResult> = results.iter().chain(baseline).collect();
    let mut columns: Vec<Column> = Vec::new();
    for result in &all {
        let mut wanted = vec![None];
        wanted.extend(result.pass_at_k.map(|(k, _)| Some(k)));
        for k in wanted {
            let seen = columns
                .iter()
                .any(|c| c.benchmark == result.benchmark && c.k == k);
            if !seen {
                columns.push(Column {
                    benchmark: result.benchmark.clone(),
                    k,
                    n: result.n,
                });
            }
        }
    }
    // Keep each benchmark's pass@k columns next to its pass@1.
    let order = first_seen(all.iter().map(|r| r.benchmark.as_str()));
    let position = |c: &Column| order.iter().position(|b| *b == c.benchmark);
    columns.sort_by_key(|c| (position(c), c.k));
    columns
}

fn summary_row(
    label: &str,
    columns: &[Column],
    value: impl Fn(&Column) -> Option<String>,
) -> Vec<String> {
    let mut row = vec![label.to_string()];
    row.extend(
        columns
            .iter()
            .map(|c| value(c).unwrap_or_else(|| "-".into())),
    );
    row
}

fn first_seen<'a>(names: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut seen: Vec<&str> = Vec::new();
    for name in names {
        if !seen.contains(&name) {
            seen.push(name);
        }
    }
    seen
}

fn mean(values: &[Option<f64>]) -> Option<f64> {
    let present: Vec<f64> = values.iter().flatten().copied().collect();
    (!present.is_empty()).then(|| present.iter().sum::<f64>() / present.len() as f64)
}

/// The value that wins under `better` (first one on ties), with its member.
fn extreme(
    values: &[Option<f64>],
    members: &[&str],
    better: fn(&f64, &f64) -> bool,
) -> Option<String> {
    let mut winner: Option<(f64, &str)> = None;
    for (value, member) in values.iter().zip(members) {
        if let Some(v) = *value {
            if winner.is_none_or(|(w, _)| better(&v, &w)) {
                winner = Some((v, member));
            }
        }
    }
    winner.map(|(v, member)| format!("{} ({member})", percent(v)))
}

fn percent(value: f64) -> String {
    format!("{:.1}", value * 100.0)
}

fn cell(value: Option<f64>) -> String {
    value.map_or_else(|| "-".into(), percent)
}

/// Left-aligned first column, right-aligned numbers, a rule under the header.
fn render(rows: &[Vec<String>]) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|i| {
            rows.iter()
                .filter_map(|r| r.get(i))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for (index, row) in rows.iter().enumerate() {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(i, (text, &width))| {
                if i == 0 {
                    format!("{text:<width$}")
                } else {
                    format!("{text:>width$}")
                }
            })
            .collect();
        let _ = writeln!(out, "{}", cells.join("  ").trim_end());
        if index == 0 {
            let total = widths.iter().sum::<usize>() + 2 * widths.len().saturating_sub(1);
            let _ = writeln!(out, "{}", "-".repeat(total));
        }
    }
    out
}
