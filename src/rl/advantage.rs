//! TRR++ (AZR's Task-Relative REINFORCE++) advantages.
//!
//! Rewards are normalised separately in each of the six (task kind × role)
//! groups, or, where the caller splits them further by [`Rollout::group`]
//! (one per population member, say), in each (group × kind × role). The statistics are token-weighted: a rollout's reward counts once
//! per response token, because the advantage is broadcast to every response
//! token and the loss is a token mean. For group g with weights w (response
//! tokens) and rewards r:
//!
//! ```text
//! mean = Σ w·r / Σ w        std = sqrt(Σ w·(r − mean)² / Σ w)
//! advantage = (r − mean) / std,   or 0 for the whole group when std ≤ std_floor
//! ```
//!
//! A group whose rewards are all equal carries no signal and gets exactly
//! zero advantages (an epsilon added to std would leave rounding noise
//! instead). The result is never NaN: rewards are checked to be finite and
//! are scaled by the group's largest magnitude before squaring.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::Error;
use crate::task::{Role, TaskKind};

/// Below this reward std a group is treated as having identical rewards.
pub const DEFAULT_STD_FLOOR: f64 = 1e-6;

/// Advantage settings (a scenario section).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdvantageConfig {
    pub std_floor: f64,
}

impl Default for AdvantageConfig {
    fn default() -> Self {
        AdvantageConfig {
            std_floor: DEFAULT_STD_FLOOR,
        }
    }
}

/// One generated response, as the advantage computation sees it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Rollout {
    pub kind: TaskKind,
    pub role: Role,
    pub reward: f64,
    /// Response tokens (the tokens the advantage is broadcast to).
    pub tokens: usize,
    /// The caller's partition on top of (task kind × role): rollouts of
    /// different groups never share statistics. The same value for every
    /// rollout (0) gives AZR's six groups.
    #[serde(default)]
    pub group: u64,
}

/// Token-weighted reward statistics of one (group × task kind × role).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GroupStats {
    /// The rollouts' [`Rollout::group`].
    pub group: u64,
    pub kind: TaskKind,
    pub role: Role,
    pub rollouts: usize,
    pub tokens: usize,
    pub mean: f64,
    pub std: f64,
}

/// Per-rollout advantages, in the order of `rollouts`. The caller broadcasts
/// each to every response token of its rollout.
pub fn trr_plus_plus(rollouts: &[Rollout], cfg: &AdvantageConfig) -> Result<Vec<f64>, Error> {
    if !(cfg.std_floor >= 0.0 && cfg.std_floor.is_finite()) {
        return Err(Error::BadSetting {
            name: "advantage.std_floor",
            value: cfg.std_floor,
            rule: "finite and >= 0",
        });
    }
    let groups = scaled_groups(rollouts)?;
    Ok(rollouts
        .iter()
        .map(|r| {
            let g = &groups[&(r.group, r.kind, r.role)];
            if g.tokens == 0 || g.scale * g.std_scaled <= cfg.std_floor {
                0.0
            } else {
                (r.reward / g.scale - g.mean_scaled) / g.std_scaled
            }
        })
        .collect())
}

/// The statistics of every group present in `rollouts`, ordered by
/// (group, kind, role).
pub fn group_stats(rollouts: &[Rollout]) -> Result<Vec<GroupStats>, Error> {
    Ok(scaled_groups(rollouts)?
        .into_iter()
        .map(|((group, kind, role), g)| GroupStats {
            group,
            kind,
            role,
            rollouts: g.rollouts,
            tokens: g.tokens,
            mean: g.mean_scaled * g.scale,
            std: g.std_scaled * g.scale,
        })
        .collect())
}

/// Group statistics of rewards divided by `scale` (the group's largest
/// |reward|, or 1 when all are zero), so squares cannot overflow.
struct Scaled {
    rollouts: usize,
    tokens: usize,
    scale: f64,
    mean_scaled: f64,
    std_scaled: f64,
}

type GroupKey = (u64, TaskKind, Role);

fn scaled_groups(rollouts: &[Rollout]) -> Result<BTreeMap<GroupKey, Scaled>, Error> {
    let mut members: BTreeMap<GroupKey, Vec<&Rollout>> = BTreeMap::new();
    for (index, r) in rollouts.iter().enumerate() {
        if !r.reward.is_finite() {
            return Err(Error::NonFiniteReward {
                index,
                reward: r.reward,
            });
        }
        members
            .entry((r.group, r.kind, r.role))
            .or_default()
            .push(r);
    }
    Ok(members
        .into_iter()
        .map(|(key, group)| (key, scaled_stats(&group)))
        .collect())
}

