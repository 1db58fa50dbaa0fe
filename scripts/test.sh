#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# torchtitan 0.3's trainer tests (tests/torchtitan03, tests/adapter03) run 0.3's own trainer in a
# second venv; built once, then reused while pyproject.toml and setup.sh are unchanged. A run of
# chosen test paths that names neither (e.g. `bash scripts/test.sh tests/unit tests/server`) skips it.
# Both venvs are set up at once: pip mostly waits on downloads and unpacking (from a fresh clone
# on the 2-core VM, 87 s together against 61 + 72 s one after the other).
paths=()
for arg in "$@"; do
  if [ -e "${arg%%::*}" ]; then paths+=("$arg"); fi  # a test path (an option's value is none)
done
titan03=""
if [ ${#paths[@]} -eq 0 ] || printf '%s\n' "${paths[@]}" | grep -qE 'torchtitan03|adapter03'; then
  SWAP_STATE_VENV=.venv-titan03 SWAP_STATE_TORCHTITAN="torchtitan>=0.3,<0.4" bash scripts/setup.sh &
  titan03=$!
fi
bash scripts/setup.sh
if [ -n "$titan03" ]; then
  wait "$titan03"  # its failure fails the run (set -e)
fi
# Two workers: most tests wait on the server and trainer processes they start, so a second
# worker fills the idle core (on 2 cores, from a fresh clone, the suite measured 39 min on one
# worker and 23.7 on two). A test file runs on one worker, in order (--dist loadfile): its module
# fixtures serve it once, and the Docker engine of tests/container/test_compose.py is one.
# SWAP_STATE_TEST_WORKERS=0 runs in this process, one test at a time.
exec .venv/bin/python -m pytest -n "${SWAP_STATE_TEST_WORKERS:-2}" --dist loadfile "$@"
