"""docker/compose.yaml's services as plain ``docker`` commands, for engines without compose v2.

Why: compose v2 (``docker compose``) is not packaged for Debian bookworm, Debian's compose v1
(1.29, end of life) rejects compose.yaml's top-level ``name:``, and PyPI has v2 only as a third
party's repackaging of a binary; CI, which reaches only PyPI and Debian, would have to run such
a binary as root. So where the plugin is missing the scenario runs compose.yaml itself through
this small reader: the same images, build arguments, commands, ``ipc``, ``shm_size``, volumes,
ulimits, healthcheck and stop grace period, as ``docker build`` / ``docker run`` argv. It reads
only the keys compose.yaml uses and refuses any other, naming it, so the file cannot grow a
setting that is silently dropped here.

Also a script (``scripts/images.sh`` runs it; python3 with PyYAML, nothing else):
``python tests/container/compose_run.py build [SERVICE...]`` builds the images as
``docker compose build`` would, with the build context filtered by each Dockerfile's
``<Dockerfile>.dockerignore`` and sent as a tar, so that Docker's legacy builder (no buildx
plugin, no registry for a BuildKit frontend) builds the same small context BuildKit would.
"""

from __future__ import annotations

import io
import os
import re
import shlex
import subprocess
import sys
import tarfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "docker" / "compose.yaml"
BUILD_TIMEOUT_S = 1500.0
CLI_TIMEOUT_S = 120.0

# What this reader understands; anything else in compose.yaml is an error naming the key.
SERVICE_KEYS = {"build", "image", "entrypoint", "command", "shm_size", "ipc", "depends_on",
                "volumes", "ulimits", "healthcheck", "stop_grace_period"}
BUILD_KEYS = {"context", "dockerfile", "args", "network"}
VOLUME_KEYS = {"driver", "driver_opts"}
TOP_KEYS = {"name", "services", "volumes"}

_VARIABLE = re.compile(r"\$(?:\$|\{(\w+)(?:(:?-)([^}]*))?\}|(\w+))")


class ComposeError(ValueError):
    """compose.yaml uses something this reader does not do; the message names it."""


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``$VAR`` and ``$$``."""
    def one(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        name = match[1] or match[4]
        value = env.get(name)
        if match[2] == ":-" and not value:
            return match[3]
        if match[2] == "-" and value is None:
            return match[3]
        return value or ""

    if re.search(r"\$\{\w+:?[?+]", text):
        raise ComposeError(f"{text!r}: only ${{VAR}}, ${{VAR:-default}} and ${{VAR-default}} are read here")
    return _VARIABLE.sub(one, text)


def _interpolate_tree(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolate_tree(item, env) for item in node]
    if isinstance(node, dict):
        return {key: _interpolate_tree(value, env) for key, value in node.items()}
    return node


def merge(base: Any, override: Any) -> Any:
    """compose's merge of a later file: mappings merge key by key, anything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        return {key: merge(base[key], value) if key in base else value
                for key, value in {**base, **override}.items()}
    return override


def _check_keys(where: str, found: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(found) - allowed)
    if unknown:
        raise ComposeError(f"{where}: {', '.join(unknown)} not supported by tests/container/compose_run.py; "
                           f"run the scenario with the docker compose plugin, or teach compose_run.py the key")


