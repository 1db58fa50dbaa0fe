#!/usr/bin/env bash
# The prepared GPU check (issue 22): the CUDA tests and the probe's figures (one JSON line per
# figure, python -m bench.gpu_probe), on a lent machine as it is, in under 6 minutes.
#
#   bash scripts/gpu_check.sh --download   # here, with network: the wheels into .whl/ (ignored)
#   bash scripts/gpu_check.sh              # there: run tool, carry [".whl"] (docs/accelerators.md)
#
# The lent machine has Python 3.12 and its own torch (CUDA 13), no torchtitan, older grpcio and
# protobuf than proto/'s generated code needs, and no network. So everything our code imports
# beyond torch travels as wheels, installed there with --no-index --no-deps --target into a
# temporary folder that goes first on PYTHONPATH (it shadows the older grpcio/protobuf). The
# project is not installed: its folders are staged as the swap_state package with symlinks
# (pyproject.toml maps swap_state.client to client/ and so on).
#
# Environment (defaults in brackets): GPU_CHECK_PYTHON, the python that runs the check
# [python3]; GPU_CHECK_DEVICE [cuda]; GPU_CHECK_WHEELS [.whl]; GPU_CHECK_DOWNLOAD_PYTHON, whose
# pip downloads [.venv/bin/python], and GPU_CHECK_PY_VERSION, for which [3.12]; seconds:
# GPU_CHECK_TOTAL_S for the whole run [345], GPU_CHECK_TEST_TIMEOUT [100] and
# GPU_CHECK_PROBE_TIMEOUT [180] at most for the tests and the probe (each step gets the least of
# its own cap and what is left of the total); GPU_CHECK_PROBE_ARGS, more arguments for the
# probe (--small for a dry run on a CPU).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="${GPU_CHECK_WHEELS:-$REPO/.whl}"
MAX_WHEEL_MIB=60 # .whl travels in the run tool's carry, 64 MiB in all

# Torch-free dependency trees: pip resolves them. Pinned below to the versions of .venv, with
# which the CPU suite passes (and proto/'s generated code runs: grpcio, protobuf).
RESOLVED=(grpcio grpcio-health-checking protobuf prometheus_client safetensors tqdm isal
          typing_extensions docstring_parser typeguard pytest pytest-timeout pytest-asyncio)
# Packages that name torch or heavy trees (datasets, huggingface-hub) among their dependencies:
# these alone; what `import torchtitan.components.optimizer` needs besides is in RESOLVED.
ALONE=(torchtitan tyro tokenizers)
# Installed there only when the machine's python lacks it (torch's environment usually has it).
IF_MISSING=(numpy)

TOTAL_S="${GPU_CHECK_TOTAL_S:-345}" # under 6 minutes, the kills' 5 s grace included

say() { echo "gpu_check: $*" >&2; }
fail() {
    say "$*"
    exit 2
}

cap() { # seconds a step may take: its own cap $1, or what is left of the total, whichever is less
    local left=$((TOTAL_S - SECONDS - 10))
    ((left < 5)) && left=5 # still say how it ended
    echo $(($1 < left ? $1 : left))
}

