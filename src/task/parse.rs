//! Reading model output: proposals and answers.
//!
//! A format problem is an expected outcome of self-play, so every parser
//! returns a typed [`FormatError`] (it becomes the −1 format penalty) and never
//! panics, whatever the text. All parsers are linear in the input length.
//!
//! Rules, shared by all parsers:
//! - A *fenced block* is ```` ```label ```` followed by a body up to the next
//!   ```` ``` ````; the label is the run of ASCII letters, digits, `_`, `-`, `+`
//!   right after the opening fence, compared case-insensitively; the body is
//!   trimmed. An opening fence that is never closed starts no block.
//! - The *answer* of a response is the body of its last complete
//!   `<answer>...</answer>` pair.
//! - Answers ([`parse_answer`]): inside the answer, the last block labelled
//!   `output` (deduction), `input` (abduction) or `python` (induction) is
//!   taken; an unlabelled block counts as the expected label. When the answer
//!   holds no fence at all, its trimmed text is taken as is (a bare answer,
//!   common from small models). Fences with only other labels are an error.
//! - Proposals ([`parse_proposal`], [`parse_induction_proposal`]) are read from
//!   the answer if the response has one, else from the text after the last
//!   `</think>`, else from the whole response: the first ```` ```python ````
//!   block (`py` also accepted) and the first ```` ```input ```` block;
//!   induction takes the last `n` ```` ```input ```` blocks and the first
//!   ```` ```message ```` block (or `<message>...</message>`).
//! - Programs must define exactly one function at their outermost level (a
//!   line starting with `def NAME(` at the least indentation of any such
//!   line; functions nested in it are its own business). A function not named
//!   `f` is renamed to `f`, with every call `NAME(` (as AZR does).

use serde::{Deserialize, Serialize};

use super::TaskKind;

/// Why a response could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FormatError {
    #[error("no <answer>...</answer> in the response")]
    NoAnswerTag,
    #[error("<answer> is opened but never closed")]
    UnclosedAnswer,
    #[error("the {0:?} answer has fenced blocks but none labelled for it")]
    NoAnswerBlock(TaskKind),
    #[error("the answer is empty")]
    EmptyAnswer,
    #[error("no ```python block")]
    NoProgramBlock,
    #[error("the program defines no function")]
    NoFunction,
    #[error("the program defines {count} functions; exactly one is allowed")]
    MultipleFunctions { count: usize },
    #[error("no ```input block")]
    NoInputBlock,
    #[error("an ```input block is empty")]
    EmptyInput,
    #[error("{found} ```input blocks, {needed} needed")]
    TooFewInputs { found: usize, needed: usize },
    #[error("no ```message block")]
    NoMessage,
    #[error("the message is empty")]
    EmptyMessage,
}

impl FormatError {
    /// A short stable name for metrics (the serde tag without data).
    pub fn code(&self) -> &'static str {
        match self {
            FormatError::NoAnswerTag => "no_answer_tag",
            FormatError::UnclosedAnswer => "unclosed_answer",
            FormatError::NoAnswerBlock(_) => "no_answer_block",
            FormatError::EmptyAnswer => "empty_answer",
            FormatError::NoProgramBlock => "no_program_block",
            FormatError::NoFunction => "no_function",
            FormatError::MultipleFunctions { .. } => "multiple_functions",
            FormatError::NoInputBlock => "no_input_block",
            FormatError::EmptyInput => "empty_input",
            FormatError::TooFewInputs { .. } => "too_few_inputs",
            FormatError::NoMessage => "no_message",
            FormatError::EmptyMessage => "empty_message",
        }
    }
}

/// A deduction or abduction proposal: one program defining `f`, one input.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proposal {
    pub program: String,
    pub input: String,
}

/// An induction proposal: inputs for a given program and a message for the solver.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InductionProposal {
    pub inputs: Vec<String>,
    pub message: String,
}

/// A solver's answer, by task kind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Answer {
    /// Deduction: the predicted output, a Python literal.
    Output(String),
    /// Abduction: the proposed arguments of `f`.
    Input(String),
    /// Induction: a program defining `f`.
    Program(String),
}

