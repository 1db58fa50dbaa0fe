"""The three rooms' import rules (pyproject's [tool.importlinter] contracts), checked by
import-linter, and the client's exception table against the server's error reasons.

import-linter (grimp) wants each package in a folder of its own under one root, while this
repository maps top-level folders into the ``swap_state`` namespace; the test stages a copy of
the namespace as grimp expects it and runs ``lint-imports`` on it.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
ROOMS = {"common": "common", "proto": "proto", "server": "server", "client": "client"}
LINT_IMPORTS = pathlib.Path(sys.executable).with_name("lint-imports")


def _stage(tmp_path: pathlib.Path) -> pathlib.Path:
    root = tmp_path / "staged"
    package = root / "swap_state"
    shutil.copytree(REPO / "swap_state", package, ignore=shutil.ignore_patterns("__pycache__"))
    for name, folder in ROOMS.items():
        shutil.copytree(REPO / folder, package / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def _lint(root: pathlib.Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", "pyproject.toml"],
        cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120,
    )


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} is missing: install the dev extra (bash scripts/setup.sh)")
    return _stage(tmp_path_factory.mktemp("imports"))


def test_import_contracts_hold(staged: pathlib.Path):
    result = _lint(staged)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout, result.stdout


@pytest.mark.parametrize(
    ("room", "line"),
    [
        ("client", "from swap_state.server import arena"),
        ("server", "import swap_state.client.rpc"),
        ("common", "import grpc"),
        ("common", "from swap_state.server import runtime"),
        ("server", "import torch"),
    ],
)
def test_a_forbidden_import_breaks_a_contract(tmp_path: pathlib.Path, room: str, line: str):
    root = _stage(tmp_path)
    (root / "swap_state" / room / "_forbidden.py").write_text(line + "\n")
    result = _lint(root)
    assert result.returncode != 0 and "BROKEN" in result.stdout.upper(), result.stdout + result.stderr


def test_every_server_reason_has_a_client_exception():
    import swap_state.common.snapshot_errors  # noqa: F401 - defines the snapshot reasons
    from swap_state.client.errors import ERROR_FOR_REASON
    from swap_state.common.errors import DomainError

    reasons, stack = set(), [DomainError]
    while stack:
        cls = stack.pop()
        reasons.add(cls.reason)
        stack.extend(cls.__subclasses__())
    assert reasons <= set(ERROR_FOR_REASON), sorted(reasons - set(ERROR_FOR_REASON))
