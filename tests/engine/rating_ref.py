"""Reference numbers for tests/rating.rs.

Two independent sources:
  * the reference `trueskill` 0.4.5 package (factor graph, its own erfcc ~1e-7),
  * a closed-form 1v1 TrueSkill in mpmath at 50 digits (exact up to rounding).

Run: python -m venv v && v/bin/pip install trueskill==0.4.5 mpmath && v/bin/python rating_ref.py
"""
import trueskill as ts
from mpmath import mp, mpf, sqrt, erfc, exp, pi, erfinv

mp.dps = 50
MU, SIGMA, BETA, TAU = mpf(25), mpf(25) / 3, mpf(25) / 6, mpf(25) / 300


def pdf(x):
    return exp(-x * x / 2) / sqrt(2 * pi)


def cdf(x):
    return erfc(-x / sqrt(2)) / 2


def margin(p_draw):
    return sqrt(2) * BETA * sqrt(2) * erfinv(mpf(p_draw))  # ppf((p+1)/2) = sqrt2*erfinv(p)


def rate(a, b, p_draw, drawn, tau=TAU, beta=BETA):
    (ma, sa), (mb, sb) = a, b
    va, vb = sa**2 + tau**2, sb**2 + tau**2
    c = sqrt(2 * beta**2 + va + vb)
    t, e = (ma - mb) / c, margin(p_draw) / c
    if drawn:
        den = cdf(e - t) - cdf(-e - t)
        v = (pdf(-e - t) - pdf(e - t)) / den
        w = v * v + ((e - t) * pdf(e - t) + (e + t) * pdf(e + t)) / den
    else:
        v = pdf(t - e) / cdf(t - e)
        w = v * (v + t - e)
    na = (ma + va / c * v, sqrt(va * (1 - va / c**2 * w)))
    nb = (mb - vb / c * v, sqrt(vb * (1 - vb / c**2 * w)))
    return na, nb


def show(label, pair):
    print(label, ", ".join(f"({mp.nstr(m, 17)}, {mp.nstr(s, 17)})" for m, s in pair))


fresh = (MU, SIGMA)
for p in (0.1, 0.0):
    env = ts.TrueSkill(draw_probability=p)
    show(f"mpmath  win  p_draw={p}:", rate(fresh, fresh, p, False))
    r = env.rate_1vs1(env.create_rating(), env.create_rating())
    print(f"package win  p_draw={p}:", [(x.mu, x.sigma) for x in r])
env = ts.TrueSkill(draw_probability=0.1)
show("mpmath  draw p_draw=0.1:", rate(fresh, fresh, 0.1, True))
r = env.rate_1vs1(env.create_rating(), env.create_rating(), drawn=True)
print("package draw p_draw=0.1:", [(x.mu, x.sigma) for x in r])

# Unequal players: strong (30, 4) vs weak (20, 6).
strong, weak = (mpf(30), mpf(4)), (mpf(20), mpf(6))
for p in (0.0, 0.1):
    env = ts.TrueSkill(draw_probability=p)
    S, W = env.create_rating(30, 4), env.create_rating(20, 6)
    show(f"mpmath  upset p_draw={p} (weak wins):", rate(weak, strong, p, False))
    print(f"package upset p_draw={p}:", [(x.mu, x.sigma) for x in env.rate_1vs1(W, S)])
    show(f"mpmath  expected p_draw={p} (strong wins):", rate(strong, weak, p, False))
env = ts.TrueSkill(draw_probability=0.1)
show("mpmath  draw strong/weak p_draw=0.1:", rate(strong, weak, 0.1, True))
S, W = env.create_rating(30, 4), env.create_rating(20, 6)
print("package draw strong/weak:", [(x.mu, x.sigma) for x in env.rate_1vs1(S, W, drawn=True)])

# Quality and win probability (no dynamics).
env = ts.TrueSkill(draw_probability=0.0)
c = sqrt(2 * BETA**2 + 4**2 + 6**2)
print("mpmath  quality strong/weak:", mp.nstr(sqrt(2 * BETA**2 / c**2) * exp(-(10**2) / (2 * c**2)), 17))
print("package quality strong/weak:", env.quality_1vs1(env.create_rating(30, 4), env.create_rating(20, 6)))
print("mpmath  quality fresh:", mp.nstr(sqrt(2 * BETA**2 / (2 * BETA**2 + 2 * SIGMA**2)), 17))
print("mpmath  P(strong beats weak):", mp.nstr(cdf(10 / c), 17))
print("mpmath  P(strong beats weak), p_draw=0.1:", mp.nstr(cdf((10 - margin(0.1)) / c), 17))
print("mpmath  draw margin p_draw=0.1:", mp.nstr(margin(0.1), 17))

# erfc and inverse normal cdf samples.
for x in (-3, -0.5, -1e-3, 0, 0.3, 0.46875, 0.5, 1, 2.5, 4, 4.5, 10, 26):
    print(f"erfc({x}) =", mp.nstr(erfc(mpf(x)), 20))
for x in (0.5, 5, 30, 1e3, 1e8):
    print(f"erfcx({x}) =", mp.nstr(exp(mpf(x) ** 2) * erfc(mpf(x)), 20))
for p in (0.5, 0.55, 0.9, 0.999, 1 - 1e-12, 0.01):
    p = mpf(p)  # the exact f64 value the Rust test passes
    print(f"ppf({mp.nstr(p, 20)}) =", mp.nstr(sqrt(2) * erfinv(2 * p - 1), 20))
# Far-tail v, w for the win case, x = t - eps.
for x in (-40, -10, 0, 10):
    x = mpf(x)
    v = pdf(x) / cdf(x)
    print(f"v_win({x}) =", mp.nstr(v, 20), " w_win =", mp.nstr(v * (v + x), 20))
# Far-tail inverse: Φ(x) = 1e-300.
from mpmath import findroot, log
p = mpf(1e-300)
print("ppf(1e-300) =", mp.nstr(findroot(lambda x: log(cdf(x)) - log(p), -37), 20))