impl Answer {
    pub fn text(&self) -> &str {
        match self {
            Answer::Output(s) | Answer::Input(s) | Answer::Program(s) => s,
        }
    }
}

/// Reads a deduction or abduction proposal.
pub fn parse_proposal(response: &str) -> Result<Proposal, FormatError> {
    let scope = proposal_scope(response);
    let blocks = fenced_blocks(scope);
    let program = blocks
        .iter()
        .find(|b| b.is("python") || b.is("py"))
        .ok_or(FormatError::NoProgramBlock)?;
    let program = normalize_program(program.body)?;
    let input = blocks
        .iter()
        .find(|b| b.is("input"))
        .ok_or(FormatError::NoInputBlock)?;
    if input.body.is_empty() {
        return Err(FormatError::EmptyInput);
    }
    Ok(Proposal {
        program,
        input: input.body.to_string(),
    })
}

/// Reads an induction proposal that must hold at least `inputs_needed` inputs;
/// the last `inputs_needed` are taken.
pub fn parse_induction_proposal(
    response: &str,
    inputs_needed: usize,
) -> Result<InductionProposal, FormatError> {
    let scope = proposal_scope(response);
    let blocks = fenced_blocks(scope);
    let inputs: Vec<&str> = blocks
        .iter()
        .filter(|b| b.is("input"))
        .map(|b| b.body)
        .collect();
    if inputs.len() < inputs_needed {
        return Err(FormatError::TooFewInputs {
            found: inputs.len(),
            needed: inputs_needed,
        });
    }
    let inputs = &inputs[inputs.len() - inputs_needed..];
    if inputs.iter().any(|i| i.is_empty()) {
        return Err(FormatError::EmptyInput);
    }
    let message = match blocks.iter().find(|b| b.is("message")) {
        Some(block) => block.body,
        None => tagged(scope, "<message>", "</message>")
            .ok_or(FormatError::NoMessage)?
            .trim(),
    };
    if message.is_empty() {
        return Err(FormatError::EmptyMessage);
    }
    Ok(InductionProposal {
        inputs: inputs.iter().map(|s| s.to_string()).collect(),
        message: message.to_string(),
    })
}

/// Reads a solver's answer to a task of `kind`.
pub fn parse_answer(kind: TaskKind, response: &str) -> Result<Answer, FormatError> {
    let answer = answer_body(response)?;
    let expected = match kind {
        TaskKind::Deduction => "output",
        TaskKind::Abduction => "input",
        TaskKind::Induction => "python",
    };
    let text = match fenced_blocks(answer)
        .iter()
        .rev()
        .find(|b| b.is(expected) || b.is(""))
    {
        Some(block) => block.body,
        None if answer.contains(FENCE) => return Err(FormatError::NoAnswerBlock(kind)),
        None => answer.trim(),
    };
    if text.is_empty() {
        return Err(FormatError::EmptyAnswer);
    }
    Ok(match kind {
        TaskKind::Deduction => Answer::Output(text.to_string()),
        TaskKind::Abduction => Answer::Input(text.to_string()),
        TaskKind::Induction => Answer::Program(normalize_program(text)?),
    })
}

const FENCE: &str = "```";

/// A fenced block: its label (as written) and trimmed body.
#[derive(Debug)]
struct Block<'a> {
    label: &'a str,
    body: &'a str,
}

impl Block<'_> {
    fn is(&self, label: &str) -> bool {
        self.label.eq_ignore_ascii_case(label)
    }
}

fn fenced_blocks(text: &str) -> Vec<Block<'_>> {
    let mut blocks = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find(FENCE) {
        let after = &rest[open + FENCE.len()..];
        // Labels are ASCII, so the byte count is also a char boundary.
        let label_len = after
            .bytes()
            .take_while(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'+'))
            .count();
        let body_and_rest = &after[label_len..];
        let Some(close) = body_and_rest.find(FENCE) else {
            break;
        };
        blocks.push(Block {
            label: &after[..label_len],
            body: body_and_rest[..close].trim(),
        });
        rest = &body_and_rest[close + FENCE.len()..];
    }
    blocks
}

