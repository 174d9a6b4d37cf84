#!/usr/bin/env python3
"""Keeps a long experiment safe from a machine reset, and its results in the tree.

    scripts/experiment-snapshot.py save DIR SNAPSHOT     # what `populora experiment ... --out DIR` needs to continue
    scripts/experiment-snapshot.py restore SNAPSHOT DIR  # on a fresh machine, before continuing
    scripts/experiment-snapshot.py record DIR RECORD     # a finished experiment's results, to commit

A snapshot holds weights (each unfinished run's newest checkpoint, finished
runs' adapters): keep it outside the repository (the tree travels to GPU
machines and CI refuses it above 40 MiB), or commit it only while it stays
small. A record holds what every table and figure is computed from and no
weights: experiment.toml and experiment.json, every run's scenario.toml,
journal.jsonl, metrics.jsonl and seeding.json, and the answers
(eval/items.jsonl gzipped as eval/items.jsonl.gz, the harness-format samples,
the table); `populora experiment` and the scripts read it as they read DIR.
The adapters it leaves out come back bit for bit with `populora replay` of
each run (as long as the run took).

What is kept: every file of DIR except sockets, reports, partial files,
old checkpoints and what only a resume needs of a finished run. A run still
going keeps its newest checkpoint whole (the one `experiment` resumes from)
but not its `members/`, which holds the same files (a run writes both at
each checkpoint, and a commit's size counts them twice): `restore` copies
them back from that checkpoint. A finished run keeps its members'
adapters, not their optimizer state. A baseline's
compute-mark checkpoint keeps its adapter (the per-adapter row the
evaluation reads). Files are copied only when they changed, and files of
SNAPSHOT no longer kept are removed, so a commit adds at most one run's
newest checkpoint.
"""
import filecmp
import gzip
import shutil
import sys
from pathlib import Path

from selfplay_metrics import load_journal

SKIPPED_NAMES = {"control.sock", ".items.jsonl.partial"}
SKIPPED_DIRS = {"report"}


def run_keeps(run: Path):
    """Whether `run` has ended, and the checkpoints to keep: {name: whole (True) or adapters only}."""
    events = load_journal(run)
    ended = any(e.get("event") == "end" for e in events)
    keep = {}
    for e in events:
        if e.get("event") == "compute_mark":
            keep[f"step-{int(e['step']):06}"] = False
    names = sorted(p.name for p in (run / "checkpoints").glob("step-*") if p.is_dir())
    if names and not ended:
        keep[names[-1]] = True
    return ended, keep


def kept(rel: tuple, ended: bool, checkpoints: dict) -> bool:
    """Whether a file of a run (its path below the run) is kept."""
    if rel[0] == "checkpoints":
        if len(rel) < 2 or rel[1] not in checkpoints:
            return False  # an older checkpoint, or one still being written (.tmp-step-N)
        return checkpoints[rel[1]] or "adapter" in rel[2:]
    if rel[0] == "members":
        if ended:
            return "adapter" in rel[1:]
        return not any(checkpoints.values())  # restore copies them from the newest checkpoint
    return True


def selected(out: Path) -> list[Path]:
    """The files of `out` to keep, relative to it."""
    runs = {}
    files = []
    for path in sorted(out.rglob("*")):
        if not path.is_file() or path.is_symlink():
            continue
        rel = path.relative_to(out)
        if path.name in SKIPPED_NAMES or SKIPPED_DIRS & set(rel.parts):
            continue
        parts = rel.parts
        i = next((i for i, p in enumerate(parts) if p in ("checkpoints", "members")), None)
        if i is not None:
            run = out.joinpath(*parts[:i])
            if run not in runs:
                runs[run] = run_keeps(run)
            if not kept(parts[i:], *runs[run]):
                continue
        files.append(rel)
    return files


