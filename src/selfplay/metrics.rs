//! What one step measured, by member id (the runtime turns it into a line of
//! `metrics.jsonl`, [`crate::run_files::MetricsLine`]).

use std::collections::BTreeMap;

use super::{
    Episode, MemberId, Problem, ProposalResult, Settings, SolveResult, TrainBatch, Verdict,
};
use crate::base::ModelConfig;
use crate::compute::Cost;
use crate::rl::reward::solve_rate;
use crate::run_files::{GroupMetrics, MemberGroup, ProposalCounts, TokenMetrics};
use crate::task::{Role, TaskKind};
use crate::verify::Features;

/// A valid program's complexity, by its author's id.
#[derive(Debug, Clone, PartialEq)]
pub struct ProgramMetrics {
    pub author: MemberId,
    pub kind: TaskKind,
    pub features: Features,
}

/// The step's measurements by member id; the runtime writes them, with names
/// and each member's fitness and rating, as a [`crate::run_files::MetricsLine`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepMetrics {
    pub step: u64,
    /// Wall time per phase: propose, validate, solve, score, train.
    pub phase_ms: BTreeMap<String, f64>,
    pub groups: Vec<GroupMetrics>,
    pub proposals: ProposalCounts,
    /// Solver rollouts judged correct, per task kind (`None`: no rollouts).
    pub solve_rate: BTreeMap<TaskKind, Option<f64>>,
    /// Solver rollouts that could not be parsed, per task kind.
    pub solver_format_errors: BTreeMap<TaskKind, Option<f64>>,
    pub programs: Vec<ProgramMetrics>,
    pub tokens: TokenMetrics,
    /// Mean reward of each member's episodes this step.
    pub member_reward: BTreeMap<MemberId, f64>,
    /// Each member's rollouts per (task kind × role), with how many carry
    /// a non-zero advantage.
    pub member_groups: BTreeMap<MemberId, Vec<MemberGroup>>,
    /// Tokens trained per member.
    pub train_tokens: BTreeMap<MemberId, usize>,
    /// Token slots each member's sequences ran through the train step.
    pub train_tokens_run: BTreeMap<MemberId, usize>,
    /// Gradient norm before clipping, per member.
    pub grad_norm: BTreeMap<MemberId, f64>,
    /// The step's compute: its generated and trained rows ([`Cost`]).
    pub compute: Cost,
    /// Solver rollouts, and those on buffer problems (no matched teacher's).
    pub solver_rollouts: usize,
    pub buffer_rollouts: usize,
}

impl StepMetrics {
    /// Everything but the timings, the update and the compute
    /// ([`step_cost`]), from the step's data.
    pub fn measure(
        step: u64,
        settings: &Settings,
        proposals: &[ProposalResult],
        problems: &[Problem],
        solves: &[SolveResult],
        episodes: &[Episode],
        batch: &TrainBatch,
    ) -> StepMetrics {
        let mut counts = ProposalCounts {
            total: proposals.len(),
            ..Default::default()
        };
        let mut programs = Vec::new();
        for p in proposals {
            match (&p.verdict, p.verdict.rejection()) {
                (Verdict::Valid { features, .. }, _) => {
                    counts.valid += 1;
                    if let Some(features) = *features {
                        programs.push(ProgramMetrics {
                            author: p.job.author,
                            kind: p.job.kind,
                            features,
                        });
                    }
                }
                (_, Some(reason)) => *counts.rejected.entry(reason).or_default() += 1,
                (_, None) => {}
            }
        }
        counts.learnable = Some(learnable(problems, solves));
        let solve_kinds: Vec<TaskKind> = solves
            .iter()
            .map(|s| problems[s.job.problem].task.kind())
            .collect();
        let mut solve_rate_by_kind = BTreeMap::new();
        let mut format_by_kind = BTreeMap::new();
        for &kind in &settings.task_kinds {
            let outcomes: Vec<_> = solves
                .iter()
                .zip(&solve_kinds)
                .filter(|(_, &k)| k == kind)
                .map(|(s, _)| s.outcome)
                .collect();
            solve_rate_by_kind.insert(kind, solve_rate(&outcomes));
            let malformed = outcomes
                .iter()
                .filter(|o| matches!(o, crate::rl::SolverOutcome::Malformed))
                .count();
            format_by_kind.insert(
                kind,
                (!outcomes.is_empty()).then(|| malformed as f64 / outcomes.len() as f64),
            );
        }
        StepMetrics {
            step,
            groups: batch
                .groups
                .iter()
                .map(|g| GroupMetrics {
                    kind: g.kind,
                    role: g.role,
                    count: g.rollouts,
                    reward_mean: g.mean,
                    reward_std: g.std,
                })
                .collect(),
            proposals: counts,
            solve_rate: solve_rate_by_kind,
            solver_format_errors: format_by_kind,
            programs,
            tokens: token_metrics(settings, episodes),
            member_reward: member_means(episodes),
            member_groups: member_groups(episodes, &batch.advantages),
            solver_rollouts: solves.len(),
            buffer_rollouts: solves
                .iter()
                .filter(|s| problems[s.job.problem].proposal.is_none())
                .count(),
            ..Default::default()
        }
    }
}