/// Body of the last complete `<answer>...</answer>` pair.
fn answer_body(response: &str) -> Result<&str, FormatError> {
    match tagged_last(response, "<answer>", "</answer>") {
        Some(body) => Ok(body),
        None if response.contains("<answer>") => Err(FormatError::UnclosedAnswer),
        None => Err(FormatError::NoAnswerTag),
    }
}

fn proposal_scope(response: &str) -> &str {
    if let Some(body) = tagged_last(response, "<answer>", "</answer>") {
        return body;
    }
    match response.rfind("</think>") {
        Some(end) => &response[end + "</think>".len()..],
        None => response,
    }
}

/// Text between the last `close` tag and the last `open` tag before it.
fn tagged_last<'a>(text: &'a str, open: &str, close: &str) -> Option<&'a str> {
    let end = text.rfind(close)?;
    let start = text[..end].rfind(open)? + open.len();
    Some(&text[start..end])
}

/// Text between the first `open` tag and the first `close` tag after it.
fn tagged<'a>(text: &'a str, open: &str, close: &str) -> Option<&'a str> {
    let start = text.find(open)? + open.len();
    let end = text[start..].find(close)?;
    Some(&text[start..start + end])
}

/// Checks that `code` defines exactly one outermost function and names it `f`.
fn normalize_program(code: &str) -> Result<String, FormatError> {
    let defs: Vec<(usize, &str)> = code
        .lines()
        .filter_map(|l| Some((l.len() - l.trim_start().len(), defined_function(l)?)))
        .collect();
    let outermost = defs.iter().map(|&(indent, _)| indent).min();
    let names: Vec<&str> = defs
        .iter()
        .filter(|&&(indent, _)| Some(indent) == outermost)
        .map(|&(_, name)| name)
        .collect();
    match names.as_slice() {
        [] => Err(FormatError::NoFunction),
        ["f"] => Ok(code.to_string()),
        [name] => Ok(rename_calls(code, name, "f")),
        _ => Err(FormatError::MultipleFunctions { count: names.len() }),
    }
}

/// `NAME` when `line` is `def NAME(...` after indentation.
fn defined_function(line: &str) -> Option<&str> {
    let rest = line.trim_start().strip_prefix("def")?;
    let name_start = rest.trim_start();
    if name_start.len() == rest.len() {
        return None; // `define(...)`, not `def name(`
    }
    let name_len: usize = name_start
        .chars()
        .take_while(|c| is_identifier_char(*c))
        .map(char::len_utf8)
        .sum();
    let (name, after) = name_start.split_at(name_len);
    (!name.is_empty() && after.trim_start().starts_with('(')).then_some(name)
}

fn is_identifier_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Replaces the identifier `from` by `to` wherever it is followed (after
/// spaces) by `(` and is not part of a longer name or an attribute (`x.from(`).
fn rename_calls(code: &str, from: &str, to: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut previous: Option<char> = None;
    let mut rest = code;
    while !rest.is_empty() {
        let starts_here = rest.starts_with(from)
            && previous.is_none_or(|p| !is_identifier_char(p) && p != '.')
            && rest[from.len()..]
                .trim_start_matches([' ', '\t'])
                .starts_with('(');
        if starts_here {
            out.push_str(to);
            rest = &rest[from.len()..];
            previous = from.chars().last();
            continue;
        }
        let Some(c) = rest.chars().next() else { break };
        out.push(c);
        previous = Some(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rename_touches_calls_of_that_name_only() {
        let code = "def g(x):\n    return g (x-1) + gg(x) + o.g(x) + g";
        assert_eq!(
            rename_calls(code, "g", "f"),
            "def f(x):\n    return f (x-1) + gg(x) + o.g(x) + g"
        );
    }

    #[test]
    fn defined_function_needs_def_space_name_paren() {
        assert_eq!(defined_function("    def  foo_1 (a):"), Some("foo_1"));
        assert_eq!(defined_function("define(a)"), None);
        assert_eq!(defined_function("def x = 1"), None);
        assert_eq!(defined_function("def ("), None);
    }

    #[test]
    fn unclosed_fence_starts_no_block() {
        let blocks = fenced_blocks("```input\n1\n``` text ```python\nx");
        assert_eq!(blocks.len(), 1);
        assert!(blocks[0].is("INPUT"));
        assert_eq!(blocks[0].body, "1");
    }
}
