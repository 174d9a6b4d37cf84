//! Rewards, TRR++ advantages and the optimizer update.
//!
//! Every response becomes an [`Episode`] with its AZR reward: a solver's
//! 1 / −0.5 / −1, a proposer's learnability `1 − acc` (acc from its matched
//! solvers' rollouts) / −0.5 / −1. TRR++ normalises rewards within each
//! advantage group ([`train_rows`]: by default each (task kind × role) over
//! the whole step's batch, so in a population the members share one baseline
//! per group) and broadcasts each episode's advantage to all its response
//! tokens.

use std::collections::BTreeMap;

use super::{AdvantageGroups, Problem, Settings};
use super::{MemberId, ProposalResult, Result, SolveResult, Verdict};
use crate::compute::{Pick, TrainRow};
use crate::lora::{clip_grad_norm, AdamW, Adapter, AdapterGrads, StepReport};
use crate::rl::advantage::{group_stats, GroupStats};
use crate::rl::{proposer_reward, solver_reward, trr_plus_plus, ProposerOutcome, Rollout};
use crate::task::{Role, TaskKind};

/// One response with its reward, as training sees it.
#[derive(Debug, Clone)]
pub struct Episode {
    pub member: MemberId,
    pub kind: TaskKind,
    pub role: Role,
    pub prompt: Vec<u32>,
    pub response: Vec<u32>,
    /// log π(response token) at sampling time: PPO's old log-probs.
    pub logprobs: Vec<f32>,
    /// How each response token was chosen: forced tokens are not trained,
    /// masked ones are trained under their mask.
    pub picks: Vec<Pick>,
    pub reward: f64,
}

impl Episode {
    /// Response tokens the policy chose (the ones PPO trains).
    pub fn chosen_tokens(&self) -> usize {
        self.picks.iter().filter(|p| **p != Pick::Forced).count()
    }
}

/// Proposer episodes (in proposal order), then solver episodes (in solve order).
pub fn episodes(
    settings: &Settings,
    proposals: &[ProposalResult],
    problems: &[Problem],
    solves: &[SolveResult],
) -> Vec<Episode> {
    let mut results_of: BTreeMap<usize, Vec<crate::rl::SolverOutcome>> = BTreeMap::new();
    for s in solves {
        if let Some(i) = problems[s.job.problem].proposal {
            results_of.entry(i).or_default().push(s.outcome);
        }
    }
    let proposer = proposals.iter().enumerate().map(|(i, p)| {
        let outcome = match &p.verdict {
            Verdict::Malformed(_) => ProposerOutcome::Malformed,
            Verdict::Invalid { .. } | Verdict::TooLong { .. } => ProposerOutcome::Invalid,
            Verdict::Valid { .. } => ProposerOutcome::Valid {
                solver_results: results_of.remove(&i).unwrap_or_default(),
            },
        };
        Episode {
            member: p.job.author,
            kind: p.job.kind,
            role: Role::Proposer,
            prompt: p.job.tokens.clone(),
            response: p.generation.tokens.clone(),
            logprobs: p.generation.logprobs.clone(),
            picks: p.generation.picks.clone(),
            reward: proposer_reward(&outcome, &settings.rewards),
        }
    });
    let solver = solves.iter().map(|s| {
        let problem = &problems[s.job.problem];
        Episode {
            member: s.job.solver,
            kind: problem.task.kind(),
            role: Role::Solver,
            prompt: problem.tokens.clone(),
            response: s.generation.tokens.clone(),
            logprobs: s.generation.logprobs.clone(),
            picks: s.generation.picks.clone(),
            reward: solver_reward(s.outcome, &settings.rewards),
        }
    });
    proposer.chain(solver).collect()
}

/// Train rows with TRR++ advantages, and the step's reward statistics.
#[derive(Debug, Clone)]
pub struct TrainBatch {
    pub rows: Vec<TrainRow>,
    /// One per episode, in the episodes' order (also those without a row).
    pub advantages: Vec<f64>,
    /// Reward statistics of each (task kind × role) over every member's
    /// rollouts, whatever the advantage groups.
    pub groups: Vec<GroupStats>,
}

