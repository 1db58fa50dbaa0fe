"""The embedded default: a private local swap-state-server owned by one container, used when
no server is named. A subprocess with its socket and log in a private temp directory; its
snapshots outlive it (:func:`default_snapshot_dir`) so that a rerun restores them. A watchdog
restarts a server that dies (it adopts the trainer's segment); a stop frees every segment.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from swap_state.common.retry import wait_until
from swap_state.common.errors import ConfigError
from swap_state.common.server_config import EXIT_WITH_PARENT_ENV, ServerConfig
from swap_state.common.server_flags import config_from_settings, config_to_argv, setting_value

__all__ = [
    "DEFAULT_SHM_SIZE_BYTES", "OWNER_FILE", "OWNERLESS_GRACE_S", "EmbeddedServerConfig", "EmbeddedServer",
    "default_snapshot_dir", "make_scratch_dir", "sweep_stale"]

DEFAULT_SHM_SIZE_BYTES = 256 << 20  # a server started on its own (a container sizes it from the model)
#: Quick deaths in a row after which the watchdog stops restarting (the server cannot run here).
CRASH_LOOP = 3
QUICK_DEATH_S = 10.0
log = logging.getLogger(__name__)


def default_snapshot_dir() -> str:
    """A per-user folder: ``$XDG_STATE_HOME/swap-state/snapshots`` (when absolute), else
    ``~/.local/state/swap-state/snapshots``."""
    state_home = os.environ.get("XDG_STATE_HOME", "")
    if not os.path.isabs(state_home):
        state_home = os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state_home, "swap-state", "snapshots")


EMBEDDED_SERVER_DEFAULTS: dict[str, Any] = {
    "grace": 5.0,  # its sessions die with their owner
    "chunk_bytes": 1 << 20,  # small, since embedded states are small
    "free_segments_on_stop": True,  # a stop frees every segment: nobody else would adopt them
}
"""Where a private server's settings differ from :class:`ServerConfig`'s own defaults."""


@dataclasses.dataclass
class EmbeddedServerConfig:
    shm_size_bytes: int | None = None
    """--shm-size; None: sized from the model (:data:`DEFAULT_SHM_SIZE_BYTES` on its own)."""
    snapshot_dir: str | None = None
    """--snapshot-dir, kept after the server stops; None: :func:`default_snapshot_dir`."""
    server: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Other server flags by :class:`ServerConfig` field name, over :data:`EMBEDDED_SERVER_DEFAULTS`."""
    start_timeout_s: float = 30.0
    """How long to wait for the server to report SERVING."""
    stop_timeout_s: float = 10.0
    """How long SIGTERM may take before SIGKILL."""
    auto_restart: bool = True
    """Start the server again when it dies (not after :data:`CRASH_LOOP` quick deaths in a row)."""

    def setting(self, name: str) -> Any:
        """The private server's ``name`` setting: this config's, the embedded default, or the server's."""
        default = ServerConfig.__dataclass_fields__[name].default
        return setting_value(name, self.server.get(name, EMBEDDED_SERVER_DEFAULTS.get(name, default)))

    def server_config(self, listen: str, snapshot_dir: str) -> ServerConfig:
        """The private server's config (else :class:`ServerConfig`'s defaults); ConfigError for bad values."""
        own = {"listen", "shm_size", "snapshot_dir"}  # the socket is the container's; the others, fields here
        unknown = sorted(name for name in self.server if name in own or name not in ServerConfig.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"EmbeddedServerConfig.server: {', '.join(unknown)} is not a setting it takes "
                              "(shm_size_bytes and snapshot_dir are fields of EmbeddedServerConfig)")
        return config_from_settings({
            **EMBEDDED_SERVER_DEFAULTS, **self.server, "listen": listen, "snapshot_dir": snapshot_dir,
            "shm_size": DEFAULT_SHM_SIZE_BYTES if self.shm_size_bytes is None else self.shm_size_bytes})


