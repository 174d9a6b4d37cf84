//! Tests for `populora::rating`.
//!
//! Reference numbers come from `tests/rating_ref.py`: "mpmath" values are the
//! closed-form 1v1 TrueSkill evaluated at 50 digits (exact for our purposes);
//! "package" values come from the reference Python `trueskill` 0.4.5, whose own
//! erfc approximation is good to ~1e-7, hence its looser tolerance.

// Reference values keep the digits mpmath printed, so they can be compared by eye.
#![allow(clippy::excessive_precision)]

use populora::rating::gauss::{erfc, erfcx, ppf, v_draw, v_win, w_draw, w_win};
use populora::rating::{
    attempt_solved, draw_margin, match_quality, match_teachers, pfsp_weight, record_problem,
    update, update_draw, win_probability, MatchConfig, MatchError, Pairing, PfspWeight, Player,
    Rating, RatingError, TrueSkillConfig,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::f64::consts::FRAC_2_PI;

fn close(got: f64, want: f64, tol: f64) {
    let err = (got - want).abs() / want.abs().max(1.0);
    assert!(
        err <= tol,
        "got {got}, want {want} (rel err {err:e} > {tol:e})"
    );
}

fn close_rating(got: Rating, want: (f64, f64), tol: f64) {
    close(got.mu, want.0, tol);
    close(got.sigma, want.1, tol);
}

fn with_draws(p: f64) -> TrueSkillConfig {
    TrueSkillConfig {
        draw_probability: p,
        ..TrueSkillConfig::default()
    }
}

// ---------------------------------------------------------------- gauss

#[test]
fn erfc_matches_mpmath() {
    let cases = [
        (-3.0, 1.9999779095030014146),
        (-0.5, 1.5204998778130465377),
        (-1e-3, 1.0011283787909692364),
        (0.0, 1.0),
        (0.3, 0.67137324054087258381),
        (0.46875, 0.50738652678206200841),
        (0.5, 0.47950012218695346232),
        (1.0, 0.15729920705028513066),
        (2.5, 0.00040695201744495893956),
        (4.0, 1.5417257900280018852e-8),
        (4.5, 1.9661604415428874763e-10),
        (10.0, 2.088487583762544757e-45),
        (26.0, 5.6631924088561428465e-296),
    ];
    for (x, want) in cases {
        let err = (erfc(x) - want).abs() / want;
        assert!(
            err < 1e-14,
            "erfc({x}) = {}, want {want}, rel err {err:e}",
            erfc(x)
        );
    }
    assert_eq!(erfc(40.0), 0.0);
    assert_eq!(erfc(-40.0), 2.0);
}

#[test]
fn erfcx_matches_mpmath_in_far_tail() {
    let cases = [
        (0.5, 0.61569034419292587487),
        (5.0, 0.11070463773306862637),
        (30.0, 0.018795888861416751497),
        (1e3, 0.0005641893014533876542),
        (1e8, 5.6418958354775625874e-9),
    ];
    for (x, want) in cases {
        let err = (erfcx(x) - want).abs() / want;
        assert!(
            err < 1e-14,
            "erfcx({x}) = {}, want {want}, rel err {err:e}",
            erfcx(x)
        );
    }
}

#[test]
fn ppf_matches_mpmath() {
    let cases = [
        (0.5, 0.0),
        (0.55, 0.12566134685507414641),
        (0.9, 1.2815515655446005935),
        (0.999, 3.0902323061678132778),
        (1.0 - 1e-12, 7.0344869100478352057),
        (0.01, -2.3263478740408410931),
    ];
    for (p, want) in cases {
        close(ppf(p), want, 1e-13);
    }
    assert_eq!(ppf(0.0), f64::NEG_INFINITY);
    assert_eq!(ppf(1.0), f64::INFINITY);
    assert!(ppf(1.5).is_nan());
    // The far tail, where Φ itself would underflow in a naive inversion.
    close(ppf(1e-300), -37.047096299361199237, 1e-13);
}

#[test]
fn v_w_stay_accurate_in_the_tails() {
    // (x, v, w) from mpmath.
    let cases = [
        (-40.0, 40.024968847207263723, 0.99937733162140861123),
        (-10.0, 10.098093233962511963, 0.99055462217434373884),
        (0.0, 0.79788456080286535588, FRAC_2_PI), // w(0) = 2/π
        (10.0, 7.6945986267064193463e-23, 7.6945986267064193463e-22),
    ];
    for (x, v, w) in cases {
        close(v_win(x), v, 1e-13);
        close(w_win(x), w, 1e-12);
    }
    // Beyond any realistic gap: finite, and w in [0, 1].
    for x in [-1e9, -1e300, 1e300] {
        assert!(
            v_win(x).is_finite() && (0.0..=1.0).contains(&w_win(x)),
            "x = {x}"
        );
    }
}

#[test]
fn draw_corrections_are_odd_and_even_and_finite() {
    for (t, e) in [(0.3, 0.2), (5.0, 0.1), (60.0, 0.5), (1e6, 1e-3), (0.0, 0.7)] {
        assert_eq!(v_draw(-t, e), -v_draw(t, e));
        assert_eq!(w_draw(-t, e), w_draw(t, e));
        assert!(
            v_draw(t, e).is_finite() && (0.0..=1.0).contains(&w_draw(t, e)),
            "t={t} e={e}"
        );
    }
    // Zero margin: the limit (−t, 1).
    assert_eq!((v_draw(2.0, 0.0), w_draw(2.0, 0.0)), (-2.0, 1.0));
}

// ---------------------------------------------------------------- TrueSkill

#[test]
fn fresh_players_match_reference_package_with_draw_probability_0_1() {
    // The textbook example: 25 ± 8.333 vs 25 ± 8.333 → 29.396 ± 7.171 / 20.604 ± 7.171.
    let cfg = with_draws(0.1);
    let fresh = Rating::fresh(&cfg);
    let (w, l) = update(fresh, fresh, &cfg);
    // mpmath, exact.
    close_rating(w, (29.395831692991513, 7.1714758070092207), 1e-12);
    close_rating(l, (20.604168307008487, 7.1714758070092207), 1e-12);
    // The package, to its accuracy.
    close_rating(w, (29.39583201999916, 7.171475587326195), 1e-7);
    close_rating(l, (20.604167980000835, 7.171475587326195), 1e-7);
    close(draw_margin(&cfg), 0.74046658745214743, 1e-13);
}

#[test]
fn fresh_players_without_draws() {
    // populora's default (no draws). mpmath; package: (29.205473106813677, 7.194816551480743).
    let cfg = TrueSkillConfig::default();
    let fresh = Rating::fresh(&cfg);
    let (w, l) = update(fresh, fresh, &cfg);
    close_rating(w, (29.205473176557785, 7.1948164848133452), 1e-12);
    close_rating(l, (20.794526823442215, 7.1948164848133452), 1e-12);
    close_rating(w, (29.205473106813677, 7.194816551480743), 1e-7);
    assert_eq!(draw_margin(&cfg), 0.0);
}

#[test]
fn unequal_players_match_mpmath_and_package() {
    let (strong, weak) = (Rating::new(30.0, 4.0), Rating::new(20.0, 6.0));
    let cfg = TrueSkillConfig::default();
    // Upset (weak wins); package: (26.126053541721962, 4.889747240395516), (27.27665315069062, ...).
    let (w, s) = update(weak, strong, &cfg);
    close_rating(w, (26.126053847253964, 4.8897469296952348), 1e-12);
    close_rating(s, (27.276653014865885, 3.6900133037190494), 1e-12);
    // Expected result (strong wins).
    let (s, w) = update(strong, weak, &cfg);
    close_rating(s, (30.448754383719376, 3.8700643833747394), 1e-12);
    close_rating(w, (18.990545995841665, 5.5495386650201538), 1e-12);

    let cfg = with_draws(0.1);
    let (w, s) = update(weak, strong, &cfg);
    close_rating(w, (26.376164745356731, 4.8765718597740889), 1e-12);
    close_rating(s, (27.165465817155783, 3.6865660508297626), 1e-12);
    let (s, w) = update(strong, weak, &cfg);
    close_rating(s, (30.497985194059897, 3.8610860688541557), 1e-12);
    close_rating(w, (18.879803370411903, 5.5178027302194354), 1e-12);
}

#[test]
fn draws_match_mpmath_and_package() {
    let cfg = with_draws(0.1);
    let fresh = Rating::fresh(&cfg);
    let (a, b) = update_draw(fresh, fresh, &cfg);
    close_rating(a, (25.0, 6.4575156832450505), 1e-12);
    close_rating(b, (25.0, 6.4575156832450505), 1e-12);
    // The package, with its ~1e-7 erfc and ppf: (25, 6.457519662317322).
    close_rating(a, (25.0, 6.457519662317322), 1e-6);

    let (s, w) = update_draw(Rating::new(30.0, 4.0), Rating::new(20.0, 6.0), &cfg);
    close_rating(s, (28.158407103151938, 3.6137391853615269), 1e-12);
    close_rating(w, (24.142585323278613, 4.5924644794275704), 1e-12);
    // Package: (28.158407036637964, 3.613739154249254), (24.142585472898993, 4.5924643555483655).
    close_rating(s, (28.158407036637964, 3.613739154249254), 1e-7);
}

#[test]
fn draw_without_draw_probability_takes_the_zero_margin_limit() {
    let cfg = TrueSkillConfig::default();
    let (a, b) = update_draw(Rating::new(30.0, 4.0), Rating::new(20.0, 6.0), &cfg);
    assert!(a.mu < 30.0 && b.mu > 20.0 && a.sigma < 4.1 && b.sigma < 6.0);
    assert!(
        a.mu > b.mu,
        "a draw pulls the means together, not past each other"
    );
}

#[test]
fn quality_and_win_probability() {
    let (strong, weak) = (Rating::new(30.0, 4.0), Rating::new(20.0, 6.0));
    let cfg = TrueSkillConfig::default();
    // mpmath 0.35550405378876959; package quality_1vs1: 0.35550405378876976.
    close(
        match_quality(strong, weak, &cfg),
        0.35550405378876959,
        1e-14,
    );
    close(
        match_quality(weak, strong, &cfg),
        0.35550405378876959,
        1e-14,
    );
    let fresh = Rating::fresh(&cfg);
    close(
        match_quality(fresh, fresh, &cfg),
        0.44721359549995794,
        1e-14,
    );
    close(
        win_probability(strong, weak, &cfg),
        0.85855015368755969,
        1e-14,
    );
    close(
        win_probability(weak, strong, &cfg),
        1.0 - 0.85855015368755969,
        1e-13,
    );
    close(win_probability(fresh, fresh, &cfg), 0.5, 1e-15);
    // With draws: P(win) excludes the draw band.
    close(
        win_probability(strong, weak, &with_draws(0.1)),
        0.8399651839229654,
        1e-14,
    );
}

#[test]
fn config_defaults_and_validation() {
    let cfg = TrueSkillConfig::default();
    assert_eq!(
        (cfg.mu0, cfg.sigma0, cfg.beta, cfg.tau),
        (25.0, 25.0 / 3.0, 25.0 / 6.0, 25.0 / 300.0)
    );
    assert_eq!(cfg.draw_probability, 0.0);
    assert!(cfg.validate().is_ok());
    for bad in [
        TrueSkillConfig { beta: 0.0, ..cfg },
        TrueSkillConfig {
            sigma0: f64::NAN,
            ..cfg
        },
        TrueSkillConfig { tau: -1.0, ..cfg },
        TrueSkillConfig {
            draw_probability: 1.0,
            ..cfg
        },
    ] {
        assert!(
            matches!(bad.validate(), Err(RatingError::InvalidConfig(_))),
            "{bad:?}"
        );
    }
    assert_eq!(Rating::fresh(&cfg).conservative(), 0.0);
}

// ---------------------------------------------------------------- problems

#[test]
fn solves_are_spread_evenly_over_attempts() {
    let pattern: String = (0..8)
        .map(|k| if attempt_solved(k, 3, 8) { 'S' } else { '.' })
        .collect();
    assert_eq!(pattern, "..S..S.S");
    assert!((0..5).all(|k| attempt_solved(k, 5, 5)));
    assert!((0..5).all(|k| !attempt_solved(k, 0, 5)));
    for (solved, n) in [(1, 7), (4, 8), (6, 8), (2, 3)] {
        assert_eq!(
            (0..n).filter(|&k| attempt_solved(k, solved, n)).count(),
            solved
        );
    }
}

#[test]
fn record_problem_is_one_game_per_attempt_with_dynamics_once() {
    let cfg = TrueSkillConfig::default();
    let (t0, s0) = (Rating::new(27.0, 5.0), Rating::new(24.0, 6.0));
    let (mut t, mut s) = (t0, s0);
    record_problem(&mut t, &mut s, 3, 8, &cfg).unwrap();

    // By hand: tau once, then eight tau-free games in the order ..S..S.S.
    let still = TrueSkillConfig { tau: 0.0, ..cfg };
    let (mut te, mut se) = (t0.with_dynamics(cfg.tau), s0.with_dynamics(cfg.tau));
    for solved in [false, false, true, false, false, true, false, true] {
        if solved {
            (se, te) = update(se, te, &still);
        } else {
            (te, se) = update(te, se, &still);
        }
    }
    assert_eq!((t, s), (te, se));
    assert!(t.sigma < t0.sigma && s.sigma < s0.sigma);
}

#[test]
fn record_problem_direction_and_edge_cases() {
    let cfg = TrueSkillConfig::default();
    let fresh = Rating::fresh(&cfg);
    let (mut t, mut s) = (fresh, fresh);
    record_problem(&mut t, &mut s, 8, 8, &cfg).unwrap();
    assert!(
        s.mu > 25.0 && t.mu < 25.0,
        "all solved: the student won every game"
    );

    let (mut t, mut s) = (fresh, fresh);
    record_problem(&mut t, &mut s, 0, 8, &cfg).unwrap();
    assert!(
        t.mu > 25.0 && s.mu < 25.0,
        "none solved: the teacher won every game"
    );

    let (mut t, mut s) = (fresh, fresh);
    record_problem(&mut t, &mut s, 0, 0, &cfg).unwrap();
    assert_eq!((t, s), (fresh, fresh), "no attempts, no update");

    let err = record_problem(&mut t, &mut s, 9, 8, &cfg).unwrap_err();
    assert_eq!(
        err,
        RatingError::SolvedExceedsAttempts {
            solved: 9,
            attempts: 8
        }
    );
    assert_eq!((t, s), (fresh, fresh), "an error leaves the ratings alone");
}

fn assert_sane(r: Rating, game: usize) {
    assert!(
        r.mu.is_finite() && r.sigma.is_finite() && r.sigma > 0.0,
        "game {game}: {r:?}"
    );
}

#[test]
fn ten_thousand_random_games_never_give_nan_or_bad_sigma() {
    for (seed, cfg) in [
        (1u64, TrueSkillConfig::default()),
        (2, with_draws(0.25)),
        (3, with_draws(0.001)),
    ] {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        // Include absurd ratings: huge gaps, tiny and huge sigmas.
        let mut players = vec![
            Rating::fresh(&cfg),
            Rating::new(1e4, 1e-6),
            Rating::new(-1e4, 1e-6),
            Rating::new(25.0, 1e4),
            Rating::new(0.0, 1e-300),
        ];
        players.extend(
            (0..5)
                .map(|_| Rating::new(rng.random_range(-50.0..100.0), rng.random_range(0.1..20.0))),
        );
        for game in 0..10_000 {
            let i = rng.random_range(0..players.len());
            let j = (i + rng.random_range(1..players.len())) % players.len();
            let (a, b) = (players[i], players[j]);
            let (a, b) = match rng.random_range(0..4) {
                0 => update(a, b, &cfg),
                1 => {
                    let (b, a) = update(b, a, &cfg);
                    (a, b)
                }
                2 => update_draw(a, b, &cfg),
                _ => {
                    let (mut a, mut b) = (a, b);
                    let attempts = rng.random_range(0..17);
                    let solved = rng.random_range(0..=attempts);
                    record_problem(&mut a, &mut b, solved, attempts, &cfg).unwrap();
                    (a, b)
                }
            };
            assert_sane(a, game);
            assert_sane(b, game);
            (players[i], players[j]) = (a, b);
        }
    }
}

#[test]
fn a_long_winning_streak_stays_finite() {
    // The same teacher beats the same student 10,000 times: the gap grows
    // without bound but v → 0 smoothly; sigma settles where tau balances w.
    let cfg = TrueSkillConfig::default();
    let (mut t, mut s) = (Rating::fresh(&cfg), Rating::fresh(&cfg));
    for game in 0..10_000 {
        (t, s) = update(t, s, &cfg);
        assert_sane(t, game);
        assert_sane(s, game);
    }
    assert!(t.mu > s.mu + 20.0);
    // ...and then one upset is a big but finite surprise.
    let (s2, t2) = update(s, t, &cfg);
    assert_sane(s2, 0);
    assert_sane(t2, 0);
    assert!(s2.mu > s.mu && t2.mu < t.mu);
}

// ---------------------------------------------------------------- matchmaking

fn player(id: &str, subpop: usize, mu: f64) -> Player {
    Player {
        id: id.into(),
        subpop,
        rating: Rating::new(mu, 3.0),
    }
}

/// Three subpops of two teachers and three students each, of spread skill.
fn population() -> (Vec<Player>, Vec<Player>) {
    let mut teachers = Vec::new();
    let mut students = Vec::new();
    for g in 0..3 {
        for k in 0..2 {
            teachers.push(player(
                &format!("t{g}{k}"),
                g,
                20.0 + 5.0 * k as f64 + g as f64,
            ));
        }
        for k in 0..3 {
            students.push(player(
                &format!("s{g}{k}"),
                g,
                15.0 + 5.0 * k as f64 + g as f64,
            ));
        }
    }
    (teachers, students)
}

fn run(teachers: &[Player], students: &[Player], per: usize, seed: u64) -> Vec<Pairing> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    match_teachers(teachers, students, per, &MatchConfig::default(), &mut rng).unwrap()
}

