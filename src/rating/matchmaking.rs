//! Near-balanced matchmaking: prioritised fictitious self-play (PFSP) across
//! sub-populations.
//!
//! Each teacher draws `per_teacher` distinct students from other sub-populations,
//! without replacement, with probability ∝ a PFSP weight that peaks for evenly
//! matched pairs. Everything is a function of the inputs and the rng state: no
//! hash maps, students are considered in id order, teachers draw in id order.

use rand::Rng;
use serde::{Deserialize, Serialize};

use super::trueskill::{match_quality, win_probability, Rating, RatingError, TrueSkillConfig};

/// A population member as matchmaking sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Player {
    /// Unique member id; ties are broken by it.
    pub id: String,
    /// Sub-population index; teachers only play students of other ones.
    pub subpop: usize,
    /// The member's current rating in its role.
    pub rating: Rating,
}

/// The students one teacher plays this step (ids sorted).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pairing {
    /// The teacher's id.
    pub teacher: String,
    /// Its `per_teacher` distinct students' ids, sorted.
    pub students: Vec<String>,
}

/// How a teacher–student pair is weighted before the floor and load penalty.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PfspWeight {
    /// 4·p·(1 − p), p = P(teacher wins an attempt): AlphaStar's PFSP "variance"
    /// weighting, scaled to 1 at p = ½. Uncertain ratings pull p toward ½, so
    /// new members look balanced and get played: exploration for free.
    #[default]
    Variance,
    /// TrueSkill's [`match_quality`]. It also falls with sigma, so uncertain
    /// (new) members are picked less: the opposite bias.
    Quality,
}

/// Matchmaking parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MatchConfig {
    /// The rating model; only beta and the draw margin matter here.
    pub trueskill: TrueSkillConfig,
    /// PFSP weighting of a pair: [`PfspWeight::Variance`].
    pub weight: PfspWeight,
    /// Least weight of any eligible pair: 0.05, so the most lopsided pair is
    /// ~20× rarer than a perfectly balanced one but never starved.
    pub floor: f64,
    /// Load balance: a student already picked n times this step has its weight
    /// divided by 1 + load_penalty·n. 1.0 halves it after one pick; 0 disables.
    pub load_penalty: f64,
}

impl Default for MatchConfig {
    fn default() -> Self {
        Self {
            trueskill: TrueSkillConfig::default(),
            weight: PfspWeight::Variance,
            floor: 0.05,
            load_penalty: 1.0,
        }
    }
}

impl MatchConfig {
    /// Checks the rating model, 0 < floor ≤ 1 and a finite load_penalty ≥ 0.
    pub fn validate(&self) -> Result<(), MatchError> {
        self.trueskill.validate()?;
        if !(self.floor > 0.0 && self.floor <= 1.0) {
            return Err(MatchError::InvalidConfig(format!(
                "floor must be in (0, 1], got {}",
                self.floor
            )));
        }
        if !(self.load_penalty.is_finite() && self.load_penalty >= 0.0) {
            let got = self.load_penalty;
            return Err(MatchError::InvalidConfig(format!(
                "load_penalty must be finite and >= 0, got {got}"
            )));
        }
        Ok(())
    }
}

/// Why no pairing could be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MatchError {
    /// Every student shares the teacher's sub-population.
    #[error("teacher {teacher} (subpop {subpop}) has no eligible student: all {students} students share its subpop")]
    NoEligibleStudents {
        teacher: String,
        subpop: usize,
        students: usize,
    },
    /// Fewer students in other sub-populations than `per_teacher`.
    #[error("teacher {teacher} needs {needed} students from other subpops but only {eligible} are eligible")]
    TooFewStudents {
        teacher: String,
        eligible: usize,
        needed: usize,
    },
    /// Two teachers or two students share an id.
    #[error("duplicate {role} id {id}")]
    DuplicateId { role: &'static str, id: String },
    /// A [`MatchConfig`] (or its TrueSkill part) out of range.
    #[error("invalid match config: {0}")]
    InvalidConfig(String),
}

impl From<RatingError> for MatchError {
    fn from(e: RatingError) -> Self {
        MatchError::InvalidConfig(e.to_string())
    }
}

/// The PFSP weight of `teacher` playing `student`, before load balancing:
/// at least `cfg.floor`, at most 1.
pub fn pfsp_weight(teacher: Rating, student: Rating, cfg: &MatchConfig) -> f64 {
    let w = match cfg.weight {
        PfspWeight::Variance => {
            let p = win_probability(teacher, student, &cfg.trueskill);
            4.0 * p * (1.0 - p)
        }
        PfspWeight::Quality => match_quality(teacher, student, &cfg.trueskill),
    };
    // f64::max ignores a NaN weight (from NaN ratings): such a pair gets the floor.
    w.max(cfg.floor)
}

