"""The containerized scenario (issue 6), written once and run on two stacks.

A *stack* is a way to run the server and trainer containers: :class:`HarnessStack` (Linux
namespaces, no Docker engine; ``test_scenario.py``) or ``compose_stack.ComposeStack`` (a real
``docker compose`` project; ``test_compose.py``). Both mount the same volumes at the same paths
and run the same commands, so a pass means the same thing on either.

What the scenario relies on (the lead's interfaces):
- ``swap-state-server --shm-size S --listen unix:///run/swap-state/swap-state.sock
  --snapshot-dir /snapshots --grace 30``: exits non-zero at once, naming ``shm_size``, when
  /dev/shm is smaller than S; exits 0 on SIGTERM (as PID 1, so it must handle SIGTERM).
- ``python -m swap_state.server.healthcheck --listen URI``: exit 0 when SERVING.
- A durable snapshot shows as a ``latest`` pointer somewhere under the snapshot volume.
- ``python -m swap_state.client.demo --server URI --job-id J --steps N --snapshot-every K
  --state-dir DIR --report FILE [--resume reattach|latest|auto]``: keeps in DIR the model
  parameters it needs to resume from the server's moments (``reattach``: the step the server
  kept; ``latest``: the latest snapshot's step), creating DIR if needed; writes FILE as JSON with
  ``step``, ``digest`` and ``reference_digest``; keeps training while the server is away and
  reconnects; exits non-zero naming the server when its next snapshot finds none within
  ``--server-wait`` seconds.
- A server started on the /dev/shm and socket a stopped one left adopts its live sessions'
  segments (a rolling restart costs the trainer nothing).
"""

from __future__ import annotations

import importlib.util
import json
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import pytest

from .harness import SNAPSHOT_DIR, SOCKET_DIR, SOCKET_URI, STATE_DIR, Container, Pod, Volume

__all__ = [
    "STEPS",
    "SNAPSHOT_EVERY",
    "SERVER_SHM_SIZE",
    "POD_SHM_SIZE",
    "SMALL_POD_SHM_SIZE",
    "SMALL_SERVER_SHM_SIZE",
    "HEALTHCHECK_CMD",
    "CKPT_DIR",
    "REPORT",
    "DEMO_MISSING",
    "DEMO_MISSING_REASON",
    "requires_demo",
    "server_args",
    "demo_cmd",
    "Service",
    "Stack",
    "HarnessStack",
    "start_healthy_server",
    "finish",
    "assert_bitwise_equal",
    "trainer_sigkill_then_reattach",
    "server_stop_then_restore",
    "server_rolling_restart",
    "small_shm_server_refuses",
]

STEPS = 20
SNAPSHOT_EVERY = 5
SERVER_SHM_SIZE = "128M"  # the server's --shm-size
POD_SHM_SIZE = "256m"  # the /dev/shm it gets (compose: shm_size): room to spare
SMALL_POD_SHM_SIZE = "16m"  # smaller than --shm-size: the server must refuse to start
SMALL_SERVER_SHM_SIZE = "64M"

HEALTHY_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 90.0  # one trainer container: torch import plus STEPS tiny steps
SNAPSHOT_TIMEOUT_S = 60.0
SERVER_STOP_TIMEOUT_S = 30.0
TRAINS_ON_S = 60.0  # a trainer whose server stopped for good trains on to its last step within this
SERVER_WAIT_S = 3.0  # --server-wait of that trainer: its snapshot waits this long first
SHM_REFUSAL_S = 10.0  # "at once": python start-up plus the size check
#: The least step time of a trainer the scenario kills or freezes after its first snapshot:
#: its STEPS - SNAPSHOT_EVERY steps left then take 3.75 s, against the few milliseconds of
#: a tiny step (under compose, `docker inspect` and `docker pause` alone may take longer: one
#: CI run saw the trainer finish before it was frozen).
PACE_S = 0.25

CKPT_DIR = f"{STATE_DIR}/ckpt"
REPORT = f"{STATE_DIR}/report.json"
HEALTHCHECK_CMD = ["python", "-m", "swap_state.server.healthcheck", "--listen", SOCKET_URI]

