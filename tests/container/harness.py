"""A container harness that needs no Docker engine: Linux namespaces through util-linux.

A :class:`Pod` stands for one host (one compose project): it owns a private mount namespace, held
by a small process, in which a tmpfs of the configured size is mounted on a host temp directory;
that tmpfs is the /dev/shm every container of the pod shares, as compose's ``ipc: shareable`` /
``ipc: service:server`` share the server's /dev/shm. The mount never appears in the host's
namespace, and it dies with the holder, which exits when the test process does.

A :class:`Container` is one ``unshare --mount --pid --net --ipc --uts --fork`` made from the pod's
mount namespace. Its PID 1 (``_nsinit.py``) builds a fresh root and pivots into it, so the
container sees only: read-only binds of the system dirs, the interpreter and the repo (enough to
run python, like an image's layers), the volumes it was given (the socket dir at /run/swap-state,
the snapshot volume at /snapshots, ...), a private /tmp, its own /proc, a minimal /dev, and the
shared /dev/shm. It runs as the images' user (uid 10001) when the harness runs as root. Its own
PID namespace means it cannot see or signal another container; its own network namespace (only
``lo``) means the Unix socket in the shared volume is the only way to the server. The command is
PID 1, as in Docker: SIGTERM reaches it only if it installs a handler, and SIGKILL ends the
whole container.

Not mirrored: cgroup limits (compose sets none), seccomp and capability sets, SysV IPC sharing
(the project shares memory through /dev/shm files only).

If the kernel or the sandbox forbids what this needs, :func:`probe` raises
:class:`HarnessUnavailable` naming the missing feature, e.g.
``unshare --mount failed: Operation not permitted``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

__all__ = [
    "IMAGE_UID",
    "IMAGE_GID",
    "SOCKET_DIR",
    "SOCKET_URI",
    "SNAPSHOT_DIR",
    "STATE_DIR",
    "REPO_ROOT",
    "HarnessUnavailable",
    "HostSupport",
    "Volume",
    "Pod",
    "Container",
    "probe",
    "wait_for",
    "host_mounts_under",
]

# The images' user and the paths compose.yaml mounts its volumes at; tests/container/test_static.py
# checks the docker files agree with these.
IMAGE_UID = 10001
IMAGE_GID = 10001
SOCKET_DIR = "/run/swap-state"
SOCKET_URI = f"unix://{SOCKET_DIR}/swap-state.sock"
SNAPSHOT_DIR = "/snapshots"
STATE_DIR = "/state"

REPO_ROOT = Path(__file__).resolve().parents[2]
NSINIT = Path(__file__).resolve().with_name("_nsinit.py")

CONTAINER_NAMESPACES = ("--mount", "--pid", "--net", "--ipc", "--uts")
START_TIMEOUT_S = 10.0
CONTAINER_TMP_SIZE = "256m"
_PR_SET_PDEATHSIG = 1


class HarnessUnavailable(RuntimeError):
    """This machine cannot run the harness; the message names the missing feature."""


@dataclasses.dataclass(frozen=True)
class HostSupport:
    """How containers can be made here (from :func:`probe`)."""

    rootless: bool  # inside a user namespace of our own (the harness is not root)
    uid: int  # the user containers run as
    gid: int
    note: str = ""  # why uid is not the images' user, when it isn't


@dataclasses.dataclass(frozen=True)
class Volume:
    """A host directory mounted into a container (compose: a named volume)."""

    source: Path
    target: str
    read_only: bool = False


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.05,
             what: str = "condition") -> None:
    """Poll ``predicate`` until true; TimeoutError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)


def host_mounts_under(path: Path) -> list[str]:
    """Mount points in the test process's own mount namespace at or below ``path``."""
    prefix = str(path)
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4]
            if point == prefix or point.startswith(prefix + "/"):
                points.append(point)
    return points


def _set_pdeathsig() -> None:
    # If the test process dies, its namespace processes die with it instead of leaking.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _readline(stream: IO[str], timeout: float) -> str:
    ready, _, _ = select.select([stream], [], [], timeout)
    if not ready:
        raise TimeoutError(f"no answer within {timeout:.1f}s")
    return stream.readline().strip()


