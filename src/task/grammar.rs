//! The grammar of every self-play reply, beside the templates that ask for it.
//!
//! With structured decoding on, each reply is decoded under the Lark grammar
//! (llguidance's dialect) of its task kind and role, so every completed reply
//! is read by [`crate::task::parse`] without a format error:
//!
//! | reply | grammar |
//! |---|---|
//! | deduction / abduction proposer | ```` ```python ```` block with `def f(p1, …):` and an indented body, then one ```` ```input ```` block with as many literal arguments as `f` has parameters |
//! | induction proposer | N ```` ```input ```` blocks (as many arguments as the program takes), then one ```` ```message ```` block |
//! | deduction solver | optional `<think>…</think>`, then `<answer>` holding one ```` ```output ```` block with a literal |
//! | abduction solver | the same, with one ```` ```input ```` block of arguments |
//! | induction solver | the same, with one ```` ```python ```` block defining `f` |
//!
//! Inputs and outputs are Python literals that `ast.literal_eval` reads:
//! numbers, strings, `True`/`False`/`None`, and lists, tuples, dicts and sets
//! of them, nested up to three deep (dict keys and set elements are scalars).
//! Strings hold printable ASCII only (one byte a character, for the budget)
//! and no backtick or `<`, so no literal can close a fence or a tag.
//!
//! **Budget.** Every free part has a bound, and the bounds are derived from
//! the reply's token budget (`max_new_tokens`) so that the longest reply the
//! grammar allows still fits it: code, thinking and messages are bounded in
//! tokens (`max_tokens`); literals, parameter names and the fixed text in
//! bytes, which bounds their tokens too (a token holds at least one byte).
//! A reply therefore always completes; truncation cannot make it malformed.

use super::{Role, TaskKind};

/// Most parameters a proposed or written function may take.
pub const MAX_PARAMS: usize = 3;
/// Longest parameter name, in bytes.
const NAME_BYTES: usize = 8;
/// A proposer's input literals get 1/`INPUT_DIVISOR` of its free budget
/// (the rest is code).
const INPUT_DIVISOR: usize = 4;
/// A solver may spend 1/`THINK_DIVISOR` of its free budget thinking
/// (deduction and abduction: half; induction, whose answer is code: a third).
const THINK_DIVISOR: usize = 2;
const THINK_DIVISOR_CODE: usize = 3;
/// An induction proposer's message gets 1/`MESSAGE_DIVISOR` of its free
/// budget, at most `MESSAGE_CAP` tokens.
const MESSAGE_DIVISOR: usize = 4;
const MESSAGE_CAP: usize = 32;
/// Smallest bounds a grammar may get: below these the budget is too small.
const MIN_CODE_TOKENS: usize = 16;
const MIN_LITERAL_BYTES: usize = 3;
const MIN_MESSAGE_TOKENS: usize = 4;

// The fixed text of replies (also counted for the budget).
const PROGRAM_HEAD: &str = "```python\ndef f(";
const PARAMS_END: &str = "):\n";
const PROGRAM_END: &str = "\n```\n";
const INPUT_HEAD: &str = "```input\n";
const OUTPUT_HEAD: &str = "```output\n";
const BLOCK_END: &str = "\n```";
const MESSAGE_HEAD: &str = "```message\n";
const ANSWER_HEAD: &str = "<answer>\n";
const ANSWER_END: &str = "\n```\n</answer>";
const THINK_HEAD: &str = "<think>";
const THINK_END: &str = "</think>\n";
const SEPARATOR: &str = ", ";

