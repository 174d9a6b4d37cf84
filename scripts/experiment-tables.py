#!/usr/bin/env python3
"""An experiment's result (`populora experiment ... --out DIR`, its experiment.json)
as the Markdown tables of a write-up: the compute of every run, then for each
matching the pooled differences with their 95 % intervals, then a row per seed;
then how far each arm moved from the untouched base model (from eval/items.jsonl): its
scores against the base model's, and the share of its answers identical to the base model's.

Usage: scripts/experiment-tables.py DIR [RESAMPLES=2000]

Scores are the reported problems' (the selection split only chooses best and
weakest); pooled scores are means over seeds, as the differences are.
"""
import json
import random
import statistics as st
import sys
from collections import defaultdict
from pathlib import Path

from selfplay_metrics import greedy_answers, identical_share, load_answers

BENCHMARKS = {
    "humaneval": "HumanEval pass@1",
    "humaneval-io-output": "HumanEval-IO output prediction",
    "humaneval-io-input": "HumanEval-IO input prediction",
    "cruxeval-i": "CRUXEval-I (input prediction)",
    "cruxeval-o": "CRUXEval-O (output prediction)",
}
MATCHINGS = {
    "per_adapter": "per adapter (baseline at one member's share of the compute: the paper's matching)",
    "total": "whole population (baseline at the population's whole compute: the strict matching)",
}
# The baseline's rows in eval/items.jsonl, by matching, and how the tables name them.
BASELINE_ROWS = {
    "per_adapter": ("baseline-per-adapter/", "baseline at the per-adapter mark"),
    "total": ("baseline/", "baseline at its end"),
}


def pts(x):
    return f"{100 * x:.1f} %"


def interval(d):
    """A difference in points with its interval, in bold when the interval excludes 0."""
    text = f"{100 * d['estimate']:+.1f} [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]"
    return f"**{text}**" if d["low"] > 0 or d["high"] < 0 else text


def tflop(compute):
    return compute["flops"] / 1e12


def compute_table(summary):
    print("| seed | seeding | population | baseline | per-adapter mark | whole-population mark |")
    print("|---|---|---|---|---|---|")
    for s in summary["seeds"]:
        p, b, sd = s["population"], s["baseline"], s.get("seeding")
        seeding = (f"{tflop(sd['compute']):.1f} TFLOP, {sd['valid']}/{sd['proposals']} valid "
                   f"in {sd['rounds']} rounds") if sd else "-"
        share = tflop(b["compute"]) / tflop(p["compute"])
        marks = [mark_cell(s.get(key)) for key in ("mark", "total_mark")]
        print(f"| {s['seed']} | {seeding} "
              f"| {p['steps']} steps, {tflop(p['compute']):.1f} TFLOP, {p['wall_s'] / 3600:.2f} h "
              f"| {b['steps']} steps, {tflop(b['compute']):.1f} TFLOP ({100 * share:.2f} % of the population's), "
              f"{b['wall_s'] / 3600:.2f} h | {marks[0]} | {marks[1]} |")
    e = summary["evaluation"]
    print(f"\nEvaluation: {e['rows']} rows, {e['answers']} answers, {e['wall_s'] / 3600:.2f} h.")


def mark_cell(m):
    """A compute mark: its step and its spending against its target; `-` when that
    matching was not run (experiment.json's `null`)."""
    if m is None:
        return "-"
    gap = m["spent_tflop"] / m["target_tflop"] - 1
    return f"step {m['step']}: {m['spent_tflop']:.2f} of {m['target_tflop']:.2f} TFLOP ({100 * gap:+.2f} %)"


def matchings_run(summary):
    """The matchings the experiment compared, in MATCHINGS' order."""
    return [m for m in MATCHINGS if comparisons(summary, m)]


def comparisons(summary, matching):
    return [c for c in summary["comparisons"] if c["matching"] == matching]