#[test]
fn same_seed_same_pairings_and_order_does_not_matter() {
    let (teachers, students) = population();
    let first = run(&teachers, &students, 3, 7);
    assert_eq!(first, run(&teachers, &students, 3, 7));
    assert_ne!(
        first,
        run(&teachers, &students, 3, 8),
        "a different seed should differ here"
    );

    // Reversed inputs: same pairings, output still in (the new) input order.
    let (rt, rs): (Vec<_>, Vec<_>) = (
        teachers.iter().rev().cloned().collect(),
        students.iter().rev().cloned().collect(),
    );
    let mut reversed = run(&rt, &rs, 3, 7);
    assert_eq!(reversed[0].teacher, "t21");
    reversed.reverse();
    assert_eq!(reversed, first);
}

#[test]
fn pairings_are_cross_subpop_distinct_and_complete() {
    let (teachers, students) = population();
    let subpop = |id: &str| students.iter().find(|s| s.id == id).unwrap().subpop;
    for seed in 0..200 {
        let pairings = run(&teachers, &students, 4, seed);
        assert_eq!(pairings.len(), teachers.len());
        for (p, t) in pairings.iter().zip(&teachers) {
            assert_eq!(p.teacher, t.id);
            assert_eq!(p.students.len(), 4);
            assert!(
                p.students.windows(2).all(|w| w[0] < w[1]),
                "sorted, distinct: {p:?}"
            );
            assert!(
                p.students.iter().all(|s| subpop(s) != t.subpop),
                "same subpop: {p:?}"
            );
        }
    }
    // Asking for every eligible student returns exactly those.
    let all = run(&teachers, &students, 6, 0);
    assert_eq!(all[0].students, ["s10", "s11", "s12", "s20", "s21", "s22"]);
}

