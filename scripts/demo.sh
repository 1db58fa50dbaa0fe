#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the end-to-end demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m swap_state.client.demo "$@"
