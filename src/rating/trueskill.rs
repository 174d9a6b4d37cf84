//! Two-player TrueSkill (Herbrich, Minka, Graepel, NIPS 2006) in closed form.
//!
//! For a 1v1 game the factor graph has no loops, so one pass of message passing
//! is exact and reduces to the update below; it matches the reference Python
//! `trueskill` package to its own ~1e-7 accuracy (see `tests/rating.rs`).

use serde::{Deserialize, Serialize};

use super::gauss::{cdf, ppf, v_draw, v_win, w_draw, w_win};

/// A skill belief N(mu, sigma²).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Rating {
    /// Mean skill.
    pub mu: f64,
    /// Uncertainty (standard deviation) of the skill; always > 0.
    pub sigma: f64,
}

impl Rating {
    /// N(mu, sigma²).
    pub fn new(mu: f64, sigma: f64) -> Self {
        Self { mu, sigma }
    }

    /// The prior of a new player, N(mu0, sigma0²).
    pub fn fresh(cfg: &TrueSkillConfig) -> Self {
        Self::new(cfg.mu0, cfg.sigma0)
    }

    /// TrueSkill's leaderboard score mu − 3·sigma: a skill the player exceeds
    /// with ~99.9% belief, so new, uncertain members do not rank on luck.
    pub fn conservative(&self) -> f64 {
        self.mu - 3.0 * self.sigma
    }

    /// The belief one time step later: skills drift, so variance grows by tau².
    pub fn with_dynamics(self, tau: f64) -> Self {
        Self::new(self.mu, self.sigma.hypot(tau))
    }
}

/// TrueSkill's parameters; the defaults are the paper's (and the reference
/// package's), except for draws, which populora games do not have.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrueSkillConfig {
    /// Prior mean of a new player: 25, the conventional TrueSkill scale.
    pub mu0: f64,
    /// Prior deviation: 25/3 = mu0/3, so a new player's conservative score
    /// mu − 3·sigma starts at 0.
    pub sigma0: f64,
    /// Performance noise per game: 25/6 = sigma0/2. Two exactly known players
    /// beta apart: the stronger one wins ~76% of games (Φ(1/√2)).
    pub beta: f64,
    /// Skill drift per update: 25/300 = sigma0/100, added in quadrature to sigma
    /// before each update so ratings keep tracking members that keep training.
    pub tau: f64,
    /// Chance that two equal players draw: 0, since one attempt is solved or
    /// not. Python `trueskill` defaults to 0.1 (its quoted examples use that).
    pub draw_probability: f64,
}

impl Default for TrueSkillConfig {
    fn default() -> Self {
        Self {
            mu0: 25.0,
            sigma0: 25.0 / 3.0,
            beta: 25.0 / 6.0,
            tau: 25.0 / 300.0,
            draw_probability: 0.0,
        }
    }
}

impl TrueSkillConfig {
    /// Checks that every parameter is finite and in range; the update functions
    /// assume a valid config.
    pub fn validate(&self) -> Result<(), RatingError> {
        let bad = |what: &str, value: f64| {
            Err(RatingError::InvalidConfig(format!("{what}, got {value}")))
        };
        if !self.mu0.is_finite() {
            return bad("mu0 must be finite", self.mu0);
        }
        if !(self.sigma0.is_finite() && self.sigma0 > 0.0) {
            return bad("sigma0 must be finite and > 0", self.sigma0);
        }
        if !(self.beta.is_finite() && self.beta > 0.0) {
            return bad("beta must be finite and > 0", self.beta);
        }
        if !(self.tau.is_finite() && self.tau >= 0.0) {
            return bad("tau must be finite and >= 0", self.tau);
        }
        if !(0.0..1.0).contains(&self.draw_probability) {
            return bad("draw_probability must be in [0, 1)", self.draw_probability);
        }
        Ok(())
    }
}

/// Invalid inputs to the rating functions.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RatingError {
    /// A parameter out of range (see [`TrueSkillConfig::validate`]).
    #[error("invalid TrueSkill config: {0}")]
    InvalidConfig(String),
    /// `record_problem` got more solves than attempts.
    #[error("a problem cannot be solved {solved} times in {attempts} attempts")]
    SolvedExceedsAttempts { solved: usize, attempts: usize },
}

/// The draw margin ε: performances closer than ε count as a draw.
/// ε = √2·β·Φ⁻¹((1 + p_draw)/2), so equal players draw with p_draw.
pub fn draw_margin(cfg: &TrueSkillConfig) -> f64 {
    if cfg.draw_probability <= 0.0 {
        return 0.0;
    }
    2f64.sqrt() * cfg.beta * ppf(0.5 + 0.5 * cfg.draw_probability)
}

