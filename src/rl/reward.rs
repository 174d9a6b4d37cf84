//! AZR's rewards, with the composite format penalty.
//!
//! - Solver: 1 for a correct answer; a well-formed wrong answer gets the
//!   `wrong_penalty` (−0.5), a malformed one the `malformed_penalty` (−1).
//! - Proposer: learnability `1 − acc` when `0 < acc < 1`, else 0, with `acc`
//!   the solve rate over the solver rollouts given (AZR: n = 8; malformed
//!   answers count as unsolved). A response that cannot be parsed gets the
//!   `malformed_penalty`; one that parses but is not a valid program (the
//!   verifier rejects it) gets the `wrong_penalty`. A valid proposal gets its
//!   learnability, 0 included: in AZR's composite reward a valid proposal is
//!   "passable", so a trivial or impossible one earns 0, not −0.5.
//!
//! Every constant is a scenario setting; the defaults are AZR's.

use serde::{Deserialize, Serialize};

/// Reward of a correct solver answer.
pub const AZR_CORRECT_REWARD: f64 = 1.0;
/// Reward of a response whose format cannot be parsed.
pub const AZR_MALFORMED_PENALTY: f64 = -1.0;
/// Reward of a well-formed response that earns nothing (a wrong answer, an
/// invalid proposal).
pub const AZR_WRONG_PENALTY: f64 = -0.5;
/// Solver rollouts per proposal that estimate its solve rate.
pub const AZR_SOLVER_ROLLOUTS: usize = 8;

/// Reward settings (a scenario section).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RewardConfig {
    pub correct_reward: f64,
    pub malformed_penalty: f64,
    pub wrong_penalty: f64,
    /// How many solver rollouts estimate a proposal's solve rate (the caller
    /// schedules them; the reward uses however many it is given).
    pub solver_rollouts: usize,
}

impl Default for RewardConfig {
    fn default() -> Self {
        RewardConfig {
            correct_reward: AZR_CORRECT_REWARD,
            malformed_penalty: AZR_MALFORMED_PENALTY,
            wrong_penalty: AZR_WRONG_PENALTY,
            solver_rollouts: AZR_SOLVER_ROLLOUTS,
        }
    }
}

/// What happened to one solver response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SolverOutcome {
    /// The answer could not be parsed.
    Malformed,
    /// The answer parsed and the verifier judged it.
    Answered { correct: bool },
}

impl SolverOutcome {
    pub fn is_correct(self) -> bool {
        matches!(self, SolverOutcome::Answered { correct: true })
    }
}

/// What happened to one proposer response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProposerOutcome {
    /// The proposal could not be parsed.
    Malformed,
    /// It parsed, but the verifier rejected the program or its inputs.
    Invalid,
    /// A valid task, with the outcomes of the solver rollouts on it.
    Valid { solver_results: Vec<SolverOutcome> },
}

/// Reward of one solver response.
pub fn solver_reward(outcome: SolverOutcome, cfg: &RewardConfig) -> f64 {
    match outcome {
        SolverOutcome::Malformed => cfg.malformed_penalty,
        SolverOutcome::Answered { correct: true } => cfg.correct_reward,
        SolverOutcome::Answered { correct: false } => cfg.wrong_penalty,
    }
}

/// Reward of one proposer response.
pub fn proposer_reward(outcome: &ProposerOutcome, cfg: &RewardConfig) -> f64 {
    match outcome {
        ProposerOutcome::Malformed => cfg.malformed_penalty,
        ProposerOutcome::Invalid => cfg.wrong_penalty,
        ProposerOutcome::Valid { solver_results } => learnability(solver_results),
    }
}

/// Solve rate over `results`; `None` when there are none.
pub fn solve_rate(results: &[SolverOutcome]) -> Option<f64> {
    if results.is_empty() {
        return None;
    }
    let solved = results.iter().filter(|r| r.is_correct()).count();
    Some(solved as f64 / results.len() as f64)
}

/// `1 − acc` for `0 < acc < 1`, else 0 (also 0 with no rollouts: nothing was
/// learned about the task). Counted in integers, so `acc` is exactly 0 or 1 at
/// the ends.
pub fn learnability(results: &[SolverOutcome]) -> f64 {
    let solved = results.iter().filter(|r| r.is_correct()).count();
    if solved == 0 || solved == results.len() {
        return 0.0;
    }
    1.0 - solved as f64 / results.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn results(correct: usize, wrong: usize, malformed: usize) -> Vec<SolverOutcome> {
        let mut v = vec![SolverOutcome::Answered { correct: true }; correct];
        v.extend(vec![SolverOutcome::Answered { correct: false }; wrong]);
        v.extend(vec![SolverOutcome::Malformed; malformed]);
        v
    }

    #[test]
    fn learnability_is_one_minus_acc_strictly_inside() {
        assert_eq!(learnability(&results(0, 8, 0)), 0.0);
        assert_eq!(learnability(&results(8, 0, 0)), 0.0);
        assert_eq!(learnability(&results(0, 0, 0)), 0.0);
        assert_eq!(learnability(&results(2, 4, 2)), 0.75);
        assert_eq!(learnability(&results(7, 0, 1)), 0.125);
        assert_eq!(solve_rate(&results(2, 5, 1)), Some(0.25));
        assert_eq!(solve_rate(&[]), None);
    }

    #[test]
    fn composite_rewards_follow_azr() {
        let cfg = RewardConfig::default();
        assert_eq!(
            solver_reward(SolverOutcome::Answered { correct: true }, &cfg),
            1.0
        );
        assert_eq!(
            solver_reward(SolverOutcome::Answered { correct: false }, &cfg),
            -0.5
        );
        assert_eq!(solver_reward(SolverOutcome::Malformed, &cfg), -1.0);
        assert_eq!(proposer_reward(&ProposerOutcome::Malformed, &cfg), -1.0);
        assert_eq!(proposer_reward(&ProposerOutcome::Invalid, &cfg), -0.5);
        let valid = ProposerOutcome::Valid {
            solver_results: results(8, 0, 0),
        };
        assert_eq!(proposer_reward(&valid, &cfg), 0.0);
        let valid = ProposerOutcome::Valid {
            solver_results: results(1, 3, 0),
        };
        assert_eq!(proposer_reward(&valid, &cfg), 0.75);
    }

    #[test]
    fn settings_change_the_constants() {
        let cfg = RewardConfig {
            correct_reward: 2.0,
            malformed_penalty: -3.0,
            wrong_penalty: 0.0,
            solver_rollouts: 4,
        };
        assert_eq!(
            solver_reward(SolverOutcome::Answered { correct: true }, &cfg),
            2.0
        );
        assert_eq!(solver_reward(SolverOutcome::Malformed, &cfg), -3.0);
        assert_eq!(proposer_reward(&ProposerOutcome::Invalid, &cfg), 0.0);
    }
}
