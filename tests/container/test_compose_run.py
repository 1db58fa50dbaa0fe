"""compose_run.py without an engine: how it reads compose.yaml (interpolation, merging, the
keys it refuses), the build context it sends, and the ``docker run`` argv it makes from it."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
import yaml

from . import compose_run
from .compose_run import ComposeError, DockerRunProject, IgnoreFile, interpolate
from .harness import SNAPSHOT_DIR, SOCKET_DIR


@pytest.mark.parametrize(("text", "env", "expected"), [
    ("${A:-x}", {}, "x"),
    ("${A:-x}", {"A": ""}, "x"),
    ("${A-x}", {"A": ""}, ""),
    ("${A:-x}", {"A": "y"}, "y"),
    ("${A:--1}", {}, "-1"),
    ("$A/${B}", {"A": "a", "B": "b"}, "a/b"),
    ("$${A}", {"A": "a"}, "${A}"),
    ("${A}", {}, ""),
])
def test_interpolate(text: str, env: dict[str, str], expected: str) -> None:
    assert interpolate(text, env) == expected


def test_interpolate_refuses_what_it_does_not_read() -> None:
    with pytest.raises(ComposeError, match="only"):
        interpolate("${A:?must be set}", {})


def test_merge_maps_key_by_key_and_replaces_lists() -> None:
    base = {"s": {"command": ["a", "b"], "healthcheck": {"interval": "5s", "retries": 3}}}
    override = {"s": {"command": ["c"], "healthcheck": {"interval": "1s"}}}
    assert compose_run.merge(base, override) == {
        "s": {"command": ["c"], "healthcheck": {"interval": "1s", "retries": 3}}}


def test_an_unknown_key_is_refused_naming_it(tmp_path: Path) -> None:
    extra = tmp_path / "extra.yaml"
    extra.write_text(yaml.safe_dump({"services": {"server": {"privileged": True}}}))
    with pytest.raises(ComposeError, match=r"services\.server: privileged not supported"):
        compose_run.load([compose_run.COMPOSE_FILE, extra], env={})


def test_ignore_file_reads_exceptions_as_docker_does() -> None:
    ignore = IgnoreFile(["*", "!src", "**/__pycache__", "!src/__pycache__/keep.pyc"])
    assert ignore.excluded("README.md") and ignore.excluded("venv/lib/x.py")
    assert not ignore.excluded("src") and not ignore.excluded("src/a/b.py")
    assert ignore.excluded("src/a/__pycache__/b.pyc")
    assert not ignore.excluded("src/__pycache__/keep.pyc")
    assert ignore.may_keep_below("src") and not ignore.may_keep_below("venv")


def test_context_tar_holds_the_copied_sources_and_the_dockerfile(tmp_path: Path) -> None:
    for path in ("src/a.py", "src/__pycache__/a.pyc", ".venv/bin/python", "docker/Dockerfile",
                 "notes.txt"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("x")
    (tmp_path / "docker" / "Dockerfile.dockerignore").write_text("*\n!src\n**/__pycache__\n")
    data = compose_run.context_tar(tmp_path, tmp_path / "docker" / "Dockerfile")
    names = tarfile.open(fileobj=io.BytesIO(data)).getnames()
    assert sorted(names) == ["docker/Dockerfile", "src/a.py"]


def test_build_argv_reads_the_build_section() -> None:
    config = compose_run.load(env={"SWAP_STATE_BUILD_NETWORK": "host", "SWAP_STATE_BASE_IMAGE": "b:1"})
    argv, context, dockerfile = compose_run.build_argv(config["services"]["trainer"])
    assert argv[:5] == ["docker", "build", "--tag", "swap-state-trainer:local", "--file"]
    assert argv[5] == "docker/Dockerfile.trainer" and argv[-1] == "-"
    assert "BASE_IMAGE=b:1" in argv and argv[argv.index("--network") + 1] == "host"
    assert context == compose_run.REPO_ROOT and dockerfile.name == "Dockerfile.trainer"


def _flags(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == name]


def test_run_argv_carries_compose_settings() -> None:
    config = compose_run.load(env={"SWAP_STATE_MEMLOCK": "8388608"})
    project = DockerRunProject("p", [compose_run.COMPOSE_FILE])
    shm = project.run_argv(config, "shm", "p-shm-1")
    assert _flags(shm, "--shm-size") == ["2gb"] and _flags(shm, "--ipc") == ["shareable"]
    assert _flags(shm, "--entrypoint") == ["python"] and shm[shm.index("swap-state-server:local") + 1] == "-c"
    server = project.run_argv(config, "server", "p-server-1")
    assert _flags(server, "--ipc") == ["container:p-shm-1"]
    assert _flags(server, "--volume") == [f"p_socket:{SOCKET_DIR}", f"p_snapshots:{SNAPSHOT_DIR}"]
    assert _flags(server, "--ulimit") == ["memlock=8388608:8388608"]
    assert _flags(server, "--stop-timeout") == ["60"]
    assert _flags(server, "--health-cmd")[0].startswith("python -m swap_state.server.healthcheck")
    assert _flags(server, "--health-start-period") == ["60s"]
    assert server[-len(config["services"]["server"]["command"]):] == config["services"]["server"]["command"]
    trainer = project.run_argv(config, "trainer", "t", ["python", "-c", "pass"])
    assert trainer[-4:] == ["swap-state-trainer:local", "python", "-c", "pass"]
    assert f"p_snapshots:{SNAPSHOT_DIR}:ro" in _flags(trainer, "--volume")


@pytest.mark.parametrize(("text", "seconds"), [("60s", 60), ("1m30s", 90), (45, 45), ("2h", 7200)])
def test_seconds(text: str | int, seconds: int) -> None:
    assert compose_run.seconds(text) == seconds
