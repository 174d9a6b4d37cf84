//! EvalPlus (Liu et al. 2023): HumanEval+ (the 164 HumanEval tasks) and
//! MBPP+ (378 sanitized MBPP tasks), each task with the original tests'
//! inputs (`base_input`) and many more (`plus_input`), scored by differential
//! testing against the task's canonical solution, as `evalplus.evaluate`
//! 0.3.1 scores them:
//!
//! - A solution passes *base* when, on every base input, its output equals
//!   the canonical solution's, and *plus* when it passes base and the same
//!   holds on every plus input. Each part is checked in its own child;
//!   the first failing input ends a part.
//! - Equality is `==`, except: with a task's `atol` (or, once an expected
//!   output is a float or a list of floats, 1e-6 for an `atol` of 0) a
//!   result of the expected type and length is also equal within
//!   `numpy.allclose(rtol=1e-7, atol)`; the special oracles (HumanEval/32's
//!   root check, MBPP+'s set-equality, not-None and four task-specific
//!   tasks) are EvalPlus's. HumanEval/32 fails whatever the answer, as it does
//!   under EvalPlus 0.3.1 (its root check passes an input without counting
//!   it as passed).
//! - Each input's time limit is max(1 s, 4 × the canonical solution's time on
//!   it), and a part's whole check gets min(60 s, the limits' sum) + 2 s, as
//!   EvalPlus derives them (`DEFAULT_MIN_TIME_LIMIT`, `..._GT_TIME_LIMIT_FACTOR`,
//!   `untrusted_check`). The canonical times are measured once per data
//!   file, in the sandbox, and cached ([`reference_times`]).
//!
//! Expected outputs come from the canonical solution run in the sandbox.
//! EvalPlus pickles them all once; here a handful are hundreds of megabytes
//! (HumanEval/15's plus outputs, Mbpp/255's), too much to keep or to send to
//! every check, so each check's child computes them, one input at a time
//! just before the solution under test meets it (only the solution's time
//! counts against the limits). The checks themselves are `src/eval/harness.py`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{ChatPrompt, EvalError};
use crate::verify::{Job, Outcome, Status, VerifierPool};

/// EvalPlus's `DEFAULT_MIN_TIME_LIMIT` (0.3.1): the least time an input gets.
pub const MIN_TIME_LIMIT_S: f64 = 1.0;
/// EvalPlus's `DEFAULT_GT_TIME_LIMIT_FACTOR`: an input's limit over the canonical time.
pub const TIME_LIMIT_FACTOR: f64 = 4.0;
/// EvalPlus's `EVALPLUS_TIMEOUT_PER_TASK` default: a part's limits' sum, at most.
const PART_TIMEOUT_S: f64 = 60.0;
/// EvalPlus's memory limit per check (`EVALPLUS_MAX_MEMORY_BYTES`, 4 GiB).
const MEMORY_MB: u64 = 4096;
/// Wall-clock limit of a reference-time job (no limit in EvalPlus).
const REFERENCE_TIMEOUT_MS: u64 = 600_000;

/// MBPP+ tasks whose output is compared only as "is not None" (EvalPlus's
/// `MBPP_OUTPUT_NOT_NONE_TASKS`, by entry point).
const MBPP_OUTPUT_NOT_NONE: [&str; 3] = ["check_str", "text_match_three", "text_starta_endb"];

const SYSTEM: &str = "You are a careful Python programmer.";

/// Which EvalPlus set (its `--dataset`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dataset {
    HumanEval,
    Mbpp,
}

impl Dataset {
    /// EvalPlus's name for it (`evalplus.evaluate --dataset`).
    pub fn name(self) -> &'static str {
        match self {
            Dataset::HumanEval => "humaneval",
            Dataset::Mbpp => "mbpp",
        }
    }
}

/// One task. The inputs stay in the record's own JSON text: they hold
/// numbers JSON parsers disagree on (`Infinity`, integers of hundreds of
/// digits), which only the harness's Python reads.
#[derive(Debug, Clone, PartialEq)]
pub struct Task {
    pub dataset: Dataset,
    pub task_id: String,
    /// HumanEval+: signature and docstring; MBPP+: a docstring with the
    /// description and one example assert.
    pub prompt: String,
    pub entry_point: String,
    pub canonical_solution: String,
    pub atol: f64,
    pub base_inputs: usize,
    pub plus_inputs: usize,
    /// The task's line of the data file, as released.
    pub record: String,
}