DEMO_MISSING_REASON = "swap_state.client.demo not implemented yet"
DEMO_MISSING = importlib.util.find_spec("swap_state.client.demo") is None
requires_demo = pytest.mark.skipif(DEMO_MISSING, reason=DEMO_MISSING_REASON)


def server_args(shm_size: str) -> list[str]:
    """The server's arguments; compose.yaml and the k8s examples use the same paths."""
    return ["--shm-size", shm_size, "--listen", SOCKET_URI, "--snapshot-dir", SNAPSHOT_DIR,
            "--grace", "30"]


def demo_cmd(resume: str | None = None, job_id: str = "demo", server_wait: float | None = None,
             paced: bool = False) -> list[str]:
    """The demo's command; ``paced``: steps of at least PACE_S (a trainer the scenario acts on)."""
    cmd = ["python", "-m", "swap_state.client.demo", "--server", SOCKET_URI, "--job-id", job_id,
           "--steps", str(STEPS), "--snapshot-every", str(SNAPSHOT_EVERY),
           "--state-dir", CKPT_DIR, "--report", REPORT]
    cmd += ["--server-wait", str(server_wait)] if server_wait is not None else []
    cmd += ["--step-seconds", str(PACE_S)] if paced else []
    return cmd + (["--resume", resume] if resume else [])


class Service(Protocol):
    """One running container, as the scenario drives it."""

    name: str

    def poll(self) -> int | None: ...  # None while running; else exit status, -signal if killed

    def wait(self, timeout: float) -> int: ...  # TimeoutError if still running

    def kill(self) -> None: ...  # SIGKILL

    def stop(self, timeout: float) -> int: ...  # SIGTERM, SIGKILL after timeout

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    @property
    def logs(self) -> str: ...


class Stack(Protocol):
    """A server volume set (socket, snapshots, trainer state) and the containers using it."""

    state_dir: Path  # the trainer-state volume (/state) as the test process sees it
    snapshot_dir: Path  # the snapshot volume (/snapshots) as the test process sees it

    def start_server(self, shm_size: str) -> Service: ...

    def healthy(self, server: Service) -> bool: ...

    def start_trainer(self, cmd: Sequence[str]) -> Service: ...

    def server_stopped(self) -> None: ...  # whatever the platform does to /dev/shm then


class _HarnessService:
    """A harness container seen through the Service protocol."""

    def __init__(self, container: Container) -> None:
        self.container = container
        self.name = container.name

    def poll(self) -> int | None:
        return self.container.returncode

    def wait(self, timeout: float) -> int:
        return self.container.wait(timeout)

    def kill(self) -> None:
        self.container.kill()

    def stop(self, timeout: float) -> int:
        return self.container.stop(timeout)

    def pause(self) -> None:
        self.container.pause()

    def resume(self) -> None:
        self.container.resume()

    @property
    def logs(self) -> str:
        return self.container.logs


class HarnessStack:
    """The compose project's services and volumes, as namespace containers of one pod."""

    def __init__(self, pod: Pod) -> None:
        self.pod = pod
        self.socket_dir = pod.volume("socket")
        self.snapshot_dir = pod.volume("snapshots")
        self.state_dir = pod.volume("trainer-state")
        pod.volume("trainer-state/ckpt")  # what the trainer image creates in the volume
        self._count = 0

    def _name(self, role: str) -> str:
        self._count += 1
        return f"{role}-{self._count}"

    def start_server(self, shm_size: str) -> _HarnessService:
        volumes = [Volume(self.socket_dir, SOCKET_DIR), Volume(self.snapshot_dir, SNAPSHOT_DIR)]
        container = self.pod.container(self._name("server"), volumes)
        return _HarnessService(container.start(["swap-state-server", *server_args(shm_size)]))

    def healthy(self, server: Service) -> bool:
        assert isinstance(server, _HarnessService)
        return server.container.exec(HEALTHCHECK_CMD, timeout=10).returncode == 0

    def start_trainer(self, cmd: Sequence[str]) -> _HarnessService:
        volumes = [Volume(self.socket_dir, SOCKET_DIR),
                   Volume(self.snapshot_dir, SNAPSHOT_DIR, read_only=True),
                   Volume(self.state_dir, STATE_DIR)]
        return _HarnessService(self.pod.container(self._name("trainer"), volumes).start(cmd))

    def server_stopped(self) -> None:
        self.pod.reset_shm()


