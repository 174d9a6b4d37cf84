//! The coordinator's bookkeeping, saved in every checkpoint: who is in the
//! population (names, roles, sub-populations), task buffers, ratings, reward
//! history for fitness, the last adapter checksums, and how far the journal
//! and metrics files had got.

use std::collections::BTreeMap;

use populora::compute::Cost;
use populora::rating::Rating;
use populora::scenario::{Fitness, Mode, Role, Scenario};
use populora::selfplay::MemberId;
use populora::task::TaskBuffers;
use serde::{Deserialize, Serialize};

use super::journal::MemberEntry;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemberInfo {
    pub name: String,
    /// Checkpoints before the roles were one type called this `part`.
    #[serde(alias = "part")]
    pub role: Role,
    pub subpop: usize,
    /// Step at which it joined (0 for the initial population).
    pub born: u64,
    pub parents: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct League {
    /// Last completed step.
    pub step: u64,
    pub members: BTreeMap<MemberId, MemberInfo>,
    pub next_id: MemberId,
    /// Next index per role name, for `teacher-N` / `student-N`.
    pub next_index: BTreeMap<String, usize>,
    pub buffers: TaskBuffers,
    pub ratings: BTreeMap<MemberId, Rating>,
    /// (step, mean reward) per member, newest last.
    pub rewards: BTreeMap<MemberId, Vec<(u64, f64)>>,
    pub checksums: BTreeMap<MemberId, String>,
    pub journal_lines: usize,
    pub metrics_lines: usize,
    /// Compute spent by the completed steps, and by the last of them.
    #[serde(default)]
    pub spent: Cost,
    #[serde(default)]
    pub last_spent: Cost,
    /// Compute spent before the last step (`spent` less `last_spent`, as
    /// it was summed then): the previous boundary a compute mark may choose.
    #[serde(default)]
    pub spent_before: Cost,
    /// The most compute one step has spent so far: a mark's target within
    /// that of the run's spending may be crossed by the next step.
    #[serde(default)]
    pub largest_step: Cost,
    /// How many of the compute marks (`checkpoint.at_tflop`, smallest
    /// first, then `budget_tflop`) the run has passed.
    #[serde(default)]
    pub marks_passed: usize,
}

impl League {
    /// The initial population of a scenario (members get ids 0, 1, ... in
    /// the scenario's order: teachers, then students).
    pub fn new(scenario: &Scenario, fresh: Rating) -> League {
        let mut league = League {
            step: 0,
            members: BTreeMap::new(),
            next_id: 0,
            next_index: BTreeMap::new(),
            buffers: TaskBuffers::seeded(),
            ratings: BTreeMap::new(),
            rewards: BTreeMap::new(),
            checksums: BTreeMap::new(),
            journal_lines: 0,
            metrics_lines: 0,
            spent: Cost::default(),
            last_spent: Cost::default(),
            spent_before: Cost::default(),
            largest_step: Cost::default(),
            marks_passed: 0,
        };
        let p = &scenario.population;
        match p.mode {
            Mode::Solo => {
                league.add(Role::Solo, 0, 0, Vec::new(), fresh);
            }
            Mode::Population => {
                for i in 0..p.teachers {
                    league.add(
                        Role::Teacher,
                        scenario.subpopulation_of(i),
                        0,
                        Vec::new(),
                        fresh,
                    );
                }
                for j in 0..p.students {
                    league.add(
                        Role::Student,
                        scenario.subpopulation_of(j),
                        0,
                        Vec::new(),
                        fresh,
                    );
                }
            }
        }
        league
    }

    /// A new member; returns its id.
    pub fn add(
        &mut self,
        role: Role,
        subpop: usize,
        born: u64,
        parents: Vec<String>,
        rating: Rating,
    ) -> MemberId {
        let id = self.next_id;
        self.next_id += 1;
        let index = self
            .next_index
            .entry(role.as_str().to_string())
            .or_default();
        let name = format!("{}-{index}", role.as_str());
        *index += 1;
        self.members.insert(
            id,
            MemberInfo {
                name,
                role,
                subpop,
                born,
                parents,
            },
        );
        self.ratings.insert(id, rating);
        id
    }

    pub fn remove(&mut self, id: MemberId) {
        self.members.remove(&id);
        self.ratings.remove(&id);
        self.rewards.remove(&id);
        self.checksums.remove(&id);
    }

    pub fn name(&self, id: MemberId) -> String {
        self.members
            .get(&id)
            .map_or_else(|| format!("#{id}"), |m| m.name.clone())
    }

    pub fn by_name(&self, name: &str) -> Option<MemberId> {
        self.members
            .iter()
            .find(|(_, m)| m.name == name)
            .map(|(&id, _)| id)
    }

    pub fn ids(&self, keep: impl Fn(&MemberInfo) -> bool) -> Vec<MemberId> {
        self.members
            .iter()
            .filter(|(_, m)| keep(m))
            .map(|(&id, _)| id)
            .collect()
    }

    pub fn entries(&self) -> Vec<MemberEntry> {
        self.members
            .values()
            .map(|m| MemberEntry {
                id: m.name.clone(),
                role: m.role.as_str().to_string(),
                subpop: m.subpop,
            })
            .collect()
    }

    /// The sub-population of `part` with the fewest members (lowest index on ties).
    pub fn smallest_subpop(&self, role: Role, subpops: usize) -> usize {
        (0..subpops.max(1))
            .min_by_key(|&g| {
                self.members
                    .values()
                    .filter(|m| m.role == role && m.subpop == g)
                    .count()
            })
            .unwrap_or(0)
    }

    /// Fitness by the scenario's rule: mean reward over the last `window`
    /// steps, or the conservative TrueSkill estimate μ − 3σ.
    pub fn fitness(&self, id: MemberId, rule: Fitness, window: u64) -> f64 {
        match rule {
            Fitness::RecentReward => {
                let history = self.rewards.get(&id).map(Vec::as_slice).unwrap_or(&[]);
                let recent: Vec<f64> = history
                    .iter()
                    .filter(|(s, _)| *s + window > self.step)
                    .map(|(_, r)| *r)
                    .collect();
                if recent.is_empty() {
                    0.0
                } else {
                    recent.iter().sum::<f64>() / recent.len() as f64
                }
            }
            Fitness::TrueSkill => self.ratings.get(&id).map_or(0.0, |r| r.mu - 3.0 * r.sigma),
        }
    }

    pub fn checksums_by_name(&self) -> BTreeMap<String, String> {
        self.checksums
            .iter()
            .map(|(&id, c)| (self.name(id), c.clone()))
            .collect()
    }
}
