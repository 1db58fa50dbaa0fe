#!/usr/bin/env bash
# Sets up what the replica-transport benchmark needs and runs it (python -m bench.transport):
#   .venv (scripts/setup.sh: grpcio, numpy, the project's crc32),
#   Debian's libibverbs1 (Mooncake's engine links it, even for its TCP transport),
#   .venv-mooncake: a separate venv holding Mooncake Transfer Engine (never added to .venv).
# Arguments go to the benchmark, e.g.
#   bash scripts/bench_transport.sh --pin both --out results/transport
#   SWAP_STATE_MOONCAKE=0 bash scripts/bench_transport.sh      # no Mooncake set-up (its rows: skipped)
# SWAP_STATE_MOONCAKE_PACKAGE picks the wheel: the default 'mooncake-transfer-engine' wheel links
# libcudart.so.12 and does not import without CUDA, so the CPU one is the default here; on a CUDA
# host use mooncake-transfer-engine (or -cuda13), on Ascend mooncake-transfer-engine-npu.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
say() { echo "bench_transport: $*" >&2; }
MOONCAKE="${SWAP_STATE_MOONCAKE:-1}"
PACKAGE="${SWAP_STATE_MOONCAKE_PACKAGE:-mooncake-transfer-engine-non-cuda}"
VENV=.venv-mooncake
if [ "$MOONCAKE" != "0" ]; then
  if ! ldconfig -p | grep -q 'libibverbs\.so\.1 '; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      say "installing libibverbs1 (apt-get)"
      { apt-get install -y -q libibverbs1 || { apt-get update -q && apt-get install -y -q libibverbs1; }; } >&2
    else
      say "libibverbs1 is missing and cannot be installed here (needs root and apt-get): Mooncake will be skipped"
    fi
  fi
  stamp="$VENV/.swap-state-installed"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$PACKAGE" ]; then
    say "creating $VENV with $PACKAGE (a separate venv; .venv is left as it is)"
    "${PYTHON:-python3}" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$PACKAGE" numpy isal 2>&1 \
      | { grep -v "is ignored: it is neither a file nor a directory" || true; }
    echo "$PACKAGE" > "$stamp"
  fi
  exec .venv/bin/python -m bench.transport --mooncake-python "$VENV/bin/python" "$@"
fi
exec .venv/bin/python -m bench.transport --no-mooncake "$@"
