//! Ratings and matchmaking: who plays whom, and what a game says about skill.
//!
//! This module owns TrueSkill ratings for teacher-vs-student games (the teacher
//! wins an attempt when the student fails it) and near-balanced matchmaking
//! across sub-populations (prioritised fictitious self-play). It is pure and
//! deterministic: no I/O, no clocks, no hash-map iteration; randomness only
//! from the rng the caller passes.
//!
//! | file | owns |
//! |---|---|
//! | [`gauss`] | erfc (Cody), Φ, φ, Φ⁻¹ and TrueSkill's truncated-Gaussian v, w |
//! | [`trueskill`] | [`Rating`], [`TrueSkillConfig`], 1v1 updates, [`record_problem`] |
//! | [`matchmaking`] | [`Player`], [`MatchConfig`], PFSP weights, [`match_teachers`] |

pub mod gauss;
pub mod matchmaking;
pub mod trueskill;

pub use matchmaking::{
    match_teachers, pfsp_weight, MatchConfig, MatchError, Pairing, PfspWeight, Player,
};
pub use trueskill::{
    attempt_solved, draw_margin, match_quality, record_problem, update, update_draw,
    win_probability, Rating, RatingError, TrueSkillConfig,
};