def load(files: Sequence[Path] = (COMPOSE_FILE,), env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The files merged in order and interpolated from ``env`` (default: os.environ)."""
    merged: dict[str, Any] = {}
    for path in files:
        merged = merge(merged, yaml.safe_load(Path(path).read_text()))
    config = _interpolate_tree(merged, os.environ if env is None else env)
    _check_keys("top level", config, TOP_KEYS)
    for name, service in config["services"].items():
        _check_keys(f"services.{name}", service, SERVICE_KEYS)
        _check_keys(f"services.{name}.build", service.get("build") or {}, BUILD_KEYS)
    for name, volume in (config.get("volumes") or {}).items():
        _check_keys(f"volumes.{name}", volume or {}, VOLUME_KEYS)
    return config


# -- build ------------------------------------------------------------------------------------

def _glob(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go's filepath.Match, plus ``**``) as a regex over a posix path."""
    body = re.escape(pattern.strip("/")).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
    return re.compile(body.replace(r"\*", "[^/]*").replace(r"\?", "[^/]"))


class IgnoreFile:
    """A .dockerignore, read as Docker reads it: the last pattern matching a path or one of its
    parents decides, and ``!pattern`` takes a path back in."""

    def __init__(self, lines: Sequence[str]) -> None:
        self.rules: list[tuple[bool, re.Pattern[str], str]] = []
        for line in (raw.strip() for raw in lines):
            if line and not line.startswith("#"):
                keep = line.startswith("!")
                literal = line.lstrip("!").strip("/")
                self.rules.append((keep, _glob(literal), literal))

    @classmethod
    def for_build(cls, dockerfile: Path, context: Path) -> IgnoreFile:
        """BuildKit's choice: ``<Dockerfile>.dockerignore`` beside it, else the context's."""
        path = dockerfile.with_name(dockerfile.name + ".dockerignore")
        path = path if path.exists() else context / ".dockerignore"
        return cls(path.read_text().splitlines() if path.exists() else [])

    def excluded(self, rel: str) -> bool:
        parts = rel.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        excluded = False
        for keep, pattern, _ in self.rules:
            if any(pattern.fullmatch(prefix) for prefix in prefixes):
                excluded = not keep
        return excluded

    def may_keep_below(self, rel_dir: str) -> bool:
        """Whether an exception could take back something under this (excluded) directory."""
        return any(keep and literal.startswith(rel_dir + "/") for keep, _, literal in self.rules)


def context_tar(context: Path, dockerfile: Path) -> bytes:
    """The build context as Docker would send it: ignored paths left out, the Dockerfile
    always in (Docker sends it even when the ignore file names it)."""
    ignore = IgnoreFile.for_build(dockerfile, context)
    buffer = io.BytesIO()
    # GNU format: no PAX header first, which the docker CLI's check for "is stdin a tar" misses.
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for root, dirs, files in os.walk(context):
            rel_root = Path(root).relative_to(context)
            for name in sorted(dirs):
                rel = (rel_root / name).as_posix()
                if ignore.excluded(rel) and not ignore.may_keep_below(rel):
                    dirs.remove(name)  # and all below it
            for name in sorted(files):
                rel = (rel_root / name).as_posix()
                if not ignore.excluded(rel):
                    tar.add(Path(root) / name, arcname=rel, recursive=False)
        rel_dockerfile = dockerfile.relative_to(context).as_posix()
        if rel_dockerfile not in tar.getnames():
            tar.add(dockerfile, arcname=rel_dockerfile)
    return buffer.getvalue()


def build_argv(service: Mapping[str, Any]) -> tuple[list[str], Path, Path]:
    """``docker build`` argv reading the context tar from stdin, the context and the Dockerfile."""
    build = service["build"]
    context = (COMPOSE_FILE.parent / build.get("context", ".")).resolve()
    dockerfile = context / build.get("dockerfile", "Dockerfile")
    argv = ["docker", "build", "--tag", service["image"], "--file", dockerfile.relative_to(context).as_posix()]
    for name, value in (build.get("args") or {}).items():
        argv += ["--build-arg", f"{name}={value}"]
    if build.get("network", "default") != "default":  # compose's "default": the builder's own
        argv += ["--network", str(build["network"])]
    return argv + ["-"], context, dockerfile


def build(config: Mapping[str, Any], services: Sequence[str] = ()) -> None:
    """Build the images of ``services`` (default: every service with a build section)."""
    names = list(services) or [n for n, s in config["services"].items() if "build" in s]
    for name in names:
        argv, context, dockerfile = build_argv(config["services"][name])
        started = time.monotonic()
        print(f"compose_run: building {name}: {shlex.join(argv)}", file=sys.stderr, flush=True)
        # The legacy builder needs no buildx plugin and fetches no frontend image; BuildKit
        # (where buildx is installed) reads the same tar context.
        env = {**os.environ, "DOCKER_BUILDKIT": os.environ.get("DOCKER_BUILDKIT", "0")}
        result = subprocess.run(argv, input=context_tar(context, dockerfile), env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S)
        if result.returncode != 0:
            tail = result.stdout.decode(errors="replace")[-6000:]
            raise RuntimeError(f"building {name} failed ({shlex.join(argv)}):\n{tail}")
        print(f"compose_run: built {service_image(config, name)} in {time.monotonic() - started:.0f}s",
              file=sys.stderr, flush=True)


def service_image(config: Mapping[str, Any], name: str) -> str:
    return str(config["services"][name]["image"])


# -- run --------------------------------------------------------------------------------------

PROJECT_LABEL = "com.docker.compose.project"


def _docker(*args: str, timeout: float = CLI_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"docker {shlex.join(args)} failed:\n{result.stdout}{result.stderr}")
    return result


def seconds(duration: str | int) -> int:
    """compose's durations ('60s', '1m30s', 90) in whole seconds."""
    if str(duration).isdigit():
        return int(duration)
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", str(duration))
    if not parts or not any(parts.groups()):
        raise ComposeError(f"not a duration: {duration!r}")
    hours, minutes, secs = (int(p or 0) for p in parts.groups())
    return hours * 3600 + minutes * 60 + secs


def _healthcheck_args(check: Mapping[str, Any] | None) -> list[str]:
    if not check:
        return []
    test = check["test"]
    if test in ("NONE", ["NONE"]):
        return ["--no-healthcheck"]
    # `docker run` takes the shell form only; CMD's argv is quoted for it.
    if isinstance(test, list):
        test = shlex.join(test[1:]) if test[0] == "CMD" else test[1]
    argv = ["--health-cmd", test]
    for key in ("interval", "timeout", "start_period", "retries"):
        if key in check:
            argv += [f"--health-{key.replace('_', '-')}", str(check[key])]
    return argv


class DockerRunProject:
    """One compose project (its containers, volumes and network, all labelled with its name)
    run with plain ``docker`` commands: ``up`` and ``run`` as compose does them."""

    def __init__(self, project: str, files: Sequence[Path]) -> None:
        self.project = project
        self.files = list(files)
        self.network = f"{project}_default"

    def container_name(self, service: str) -> str:
        return f"{self.project}-{service}-1"  # compose v2's naming

    def _prepare(self) -> dict[str, Any]:
        """The files as they are now (the caller rewrites its override between calls), with
        the project's network and volumes created once."""
        config = load(self.files)
        label = f"{PROJECT_LABEL}={self.project}"
        if not _docker("network", "ls", "--quiet", "--filter", f"name=^{self.network}$").stdout.strip():
            _docker("network", "create", "--label", label, self.network)
        for name, spec in (config.get("volumes") or {}).items():
            spec = spec or {}
            opts = [a for k, v in (spec.get("driver_opts") or {}).items() for a in ("--opt", f"{k}={v}")]
            _docker("volume", "create", "--label", label, "--driver", spec.get("driver", "local"),
                    *opts, f"{self.project}_{name}")
        return config

    def run_argv(self, config: Mapping[str, Any], service: str, name: str,
                 command: Sequence[str] | None = None) -> list[str]:
        spec = config["services"][service]
        argv = ["run", "--detach", "--name", name, "--label", f"{PROJECT_LABEL}={self.project}",
                "--label", f"com.docker.compose.service={service}",
                "--network", self.network, "--network-alias", service]
        if "shm_size" in spec:
            argv += ["--shm-size", str(spec["shm_size"])]
        if spec.get("ipc"):
            ipc = str(spec["ipc"])
            argv += ["--ipc", f"container:{self.container_name(ipc[len('service:'):])}"
                     if ipc.startswith("service:") else ipc]
        for entry in spec.get("volumes") or []:
            source, target, *mode = str(entry).split(":")
            if source.startswith((".", "/", "~")):
                raise ComposeError(f"services.{service}.volumes: bind mounts ({entry}) are not read here")
            argv += ["--volume", ":".join([f"{self.project}_{source}", target, *mode])]
        for kind, limit in (spec.get("ulimits") or {}).items():
            soft, hard = (limit["soft"], limit["hard"]) if isinstance(limit, dict) else (limit, limit)
            argv += ["--ulimit", f"{kind}={int(soft)}:{int(hard)}"]
        argv += _healthcheck_args(spec.get("healthcheck"))
        if "stop_grace_period" in spec:
            argv += ["--stop-timeout", str(seconds(spec["stop_grace_period"]))]
        args = list(command) if command is not None else [str(a) for a in spec.get("command") or []]
        if spec.get("entrypoint"):
            entrypoint = [str(a) for a in spec["entrypoint"]]
            argv += ["--entrypoint", entrypoint[0]]
            args = entrypoint[1:] + args
        return argv + [str(spec["image"]), *args]

    def up(self, service: str, recreate: bool = False) -> str:
        """``docker compose up --detach --no-deps [--force-recreate] SERVICE``; its container id."""
        config = self._prepare()
        name = self.container_name(service)
        state = _docker("inspect", "--format", "{{.State.Running}}", name, check=False)
        if state.returncode == 0 and (recreate or state.stdout.strip() != "true"):
            grace = seconds(config["services"][service].get("stop_grace_period", 10))
            _docker("stop", "--time", str(grace), name, timeout=grace + CLI_TIMEOUT_S)
            _docker("rm", name)
        elif state.returncode == 0:
            return _docker("inspect", "--format", "{{.Id}}", name).stdout.strip()
        return _docker(*self.run_argv(config, service, name)).stdout.strip()

    def run(self, service: str, name: str, command: Sequence[str] | None) -> str:
        """``docker compose run --detach --no-deps --name NAME SERVICE COMMAND...``."""
        config = self._prepare()
        return _docker(*self.run_argv(config, service, name, command)).stdout.strip()

    def down(self) -> None:
        """``docker compose down --volumes``: containers, volumes and network of the project."""
        label = f"label={PROJECT_LABEL}={self.project}"
        ids = _docker("ps", "--all", "--quiet", "--filter", label, check=False).stdout.split()
        if ids:
            _docker("rm", "--force", "--volumes", *ids, check=False)
        volumes = _docker("volume", "ls", "--quiet", "--filter", label, check=False).stdout.split()
        if volumes:
            _docker("volume", "rm", "--force", *volumes, check=False)
        _docker("network", "rm", self.network, check=False)


def main(argv: Sequence[str]) -> None:
    if not argv or argv[0] != "build":
        sys.exit("usage: python tests/container/compose_run.py build [SERVICE...]")
    try:
        build(load(), argv[1:])
    except (ComposeError, RuntimeError, subprocess.TimeoutExpired) as exc:
        sys.exit(f"compose_run: {exc}")


if __name__ == "__main__":
    main(sys.argv[1:])
