#!/usr/bin/env python3
"""Score an evaluation's answers with the official harnesses and compare
their pass/fail with ours, task by task.

    scripts/harness-agreement.sh EVAL_DIR [ROW]     (sets up the tools, then runs this)
    python3 scripts/harness-agreement.py EVAL_DIR --cruxeval-repo DIR [--row ROW]

EVAL_DIR is an evaluation's `eval/` folder (`populora eval ... --out OUT`
writes OUT/eval/): its `items.jsonl` holds our verdicts, its harness files
the answers (see README, `eval`). For each of the row's files:

- HumanEval+ / MBPP+: `evalplus.evaluate` (EvalPlus from PyPI, importable
  here) on `evalplus-{humaneval,mbpp}-ROW.jsonl`, with `HUMANEVAL_OVERRIDE_PATH`
  / `MBPP_OVERRIDE_PATH` pointing at the project's shipped data files, one
  check at a time (`--parallel 1`, or $PARALLEL: its time limits come from
  the canonical solutions' times, and checks that share the cores run
  slower than those did); base and plus status of every task against our
  `base_passed` and `passed`.
- CRUXEval-O / -I: CRUXEval's own `evaluation/evaluate_generations.py`,
  copied at run time from the repository at `--cruxeval-repo` (a checkout
  or a bare git directory), on `cruxeval-generations-ROW-{output,input}.json`;
  every item against our `passed`.

Prints one line per benchmark (tasks, agreeing, passing by each side) and
every disagreement, and exits 1 if there is one. A harness whose file is
missing (the benchmark was not evaluated) is skipped, and says so.

    python3 scripts/harness-agreement.py --write-canonical FILE

writes answers for `populora eval --rescore FILE`: every HumanEval+ and
MBPP+ task answered by its own canonical solution (in a ```python block),
as the row "canonical", to compare the two harnesses on answers that pass.
"""
import gzip
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("POPULORA_DATA", ROOT / "data"))
EVALPLUS_DATA = {
    "humaneval": ("HUMANEVAL_OVERRIDE_PATH", DATA / "evalplus/HumanEvalPlus-v0.1.10.jsonl.gz", "humaneval+"),
    "mbpp": ("MBPP_OVERRIDE_PATH", DATA / "evalplus/MbppPlus-v0.2.0.jsonl.gz", "mbpp+"),
}
CRUXEVAL_FILES = ("evaluate_generations.py", "utils_general.py", "utils_execute.py")


def our_verdicts(eval_dir, row):
    """(benchmark, task id) -> (passed, base_passed) of the row's first sample."""
    verdicts = {}
    with open(eval_dir / "items.jsonl") as fh:
        for line in fh:
            r = json.loads(line)
            if r["member"] == row and r["sample"] == 0:
                verdicts[(r["benchmark"], r["task_id"])] = (r["passed"], r.get("base_passed"))
    return verdicts


def file_row(row):
    return row.replace("/", "-").replace(" ", "-")


def evalplus_agreement(eval_dir, row, ours, work):
    lines = []
    for dataset, (variable, data_file, benchmark) in EVALPLUS_DATA.items():
        samples = eval_dir / f"evalplus-{dataset}-{file_row(row)}.jsonl"
        if not samples.exists():
            lines.append((benchmark, None, f"skipped: no {samples.name}"))
            continue
        copy = work / samples.name
        shutil.copy(samples, copy)
        env = dict(os.environ, **{variable: str(data_file)})
        command = [sys.executable, "-m", "evalplus.evaluate", "--dataset", dataset,
                   "--samples", str(copy), "--parallel", os.environ.get("PARALLEL", "1"),
                   "--i-just-wanna-run"]
        subprocess.run(command, env=env, check=True, stdout=sys.stderr)
        # EvalPlus 0.3.1 names it NAME_eval_results.json (later releases NAME.eval_results.json).
        written = [copy.with_name(copy.stem + suffix)
                   for suffix in ("_eval_results.json", ".eval_results.json")]
        results = json.loads(next(p for p in written if p.exists()).read_text())
        disagreements, counts = [], [0, 0, 0, 0]
        for task_id, [result] in sorted(results["eval"].items()):
            official = (result["base_status"] == "pass"
                        and result["plus_status"] == "pass", result["base_status"] == "pass")
            mine = ours.get((benchmark, task_id))
            counts[0] += 1
            counts[1] += official[0]
            counts[2] += bool(mine and mine[0])
            if mine is None or (mine[0], mine[1]) != official:
                disagreements.append(f"  {task_id}: EvalPlus base {result['base_status']}, plus "
                                     f"{result['plus_status']}; ours {mine}")
            else:
                counts[3] += 1
        lines.append((benchmark, counts, disagreements))
    return lines


