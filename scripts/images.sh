#!/usr/bin/env bash
# Builds both images (docker/compose.yaml) and runs the compose scenario for real, also on a
# machine with no Docker engine running and no container registry (CI's: PyPI and Debian only).
#
#   bash scripts/images.sh              engine (a private dockerd when none answers), images,
#                                       then the scenario (tests/container/test_compose.py);
#                                       stops what it started
#   bash scripts/images.sh build        the images only, on the engine DOCKER_HOST reaches
#   bash scripts/images.sh engine-start DIR   a private dockerd under DIR (DIR/engine.env: its
#                                             DOCKER_HOST and settings); tests/container uses it
#   bash scripts/images.sh engine-stop DIR    stops it, by pid, and removes DIR
#
# Extra arguments after the default command go to pytest. The parts and what they need are in
# scripts/images/engine.sh and scripts/images/build.sh; each part prints how long it took.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "images.sh: $*" >&2; }

if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHON

# shellcheck source=scripts/images/engine.sh
source scripts/images/engine.sh
# shellcheck source=scripts/images/build.sh
source scripts/images/build.sh

# Everything this run started, stopped on any exit: the wheel index (by pid), the private
# engine (by pid, in engine_stop), the temp folder.
WORK=$(mktemp -d /tmp/swap-state-images.XXXXXX)
ENGINE_DIR=
INDEX_PID=
cleanup() {
  local rc=$?
  stop_torch_index
  if [ -n "$ENGINE_DIR" ]; then engine_stop "$ENGINE_DIR"; fi
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

run_all() {
  local started=$SECONDS
  if ! timeout 30 docker info >/dev/null 2>&1; then
    ENGINE_DIR=$(mktemp -d /tmp/swap-state-engine.XXXXXX)
    engine_start "$ENGINE_DIR"
    set -a
    # shellcheck disable=SC1091  # written by engine_start
    source "$ENGINE_DIR/engine.env"
    set +a
  fi
  # The scenario's own fixture builds the images (scripts/images.sh build), then runs every
  # step; SWAP_STATE_REQUIRE_DOCKER turns its skip (no engine) into a failure.
  SWAP_STATE_REQUIRE_DOCKER=1 "$PYTHON" -m pytest -p no:cacheprovider -m docker \
    tests/container/test_compose.py "$@"
  log "all: $((SECONDS - started))s"
}

case "${1:-all}" in
  all) shift $(($# > 0 ? 1 : 0)); run_all "$@" ;;
  build) images_build ;;
  # A start that fails half way is stopped by the EXIT trap; one that succeeds stays up.
  engine-start) ENGINE_DIR=${2:?engine-start needs a directory}; engine_start "$ENGINE_DIR"; ENGINE_DIR= ;;
  engine-stop) engine_stop "${2:?engine-stop needs a directory}" ;;
  -*) run_all "$@" ;;
  *) echo "usage: bash scripts/images.sh [all [PYTEST_ARGS...] | build | engine-start DIR | engine-stop DIR]" >&2; exit 2 ;;
esac
