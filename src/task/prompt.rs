//! Building proposer and solver prompts from tasks and buffers.
//!
//! Prompts come out as (system, user) message pairs ([`ChatPrompt`]); the base
//! model's chat template renders them. Every builder takes `measure`, the
//! token length of a prompt *as the model will see it* (rendered with the chat
//! template, then tokenized), so that the length is reported and the budget
//! [`PromptConfig::max_prompt_tokens`] is enforced on real tokens. A proposer
//! prompt that is over budget drops reference triplets until it fits; a prompt
//! that cannot fit is an [`Error::PromptTooLong`], never silently truncated.

use rand::Rng;
use serde::{Deserialize, Serialize};

use super::templates::{self, fill};
use super::{Error, IoPair, Role, TaskBuffers, TaskKind, Triplet};

/// AZR shows K = 6 reference triplets to a deduction/abduction proposer.
pub const AZR_REFERENCES: usize = 6;
/// Token budget of one prompt (system + user, rendered). A 135M model on CPU
/// pays prefill for every token in every rollout.
pub const DEFAULT_MAX_PROMPT_TOKENS: usize = 1024;
/// AZR's induction proposer writes 10 inputs...
pub const AZR_INDUCTION_INPUTS: usize = 10;
/// ...of which the solver sees 5 (with outputs); the other 5 are hidden tests.
pub const AZR_INDUCTION_SHOWN: usize = 5;

/// Prompt settings (a scenario section).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PromptConfig {
    /// Reference triplets K in a deduction/abduction proposer prompt.
    pub references: usize,
    /// Longest prompt allowed, in tokens of the rendered chat.
    pub max_prompt_tokens: usize,
    /// Inputs an induction proposer must write.
    pub induction_inputs: usize,
    /// Of those, how many the induction solver sees.
    pub induction_shown: usize,
}

impl Default for PromptConfig {
    fn default() -> Self {
        PromptConfig {
            references: AZR_REFERENCES,
            max_prompt_tokens: DEFAULT_MAX_PROMPT_TOKENS,
            induction_inputs: AZR_INDUCTION_INPUTS,
            induction_shown: AZR_INDUCTION_SHOWN,
        }
    }
}

/// A prompt as chat messages; the base model's chat template renders it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatPrompt {
    pub system: String,
    pub user: String,
}

/// A prompt and its measured token length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuiltPrompt {
    pub chat: ChatPrompt,
    pub tokens: usize,
}

/// A proposer prompt with what went into it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProposerPrompt {
    pub prompt: BuiltPrompt,
    /// Reference triplets shown (after the token budget dropped any).
    pub references: usize,
    /// Induction only: the program the proposer writes inputs for. The
    /// verifier runs the proposed inputs through it.
    pub program: Option<String>,
}

/// What a solver is asked, with the gold needed to score the answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SolverTask {
    /// Shown program and input; gold is the triplet's output.
    Deduction(Triplet),
    /// Shown program and output; any input with `f(input) == output` is correct.
    Abduction(Triplet),
    /// Shown message and pairs; the answer must pass every hidden pair.
    Induction {
        program: String,
        message: String,
        shown: Vec<IoPair>,
        hidden: Vec<IoPair>,
    },
}

impl SolverTask {
    pub fn kind(&self) -> TaskKind {
        match self {
            SolverTask::Deduction(_) => TaskKind::Deduction,
            SolverTask::Abduction(_) => TaskKind::Abduction,
            SolverTask::Induction { .. } => TaskKind::Induction,
        }
    }
}

