//! Math problems: GSM8K (`question`, `answer` ending in `#### N`) and the
//! MATH-style sets (MATH-500, Minerva, OlympiadBench, AIME 24/25, AMC 23:
//! a problem and a reference answer, field names differing per set), shipped
//! or from a user's JSONL file; prompts, answer extraction from model
//! responses, normalisation and equivalence. No code runs here, so nothing
//! needs the sandbox.
//!
//! Reference answers: the number after `####` (GSM8K); `answer` (MATH-500,
//! AIME, AMC, whose answers are JSON numbers such as `27.0`); the
//! solution's last `\boxed{}` (Minerva, and any set without `answer`);
//! `final_answer[0]` without its `$` (OlympiadBench).
//!
//! The default prompt ([`MathPrompt::Boxed`]) asks for the final answer in
//! `\boxed{}`, with the system prompt of the AZR evaluation suite's
//! `qwen25-math-cot` template, and the answer is the response's last
//! `\boxed{}`. [`MathPrompt::AnswerTags`] is the older prompt asking for
//! `<answer>` tags.
//!
//! Numbers compare exactly as rationals when both sides are exact, else as
//! floats within [`TOLERANCE`]. MATH answers are normalised in the spirit of
//! Hendrycks et al.'s `is_equiv` and then compared as strings, or as numbers
//! when both sides are numeric (`0.5` equals `\frac{1}{2}`, `4.5\times10^{33}`
//! equals `4.5e33`); tuples and intervals part by part under the same
//! brackets; answers listed with commas (several solutions) in any order.

use super::{ChatPrompt, EvalError};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Absolute tolerance of a numeric comparison.
pub const TOLERANCE: f64 = 1e-6; // keep in step with the exact check in `Number::equals`

const SYSTEM: &str = "You are a careful problem solver. \
Think step by step inside <think> </think>, then give only the final answer inside <answer> </answer>.";

/// The system prompt of the AZR suite's `qwen25-math-cot` template.
const BOXED_SYSTEM: &str =
    "Please reason step by step, and put your final answer within \\boxed{}.";

/// How a math problem is asked, and where its answer is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MathPrompt {
    /// The problem as the user turn after [`BOXED_SYSTEM`]; the answer is the
    /// response's last `\boxed{}`.
    #[default]
    Boxed,
    /// Think in `<think>`, answer in `<answer>` tags (the prompt before the
    /// boxed one); the answer is read as [`extract_gsm8k_answer`] and
    /// [`extract_math_answer`] say.
    AnswerTags,
}

impl MathPrompt {
    pub fn name(self) -> &'static str {
        match self {
            MathPrompt::Boxed => "boxed",
            MathPrompt::AnswerTags => "answer-tags",
        }
    }
}

impl std::str::FromStr for MathPrompt {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "boxed" => Ok(MathPrompt::Boxed),
            "answer-tags" => Ok(MathPrompt::AnswerTags),
            other => Err(format!(
                "unknown math prompt `{other}` (boxed, answer-tags)"
            )),
        }
    }
}

/// A GSM8K problem.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GsmProblem {
    pub question: String,
    /// The worked solution, ending in `#### N`.
    pub solution: String,
    /// `N`, commas removed.
    pub answer: String,
}

/// A MATH problem.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MathProblem {
    pub problem: String,
    pub solution: String,
    /// The record's `answer` when present (MATH-500), else the solution's last `\boxed{}`.
    pub answer: String,
    /// "Level 5" in MATH, 5 in MATH-500; kept as text.
    pub level: Option<String>,
    /// `type` in MATH, `subject` in MATH-500.
    pub subject: Option<String>,
    /// OlympiadBench: the answer's unit, which a response may add.
    pub unit: Option<String>,
}

#[derive(Deserialize)]
struct GsmRecord {
    question: String,
    answer: String,
}