#[test]
fn balanced_students_are_drawn_more_often_than_lopsided_ones() {
    let cfg = MatchConfig::default();
    let teacher = vec![player("t", 0, 25.0)];
    // Gaps 0, 5, 10, 40: weights 1, ~0.73, ~0.31, floor.
    let students = vec![
        player("even", 1, 25.0),
        player("near", 1, 30.0),
        player("far", 1, 15.0),
        player("absurd", 1, 65.0),
    ];
    let weights: Vec<f64> = students
        .iter()
        .map(|s| pfsp_weight(teacher[0].rating, s.rating, &cfg))
        .collect();
    assert!(weights.windows(2).all(|w| w[0] > w[1]), "{weights:?}");
    assert_eq!(weights[3], cfg.floor);

    let n = 20_000;
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    let mut counts = [0usize; 4];
    for _ in 0..n {
        let pick = &match_teachers(&teacher, &students, 1, &cfg, &mut rng).unwrap()[0].students[0];
        counts[students.iter().position(|s| &s.id == pick).unwrap()] += 1;
    }
    let total: f64 = weights.iter().sum();
    for (count, w) in counts.iter().zip(&weights) {
        // Within 5 standard deviations of the multinomial expectation.
        let p = w / total;
        let sd = (n as f64 * p * (1.0 - p)).sqrt();
        assert!(
            (*count as f64 - n as f64 * p).abs() < 5.0 * sd,
            "{counts:?} vs weights {weights:?}"
        );
    }
    assert!(
        counts[0] > counts[1] && counts[1] > counts[2] && counts[2] > counts[3],
        "{counts:?}"
    );
    assert!(counts[3] > 0, "the floor keeps lopsided pairs possible");
}

