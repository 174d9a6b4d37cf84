//! The per-step line of `metrics.jsonl`: the engine's step metrics with
//! member names, and each member's role, rating and fitness.

use std::collections::BTreeMap;

use populora::compute::Cost;
use populora::rating::{Rating, TrueSkillConfig};
use populora::scenario::Scenario;
use populora::selfplay::{GroupMetrics, MemberId, ProposalCounts, StepMetrics, TokenMetrics};
use populora::task::TaskKind;
use serde::{Deserialize, Serialize};

use super::league::League;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MemberLine {
    pub id: String,
    pub role: String,
    pub subpop: usize,
    pub reward_mean: Option<f64>,
    pub fitness: f64,
    pub rating: Rating,
    pub grad_norm: Option<f64>,
    pub train_tokens: Option<usize>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProgramLine {
    pub author: String,
    pub kind: TaskKind,
    pub ast_nodes: u32,
    pub max_depth: u32,
    pub node_types: u32,
    pub cyclomatic: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Line {
    pub step: u64,
    pub wall_ms: f64,
    pub phase_ms: BTreeMap<String, f64>,
    pub members: Vec<MemberLine>,
    pub groups: Vec<GroupMetrics>,
    pub proposals: ProposalCounts,
    pub solve_rate: BTreeMap<TaskKind, Option<f64>>,
    pub solver_format_errors: BTreeMap<TaskKind, Option<f64>>,
    pub programs: Vec<ProgramLine>,
    pub tokens: TokenMetrics,
    /// This step's compute, and the run's so far.
    pub compute: Cost,
    pub compute_total: Cost,
}

pub fn line(league: &League, scenario: &Scenario, m: &StepMetrics, wall_ms: f64) -> Line {
    let evolution = &scenario.evolution;
    let member = |id: MemberId| {
        let info = &league.members[&id];
        MemberLine {
            id: info.name.clone(),
            role: info.part.name().to_string(),
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
        }
    };
    Line {
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
                ast_nodes: p.ast_nodes,
                max_depth: p.max_depth,
                node_types: p.node_types,
                cyclomatic: p.cyclomatic,
            })
            .collect(),
        tokens: m.tokens.clone(),
        compute: m.compute,
        compute_total: league.spent,
    }
}