#[derive(Deserialize)]
struct MathRecord {
    /// `question` in OlympiadBench (AIME 24 and AMC 23 have both).
    #[serde(default)]
    problem: Option<String>,
    #[serde(default)]
    question: Option<String>,
    /// Text, or a list of texts (OlympiadBench).
    #[serde(default)]
    solution: serde_json::Value,
    /// Text, or a number (AMC 23).
    #[serde(default)]
    answer: Option<serde_json::Value>,
    #[serde(default)]
    final_answer: Option<Vec<String>>,
    #[serde(default)]
    level: Option<serde_json::Value>,
    #[serde(default, rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    subject: Option<String>,
    #[serde(default)]
    unit: Option<String>,
}

/// A JSON value as text: a string as it is, anything else as JSON (`27.0`).
fn text_of(value: serde_json::Value) -> String {
    match value {
        serde_json::Value::String(s) => s,
        other => other.to_string(),
    }
}

/// Load a GSM8K JSONL file (plain or gzip).
pub fn load_gsm8k(path: &Path) -> Result<Vec<GsmProblem>, EvalError> {
    let records: Vec<(usize, GsmRecord)> = super::read_jsonl(path)?;
    records
        .into_iter()
        .map(|(line, record)| {
            let answer = gsm8k_gold(&record.answer)
                .ok_or_else(|| super::bad_record(path, line, "answer has no `#### N` line"))?;
            Ok(GsmProblem {
                question: record.question,
                solution: record.answer,
                answer,
            })
        })
        .collect()
}

/// Load a MATH-style JSONL file (plain or gzip): MATH, MATH-500, Minerva,
/// OlympiadBench, AIME, AMC (see the module doc for where each keeps its
/// reference answer).
pub fn load_math(path: &Path) -> Result<Vec<MathProblem>, EvalError> {
    let records: Vec<(usize, MathRecord)> = super::read_jsonl(path)?;
    records
        .into_iter()
        .map(|(line, record)| {
            let solution = match record.solution {
                serde_json::Value::Array(parts) => {
                    let parts: Vec<String> = parts.into_iter().map(text_of).collect();
                    parts.join("\n")
                }
                serde_json::Value::Null => String::new(),
                other => text_of(other),
            };
            let final_answer = record
                .final_answer
                .and_then(|answers| answers.into_iter().next())
                .map(|a| a.trim().trim_matches('$').trim().to_string());
            let answer = record
                .answer
                .map(text_of)
                .or(final_answer)
                .filter(|a| !a.trim().is_empty())
                .or_else(|| last_boxed(&solution))
                .ok_or_else(|| {
                    super::bad_record(
                        path,
                        line,
                        "no `answer`, no `final_answer` and no \\boxed{} in `solution`",
                    )
                })?;
            let problem = record
                .problem
                .or(record.question)
                .ok_or_else(|| super::bad_record(path, line, "no `problem` and no `question`"))?;
            Ok(MathProblem {
                problem,
                solution,
                answer,
                level: record.level.map(text_of),
                subject: record.subject.or(record.kind),
                unit: record.unit.filter(|u| !u.trim().is_empty()),
            })
        })
        .collect()
}

/// The text after the last `####`, trimmed, commas removed.
fn gsm8k_gold(solution: &str) -> Option<String> {
    let (_, tail) = solution.rsplit_once("####")?;
    let answer = tail.trim().replace(',', "");
    (!answer.is_empty()).then_some(answer)
}

pub fn gsm8k_prompt(problem: &GsmProblem, style: MathPrompt) -> ChatPrompt {
    match style {
        MathPrompt::Boxed => boxed_prompt(&problem.question),
        MathPrompt::AnswerTags => ChatPrompt {
            system: SYSTEM.to_string(),
            user: format!(
                "Solve this problem. The final answer is a number.\n{}",
                problem.question
            ),
        },
    }
}

pub fn math_prompt(problem: &MathProblem, style: MathPrompt) -> ChatPrompt {
    match style {
        MathPrompt::Boxed => boxed_prompt(&problem.problem),
        MathPrompt::AnswerTags => ChatPrompt {
            system: SYSTEM.to_string(),
            user: format!(
                "Solve this problem. Write the final answer in LaTeX as \\boxed{{...}}.\n{}",
                problem.problem
            ),
        },
    }
}