/// The compute of a step's rows: every proposal and solve generated, every
/// row trained ([`StepMetrics::compute`]).
pub fn step_cost(
    config: &ModelConfig,
    proposals: &[ProposalResult],
    problems: &[Problem],
    solves: &[SolveResult],
    batch: &TrainBatch,
) -> Cost {
    let proposed = proposals.iter().map(|p| {
        let (author, prompt) = (Some(p.job.author), p.job.tokens.as_slice());
        (author, prompt, p.generation.tokens.len())
    });
    let solved = solves.iter().map(|s| {
        let prompt = problems[s.job.problem].tokens.as_slice();
        (Some(s.job.solver), prompt, s.generation.tokens.len())
    });
    let mut cost = Cost::generations(config, proposed.chain(solved));
    cost.add(Cost::train_rows(config, &batch.rows));
    cost
}

/// Proposed problems solved in some of their rollouts but not in all.
fn learnable(problems: &[Problem], solves: &[SolveResult]) -> usize {
    let mut outcomes: BTreeMap<usize, Vec<crate::rl::SolverOutcome>> = BTreeMap::new();
    for s in solves {
        if problems[s.job.problem].proposal.is_some() {
            outcomes.entry(s.job.problem).or_default().push(s.outcome);
        }
    }
    outcomes
        .values()
        .filter(|o| solve_rate(o).is_some_and(|acc| acc > 0.0 && acc < 1.0))
        .count()
}

fn token_metrics(settings: &Settings, episodes: &[Episode]) -> TokenMetrics {
    if episodes.is_empty() {
        return TokenMetrics::default();
    }
    let n = episodes.len() as f64;
    let stop_ended = |e: &Episode| e.response.len() < settings.max_new_tokens;
    TokenMetrics {
        prompt_mean: episodes.iter().map(|e| e.prompt.len()).sum::<usize>() as f64 / n,
        prompt_max: episodes.iter().map(|e| e.prompt.len()).max().unwrap_or(0),
        response_mean: episodes.iter().map(|e| e.response.len()).sum::<usize>() as f64 / n,
        truncated: episodes.iter().filter(|e| !stop_ended(e)).count() as f64 / n,
    }
}

/// Per member and (kind, role): rollouts, mean reward, and those with a
/// non-zero advantage and a token to train (`advantages` in episode order).
fn member_groups(episodes: &[Episode], advantages: &[f64]) -> BTreeMap<MemberId, Vec<MemberGroup>> {
    // (rollouts, reward sum, non-zero)
    let mut tally: BTreeMap<(MemberId, TaskKind, Role), (usize, f64, usize)> = BTreeMap::new();
    for (e, &advantage) in episodes.iter().zip(advantages) {
        let t = tally.entry((e.member, e.kind, e.role)).or_default();
        t.0 += 1;
        t.1 += e.reward;
        t.2 += usize::from(advantage != 0.0 && e.chosen_tokens() > 0);
    }
    let mut out: BTreeMap<MemberId, Vec<MemberGroup>> = BTreeMap::new();
    for ((member, kind, role), (rollouts, reward, nonzero)) in tally {
        out.entry(member).or_default().push(MemberGroup {
            kind,
            role,
            rollouts,
            reward_mean: reward / rollouts as f64,
            nonzero_advantage: nonzero,
            nonzero_share: nonzero as f64 / rollouts as f64,
        });
    }
    out
}

fn member_means(episodes: &[Episode]) -> BTreeMap<MemberId, f64> {
    let mut sums: BTreeMap<MemberId, (f64, usize)> = BTreeMap::new();
    for e in episodes {
        let s = sums.entry(e.member).or_default();
        s.0 += e.reward;
        s.1 += 1;
    }
    sums.into_iter()
        .map(|(m, (sum, n))| (m, sum / n as f64))
        .collect()
}