#[test]
fn quality_weighting_is_available() {
    let cfg = MatchConfig {
        weight: PfspWeight::Quality,
        ..MatchConfig::default()
    };
    let t = Rating::new(25.0, 3.0);
    let even = pfsp_weight(t, Rating::new(25.0, 3.0), &cfg);
    let far = pfsp_weight(t, Rating::new(35.0, 3.0), &cfg);
    assert!(even > far && far >= cfg.floor);
    close(
        even,
        match_quality(t, Rating::new(25.0, 3.0), &cfg.trueskill),
        1e-15,
    );
}

#[test]
fn load_penalty_spreads_students() {
    // Four identical teachers, four identical students: with the penalty each
    // student is picked once far more often than without it.
    let teachers: Vec<_> = (0..4).map(|k| player(&format!("t{k}"), 0, 25.0)).collect();
    let students: Vec<_> = (0..4).map(|k| player(&format!("s{k}"), 1, 25.0)).collect();
    let spread = |load_penalty: f64| {
        let cfg = MatchConfig {
            load_penalty,
            ..MatchConfig::default()
        };
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        (0..2_000)
            .filter(|_| {
                let pairings = match_teachers(&teachers, &students, 1, &cfg, &mut rng).unwrap();
                let mut picked: Vec<_> = pairings.iter().map(|p| p.students[0].clone()).collect();
                picked.sort();
                picked.dedup();
                picked.len() == 4
            })
            .count()
    };
    let (without, with) = (spread(0.0), spread(10.0));
    // Uniform: 4!/4⁴ ≈ 9% of steps cover every student.
    assert!(with > 3 * without, "with penalty {with}, without {without}");
}

