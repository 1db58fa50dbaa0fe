"""Checks of docker/ that need no Docker engine: the files parse, agree with each other, with
scripts/setup.sh's torch pin, and with the paths the container harness mirrors."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # python 3.10: the dev extra installs tomli
    import tomli as tomllib  # type: ignore[no-redef]

from . import compose_run
from .harness import IMAGE_UID, REPO_ROOT, SNAPSHOT_DIR, SOCKET_DIR, SOCKET_URI, STATE_DIR
from .scenario import CKPT_DIR, HEALTHCHECK_CMD, REPORT, server_args

DOCKER = REPO_ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int) -> int:
    """'1G', '2gb', '1536Mi', '64m' -> bytes (binary units, as Docker and the server read them)."""
    match = re.fullmatch(r"(\d+)\s*([kmgt]?)(i?b?)", str(text).strip(), re.IGNORECASE)
    assert match, f"not a size: {text!r}"
    return int(match[1]) * SIZE_UNITS[match[2].lower()]


def flag(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


# -- Dockerfiles --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


@dataclass(frozen=True)
class Dockerfile:
    global_args: dict[str, str]  # ARGs before the first FROM, with their defaults
    stages: list[list[Instruction]]  # each starts with its FROM

    @property
    def final(self) -> list[Instruction]:
        return self.stages[-1]

    def resolve(self, text: str, stage: list[Instruction] | None = None) -> str:
        values = dict(self.global_args) | _arg_defaults(stage or [])
        return re.sub(r"\$\{?(\w+)\}?", lambda m: values.get(m[1], m[0]), text)

    def find(self, keyword: str, stage: list[Instruction] | None = None) -> list[str]:
        return [i.args for i in (stage if stage is not None else self.final) if i.keyword == keyword]


def _arg_defaults(stage: list[Instruction]) -> dict[str, str]:
    defaults = {}
    for ins in stage:
        if ins.keyword == "ARG" and "=" in ins.args:
            name, value = ins.args.split("=", 1)
            defaults[name.strip()] = value.strip().strip('"')
    return defaults


def parse_dockerfile(path: Path) -> Dockerfile:
    logical, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    global_args: dict[str, str] = {}
    stages: list[list[Instruction]] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        ins = Instruction(keyword.upper(), args.strip())
        if ins.keyword == "FROM":
            stages.append([ins])
        elif stages:
            stages[-1].append(ins)
        elif ins.keyword == "ARG":
            global_args |= _arg_defaults([ins])
    return Dockerfile(global_args, stages)


def pip_installs(dockerfile: Dockerfile, stage: list[Instruction]) -> list[str]:
    """Every `pip install ...` command of the stage's RUN instructions, in order."""
    commands = []
    for run in dockerfile.find("RUN", stage):
        commands += [c.strip() for c in re.split(r"&&|;", run) if "pip install" in c]
    return commands


def test_server_dockerfile_installs_no_torch() -> None:
    df = parse_dockerfile(DOCKER / "Dockerfile.server")
    assert df.resolve(df.final[0].args) == "python:3.11-slim"
    installs = pip_installs(df, df.final)
    assert installs, "the server image installs the project"
    for command in installs:
        assert "torch" not in command, command
        assert re.findall(r"\[([\w,]+)\]", command) == ["server"], command
    # The build itself refuses an image in which torch became importable.
    assert any("find_spec('torch')" in run for run in df.find("RUN"))
    # ... and what the server extra resolves to names no torch.
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    server_reqs = project["dependencies"] + project["optional-dependencies"]["server"]
    assert not [r for r in server_reqs if re.match(r"torch\b", r)], server_reqs


def test_server_dockerfile_user_healthcheck_entrypoint() -> None:
    df = parse_dockerfile(DOCKER / "Dockerfile.server")
    assert df.find("USER")[-1].split(":")[0] == str(IMAGE_UID)
    healthcheck = df.find("HEALTHCHECK")
    assert len(healthcheck) == 1
    assert " ".join(HEALTHCHECK_CMD).replace(" ", "") in re.sub(r'[\s",\[\]]', "", healthcheck[0])
    assert "swap-state-server" in df.find("ENTRYPOINT")[-1]


