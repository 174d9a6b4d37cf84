//! HumanEval-IO: held-out code-reasoning items in the self-play formats,
//! built from HumanEval's reference solutions and test asserts.
//!
//! For every `assert candidate(ARGS) == EXPECTED` line of a problem's tests
//! (an optional `, "message"` and indentation allowed) we make
//! - an *output* item (deduction): program + `ARGS` → the output, and
//! - an *input* item (abduction): program + output → any `ARGS'` with
//!   `f(ARGS') == output`.
//!
//! The program is `prompt + canonical_solution` with its docstrings removed
//! (their `>>>` examples often are the test cases) and the entry point
//! renamed to `f`, as in the self-play prompts. Problems whose
//! program is not a single function (helpers) or is otherwise invalid for
//! the sandbox are dropped by the sandbox itself.
//!
//! Asserts are split here, in Rust, by a small string- and bracket-aware
//! scanner rather than Python's `ast`: the scanner only has to be *safe*
//! (never yield a wrong item), not complete, because every candidate is
//! then verified in the sandbox — `f(ARGS)` runs (twice, for determinism)
//! and its repr must equal `EXPECTED` under the same literal comparison used
//! for answers. What fails is dropped; an item's `output` is the repr the
//! sandbox produced, so golds have exactly the self-play triplet format.

use super::humaneval::Problem;
use super::EvalError;
use crate::verify::{Job, Outcome, Status, VerifierPool};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::ops::Range;

/// The sandbox truncates `repr(f(x))` to this many characters.
const SANDBOX_OUTPUT_CHARS: usize = 400;

/// What the solver must predict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IoKind {
    /// Given program and input, predict the output (AZR deduction, `code_o`).
    Output,
    /// Given program and output, find an input (AZR abduction, `code_i`).
    Input,
}

/// One item; the fields map one-to-one onto a self-play triplet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IoItem {
    pub task_id: String,
    pub kind: IoKind,
    /// One function named `f`.
    pub program: String,
    /// The arguments of `f` as the text between the call's parentheses.
    pub input: String,
    /// `repr(f(input))`.
    pub output: String,
}

/// How many items to build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoConfig {
    /// Items of each kind per problem. Output items have distinct inputs,
    /// input items distinct outputs.
    pub per_kind: usize,
    /// Longest input or output text kept (a small model's context is short).
    pub max_chars: usize,
    /// Asserts checked per problem, in test order.
    pub max_candidates: usize,
}

impl Default for IoConfig {
    fn default() -> Self {
        IoConfig {
            per_kind: 3,
            max_chars: 200,
            max_candidates: 12,
        }
    }
}

/// What [`build`] made and what it dropped.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct BuildStats {
    pub problems: usize,
    /// Problems whose program could not be derived (no `def <entry_point>(`
    /// line, or `f` already used as a name).
    pub no_program: usize,
    /// Assert lines matching the pattern (before the per-problem cap).
    pub asserts: usize,
    /// Candidates run in the sandbox.
    pub checked: usize,
    /// Candidates that ran and matched `EXPECTED`.
    pub verified: usize,
    /// Dropped candidates by sandbox status (`mismatch`: `EXPECTED` differs
    /// from the repr; `too_long`: output over `max_chars`).
    pub dropped: BTreeMap<String, usize>,
    /// Problems with at least one item.
    pub problems_used: usize,
    pub output_items: usize,
    pub input_items: usize,
}

/// The items and how they were made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoSet {
    pub items: Vec<IoItem>,
    pub stats: BuildStats,
}

/// An assert to check: `f(args) == expected` for one problem's program.
struct Candidate {
    /// Index into the problems.
    problem: usize,
    program: String,
    args: String,
    expected: String,
}

/// A candidate that held, with the repr the sandbox produced.
struct Verified<'a> {
    candidate: &'a Candidate,
    output: String,
}