#[test]
fn matching_errors_name_the_teacher_and_counts() {
    let (teachers, students) = population();
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let cfg = MatchConfig::default();
    let err = match_teachers(&teachers, &students, 7, &cfg, &mut rng).unwrap_err();
    assert_eq!(
        err,
        MatchError::TooFewStudents {
            teacher: "t00".into(),
            eligible: 6,
            needed: 7
        }
    );
    assert!(
        err.to_string().contains("t00")
            && err.to_string().contains('6')
            && err.to_string().contains('7')
    );

    let own: Vec<_> = students.iter().filter(|s| s.subpop == 1).cloned().collect();
    let err = match_teachers(&teachers[2..], &own, 1, &cfg, &mut rng).unwrap_err();
    assert_eq!(
        err,
        MatchError::NoEligibleStudents {
            teacher: "t10".into(),
            subpop: 1,
            students: 3
        }
    );

    let mut dup = students.clone();
    dup.push(students[4].clone());
    let err = match_teachers(&teachers, &dup, 1, &cfg, &mut rng).unwrap_err();
    assert_eq!(
        err,
        MatchError::DuplicateId {
            role: "student",
            id: "s11".into()
        }
    );

    let bad = MatchConfig { floor: 0.0, ..cfg };
    assert!(matches!(
        match_teachers(&teachers, &students, 1, &bad, &mut rng),
        Err(MatchError::InvalidConfig(_))
    ));

    // Zero students per teacher is fine, even with nobody eligible.
    let empty = match_teachers(&teachers[2..], &own, 0, &cfg, &mut rng).unwrap();
    assert!(empty.iter().all(|p| p.students.is_empty()));
}

#[test]
fn errors_consume_no_randomness() {
    let (teachers, students) = population();
    let mut a = ChaCha8Rng::seed_from_u64(3);
    let b = a.clone();
    assert!(match_teachers(&teachers, &students, 99, &MatchConfig::default(), &mut a).is_err());
    assert_eq!(a, b);
}
