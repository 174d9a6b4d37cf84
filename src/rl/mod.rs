//! Rewards and policy-gradient pieces of self-play: AZR's rewards
//! ([`reward`]), TRR++ advantages ([`advantage`]) and the PPO-clip token loss
//! in plain f64 ([`ppo`]), the definition the compute engine is tested against.
//!
//! Nothing here knows who produced a result: a proposer's learnability is
//! computed from whatever solver results the caller passes (its matched
//! students in PopuLoRA, itself in the single-agent baseline).

pub mod advantage;
pub mod ppo;
pub mod reward;

pub use advantage::{trr_plus_plus, AdvantageConfig, Rollout};
pub use ppo::{ppo_clip_token_loss, ppo_clip_token_loss_grad};
pub use reward::{proposer_reward, solver_reward, ProposerOutcome, RewardConfig, SolverOutcome};

/// Errors of the rl module: inputs that would otherwise become NaN or a panic.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("rollout {index} has a non-finite reward {reward}")]
    NonFiniteReward { index: usize, reward: f64 },
    #[error("{what}: {name} has length {got}, expected {expected}")]
    LengthMismatch {
        what: &'static str,
        name: &'static str,
        got: usize,
        expected: usize,
    },
    #[error("{what}: {name}[{index}] = {value} is not finite")]
    NonFinite {
        what: &'static str,
        name: &'static str,
        index: usize,
        value: f64,
    },
    #[error("{name} = {value} must be {rule}")]
    BadSetting {
        name: &'static str,
        value: f64,
        rule: &'static str,
    },
}
