#!/usr/bin/env python3
"""Self-play dynamics of a run, from its metrics.jsonl, as BENCHMARKS.md reports them.

Usage: scripts/selfplay-windows.py RUN_DIR [EVERY=8] [COMPARE=14]

Prints one Markdown row per window of EVERY steps (valid and learnable
proposals, solve rate per task kind, share of proposer and solver rollouts
with a non-zero advantage, teacher program size, rating spread),
then the last COMPARE steps against the first COMPARE with 95 % bootstrap
intervals (10,000 resamples, fixed seed).
"""
import random
import statistics as st
import sys

from selfplay_metrics import KINDS, load_rows, nonzero_share, rating_spread, solve_rates


def windows(rows, every):
    print("| steps | valid / proposed | learnable per step | solve rate ded / abd / ind "
          "| non-zero advantage proposer / solver "
          "| mean AST nodes | mean cyclomatic | μ spread (max − min) | mean σ at end | step s (median) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i in range(0, len(rows), every):
        part = rows[i:i + every]
        valid = sum(d["proposals"]["valid"] for d in part)
        total = sum(d["proposals"]["total"] for d in part)
        learnable = st.mean(d["proposals"].get("learnable", 0) for d in part)
        progs = [p for d in part for p in d["programs"]] or [{"ast_nodes": 0, "cyclomatic": 0}]
        spread = st.mean(rating_spread(d) for d in part)
        sigma = st.mean(m["rating"]["sigma"] for m in part[-1]["members"])
        solve = " / ".join(fmt(solve_rates(part, k)) for k in KINDS)
        signal = " / ".join(nonzero_share(part, role) for role in ("proposer", "solver"))
        steps = f"{part[0]['step']}" if len(part) == 1 else f"{part[0]['step']}–{part[-1]['step']}"
        print(f"| {steps} | {valid}/{total} ({valid / max(total, 1):.0%}) "
              f"| {learnable:.2f} | {solve} | {signal} | {st.mean(p['ast_nodes'] for p in progs):.1f} "
              f"| {st.mean(p['cyclomatic'] for p in progs):.2f} | {spread:.1f} | {sigma:.2f} "
              f"| {st.median(d['wall_ms'] / 1000 for d in part):.0f} |")


def fmt(xs):
    return f"{st.mean(xs):.2f}" if xs else "-"


def interval(xs, ys, rng, n=10000):
    """Mean of ys minus mean of xs, with a 95 % percentile bootstrap interval."""
    if not xs or not ys:
        return "no data"
    diffs = sorted(st.mean(rng.choices(ys, k=len(ys))) - st.mean(rng.choices(xs, k=len(xs)))
                   for _ in range(n))
    return f"{st.mean(ys) - st.mean(xs):+.3f} [{diffs[int(0.025 * n)]:+.3f}, {diffs[int(0.975 * n)]:+.3f}]"


def compare(rows, count):
    first, last = rows[:count], rows[-count:]
    rng = random.Random(0)
    ast = lambda part: [p["ast_nodes"] for d in part for p in d["programs"]]
    valid = lambda part: [int(i < d["proposals"]["valid"]) for d in part
                          for i in range(d["proposals"]["total"])]
    print(f"\nsteps {last[0]['step']}–{last[-1]['step']} against {first[0]['step']}–{first[-1]['step']}:")
    print("  AST nodes of valid programs:", interval(ast(first), ast(last), rng))
    print("  valid-proposal rate:", interval(valid(first), valid(last), rng))
    for kind in KINDS:
        print(f"  {kind} solve rate (per step):", interval(solve_rates(first, kind), solve_rates(last, kind), rng))


def main():
    run = sys.argv[1]
    every = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 14
    rows = load_rows(run)
    windows(rows, every)
    compare(rows, count)


if __name__ == "__main__":
    main()