fn boxed_prompt(problem: &str) -> ChatPrompt {
    ChatPrompt {
        system: BOXED_SYSTEM.to_string(),
        user: problem.trim().to_string(),
    }
}

/// The number a GSM8K response gives: the last number inside its last
/// `<answer>`, else the first number after its last `####`, else inside its
/// last `\boxed{}`, else the last number anywhere.
pub fn extract_gsm8k_answer(response: &str) -> Option<String> {
    if let Some(body) = answer_tag(response) {
        let number = numbers_in(body).last().map(|n| n.to_string());
        return number.or_else(|| Some(body.trim().to_string()));
    }
    if let Some((_, tail)) = response.rsplit_once("####") {
        if let Some(first) = numbers_in(tail).first() {
            return Some(first.to_string());
        }
    }
    if let Some(boxed) = last_boxed(response) {
        if let Some(last) = numbers_in(&boxed).last() {
            return Some(last.to_string());
        }
    }
    numbers_in(response).last().map(|n| n.to_string())
}

/// Is `predicted` the same number as `gold`?
pub fn gsm8k_equal(predicted: &str, gold: &str) -> bool {
    match (parse_number(predicted), parse_number(gold)) {
        (Some(p), Some(g)) => p.equals(&g),
        _ => false,
    }
}

/// The number a GSM8K response gives under the boxed prompt: the last
/// number inside its last `\boxed{}` (the box's text when it holds none).
pub fn extract_boxed_number(response: &str) -> Option<String> {
    let boxed = last_boxed(response)?;
    let number = numbers_in(&boxed).last().map(|n| n.to_string());
    Some(number.unwrap_or(boxed))
}

/// Extract (as `style` says) and compare; `false` when the response has no answer.
pub fn score_gsm8k(problem: &GsmProblem, response: &str, style: MathPrompt) -> bool {
    let answer = match style {
        MathPrompt::Boxed => extract_boxed_number(response),
        MathPrompt::AnswerTags => extract_gsm8k_answer(response),
    };
    answer.is_some_and(|a| gsm8k_equal(&a, &problem.answer))
}

/// A MATH response's answer: its last balanced `\boxed{}` (or `\fbox{}`),
/// else the body of its last `<answer>` without `$` delimiters.
pub fn extract_math_answer(response: &str) -> Option<String> {
    last_boxed(response).or_else(|| {
        let body = answer_tag(response)?.trim().trim_matches('$').trim();
        (!body.is_empty()).then(|| body.to_string())
    })
}

/// Are two MATH answers equivalent after [`normalize_math`]: the same
/// string; or both numbers that are equal; or tuples or intervals under the
/// same brackets whose parts are equivalent in order; or lists of several
/// answers separated by commas, equivalent in some order.
pub fn math_equal(predicted: &str, gold: &str) -> bool {
    normalized_equal(&normalize_math(predicted), &normalize_math(gold))
}

fn normalized_equal(p: &str, g: &str) -> bool {
    if p == g {
        return true;
    }
    if let (Some(p), Some(g)) = (math_number(p), math_number(g)) {
        return p.equals(&g);
    }
    if let (Some(p), Some(g)) = (bracketed(p), bracketed(g)) {
        let same_shape = p.0 == g.0 && p.2 == g.2 && p.1.len() == g.1.len();
        return same_shape && p.1.iter().zip(&g.1).all(|(a, b)| normalized_equal(a, b));
    }
    let (p, g) = (top_level_parts(p), top_level_parts(g));
    g.len() > 1 && p.len() == g.len() && equal_in_some_order(&p, &g)
}

