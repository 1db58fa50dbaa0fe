"""tests/adapter03 (the 0.3 adapter's own tests, which import torchtitan 0.3 in-process) run in
the 0.3 venv, from the main suite: one pytest subprocess, its summary shown on failure."""

from __future__ import annotations

import subprocess

import pytest
from titan03_kit import REPO_ROOT

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_the_0_3_adapters_tests_pass_in_the_0_3_venv(titan03_python):
    argv = [str(titan03_python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/adapter03"]
    proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=280, check=False,
                          env=_without_main_venv())  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


def _without_main_venv() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTEST_ADDOPTS")}