def _setup_sh_torch_version() -> str:
    match = re.search(r'TORCH_VERSION="\$\{SWAP_STATE_TORCH_VERSION:-([^}]+)\}"',
                      (REPO_ROOT / "scripts" / "setup.sh").read_text())
    assert match, "scripts/setup.sh's torch pin not found"
    return match[1]


def test_trainer_dockerfile_pins_cpu_torch_first() -> None:
    df = parse_dockerfile(DOCKER / "Dockerfile.trainer")
    final_args = _arg_defaults(df.final)
    assert final_args["TORCH_VERSION"] == _setup_sh_torch_version() == "2.13.0"
    assert final_args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert final_args["EXTRAS"] == "client"
    # The base is a build argument (CUDA / CANN images), CPU python by default.
    assert df.final[0].args == "${BASE_IMAGE}"
    assert df.resolve(df.final[0].args) == "python:3.11-slim"
    installs = pip_installs(df, df.final)
    torch_at = next(i for i, c in enumerate(installs) if "torch==${TORCH_VERSION}" in c)
    assert "--index-url" in installs[torch_at] and "${TORCH_INDEX_URL}" in installs[torch_at]
    project_at = next(i for i, c in enumerate(installs) if "[${EXTRAS}]" in c)
    assert torch_at < project_at, "torch must be installed before the client extra"
    constraint = flag(shlex.split(installs[project_at]), "-c")
    assert any(f'"torch==${{TORCH_VERSION}}" > {constraint}' in run for run in df.find("RUN")), (
        "the client extra must be installed under a constraint pinning torch")
    assert df.find("USER")[-1].split(":")[0] == str(IMAGE_UID)


@pytest.mark.parametrize("name", ["Dockerfile.server", "Dockerfile.trainer"])
def test_build_context_is_trimmed(name: str) -> None:
    dockerfile = DOCKER / name
    ignore = compose_run.IgnoreFile.for_build(dockerfile, REPO_ROOT)
    # Virtualenvs of any name, results, tests and .git never enter the context.
    for path in (".venv", ".venv-titan/lib/torch/__init__.py", ".git/config", "tests/conftest.py",
                 "bench/results.json", "results/x", "swap_state/__pycache__/x.pyc", "swap_state.egg-info"):
        assert ignore.excluded(path), f"{path} would enter the build context of {name}"
    for copy in parse_dockerfile(dockerfile).find("COPY", parse_dockerfile(dockerfile).stages[0]):
        for source in copy.split()[:-1]:
            # A wildcard may match nothing (README.md* is optional); a plain path must exist.
            assert "*" in source or (REPO_ROOT / source).exists(), f"COPY {source}: missing"
            assert not ignore.excluded(source.rstrip("*/")), f"COPY {source}: ignored by the .dockerignore"


# -- compose.yaml -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """compose.yaml as compose reads it where none of its variables is set."""
    return compose_run.load(env={})


def _memlock(service: dict[str, Any]) -> dict[str, int]:
    return {key: int(value) for key, value in service["ulimits"]["memlock"].items()}


def _mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """target -> (volume name, read only) from short-syntax volume entries."""
    mounts = {}
    for entry in service["volumes"]:
        source, target, *mode = entry.split(":")
        mounts[target] = (source, mode == ["ro"])
    return mounts


