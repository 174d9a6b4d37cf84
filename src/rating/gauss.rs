//! The standard normal distribution in plain `f64`, and TrueSkill's truncated
//! Gaussian corrections `v` and `w`.
//!
//! `erfc` is W. J. Cody's rational Chebyshev approximation ("Rational Chebyshev
//! approximations for the error function", Math. Comp. 23, 1969; the SPECFUN
//! routine CALERF), relative error about 1e-16 in IEEE double. Cody's middle and
//! tail intervals compute the scaled `erfcx(x) = exp(x²)·erfc(x)` directly, which
//! lets `v` and `w` stay finite and accurate far into the tails, where `Φ`
//! itself underflows but the ratio `φ/Φ` does not.

use std::f64::consts::{FRAC_1_SQRT_2, FRAC_2_SQRT_PI, PI};

/// 1/√π.
const FRAC_1_SQRT_PI: f64 = FRAC_2_SQRT_PI / 2.0;

/// Cody's first interval, `|x| <= 0.46875`: erf(x) = x·A(x²)/B(x²).
const THRESH: f64 = 0.46875;
/// Beyond this, erfcx(x) = 1/(x√π) to double precision.
const XHUGE: f64 = 6.71e7;

// Coefficients as published by Cody, kept digit for digit so they can be audited.
#[allow(clippy::excessive_precision)]
const A: [f64; 5] = [
    3.16112374387056560e00,
    1.13864154151050156e02,
    3.77485237685302021e02,
    3.20937758913846947e03,
    1.85777706184603153e-1,
];
#[allow(clippy::excessive_precision)]
const B: [f64; 4] = [
    2.36012909523441209e01,
    2.44024637934444173e02,
    1.28261652607737228e03,
    2.84423683343917062e03,
];
/// Second interval, `0.46875 < x <= 4`: erfcx(x) = C(x)/D(x).
#[allow(clippy::excessive_precision)]
const C: [f64; 9] = [
    5.64188496988670089e-1,
    8.88314979438837594e00,
    6.61191906371416295e01,
    2.98635138197400131e02,
    8.81952221241769090e02,
    1.71204761263407058e03,
    2.05107837782607147e03,
    1.23033935479799725e03,
    2.15311535474403846e-8,
];
#[allow(clippy::excessive_precision)]
const D: [f64; 8] = [
    1.57449261107098347e01,
    1.17693950891312499e02,
    5.37181101862009858e02,
    1.62138957456669019e03,
    3.29079923573345963e03,
    4.36261909014324716e03,
    3.43936767414372164e03,
    1.23033935480374942e03,
];
/// Third interval, `x > 4`: erfcx(x) = (1/√π − z·P(z)/Q(z))/x with z = 1/x².
#[allow(clippy::excessive_precision)]
const P: [f64; 6] = [
    3.05326634961232344e-1,
    3.60344899949804439e-1,
    1.25781726111229246e-1,
    1.60837851487422766e-2,
    6.58749161529837803e-4,
    1.63153871373020978e-2,
];
#[allow(clippy::excessive_precision)]
const Q: [f64; 5] = [
    2.56852019228982242e00,
    1.87295284992346047e00,
    5.27905102951428412e-1,
    6.05183413124413191e-2,
    2.33520497626869185e-3,
];

/// erf(x) for `|x| <= THRESH`.
fn erf_small(x: f64) -> f64 {
    let z = x * x;
    let (mut num, mut den) = (A[4] * z, z);
    for (a, b) in A[..3].iter().zip(&B[..3]) {
        num = (num + a) * z;
        den = (den + b) * z;
    }
    x * (num + A[3]) / (den + B[3])
}

/// erfcx(y) for `y > THRESH`.
fn erfcx_tail(y: f64) -> f64 {
    if y <= 4.0 {
        let (mut num, mut den) = (C[8] * y, y);
        for (c, d) in C[..7].iter().zip(&D[..7]) {
            num = (num + c) * y;
            den = (den + d) * y;
        }
        (num + C[7]) / (den + D[7])
    } else if y >= XHUGE {
        // Also keeps 1/y² from underflowing to 0 and turning P/Q into 0/0.
        FRAC_1_SQRT_PI / y
    } else {
        let z = 1.0 / (y * y);
        let (mut num, mut den) = (P[5] * z, z);
        for (p, q) in P[..4].iter().zip(&Q[..4]) {
            num = (num + p) * z;
            den = (den + q) * z;
        }
        (FRAC_1_SQRT_PI - z * (num + P[4]) / (den + Q[4])) / y
    }
}

/// exp(−y²), splitting y = head + rest so the rounding error of y² (up to ~1e-13
/// relative near y = 26) does not reach the exponent.
fn exp_neg_sq(y: f64) -> f64 {
    let head = (y * 16.0).trunc() / 16.0;
    let rest = (y - head) * (y + head);
    (-head * head).exp() * (-rest).exp()
}

/// The complementary error function, erfc(x) = 1 − erf(x).
pub fn erfc(x: f64) -> f64 {
    let y = x.abs();
    if y <= THRESH {
        return 1.0 - erf_small(x);
    }
    let upper = exp_neg_sq(y) * erfcx_tail(y);
    if x < 0.0 {
        2.0 - upper
    } else {
        upper
    }
}

/// The scaled complementary error function, erfcx(x) = exp(x²)·erfc(x).
/// Accurate for all x ≥ 0; overflows to +∞ below about −26.6.
pub fn erfcx(x: f64) -> f64 {
    if x.abs() <= THRESH {
        (x * x).exp() * (1.0 - erf_small(x))
    } else if x > 0.0 {
        erfcx_tail(x)
    } else {
        2.0 / exp_neg_sq(-x) - erfcx_tail(-x)
    }
}

