"""The three rooms' import rules (pyproject's [tool.importlinter] contracts), checked by
import-linter, and the client's exception table against the server's error reasons.

import-linter (grimp) wants each package in a folder of its own under one root, while this
repository maps top-level folders into the ``swap_state`` namespace; the test stages a copy of
the namespace as grimp expects it and runs ``lint-imports`` on it.
"""

from __future__ import annotations

import json
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
    assert "4 kept, 0 broken" in result.stdout, result.stdout


@pytest.mark.parametrize(
    ("room", "line"),
    [
        ("client", "from swap_state.server.memory import arena"),
        ("server", "import swap_state.client.remote.rpc"),
        ("common", "import grpc"),
        ("common", "from swap_state.server import runtime"),
        ("server", "import torch"),
        # the server's layers: rpc > observability > snapshot | memory > logs | _posix
        ("server/memory", "from swap_state.server.rpc import service"),
        ("server/memory", "from swap_state.server.snapshot.writing import writer"),
        ("server/snapshot", "from swap_state.server.observability import metrics"),
    ],
)
def test_a_forbidden_import_breaks_a_contract(tmp_path: pathlib.Path, room: str, line: str):
    root = _stage(tmp_path)
    (root / "swap_state" / room / "_forbidden.py").write_text(line + "\n")
    result = _lint(root)
    assert result.returncode != 0 and "BROKEN" in result.stdout.upper(), result.stdout + result.stderr


def _import_cycles(root: pathlib.Path) -> list[list[str]]:
    """Groups of modules that import each other, directly or not: lazy imports inside functions
    and ``if TYPE_CHECKING:`` imports count too (grimp reads every import statement)."""
    code = (
        "import grimp, json, sys\n"
        "g = grimp.build_graph('swap_state')\n"
        "edges = {m: sorted(i for i in g.find_modules_directly_imported_by(m) if i in g.modules) for m in g.modules}\n"
        "json.dump(edges, sys.stdout)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env={"PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    return strongly_connected(json.loads(done.stdout))


def strongly_connected(edges: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_import_cycles(staged: pathlib.Path):
    assert _import_cycles(staged) == []


def test_a_planted_cycle_is_found(tmp_path: pathlib.Path):
    root = _stage(tmp_path)
    (root / "swap_state" / "server" / "_a.py").write_text("def f():\n    from swap_state.server import _b\n")
    (root / "swap_state" / "server" / "_b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from swap_state.server import _a\n")
    assert _import_cycles(root) == [["swap_state.server._a", "swap_state.server._b"]]


def test_every_reason_reaches_the_client_with_its_status_code():
    """A class that shares another's reason (SnapshotInvalid: INVALID_ARGUMENT) reaches the
    client as the class that declared it first: it must answer with the same status code."""
    import swap_state.common.snapshot_errors  # noqa: F401 - defines the snapshot reasons
    from swap_state.client.errors import ERROR_FOR_REASON
    from swap_state.common.errors import SwapStateError

    stack, seen = [SwapStateError], []
    while stack:
        cls = stack.pop()
        seen.append(cls)
        stack.extend(cls.__subclasses__())
    for cls in seen:
        if isinstance(cls.reason, str):
            assert ERROR_FOR_REASON[cls.reason].code == cls.code, cls
