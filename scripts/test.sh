#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# torchtitan 0.3's trainer tests (tests/torchtitan03) run 0.3's own trainer in a second venv;
# built once, then reused while pyproject.toml and setup.sh are unchanged.
SWAP_STATE_VENV=.venv-titan03 SWAP_STATE_TORCHTITAN="torchtitan>=0.3,<0.4" bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
