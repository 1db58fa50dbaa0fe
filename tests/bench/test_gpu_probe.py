"""The prepared GPU check, tested where there is no GPU: every figure of ``bench.gpu_probe``
runs on the CPU backend at toy sizes and prints one JSON line with its keys; the device's
counters and registration calls are stubbed (a fake allocator module, a counting backend);
a figure that raises or hangs prints an error line and the next one still runs;
``scripts/gpu_check.sh`` parses, its run mode says what is missing on a machine without
torch, CUDA or wheels, and its download mode asks pip for Python 3.12 wheels and never torch.
The conftest's device pinning is checked here too."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import time
from typing import Any, ClassVar

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
# The benchmarks are run from the repository's root (python -m bench...), which pytest does not
# put on sys.path; without it, ``bench`` would be this folder (tests/ is on sys.path) as a
# namespace package. Appended: the repository's own swap_state/ must not shadow the installed one.
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))
if getattr(sys.modules.get("bench"), "__file__", "") is None:
    del sys.modules["bench"]

from swap_state.client import device
from swap_state.client.device import DEVICE_ENV_VAR, DeviceBackend

from bench import gpu_probe
from bench.gpu_probe import FIGURES, SMALL, DeviceMemory, Probe, run_figures

SCRIPT = REPO / "scripts" / "gpu_check.sh"

# The keys each figure's line must carry besides figure, device and seconds.
EXPECTED: dict[str, set[str]] = {
    "environment": {"python", "torch", "cuda", "sizes", "dev_shm_free_bytes"},
    "register_shm": {"bytes", "one_registration", "chunked"},
    "copy_bandwidth": {"bytes", "pinned", "shm_one_registration", "shm_chunked", "pin_memory"},
    "peak_memory_inproc": {"params", "moments_bytes", "swap_times", "slice_bytes", "step_peak_bytes",
                           "peak_over_moments", "peak_over_slice"},
    "peak_memory_remote": {"params", "moments_bytes", "swap_times", "slice_bytes", "step_peak_bytes",
                           "peak_over_moments", "peak_over_slice"},
    "parity_fused_adamw": {"steps", "params", "inproc", "remote"},
    "step_while_snapshot": {"params", "snapshots", "steps_with", "with_opt_s", "without_opt_s", "ratio_opt",
                            "snapshot_call_s", "snapshot_to_durable_while_training_s"},
    "fingerprint": {"shape", "dtype", "samples", "last_sample_index", "compute_s", "matches_host"},
}  # fmt: skip


@pytest.fixture
def probe(tmp_path: pathlib.Path, private_shm_dir: str) -> Probe:
    return Probe(DeviceBackend("cpu"), SMALL, str(tmp_path), private_shm_dir)


def _lines(probe: Probe, names: list[str], timeout_s: float = 60.0) -> tuple[int, list[dict[str, Any]]]:
    out = io.StringIO()
    failed = run_figures(probe, names, timeout_s, out)
    return failed, [json.loads(line) for line in out.getvalue().splitlines()]


def test_every_figure_has_expected_keys():
    assert set(EXPECTED) == set(FIGURES)


@pytest.mark.parametrize("name", list(FIGURES))
def test_each_figure_prints_one_json_line_on_cpu(probe: Probe, name: str):
    failed, lines = _lines(probe, [name])
    assert failed == 0 and len(lines) == 1, lines
    line = lines[0]
    assert "error" not in line, line["error"]
    assert line["figure"] == name and line["device"] == "cpu" and line["seconds"] >= 0
    assert EXPECTED[name] <= set(line), EXPECTED[name] - set(line)


def test_the_cpu_figures_say_what_they_can(probe: Probe):
    """Values, not only keys: CPU runs both containers bitwise equal to fused AdamW, the
    fingerprint is the host's, and there is no device memory counter to report."""
    _, lines = _lines(probe, ["parity_fused_adamw", "fingerprint", "peak_memory_inproc"])
    parity, fp, peak = lines
    assert parity["inproc"] == {"bitwise_equal": True, "max_abs_diff": 0.0}
    assert parity["remote"] == {"bitwise_equal": True, "max_abs_diff": 0.0}
    assert fp["matches_host"] and fp["last_sample_index"] < math.prod(fp["shape"])
    assert peak["step_peak_bytes"] is None and peak["moments_bytes"] == 8 * peak["params"]