/// `(a,b)`, `[a,b)`, ...: the opening bracket, the top-level parts and the
/// closing bracket, when one bracket pair encloses the whole text.
fn bracketed(s: &str) -> Option<(char, Vec<&str>, char)> {
    let open = s.chars().next().filter(|c| matches!(c, '(' | '['))?;
    let close = s.chars().last().filter(|c| matches!(c, ')' | ']'))?;
    let inner = &s[1..s.len() - 1];
    // The first bracket must close at the end: "(1,2),(3,4)" is a list.
    let mut depth = 0i32;
    for c in inner.chars() {
        match c {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth -= 1,
            _ => {}
        }
        if depth < 0 {
            return None;
        }
    }
    (depth == 0).then(|| (open, top_level_parts(inner), close))
}

/// The parts of `s` between commas outside brackets and braces.
fn top_level_parts(s: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

/// Can `p`'s parts be paired one to one with equivalent parts of `g`?
fn equal_in_some_order(p: &[&str], g: &[&str]) -> bool {
    let mut unused: Vec<&str> = g.to_vec();
    for part in p {
        match unused.iter().position(|u| normalized_equal(part, u)) {
            Some(i) => {
                unused.swap_remove(i);
            }
            None => return false,
        }
    }
    true
}

/// Extract (as `style` says) and compare, a trailing unit of the problem's
/// own (OlympiadBench) set aside; `false` when the response has no answer.
pub fn score_math(problem: &MathProblem, response: &str, style: MathPrompt) -> bool {
    let answer = match style {
        MathPrompt::Boxed => last_boxed(response),
        MathPrompt::AnswerTags => extract_math_answer(response),
    };
    let Some(answer) = answer else {
        return false;
    };
    if math_equal(&answer, &problem.answer) {
        return true;
    }
    let unit = problem.unit.as_deref().map(normalize_math);
    let answer = normalize_math(&answer);
    let without_unit = unit
        .filter(|u| !u.is_empty())
        .and_then(|u| answer.strip_suffix(u.as_str()).map(str::to_string));
    without_unit.is_some_and(|a| math_equal(&a, &problem.answer))
}

/// The content of the last balanced `\boxed{...}` or `\fbox{...}` (nested
/// braces allowed); `\boxed 5` (no braces) gives the next word.
pub fn last_boxed(text: &str) -> Option<String> {
    let mut starts: Vec<usize> = ["\\boxed", "\\fbox"]
        .iter()
        .flat_map(|m| text.match_indices(m).map(|(i, m)| i + m.len()))
        .collect();
    starts.sort_unstable();
    starts
        .iter()
        .rev()
        .find_map(|&at| boxed_content(&text[at..]))
}

/// `{content}` with balanced braces, or ` word`.
fn boxed_content(rest: &str) -> Option<String> {
    if let Some(inner) = rest.strip_prefix('{') {
        let mut depth = 1usize;
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        return Some(inner[..i].trim().to_string());
                    }
                }
                _ => {}
            }
        }
        return None;
    }
    let word = rest.strip_prefix(' ')?.split(['$', ' ', '\n']).next()?;
    (!word.is_empty()).then(|| word.to_string())
}

/// The body of the last complete `<answer>...</answer>`, else the text after
/// an unclosed last `<answer>`.
fn answer_tag(response: &str) -> Option<&str> {
    let open = response.rfind("<answer>")?;
    let body = &response[open + "<answer>".len()..];
    Some(body.find("</answer>").map_or(body, |end| &body[..end]))
}

/// Numbers in text order: an optional `-`, digits with `,` thousands groups,
/// an optional decimal part. A sentence's final `.` is not part of a number.
fn numbers_in(text: &str) -> Vec<&str> {
    let bytes = text.as_bytes();
    let digit = |i: usize| bytes.get(i).is_some_and(u8::is_ascii_digit);
    let mut found = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let word_before = i > 0 && (bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'.');
        let signed = bytes[i] == b'-' && digit(i + 1);
        if !(digit(i) || signed) || word_before {
            i += 1;
            continue;
        }
        let start = i;
        i += usize::from(signed);
        while digit(i) {
            i += 1;
        }
        while bytes.get(i) == Some(&b',') && (1..=3).all(|k| digit(i + k)) && !digit(i + 4) {
            i += 4;
        }
        if bytes.get(i) == Some(&b'.') && digit(i + 1) {
            i += 1;
            while digit(i) {
                i += 1;
            }
        }
        found.push(&text[start..i]);
    }
    found
}