#[derive(Deserialize)]
struct Record {
    task_id: String,
    prompt: String,
    entry_point: String,
    canonical_solution: String,
    atol: f64,
    #[serde(deserialize_with = "count_inputs")]
    base_input: usize,
    #[serde(deserialize_with = "count_inputs")]
    plus_input: usize,
}

/// The number of inputs in a list of them (or in `{}`, which Mbpp/793 has
/// for its plus inputs: none), without reading them.
fn count_inputs<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<usize, D::Error> {
    struct Count;
    impl<'de> serde::de::Visitor<'de> for Count {
        type Value = usize;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a list of inputs")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<usize, A::Error> {
            let mut n = 0;
            while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                n += 1;
            }
            Ok(n)
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<usize, A::Error> {
            let mut n = 0;
            while map
                .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                .is_some()
            {
                n += 1;
            }
            Ok(n)
        }
    }
    deserializer.deserialize_any(Count)
}

/// Load `HumanEvalPlus-*.jsonl.gz` or `MbppPlus-*.jsonl.gz`.
pub fn load(path: &Path, dataset: Dataset) -> Result<Vec<Task>, EvalError> {
    let text = super::read_text(path)?;
    let mut tasks = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let record: Record = serde_json::from_str(&readable(line))
            .map_err(|e| super::bad_record(path, index + 1, e.to_string()))?;
        tasks.push(Task {
            dataset,
            task_id: record.task_id,
            prompt: record.prompt,
            entry_point: record.entry_point,
            canonical_solution: record.canonical_solution,
            atol: record.atol,
            base_inputs: record.base_input,
            plus_inputs: record.plus_input,
            record: line.to_string(),
        });
    }
    Ok(tasks)
}

/// `line` with what serde_json cannot read outside strings made readable:
/// `NaN` and `Infinity` (Python's JSON) and numbers of more than 30
/// characters (beyond an f64) become `0`. Only the counts of inputs are read
/// from it; the inputs themselves go to the harness as released.
fn readable(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut in_string = false;
    let mut escaped = false;
    let mut token = String::new();
    let flush = |token: &mut String, out: &mut String| {
        let number = token.bytes().any(|b| b.is_ascii_digit());
        let special = matches!(token.as_str(), "NaN" | "Infinity" | "-Infinity");
        if special || (number && token.len() > 30) {
            out.push('0');
        } else {
            out.push_str(token);
        }
        token.clear();
    };
    for c in line.chars() {
        if in_string {
            out.push(c);
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
        } else if c.is_ascii_alphanumeric() || matches!(c, '-' | '+' | '.') {
            token.push(c);
        } else {
            flush(&mut token, &mut out);
            out.push(c);
            in_string = c == '"';
        }
    }
    flush(&mut token, &mut out);
    out
}

/// The prompt: HumanEval+ asks to complete the function, as `humaneval`
/// does; MBPP+ gives its task's `prompt` (description and one assert) and
/// asks for the function.
pub fn prompt(task: &Task) -> ChatPrompt {
    let user = match task.dataset {
        Dataset::HumanEval => format!(
            "Complete this Python function. Reply with the whole function in one ```python block.\n```python\n{}```",
            task.prompt
        ),
        Dataset::Mbpp => format!(
            "{}\nReply with the Python function in one ```python block.",
            task.prompt.trim().trim_matches('"').trim()
        ),
    };
    ChatPrompt {
        system: SYSTEM.to_string(),
        user,
    }
}

/// The solution EvalPlus runs for a response (its samples' `solution`):
/// HumanEval+ the prompt followed by the completion `humaneval` takes from
/// the response; MBPP+ the response's code (the first fenced block defining
/// the entry point, else the first `python` block, else the first block,
/// else the whole response), top-level statements other than imports and
/// definitions dropped.
pub fn solution_from_response(task: &Task, response: &str) -> String {
    match task.dataset {
        Dataset::HumanEval => {
            let problem = super::humaneval::Problem {
                task_id: task.task_id.clone(),
                prompt: task.prompt.clone(),
                canonical_solution: String::new(),
                test: String::new(),
                entry_point: task.entry_point.clone(),
            };
            let completion = super::humaneval::completion_from_response(&problem, response);
            super::humaneval::program(&problem, &completion)
        }
        Dataset::Mbpp => super::humaneval::definitions_from_response(response, &task.entry_point),
    }
}