def pooled_table(summary, matching):
    chosen = comparisons(summary, matching)
    print("| | " + " | ".join(f"{BENCHMARKS.get(c['benchmark'], c['benchmark'])} ({c['items']})"
                              for c in chosen) + " |")
    print("|---" * (len(chosen) + 1) + "|")
    print("| base model | " + " | ".join(pts(summary["base_model"][c["benchmark"]]) for c in chosen) + " |")
    print("| baseline | " + " | ".join(pts(st.mean(r["baseline"] for r in c["per_seed"])) for c in chosen) + " |")
    print("| members, mean | " + " | ".join(pts(st.mean(r["all"] for r in c["per_seed"])) for c in chosen) + " |")
    for i, label in enumerate(d["label"] for d in chosen[0]["differences"]):
        print(f"| {label}, pts | " + " | ".join(interval(c["differences"][i]["difference"])
                                                 for c in chosen) + " |")
    c = chosen[0]
    print(f"\n95 % intervals, {c['differences'][0]['difference']['resamples']} resamples over "
          f"{len(c['per_seed'])} seeds × reported problems (the seed level has only "
          f"{c['distinct_seed_draws']} distinct draws); bold: the interval excludes 0.")


def chosen(row, which):
    """The best or weakest member's name, saying so when a seeded draw chose it among
    members tied on the selection problems (experiment.json's `*_drawn_from`)."""
    tied = row.get(f"{which}_drawn_from", [])
    return f"{row[which][0]} (drawn from {len(tied)} tied)" if tied else row[which][0]


