//! Every prompt text of self-play, in one place.
//!
//! Prompts are short on purpose: the base is a 135M model running on CPU, so
//! each instruction token costs prefill time in every rollout and a long
//! instruction is more than the model can follow anyway. The layout keeps the
//! reply format as the last thing the model reads.
//!
//! Placeholders are `{name}`; [`fill`] substitutes them in one pass, so a value
//! that itself contains braces (a dict literal) is never rescanned.
//!
//! Answer convention (all solver prompts): reasoning inside `<think> </think>`,
//! then the answer inside `<answer> </answer>` holding one fenced block
//! (```` ```output ````, ```` ```input ```` or ```` ```python ````); see
//! [`crate::task::parse`] for exactly what is accepted.

use super::{Role, TaskKind};

/// System message of every solver prompt.
pub const SOLVER_SYSTEM: &str = "You are a careful Python programmer. \
Think step by step inside <think> </think>, then give only the final answer inside <answer> </answer>.";

/// System message of every proposer prompt.
pub const PROPOSER_SYSTEM: &str = "You are a Python programmer who writes small, tricky puzzles. \
Think inside <think> </think> if you need to, then reply with the blocks asked for.";

/// Deduction solver: predict the output. Placeholders: program, input.
pub const DEDUCTION_SOLVER: &str = "What does f return for this input?
```python
{program}
```
```input
{input}
```
Give the output as a Python literal:
<answer>
```output
...
```
</answer>";

/// Abduction solver: find an input. Placeholders: program, output.
pub const ABDUCTION_SOLVER: &str = "Find an input for which f returns this output.
```python
{program}
```
```output
{output}
```
Give the arguments of f as Python literals:
<answer>
```input
...
```
</answer>";

/// Induction solver: write the program. Placeholders: message, pairs
/// (rendered with [`INDUCTION_PAIR`], one per line).
pub const INDUCTION_SOLVER: &str = "Write a Python function f that passes these checks.
Hint: {message}
{pairs}
Give the code:
<answer>
```python
def f(...):
    ...
```
</answer>";

/// One shown input/output pair of an induction task. Placeholders: input, output.
pub const INDUCTION_PAIR: &str = "f({input}) == {output}";

/// Deduction and abduction proposer. Placeholders: goal ([`proposer_goal`]),
/// references (rendered with [`REFERENCE`], blank-line separated).
pub const TRIPLET_PROPOSER: &str = "Write a new Python function f and one input for it. {goal}
Rules: one function named f, standard library only, deterministic, no printing, no input().
Make it different from these examples:
{references}
Reply with exactly two blocks:
```python
def f(...):
    ...
```
```input
...
```";

/// One reference triplet inside [`TRIPLET_PROPOSER`]. Placeholders: program, input, output.
pub const REFERENCE: &str = "```python
{program}
```
```input
{input}
```
```output
{output}
```";

/// Induction proposer: inputs and a message for a given program.
/// Placeholders: program, count (how many inputs).
pub const INDUCTION_PROPOSER: &str = "Here is a Python function f:
```python
{program}
```
Write {count} different inputs for f, each in its own ```input block, \
then one ```message block with a short hint about what f does (do not show the code). \
A solver will see some inputs with their outputs and your message, and must write f.";

/// The start of the assistant's reply, written for the model when answer
/// prefilling is on: a 135M model rarely finds the block format by itself,
/// and with every reply malformed all rewards tie and TRR++ has no signal.
/// The prefix is part of the prompt (never trained) and of the parsed text.
pub fn response_prefix(kind: TaskKind, role: Role) -> &'static str {
    match (role, kind) {
        (Role::Proposer, TaskKind::Induction) => "```input\n",
        (Role::Proposer, _) => "```python\ndef f(",
        (Role::Solver, TaskKind::Deduction) => "<answer>\n```output\n",
        (Role::Solver, TaskKind::Abduction) => "<answer>\n```input\n",
        (Role::Solver, TaskKind::Induction) => "<answer>\n```python\ndef f(",
    }
}

/// The sentence of [`TRIPLET_PROPOSER`] that says what the solver will be asked.
pub fn proposer_goal(kind: TaskKind) -> &'static str {
    match kind {
        TaskKind::Deduction => {
            "A solver will see f and the input and must predict the output: make it hard but solvable."
        }
        TaskKind::Abduction => {
            "A solver will see f and the output and must find an input: make it hard but solvable."
        }
        // Induction proposals use INDUCTION_PROPOSER; the goal is stated there.
        TaskKind::Induction => "",
    }
}

/// Substitutes `{key}` placeholders in `template` in a single left-to-right
/// pass. Unknown `{...}` text is copied unchanged.
pub fn fill(template: &str, values: &[(&str, &str)]) -> String {
    let mut out =
        String::with_capacity(template.len() + values.iter().map(|(_, v)| v.len()).sum::<usize>());
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        let hit = values
            .iter()
            .find(|(key, _)| after.starts_with(key) && after[key.len()..].starts_with('}'));
        match hit {
            Some((key, value)) => {
                out.push_str(value);
                rest = &after[key.len() + 1..];
            }
            None => {
                out.push('{');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_substitutes_once_and_keeps_braces_in_values() {
        let s = fill("a {x} b {y} {z}", &[("x", "{y}"), ("y", "{'k': 1}")]);
        assert_eq!(s, "a {y} b {'k': 1} {z}");
    }
}
