"""The Docker engine and images for the compose scenario (tests/container/test_compose.py).

The engine is the one ``docker info`` reaches, else a private ``dockerd`` that
``scripts/images.sh engine-start`` starts (installing Debian's docker.io where it is missing
and we are root) and ``engine-stop`` stops, by pid. The images are built by
``scripts/images.sh build``: where no registry is reachable it makes a local Debian base and
serves this machine's torch wheel to the build (see that script).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .compose_run import REPO_ROOT

__all__ = ["IMAGES_SH", "EngineUnavailable", "PrivateEngine", "engine_unreachable", "build_images"]

IMAGES_SH = REPO_ROOT / "scripts" / "images.sh"
ENGINE_START_TIMEOUT_S = 300.0  # an apt-get install of docker.io included
ENGINE_STOP_TIMEOUT_S = 180.0
BUILD_TIMEOUT_S = 1200.0  # a local base, torch's wheel and two images, on 2 cores
OUTPUT_TAIL = 4000


class EngineUnavailable(RuntimeError):
    """No engine could be reached or started; the message says why."""


def _images_sh(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    try:
        return subprocess.run(["bash", str(IMAGES_SH), *args], env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        raise TimeoutError(f"scripts/images.sh {' '.join(args)} still running after {timeout:.0f}s:\n"
                           f"{out[-OUTPUT_TAIL:]}") from None


def engine_unreachable() -> str | None:
    """Why no engine answers here, or None when ``docker info`` succeeds."""
    if shutil.which("docker") is None:
        return "docker CLI not found"
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "no Docker engine reachable (`docker info` timed out)"
    if info.returncode != 0:
        last = (info.stderr.strip().splitlines() or ["?"])[-1]
        return f"no Docker engine reachable (`docker info` failed: {last})"
    return None


class PrivateEngine:
    """A dockerd of our own under a temp directory: its socket, data, and an env file
    (DOCKER_HOST and the settings the scenario needs on it)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.env: dict[str, str] = {}
        self.log = ""  # what engine-start said (what it installed, how long it took)

    @classmethod
    def start(cls) -> PrivateEngine:
        # Under /tmp, not pytest's tmp_path: the socket path must stay under 108 bytes.
        engine = cls(Path(tempfile.mkdtemp(prefix="swap-state-engine.")))
        try:
            result = _images_sh("engine-start", str(engine.directory), timeout=ENGINE_START_TIMEOUT_S)
        except TimeoutError as exc:
            engine.stop()
            raise EngineUnavailable(str(exc)) from None
        if result.returncode != 0:
            engine.stop()
            lines = [line for line in result.stdout.strip().splitlines() if line.strip()]
            raise EngineUnavailable(" | ".join(lines[-3:]) or f"engine-start exited {result.returncode}")
        engine.log = result.stdout
        for line in (engine.directory / "engine.env").read_text().splitlines():
            key, _, value = line.partition("=")
            engine.env[key] = value
        return engine

    def stop(self) -> str:
        """Stop it (scripts/images.sh engine-stop); what that said."""
        result = _images_sh("engine-stop", str(self.directory), timeout=ENGINE_STOP_TIMEOUT_S)
        if result.returncode != 0:
            raise RuntimeError(f"scripts/images.sh engine-stop failed:\n{result.stdout[-OUTPUT_TAIL:]}")
        return result.stdout


def build_images() -> str:
    """Both images (scripts/images.sh build); its log, which says what each part took."""
    result = _images_sh("build", timeout=BUILD_TIMEOUT_S)
    if result.returncode != 0:
        raise RuntimeError(f"scripts/images.sh build failed:\n{result.stdout[-OUTPUT_TAIL:]}")
    return result.stdout