def per_seed_table(summary, matching):
    print("| benchmark | seed | all | students | teachers | best | weakest | baseline | all − baseline |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in comparisons(summary, matching):
        for r in c["per_seed"]:
            print(f"| {BENCHMARKS.get(c['benchmark'], c['benchmark'])} | {r['seed']} "
                  f"| {pts(r['all'])} | {pts(r['students'])} | {pts(r['teachers'])} "
                  f"| {chosen(r, 'best')} {pts(r['best'][1])} | {chosen(r, 'weakest')} {pts(r['weakest'][1])} "
                  f"| {pts(r['baseline'])} | {100 * (r['all'] - r['baseline']):+.1f} |")


def tallies(records, reported):
    """Per benchmark and row: passed and answered per reported problem (a HumanEval
    problem with its HumanEval-IO items, as the experiment's bootstrap clusters them)."""
    cluster = {task: i for i, task in enumerate(reported)}
    counts = defaultdict(lambda: [[0] * len(reported), [0] * len(reported)])
    for r in records:
        c = cluster.get(r["task_id"])
        if c is not None:
            t = counts[(r["benchmark"], r["member"])]
            t[0][c] += r["passed"]
            t[1][c] += 1
    return dict(counts)  # a row missing from items.jsonl is then a KeyError, not a silent 0


def score(tally, drawn):
    """Pass rate over the drawn problems (with repeats)."""
    answered = sum(tally[1][c] for c in drawn)
    return sum(tally[0][c] for c in drawn) / answered if answered else 0.0


def every_problem(records):
    """The problems of eval/items.jsonl (every benchmark's task ids), in order: the
    experiment's problems when it evaluated all of them (experiment.json then names no
    subset)."""
    return list(dict.fromkeys(r["task_id"] for r in records))


def against_base(records, summary, resamples):
    """Each arm minus the base model, per benchmark: the mean over seeds of the arm's score
    (members: their mean) minus the base model's, with the experiment's crossed bootstrap
    (seeds and reported problems drawn independently, with replacement)."""
    selection = set(summary["selection"])
    reported = [t for t in summary.get("subset") or every_problem(records) if t not in selection]
    if len(reported) != summary["report_problems"]:
        sys.exit(f"{len(reported)} reported problems found, but experiment.json reports "
                 f"{summary['report_problems']}; they must agree")
    counts = tallies(records, reported)
    seeds = [s["seed"] for s in summary["seeds"]]
    arms = {"members, mean": lambda b, s: [counts[(b, f"seed-{s}/{m}")] for m, _ in members(summary, b, s)]}
    for matching in matchings_run(summary):
        prefix, label = BASELINE_ROWS[matching]
        arms[label] = lambda b, s, prefix=prefix: [solo(counts, b, f"seed-{s}/{prefix}")]
    benchmarks = [c["benchmark"] for c in comparisons(summary, matchings_run(summary)[0])]
    every = list(range(len(reported)))
    for matching in matchings_run(summary):
        prefix = BASELINE_ROWS[matching][0]
        for c in comparisons(summary, matching):
            for r in c["per_seed"]:
                mine = score(solo(counts, c["benchmark"], f"seed-{r['seed']}/{prefix}"), every)
                if abs(mine - r["baseline"]) > 1e-9:
                    sys.exit(f"{c['benchmark']}, seed {r['seed']}: the {matching} baseline scores {mine} on "
                             f"eval/items.jsonl's reported problems but {r['baseline']} in experiment.json; "
                             "they must agree")
    print("| | " + " | ".join(BENCHMARKS.get(b, b) for b in benchmarks) + " |")
    print("|---" * (len(benchmarks) + 1) + "|")
    for arm, rows_of in arms.items():
        cells = []
        for b in benchmarks:
            base = counts[(b, "base model")]
            rows = {s: rows_of(b, s) for s in seeds}

            def statistic(drawn_seeds, drawn):
                gap = [st.mean(score(t, drawn) for t in rows[s]) - score(base, drawn) for s in drawn_seeds]
                return sum(gap) / len(gap)

            rng = random.Random(f"{b}/{arm}")
            values = sorted(statistic(rng.choices(seeds, k=len(seeds)), rng.choices(every, k=len(every)))
                            for _ in range(resamples))
            at = lambda q: values[round(q * (len(values) - 1))]
            cells.append(interval({"estimate": statistic(seeds, every), "low": at(0.025), "high": at(0.975)}))
        print(f"| {arm} − base model, pts | " + " | ".join(cells) + " |")
    print(f"\n95 % intervals, {resamples} resamples of seeds × the {len(reported)} reported problems; "
          "bold: the interval excludes 0.")


def solo(counts, benchmark, prefix):
    """The tallies of the one baseline row whose name starts with `prefix`."""
    (row,) = [t for (b, name), t in counts.items() if b == benchmark and name.startswith(prefix)]
    return row


def members(summary, benchmark, seed):
    c = next(c for c in comparisons(summary, matchings_run(summary)[0]) if c["benchmark"] == benchmark)
    return next(r for r in c["per_seed"] if r["seed"] == seed)["members"]


def unchanged(records, summary):
    """How far each arm's answers moved: the share of its answers (every item, every seed)
    that are the base model's answer to the same item, word for word. Under greedy
    decoding an identical answer means the adapter left that item's output untouched."""
    answers = greedy_answers(records)
    if answers is None:
        print("Not computed: the answers were sampled, not greedy.")
        return
    base = answers["base model"]
    benchmarks = [c["benchmark"] for c in comparisons(summary, matchings_run(summary)[0])]
    seeds = [s["seed"] for s in summary["seeds"]]
    members_of = {f"seed-{s}/{m}" for s in seeds for m, _ in members(summary, benchmarks[0], s)}
    arms = {"members": lambda name: name in members_of}
    for matching in matchings_run(summary):
        prefix, label = BASELINE_ROWS[matching]
        arms[label] = lambda name, prefix=prefix: name.startswith("seed-") and f"/{prefix}" in name
    print("| share of answers identical to the base model's | " + " | ".join(benchmarks) + " |")
    print("|---" * (len(benchmarks) + 1) + "|")
    for arm, chosen in arms.items():
        cells = []
        for b in benchmarks:
            counts = [identical_share(row, base, b) for name, row in answers.items() if chosen(name)]
            same, total = sum(c[0] for c in counts), sum(c[1] for c in counts)
            cells.append(f"{pts(same / total)} of {total}")
        print(f"| {arm} | " + " | ".join(cells) + " |")


def main(out: Path, resamples: int):
    summary = json.loads((out / "experiment.json").read_text())
    print("### Compute\n")
    compute_table(summary)
    for matching, title in MATCHINGS.items():
        if not comparisons(summary, matching):
            continue
        print(f"\n### Matched {title}\n")
        pooled_table(summary, matching)
        print()
        per_seed_table(summary, matching)
    print("\n### Against the untouched base model\n")
    records = load_answers(out)
    against_base(records, summary, resamples)
    print("\n### Answers identical to the base model's\n")
    unchanged(records, summary)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) == 3 else 2000)