# -- steps ------------------------------------------------------------------------------------

def _tail(service: Service, chars: int = 4000) -> str:
    return f"\n--- {service.name} logs (tail) ---\n{service.logs[-chars:]}"


def start_healthy_server(stack: Stack, shm_size: str = SERVER_SHM_SIZE) -> Service:
    server = stack.start_server(shm_size)
    deadline = time.monotonic() + HEALTHY_TIMEOUT_S
    while not stack.healthy(server):
        if server.poll() is not None:
            pytest.fail(f"server exited {server.poll()} before turning healthy" + _tail(server))
        if time.monotonic() > deadline:
            pytest.fail(f"server not healthy after {HEALTHY_TIMEOUT_S}s" + _tail(server))
        time.sleep(0.2)
    return server


def _durable_snapshots(snapshot_dir: Path) -> list[Path]:
    """The server's `latest` pointers: one appears (per job) once a snapshot is durable. Only
    the job directories are looked in: a step's partial directory may be renamed mid-walk."""
    return list(snapshot_dir.glob("*/latest"))


def wait_first_snapshot(stack: Stack, trainer: Service) -> None:
    """Return as soon as the trainer's first snapshot (step SNAPSHOT_EVERY) is durable.

    Polled tightly: the caller kills or freezes the trainer right after, while it still has
    most of its STEPS to go (a paced trainer: PACE_S each).
    """
    deadline = time.monotonic() + SNAPSHOT_TIMEOUT_S
    while not _durable_snapshots(stack.snapshot_dir):
        if trainer.poll() is not None:
            pytest.fail(f"trainer exited {trainer.poll()} before its first snapshot" + _tail(trainer))
        if time.monotonic() > deadline:
            pytest.fail(f"no durable snapshot in {stack.snapshot_dir} after {SNAPSHOT_TIMEOUT_S}s"
                        + _tail(trainer))
        time.sleep(0.002)


def finish(stack: Stack, trainer: Service) -> dict[str, Any]:
    try:
        rc = trainer.wait(RUN_TIMEOUT_S)
    except TimeoutError:
        trainer.kill()
        pytest.fail(f"trainer still running after {RUN_TIMEOUT_S}s" + _tail(trainer))
    assert rc == 0, f"trainer exited {rc}" + _tail(trainer)
    report = json.loads((stack.state_dir / "report.json").read_text())
    assert report["step"] == STEPS, report
    return report


def assert_bitwise_equal(report: dict[str, Any], trainer: Service) -> None:
    assert report["digest"] == report["reference_digest"], (
        f"parameters and moments differ from an uninterrupted torch AdamW run: {report}"
        + _tail(trainer))


# -- the scenario -----------------------------------------------------------------------------

def trainer_sigkill_then_reattach(stack: Stack) -> None:
    """Train; SIGKILL the trainer container after its first snapshot; a new trainer container
    reattaches (or restores) and finishes bitwise equal to an uninterrupted run."""
    server = start_healthy_server(stack)
    first = stack.start_trainer(demo_cmd(paced=True))
    wait_first_snapshot(stack, first)
    first.kill()
    rc = first.wait(10)
    assert rc == -signal.SIGKILL, (
        f"the first trainer exited {rc} before it could be killed: its {STEPS} steps took less "
        f"than the harness's reaction time after the first snapshot" + _tail(first))
    # A kill between steps leaves the server's moments whole (reattach); a kill while the
    # trainer was writing a step leaves them torn, and the demo restores the latest snapshot.
    second = stack.start_trainer(demo_cmd(resume="auto"))
    assert_bitwise_equal(finish(stack, second), second)
    resumed_by = second.logs
    assert "reattached:" in resumed_by or "restored the latest snapshot" in resumed_by, resumed_by
    assert server.poll() is None, "the server must outlive its trainer" + _tail(server)


