"""The scenario's stack on a real Docker engine: docker/compose.yaml plus a small override.

Driven by the compose plugin (``docker compose``) where it is installed, else by compose_run.py,
which runs the same file as plain ``docker`` commands (why: see there).

The override only sizes /dev/shm and --shm-size for the test and binds the snapshot and
trainer-state volumes to host directories the test can read; everything else (images, ipc,
volumes, users, healthcheck) is compose.yaml's own.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from pathlib import Path

import yaml

from .compose_run import COMPOSE_FILE, DockerRunProject
from .scenario import server_args

__all__ = ["COMPOSE_FILE", "compose_plugin", "ComposeStack", "ComposePlugin", "DockerService"]

CLI_TIMEOUT_S = 120.0


def _run(argv: Sequence[str], timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)


@functools.cache
def compose_plugin() -> bool:
    """Whether ``docker compose`` (v2) is installed; else compose_run drives compose.yaml."""
    try:
        return _run(["docker", "compose", "version"], timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _exit_status(code: int) -> int:
    # Docker reports death by signal N as 128 + N; the scenario uses subprocess's -N.
    return -(code - 128) if 128 < code <= 128 + 64 else code


class DockerService:
    """One container, by id or name."""

    def __init__(self, ref: str, name: str) -> None:
        self.ref = ref
        self.name = name

    def _inspect(self, template: str) -> str:
        return _run(["docker", "inspect", "-f", template, self.ref]).stdout.strip()

    def poll(self) -> int | None:
        status, code = self._inspect("{{.State.Status}} {{.State.ExitCode}}").split()
        return _exit_status(int(code)) if status in ("exited", "dead") else None

    def wait(self, timeout: float) -> int:
        try:
            result = _run(["docker", "wait", self.ref], timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{self.name} still running after {timeout:.1f}s") from None
        return _exit_status(int(result.stdout.strip()))

    def kill(self) -> None:
        _run(["docker", "kill", "--signal", "KILL", self.ref])

    def stop(self, timeout: float) -> int:
        _run(["docker", "stop", "--time", str(int(timeout)), self.ref], timeout=timeout + CLI_TIMEOUT_S)
        return self.wait(CLI_TIMEOUT_S)

    def pause(self) -> None:
        _run(["docker", "pause", self.ref])

    def resume(self) -> None:
        _run(["docker", "unpause", self.ref])

    @property
    def logs(self) -> str:
        result = _run(["docker", "logs", self.ref])
        return result.stdout + result.stderr

    def health(self) -> str:
        return self._inspect("{{if .State.Health}}{{.State.Health.Status}}{{end}}")


class ComposePlugin:
    """A compose project driven by the ``docker compose`` plugin (compose v2)."""

    def __init__(self, project: str, files: Sequence[Path]) -> None:
        self.project = project
        self.files = list(files)

    def compose(self, *args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        argv = ["docker", "compose", *[a for f in self.files for a in ("-f", str(f))], "-p", self.project, *args]
        result = _run(argv, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed:\n{result.stdout}{result.stderr}")
        return result

    def up(self, service: str, recreate: bool = False) -> str:
        self.compose("up", "--detach", "--no-build", "--no-deps", *(["--force-recreate"] if recreate else []), service)
        return self.compose("ps", "--all", "--quiet", service).stdout.split()[0]

    def run(self, service: str, name: str, command: Sequence[str] | None) -> str:
        return self.compose("run", "--detach", "--no-deps", "--name", name, service, *(command or [])).stdout.strip()

    def down(self) -> None:
        _run(["docker", "compose", *[a for f in self.files for a in ("-f", str(f))], "-p", self.project,
              "down", "--volumes", "--remove-orphans", "--timeout", "5"])


#: The user the images run as (docker/Dockerfile.server, Dockerfile.trainer).
IMAGE_UID = 10001


class ComposeStack:
    """A throw-away compose project (its own name, containers and volumes), driven by the
    compose plugin where it is installed, else by compose_run (compose.yaml as docker commands)."""

    def __init__(self, shm_size: str | None, workdir: Path) -> None:
        """``shm_size``: the shared /dev/shm's size; None keeps compose.yaml's own sizes, and
        its healthcheck timing, as ``docker compose up`` runs them."""
        project = f"swapstate-test-{uuid.uuid4().hex[:8]}"
        self.shm_size = shm_size
        self.workdir = workdir
        self.snapshot_dir = workdir / "snapshots"
        self.state_dir = workdir / "trainer-state"
        for path in (self.snapshot_dir, self.state_dir, self.state_dir / "ckpt"):
            path.mkdir(parents=True, exist_ok=True)
            # The images' user writes here, and the server refuses a --snapshot-dir that other
            # users can write: the directories are that user's (the engine runs as root here).
            os.chown(path, IMAGE_UID, IMAGE_UID)
            os.chmod(path, 0o755)
        self.override = workdir / "compose.override.yaml"
        files = [COMPOSE_FILE, self.override]
        self.project: ComposePlugin | DockerRunProject = (
            ComposePlugin(project, files) if compose_plugin() else DockerRunProject(project, files))
        self._count = 0

    def _write_override(self, server_shm_size: str) -> None:
        def bind(path: Path) -> dict[str, object]:
            return {"driver": "local", "driver_opts": {"type": "none", "o": "bind", "device": str(path)}}

        services: dict[str, object] = {"server": {"command": server_args(server_shm_size)}}
        if self.shm_size is not None:
            # Health probed every second, not 5: each step starts a server or two and waits
            # for it to turn healthy. The probe itself is compose.yaml's.
            services = {"shm": {"shm_size": self.shm_size},
                        "server": {"command": server_args(server_shm_size), "healthcheck": {"interval": "1s"}}}
        self.override.write_text(yaml.safe_dump({
            "services": services,
            "volumes": {"snapshots": bind(self.snapshot_dir), "trainer-state": bind(self.state_dir)},
        }))

    def start_server(self, shm_size: str) -> DockerService:
        self._write_override(shm_size)
        # The /dev/shm holder (service shm) is started once and stays, as a pod's emptyDir
        # does; each server is a new container joining it.
        self.project.up("shm")
        return DockerService(self.project.up("server", recreate=True), "server")

    def healthy(self, server: object) -> bool:
        assert isinstance(server, DockerService)
        return server.health() == "healthy"

    def start_trainer(self, cmd: Sequence[str] | None) -> DockerService:
        """A trainer container running ``cmd`` (None: compose.yaml's command)."""
        self._count += 1
        name = f"{self.project.project}-trainer-{self._count}"
        self.project.run("trainer", name, cmd)
        return DockerService(name, name)

    def server_stopped(self) -> None:
        """A /dev/shm lost with the server (the harness's reset): recreate the holder."""
        self.project.up("shm", recreate=True)

    def close(self) -> None:
        if self.override.exists():
            self.project.down()
        shutil.rmtree(self.workdir, ignore_errors=True)