/// Build and verify the items. Sandbox failures (not program failures) are errors.
pub fn build(
    pool: &VerifierPool,
    problems: &[Problem],
    config: &IoConfig,
) -> Result<IoSet, EvalError> {
    let mut stats = BuildStats {
        problems: problems.len(),
        ..BuildStats::default()
    };
    let candidates = candidates(problems, config, &mut stats);
    let verified = verify(pool, &candidates, config, &mut stats)?;
    let mut items = Vec::new();
    for (index, problem) in problems.iter().enumerate() {
        let pairs: Vec<&Verified> = verified
            .iter()
            .filter(|v| v.candidate.problem == index)
            .collect();
        if !pairs.is_empty() {
            stats.problems_used += 1;
            items.extend(select(problem, &pairs, config.per_kind));
        }
    }
    stats.output_items = items.iter().filter(|i| i.kind == IoKind::Output).count();
    stats.input_items = items.len() - stats.output_items;
    Ok(IoSet { items, stats })
}

/// The first `max_candidates` short asserts with distinct arguments of
/// every problem that has a program.
fn candidates(problems: &[Problem], config: &IoConfig, stats: &mut BuildStats) -> Vec<Candidate> {
    let mut candidates = Vec::new();
    for (index, problem) in problems.iter().enumerate() {
        let Some(program) = function_program(problem) else {
            stats.no_program += 1;
            continue;
        };
        let asserts = extract_asserts(&problem.test);
        stats.asserts += asserts.len();
        let mut seen: Vec<String> = Vec::new();
        for (args, expected) in asserts {
            let short = args.chars().count() <= config.max_chars
                && expected.chars().count() <= config.max_chars;
            if short && !seen.contains(&args) && seen.len() < config.max_candidates {
                seen.push(args.clone());
                candidates.push(Candidate {
                    problem: index,
                    program: program.clone(),
                    args,
                    expected,
                });
            }
        }
    }
    stats.checked = candidates.len();
    candidates
}

/// Run every candidate (as a proposal: single function, allowed imports,
/// deterministic), then compare its repr with `EXPECTED`; keep those that
/// match, in candidate order.
fn verify<'a>(
    pool: &VerifierPool,
    candidates: &'a [Candidate],
    config: &IoConfig,
    stats: &mut BuildStats,
) -> Result<Vec<Verified<'a>>, EvalError> {
    let runs: Vec<Job> = candidates
        .iter()
        .map(|c| Job::Proposal {
            program: c.program.clone(),
            input: c.args.clone(),
        })
        .collect();
    let mut ran = Vec::new();
    for (candidate, outcome) in candidates.iter().zip(pool.batch(&runs)) {
        let Outcome::Proposal(validation) = outcome? else {
            return Err(unexpected_reply());
        };
        let Some(output) = validation
            .output
            .filter(|_| validation.status == Status::Ok)
        else {
            count(stats, validation.status.name());
            continue;
        };
        let chars = output.chars().count();
        if chars > config.max_chars || chars >= SANDBOX_OUTPUT_CHARS {
            count(stats, "too_long");
            continue;
        }
        ran.push(Verified { candidate, output });
    }

    let comparisons: Vec<Job> = ran
        .iter()
        .map(|v| Job::Output {
            predicted: v.output.clone(),
            gold: v.candidate.expected.clone(),
        })
        .collect();
    let mut verified = Vec::new();
    for (pair, outcome) in ran.into_iter().zip(pool.batch(&comparisons)) {
        let status = outcome?.status();
        if status == Status::Ok {
            verified.push(pair);
        } else {
            count(stats, status.name());
        }
    }
    stats.verified = verified.len();
    Ok(verified)
}

fn count(stats: &mut BuildStats, reason: &str) {
    *stats.dropped.entry(reason.to_string()).or_default() += 1;
}

fn unexpected_reply() -> EvalError {
    let message = "the sandbox answered a proposal with a check".to_string();
    EvalError::Sandbox(crate::verify::Error::Protocol(message))
}

/// Up to `per_kind` output items with distinct inputs (all candidates have
/// distinct inputs) and up to `per_kind` input items with distinct outputs.
fn select(problem: &Problem, pairs: &[&Verified], per_kind: usize) -> Vec<IoItem> {
    let item = |kind, pair: &Verified| IoItem {
        task_id: problem.task_id.clone(),
        kind,
        program: pair.candidate.program.clone(),
        input: pair.candidate.args.clone(),
        output: pair.output.clone(),
    };
    let mut items: Vec<IoItem> = pairs
        .iter()
        .take(per_kind)
        .map(|p| item(IoKind::Output, p))
        .collect();
    let mut outputs: Vec<&str> = Vec::new();
    for pair in pairs {
        if outputs.len() == per_kind {
            break;
        }
        if !outputs.contains(&pair.output.as_str()) {
            outputs.push(&pair.output);
            items.push(item(IoKind::Input, pair));
        }
    }
    items
}