def _read_only_binds() -> list[str]:
    """What a container needs to run this interpreter and the repo: its 'image layers'."""
    # Both spellings of the prefixes: scripts' shebangs and PATH use the one the venv was
    # made with, symlinks resolve to the other.
    prefixes = [Path(p) for p in (sys.prefix, sys.base_prefix)]
    wanted = [Path("/usr"), Path("/etc"), REPO_ROOT, *prefixes, *(p.resolve() for p in prefixes),
              Path(sys.executable).resolve().parent.parent]
    kept: list[Path] = []
    for path in sorted(set(wanted), key=lambda p: len(p.parts)):
        if not any(path.is_relative_to(k) for k in kept):
            kept.append(path)
    return [str(p) for p in kept]


class Container:
    """One container of a :class:`Pod`. Create through :meth:`Pod.container`."""

    def __init__(self, pod: Pod, name: str, volumes: Sequence[Volume]) -> None:
        self.pod = pod
        self.name = name
        self.volumes = tuple(volumes)
        self.log_path = pod.root / "logs" / f"{name}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None
        self.env: dict[str, str] = {}

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, cmd: Sequence[str], env: Mapping[str, str] | None = None) -> Container:
        """Run ``cmd`` as PID 1 of a new container; returns once PID 1 has exec'd it."""
        if self._proc is not None:
            raise RuntimeError(f"container {self.name} was already started; make a new one")
        self.env = self.pod.default_env(self.name) | dict(env or {})
        spec = {
            "name": self.name,
            "rootfs": str(self.pod.rootfs_dir(self.name)),
            "ro_binds": [[p, p] for p in _read_only_binds()],
            "volumes": [[str(v.source), v.target, v.read_only] for v in self.volumes],
            "shm": str(self.pod.shm_dir),
            "tmp_size": CONTAINER_TMP_SIZE,
            "uid": self.pod.support.uid,
            "gid": self.pod.support.gid,
            "cwd": "/",
            "env": self.env,
            "cmd": list(cmd),
        }
        read_end, write_end = os.pipe()
        spec["ready_fd"] = write_end
        argv = [*self.pod.enter_pod_argv(), "unshare", *CONTAINER_NAMESPACES,
                "--propagation", "private", "--",
                sys.executable, "-I", "-S", str(NSINIT), "container", json.dumps(spec)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(self.log_path, "ab") as log:
                self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                              stderr=subprocess.STDOUT, pass_fds=(write_end,),
                                              preexec_fn=_set_pdeathsig)
            os.close(write_end)
            self._pid = self._await_exec(read_end)
        finally:
            os.close(read_end)
        return self

    def _await_exec(self, read_end: int) -> int | None:
        """The host PID of PID 1, once it has exec'd the command (None if setup failed first)."""
        with os.fdopen(os.dup(read_end), "r") as ready:
            try:
                line = _readline(ready, START_TIMEOUT_S)
                if _readline(ready, START_TIMEOUT_S) != "":
                    raise RuntimeError("unexpected data on the ready pipe")
            except TimeoutError:
                assert self._proc is not None
                self._proc.kill()
                raise TimeoutError(f"container {self.name}: not started after "
                                   f"{START_TIMEOUT_S}s\n{self.logs}") from None
        return int(line) if line else None

    @property
    def pid(self) -> int:
        """Host PID of the container's PID 1 (the command)."""
        if self._pid is None:
            raise RuntimeError(f"container {self.name} is not running\n{self.logs}")
        return self._pid

    @property
    def returncode(self) -> int | None:
        """None while running; else as ``subprocess``: the exit status, or -signal."""
        return None if self._proc is None else self._proc.poll()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def wait(self, timeout: float) -> int:
        """Exit status (-signal if killed); TimeoutError if still running after ``timeout``."""
        if self._proc is None:
            raise RuntimeError(f"container {self.name} was never started")
        try:
            return self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"container {self.name} still running after {timeout:.1f}s") from None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to PID 1 (dropped by the kernel unless PID 1 handles it, as in Docker)."""
        if not self.running:
            return
        assert self._proc is not None
        with contextlib.suppress(ProcessLookupError):
            if self._pid is None:  # setup failed and is exiting: signal the waiter instead
                self._proc.send_signal(sig)
            else:
                os.kill(self._pid, sig)

    def kill(self) -> None:
        """SIGKILL: PID 1 dies and the kernel kills everything else in the container."""
        self.signal(signal.SIGKILL)

    def stop(self, timeout: float = 10.0) -> int:
        """``docker stop``: SIGTERM, then SIGKILL after ``timeout`` seconds; the exit status."""
        self.signal(signal.SIGTERM)
        try:
            return self.wait(timeout)
        except TimeoutError:
            self.kill()
            return self.wait(START_TIMEOUT_S)

    def processes(self) -> list[int]:
        """Host PIDs of every process in the container."""
        ns = _pid_namespace(self.pid) if self.running else None
        if ns is None:
            return []
        return [int(p) for p in os.listdir("/proc") if p.isdigit() and _pid_namespace(int(p)) == ns]

    def pause(self) -> None:
        """``docker pause`` (SIGSTOP to every process; the freezer cgroup is not needed)."""
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def exec(self, cmd: Sequence[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """``docker exec``: run ``cmd`` in all of the container's namespaces, as its user."""
        argv = ["nsenter", "-t", str(self.pid), "-m", "-u", "-i", "-n", "-p", "-r", "-w"]
        if self.pod.support.rootless:
            argv += ["-U", "--preserve-credentials"]
        elif self.pod.support.uid != os.geteuid():
            argv += ["-S", str(self.pod.support.uid), "-G", str(self.pod.support.gid)]
        return subprocess.run([*argv, "--", *cmd], env=self.env, capture_output=True, text=True,
                              timeout=timeout, preexec_fn=_set_pdeathsig)

    @property
    def logs(self) -> str:
        """Everything the container wrote to stdout and stderr so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


class Pod:
    """One host's worth of containers sharing a /dev/shm of ``shm_size`` (tmpfs size syntax)."""

    def __init__(self, shm_size: str = "64m", support: HostSupport | None = None,
                 parent_dir: Path | None = None) -> None:
        self.support = support or probe()
        self.shm_size = shm_size
        self.root = Path(tempfile.mkdtemp(prefix="swap-state-pod-", dir=parent_dir))
        self.root.chmod(0o755)
        self.shm_dir = self.root / "shm"
        self.shm_dir.mkdir()
        self.containers: list[Container] = []
        self._holder: subprocess.Popen[str] | None = None
        try:
            self._start_holder()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Pod:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start_holder(self) -> None:
        user = ["--user", "--map-root-user"] if self.support.rootless else []
        spec = {"shm": str(self.shm_dir), "shm_size": self.shm_size}
        self._holder = subprocess.Popen(
            ["unshare", *user, "--mount", "--propagation", "private", "--",
             sys.executable, "-I", "-S", str(NSINIT), "pod", json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            preexec_fn=_set_pdeathsig)
        self._expect("ready")

    def _expect(self, word: str) -> None:
        assert self._holder is not None and self._holder.stdout is not None
        answer = _readline(self._holder.stdout, START_TIMEOUT_S)
        if answer != word:
            rest = "" if self._holder.poll() is None else self._holder.stdout.read()
            raise HarnessUnavailable(f"pod /dev/shm: {answer} {rest}".strip())

    @property
    def holder_pid(self) -> int:
        assert self._holder is not None
        return self._holder.pid

    @property
    def shm_host_path(self) -> Path:
        """The shared /dev/shm as the test process can read it (through the holder's root)."""
        return Path(f"/proc/{self.holder_pid}/root{self.shm_dir}")

    def enter_pod_argv(self) -> list[str]:
        ns = f"/proc/{self.holder_pid}/ns"
        user = [f"--user={ns}/user", "--preserve-credentials"] if self.support.rootless else []
        return ["nsenter", *user, f"--mount={ns}/mnt", "--"]

    def rootfs_dir(self, name: str) -> Path:
        path = self.root / "rootfs" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def default_env(self, name: str) -> dict[str, str]:
        """What the images set: PATH with the python env first, a writable HOME, no buffering."""
        user = "root" if self.support.uid == 0 else "swapstate"
        return {
            "PATH": f"{sys.prefix}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/tmp",
            "USER": user,
            "LOGNAME": user,
            "HOSTNAME": name,
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
        }

    def volume(self, name: str) -> Path:
        """A fresh host directory owned by the containers' user (compose: a named volume)."""
        path = self.root / "volumes" / name
        path.mkdir(parents=True, exist_ok=True)
        if not self.support.rootless and self.support.uid != os.geteuid():
            os.chown(path, self.support.uid, self.support.gid)
        return path

    def container(self, name: str, volumes: Sequence[Volume] = ()) -> Container:
        if any(c.name == name for c in self.containers):
            raise ValueError(f"container name {name!r} already used in this pod")
        container = Container(self, name, volumes)
        self.containers.append(container)
        return container

    def reset_shm(self) -> None:
        """Replace /dev/shm with an empty tmpfs, as Docker does when the server container stops."""
        assert self._holder is not None and self._holder.stdin is not None
        self._holder.stdin.write("reset\n")
        self._holder.stdin.flush()
        self._expect("ok")

    def close(self) -> None:
        """Kill every container and the holder, then remove the pod's files. Idempotent."""
        for container in self.containers:
            container.kill()
            with contextlib.suppress(TimeoutError, RuntimeError):
                container.wait(START_TIMEOUT_S)
        if self._holder is not None:
            with contextlib.suppress(BrokenPipeError, OSError):
                self._holder.stdin.close()  # type: ignore[union-attr]
            try:
                self._holder.wait(START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._holder.kill()
                self._holder.wait(START_TIMEOUT_S)
            if self._holder.stdout is not None:
                self._holder.stdout.close()
        # Nothing is mounted in our namespace by design; lazily unmount if that ever changes.
        for point in reversed(host_mounts_under(self.root)):
            subprocess.run(["umount", "-l", point], check=False, capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)


# -- probing ---------------------------------------------------------------------------------

def _unshare_error(stderr: str) -> str:
    """'unshare: unshare failed: Operation not permitted' -> 'Operation not permitted'."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return lines[-1].rsplit(": ", 1)[-1] if lines else "unknown error"


def _probe_flags(rootless: bool) -> None:
    user = ["--user", "--map-root-user"] if rootless else []
    checks = [[*user]] if rootless else []
    checks += [[*user, flag] for flag in CONTAINER_NAMESPACES]
    for flags in checks:
        fork = ["--fork"] if "--pid" in flags else []
        run = subprocess.run(["unshare", *flags, *fork, "--", "true"], capture_output=True,
                             text=True, timeout=START_TIMEOUT_S)
        if run.returncode != 0:
            raise HarnessUnavailable(f"unshare {' '.join(flags)} failed: {_unshare_error(run.stderr)}")


def _probe_container(support: HostSupport) -> None:
    with Pod("4m", support=support) as pod:
        box = pod.container("probe").start([sys.executable, "-c", "import sys"])
        rc = box.wait(START_TIMEOUT_S * 3)
        if rc != 0:
            raise HarnessUnavailable(box.logs.strip().splitlines()[-1] if box.logs.strip()
                                     else f"container exited {rc}")


def _probe_mode(rootless: bool) -> HostSupport:
    _probe_flags(rootless)
    if rootless:
        support = HostSupport(rootless=True, uid=0, gid=0,
                              note="rootless: containers run as the mapped root")
        _probe_container(support)
        return support
    support = HostSupport(rootless=False, uid=IMAGE_UID, gid=IMAGE_GID)
    try:
        _probe_container(support)
        return support
    except HarnessUnavailable as as_image_user:
        # e.g. the interpreter or the repo is not readable by others: run as root, say why.
        support = HostSupport(rootless=False, uid=0, gid=0,
                              note=f"uid {IMAGE_UID} cannot run python here: {as_image_user}")
        _probe_container(support)
        return support


@functools.cache
def _probe_cached() -> HostSupport | HarnessUnavailable:
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            return HarnessUnavailable(f"util-linux `{tool}` not found on PATH")
    modes = [False, True] if os.geteuid() == 0 else [True]
    reasons = []
    for rootless in modes:
        try:
            return _probe_mode(rootless)
        except (HarnessUnavailable, OSError, subprocess.SubprocessError, TimeoutError) as exc:
            reasons.append(f"{'rootless: ' if rootless else ''}{exc}")
    return HarnessUnavailable("; ".join(reasons))


def probe() -> HostSupport:
    """How this machine can run containers; raises HarnessUnavailable naming what is missing."""
    result = _probe_cached()
    if isinstance(result, HarnessUnavailable):
        raise result
    return result