class EmbeddedServer:
    """Start with :meth:`start`; ``address`` is then a ``unix://`` address; :meth:`stop` ends it."""

    def __init__(self, config: EmbeddedServerConfig | None = None):
        self.config = config or EmbeddedServerConfig()
        self.workdir: str | None = None
        self.address: str | None = None
        self.snapshot_dir: str | None = None
        self._proc: subprocess.Popen | None = None
        self._log_path: str | None = None
        self._cmd: list[str] = []
        self._started_at = 0.0
        self._stopping = threading.Event()
        self._restart_lock = threading.RLock()
        self.restarts = 0  # times the server was started again

    def start(self) -> EmbeddedServer:
        # A trainer killed with SIGKILL leaves its server's folder: the next start sweeps it.
        self.workdir = make_scratch_dir("swap-state-embedded-")
        self.snapshot_dir = os.path.abspath(os.path.expanduser(self.config.snapshot_dir or default_snapshot_dir()))
        self.address = f"unix://{os.path.join(self.workdir, 'swap-state.sock')}"
        self._log_path = os.path.join(self.workdir, "server.log")
        try:  # a ConfigError names the flag; a failed start leaves no directory behind
            server_config = self.config.server_config(self.address, self.snapshot_dir)
            self._cmd = [sys.executable, "-m", "swap_state.server.cli", *config_to_argv(server_config)]
            atexit.register(self._stop_at_exit, os.getpid())
            self._launch()
        except BaseException:
            self.stop()
            raise
        if self.config.auto_restart:
            threading.Thread(target=self._watch, name="swap-state-embedded-watchdog", daemon=True).start()
        return self

    def _launch(self) -> None:
        with open(self._log_path, "ab") as log_file:
            self._proc = subprocess.Popen(
                self._cmd, stdout=log_file, stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C for the trainer must not kill it first
                env={**os.environ, EXIT_WITH_PARENT_ENV: str(os.getpid())},  # dies with the trainer
            )
        self._started_at = time.monotonic()
        self._wait_serving(self.address.removeprefix("unix://"))
        log.info("started embedded swap-state-server pid=%d at %s (snapshots in %s)",
                 self._proc.pid, self.address, self.snapshot_dir)

    def restart(self) -> None:
        """SIGTERM the server and start it again on the same socket (it adopts the old segments)."""
        with self._restart_lock:
            self.terminate()
            if self._stopping.is_set():
                return
            self._launch()
            self.restarts += 1

    def _watch(self) -> None:
        quick_deaths = 0
        while not self._stopping.is_set():
            proc = self._proc
            if proc is None:
                return
            code = proc.wait()
            with self._restart_lock:
                if self._stopping.is_set() or self._proc is not proc:
                    continue  # stopped, or restarted by someone else meanwhile
            quick_deaths = quick_deaths + 1 if time.monotonic() - self._started_at < QUICK_DEATH_S else 1
            if quick_deaths >= CRASH_LOOP:
                log.error("embedded swap-state-server died %d times in a row within %.0f s of its "
                          "start; not restarting it again:\n%s", quick_deaths, QUICK_DEATH_S, self.log_text())
                return
            log.warning("embedded swap-state-server pid=%d exited with %s; starting it again on %s "
                        "(it adopts this trainer's segment):\n%s", proc.pid, code, self.address,
                        self.log_text()[-1500:])
            try:
                self.restart()
            except Exception as e:  # the trainer goes on; its RPCs say the server is unreachable
                log.error("could not restart the embedded swap-state-server: %s", e)
                return

    def _wait_serving(self, socket_path: str) -> None:
        def serving() -> bool:
            if self._proc.poll() is not None:
                raise RuntimeError(f"embedded swap-state-server exited with {self._proc.returncode}:\n"
                                   f"{self.log_text()}")
            if not os.path.exists(socket_path):
                return False
            with grpc.insecure_channel(self.address) as channel:
                try:
                    stub = health_pb2_grpc.HealthStub(channel)
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                except grpc.RpcError:
                    return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        if not wait_until(serving, timeout_s=self.config.start_timeout_s, first_s=0.01, max_s=0.05):
            raise RuntimeError(f"embedded swap-state-server not serving after {self.config.start_timeout_s}s:\n"
                               f"{self.log_text()}")

    def log_text(self) -> str:
        if self._log_path and os.path.exists(self._log_path):
            with open(self._log_path, errors="replace") as f:
                return f.read()[-4000:]
        return ""

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def kill(self) -> None:
        """SIGKILL the server (tests of a dying server); :meth:`stop` still cleans up."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=self.config.stop_timeout_s)

    def _stop_at_exit(self, pid: int) -> None:
        if os.getpid() == pid:  # a forked child's exit must not stop its parent's server
            self.stop()

    def terminate(self) -> None:
        """SIGTERM the server and wait for it; the private folder stays (for :meth:`restart`)."""
        with self._restart_lock:
            proc = self._proc
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=self.config.stop_timeout_s)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after the timeout; remove the private directory."""
        self._stopping.set()
        with self._restart_lock:
            try:
                self.terminate()
            except subprocess.TimeoutExpired:
                log.warning("embedded swap-state-server ignored SIGTERM; killing it")
                self.kill()
            self._proc = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        atexit.unregister(self._stop_at_exit)

# -- scratch folders: a process killed with SIGKILL runs no cleanup, so each folder holds its
# owner's pid and the next make_scratch_dir sweeps those whose owner is gone (an empty folder with
# no owner file only after OWNERLESS_GRACE_S: a younger one is between mkdtemp and its write).

OWNER_FILE = ".owner-pid"
OWNERLESS_GRACE_S = 60.0


def make_scratch_dir(prefix: str, dir: str | None = None) -> str:
    """``tempfile.mkdtemp(prefix=prefix)`` with the owner's pid in it, after :func:`sweep_stale`."""
    sweep_stale(prefix, dir)
    path = tempfile.mkdtemp(prefix=prefix, dir=dir)
    with open(os.path.join(path, OWNER_FILE), "w") as f:
        f.write(str(os.getpid()))
    return path


def sweep_stale(prefix: str, dir: str | None = None) -> list[str]:
    """Remove this user's ``prefix*`` folders whose owner process is gone; returns them."""
    base = dir or tempfile.gettempdir()
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(base) if n.startswith(prefix)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(base, name)
        try:
            if (os.lstat(path).st_uid != os.getuid() or os.path.islink(path) or not os.path.isdir(path)
                    or _owner_alive(path)):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _owner_alive(path: str) -> bool:
    try:
        with open(os.path.join(path, OWNER_FILE)) as f:
            pid = int(f.read().strip() or 0)
    except FileNotFoundError:  # no owner file: only an empty folder no one is making is stale
        return bool(os.listdir(path)) or time.time() - os.stat(path).st_mtime < OWNERLESS_GRACE_S
    except (OSError, ValueError):
        return True
    try:
        if pid > 0:
            os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True
