#!/usr/bin/env python3
"""Where an experiment directory (`populora experiment ... --out DIR`) stands:
per seed, the seeding stage, and per run the steps done, the compute spent,
the wall time its steps took (summed `wall_ms`, so pauses between pieces are
left out) and the median step; then the evaluation's answers so far.

    scripts/experiment-progress.py DIR
"""
import statistics
import sys
from pathlib import Path

from selfplay_metrics import answers_file, load_answers, load_rows


def run_line(run: Path) -> str:
    metrics = run / "metrics.jsonl"
    if not metrics.exists():
        return f"  {run.name}: not started"
    rows = load_rows(run)
    if not rows:
        return f"  {run.name}: no step yet"
    steps = [r["wall_ms"] / 1000 for r in rows]
    tflop = rows[-1]["compute_total"]["flops"] / 1e12
    return (
        f"  {run.name}: {rows[-1]['step']} steps, {tflop:.1f} TFLOP, "
        f"{sum(steps) / 3600:.2f} h of steps (median {statistics.median(steps):.1f} s)"
    )


def main(out: Path) -> None:
    for seed in sorted(out.glob("seed-*")):
        print(seed.name)
        seeding = seed / "seeding.json"
        print(f"  seeding: {'done' if seeding.exists() else 'not done'}")
        for run in ("population", "baseline"):
            print(run_line(seed / run))
    if answers_file(out):
        print(f"evaluation: done, {len(load_answers(out))} answers")
    for progress in sorted((out / "eval").glob("progress-*.jsonl")):
        print(f"evaluation so far, {progress.name}: {sum(1 for _ in progress.open())} lines")
    summary = out / "experiment.json"
    # The experiment writes experiment.json when it starts (the arms' settings hashes)
    # and again, with the comparisons, when it is done.
    if summary.exists() and '"comparisons"' in summary.read_text():
        print("done: experiment.json written")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
