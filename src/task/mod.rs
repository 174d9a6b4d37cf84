//! Absolute-Zero self-play tasks: triplets, the three task kinds, prompts,
//! answer parsing and the per-kind task buffers.
//!
//! Everything here is plain data and pure functions. Running programs is the
//! verifier's job ([`crate::verify`]), generating text the compute engine's;
//! this module only says what to ask and how to read the reply.
//!
//! | file | owns |
//! |---|---|
//! | [`templates`] | every prompt text, in one place |
//! | [`grammar`] | the grammar of every reply (structured decoding), its token budget |
//! | [`prompt`] | [`ChatPrompt`], the proposer and solver prompt builders, token budget |
//! | [`parse`] | proposal and answer parsers, [`FormatError`] |
//! | [`buffer`] | [`TaskBuffers`]: seeded, append-only, deterministic sampling |

pub mod buffer;
pub mod grammar;
pub mod parse;
pub mod prompt;
pub mod templates;

pub use buffer::TaskBuffers;
pub use parse::{
    parse_answer, parse_induction_proposal, parse_proposal, Answer, FormatError, InductionProposal,
    Proposal,
};
pub use prompt::{
    proposer_prompt, solver_prompt, BuiltPrompt, ChatPrompt, PromptConfig, ProposerPrompt,
    SolverTask,
};

use serde::{Deserialize, Serialize};

/// AZR truncates `repr(f(i))` to this many characters before it becomes a
/// triplet's output (the verifier applies it; it is here because it is a fact
/// about triplets).
pub const MAX_OUTPUT_CHARS: usize = 400;

/// The three AZR task kinds, named for what the solver does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskKind {
    /// AZR `code_o`: given program and input, predict the output.
    Deduction,
    /// AZR `code_i`: given program and output, find an input that produces it.
    Abduction,
    /// AZR `code_f`: given input/output pairs and a message, write the program.
    Induction,
}

impl TaskKind {
    pub const ALL: [TaskKind; 3] = [
        TaskKind::Deduction,
        TaskKind::Abduction,
        TaskKind::Induction,
    ];

    pub fn name(self) -> &'static str {
        match self {
            TaskKind::Deduction => "deduction",
            TaskKind::Abduction => "abduction",
            TaskKind::Induction => "induction",
        }
    }
}

/// Which side of a task a response was generated for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Proposer,
    Solver,
}

impl Role {
    pub const ALL: [Role; 2] = [Role::Proposer, Role::Solver];

    pub fn name(self) -> &'static str {
        match self {
            Role::Proposer => "proposer",
            Role::Solver => "solver",
        }
    }
}

/// An AZR triplet: a program `f`, an input (a Python expression, as the
/// proposer wrote it) and `output = repr(f(input))`, plus where it came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Triplet {
    pub program: String,
    pub input: String,
    pub output: String,
    /// Self-play step at which the proposal was accepted (0 for the seed).
    pub step: u64,
    /// Member id of the proposer; `None` for the seed triplet.
    pub author: Option<u64>,
}

impl Triplet {
    /// The AZR seed: `def f(a): return a` on `"Hello world"`.
    pub fn identity() -> Triplet {
        Triplet {
            program: IDENTITY_PROGRAM.to_string(),
            input: "\"Hello world\"".to_string(),
            output: "'Hello world'".to_string(),
            step: 0,
            author: None,
        }
    }
}

/// The seed program of every buffer.
pub const IDENTITY_PROGRAM: &str = "def f(a):\n    return a";

/// One input (a Python expression) and the repr of `f` applied to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IoPair {
    pub input: String,
    pub output: String,
}

/// An accepted induction proposal: a program, the proposer's message and the
/// input/output pairs computed from its inputs. Solvers see some pairs and the
/// message and are scored on the others (see [`InductionTask::split`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InductionTask {
    pub program: String,
    pub message: String,
    pub pairs: Vec<IoPair>,
    pub step: u64,
    pub author: Option<u64>,
}

impl InductionTask {
    /// The seed induction task: the identity program on ten literals whose
    /// repr is the literal itself, so the outputs need no Python to compute.
    pub fn identity() -> InductionTask {
        const LITERALS: [&str; 10] = [
            "'Hello world'",
            "0",
            "-3",
            "[1, 2, 3]",
            "'abc'",
            "True",
            "None",
            "(1, 'a')",
            "{'k': 1}",
            "2.5",
        ];
        InductionTask {
            program: IDENTITY_PROGRAM.to_string(),
            message: "The function returns its argument unchanged.".to_string(),
            pairs: LITERALS
                .iter()
                .map(|l| IoPair {
                    input: l.to_string(),
                    output: l.to_string(),
                })
                .collect(),
            step: 0,
            author: None,
        }
    }

    /// Deterministically shuffles the pairs with `rng` and splits them into
    /// `shown` pairs (in the solver's prompt) and the rest (hidden; the
    /// solver's program must pass all of them). Shuffling keeps a proposer
    /// from choosing which of its inputs are shown.
    pub fn split(&self, shown: usize, rng: &mut impl rand::Rng) -> (Vec<IoPair>, Vec<IoPair>) {
        use rand::seq::SliceRandom;
        let mut pairs = self.pairs.clone();
        pairs.shuffle(rng);
        let hidden = pairs.split_off(shown.min(pairs.len()));
        (pairs, hidden)
    }
}

/// Errors of the task module (format problems of model output are not errors:
/// they are [`FormatError`] values, an expected outcome of self-play).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("prompt for {kind:?} {role:?} is {tokens} tokens, over the limit of {limit} (prompt.max_prompt_tokens)")]
    PromptTooLong {
        kind: TaskKind,
        role: Role,
        tokens: usize,
        limit: usize,
    },
    #[error("the {0:?} buffer holds induction tasks, not triplets")]
    NotATripletBuffer(TaskKind),
    #[error("the {0:?} buffer is empty")]
    EmptyBuffer(TaskKind),
}