/// TRR++ over all `episodes`, then one train row per response with a chosen
/// token: prompt and response tokens, the loss on the response tokens the
/// policy chose (not those the grammar forced), each under its mask.
///
/// The advantage groups ([`Settings::advantage_groups`]):
/// - `Pooled` (the default): one group per (task kind × role) over every
///   member's rollouts of the step, AZR's six groups with the members
///   sharing one baseline and one std per group.
/// - `PerMember`: one group per (member × kind × role), each member its own.
///
/// AZR is a single agent, so it has no answer. Both are REINFORCE with a
/// batch baseline, and a baseline that does not depend on a rollout's own
/// sample leaves the expected gradient as it is: the choice is about
/// variance and about what is thrown away. Per member, the baseline is the
/// member's own mean over its few rollouts (noisy), and a member whose
/// rewards in a group are all equal (every answer wrong, say) gets exactly
/// 0, learning nothing from them; a teacher with one proposal per kind
/// (`proposals_per_teacher` 1) has one-rollout groups and never learns.
/// Pooled, the baseline comes from every member's rollouts (twice the
/// samples for two students), and an all-equal member is pushed relative to
/// its peers; the price is a baseline off by the members' difference once
/// they differ, variance that per-member groups would not have.
///
/// Measured (issue 38; quickstart, 6 steps, no evolution, `buffer_problems`
/// 1): pooled, 83 % of the students' rollouts and 61 % of the teachers' had
/// a non-zero advantage; on the same rollouts per-member groups would give
/// 68 % and 0 %. The students' means differed no more than sampling noise
/// (between-member share of the reward variance 0.07, 0.07 expected of equal
/// students); with `solver_samples` 8 (100 % pooled against 87 %) a small
/// difference shows (0.08 against 0.04 expected). So the pooled baseline is
/// barely biased, keeps signal that per-member groups drop, and teachers
/// need it: pooled is the default. Per member fits once students differ
/// (after evolution, in larger populations) and teachers propose at least
/// twice per kind.
pub fn train_rows(settings: &Settings, episodes: &[Episode]) -> Result<TrainBatch> {
    let group = |e: &Episode| match settings.advantage_groups {
        AdvantageGroups::Pooled => 0,
        AdvantageGroups::PerMember => e.member,
    };
    let pooled: Vec<Rollout> = episodes
        .iter()
        .map(|e| Rollout {
            kind: e.kind,
            role: e.role,
            reward: e.reward,
            tokens: e.chosen_tokens(),
            group: 0,
        })
        .collect();
    let grouped: Vec<Rollout> = pooled
        .iter()
        .zip(episodes)
        .map(|(r, e)| Rollout {
            group: group(e),
            ..*r
        })
        .collect();
    let advantages = trr_plus_plus(&grouped, &settings.advantage)?;
    let groups = group_stats(&pooled)?;
    let rows = episodes
        .iter()
        .zip(&advantages)
        .filter(|(e, _)| e.chosen_tokens() > 0)
        .map(|(e, &advantage)| {
            let (p, r) = (e.prompt.len(), e.response.len());
            TrainRow {
                adapter: e.member,
                tokens: [e.prompt.as_slice(), e.response.as_slice()].concat(),
                prompt_len: p,
                loss_mask: std::iter::repeat_n(false, p)
                    .chain(e.picks.iter().map(|pick| *pick != Pick::Forced))
                    .collect(),
                advantages: (0..p + r)
                    .map(|t| if t >= p { advantage as f32 } else { 0.0 })
                    .collect(),
                old_logprobs: std::iter::repeat_n(0.0, p)
                    .chain(e.logprobs.iter().copied())
                    .collect(),
                allowed: std::iter::repeat_n(None, p)
                    .chain(e.picks.iter().map(Pick::mask))
                    .collect(),
                temperature: settings.sampling.policy_temperature(),
            }
        })
        .collect();
    Ok(TrainBatch {
        rows,
        advantages,
        groups,
    })
}

/// Clip the gradients to `grad_clip` in global norm, then one AdamW step.
pub fn apply_update(
    adapter: &Adapter,
    optimizer: &mut AdamW,
    mut grads: AdapterGrads,
    grad_clip: f64,
) -> Result<StepReport> {
    let norm = clip_grad_norm(&mut grads, grad_clip)?;
    let mut report = optimizer.step(adapter, &grads)?;
    report.grad_norm = norm;
    Ok(report)
}
