#!/usr/bin/env python3
"""pass@1 of every row on every benchmark of one or more evaluations, with
95 % intervals from a bootstrap over problems, as a Markdown table.

    python3 scripts/eval-table.py OUT/eval/items.jsonl[.gz] [...] [--resamples N] [--seed S]

Each item is a problem's answers (its task id: a CRUXEval function's O and
I items are different benchmarks, so each benchmark resamples its own
problems); a row's score is the mean over problems of the share of its
samples that pass (greedy: one sample), and the interval the 2.5th and
97.5th percentiles of that mean over problems drawn with replacement,
from a seeded generator (the same files give the same table). A score of
0 has the degenerate interval [0, 0]: the table adds the rule-of-three
bound 3/n (95 % one-sided) there. HumanEval+ and MBPP+ rows also give the
base-inputs score (`base_passed`).
"""
import argparse
import gzip
import json
import random
from collections import defaultdict


def load(paths):
    """(benchmark, row) -> task -> [passed per sample]; the same for base."""
    scores, base = defaultdict(lambda: defaultdict(list)), defaultdict(lambda: defaultdict(list))
    for path in paths:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as fh:
            for line in fh:
                r = json.loads(line)
                key = (r["benchmark"], r["member"])
                scores[key][r["task_id"]].append(r["passed"])
                if r.get("base_passed") is not None:
                    base[(r["benchmark"] + " base", r["member"])][r["task_id"]].append(r["base_passed"])
    scores.update(base)
    return scores


def interval(per_problem, resamples, rng):
    n = len(per_problem)
    estimate = sum(per_problem) / n
    means = sorted(sum(rng.choice(per_problem) for _ in range(n)) / n for _ in range(resamples))
    at = lambda q: means[min(len(means) - 1, round(q * (len(means) - 1)))]
    return estimate, at(0.025), at(0.975)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("items", nargs="+")
    parser.add_argument("--resamples", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("| benchmark | row | problems | pass@1 % | 95 % interval |")
    print("|---|---|---:|---:|---|")
    for (benchmark, row), tasks in load(args.items).items():
        per_problem = [sum(p) / len(p) for p in tasks.values()]
        rng = random.Random(f"{args.seed}/{benchmark}/{row}")
        estimate, low, high = interval(per_problem, args.resamples, rng)
        n = len(per_problem)
        spread = f"[{100 * low:.1f}, {100 * high:.1f}]"
        if estimate == 0:
            spread += f"; ≤ {100 * 3 / n:.1f} (3/n)"
        print(f"| {benchmark} | {row} | {n} | {100 * estimate:.1f} | {spread} |")


if __name__ == "__main__":
    main()
