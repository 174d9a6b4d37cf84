//! One line of `metrics.jsonl`: what a step measured, members by name.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::compute::Cost;
use crate::rating::Rating;
use crate::task::{Role, TaskKind};
use crate::verify::Features;

/// Everything measured in one completed step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetricsLine {
    pub step: u64,
    /// Wall time of the step, retries included.
    pub wall_ms: f64,
    /// Wall time per phase (propose, validate, solve, score, train, ...) and
    /// `compute`, the model's share of it.
    pub phase_ms: BTreeMap<String, f64>,
    /// Every member alive after the step, in id order.
    pub members: Vec<MemberLine>,
    pub groups: Vec<GroupMetrics>,
    pub proposals: ProposalCounts,
    /// Solver rollouts judged correct, per task kind (`None`: no rollouts).
    pub solve_rate: BTreeMap<TaskKind, Option<f64>>,
    /// Solver rollouts that could not be parsed, per task kind.
    pub solver_format_errors: BTreeMap<TaskKind, Option<f64>>,
    /// Every valid proposed program.
    pub programs: Vec<ProgramLine>,
    pub tokens: TokenMetrics,
    /// The step's compute ([`Cost`]); `None` in runs from before compute
    /// was counted.
    #[serde(default)]
    pub compute: Option<Cost>,
    /// The run's compute so far; `None` as for `compute`.
    #[serde(default)]
    pub compute_total: Option<Cost>,
    /// Bytes this step sent to and received from worker nodes (absent when
    /// every member runs in the `run` process).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wire_bytes: Option<WireBytes>,
    /// Solver rollouts this step, and how many of them solved a problem
    /// drawn from the task buffers rather than a matched teacher's (`None`
    /// in runs from before this was counted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub solver_rollouts: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buffer_rollouts: Option<usize>,
}

/// One member's numbers after a step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemberLine {
    pub id: String,
    /// `teacher`, `student` or `solo`.
    pub role: String,
    pub subpop: usize,
    /// Mean reward of its episodes this step (`None`: it had none).
    pub reward_mean: Option<f64>,
    pub fitness: f64,
    pub rating: Rating,
    /// Gradient norm before clipping (`None`: it did not train this step).
    pub grad_norm: Option<f64>,
    /// Tokens it trained on (`None`: it did not train this step).
    pub train_tokens: Option<usize>,
    /// Token slots its sequences ran through the train step, prompts shared
    /// and rows that add nothing skipped (`None`: it did not train, or a run
    /// from before this was measured).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_tokens_run: Option<usize>,
    /// Its rollouts this step per (task kind × role), and how many of them
    /// carry a learning signal. Empty when it had none, and in runs from
    /// before this was measured.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<MemberGroup>,
}

/// One member's rollouts of one (task kind × role) in a step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemberGroup {
    pub kind: TaskKind,
    pub role: Role,
    pub rollouts: usize,
    pub reward_mean: f64,
    /// Rollouts with a non-zero TRR++ advantage and a token to train: the
    /// ones that move the policy (a zero advantage adds exactly 0 to the
    /// gradient, and the train step skips such rows).
    pub nonzero_advantage: usize,
    /// `nonzero_advantage / rollouts`.
    pub nonzero_share: f64,
}

/// Reward statistics of one (task kind × role) over every member's rollouts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupMetrics {
    pub kind: TaskKind,
    pub role: Role,
    pub count: usize,
    pub reward_mean: f64,
    pub reward_std: f64,
}

/// How the step's proposals fared.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProposalCounts {
    pub total: usize,
    pub valid: usize,
    /// Valid proposals that their solvers solved in some rollouts but not in
    /// all (0 < acc < 1): the problems a proposer is rewarded for. `None` in
    /// runs from before the count existed.
    #[serde(default)]
    pub learnable: Option<usize>,
    /// Rejections by reason: `format.<code>` or the sandbox status name.
    pub rejected: BTreeMap<String, usize>,
}

/// A valid proposed program's complexity (for the dynamics plots).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProgramLine {
    pub author: String,
    pub kind: TaskKind,
    #[serde(flatten)]
    pub features: Features,
}

/// Prompt and response lengths, in tokens.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenMetrics {
    pub prompt_mean: f64,
    pub prompt_max: usize,
    pub response_mean: f64,
    /// Fraction of responses cut off by `max_new_tokens`.
    pub truncated: f64,
}

/// Bytes that crossed the wire between the coordinator and its nodes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct WireBytes {
    pub sent: u64,
    pub received: u64,
}
