#!/usr/bin/env python3
"""Self-play dynamics of both arms of an experiment (`populora experiment ... --out DIR`),
side by side, as the experiment's write-up reports them.

Usage: scripts/experiment-dynamics.py DIR [WINDOWS=5]

The two arms take different numbers of steps for the same compute (the
baseline's step is cheaper), so windows are cut by compute, not by step:
window k holds the steps whose running compute falls in the k-th of WINDOWS
equal shares of the population's total for that seed. Each cell is the mean
over seeds of that window's value. Then, per arm, the updates and rollouts
each adapter trained on, which is what separates "one adapter, many updates"
from "eight adapters, fewer each".
"""
import json
import statistics as st
import sys
from pathlib import Path

from selfplay_metrics import KINDS, greedy_answers, identical_share, load_answers, load_journal, load_rows, nonzero_share, rating_spread, solve_rates


def by_compute(rows, total, count):
    """Splits rows into `count` windows by running compute (the last window takes any overshoot)."""
    parts = [[] for _ in range(count)]
    for row in rows:
        share = row["compute_total"]["flops"] / total
        parts[min(int(share * count - 1e-9), count - 1)].append(row)
    return parts


def window_values(part):
    """The dynamics of one window, None where it holds nothing to measure."""
    if not part:
        return None
    valid = sum(d["proposals"]["valid"] for d in part)
    total = sum(d["proposals"]["total"] for d in part)
    learnable = sum(d["proposals"].get("learnable", 0) for d in part)
    programs = [p["ast_nodes"] for d in part for p in d["programs"]]
    solo = all(m["role"] == "solo" for d in part for m in d["members"])
    values = {
        "steps": len(part),
        "valid": valid / max(total, 1),
        "learnable": learnable / max(valid, 1),
        "ast": st.mean(programs) if programs else None,
        # A lone adapter has no opponent to be rated against.
        "spread": None if solo else st.mean(rating_spread(d) for d in part),
    }
    for kind in KINDS:
        rates = solve_rates(part, kind)
        values[kind] = st.mean(rates) if rates else None
    for role in ("proposer", "solver"):
        share = nonzero_share(part, role)
        values[role] = None if share == "-" else float(share)
    return values


def pooled(cells):
    cells = [c for c in cells if c is not None]
    return st.mean(cells) if cells else None


def fmt(x, digits=2):
    return "–" if x is None else f"{x:.{digits}f}"


def dynamics_table(seeds, count):
    print("| arm | compute share | steps | valid | learnable / valid | solve ded / abd / ind "
          "| non-zero advantage proposer / solver | mean AST nodes | rating μ spread |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arm in ("population", "baseline"):
        per_seed = []
        for seed in seeds:
            total = load_rows(seed / "population")[-1]["compute_total"]["flops"]
            per_seed.append([window_values(p) for p in by_compute(load_rows(seed / arm), total, count)])
        for k in range(count):
            cells = [windows[k] for windows in per_seed if windows[k] is not None]
            if not cells:
                continue
            mean = lambda key: pooled([c[key] for c in cells])
            solve = " / ".join(fmt(mean(kind)) for kind in KINDS)
            signal = " / ".join(fmt(mean(role)) for role in ("proposer", "solver"))
            print(f"| {arm} | {k / count:.0%}–{(k + 1) / count:.0%} | {fmt(mean('steps'), 0)} "
                  f"| {fmt(mean('valid'))} | {fmt(mean('learnable'))} | {solve} | {signal} "
                  f"| {fmt(mean('ast'), 1)} | {fmt(mean('spread'), 1)} |")


def updates_table(seeds):
    """Per adapter: optimizer steps taken (steps it trained in) and rollouts it trained on."""
    print("\n| seed | arm | adapters ever | steps trained per adapter (mean) | rollouts trained per adapter (mean) | TFLOP per live adapter |")
    print("|---|---|---|---|---|---|")
    for seed in seeds:
        for arm in ("population", "baseline"):
            rows = load_rows(seed / arm)
            steps, rollouts = {}, {}
            for d in rows:
                for m in d["members"]:
                    steps[m["id"]] = steps.get(m["id"], 0) + 1
                    rollouts[m["id"]] = rollouts.get(m["id"], 0) + sum(g["rollouts"] for g in m.get("groups", []))
            live = len(rows[-1]["members"])
            tflop = rows[-1]["compute_total"]["flops"] / 1e12 / live
            print(f"| {seed.name} | {arm} | {len(steps)} | {st.mean(steps.values()):.1f} "
                  f"| {st.mean(rollouts.values()):.0f} | {tflop:.1f} |")


def spawn_steps(run: Path):
    """Member id -> (step it was spawned before, its parents), from the run's journal."""
    spawned = {}
    for event in load_journal(run):
        if event.get("event") == "spawn":
            spawned[event["id"]] = (event["step"], event["parents"])
    return spawned


def members_table(out: Path, seeds):
    """The population's final members: when each was born, how many steps it trained,
    and (once the evaluation is done) its score on each benchmark's reported items and
    the share of its greedy answers (every item) that are the base model's, word for
    word: how far its training moved it."""
    scores = {}
    summary = out / "experiment.json"
    if summary.exists():
        for c in json.loads(summary.read_text())["comparisons"]:
            if c["matching"] != "total":
                continue
            for row in c["per_seed"]:
                for name, score in row["members"]:
                    scores.setdefault((row["seed"], name), {})[c["benchmark"]] = score
    benchmarks = sorted({b for s in scores.values() for b in s})
    answers = greedy_answers(load_answers(out)) or {}
    base = answers.get("base model")
    moved = sorted({key[0] for key in base}) if base else []
    header = ["seed", "member", "born before step", "steps trained", "parents", *benchmarks,
              *(f"{b}: same as base" for b in moved)]
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for seed in seeds:
        run = seed / "population"
        rows, spawned = load_rows(run), spawn_steps(run)
        last = rows[-1]["step"]
        number = int(seed.name.split("-")[1])
        for m in sorted(m["id"] for m in rows[-1]["members"]):
            born, parents = spawned.get(m, (1, []))
            cells = [seed.name, m, str(born), str(last - born + 1), ", ".join(parents) or "initial"]
            cells += [f"{100 * scores.get((number, m), {}).get(b, float('nan')):.1f}" for b in benchmarks]
            for b in moved:
                same, total = identical_share(answers.get(f"{seed.name}/{m}", {}), base, b)
                cells.append(f"{100 * same / total:.1f}" if total else "-")
            print("| " + " | ".join(cells) + " |")


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    out = Path(sys.argv[1])
    count = int(sys.argv[2]) if len(sys.argv) == 3 else 5
    seeds = [s for s in sorted(out.glob("seed-*"))
             if (s / "population" / "metrics.jsonl").exists() and (s / "baseline" / "metrics.jsonl").exists()]
    if not seeds:
        sys.exit(f"{out}: no seed has both arms started")
    print(f"seeds: {', '.join(s.name for s in seeds)}\n")
    dynamics_table(seeds, count)
    updates_table(seeds)
    members_table(out, seeds)


if __name__ == "__main__":
    main()
