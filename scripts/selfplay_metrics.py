"""What the scripts read from a run's metrics.jsonl (one JSON row per step):
the rows themselves and the per-step measures more than one script reports;
and, of an evaluation, its greedy answers.
"""
import gzip
import json
from pathlib import Path

KINDS = ["deduction", "abduction", "induction"]


def load_lines(path):
    """The JSON lines of `path` (none when it is missing). A last line cut by an
    interruption is left out: resuming the run rewrites it."""
    path = Path(path)
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def load_rows(run):
    """The step rows of `run`'s metrics.jsonl."""
    return load_lines(Path(run) / "metrics.jsonl")


def load_journal(run):
    """The events of `run`'s journal.jsonl."""
    return load_lines(Path(run) / "journal.jsonl")


def solve_rates(part, kind):
    """The solve rate of `kind` at each step of `part` that had a problem of that kind."""
    return [d["solve_rate"][kind] for d in part if d["solve_rate"].get(kind) is not None]


def nonzero_share(part, role):
    """Rollouts of `role` with a non-zero advantage over the window ("-": not measured)."""
    groups = [g for d in part for m in d["members"] for g in m.get("groups", []) if g["role"] == role]
    rollouts = sum(g["rollouts"] for g in groups)
    return f"{sum(g['nonzero_advantage'] for g in groups) / rollouts:.2f}" if rollouts else "-"


def rating_spread(row):
    """μ of the best-rated member minus μ of the worst at one step."""
    mus = [m["rating"]["mu"] for m in row["members"]]
    return max(mus) - min(mus)


def answers_file(out):
    """`out`/eval/items.jsonl, or in an experiment's committed record its gzipped copy
    (items.jsonl.gz); None when neither is there."""
    for name in ("items.jsonl", "items.jsonl.gz"):
        path = Path(out) / "eval" / name
        if path.exists():
            return path
    return None


def load_answers(out):
    """Every answer of `out`/eval/items.jsonl (none when it is missing). Read strictly:
    the experiment writes this file whole, so a line that does not parse is an error,
    not an interruption to skip."""
    path = answers_file(out)
    if path is None:
        return []
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return [json.loads(line) for line in text.splitlines()]


def greedy_answers(records):
    """Each row's answers among `records` (from load_answers): {row: {(benchmark, task id,
    item): response}}; None when the answers were sampled (then two answers of one item
    differ anyway, so comparing them with the base model's says nothing)."""
    answers = {}
    for r in records:
        if r["sample"] > 0:
            return None
        answers.setdefault(r["member"], {})[(r["benchmark"], r["task_id"], r["item"])] = r["response"]
    return answers


def identical_share(row, base, benchmark):
    """How many of `row`'s answers on `benchmark` are word for word `base`'s, of how many."""
    same = [answer == base[key] for key, answer in row.items() if key[0] == benchmark]
    return sum(same), len(same)
