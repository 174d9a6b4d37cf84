//! One Absolute-Zero self-play step as plain function calls.
//!
//! A step runs in phases; each phase is a function from plain data to plain
//! data, so the runtime can put the compute phases on its broker and the
//! verifier phases on its pool while [`run_step`] runs them all in-process.
//! [`play_step`] is the one place they are put in order:
//!
//! ```text
//! proposal_jobs ─▶ generate ─▶ judge_proposals ─▶ accept (buffers)
//!   ─▶ problems / solve_jobs ─▶ generate ─▶ judge_solutions
//!   ─▶ episodes (rewards) ─▶ train_rows (TRR++) ─▶ train_step ─▶ apply_update (AdamW)
//! ```
//!
//! Who proposes and who solves whose problems is the caller's [`Roster`]: the
//! population's cross-evaluation and the single-agent baseline (one member in
//! both roles) are the same step with different rosters.

mod grammars;
mod learn;
mod metrics;
mod propose;
mod seeding;
mod solve;
mod step;

pub use grammars::{GrammarError, Grammars};
pub use learn::{apply_update, episodes, train_rows, Episode, TrainBatch};
pub use metrics::{step_cost, ProgramMetrics, StepMetrics};
pub use propose::{
    accept, judge_proposals, proposal_jobs, AcceptedTask, ProposalJob, ProposalResult, Verdict,
};
pub use seeding::{seed_buffers, Seeded, SeedingConfig, SEEDING_AUTHOR};
pub use solve::{judge_solutions, problems, solve_jobs, Problem, SolveJob, SolveResult};
pub use step::{play_step, run_step, Learner, Local, StepBackend, StepReport, Trained};

use std::collections::BTreeMap;

use crate::base::{Message, Tokenizer};
use crate::compute::{AdapterId, Sampling, TrainConfig};
use crate::rl::{AdvantageConfig, RewardConfig};
pub use crate::scenario::AdvantageGroups;
use crate::scenario::Scenario;
use crate::task::{ChatPrompt, PromptConfig, TaskKind};

/// Members are named by their adapter id in the engine.
pub type MemberId = AdapterId;

/// Self-play settings (the scenario's `selfplay`, `rewards` and `training`).
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// Task kinds proposed and solved every step (default: all three).
    pub task_kinds: Vec<TaskKind>,
    /// References K, prompt token limit, induction inputs (AZR defaults).
    pub prompt: PromptConfig,
    /// Proposals per proposer per task kind per step (default 1).
    pub proposals_per_teacher: usize,
    /// Solver rollouts per problem and matched solver: AZR's n (default 8).
    pub solver_samples: usize,
    /// Buffer problems every solver gets per task kind per step, beside its
    /// matched proposers' problems (default 1); 0: only as the fallback of a
    /// solver left without a problem ([`problems`]).
    pub buffer_problems: usize,
    /// Which rollouts share one TRR++ baseline ([`train_rows`]; default pooled).
    pub advantage_groups: AdvantageGroups,
    /// Longest response (default 512).
    pub max_new_tokens: usize,
    /// Sampling of every response (default temperature 1, top-p 1).
    pub sampling: Sampling,
    /// Decode every reply under its grammar ([`crate::task::grammar`];
    /// default true): every reply parses, and PPO trains the masked policy.
    pub constrained: bool,
    /// Unconstrained decoding only: write the start of every reply for the
    /// model ([`crate::task::templates::response_prefix`]; default false, as AZR).
    pub prefill_answer: bool,
    pub rewards: RewardConfig,
    pub advantage: AdvantageConfig,
    /// PPO clip (0.2) and micro-batch token budget (2048).
    pub train: TrainConfig,
    /// Global gradient-norm clip per adapter (AZR: 1.0).
    pub grad_clip: f64,
}

impl Settings {
    /// A scenario's `[selfplay]`, `[rewards]` and `[training]`: the only way
    /// scenario settings reach a step.
    pub fn from_scenario(s: &Scenario) -> Settings {
        let p = &s.selfplay;
        Settings {
            task_kinds: p.task_kinds.clone(),
            prompt: PromptConfig {
                references: p.references,
                max_prompt_tokens: p.max_prompt_tokens,
                induction_inputs: p.induction_inputs,
                induction_shown: p.induction_shown,
            },
            proposals_per_teacher: p.proposals_per_teacher,
            solver_samples: p.solver_samples,
            buffer_problems: p.buffer_problems,
            advantage_groups: p.advantage_groups,
            max_new_tokens: p.max_new_tokens,
            sampling: Sampling {
                temperature: p.temperature as f32,
                top_p: p.top_p as f32,
            },
            constrained: p.constrained,
            prefill_answer: p.prefill_answer,
            rewards: RewardConfig {
                correct_reward: s.rewards.correct,
                malformed_penalty: s.rewards.malformed,
                wrong_penalty: s.rewards.wrong,
                solver_rollouts: p.solver_samples,
            },
            advantage: AdvantageConfig::default(),
            train: TrainConfig {
                clip: s.training.clip,
                micro_batch_tokens: s.training.micro_batch_tokens,
                share_prefixes: p.share_prefixes,
            },
            grad_clip: s.training.grad_clip,
        }
    }
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            task_kinds: TaskKind::ALL.to_vec(),
            prompt: PromptConfig::default(),
            proposals_per_teacher: 1,
            solver_samples: crate::rl::reward::AZR_SOLVER_ROLLOUTS,
            buffer_problems: 1,
            advantage_groups: AdvantageGroups::Pooled,
            max_new_tokens: 512,
            sampling: Sampling::default(),
            constrained: true,
            prefill_answer: false,
            rewards: RewardConfig::default(),
            advantage: AdvantageConfig::default(),
            train: TrainConfig::default(),
            grad_clip: crate::rl::ppo::AZR_GRAD_CLIP_NORM,
        }
    }
}

