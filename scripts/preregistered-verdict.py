#!/usr/bin/env python3
"""A pre-registered hypothesis's verdict, read from a finished experiment.

    scripts/preregistered-verdict.py DIR [--benchmark cruxeval-i] [--group students]
                                         [--matching per_adapter] [--refute-below 1.0]

It takes one difference of DIR/experiment.json (a population group minus the
baseline, pooled over seeds, with its crossed seeds x problems bootstrap
interval) and applies the decision rule of EXPERIMENTS.md's confirm-4t4s
pre-registration, whose defaults these are (issue 56's H1):

- confirmed: the 95 % interval lies above 0;
- refuted: its upper end is below `--refute-below` points (an interval
  wholly below 0, the baseline ahead, is refuted and said so);
- inconclusive: otherwise.

The rule is applied to the figures as experiment.json holds them, so the
verdict cannot drift from the table it is printed beside. Exit status 0
whatever the verdict; 2 when the difference is not in the file.
"""
import argparse
import json
import sys
from pathlib import Path

GROUPS = ("all members", "students", "teachers", "best member", "weakest member")


def verdict(low: float, high: float, refute_below: float) -> str:
    """The pre-registered rule on an interval in points."""
    if low > 0:
        return "confirmed: the interval lies above 0"
    if high < 0:
        return "refuted: the interval lies below 0 (the baseline ahead)"
    if high < refute_below:
        return f"refuted: the interval excludes a gain of {refute_below:.1f} points or more"
    return f"inconclusive: the interval includes 0 and reaches {refute_below:.1f} points or more"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--benchmark", default="cruxeval-i")
    parser.add_argument("--group", default="students", choices=GROUPS)
    parser.add_argument("--matching", default="per_adapter", choices=("per_adapter", "total"))
    parser.add_argument("--refute-below", type=float, default=1.0, help="points (default 1.0)")
    args = parser.parse_args()
    summary = json.loads((args.dir / "experiment.json").read_text())
    label = f"{args.group} − baseline"
    found = [
        (c, d)
        for c in summary.get("comparisons", [])
        if c["benchmark"] == args.benchmark and c["matching"] == args.matching
        for d in c["differences"]
        if d["label"] == label
    ]
    if len(found) != 1:
        print(f"{args.dir}/experiment.json holds no `{label}` for {args.benchmark} matched "
              f"{args.matching} (is the experiment finished?)", file=sys.stderr)
        sys.exit(2)
    comparison, difference = found[0]
    d = difference["difference"]
    low, estimate, high = (100 * d[k] for k in ("low", "estimate", "high"))
    seeds = [r["seed"] for r in comparison["per_seed"]]
    # Two decimals: the rule reads the unrounded ends, and a table's one decimal
    # could round an end across a threshold.
    print(f"{label}, {args.benchmark}, matched {args.matching}: {estimate:+.2f} points "
          f"[{low:+.2f}, {high:+.2f}] (95 %, {d['resamples']} resamples over seeds {seeds} "
          f"x {comparison['items']} items; {comparison['distinct_seed_draws']} distinct seed draws)")
    print(verdict(low, high, args.refute_below))


if __name__ == "__main__":
    main()