/// Terminals shared by every grammar. A literal is one terminal (a regular
/// language, nesting unrolled three deep), so its byte bound is a plain
/// intersection with a length-bounded regex.
const COMMON: &str = r#"
NAME: /[a-z_][a-z0-9_]{0,7}/
NUMBER: /-?(0|[1-9][0-9]*)(\.[0-9]+)?(e-?[0-9]+)?/
STRING: /'([ -~&&[^'\\`<]]|\\[\\'"nt])*'/ | /"([ -~&&[^"\\`<]]|\\[\\'"nt])*"/
SCALAR: NUMBER | STRING | "True" | "False" | "None"
SET: "set()" | "{" SCALAR (", " SCALAR)* "}"
V1: SCALAR | SET | "[" (SCALAR (", " SCALAR)*)? "]" | "()" | "(" SCALAR ",)" | "(" SCALAR (", " SCALAR)+ ")" | "{" (SCALAR ": " SCALAR (", " SCALAR ": " SCALAR)*)? "}"
V2: V1 | "[" (V1 (", " V1)*)? "]" | "(" V1 ",)" | "(" V1 (", " V1)+ ")" | "{" (SCALAR ": " V1 (", " SCALAR ": " V1)*)? "}"
VALUE: V2 | "[" (V2 (", " V2)*)? "]" | "(" V2 ",)" | "(" V2 (", " V2)+ ")" | "{" (SCALAR ": " V2 (", " SCALAR ": " V2)*)? "}"
"#;

/// What a reply's grammar depends on besides its kind and role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplyShape {
    /// The reply's token budget (`max_new_tokens`).
    pub max_new_tokens: usize,
    /// Parameters of the function whose inputs are written (abduction solver,
    /// induction proposer); `None` when unknown: then 1 to [`MAX_PARAMS`].
    pub arity: Option<usize>,
    /// Inputs an induction proposer writes.
    pub inputs: usize,
}

/// The bounds a grammar was built with and the longest reply it allows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplyGrammar {
    /// The Lark text.
    pub lark: String,
    /// Tokens of the longest reply the grammar allows, stop token included:
    /// never more than the shape's `max_new_tokens`.
    pub worst_case_tokens: usize,
}

/// The number of parameters of `f` (or, without an `f`, of the first
/// function) in `program`, when every parameter is a plain name, annotated
/// or not: `None` for defaults, `*args`, `**kwargs` or a `/` or `*` marker,
/// which leave the number of arguments a call takes open.
pub fn arity(program: &str) -> Option<usize> {
    let line = program
        .lines()
        .find(|l| l.starts_with("def f("))
        .or_else(|| program.lines().find(|l| l.starts_with("def ")))?;
    let params = top_level_params(line.split_once('(')?.1)?;
    let plain = |p: &&str| {
        let name = p.split_once(':').map_or(*p, |(name, _)| name).trim();
        !name.is_empty()
            && name.chars().all(|c| c.is_alphanumeric() || c == '_')
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && !p.contains('=')
    };
    match params.as_slice() {
        [] => Some(0),
        _ if params.iter().all(plain) => Some(params.len()),
        _ => None,
    }
}