/// A parsed number: exact when it came from decimal digits or a fraction.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Number {
    /// numerator / denominator, denominator > 0.
    Exact(i128, i128),
    Float(f64),
}

impl Number {
    fn value(self) -> f64 {
        match self {
            Number::Exact(n, d) => n as f64 / d as f64,
            Number::Float(x) => x,
        }
    }

    /// Within [`TOLERANCE`]; computed exactly for two exact numbers (floats
    /// would merge large distinct integers), falling back to floats only if
    /// the exact arithmetic overflows.
    fn equals(&self, other: &Number) -> bool {
        if let (Number::Exact(a, b), Number::Exact(c, d)) = (*self, *other) {
            // |a/b - c/d| <= 1e-6  <=>  |a*d - c*b| * 10^6 <= b*d  (b, d > 0)
            let exact = (|| {
                let difference = a.checked_mul(d)?.checked_sub(c.checked_mul(b)?)?;
                let scaled = difference.checked_abs()?.checked_mul(1_000_000)?;
                Some(scaled <= b.checked_mul(d)?)
            })();
            if let Some(equal) = exact {
                return equal;
            }
        }
        (self.value() - other.value()).abs() <= TOLERANCE
    }
}

/// A number from free text: `$`, `\$`, commas, spaces, a trailing `%` or `.`
/// and a trailing `.0` do not matter; `a/b` is a fraction.
fn parse_number(text: &str) -> Option<Number> {
    let cleaned: String = text
        .replace("\\$", "")
        .replace("\\%", "")
        .chars()
        .filter(|c| !matches!(c, '$' | ',' | ' ' | '%'))
        .collect();
    let cleaned = cleaned.trim_end_matches('.');
    if let Some((n, d)) = cleaned.split_once('/') {
        return divide(plain_number(n)?, plain_number(d)?);
    }
    plain_number(cleaned)
}

/// `[+-]digits[.digits]` exactly, or a finite float literal such as `1e-3`.
fn plain_number(text: &str) -> Option<Number> {
    let text = text.trim();
    let (negative, unsigned) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text.strip_prefix('+').unwrap_or(text)),
    };
    let (whole, fraction) = unsigned.split_once('.').unwrap_or((unsigned, ""));
    let digits_only = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    let has_digits = !whole.is_empty() || !fraction.is_empty();
    if has_digits && digits_only(whole) && digits_only(fraction) {
        if let Some(exact) = exact_decimal(whole, fraction, negative) {
            return Some(exact);
        }
    }
    let has_digit = text.bytes().any(|b| b.is_ascii_digit());
    let value: f64 = text.parse().ok()?;
    (has_digit && value.is_finite()).then_some(Number::Float(value))
}

fn exact_decimal(whole: &str, fraction: &str, negative: bool) -> Option<Number> {
    let denominator = 10i128.checked_pow(u32::try_from(fraction.len()).ok()?)?;
    let digits = format!("{whole}{fraction}");
    let magnitude: i128 = if digits.is_empty() {
        0
    } else {
        digits.parse().ok()?
    };
    let numerator = if negative { -magnitude } else { magnitude };
    Some(reduced(numerator, denominator))
}

fn divide(n: Number, d: Number) -> Option<Number> {
    match (n, d) {
        (Number::Exact(a, b), Number::Exact(c, e)) if c != 0 => {
            let (num, den) = (a.checked_mul(e)?, b.checked_mul(c)?);
            Some(if den < 0 {
                reduced(num.checked_neg()?, den.checked_neg()?)
            } else {
                reduced(num, den)
            })
        }
        _ => {
            let value = n.value() / d.value();
            value.is_finite().then_some(Number::Float(value))
        }
    }
}