/// Who plays what in one step.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Roster {
    /// Members that propose, in id order.
    pub proposers: Vec<MemberId>,
    /// Each proposer's matched solvers: they solve its problems and its
    /// learnability comes only from them.
    pub matches: BTreeMap<MemberId, Vec<MemberId>>,
    /// Members that solve. Each also solves `buffer_problems` buffer
    /// problems per task kind; with that 0, a solver matched to no proposer
    /// with a valid problem solves one per kind instead, so every solver
    /// trains every step.
    pub solvers: Vec<MemberId>,
}

impl Roster {
    /// The single-agent baseline: one member proposes and solves its own problems.
    pub fn solo(member: MemberId) -> Roster {
        Roster {
            proposers: vec![member],
            matches: BTreeMap::from([(member, vec![member])]),
            solvers: vec![member],
        }
    }

    /// Every member that takes part, once, in id order.
    pub fn members(&self) -> Vec<MemberId> {
        let mut all: Vec<MemberId> = self
            .proposers
            .iter()
            .chain(&self.solvers)
            .copied()
            .collect();
        all.sort_unstable();
        all.dedup();
        all
    }
}

/// What every phase needs to know about the step.
#[derive(Clone, Copy)]
pub struct StepContext<'a> {
    pub seed: u64,
    pub step: u64,
    pub settings: &'a Settings,
    pub tokenizer: &'a Tokenizer,
    /// The reply grammars ([`Grammars::off`] when decoding is free).
    pub grammars: &'a Grammars,
}

impl StepContext<'_> {
    /// The chat prompt as the model's tokens, ready for the assistant turn.
    pub fn encode(&self, chat: &ChatPrompt) -> Result<Vec<u32>> {
        self.encode_with(chat, "")
    }

    /// The chat prompt followed by the start of the assistant's reply.
    pub fn encode_with(&self, chat: &ChatPrompt, prefix: &str) -> Result<Vec<u32>> {
        let rendered = self.tokenizer.chat.render(&[
            Message::new("system", chat.system.clone()),
            Message::new("user", chat.user.clone()),
        ])?;
        Ok(self.tokenizer.encode(&format!("{rendered}{prefix}"))?)
    }

    /// What the model is given of its reply for (kind, role): see [`Settings::prefill_answer`].
    pub fn prefix(&self, kind: TaskKind, role: crate::task::Role) -> &'static str {
        if self.settings.prefill_answer && !self.settings.constrained {
            crate::task::templates::response_prefix(kind, role)
        } else {
            ""
        }
    }

    /// Token length of a prompt, for the prompt builders' budget.
    fn measure(&self, chat: &ChatPrompt) -> usize {
        self.encode(chat).map_or(usize::MAX, |t| t.len())
    }

    /// The text a response is parsed from: the prefilled prefix, the reply,
    /// and — when prefilling — whatever the prefix opened and the reply left
    /// open (a fence, `<answer>`) closed at the end of the reply.
    fn reply_text(&self, prefix: &str, tokens: &[u32]) -> Result<String> {
        let mut text = format!("{prefix}{}", self.decode(tokens)?);
        if !prefix.is_empty() {
            if text.matches("```").count() % 2 == 1 {
                text.push_str("\n```");
            }
            if text.contains("<answer>") && !text.contains("</answer>") {
                text.push_str("\n</answer>");
            }
        }
        Ok(text)
    }

    /// Response tokens as text; the stop token is not part of the answer.
    fn decode(&self, tokens: &[u32]) -> Result<String> {
        Ok(self.tokenizer.decode_reply(tokens)?)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Base(#[from] crate::base::Error),
    #[error(transparent)]
    Compute(#[from] crate::compute::Error),
    #[error(transparent)]
    Task(#[from] crate::task::Error),
    #[error(transparent)]
    Verify(#[from] crate::verify::Error),
    #[error(transparent)]
    Rl(#[from] crate::rl::Error),
    #[error(transparent)]
    Lora(#[from] crate::lora::Error),
    #[error("{phase}: {expected} results expected, {got} given")]
    Mismatch {
        phase: &'static str,
        expected: usize,
        got: usize,
    },
    #[error(transparent)]
    Grammar(#[from] GrammarError),
    #[error("member {0} takes part in the step but has no adapter")]
    UnknownMember(MemberId),
    #[error("seeding: {0}")]
    Seeding(String),
}

pub type Result<T> = std::result::Result<T, Error>;

/// `expected == got`, or the phase's mismatch error.
fn check_len(phase: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(Error::Mismatch {
            phase,
            expected,
            got,
        })
    }
}