/// The comma-separated parts of a parameter list up to its closing `)`,
/// split only where no bracket is open (`Dict[str, int]` is one part).
fn top_level_params(after_open: &str) -> Option<Vec<&str>> {
    let (mut depth, mut start, mut parts) = (0usize, 0, Vec::new());
    for (i, c) in after_open.char_indices() {
        match c {
            '(' | '[' | '{' => depth += 1,
            ']' | '}' => depth = depth.checked_sub(1)?,
            ')' if depth == 0 => {
                let last = after_open[start..i].trim();
                if !last.is_empty() {
                    parts.push(last);
                }
                return Some(parts);
            }
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(after_open[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    None
}

/// The grammar of a (kind, role) reply of `shape`, or why the budget is too
/// small for it (naming the smallest `max_new_tokens` that works).
pub fn reply_grammar(
    kind: TaskKind,
    role: Role,
    shape: &ReplyShape,
) -> Result<ReplyGrammar, String> {
    build(kind, role, shape).ok_or_else(|| {
        // Every grammar fits a few hundred tokens; the search stops well above.
        let needed = (shape.max_new_tokens..shape.max_new_tokens.max(64) * 64).find(|&n| {
            let bigger = ReplyShape {
                max_new_tokens: n,
                ..*shape
            };
            build(kind, role, &bigger).is_some()
        });
        let needed = needed.map_or("more".to_string(), |n| format!("at least {n}"));
        format!(
            "max_new_tokens = {} is too small for the {} {} reply: it needs {needed}",
            shape.max_new_tokens,
            kind.name(),
            role.name()
        )
    })
}

fn build(kind: TaskKind, role: Role, shape: &ReplyShape) -> Option<ReplyGrammar> {
    match (role, kind) {
        (Role::Proposer, TaskKind::Induction) => induction_proposer(shape),
        (Role::Proposer, _) => program_proposer(shape),
        (Role::Solver, TaskKind::Deduction) => literal_solver(shape, OUTPUT_HEAD, Some(1)),
        (Role::Solver, TaskKind::Abduction) => literal_solver(shape, INPUT_HEAD, shape.arity),
        (Role::Solver, TaskKind::Induction) => program_solver(shape),
    }
}

/// Deduction and abduction proposer: a program of 1 to [`MAX_PARAMS`]
/// parameters and one call's arguments, as many as it has parameters.
fn program_proposer(shape: &ReplyShape) -> Option<ReplyGrammar> {
    let fixed = bytes(&[PROGRAM_HEAD, PARAMS_END, PROGRAM_END, INPUT_HEAD, BLOCK_END]) + STOP;
    let most = params_bytes(MAX_PARAMS) + separators(MAX_PARAMS);
    let free = shape.max_new_tokens.checked_sub(fixed + most)?;
    let literals = free / INPUT_DIVISOR;
    let code = code_tokens(free - literals)?;
    let mut lark = format!("start: {}\n", alternatives("proposal", MAX_PARAMS));
    let mut worst = 0;
    for k in 1..=MAX_PARAMS {
        let arg = each(literals, k)?;
        lark += &format!(
            "proposal{k}: {} params{k} {} body {} args{k} {}\n",
            lit(PROGRAM_HEAD),
            lit(PARAMS_END),
            lit(&format!("{PROGRAM_END}{INPUT_HEAD}")),
            lit(BLOCK_END),
        );
        lark += &params_rule(k);
        lark += &format!("args{k}: {}\n", repeated(&format!("ARG{k}"), k));
        lark += &literal_terminal(&format!("ARG{k}"), arg);
        worst = worst.max(fixed + params_bytes(k) + separators(k) + k * arg + code);
    }
    lark += &code_rule(code);
    Some(finish(lark, worst))
}

/// Induction proposer: `inputs` argument lists, then a message.
fn induction_proposer(shape: &ReplyShape) -> Option<ReplyGrammar> {
    let n = shape.inputs.max(1);
    let most = shape.arity.unwrap_or(MAX_PARAMS);
    let block = bytes(&[INPUT_HEAD, BLOCK_END, "\n"]) + separators(most);
    let fixed = n * block + bytes(&[MESSAGE_HEAD, BLOCK_END]) + STOP;
    let free = shape.max_new_tokens.checked_sub(fixed)?;
    let message = (free / MESSAGE_DIVISOR).min(MESSAGE_CAP);
    if message < MIN_MESSAGE_TOKENS {
        return None;
    }
    let arg = each((free - message) / n, most)?;
    let mut lark = format!(
        "start: block{{{n}}} {} message {}\n",
        lit(MESSAGE_HEAD),
        lit(BLOCK_END)
    );
    lark += &format!(
        "block: {} arguments {}\n",
        lit(INPUT_HEAD),
        lit(&format!("{BLOCK_END}\n"))
    );
    lark += &arguments_rule(shape.arity, arg);
    lark += &format!(
        "message[max_tokens={message}]: MESSAGE\nMESSAGE: /[A-Za-z][^\\x00-\\x1f\\x7f`<]*/\n"
    );
    Some(finish(lark, fixed + n * most * arg + message))
}

/// Deduction and abduction solver: optional thinking, then an answer block
/// labelled by `head` holding `arity` literals (`None`: 1 to [`MAX_PARAMS`]).
fn literal_solver(shape: &ReplyShape, head: &str, arity: Option<usize>) -> Option<ReplyGrammar> {
    let most = arity.unwrap_or(MAX_PARAMS);
    let fixed =
        bytes(&[ANSWER_HEAD, head, ANSWER_END, THINK_HEAD, THINK_END]) + STOP + separators(most);
    let free = shape.max_new_tokens.checked_sub(fixed)?;
    let think = free / THINK_DIVISOR;
    let arg = each(free - think, most)?;
    let mut lark = format!(
        "start: think? {} arguments {}\n",
        lit(&format!("{ANSWER_HEAD}{head}")),
        lit(ANSWER_END)
    );
    lark += &think_rules(think);
    lark += &arguments_rule(arity, arg);
    Some(finish(lark, fixed + think + most * arg))
}

/// Induction solver: optional thinking, then an answer holding a program.
fn program_solver(shape: &ReplyShape) -> Option<ReplyGrammar> {
    let text = [
        ANSWER_HEAD,
        PROGRAM_HEAD,
        PARAMS_END,
        ANSWER_END,
        THINK_HEAD,
        THINK_END,
    ];
    let fixed = bytes(&text) + STOP + params_bytes(MAX_PARAMS) + separators(MAX_PARAMS);
    let free = shape.max_new_tokens.checked_sub(fixed)?;
    let think = free / THINK_DIVISOR_CODE;
    let code = code_tokens(free - think)?;
    let mut lark = format!(
        "start: think? {} params {} body {}\n",
        lit(&format!("{ANSWER_HEAD}{PROGRAM_HEAD}")),
        lit(PARAMS_END),
        lit(ANSWER_END)
    );
    lark += &format!("params: {}\n", alternatives("params", MAX_PARAMS));
    for k in 1..=MAX_PARAMS {
        lark += &params_rule(k);
    }
    lark += &think_rules(think);
    lark += &code_rule(code);
    Some(finish(lark, fixed + think + code))
}

/// The stop token that ends every reply.
const STOP: usize = 1;

/// `name1 | name2 | ...` up to `n`.
fn alternatives(name: &str, n: usize) -> String {
    let all: Vec<String> = (1..=n).map(|k| format!("{name}{k}")).collect();
    all.join(" | ")
}

/// `paramsK: NAME ", " NAME ...` (K names).
fn params_rule(k: usize) -> String {
    format!("params{k}: {}\n", repeated("NAME", k))
}

/// `arguments`: exactly `arity` literals, or 1 to [`MAX_PARAMS`] when
/// unknown, each at most `bytes` long.
fn arguments_rule(arity: Option<usize>, bytes: usize) -> String {
    let counts: Vec<usize> = match arity {
        Some(k) => vec![k],
        None => (1..=MAX_PARAMS).collect(),
    };
    let choices: Vec<String> = counts.iter().map(|&k| repeated("ARG", k)).collect();
    format!("arguments: {}\n", choices.join(" | ")) + &literal_terminal("ARG", bytes)
}

/// A literal terminal of at most `bytes` bytes.
fn literal_terminal(name: &str, bytes: usize) -> String {
    format!("{name}: VALUE & /[^\\n]{{1,{bytes}}}/\n")
}

fn think_rules(tokens: usize) -> String {
    format!(
        "think: {} thought {}\nthought[max_tokens={tokens}]: /[^<]*/\n",
        lit(THINK_HEAD),
        lit(THINK_END)
    )
}

fn code_tokens(tokens: usize) -> Option<usize> {
    (tokens >= MIN_CODE_TOKENS).then_some(tokens)
}

/// A function body of at most `tokens` tokens: the first line indented by
/// four spaces, every other line empty or indented; no backtick (the body
/// cannot close its fence), no control character but the tab, and no
/// `<answer>`, `</answer>` or `</think>` (the parsers find a reply's parts by
/// those tags). Each line is a terminal of a nested grammar: the lexer is
/// greedy, so a body that was one terminal could always go on with another
/// line and never let the closing fence start; and the token bound sits on
/// the nested grammar, whose every prefix is complete, so the fence can
/// follow wherever the bound falls.
fn code_rule(tokens: usize) -> String {
    format!(
        r#"body[max_tokens={tokens}]: %lark {{
start: FIRST LINE*
FIRST: /    [^\x00-\x08\x0a-\x1f\x7f`]*/ & ~TAGGED
LINE: /\n( [^\x00-\x08\x0a-\x1f\x7f`]*)?/ & ~TAGGED
TAGGED: /(?s:.*)(<\/?answer>|<\/think>)(?s:.*)/
}}
"#
    )
}

/// `item ", " item ...` (`k` items).
fn repeated(item: &str, k: usize) -> String {
    vec![item; k].join(&format!(" {} ", lit(SEPARATOR)))
}

/// Bytes for each of `k` literals sharing `total` bytes.
fn each(total: usize, k: usize) -> Option<usize> {
    let share = total / k;
    (share >= MIN_LITERAL_BYTES).then_some(share)
}

fn separators(k: usize) -> usize {
    SEPARATOR.len() * k.saturating_sub(1)
}

/// Bytes of `k` parameter names and their separators.
fn params_bytes(k: usize) -> usize {
    NAME_BYTES * k + separators(k)
}

fn bytes(parts: &[&str]) -> usize {
    parts.iter().map(|p| p.len()).sum()
}

/// A Lark string literal of `text`.
fn lit(text: &str) -> String {
    let escaped = text
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n");
    format!("\"{escaped}\"")
}

/// The rules followed by the shared terminals.
fn finish(rules: String, worst_case_tokens: usize) -> ReplyGrammar {
    ReplyGrammar {
        lark: format!("{rules}{COMMON}"),
        worst_case_tokens,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arity_counts_plain_and_annotated_parameters() {
        assert_eq!(arity("def f(a, b):\n    return a"), Some(2));
        assert_eq!(arity("import math\ndef f(x):\n    return x"), Some(1));
        assert_eq!(arity("def f():\n    return 1"), Some(0));
        assert_eq!(arity("def f(a, b=2):\n    return a"), None);
        assert_eq!(arity("def f(*args):\n    return 1"), None);
        assert_eq!(arity("def f(a: int):\n    return a"), Some(1));
        assert_eq!(
            arity("from typing import Dict, List\ndef f(d: Dict[str, int], xs: List[int]) -> Tuple[int, int]:\n    return 1"),
            Some(2)
        );
        assert_eq!(
            arity("def g(a):\n    return a\ndef f(a, b, c):\n    return g(a)"),
            Some(3)
        );
        assert_eq!(arity("def f(a, *, b):\n    return a"), None);
        assert_eq!(arity("def f(a, b,):\n    return a"), Some(2));
        assert_eq!(arity("def f(a, b"), None);
    }

    #[test]
    fn lark_literals_escape_newlines_quotes_and_backslashes() {
        assert_eq!(lit("a\n\"b\\"), r#""a\n\"b\\""#);
    }

    #[test]
    fn a_small_budget_names_the_smallest_that_works() {
        let shape = ReplyShape {
            max_new_tokens: 40,
            arity: None,
            inputs: 10,
        };
        let err = reply_grammar(TaskKind::Induction, Role::Proposer, &shape).unwrap_err();
        assert!(err.contains("max_new_tokens = 40"), "{err}");
        let needed: usize = err.rsplit(' ').next().unwrap().parse().unwrap();
        let below = ReplyShape {
            max_new_tokens: needed - 1,
            ..shape
        };
        assert!(reply_grammar(TaskKind::Induction, Role::Proposer, &below).is_err());
        let fits = ReplyShape {
            max_new_tokens: needed,
            ..shape
        };
        assert!(reply_grammar(TaskKind::Induction, Role::Proposer, &fits).is_ok());
    }
}
