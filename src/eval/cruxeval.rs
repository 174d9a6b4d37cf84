//! CRUXEval (Gu et al. 2024): 800 short Python functions `f`, each with one
//! input and its output. CRUXEval-O predicts the output from the function
//! and the input, CRUXEval-I an input from the function and the output: the
//! held-out form of AZR's deduction and abduction.
//!
//! Scored as the official harness scores a generation `g`
//! (facebookresearch/cruxeval, `evaluation/utils_general.py`): the program
//! `{code}\nassert {output} == {g}` is executed under a 3 s limit and passes
//! when nothing is raised; first, an output prediction that contains the
//! call `f({input})` fails, and so does an input prediction without `f(`.
//! Our solver answers input prediction with the arguments alone, so its
//! generation is the call `f({answer})`.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::humaneval_io::IoKind;
use super::EvalError;
use crate::task::grammar::{arity, MAX_PARAMS};
use crate::verify::{Job, VerifierPool};

/// Functions in the set.
pub const PROBLEMS: usize = 800;
/// The official check's time limit (`check_correctness(..., 3)`).
const TIME_LIMIT_S: f64 = 3.0;
/// Its process is joined one second later (`p.join(timeout=timeout + 1)`).
const JOB_TIMEOUT_MS: u64 = 4_000;

/// One function, as in `cruxeval.jsonl`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Problem {
    /// `def f(...)` and its body.
    pub code: String,
    /// The arguments of the call, as text (`[1, 2], 3`).
    pub input: String,
    /// The call's value, as a Python literal.
    pub output: String,
    /// `sample_N`, N its line (from 0): the key of the harness's generations.
    pub id: String,
}

/// Load `cruxeval.jsonl`; every id must be `sample_N` on line N + 1, since
/// the official harness reads generations by that key.
pub fn load(path: &Path) -> Result<Vec<Problem>, EvalError> {
    let records: Vec<(usize, Problem)> = super::read_jsonl(path)?;
    records
        .into_iter()
        .enumerate()
        .map(|(index, (line, problem))| {
            if problem.id != format!("sample_{index}") {
                let message = format!("id {} where sample_{index} belongs", problem.id);
                return Err(super::bad_record(path, line, message));
            }
            Ok(problem)
        })
        .collect()
}

/// What the official harness scores for our answer: the predicted value
/// (`Output`), or the call `f(ARGS)` with the predicted arguments (`Input`).
pub fn generation(kind: IoKind, answer: &str) -> String {
    match kind {
        IoKind::Output => answer.to_string(),
        IoKind::Input => format!("f({answer})"),
    }
}

/// The program the official harness executes for `generation`, or `None`
/// when its text alone fails it.
pub fn check_program(problem: &Problem, kind: IoKind, generation: &str) -> Option<String> {
    let refused = match kind {
        IoKind::Output => generation.contains(&format!("f({})", problem.input)),
        IoKind::Input => !generation.contains("f("),
    };
    (!refused).then(|| {
        format!(
            "{}\nassert {} == {}",
            problem.code, problem.output, generation
        )
    })
}

/// The sandbox job that checks `generation`, or `None` when it fails on its
/// text alone (see [`check_program`]).
pub fn job(problem: &Problem, kind: IoKind, generation: &str) -> Option<Job> {
    let program = check_program(problem, kind, generation)?;
    Some(Job::Harness {
        harness: super::HARNESS,
        program,
        args: serde_json::json!({ "check": "exec", "seconds": TIME_LIMIT_S }),
        timeout_ms: JOB_TIMEOUT_MS,
        memory_mb: 0,
    })
}

/// Does `generation` pass, as the official harness judges it?
pub fn score(
    pool: &VerifierPool,
    problem: &Problem,
    kind: IoKind,
    generation: &str,
) -> Result<bool, EvalError> {
    match job(problem, kind, generation) {
        Some(job) => Ok(pool.run(&job)?.status() == crate::verify::Status::Ok),
        None => Ok(false),
    }
}

/// The ids of the functions whose inputs the solver grammar cannot write: it
/// writes 1 to [`MAX_PARAMS`] plain arguments, and these functions take more
/// or an open number (defaults, `*args`).
pub fn unanswerable_inputs(problems: &[Problem]) -> Vec<&str> {
    problems
        .iter()
        .filter(|p| arity(&p.code).is_none_or(|a| a == 0 || a > MAX_PARAMS))
        .map(|p| p.id.as_str())
        .collect()
}

/// The official harness's generations file: `{"sample_N": [generation]}`
/// for every function of `problems`, in order; a function without an
/// answer gets `[""]`, which the harness fails.
pub fn write_generations(
    path: &Path,
    problems: &[Problem],
    generations: &BTreeMap<&str, &str>,
) -> Result<(), EvalError> {
    let mut out = serde_json::Map::new();
    for problem in problems {
        let generation = generations.get(problem.id.as_str()).copied().unwrap_or("");
        out.insert(problem.id.clone(), serde_json::json!([generation]));
    }
    let text = serde_json::Value::Object(out).to_string();
    std::fs::write(path, text).map_err(|source| EvalError::Write {
        path: path.to_path_buf(),
        source,
    })
}

/// The generations file's name for one row: the official script takes its
/// mode from whether the path contains "input".
pub fn generations_file_name(kind: IoKind, row: &str) -> String {
    let mode = match kind {
        IoKind::Output => "output",
        IoKind::Input => "input",
    };
    format!("cruxeval-generations-{row}-{mode}.json")
}