/// The sandbox job that checks `answer` for `item`, for [`VerifierPool::batch`]:
/// a predicted output (`Output` items) or predicted arguments (`Input` items).
pub fn job(item: &IoItem, answer: &str) -> Job {
    match item.kind {
        IoKind::Output => Job::Output {
            predicted: answer.to_string(),
            gold: item.output.clone(),
        },
        IoKind::Input => Job::Input {
            program: item.program.clone(),
            predicted_input: answer.to_string(),
            gold_output: item.output.clone(),
        },
    }
}

/// Deduction: is `predicted` (a repr) the same value as the item's output?
pub fn score_output(
    pool: &VerifierPool,
    item: &IoItem,
    predicted: &str,
) -> Result<bool, EvalError> {
    Ok(pool.check_output(predicted, &item.output)?.passed())
}

/// Abduction: does `f(predicted_args) == output`?
pub fn score_input(
    pool: &VerifierPool,
    item: &IoItem,
    predicted_args: &str,
) -> Result<bool, EvalError> {
    Ok(pool
        .check_input(&item.program, predicted_args, &item.output)?
        .passed())
}

/// [`score_output`] or [`score_input`], by the item's kind.
pub fn score(pool: &VerifierPool, item: &IoItem, answer: &str) -> Result<bool, EvalError> {
    match item.kind {
        IoKind::Output => score_output(pool, item, answer),
        IoKind::Input => score_input(pool, item, answer),
    }
}

/// `prompt + canonical_solution` with standalone string statements
/// (docstrings) removed and the entry point renamed to `f`. `None` when
/// there is no top-level `def <entry_point>(`, when `f` is already a name in
/// the program, or when the source has an unterminated string.
pub fn function_program(problem: &Problem) -> Option<String> {
    let source = format!("{}{}", problem.prompt, problem.canonical_solution);
    let name = problem.entry_point.as_str();
    let def = format!("def {name}(");
    if !line_starts(&source).any(|at| source[at..].starts_with(&def)) {
        return None;
    }
    let without_doc = strip_string_statements(&source)?;
    let mask = mask(&without_doc)?;
    if name != "f" && identifiers(&mask).any(|(_, ident)| ident == "f") {
        return None;
    }
    let renamed = rename(&without_doc, &mask, name, "f");
    Some(renamed.trim_matches('\n').to_string())
}

/// `(ARGS, EXPECTED)` of every line `assert candidate(ARGS) == EXPECTED` in
/// `test`, in order. Lines that do not have exactly this shape are skipped.
pub fn extract_asserts(test: &str) -> Vec<(String, String)> {
    test.lines().filter_map(parse_assert).collect()
}

/// One assert line, or `None` when it is anything but a single top-level
/// `candidate(...) == EXPECTED` (optionally `, message`) on one line.
fn parse_assert(line: &str) -> Option<(String, String)> {
    let statement = line.trim().strip_prefix("assert")?;
    if !statement.starts_with([' ', '\t']) {
        return None;
    }
    let statement = statement.trim();
    if !statement.starts_with("candidate(") {
        return None;
    }
    let masked = mask(statement)?;
    if statement.ends_with('\\') {
        return None; // a continuation line
    }
    let shape = top_level_shape(&masked)?;
    // The condition ends at a trailing comment or at the first top-level
    // comma (the message follows).
    let comment = statement.find('#').filter(|&i| masked[i] == b' ');
    let end = [shape.first_comma, comment]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(statement.len());
    let ([eq], Some(call_end)) = (shape.equals.as_slice(), shape.first_close) else {
        return None;
    };
    let between = statement.get(call_end + 1..*eq)?;
    if *eq > end || !between.trim().is_empty() {
        return None;
    }
    let args = span(statement, "candidate(".len(), call_end)?;
    let expected = span(statement, eq + 2, end)?;
    if expected.0.is_empty() || has_bad_word(&masked[args.1]) || has_bad_word(&masked[expected.1]) {
        return None;
    }
    Some((args.0.to_string(), expected.0.to_string()))
}