/// The canonical program: EvalPlus's `prompt + canonical_solution`.
fn canonical(task: &Task) -> String {
    format!("{}{}", task.prompt, task.canonical_solution)
}

/// Which inputs of a task: the original tests' or EvalPlus's added ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Base,
    Plus,
}

impl Part {
    fn name(self) -> &'static str {
        match self {
            Part::Base => "base",
            Part::Plus => "plus",
        }
    }
}

fn harness_args(task: &Task, part: Part) -> serde_json::Value {
    serde_json::json!({
        "dataset": task.dataset.name(),
        "record": task.record,
        "part": part.name(),
        "entry_point": task.entry_point,
        "output_not_none": task.dataset == Dataset::Mbpp
            && MBPP_OUTPUT_NOT_NONE.contains(&task.entry_point.as_str()),
    })
}

/// The canonical solution's time on each input of each part of one task, in seconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReferenceTimes {
    pub base: Vec<f64>,
    pub plus: Vec<f64>,
}

impl ReferenceTimes {
    fn of(&self, part: Part) -> &[f64] {
        match part {
            Part::Base => &self.base,
            Part::Plus => &self.plus,
        }
    }
}

/// Each input's time limit: max(1 s, 4 × the canonical time).
pub fn time_limits(reference: &[f64]) -> Vec<f64> {
    reference
        .iter()
        .map(|t| (TIME_LIMIT_FACTOR * t).max(MIN_TIME_LIMIT_S))
        .collect()
}

