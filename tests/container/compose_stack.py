"""The scenario's stack on a real Docker engine: docker/compose.yaml plus a small override.

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

from .harness import REPO_ROOT
from .scenario import server_args

__all__ = ["COMPOSE_FILE", "docker_unavailable", "build_images", "ComposeStack", "DockerService"]

COMPOSE_FILE = REPO_ROOT / "docker" / "compose.yaml"
CLI_TIMEOUT_S = 120.0
BUILD_TIMEOUT_S = 1800.0


def _run(argv: Sequence[str], timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)


@functools.cache
def docker_unavailable() -> str | None:
    """Why the compose scenario cannot run here, or None."""
    if shutil.which("docker") is None:
        return "docker CLI not found"
    try:
        info = _run(["docker", "info"], timeout=30)
    except subprocess.TimeoutExpired:
        return "no Docker engine reachable (`docker info` timed out)"
    if info.returncode != 0:
        last = (info.stderr.strip().splitlines() or ["?"])[-1]
        return f"no Docker engine reachable (`docker info` failed: {last})"
    if _run(["docker", "compose", "version"], timeout=30).returncode != 0:
        return "the docker compose plugin is not installed"
    return None


def build_images() -> None:
    build = _run(["docker", "compose", "-f", str(COMPOSE_FILE), "build"], timeout=BUILD_TIMEOUT_S)
    if build.returncode != 0:
        raise RuntimeError(f"docker compose build failed:\n{build.stdout[-4000:]}{build.stderr[-4000:]}")


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


class ComposeStack:
    """A throw-away compose project (its own name, containers and volumes)."""

    def __init__(self, shm_size: str, workdir: Path) -> None:
        self.project = f"swapstate-test-{uuid.uuid4().hex[:8]}"
        self.shm_size = shm_size
        self.workdir = workdir
        self.snapshot_dir = workdir / "snapshots"
        self.state_dir = workdir / "trainer-state"
        for path in (self.snapshot_dir, self.state_dir, self.state_dir / "ckpt"):
            path.mkdir(parents=True, exist_ok=True)
            os.chmod(path, 0o777)  # the images' user (10001) writes here
        self.override = workdir / "compose.override.yaml"
        self._count = 0

    def _write_override(self, server_shm_size: str) -> None:
        def bind(path: Path) -> dict[str, object]:
            return {"driver": "local", "driver_opts": {"type": "none", "o": "bind", "device": str(path)}}

        self.override.write_text(yaml.safe_dump({
            "services": {"shm": {"shm_size": self.shm_size},
                         "server": {"command": server_args(server_shm_size)}},
            "volumes": {"snapshots": bind(self.snapshot_dir), "trainer-state": bind(self.state_dir)},
        }))

    def compose(self, *args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        argv = ["docker", "compose", "-f", str(COMPOSE_FILE), "-f", str(self.override),
                "-p", self.project, *args]
        result = _run(argv, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed:\n{result.stdout}{result.stderr}")
        return result

    def start_server(self, shm_size: str) -> DockerService:
        self._write_override(shm_size)
        # The /dev/shm holder (service shm) is started once and stays, as a pod's emptyDir
        # does; each server is a new container joining it.
        self.compose("up", "--detach", "--no-build", "shm")
        self.compose("up", "--detach", "--no-build", "--force-recreate", "--no-deps", "server")
        container_id = self.compose("ps", "--all", "--quiet", "server").stdout.split()[0]
        return DockerService(container_id, "server")

    def healthy(self, server: object) -> bool:
        assert isinstance(server, DockerService)
        return server.health() == "healthy"

    def start_trainer(self, cmd: Sequence[str]) -> DockerService:
        self._count += 1
        name = f"{self.project}-trainer-{self._count}"
        self.compose("run", "--detach", "--no-deps", "--name", name, "trainer", *cmd)
        return DockerService(name, name)

    def server_stopped(self) -> None:
        """A /dev/shm lost with the server (the harness's reset): recreate the holder."""
        self.compose("up", "--detach", "--no-build", "--force-recreate", "shm")

    def close(self) -> None:
        if self.override.exists():
            _run(["docker", "compose", "-f", str(COMPOSE_FILE), "-f", str(self.override),
                  "-p", self.project, "down", "--volumes", "--remove-orphans", "--timeout", "5"])
        shutil.rmtree(self.workdir, ignore_errors=True)