/// The trimmed text of `text[start..end]` with its byte range.
fn span(text: &str, start: usize, end: usize) -> Option<(&str, Range<usize>)> {
    let raw = text.get(start..end)?;
    let from = start + (raw.len() - raw.trim_start().len());
    let trimmed = raw.trim();
    Some((trimmed, from..from + trimmed.len()))
}

/// Positions (in bytes) of the top-level structure of a masked statement.
struct Shape {
    /// `==` operators at bracket depth 0.
    equals: Vec<usize>,
    first_comma: Option<usize>,
    /// The bracket that first returns to depth 0 (closing `candidate(`).
    first_close: Option<usize>,
}

/// `None` when brackets do not balance or another comparison operator sits
/// at the top level (chained or non-equality comparisons).
fn top_level_shape(masked: &[u8]) -> Option<Shape> {
    let mut shape = Shape {
        equals: Vec::new(),
        first_comma: None,
        first_close: None,
    };
    let mut depth = 0usize;
    let at = |i: usize| masked.get(i).copied().unwrap_or(b' ');
    for (i, &byte) in masked.iter().enumerate() {
        match byte {
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 && shape.first_close.is_none() {
                    shape.first_close = Some(i);
                }
            }
            _ if depth > 0 => {}
            b',' => {
                shape.first_comma.get_or_insert(i);
            }
            b'=' if at(i + 1) == b'=' => {
                let before = if i == 0 { b' ' } else { masked[i - 1] };
                if matches!(before, b'=' | b'!' | b'<' | b'>') || at(i + 2) == b'=' {
                    return None;
                }
                shape.equals.push(i);
            }
            b'<' | b'>' | b'!' => return None,
            _ => {}
        }
    }
    (depth == 0).then_some(shape)
}

/// Words that make a side something other than a plain value: boolean or
/// comparison keywords at any depth, conditional expressions, and a second
/// use of `candidate`.
fn has_bad_word(masked: &[u8]) -> bool {
    const BAD: [&str; 8] = [
        "candidate",
        "and",
        "or",
        "not",
        "is",
        "if",
        "lambda",
        "await",
    ];
    identifiers(masked).any(|(_, ident)| BAD.contains(&ident))
}

/// Identifiers (not numbers, not inside strings) of a masked text, with
/// their byte offsets.
fn identifiers(masked: &[u8]) -> impl Iterator<Item = (usize, &str)> {
    let mut i = 0;
    std::iter::from_fn(move || {
        while i < masked.len() {
            let start = i;
            if is_ident_byte(masked[i]) {
                while i < masked.len() && is_ident_byte(masked[i]) {
                    i += 1;
                }
                if !masked[start].is_ascii_digit() {
                    // Every byte of an ASCII identifier run is a char boundary.
                    let word = std::str::from_utf8(&masked[start..i]).unwrap_or("");
                    return Some((start, word));
                }
            } else {
                i += 1;
            }
        }
        None
    })
}

fn is_ident_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || byte == b'_'
}

/// Replace the identifier `from` (not an attribute) by `to`.
fn rename(source: &str, masked: &[u8], from: &str, to: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut copied = 0;
    for (start, ident) in identifiers(masked) {
        if ident == from && !after_dot(masked, start) {
            out.push_str(&source[copied..start]);
            out.push_str(to);
            copied = start + ident.len();
        }
    }
    out.push_str(&source[copied..]);
    out
}

/// Is the word at `start` an attribute (`x.word`)?
fn after_dot(masked: &[u8], start: usize) -> bool {
    masked[..start]
        .iter()
        .rev()
        .find(|b| !b.is_ascii_whitespace())
        == Some(&b'.')
}