def cruxeval_agreement(eval_dir, row, ours, work, repo):
    lines = []
    evaluation = work / "cruxeval" / "evaluation"
    evaluation.mkdir(parents=True)
    (work / "cruxeval" / "data").mkdir()
    shutil.copy(DATA / "cruxeval/cruxeval.jsonl", work / "cruxeval/data/cruxeval.jsonl")
    for name in CRUXEVAL_FILES:
        evaluation.joinpath(name).write_bytes(read_from_repo(repo, f"evaluation/{name}"))
    for mode, benchmark in (("output", "cruxeval-o"), ("input", "cruxeval-i")):
        generations = eval_dir / f"cruxeval-generations-{file_row(row)}-{mode}.json"
        if not generations.exists():
            lines.append((benchmark, None, f"skipped: no {generations.name}"))
            continue
        # The script takes its mode from whether the path says "input".
        copy = work / f"generations-{mode}.json"
        shutil.copy(generations, copy)
        scored = work / f"scored-{mode}.json"
        subprocess.run([sys.executable, "evaluate_generations.py", "--generations_path", str(copy),
                        "--scored_results_path", str(scored)],
                       cwd=evaluation, check=True, stdout=sys.stderr)
        results = json.loads(scored.read_text())["raw_scored_generations"]
        answered = {task for (b, task) in ours if b == benchmark}
        disagreements, counts = [], [0, 0, 0, 0]
        for task_id in sorted(answered, key=lambda t: int(t.split("_")[1])):
            official = bool(results[task_id][0])
            mine = ours[(benchmark, task_id)][0]
            counts[0] += 1
            counts[1] += official
            counts[2] += mine
            if mine != official:
                disagreements.append(f"  {task_id}: CRUXEval {official}, ours {mine}")
            else:
                counts[3] += 1
        lines.append((benchmark, counts, disagreements))
    return lines


def read_from_repo(repo, path):
    repo = Path(repo)
    if (repo / path).exists():
        return (repo / path).read_bytes()
    return subprocess.run(["git", f"--git-dir={repo}", "show", f"HEAD:{path}"],
                          check=True, capture_output=True).stdout


def write_canonical(path):
    with open(path, "w") as out:
        for dataset, (_, data_file, benchmark) in EVALPLUS_DATA.items():
            with gzip.open(data_file, "rt") as fh:
                for item, line in enumerate(fh):
                    task = json.loads(line)
                    code = task["prompt"] + task["canonical_solution"]
                    if dataset == "mbpp":
                        code = task["canonical_solution"]
                    record = {"benchmark": benchmark, "task_id": task["task_id"], "item": item,
                              "member": "canonical", "sample": 0, "passed": False,
                              "response": "```python\n" + code.strip("\n") + "\n```"}
                    out.write(json.dumps(record) + "\n")


def main():
    if sys.argv[1:2] == ["--write-canonical"]:
        write_canonical(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("eval_dir", type=Path)
    parser.add_argument("--row", default="base model")
    parser.add_argument("--cruxeval-repo", required=True)
    args = parser.parse_args()
    ours = our_verdicts(args.eval_dir, args.row)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        lines = evalplus_agreement(args.eval_dir, args.row, ours, work)
        lines += cruxeval_agreement(args.eval_dir, args.row, ours, work, args.cruxeval_repo)
    failed = False
    print(f"row: {args.row}")
    print("benchmark   tasks  agree  official-pass  our-pass")
    for benchmark, counts, detail in lines:
        if counts is None:
            print(f"{benchmark:<11} {detail}")
            continue
        print(f"{benchmark:<11} {counts[0]:>5}  {counts[3]:>5}  {counts[1]:>13}  {counts[2]:>8}")
        for line in detail:
            print(line)
        failed |= bool(detail)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