def test_compose_names_existing_dockerfiles_and_declared_volumes(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"shm", "server", "trainer"}
    assert services["shm"]["image"] == services["server"]["image"]  # built by the server service
    declared = set(compose["volumes"])
    used = set()
    for name, service in services.items():
        if name == "shm":
            continue
        build = service["build"]
        dockerfile = (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve()
        assert dockerfile == DOCKER / f"Dockerfile.{name}", dockerfile
        used |= {source for source, _ in _mounts(service).values()}
    assert used == declared, f"used {used}, declared {declared}"


def test_compose_server(compose: dict[str, Any]) -> None:
    server = compose["services"]["server"]
    command = [str(a) for a in server["command"]]
    # The harness runs the server with exactly these flags.
    assert command == server_args(flag(command, "--shm-size"))
    holder = compose["services"]["shm"]  # /dev/shm outlives the server: restarts adopt
    assert parse_size(holder["shm_size"]) >= parse_size(flag(command, "--shm-size")), (
        "shm_size must hold --shm-size or the server refuses to start")
    assert holder["ipc"] == "shareable" and server["ipc"] == "service:shm"
    assert _mounts(server) == {SOCKET_DIR: ("socket", False), SNAPSHOT_DIR: ("snapshots", False)}
    assert server["healthcheck"]["test"] == ["CMD", *HEALTHCHECK_CMD]
    assert _memlock(server) == {"soft": -1, "hard": -1}


def test_compose_trainer(compose: dict[str, Any]) -> None:
    trainer = compose["services"]["trainer"]
    assert trainer["ipc"] == "service:shm"
    assert trainer["depends_on"] == {"server": {"condition": "service_healthy"}}
    assert _mounts(trainer) == {SOCKET_DIR: ("socket", False), SNAPSHOT_DIR: ("snapshots", True),
                                STATE_DIR: ("trainer-state", False)}
    command = [str(a) for a in trainer["command"]]
    assert command[:3] == ["python", "-m", "swap_state.client.demo"]
    assert flag(command, "--server") == SOCKET_URI
    assert int(flag(command, "--snapshot-every")) < int(flag(command, "--steps"))
    assert (flag(command, "--state-dir"), flag(command, "--report")) == (CKPT_DIR, REPORT)
    assert _memlock(trainer) == {"soft": -1, "hard": -1}


SETTINGS_ENV = {
    "SWAP_STATE_PYTHON_IMAGE": "local/python:1",
    "SWAP_STATE_BASE_IMAGE": "local/cuda:2",
    "SWAP_STATE_TORCH_INDEX_URL": "http://127.0.0.1:9/simple",
    "SWAP_STATE_BUILD_NETWORK": "host",
    "SWAP_STATE_SHM_SIZE": "3gb",
    "SWAP_STATE_MEMLOCK": "8388608",
}


def test_compose_settings_default_to_the_dockerfiles(compose: dict[str, Any]) -> None:
    """With no variable set, compose.yaml builds and runs what it did before they existed."""
    server_df, trainer_df = (parse_dockerfile(DOCKER / f"Dockerfile.{n}") for n in ("server", "trainer"))
    services = compose["services"]
    assert services["server"]["build"]["args"] == {"PYTHON_IMAGE": server_df.global_args["PYTHON_IMAGE"]}
    assert services["trainer"]["build"]["args"] == {
        "PYTHON_IMAGE": trainer_df.global_args["PYTHON_IMAGE"],
        "BASE_IMAGE": trainer_df.global_args["BASE_IMAGE"],
        "TORCH_INDEX_URL": _arg_defaults(trainer_df.final)["TORCH_INDEX_URL"],
    }
    assert services["server"]["build"]["network"] == services["trainer"]["build"]["network"] == "default"
    assert parse_size(services["shm"]["shm_size"]) == 2 << 30


def test_compose_settings_follow_the_environment() -> None:
    services = compose_run.load(env=SETTINGS_ENV)["services"]
    for name in ("server", "trainer"):
        build = services[name]["build"]
        assert build["args"]["PYTHON_IMAGE"] == "local/python:1" and build["network"] == "host"
        assert _memlock(services[name]) == {"soft": 8388608, "hard": 8388608}
    assert services["trainer"]["build"]["args"]["BASE_IMAGE"] == "local/cuda:2"
    assert services["trainer"]["build"]["args"]["TORCH_INDEX_URL"] == "http://127.0.0.1:9/simple"
    assert services["shm"]["shm_size"] == "3gb"


def test_images_build_defaults_equal_the_dockerfiles() -> None:
    """scripts/images/build.sh decides whether the defaults are reachable: the same defaults."""
    text = (REPO_ROOT / "scripts" / "images" / "build.sh").read_text()
    trainer_df = parse_dockerfile(DOCKER / "Dockerfile.trainer")

    def assigned(name: str) -> str:
        match = re.search(rf"^{name}=(\S+)$", text, re.MULTILINE)
        assert match, f"{name} not found in scripts/images/build.sh"
        return match[1]

    assert assigned("DEFAULT_PYTHON_IMAGE") == trainer_df.global_args["PYTHON_IMAGE"]
    assert assigned("DEFAULT_TORCH_INDEX_URL") == _arg_defaults(trainer_df.final)["TORCH_INDEX_URL"]
    assert assigned("TORCH_VERSION") == f"${{SWAP_STATE_TORCH_VERSION:-{_setup_sh_torch_version()}}}"


# -- Kubernetes examples ----------------------------------------------------------------------

def _k8s(name: str) -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all((DOCKER / "k8s" / name).read_text())}


