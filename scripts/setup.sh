#!/usr/bin/env bash
# Creates .venv and installs swap-state with its client, torchtitan and dev extras.
# torch is installed first, pinned, so nothing later can resolve a newer (CUDA, multi-GB) build.
# Idempotent: a second run only reinstalls when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${SWAP_STATE_TORCH_VERSION:-2.13.0}"
VENV="${SWAP_STATE_VENV:-.venv}"
# The torchtitan line this venv gets (the torchtitan extra admits 0.2 and 0.3; a venv holds one).
# scripts/test.sh builds a second venv with 0.3 for its trainer tests (tests/torchtitan03).
TORCHTITAN="${SWAP_STATE_TORCHTITAN:-torchtitan>=0.2,<0.3}"

say() { echo "setup ($VENV): $*" >&2; }
if [ ! -x "$VENV/bin/python" ]; then
  say "creating the virtual environment"
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.swap-state-installed"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1) torch==$TORCH_VERSION $TORCHTITAN"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# pip warns once per package about this machine's unused local index folders: noise, dropped.
pip_install() {
  "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}
say "installing torch $TORCH_VERSION (pinned; about a minute)"
pip_install "torch==$TORCH_VERSION"
# The constraint keeps every later resolution on the torch just installed.
constraint="$VENV/torch-constraint.txt"
printf '%s\n' "torch==$TORCH_VERSION" "$TORCHTITAN" > "$constraint"
say "installing swap-state with its client, torchtitan and dev extras ($TORCHTITAN; one to two minutes)"
pip_install -c "$constraint" -e ".[client,torchtitan,dev]"
echo "$want" > "$stamp"
say "done"