def mirror(src: Path, dest: Path, files: list[Path], skip_missing=False) -> tuple[list[Path], int, int]:
    """Copy `files` from `src` to `dest` where they differ; remove the rest of `dest`.

    The experiment may be running: a live `members/` file it replaces while
    this copies is left out (its checkpoint's copy is what a resume reads)."""
    copied, present = 0, []
    for rel in files:
        a, b = src / rel, dest / rel
        if skip_missing and not a.exists():
            present.append(rel)  # written by the caller
            continue
        try:
            if not (b.exists() and filecmp.cmp(a, b, shallow=False)):
                b.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(a, b)
                copied += 1
        except FileNotFoundError:
            print(f"left out {rel}: it changed while being copied", file=sys.stderr)
            continue
        present.append(rel)
    wanted = {dest / rel for rel in present}
    removed = 0
    for path in sorted(dest.rglob("*"), reverse=True):
        if path.is_file() and path not in wanted:
            path.unlink()
            removed += 1
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()
    return present, copied, removed


def refill_members(out: Path) -> int:
    """Copy each unfinished run's newest checkpoint's members into its `members/`, as the run left it."""
    filled = 0
    for journal in sorted(out.rglob("journal.jsonl")):
        run = journal.parent
        ended, keep = run_keeps(run)
        whole = [name for name, is_whole in keep.items() if is_whole]
        if ended or not whole:
            continue
        shutil.copytree(run / "checkpoints" / whole[0] / "members", run / "members", dirs_exist_ok=True)
        filled += 1
    return filled


def recorded(out: Path) -> list[Path]:
    """The files of a finished experiment `out` that its record keeps, relative to it
    (eval/items.jsonl among them, written gzipped)."""
    files = []
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out)
        weights = {"checkpoints", "members", "replay"} & set(rel.parts)
        if not path.is_file() or path.is_symlink() or weights or SKIPPED_DIRS & set(rel.parts):
            continue
        if path.name in SKIPPED_NAMES or path.name.startswith("progress-") or path.name == "items.jsonl.gz":
            continue
        files.append(rel)
    return files


def record(src: Path, dest: Path) -> None:
    if not (src / "eval" / "items.jsonl").exists():
        sys.exit(f"{src} has no eval/items.jsonl: record a finished experiment (save a running one)")
    files = [rel for rel in recorded(src) if rel != Path("eval/items.jsonl")]
    dest.mkdir(parents=True, exist_ok=True)
    files, copied, removed = mirror(src, dest, files + [Path("eval/items.jsonl.gz")], skip_missing=True)
    # mtime 0: the same answers give the same bytes, so a commit changes only what changed.
    data = gzip.compress((src / "eval" / "items.jsonl").read_bytes(), compresslevel=9, mtime=0)
    (dest / "eval" / "items.jsonl.gz").write_bytes(data)
    size = sum((dest / rel).stat().st_size for rel in files)
    print(f"record: {len(files)} files ({size / 2**20:.1f} MiB) in {dest}; {copied} copied, {removed} removed")


def main(argv: list[str]) -> None:
    if len(argv) != 4 or argv[1] not in ("save", "restore", "record"):
        sys.exit(__doc__)
    if argv[1] == "record":
        return record(Path(argv[2]), Path(argv[3]))
    src, dest = Path(argv[2]), Path(argv[3])
    if not (src / "experiment.toml").exists():
        sys.exit(f"{src} holds no experiment (no experiment.toml)")
    if argv[1] == "restore" and dest.exists() and any(dest.iterdir()):
        sys.exit(f"{dest} exists and is not empty; restore only onto a fresh machine")
    files = selected(src)
    dest.mkdir(parents=True, exist_ok=True)
    files, copied, removed = mirror(src, dest, files)
    size = sum((dest / rel).stat().st_size for rel in files)
    print(f"{argv[1]}: {len(files)} files ({size / 2**20:.1f} MiB) in {dest}; {copied} copied, {removed} removed")
    if argv[1] == "restore":
        print(f"restore: members/ of {refill_members(dest)} unfinished runs copied from their newest checkpoints")


if __name__ == "__main__":
    main(sys.argv)
