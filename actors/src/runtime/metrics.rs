//! The per-step line of `metrics.jsonl` ([`MetricsLine`]): the engine's step
//! metrics with member names, and each member's role, rating and fitness.

use populora::rating::{Rating, TrueSkillConfig};
use populora::run_files::{MemberLine, MetricsLine, ProgramLine, WireBytes};
use populora::scenario::Scenario;
use populora::selfplay::{MemberId, StepMetrics};

use super::league::League;

pub fn line(
    league: &League,
    scenario: &Scenario,
    m: &StepMetrics,
    wall_ms: f64,
    wire_bytes: Option<WireBytes>,
) -> MetricsLine {
    let evolution = &scenario.evolution;
    let member = |id: MemberId| {
        let info = &league.members[&id];
        MemberLine {
            id: info.name.clone(),
            role: info.role.as_str().to_string(),
            subpop: info.subpop,
            reward_mean: m.member_reward.get(&id).copied(),
            fitness: league.fitness(id, evolution.fitness, evolution.fitness_window),
            rating: league
                .ratings
                .get(&id)
                .copied()
                .unwrap_or_else(|| Rating::fresh(&TrueSkillConfig::default())),
            grad_norm: m.grad_norm.get(&id).copied(),
            train_tokens: m.train_tokens.get(&id).copied(),
            train_tokens_run: m.train_tokens_run.get(&id).copied(),
            groups: m.member_groups.get(&id).cloned().unwrap_or_default(),
        }
    };
    MetricsLine {
        step: m.step,
        wall_ms,
        phase_ms: m.phase_ms.clone(),
        members: league.members.keys().map(|&id| member(id)).collect(),
        groups: m.groups.clone(),
        proposals: m.proposals.clone(),
        solve_rate: m.solve_rate.clone(),
        solver_format_errors: m.solver_format_errors.clone(),
        programs: m
            .programs
            .iter()
            .map(|p| ProgramLine {
                author: league.name(p.author),
                kind: p.kind,
                features: p.features,
            })
            .collect(),
        tokens: m.tokens.clone(),
        compute: Some(m.compute),
        compute_total: Some(league.spent),
        wire_bytes,
        solver_rollouts: Some(m.solver_rollouts),
        buffer_rollouts: Some(m.buffer_rollouts),
    }
}
