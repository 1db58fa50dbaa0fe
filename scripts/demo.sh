#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the end-to-end demo.
#   bash scripts/demo.sh [demo flags]      the remote container against an embedded server
#   bash scripts/demo.sh --torchtitan      torchtitan 0.2's own trainer on the CPU: killed, resumed
#   bash scripts/demo.sh --torchtitan03    the same with torchtitan 0.3 (builds .venv-titan03)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${1:-}" = "--torchtitan" ]; then
  shift
  exec .venv/bin/python scripts/demo_torchtitan.py "$@"
fi
if [ "${1:-}" = "--torchtitan03" ]; then
  shift
  SWAP_STATE_VENV=.venv-titan03 SWAP_STATE_TORCHTITAN="torchtitan>=0.3,<0.4" bash scripts/setup.sh
  exec .venv/bin/python scripts/demo_torchtitan.py --line 0.3 "$@"
fi
exec .venv/bin/python -m swap_state.client.demo "$@"