/// The reference times of `tasks`: read from the file `cache` when it holds
/// exactly these tasks, else measured now in the sandbox, one job per task
/// and part, and written there. A canonical solution that fails in the
/// sandbox is an error naming its task.
pub fn reference_times(
    pool: &VerifierPool,
    tasks: &[Task],
    cache: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<BTreeMap<String, ReferenceTimes>, EvalError> {
    let dataset = tasks.first().map_or(Dataset::HumanEval, |t| t.dataset);
    let path = cache;
    if let Some(times) = read_cache(path, tasks) {
        return Ok(times);
    }
    progress(&format!(
        "{}: timing the canonical solutions of {} tasks in the sandbox (once per data file, cached in {})",
        dataset.name(),
        tasks.len(),
        path.display()
    ));
    let started = std::time::Instant::now();
    let jobs: Vec<Job> = tasks
        .iter()
        .flat_map(|task| {
            [Part::Base, Part::Plus].map(|part| {
                let mut args = harness_args(task, part);
                args["check"] = "evalplus_expected".into();
                Job::Harness {
                    harness: super::HARNESS,
                    program: canonical(task),
                    args,
                    timeout_ms: REFERENCE_TIMEOUT_MS,
                    memory_mb: MEMORY_MB,
                }
            })
        })
        .collect();
    let outcomes = pool.batch(&jobs);
    let mut times = BTreeMap::new();
    for (task, pair) in tasks.iter().zip(outcomes.chunks(2)) {
        let [base, plus] = pair else {
            return Err(sandbox_error("a reference-time job returned nothing"));
        };
        let parse = |outcome: &Result<Outcome, crate::verify::Error>, part: Part| {
            reference_seconds(task, part, outcome)
        };
        let reference = ReferenceTimes {
            base: parse(base, Part::Base)?,
            plus: parse(plus, Part::Plus)?,
        };
        times.insert(task.task_id.clone(), reference);
    }
    progress(&format!(
        "{}: canonical solutions timed in {:.0} s",
        dataset.name(),
        started.elapsed().as_secs_f64()
    ));
    write_cache(path, &times)?;
    Ok(times)
}

fn reference_seconds(
    task: &Task,
    part: Part,
    outcome: &Result<Outcome, crate::verify::Error>,
) -> Result<Vec<f64>, EvalError> {
    let failed = |why: String| {
        sandbox_error(&format!(
            "{}'s canonical solution failed on its {} inputs in the sandbox: {why}",
            task.task_id,
            part.name()
        ))
    };
    let result = match outcome {
        Ok(Outcome::Harness(result)) => result,
        Ok(_) => return Err(failed("the sandbox answered another job".into())),
        Err(e) => return Err(failed(e.to_string())),
    };
    if result.status != Status::Ok {
        return Err(failed(format!(
            "{}: {}",
            result.status.name(),
            result.reason
        )));
    }
    let seconds: Vec<f64> = result
        .outputs
        .first()
        .and_then(|text| serde_json::from_str(text).ok())
        .ok_or_else(|| failed("no times came back".into()))?;
    let wanted = match part {
        Part::Base => task.base_inputs,
        Part::Plus => task.plus_inputs,
    };
    if seconds.len() != wanted {
        return Err(failed(format!(
            "{} times for {wanted} inputs",
            seconds.len()
        )));
    }
    Ok(seconds)
}

fn sandbox_error(message: &str) -> EvalError {
    EvalError::Sandbox(crate::verify::Error::Job(message.to_string()))
}

/// Where a data file's reference times are cached:
/// `$POPULORA_HOME/evalplus/<dataset>-<sha256>.json`.
pub fn reference_cache(dataset: Dataset, data_sha256: &str) -> PathBuf {
    crate::base::fetch::cache_dir()
        .join("evalplus")
        .join(format!("{}-{data_sha256}.json", dataset.name()))
}

/// The cached times when they cover exactly `tasks` (else they are measured again).
fn read_cache(path: &Path, tasks: &[Task]) -> Option<BTreeMap<String, ReferenceTimes>> {
    let bytes = std::fs::read(path).ok()?;
    let times: BTreeMap<String, ReferenceTimes> = serde_json::from_slice(&bytes).ok()?;
    let fits = times.len() == tasks.len()
        && tasks.iter().all(|t| {
            times
                .get(&t.task_id)
                .is_some_and(|r| r.base.len() == t.base_inputs && r.plus.len() == t.plus_inputs)
        });
    fits.then_some(times)
}

fn write_cache(path: &Path, times: &BTreeMap<String, ReferenceTimes>) -> Result<(), EvalError> {
    let write_error = |source| EvalError::Write {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(write_error)?;
    }
    let partial = path.with_extension(format!("partial-{}", std::process::id()));
    let text = serde_json::to_vec(times).map_err(|e| write_error(e.into()))?;
    std::fs::write(&partial, text).map_err(write_error)?;
    std::fs::rename(&partial, path).map_err(write_error)
}

/// The sandbox job checking `solution` on one part of `task`.
pub fn job(task: &Task, reference: &ReferenceTimes, part: Part, solution: &str) -> Job {
    let limits = time_limits(reference.of(part));
    let budget_s = PART_TIMEOUT_S.min(limits.iter().sum()) + 2.0;
    // The child also computes the expected outputs: give it that time too.
    let canonical_s: f64 = reference.of(part).iter().sum();
    let timeout_ms = ((budget_s + 2.0 * canonical_s + 5.0) * 1000.0).ceil() as u64;
    let mut args = harness_args(task, part);
    args["check"] = "evalplus".into();
    args["canonical"] = canonical(task).into();
    args["time_limits"] = limits.into();
    args["atol"] = task.atol.into();
    Job::Harness {
        harness: super::HARNESS,
        program: solution.to_string(),
        args,
        timeout_ms,
        memory_mb: MEMORY_MB,
    }
}

/// A solution's verdicts, as EvalPlus reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    /// Passed every base input.
    pub base: bool,
    /// Passed every base and every plus input (EvalPlus's headline "+" score).
    pub plus: bool,
}

/// Check `solution` on both parts of `task` (in parallel on the pool's zygotes).
pub fn score(
    pool: &VerifierPool,
    task: &Task,
    reference: &ReferenceTimes,
    solution: &str,
) -> Result<Verdict, EvalError> {
    let jobs = [Part::Base, Part::Plus].map(|part| job(task, reference, part, solution));
    let mut passed = pool
        .batch(&jobs)
        .into_iter()
        .map(|outcome| Ok(outcome?.status() == Status::Ok));
    let mut next = || {
        passed
            .next()
            .unwrap_or_else(|| Err(sandbox_error("a check returned nothing")))
    };
    let base = next()?;
    let plus = next()?;
    Ok(Verdict {
        base,
        plus: base && plus,
    })
}

/// Write EvalPlus's samples file: one `{"task_id", "solution"}` per line.
pub fn write_samples(path: &Path, samples: &[(&str, &str)]) -> Result<(), EvalError> {
    #[derive(Serialize)]
    struct Sample<'a> {
        task_id: &'a str,
        solution: &'a str,
    }
    let samples: Vec<Sample> = samples
        .iter()
        .map(|&(task_id, solution)| Sample { task_id, solution })
        .collect();
    super::write_jsonl(path, &samples)
}