/// The deviation c of the performance difference of a and b: c² = 2β² + σa² + σb².
fn performance_scale(a: Rating, b: Rating, cfg: &TrueSkillConfig) -> f64 {
    (2.0 * cfg.beta * cfg.beta + a.sigma * a.sigma + b.sigma * b.sigma).sqrt()
}

/// Moves `a` and `b` given the truncation corrections (v, w) of their
/// standardised performance difference a − b.
fn posterior(a: Rating, b: Rating, c: f64, v: f64, w: f64) -> (Rating, Rating) {
    let c2 = c * c;
    let shift = |r: Rating, sign: f64| {
        let var = r.sigma * r.sigma;
        // var·(c² − var·w)/c² rather than var·(1 − var/c²·w): with w ≤ 1 and
        // c² ≥ var the bracket cannot round below zero.
        let new_var = var * (c2 - var * w) / c2;
        Rating::new(r.mu + sign * var / c * v, new_var.max(0.0).sqrt())
    };
    (shift(a, 1.0), shift(b, -1.0))
}

/// Updates after `winner` beat `loser`; returns (winner, loser).
pub fn update(winner: Rating, loser: Rating, cfg: &TrueSkillConfig) -> (Rating, Rating) {
    let (a, b) = (winner.with_dynamics(cfg.tau), loser.with_dynamics(cfg.tau));
    let c = performance_scale(a, b, cfg);
    let x = (a.mu - b.mu - draw_margin(cfg)) / c;
    posterior(a, b, c, v_win(x), w_win(x))
}

/// Updates after a draw between `a` and `b`; returns (a, b). With
/// `draw_probability == 0` a draw has probability zero; we then take the limit
/// of a vanishing margin (both performances conditioned equal) rather than fail.
pub fn update_draw(a: Rating, b: Rating, cfg: &TrueSkillConfig) -> (Rating, Rating) {
    let (a, b) = (a.with_dynamics(cfg.tau), b.with_dynamics(cfg.tau));
    let c = performance_scale(a, b, cfg);
    let (t, e) = ((a.mu - b.mu) / c, draw_margin(cfg) / c);
    posterior(a, b, c, v_draw(t, e), w_draw(t, e))
}

/// P(a beats b): a's performance exceeds b's by more than the draw margin,
/// Φ((μa − μb − ε)/c). With `draw_probability == 0` this is Φ(Δμ/c).
pub fn win_probability(a: Rating, b: Rating, cfg: &TrueSkillConfig) -> f64 {
    cdf((a.mu - b.mu - draw_margin(cfg)) / performance_scale(a, b, cfg))
}

/// TrueSkill's match quality for 1v1, √(2β²/c²)·exp(−Δμ²/(2c²)): the draw
/// likelihood relative to that of two equal, exactly known players. In (0, 1];
/// it falls with the skill gap and also with the players' uncertainty.
pub fn match_quality(a: Rating, b: Rating, cfg: &TrueSkillConfig) -> f64 {
    let c = performance_scale(a, b, cfg);
    let gap = (a.mu - b.mu) / c;
    (2.0f64.sqrt() * cfg.beta / c) * (-0.5 * gap * gap).exp()
}

/// Whether attempt `k` (0-based) of `attempts` is a solve when `solved` of them
/// are. Solves are spread evenly (Bresenham), e.g. 3 of 8: `..S..S.S`, so the
/// order of sequential updates favours neither side.
pub fn attempt_solved(k: usize, solved: usize, attempts: usize) -> bool {
    (k + 1) * solved / attempts > k * solved / attempts
}

/// Rates one problem: the teacher proposed it, the student solved `solved` of
/// `attempts` samples. Each attempt is one game (the teacher wins when the
/// student fails), applied in [`attempt_solved`] order.
///
/// Dynamics (tau) apply once per problem, not per attempt: the attempts are
/// simultaneous, so the skills had no time to drift between them. No attempts:
/// nothing changes.
///
/// The attempts share one problem, so they are not independent games; treating
/// them as such makes sigma shrink faster than the evidence warrants. tau keeps
/// ratings mobile regardless.
pub fn record_problem(
    teacher: &mut Rating,
    student: &mut Rating,
    solved: usize,
    attempts: usize,
    cfg: &TrueSkillConfig,
) -> Result<(), RatingError> {
    if solved > attempts {
        return Err(RatingError::SolvedExceedsAttempts { solved, attempts });
    }
    if attempts == 0 {
        return Ok(());
    }
    let (mut t, mut s) = (
        teacher.with_dynamics(cfg.tau),
        student.with_dynamics(cfg.tau),
    );
    let still = TrueSkillConfig { tau: 0.0, ..*cfg };
    for k in 0..attempts {
        if attempt_solved(k, solved, attempts) {
            (s, t) = update(s, t, &still);
        } else {
            (t, s) = update(t, s, &still);
        }
    }
    (*teacher, *student) = (t, s);
    Ok(())
}