fn scaled_stats(group: &[&Rollout]) -> Scaled {
    let tokens: usize = group.iter().map(|r| r.tokens).sum();
    let largest = group.iter().map(|r| r.reward.abs()).fold(0.0, f64::max);
    let scale = if largest > 0.0 { largest } else { 1.0 };
    let mut stats = Scaled {
        rollouts: group.len(),
        tokens,
        scale,
        mean_scaled: 0.0,
        std_scaled: 0.0,
    };
    if tokens == 0 {
        return stats;
    }
    let total = tokens as f64;
    let weight = |r: &Rollout| r.tokens as f64 / total;
    let mean: f64 = group.iter().map(|r| weight(r) * r.reward / scale).sum();
    let variance: f64 = group
        .iter()
        .map(|r| weight(r) * (r.reward / scale - mean).powi(2))
        .sum();
    stats.mean_scaled = mean;
    stats.std_scaled = variance.max(0.0).sqrt();
    stats
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rollout(kind: TaskKind, role: Role, reward: f64, tokens: usize) -> Rollout {
        Rollout {
            kind,
            role,
            reward,
            tokens,
            group: 0,
        }
    }

    #[test]
    fn token_weighted_statistics_match_hand_computation() {
        // Weights 1 and 3: mean = (1·1 + 3·0)/4 = 0.25, var = (1·0.5625 + 3·0.0625)/4 = 0.1875.
        let rs = [
            rollout(TaskKind::Deduction, Role::Solver, 1.0, 1),
            rollout(TaskKind::Deduction, Role::Solver, 0.0, 3),
        ];
        let adv = trr_plus_plus(&rs, &AdvantageConfig::default()).unwrap();
        let std = 0.1875f64.sqrt();
        assert!((adv[0] - 0.75 / std).abs() < 1e-12);
        assert!((adv[1] + 0.25 / std).abs() < 1e-12);
        // Token-weighted mean of the advantages is zero, weighted variance one.
        let mean = (adv[0] * 1.0 + adv[1] * 3.0) / 4.0;
        let var = (adv[0].powi(2) * 1.0 + adv[1].powi(2) * 3.0) / 4.0;
        assert!(mean.abs() < 1e-12 && (var - 1.0).abs() < 1e-12);
    }

    #[test]
    fn groups_are_normalised_separately() {
        let rs = [
            rollout(TaskKind::Deduction, Role::Solver, 1.0, 5),
            rollout(TaskKind::Deduction, Role::Solver, -1.0, 5),
            rollout(TaskKind::Deduction, Role::Proposer, 100.0, 5),
            rollout(TaskKind::Deduction, Role::Proposer, 0.0, 5),
        ];
        let adv = trr_plus_plus(&rs, &AdvantageConfig::default()).unwrap();
        assert_eq!(adv, vec![1.0, -1.0, 1.0, -1.0]);
    }

    #[test]
    fn rollouts_of_different_groups_never_share_statistics() {
        let mut rs = [
            rollout(TaskKind::Deduction, Role::Solver, 1.0, 5),
            rollout(TaskKind::Deduction, Role::Solver, 1.0, 5),
            rollout(TaskKind::Deduction, Role::Solver, 1.0, 5),
            rollout(TaskKind::Deduction, Role::Solver, -1.0, 5),
        ];
        // One group: the three 1s sit above the mean of 0.5.
        let pooled = trr_plus_plus(&rs, &AdvantageConfig::default()).unwrap();
        assert!(pooled[..3].iter().all(|&a| a > 0.0) && pooled[3] < 0.0);
        // The first two apart: all equal, so exactly zero; the rest ±1.
        rs[0].group = 7;
        rs[1].group = 7;
        let split = trr_plus_plus(&rs, &AdvantageConfig::default()).unwrap();
        assert_eq!(split, vec![0.0, 0.0, 1.0, -1.0]);
        let stats = group_stats(&rs).unwrap();
        assert_eq!(
            stats
                .iter()
                .map(|g| (g.group, g.rollouts))
                .collect::<Vec<_>>(),
            [(0, 2), (7, 2)]
        );
    }

    #[test]
    fn identical_rewards_give_exact_zeros_and_bad_input_is_an_error() {
        let rs = [
            rollout(TaskKind::Induction, Role::Solver, 0.1, 7),
            rollout(TaskKind::Induction, Role::Solver, 0.1, 13),
            rollout(TaskKind::Abduction, Role::Proposer, 0.3, 0),
        ];
        assert_eq!(
            trr_plus_plus(&rs, &AdvantageConfig::default()).unwrap(),
            vec![0.0; 3]
        );
        let bad = [rollout(TaskKind::Induction, Role::Solver, f64::NAN, 1)];
        assert!(matches!(
            trr_plus_plus(&bad, &AdvantageConfig::default()),
            Err(Error::NonFiniteReward { index: 0, .. })
        ));
        let cfg = AdvantageConfig {
            std_floor: f64::NAN,
        };
        assert!(matches!(
            trr_plus_plus(&rs, &cfg),
            Err(Error::BadSetting { .. })
        ));
    }

    #[test]
    fn huge_rewards_do_not_overflow() {
        let rs = [
            rollout(TaskKind::Deduction, Role::Solver, 1e300, 1),
            rollout(TaskKind::Deduction, Role::Solver, -1e300, 1),
        ];
        assert_eq!(
            trr_plus_plus(&rs, &AdvantageConfig::default()).unwrap(),
            vec![1.0, -1.0]
        );
    }
}
