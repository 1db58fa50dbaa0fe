#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the benchmark suite (python -m bench).
# Default size finishes in a few minutes on a 2-core machine; go bigger with --params, e.g.
#   bash scripts/bench.sh --params 64M --out results/
# Writes results/bench.md, results/bench.json and results/bench.png (the plot needs matplotlib).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The plot's matplotlib is the optional `bench` extra.
.venv/bin/python -c "import matplotlib" 2>/dev/null \
  || .venv/bin/python -m pip install -q --disable-pip-version-check \
       -c .venv/torch-constraint.txt -e ".[client,torchtitan,dev,bench]" 2>&1 | { grep -v "is ignored" || true; }
exec .venv/bin/python -m bench "$@"