/// The standard normal density φ(x).
pub fn pdf(x: f64) -> f64 {
    (-0.5 * x * x).exp() / (2.0 * PI).sqrt()
}

/// The standard normal distribution function Φ(x).
pub fn cdf(x: f64) -> f64 {
    0.5 * erfc(-x * FRAC_1_SQRT_2)
}

/// Φ(x)/φ(x) for x ≤ 0 (the Mills ratio of −x), without forming either factor,
/// so it stays finite where both underflow.
fn cdf_over_pdf(x: f64) -> f64 {
    (PI / 2.0).sqrt() * erfcx(-x * FRAC_1_SQRT_2)
}

/// The inverse of Φ. Returns ∓∞ at 0 and 1, NaN outside [0, 1].
///
/// Newton's method on ln Q(x) = ln(1 − Φ(x)), which is concave: started at
/// √(−2 ln q), to the right of the root since Q(x) ≤ e^(−x²/2)/2, it decreases
/// monotonically onto the root, quadratically, for any tail mass q down to the
/// smallest f64. Accuracy is that of `erfcx` (~1e-16 relative).
pub fn ppf(p: f64) -> f64 {
    if !(0.0..=1.0).contains(&p) {
        return f64::NAN;
    }
    if p == 0.5 {
        return 0.0;
    }
    // Solve in the upper tail: x = Q⁻¹(q) with q = min(p, 1 − p).
    let q = p.min(1.0 - p);
    if q == 0.0 {
        return if p == 0.0 {
            f64::NEG_INFINITY
        } else {
            f64::INFINITY
        };
    }
    let ln_q = q.ln();
    let mut x = (-2.0 * ln_q).sqrt();
    for _ in 0..100 {
        // ln Q(x) = ln(erfcx(x/√2)/2) − x²/2, and d/dx ln Q(x) = −1/Mills(x).
        let scaled = erfcx(x * FRAC_1_SQRT_2);
        let ln_tail = (0.5 * scaled).ln() - 0.5 * x * x;
        let next = x + (ln_tail - ln_q) * (PI / 2.0).sqrt() * scaled;
        // The iterates decrease; once rounding stops that, we are at the root.
        if next >= x {
            break;
        }
        x = next;
    }
    if p < 0.5 {
        -x
    } else {
        x
    }
}

/// TrueSkill's `v` for a win: the mean shift E[X − x | X > 0] of a unit Gaussian
/// X ~ N(x, 1) truncated to X > 0, i.e. φ(x)/Φ(x), where x = (Δμ − ε)/c.
pub fn v_win(x: f64) -> f64 {
    if x >= 0.0 {
        pdf(x) / cdf(x)
    } else {
        1.0 / cdf_over_pdf(x)
    }
}

/// TrueSkill's `w` for a win: the variance reduction 1 − Var[X | X > 0] = v(v + x).
pub fn w_win(x: f64) -> f64 {
    let v = v_win(x);
    // The exact value lies in (0, 1). Far in the left tail v + x cancels and
    // rounding could leave the interval; w > 1 would make a variance negative.
    (v * (v + x)).clamp(0.0, 1.0)
}

/// TrueSkill's `v` for a draw: the mean shift of N(t, 1) truncated to |X| ≤ e.
/// Odd in t (it pulls the leader back); e = 0 gives the limit −t.
pub fn v_draw(t: f64, e: f64) -> f64 {
    let (v, _) = draw_moments(t.abs(), e);
    if t < 0.0 {
        -v
    } else {
        v
    }
}

/// TrueSkill's `w` for a draw: the variance reduction of N(t, 1) truncated to
/// |X| ≤ e. Even in t; e = 0 gives the limit 1.
pub fn w_draw(t: f64, e: f64) -> f64 {
    draw_moments(t.abs(), e).1
}

/// (v, w) of N(t, 1) truncated to [−e, e], for t ≥ 0. Shifting by t, that is a
/// unit Gaussian truncated to [lo, hi] = [−e − t, e − t]:
/// v = (φ(lo) − φ(hi))/Z, w = v² + (hi·φ(hi) − lo·φ(lo))/Z, Z = Φ(hi) − Φ(lo).
fn draw_moments(t: f64, e: f64) -> (f64, f64) {
    // Zero margin: the draw pins the performances equal.
    let pinned = (-t, 1.0);
    if e <= 0.0 {
        return pinned;
    }
    let (lo, hi) = (-e - t, e - t);
    let (dv, dw, z) = if hi >= 0.0 {
        (
            pdf(lo) - pdf(hi),
            hi * pdf(hi) - lo * pdf(lo),
            cdf(hi) - cdf(lo),
        )
    } else {
        // Both ends in the left tail: divide every term by φ(hi) so nothing
        // underflows. φ(lo)/φ(hi) = exp(−2et) and Φ(x)/φ(x) is the Mills ratio.
        let r = (-2.0 * e * t).exp();
        (
            r - 1.0,
            hi - lo * r,
            cdf_over_pdf(hi) - r * cdf_over_pdf(lo),
        )
    };
    // A margin so small that Z rounds to zero behaves like no margin at all.
    if z.is_nan() || z <= 0.0 {
        return pinned;
    }
    let v = dv / z;
    (v, (v * v + dw / z).clamp(0.0, 1.0))
}