/// The proposer prompt for `kind`. Deduction/abduction: up to
/// `cfg.references` reference triplets drawn from that kind's buffer with
/// `rng`; induction: one program drawn from the deduction and abduction
/// buffers. `measure` gives the rendered token length of a prompt.
pub fn proposer_prompt(
    kind: TaskKind,
    buffers: &TaskBuffers,
    cfg: &PromptConfig,
    rng: &mut impl Rng,
    measure: &dyn Fn(&ChatPrompt) -> usize,
) -> Result<ProposerPrompt, Error> {
    match kind {
        TaskKind::Deduction | TaskKind::Abduction => {
            let references = buffers.sample_triplets(kind, cfg.references, rng)?;
            // Drop references from the end of the (random) draw until it fits.
            let mut shown = references.len();
            loop {
                let chat = triplet_proposer_chat(kind, &references[..shown]);
                let tokens = measure(&chat);
                if tokens <= cfg.max_prompt_tokens || shown == 0 {
                    let prompt = within_budget(kind, Role::Proposer, chat, tokens, cfg)?;
                    return Ok(ProposerPrompt {
                        prompt,
                        references: shown,
                        program: None,
                    });
                }
                shown -= 1;
            }
        }
        TaskKind::Induction => {
            let program = buffers.sample_program(rng)?.program.clone();
            let count = cfg.induction_inputs.to_string();
            let chat = ChatPrompt {
                system: templates::PROPOSER_SYSTEM.to_string(),
                user: fill(
                    templates::INDUCTION_PROPOSER,
                    &[("program", &program), ("count", &count)],
                ),
            };
            let tokens = measure(&chat);
            let prompt = within_budget(kind, Role::Proposer, chat, tokens, cfg)?;
            Ok(ProposerPrompt {
                prompt,
                references: 0,
                program: Some(program),
            })
        }
    }
}

/// The solver prompt for `task`.
pub fn solver_prompt(
    task: &SolverTask,
    cfg: &PromptConfig,
    measure: &dyn Fn(&ChatPrompt) -> usize,
) -> Result<BuiltPrompt, Error> {
    let user = match task {
        SolverTask::Deduction(t) => fill(
            templates::DEDUCTION_SOLVER,
            &[("program", &t.program), ("input", &t.input)],
        ),
        SolverTask::Abduction(t) => fill(
            templates::ABDUCTION_SOLVER,
            &[("program", &t.program), ("output", &t.output)],
        ),
        SolverTask::Induction { message, shown, .. } => {
            let pairs: Vec<String> = shown
                .iter()
                .map(|p| {
                    fill(
                        templates::INDUCTION_PAIR,
                        &[("input", &p.input), ("output", &p.output)],
                    )
                })
                .collect();
            fill(
                templates::INDUCTION_SOLVER,
                &[("message", message), ("pairs", &pairs.join("\n"))],
            )
        }
    };
    let chat = ChatPrompt {
        system: templates::SOLVER_SYSTEM.to_string(),
        user,
    };
    let tokens = measure(&chat);
    within_budget(task.kind(), Role::Solver, chat, tokens, cfg)
}

fn triplet_proposer_chat(kind: TaskKind, references: &[&Triplet]) -> ChatPrompt {
    let rendered: Vec<String> = references
        .iter()
        .map(|t| {
            fill(
                templates::REFERENCE,
                &[
                    ("program", &t.program),
                    ("input", &t.input),
                    ("output", &t.output),
                ],
            )
        })
        .collect();
    let references = if rendered.is_empty() {
        "(none)".to_string()
    } else {
        rendered.join("\n\n")
    };
    ChatPrompt {
        system: templates::PROPOSER_SYSTEM.to_string(),
        user: fill(
            templates::TRIPLET_PROPOSER,
            &[
                ("goal", templates::proposer_goal(kind)),
                ("references", &references),
            ],
        ),
    }
}

fn within_budget(
    kind: TaskKind,
    role: Role,
    chat: ChatPrompt,
    tokens: usize,
    cfg: &PromptConfig,
) -> Result<BuiltPrompt, Error> {
    if tokens > cfg.max_prompt_tokens {
        return Err(Error::PromptTooLong {
            kind,
            role,
            tokens,
            limit: cfg.max_prompt_tokens,
        });
    }
    Ok(BuiltPrompt { chat, tokens })
}