fn reduced(numerator: i128, denominator: i128) -> Number {
    let g = gcd(numerator.unsigned_abs(), denominator.unsigned_abs()).max(1);
    // Dividing by a positive divisor of both cannot overflow.
    let g = g as i128;
    Number::Exact(numerator / g, denominator / g)
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// A normalised MATH answer as a number: a plain decimal, `\frac{a}{b}` or
/// `-\frac{a}{b}`, optionally followed by a unit word (`5cm`).
fn math_number(normalized: &str) -> Option<Number> {
    let (negative, body) = match normalized.strip_prefix('-') {
        Some(rest) if rest.starts_with("\\frac") => (true, rest),
        _ => (false, normalized),
    };
    if let Some(rest) = body.strip_prefix("\\frac{") {
        let (n, rest) = rest.split_once("}{")?;
        let d = rest.strip_suffix('}')?;
        let value = divide(plain_number(n)?, plain_number(d)?)?;
        return Some(if negative { negate(value)? } else { value });
    }
    let number_end = body
        .find(|c: char| c.is_ascii_alphabetic() && c != 'e')
        .unwrap_or(body.len());
    let unit = &body[number_end..];
    let is_unit =
        unit.is_empty() || (unit.len() >= 2 && unit.chars().all(|c| c.is_ascii_alphabetic()));
    if !is_unit {
        return None;
    }
    plain_number(&body[..number_end])
}

fn negate(number: Number) -> Option<Number> {
    Some(match number {
        Number::Exact(n, d) => Number::Exact(n.checked_neg()?, d),
        Number::Float(x) => Number::Float(-x),
    })
}

/// Normalise a MATH answer: drop `$`, `\left`/`\right`, spacing commands
/// (`\!`, `\,`, `\;`, `\:`), `\displaystyle`, degrees (`^\circ`), percent
/// signs, a trailing unit in `\text{}`/`\mbox{}` and a trailing `.`;
/// `\dfrac`/`\tfrac` become `\frac`, `\frac12` becomes `\frac{1}{2}`,
/// `\sqrt2` becomes `\sqrt{2}`, `a/b` becomes `\frac{a}{b}`; a short `x =`
/// prefix goes; thousands commas go from a plain number; spaces go.
pub fn normalize_math(answer: &str) -> String {
    let mut s = answer.trim().replace('\n', "");
    for (from, to) in [
        ("\\!", ""),
        ("\\\\", "\\"),
        ("tfrac", "frac"),
        ("dfrac", "frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\$", ""),
        ("$", ""),
        ("\\displaystyle", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\:", ""),
    ] {
        s = s.replace(from, to);
    }
    s = remove_text_groups(&s);
    s = s.replace("\\%", "").replace('%', "");
    s = s.replace(" .", " 0.").replace("{.", "{0.");
    if s.starts_with('.') {
        s.insert(0, '0');
    }
    if let Some((lhs, rhs)) = s.split_once('=') {
        if lhs.trim().len() <= 2 && !rhs.contains('=') {
            s = rhs.to_string();
        }
    }
    s = fix_sqrt(&s);
    s.retain(|c| !c.is_whitespace());
    s = fix_scientific(&s);
    s = fix_fracs(&s);
    s = fix_slash(&s);
    s = drop_thousands_commas(&s);
    s.trim_end_matches('.').to_string()
}

/// A trailing `\text{unit}` or `\mbox{unit}` after something else is a unit
/// and goes; any other `\text{X}` (e.g. `\text{(A)}`) is unwrapped to `X`.
fn remove_text_groups(s: &str) -> String {
    let mut out = s.to_string();
    for command in ["\\text", "\\mbox", "\\textbf", "\\mathrm"] {
        while let Some(at) = find_command(&out, command) {
            let open = at + command.len();
            let Some(close) = matching_brace(&out, open) else {
                break;
            };
            let inner = out[open + 1..close].to_string();
            let trailing = out[close + 1..].trim().is_empty();
            let replacement = if trailing && !out[..at].trim().is_empty() {
                String::new()
            } else {
                inner
            };
            out.replace_range(at..=close, &replacement);
        }
    }
    out
}

/// Position of `command{` (not a longer command such as `\textbf` for `\text`).
fn find_command(s: &str, command: &str) -> Option<usize> {
    s.match_indices(command)
        .map(|(i, _)| i)
        .find(|&i| s[i + command.len()..].starts_with('{'))
}

/// Index of the `}` matching the `{` at `open`.
fn matching_brace(s: &str, open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in s[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(open + i);
                }
            }
            _ => {}
        }
    }
    None
}