def _container_mounts(container: dict[str, Any]) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in container["volumeMounts"]}


def _check_server(server: dict[str, Any]) -> int:
    args = [str(a) for a in server["args"]]
    assert args == server_args(flag(args, "--shm-size"))
    for probe in ("startupProbe", "livenessProbe"):
        assert server[probe]["exec"]["command"] == HEALTHCHECK_CMD
    shm = parse_size(flag(args, "--shm-size"))
    assert parse_size(server["resources"]["limits"]["memory"]) > shm, (
        "the server's memory limit must cover the /dev/shm pages it pre-faults")
    return shm


def test_k8s_sidecar_shares_memory_emptydir_and_socket() -> None:
    docs = _k8s("sidecar.yaml")
    pod = docs["Job"]["spec"]["template"]["spec"]
    (server,) = pod["initContainers"]
    (trainer,) = pod["containers"]
    assert server["restartPolicy"] == "Always"  # native sidecar: healthy before the trainer
    shm = _check_server(server)
    volumes = {v["name"]: v for v in pod["volumes"]}
    for container in (server, trainer):
        mounts = _container_mounts(container)
        dshm = volumes[mounts["/dev/shm"]]["emptyDir"]
        assert dshm["medium"] == "Memory" and parse_size(dshm["sizeLimit"]) >= shm
        assert "emptyDir" in volumes[mounts[SOCKET_DIR]]
    assert _container_mounts(server)[SOCKET_DIR] == _container_mounts(trainer)[SOCKET_DIR]
    assert pod["securityContext"]["runAsUser"] == IMAGE_UID
    claim = volumes[_container_mounts(server)[SNAPSHOT_DIR]]["persistentVolumeClaim"]["claimName"]
    assert claim == docs["PersistentVolumeClaim"]["metadata"]["name"]


def test_k8s_daemonset_uses_host_ipc_and_hostpath_socket() -> None:
    docs = _k8s("daemonset.yaml")
    ds_pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    job_pod = docs["Job"]["spec"]["template"]["spec"]
    assert ds_pod["hostIPC"] is True and job_pod["hostIPC"] is True
    (server,) = ds_pod["containers"]
    (trainer,) = job_pod["containers"]
    _check_server(server)

    def socket_host_path(pod: dict[str, Any], container: dict[str, Any]) -> str:
        volumes = {v["name"]: v for v in pod["volumes"]}
        return volumes[_container_mounts(container)[SOCKET_DIR]]["hostPath"]["path"]

    assert socket_host_path(ds_pod, server) == socket_host_path(job_pod, trainer) == SOCKET_DIR


def test_readme_documents_the_one_command() -> None:
    readme = (DOCKER / "README.md").read_text()
    assert "docker compose -f docker/compose.yaml up --build --exit-code-from trainer" in readme
    for topic in ("shm_size", "memlock", "sizeLimit", "hostIPC", "kubectl apply"):
        assert topic in readme, topic


def test_k8s_torchrun_job_runs_torchtitan_with_a_store_and_a_sized_shm() -> None:
    docs = _k8s("torchrun-job.yaml")
    pod = docs["Job"]["spec"]["template"]["spec"]
    (server,) = pod["initContainers"]
    (trainer,) = pod["containers"]
    assert server["restartPolicy"] == "Always"
    args = [str(a) for a in server["args"]]
    assert flag(args, "--snapshot-store").startswith("s3://") and flag(args, "--listen") == SOCKET_URI
    shm = parse_size(flag(args, "--shm-size"))
    assert parse_size(server["resources"]["limits"]["memory"]) > shm
    volumes = {v["name"]: v for v in pod["volumes"]}
    dshm = volumes[_container_mounts(server)["/dev/shm"]]["emptyDir"]
    assert dshm["medium"] == "Memory" and parse_size(dshm["sizeLimit"]) >= shm
    command = " ".join(trainer["command"])
    assert command.startswith("torchrun ") and "swap_state.client.torchtitan_override.swap_state=" in command
    env = {e["name"]: e["value"] for e in trainer["env"]}
    assert env["SWAP_STATE_SERVER"] == SOCKET_URI
    assert _container_mounts(server)[SOCKET_DIR] == _container_mounts(trainer)[SOCKET_DIR]