/// Remove every string literal that stands alone as a statement (the
/// docstrings, wherever they sit in a body): the whole lines of a literal
/// that starts a line at bracket depth 0 and is followed only by blanks or
/// a comment. Such a statement does nothing, so behaviour is unchanged.
fn strip_string_statements(source: &str) -> Option<String> {
    let (masked, strings) = scan(source)?;
    let line_end = |from: usize| {
        source[from..]
            .find('\n')
            .map_or(source.len(), |i| from + i + 1)
    };
    let mut out = String::with_capacity(source.len());
    let (mut depth, mut copied, mut at) = (0usize, 0, 0);
    while at < source.len() {
        let mut next = line_end(at);
        let first = at
            + masked[at..next]
                .iter()
                .take_while(|b| b.is_ascii_whitespace())
                .count();
        let string = strings.iter().find(|s| s.start == first);
        if let Some(string) = string {
            let last = line_end(string.end);
            let alone = masked[string.end..last].iter().all(u8::is_ascii_whitespace);
            if depth == 0 && alone && !continues_previous_line(&masked[..at]) {
                out.push_str(&source[copied..at]);
                copied = last;
            }
            // Never start a line scan inside a string.
            next = last;
        }
        depth = masked[at..next].iter().try_fold(depth, |d, &b| match b {
            b'(' | b'[' | b'{' => Some(d + 1),
            b')' | b']' | b'}' => d.checked_sub(1),
            _ => Some(d),
        })?;
        at = next;
    }
    out.push_str(&source[copied..]);
    Some(out)
}

/// Does the text end in a backslash line continuation?
fn continues_previous_line(masked_before: &[u8]) -> bool {
    masked_before.trim_ascii_end().last() == Some(&b'\\')
}

fn line_starts(source: &str) -> impl Iterator<Item = usize> + '_ {
    std::iter::once(0).chain(source.match_indices('\n').map(|(i, _)| i + 1))
}

/// Does a string literal (with an optional prefix such as `r` or `f`) start here?
fn is_string_start(text: &str) -> bool {
    let prefix = text.bytes().take_while(|b| b"rRbBuUfF".contains(b)).count();
    prefix <= 2 && matches!(text.as_bytes().get(prefix), Some(b'"' | b'\''))
}

/// The source's bytes with every string literal (prefix and quotes
/// included) replaced by `_` and every comment by spaces, so that brackets,
/// operators and identifiers can be found by plain byte scans. `None` when a
/// string is not terminated.
fn mask(source: &str) -> Option<Vec<u8>> {
    scan(source).map(|(masked, _)| masked)
}

/// [`mask`] and the byte ranges of the string literals.
fn scan(source: &str) -> Option<(Vec<u8>, Vec<Range<usize>>)> {
    let bytes = source.as_bytes();
    let mut masked = bytes.to_vec();
    let mut strings = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let byte = bytes[i];
        if byte == b'#' {
            let end = bytes[i..]
                .iter()
                .position(|&b| b == b'\n')
                .map_or(bytes.len(), |n| i + n);
            masked[i..end].fill(b' ');
            i = end;
            continue;
        }
        let word_end = i + bytes[i..].iter().take_while(|&&b| is_ident_byte(b)).count();
        let prefixed = is_ident_byte(byte) && !byte.is_ascii_digit() && word_end - i <= 2;
        let quote_at = if byte == b'"' || byte == b'\'' {
            Some(i)
        } else if prefixed && is_string_start(&source[i..]) {
            Some(word_end)
        } else {
            None
        };
        match quote_at {
            Some(quote_at) => {
                let end = string_end(bytes, quote_at)?;
                masked[i..end].fill(b'_');
                strings.push(i..end);
                i = end;
            }
            None => i = word_end.max(i + 1),
        }
    }
    Some((masked, strings))
}

/// End (exclusive) of the string literal whose opening quote is at `quote_at`.
fn string_end(bytes: &[u8], quote_at: usize) -> Option<usize> {
    let quote = bytes[quote_at];
    let triple = bytes.get(quote_at..quote_at + 3) == Some(&[quote; 3][..]);
    let mut k = quote_at + if triple { 3 } else { 1 };
    while k < bytes.len() {
        match bytes[k] {
            b'\\' => k += 2,
            b if b == quote && !triple => return Some(k + 1),
            b if b == quote && bytes.get(k..k + 3) == Some(&[quote; 3][..]) => return Some(k + 3),
            b'\n' if !triple => return None,
            _ => k += 1,
        }
    }
    None
}