def server_stop_then_restore(stack: Stack) -> None:
    """Stop the server container under a running trainer, its /dev/shm lost with it: the
    trainer steps on to its last step; each snapshot waits ``--server-wait`` for a server, then
    is not taken, saying so (a trainer never dies of a snapshot). A new server container
    restores the latest snapshot; a new trainer finishes bitwise equal."""
    server = start_healthy_server(stack)
    trainer = stack.start_trainer(demo_cmd(server_wait=SERVER_WAIT_S, paced=True))
    wait_first_snapshot(stack, trainer)
    # Freeze the trainer mid-run, so the server is gone before its next call, whatever the timing.
    trainer.pause()
    assert trainer.poll() is None, "trainer finished before the server could be stopped" + _tail(trainer)
    logged_before = len(trainer.logs)
    rc = server.stop(SERVER_STOP_TIMEOUT_S)
    assert rc == 0, f"server exited {rc} on SIGTERM, expected 0" + _tail(server)
    stack.server_stopped()
    trainer.resume()
    try:
        rc = trainer.wait(TRAINS_ON_S)
    except TimeoutError:
        trainer.kill()
        pytest.fail(f"trainer still running {TRAINS_ON_S}s after its server stopped" + _tail(trainer))
    assert rc == 0, f"trainer should train on to its last step, got {rc}" + _tail(trainer)
    after = trainer.logs[logged_before:]
    assert "snapshot of step" in after and "not taken" in after and "not reachable" in after, (
        "the trainer should say which snapshots it could not take, naming the server" + _tail(trainer))

    start_healthy_server(stack)
    resumed = stack.start_trainer(demo_cmd(resume="latest"))
    assert_bitwise_equal(finish(stack, resumed), resumed)


def server_rolling_restart(stack: Stack) -> None:
    """Stop the server container under a running trainer and start a new one on the same
    /dev/shm and socket (a rolling upgrade; /dev/shm outlives the server container, as a
    Kubernetes Memory emptyDir does): the trainer never stops, the new server adopts its
    segment, and it finishes bitwise equal to an uninterrupted run."""
    server = start_healthy_server(stack)
    trainer = stack.start_trainer(demo_cmd(paced=True))
    wait_first_snapshot(stack, trainer)
    trainer.pause()  # the restart falls between two of its steps, whatever the timing
    assert trainer.poll() is None, "trainer finished before the server could be stopped" + _tail(trainer)
    rc = server.stop(SERVER_STOP_TIMEOUT_S)
    assert rc == 0, f"server exited {rc} on SIGTERM, expected 0" + _tail(server)
    # Read now: on compose, starting the successor removes the old container and its logs.
    stopped_logs = f"\n--- {server.name} (stopped) logs (tail) ---\n{server.logs[-4000:]}"
    successor = start_healthy_server(stack)
    trainer.resume()
    assert_bitwise_equal(finish(stack, trainer), trainer)
    assert "event=session_adopted" in successor.logs, stopped_logs + _tail(successor) + _tail(trainer)
    assert "reconnected" in trainer.logs, _tail(trainer)


def small_shm_server_refuses(stack: Stack) -> None:
    """/dev/shm smaller than --shm-size: the server container exits at once, naming shm_size."""
    server = stack.start_server(SMALL_SERVER_SHM_SIZE)
    try:
        rc = server.wait(SHM_REFUSAL_S)
    except TimeoutError:
        server.kill()
        pytest.fail(f"server still running {SHM_REFUSAL_S}s after start with a too small /dev/shm"
                    + _tail(server))
    assert rc > 0, f"server exited {rc}, expected an error status" + _tail(server)
    assert "shm_size" in server.logs, "the error should name compose's shm_size" + _tail(server)