/// Matches every teacher with `per_teacher` distinct students of other
/// sub-populations; one [`Pairing`] per teacher, in input order.
///
/// Teachers draw in id order and students are considered in id order, so the
/// result depends on the sets of players and the rng state, not on the input
/// order. The load penalty makes later teachers (by id) avoid students already
/// picked this step. `per_teacher == 0` gives empty pairings.
pub fn match_teachers(
    teachers: &[Player],
    students: &[Player],
    per_teacher: usize,
    cfg: &MatchConfig,
    rng: &mut impl Rng,
) -> Result<Vec<Pairing>, MatchError> {
    cfg.validate()?;
    let order = sorted_by_id(teachers, "teacher")?;
    let pool: Vec<&Player> = sorted_by_id(students, "student")?
        .into_iter()
        .map(|j| &students[j])
        .collect();
    // Check every teacher before drawing anything: an error names the first
    // failing teacher in input order and consumes no randomness.
    for teacher in teachers {
        check_eligible(teacher, students, per_teacher)?;
    }
    let mut load = vec![0usize; pool.len()];
    let mut picks = vec![Vec::new(); teachers.len()];
    for i in order {
        picks[i] = draw_students(&teachers[i], &pool, &mut load, per_teacher, cfg, rng);
    }
    let pairings = teachers.iter().zip(picks);
    Ok(pairings
        .map(|(t, students)| Pairing {
            teacher: t.id.clone(),
            students,
        })
        .collect())
}

/// Indices of `players` sorted by id; duplicate ids are an error.
fn sorted_by_id(players: &[Player], role: &'static str) -> Result<Vec<usize>, MatchError> {
    let mut order: Vec<usize> = (0..players.len()).collect();
    order.sort_by(|&i, &j| players[i].id.cmp(&players[j].id));
    for pair in order.windows(2) {
        if players[pair[0]].id == players[pair[1]].id {
            return Err(MatchError::DuplicateId {
                role,
                id: players[pair[0]].id.clone(),
            });
        }
    }
    Ok(order)
}

fn check_eligible(
    teacher: &Player,
    students: &[Player],
    per_teacher: usize,
) -> Result<(), MatchError> {
    let eligible = students
        .iter()
        .filter(|s| s.subpop != teacher.subpop)
        .count();
    if per_teacher == 0 || eligible >= per_teacher {
        return Ok(());
    }
    let teacher_id = teacher.id.clone();
    if eligible == 0 {
        let (subpop, students) = (teacher.subpop, students.len());
        return Err(MatchError::NoEligibleStudents {
            teacher: teacher_id,
            subpop,
            students,
        });
    }
    Err(MatchError::TooFewStudents {
        teacher: teacher_id,
        eligible,
        needed: per_teacher,
    })
}

/// Draws `k` distinct eligible students for `teacher` from `pool` (sorted by
/// id), without replacement, ∝ PFSP weight / (1 + load_penalty·load); returns
/// their ids sorted and counts the picks in `load`.
fn draw_students(
    teacher: &Player,
    pool: &[&Player],
    load: &mut [usize],
    k: usize,
    cfg: &MatchConfig,
    rng: &mut impl Rng,
) -> Vec<String> {
    let mut candidates: Vec<(usize, f64)> = pool
        .iter()
        .enumerate()
        .filter(|(_, s)| s.subpop != teacher.subpop)
        .map(|(j, s)| {
            let balance = pfsp_weight(teacher.rating, s.rating, cfg);
            (j, balance / (1.0 + cfg.load_penalty * load[j] as f64))
        })
        .collect();
    let mut chosen = Vec::with_capacity(k);
    for _ in 0..k {
        let (j, _) = candidates.remove(weighted_index(&candidates, rng));
        load[j] += 1;
        chosen.push(pool[j].id.clone());
    }
    chosen.sort();
    chosen
}

/// An index into `candidates` drawn ∝ weight (all weights are > 0): one
/// uniform draw, scanned against the running sum in order.
fn weighted_index(candidates: &[(usize, f64)], rng: &mut impl Rng) -> usize {
    let total: f64 = candidates.iter().map(|c| c.1).sum();
    let mut u = rng.random::<f64>() * total;
    for (i, &(_, w)) in candidates.iter().enumerate() {
        if u < w {
            return i;
        }
        u -= w;
    }
    // Rounding can leave u just past the last weight: that is the last candidate.
    candidates.len() - 1
}
