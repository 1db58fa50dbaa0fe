#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the end-to-end demo.
#   bash scripts/demo.sh [demo flags]      the remote container against an embedded server
#   bash scripts/demo.sh --torchtitan      torchtitan's own trainer on the CPU: killed, resumed
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${1:-}" = "--torchtitan" ]; then
  shift
  exec .venv/bin/python scripts/demo_torchtitan.py "$@"
fi
exec .venv/bin/python -m swap_state.client.demo "$@"