pinned() { # name==version for each name installed in the download python, the name otherwise
    "$1" -c 'import sys
from importlib import metadata
for name in sys.argv[1:]:
    try:
        print(f"{name}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(name)' "${@:2}"
}

download() {
    local py="${GPU_CHECK_DOWNLOAD_PYTHON:-$REPO/.venv/bin/python}"
    [[ -x $py ]] || py="$(command -v python3)" || fail "no python to download with"
    # Python 3.12 wheels for x86-64 Linux whatever runs this; torch is never resolved.
    local pip=("$py" -m pip download --quiet --disable-pip-version-check --only-binary=:all:
        --python-version "${GPU_CHECK_PY_VERSION:-3.12}" --implementation cp --platform manylinux2014_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
    local resolved alone missing
    mapfile -t resolved < <(pinned "$py" "${RESOLVED[@]}")
    mapfile -t alone < <(pinned "$py" "${ALONE[@]}")
    mapfile -t missing < <(pinned "$py" "${IF_MISSING[@]}")
    rm -rf "$WHEELS" && mkdir -p "$WHEELS/if-missing" || fail "cannot create $WHEELS"
    "${pip[@]}" -d "$WHEELS" "${resolved[@]}" || fail "pip download of ${resolved[*]} failed"
    "${pip[@]}" --no-deps -d "$WHEELS" "${alone[@]}" || fail "pip download of ${alone[*]} failed"
    "${pip[@]}" --no-deps -d "$WHEELS/if-missing" "${missing[@]}" || fail "pip download of ${missing[*]} failed"
    local heavy
    heavy="$(find "$WHEELS" -name '*.whl' -printf '%f ' | tr ' ' '\n' | grep -iE '^(torch|nvidia|triton)[-_]')"
    [[ -z $heavy ]] || fail "a dependency pulled in $heavy: the machine has its own torch"
    local kib
    kib="$(du -sk "$WHEELS" | cut -f1)"
    (cd "$WHEELS" && ls -1 -- *.whl if-missing/*.whl)
    say "$(find "$WHEELS" -name '*.whl' | wc -l) wheels, $((kib / 1024)) MiB in $WHEELS"
    ((kib <= MAX_WHEEL_MIB * 1024)) || fail "$WHEELS is over $MAX_WHEEL_MIB MiB: it must fit the carry"
}

check_device() { # $1 python, $2 device: fail with what is missing
    local out
    out="$(timeout "$(cap 60)" "$1" -W ignore -c 'import sys, torch
device = sys.argv[1]
present = device == "cpu" or (device == "cuda" and torch.cuda.is_available())
print(torch.__version__, torch.version.cuda, present)' "$2" 2>&1)" ||
        fail "cannot import torch with $1 (${out##*$'\n'}): this script runs on the lent accelerator, whose python has torch (GPU_CHECK_PYTHON names another python); here, run the tests as usual"
    [[ $out == *" True" ]] ||
        fail "no $2 device for $1 (torch, CUDA, present: $out): this script runs on the lent accelerator; here, run the tests as usual"
    say "torch, CUDA, $2 present: $out"
}

install_wheels() { # $1 python, $2 target folder
    local wheels=("$WHEELS"/*.whl)
    [[ -e ${wheels[0]} ]] ||
        fail "no wheels in $WHEELS: run 'bash scripts/gpu_check.sh --download' where there is network first, and carry .whl"
    if ! "$1" -c 'import numpy' 2>/dev/null; then
        wheels+=("$WHEELS"/if-missing/*.whl)
    fi
    if "$1" -m pip --version >/dev/null 2>&1; then
        timeout "$(cap 90)" "$1" -m pip install --quiet --disable-pip-version-check --no-index --no-deps \
            --no-compile --target "$2" "${wheels[@]}" || fail "pip install --target $2 of $WHEELS failed"
    else # no pip there: a wheel is a zip of what goes into site-packages
        say "no pip for $1: unpacking the wheels"
        "$1" -c 'import sys, zipfile
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])' "$2" "${wheels[@]}" || fail "unpacking the wheels failed"
    fi
}

stage_package() { # $1 folder that gets swap_state/, as pyproject's package-dir maps it
    mkdir -p "$1/swap_state" || fail "cannot create $1/swap_state"
    ln -s "$REPO/swap_state/__init__.py" "$1/swap_state/__init__.py"
    local room
    for room in common proto server client; do
        ln -s "$REPO/$room" "$1/swap_state/$room"
    done
}

cuda_test_files() { # the test files that ask for CUDA: marked cuda, or named test_*_cuda.py
    (
        cd "$REPO" || exit
        grep -rlE --include='test_*.py' 'pytest\.mark\.cuda' tests
        find tests -name 'test_*_cuda.py'
    ) | sort -u | sed "s|^|$REPO/|"
}

run() {
    local py="${GPU_CHECK_PYTHON:-$(command -v python3 || command -v python)}"
    local device="${GPU_CHECK_DEVICE:-cuda}"
    [[ -n $py ]] || fail "no python3 on PATH (GPU_CHECK_PYTHON names one)"
    check_device "$py" "$device"
    work="$(mktemp -d "${TMPDIR:-/tmp}/swap-state-gpu-check.XXXXXX")" || fail "no temporary folder"
    trap 'rm -rf "$work"' EXIT # global: the trap runs after run() has returned
    install_wheels "$py" "$work/site"
    stage_package "$work/pkg"
    # The repository (for bench/) comes after the staged package, and the check runs from the
    # temporary folder: from the repository's root, its own swap_state/ (no subpackages) would
    # shadow the staged one.
    export PYTHONPATH="$work/site:$work/pkg:$REPO${PYTHONPATH:+:$PYTHONPATH}"
    export SWAP_STATE_DEVICE="$device" # tests/conftest.py pins cpu only where this is unset
    cd "$work" || fail "no $work"
    timeout "$(cap 60)" "$py" -c 'import google.protobuf, grpc, safetensors, torchtitan.components.optimizer
import swap_state.proto.swap_state_pb2_grpc, swap_state.client.remote.container, bench.gpu_probe
print(f"gpu_check: grpcio {grpc.__version__}, protobuf {google.protobuf.__version__}: imports complete")' ||
        fail "the project does not import with the carried wheels (above); fix the lists in $0 and --download again"

    local files tests_rc probe_rc probe_s
    mapfile -t files < <(cuda_test_files)
    ((${#files[@]})) || fail "no test file under tests/ is marked cuda or named test_*_cuda.py"
    say "tests (-m cuda): ${files[*]#"$REPO"/}"
    timeout -k 5 "$(cap "${GPU_CHECK_TEST_TIMEOUT:-100}")" "$py" -m pytest -p no:cacheprovider \
        --rootdir "$REPO" -c "$REPO/pyproject.toml" --continue-on-collection-errors -m cuda -q "${files[@]}"
    tests_rc=$?
    probe_s="$(cap "${GPU_CHECK_PROBE_TIMEOUT:-180}")"
    # shellcheck disable=SC2086 # GPU_CHECK_PROBE_ARGS is a list of words
    timeout -k 5 "$probe_s" "$py" -m bench.gpu_probe --device "$device" \
        --figure-timeout 60 ${GPU_CHECK_PROBE_ARGS:-}
    probe_rc=$?
    if ((probe_rc == 124 || probe_rc == 137)); then
        echo "{\"figure\": \"probe\", \"error\": \"killed after $probe_s s (timeout)\"}"
    fi
    say "tests exit ${tests_rc}, probe exit ${probe_rc} (124/137: timed out)"
    ((tests_rc == 0 && probe_rc == 0))
}

case "${1:-}" in
--download) download ;;
"") run ;;
*) fail "usage: bash scripts/gpu_check.sh [--download]" ;;
esac
