#!/bin/sh
# Our pass/fail against the official harnesses' on the same answers (see
# scripts/harness-agreement.py):
#   scripts/harness-agreement.sh EVAL_DIR CRUXEVAL_REPO [ROW]
# EVAL_DIR: an evaluation's eval/ folder; CRUXEVAL_REPO: a checkout (or a
# bare git directory) of facebookresearch/cruxeval, whose
# evaluation/*.py is copied to a temporary folder and run there; ROW:
# default "base model". Installs EvalPlus 0.3.1 (and numpy, which CRUXEval's
# script imports) from PyPI into a virtual environment, VENV (default
# /tmp/populora-harness-venv), once. Needs pip; not part of the test suite.
# EvalPlus computes its own expected outputs on first use (minutes, and
# about 1.5 GB in ~/.cache/evalplus: MBPP+'s Mbpp/255 alone pickles 1 GB).
# The canonical solutions as answers (every task passes but HumanEval/32):
#   python3 scripts/harness-agreement.py --write-canonical /tmp/canonical.jsonl
#   populora eval --rescore /tmp/canonical.jsonl --benchmarks humaneval+,mbpp+ --out OUT
#   scripts/harness-agreement.sh OUT/eval CRUXEVAL_REPO canonical
set -eu
eval_dir=$1
repo=$2
row=${3:-base model}
venv=${VENV:-/tmp/populora-harness-venv}
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet evalplus==0.3.1 numpy
fi
exec "$venv/bin/python" "$(dirname "$0")/harness-agreement.py" "$eval_dir" \
    --cruxeval-repo "$repo" --row "$row"