class _FakeAllocator:
    """The calls of ``torch.cuda`` that :class:`DeviceMemory` makes: 1000 bytes live, and a
    peak of 1000 plus what the test says a step added."""

    def __init__(self, step_bytes: int) -> None:
        self.step_bytes = step_bytes
        self.calls: list[str] = []

    def synchronize(self) -> None:
        self.calls.append("synchronize")

    def reset_peak_memory_stats(self) -> None:
        self.calls.append("reset")

    def memory_allocated(self) -> int:
        return 1000

    def max_memory_allocated(self) -> int:
        return 1000 + self.step_bytes


def test_peak_memory_arithmetic_with_a_stubbed_cuda_allocator(tmp_path: pathlib.Path, private_shm_dir: str):
    moments = 8 * SMALL.params  # build_model(SMALL.params) has exactly that many parameters
    allocator = _FakeAllocator(step_bytes=moments // 2)
    meter = DeviceMemory(DeviceBackend("cuda", module=allocator))  # type: ignore[arg-type]
    probe = Probe(DeviceBackend("cpu"), SMALL, str(tmp_path), private_shm_dir, memory=meter)
    _, (line,) = _lines(probe, ["peak_memory_inproc"])
    assert line["moments_bytes"] == moments and line["step_peak_bytes"] == moments // 2
    assert line["peak_over_moments"] == 0.5 and line["peak_over_slice"] == 0.5 * SMALL.swap_times
    assert allocator.calls.count("reset") == 2 and "synchronize" in allocator.calls


class _CountingBackend(DeviceBackend):
    """A CPU backend that records each chunk the device would have been asked to register."""

    registered: ClassVar[list[int]] = []

    def _register_chunk(self, ptr: int, nbytes: int) -> int:
        type(self).registered.append(nbytes)
        return 0


def test_registration_goes_through_the_backend_in_chunks(tmp_path: pathlib.Path, private_shm_dir: str, monkeypatch):
    monkeypatch.setattr(_CountingBackend, "registered", [])
    probe = Probe(_CountingBackend("cpu"), SMALL, str(tmp_path), private_shm_dir)
    _, (line,) = _lines(probe, ["register_shm"])
    chunks = SMALL.shm_bytes // SMALL.chunk_bytes
    assert line["one_registration"]["chunks"] == 1 and line["chunked"]["chunks"] == chunks
    assert _CountingBackend.registered == [SMALL.shm_bytes] + [SMALL.chunk_bytes] * chunks


def test_a_failing_and_a_hung_figure_print_errors_and_the_rest_run(probe: Probe, monkeypatch):
    def boom(p: Probe) -> dict[str, Any]:
        raise RuntimeError("no device")

    def hang(p: Probe) -> dict[str, Any]:
        time.sleep(30)
        return {}

    monkeypatch.setitem(FIGURES, "boom", boom)
    monkeypatch.setitem(FIGURES, "hang", hang)
    monkeypatch.setitem(FIGURES, "ok", lambda p: {"value": float("nan"), "n": 1})
    t0 = time.monotonic()
    failed, lines = _lines(probe, ["boom", "hang", "ok"], timeout_s=0.3)
    assert time.monotonic() - t0 < 5 and failed == 2
    assert lines[0]["error"] == "RuntimeError: no device"
    assert lines[1]["error"].startswith("FigureTimeout: ran past its 0.3 s deadline")
    assert lines[2] == {"figure": "ok", "device": "cpu", "value": None, "n": 1, "seconds": lines[2]["seconds"]}


def test_main_prints_the_named_figures_and_fails_when_one_fails(private_shm_dir: str, capsys, monkeypatch):
    argv = ["--device", "cpu", "--small", "--shm-dir", private_shm_dir, "--only", "fingerprint"]
    assert gpu_probe.main(argv) == 0
    (line,) = [json.loads(text) for text in capsys.readouterr().out.splitlines()]
    assert line["figure"] == "fingerprint" and line["shape"] == list(SMALL.fingerprint_shape)
    monkeypatch.setitem(FIGURES, "fingerprint", lambda p: 1 / 0)
    assert gpu_probe.main(argv) == 1
    assert "ZeroDivisionError" in capsys.readouterr().out


# -- the device pinning of tests/conftest.py ---------------------------------------------------------
def _root_conftest() -> Any:
    spec = importlib.util.spec_from_file_location("root_conftest_under_test", REPO / "tests" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_the_suite_runs_with_a_pinned_backend():
    conftest = _root_conftest()
    assert conftest.DEVICE_ENV_VAR == DEVICE_ENV_VAR
    # Set by tests/conftest.py for the session, or by the caller (gpu_check.sh: cuda).
    assert os.environ.get(DEVICE_ENV_VAR) in ("cpu", "cuda", "npu")


def test_files_named_for_a_device_ask_for_it():
    class Item:
        def __init__(self, path: str) -> None:
            self.path = pathlib.Path(path)
            self.markers: list[str] = []

        def add_marker(self, marker: str) -> None:
            self.markers.append(marker)

    items = [Item("tests/integration/test_whole_state_cuda.py"), Item("tests/x/test_y_npu.py"), Item("tests/test_cudax.py")]
    _root_conftest().pytest_collection_modifyitems(None, items)
    assert [item.markers for item in items] == [["cuda"], ["npu"], []]


@pytest.mark.cuda
def test_a_test_marked_cuda_gets_the_cuda_backend():
    """Skipped by tests/conftest.py where CUDA is absent, saying so (the marker asks for it)."""
    assert os.environ[DEVICE_ENV_VAR] == "cuda" and device.get_device_backend().type == "cuda"


# -- scripts/gpu_check.sh ----------------------------------------------------------------------------
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
case "$1" in
-W) echo "$FAKE_TORCH"; exit "${FAKE_RC:-0}" ;;  # the device check
-c) shift 2; printf '%s\\n' "$@"; exit 0 ;;      # the version pins: names as they are
esac
while (($#)); do  # pip download ... -d DIR
    if [[ $1 == -d ]]; then head -c 1024 /dev/zero > "$2/${FAKE_WHEEL:-fake-1.0-py3-none-any.whl}"; fi
    shift
done
"""


def _script(tmp_path: pathlib.Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    full = {"PATH": os.environ["PATH"], "FAKE_LOG": str(tmp_path / "log"), "GPU_CHECK_PYTHON": str(fake),
            "GPU_CHECK_DOWNLOAD_PYTHON": str(fake), "GPU_CHECK_WHEELS": str(tmp_path / "wheels"), **env}  # fmt: skip
    return subprocess.run(["bash", str(SCRIPT), *args], check=False, env=full, capture_output=True, text=True, timeout=30)


def test_the_script_parses():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], check=False, capture_output=True, text=True, timeout=10)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("torch_says", "rc", "message"),
    [
        ("ModuleNotFoundError: No module named 'torch'", "1", "cannot import torch with"),
        ("2.11.0 13.0 False", "0", "no cuda device for"),
        ("2.11.0 13.0 True", "0", "run 'bash scripts/gpu_check.sh --download' where there is network first"),
    ],
)
def test_the_run_mode_says_what_is_missing(tmp_path: pathlib.Path, torch_says: str, rc: str, message: str):
    result = _script(tmp_path, FAKE_TORCH=torch_says, FAKE_RC=rc)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_the_download_mode_asks_for_python_312_wheels_and_never_torch(tmp_path: pathlib.Path):
    result = _script(tmp_path, "--download")
    assert result.returncode == 0, result.stderr
    assert re.search(r"gpu_check: \d+ wheels, 0 MiB in ", result.stderr), result.stderr
    downloads = [line.split() for line in (tmp_path / "log").read_text().splitlines() if " download " in line]
    assert len(downloads) == 3
    for words in downloads:
        for flag in ("--only-binary=:all:", "manylinux2014_x86_64", "manylinux_2_28_x86_64", "cp"):
            assert flag in words
        assert words[words.index("--python-version") + 1] == "3.12"
        assert not [word for word in words if word.split("==")[0].split(">")[0] in ("torch", "triton")]
    everything = {word.split("==")[0] for words in downloads for word in words}
    assert {"grpcio", "protobuf", "safetensors", "torchtitan", "numpy", "pytest"} <= everything
    assert "--no-deps" in downloads[1] and "torchtitan" in downloads[1]


def test_the_download_mode_refuses_a_torch_wheel(tmp_path: pathlib.Path):
    result = _script(tmp_path, "--download", FAKE_WHEEL="torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl")
    assert result.returncode == 2 and "pulled in torch-2.11.0" in result.stderr, result.stderr