/// `4.5\times10^{33}`, `4.5\cdot10^{33}`, `4.5*10^33` → `4.5e33` (spaces gone).
fn fix_scientific(s: &str) -> String {
    for times in ["\\times10^", "\\cdot10^", "*10^"] {
        let Some((mantissa, exponent)) = s.split_once(times) else {
            continue;
        };
        let exponent = exponent
            .strip_prefix('{')
            .and_then(|e| e.strip_suffix('}'))
            .unwrap_or(exponent);
        if plain_number(mantissa).is_some() && exponent.parse::<i32>().is_ok() {
            return format!("{mantissa}e{exponent}");
        }
    }
    s.to_string()
}

/// `\sqrt2` → `\sqrt{2}`.
fn fix_sqrt(s: &str) -> String {
    let mut parts = s.split("\\sqrt");
    let mut out = parts.next().unwrap_or_default().to_string();
    for part in parts {
        out.push_str("\\sqrt");
        match part.chars().next() {
            Some(c) if c != '{' && c != '[' && !c.is_whitespace() => {
                out.push_str(&format!("{{{c}}}{}", &part[c.len_utf8()..]));
            }
            _ => out.push_str(part),
        }
    }
    out
}

/// `\frac12` → `\frac{1}{2}`, `\frac1{2}` → `\frac{1}{2}`, `\frac{1}2` → `\frac{1}{2}`.
fn fix_fracs(s: &str) -> String {
    let mut parts = s.split("\\frac");
    let mut out = parts.next().unwrap_or_default().to_string();
    for part in parts {
        out.push_str("\\frac");
        let (first, rest) = brace_group(part);
        out.push_str(&first);
        let (second, rest) = brace_group(rest);
        out.push_str(&second);
        out.push_str(rest);
    }
    out
}

/// The leading `{...}` of `s`, or its first character wrapped in braces.
fn brace_group(s: &str) -> (String, &str) {
    if s.starts_with('{') {
        if let Some(close) = matching_brace(s, 0) {
            return (s[..=close].to_string(), &s[close + 1..]);
        }
        return (s.to_string(), "");
    }
    match s.chars().next() {
        Some(c) if c != '\\' => (format!("{{{c}}}"), &s[c.len_utf8()..]),
        _ => (String::new(), s),
    }
}

/// `a/b` with integers `a`, `b` → `\frac{a}{b}`.
fn fix_slash(s: &str) -> String {
    let is_int = |t: &str| {
        let t = t.strip_prefix('-').unwrap_or(t);
        !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit())
    };
    match s.split_once('/') {
        Some((a, b)) if is_int(a) && is_int(b) && !b.starts_with('-') => {
            match a.strip_prefix('-') {
                Some(a) => format!("-\\frac{{{a}}}{{{b}}}"),
                None => format!("\\frac{{{a}}}{{{b}}}"),
            }
        }
        _ => s.to_string(),
    }
}

/// `1,234,567.5` → `1234567.5`; anything else (a tuple `1,2`) is left alone.
fn drop_thousands_commas(s: &str) -> String {
    let unsigned = s.strip_prefix('-').unwrap_or(s);
    let whole = unsigned.split_once('.').map_or(unsigned, |(w, _)| w);
    let groups: Vec<&str> = whole.split(',').collect();
    let grouped = groups.len() > 1
        && (1..=3).contains(&groups[0].len())
        && groups[1..].iter().all(|g| g.len() == 3)
        && groups.iter().all(|g| g.bytes().all(|b| b.is_ascii_digit()));
    if grouped {
        s.replace(',', "")
    } else {
        s.to_string()
    }
}
