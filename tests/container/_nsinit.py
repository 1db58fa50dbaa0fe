"""Inside-the-namespace half of the container harness (see ``harness.py``).

Run by the harness as ``python -I -S _nsinit.py pod|container SPEC_JSON`` right after ``unshare``
has created the namespaces; it uses the standard library only, because it runs before (and
while) the file system view is replaced.

``pod``: the holder of a pod's private mount namespace. Mounts the shared /dev/shm tmpfs on a
host directory (visible only in this namespace and in the containers made from it), says
``ready``, then serves ``reset`` requests on stdin and exits at EOF, so the mount dies with the
test process even when that is killed.

``container``: forks PID 1 of a container into the new PID namespace, reports its host PID and
waits for it, ending the same way (exit status or signal). PID 1 builds a fresh root (a tmpfs
holding a private /tmp, read-only binds of the interpreter, the repo and system dirs, the
volumes, /proc, /sys, a minimal /dev with the shared /dev/shm), pivots into it, sets the
hostname, brings up ``lo``, drops to the image user, and execs the command, which stays PID 1
like a Docker container's entrypoint.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import platform
import signal
import socket
import struct
import sys
from typing import Any

__all__ = ["main"]

EXIT_SETUP_FAILED = 125  # what `docker run` returns when the container could not be created

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1

# statvfs f_flag bit -> mount flag. A read-only remount inside a user namespace must keep the
# flags the source mount has locked (nosuid, nodev, ...), or the kernel refuses it.
_ST_TO_MS = {1: MS_RDONLY, 2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: MS_NOATIME,
             2048: MS_NODIRATIME, 4096: MS_RELATIME}

# glibc has no pivot_root wrapper; the syscall number depends on the architecture.
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41, "ppc64le": 203,
                   "ppc64": 203, "s390x": 217, "loongarch64": 41}

DEVICE_NODES = ("null", "zero", "full", "random", "urandom")
IFREQ = "16sH22x"  # struct ifreq: name[16] + flags + padding to 40 bytes

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


class SetupError(Exception):
    """A step of building the container failed; the message names the step."""


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what} failed: {os.strerror(err)} (errno {errno.errorcode.get(err, err)})")


def mount(source: str | None, target: str, fstype: str | None, flags: int,
          data: str | None = None) -> None:
    enc = (lambda s: s.encode() if s is not None else None)
    rc = _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data))
    _check(rc, f"mount {fstype or 'bind'} {source or ''} on {target}")


def umount(target: str, flags: int = 0) -> None:
    _check(_libc.umount2(target.encode(), flags), f"umount {target}")


def pivot_root(new_root: str) -> None:
    # pivot_root(".", ".") stacks the old root under the new one; detaching "." then drops it
    # without needing a directory for it (the trick runc uses).
    nr = _SYS_PIVOT_ROOT.get(platform.machine())
    if nr is None:
        raise SetupError(f"pivot_root: unknown syscall number on {platform.machine()}")
    os.chdir(new_root)
    _check(_libc.syscall(nr, b".", b"."), f"pivot_root {new_root}")
    umount(".", MNT_DETACH)
    os.chdir("/")


def _make_target(path: str, like: str) -> None:
    if os.path.isdir(like):
        os.makedirs(path, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not os.path.exists(path):
            with open(path, "w"):
                pass


def bind(source: str, target: str, read_only: bool) -> None:
    _make_target(target, source)
    mount(source, target, None, MS_BIND | MS_REC)
    if read_only:
        locked = 0
        for st_bit, ms_bit in _ST_TO_MS.items():
            if os.statvfs(target).f_flag & st_bit:
                locked |= ms_bit
        mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | locked)


def _system_links(root: str) -> None:
    # Merged-/usr hosts have /bin -> usr/bin etc.; recreate the links, bind real dirs instead.
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = f"/{name}"
        if os.path.islink(host):
            os.symlink(os.readlink(host), f"{root}{host}")
        elif os.path.isdir(host):
            bind(host, f"{root}{host}", read_only=True)


def _build_dev(root: str, shm: str) -> None:
    dev = f"{root}/dev"
    os.makedirs(dev, exist_ok=True)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k")
    for node in DEVICE_NODES:
        bind(f"/dev/{node}", f"{dev}/{node}", read_only=False)
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{fd}", f"{dev}/{name}")
    os.symlink("/proc/self/fd", f"{dev}/fd")
    bind(shm, f"{dev}/shm", read_only=False)


def _mount_sys(root: str) -> None:
    # A fresh sysfs shows this network namespace's interfaces (only lo), as Docker's does.
    target = f"{root}/sys"
    os.makedirs(target, exist_ok=True)
    try:
        mount("sysfs", target, "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except SetupError:
        bind("/sys", target, read_only=True)


def _lo_up() -> None:
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack(IFREQ, b"lo", 0)
        flags = struct.unpack(IFREQ, fcntl.ioctl(s, siocgifflags, req))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack(IFREQ, b"lo", flags | iff_up))


def build_root(spec: dict[str, Any]) -> None:
    root = spec["rootfs"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", 0, "mode=755,size=16m")
    _system_links(root)
    # /tmp first: binds below it (a checkout under /tmp, say) must land on top, not be hidden.
    os.makedirs(f"{root}/tmp", exist_ok=True)
    mount("tmpfs", f"{root}/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={spec['tmp_size']}")
    for source, target in spec["ro_binds"]:
        bind(source, f"{root}{target}", read_only=True)
    for source, target, read_only in spec["volumes"]:
        bind(source, f"{root}{target}", read_only=read_only)
    _build_dev(root, spec["shm"])
    os.makedirs(f"{root}/proc", exist_ok=True)
    mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount_sys(root)
    pivot_root(root)


def _become_container(spec: dict[str, Any]) -> None:
    """PID 1 of the new PID namespace: build the container around us, then exec the command."""
    # The harness waits for EOF on this pipe: it closes at exec (or at a failed setup's exit).
    os.set_inheritable(spec["ready_fd"], False)
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    try:
        build_root(spec)
        socket.sethostname(spec["name"])
        _lo_up()
        uid, gid = spec["uid"], spec["gid"]
        if (uid, gid) != (os.getuid(), os.getgid()):
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            # Changing credentials clears the parent-death signal; set it again.
            _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        os.chdir(spec["cwd"])
    except (SetupError, OSError) as exc:
        print(f"container {spec['name']}: setup failed: {exc}", file=sys.stderr, flush=True)
        os._exit(EXIT_SETUP_FAILED)
    cmd = spec["cmd"]
    try:
        os.execvpe(cmd[0], cmd, spec["env"])
    except OSError as exc:
        # Docker's codes for "command not found" / "not executable".
        print(f"container {spec['name']}: exec {cmd[0]!r} failed: {exc}", file=sys.stderr, flush=True)
        os._exit(127 if exc.errno == errno.ENOENT else 126)


def run_container(spec: dict[str, Any]) -> None:
    """The waiter: fork PID 1 into the new PID namespace, report its host PID, mirror its end.

    Not ``unshare --fork``: util-linux 2.38 exits 1 instead of reporting a child killed by a
    signal, and the harness must tell a SIGKILL from a failure.
    """
    pid = os.fork()
    if pid == 0:
        _become_container(spec)
    ready = spec["ready_fd"]
    os.write(ready, f"{pid}\n".encode())
    os.close(ready)
    status = os.waitpid(pid, 0)[1]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be caught anyway
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128)


def _mount_shm(path: str, size: str) -> None:
    mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={size}")


def run_pod(spec: dict[str, Any]) -> None:
    try:
        mount(None, "/", None, MS_REC | MS_PRIVATE)
        _mount_shm(spec["shm"], spec["shm_size"])
    except SetupError as exc:
        print(f"error {exc}", flush=True)
        sys.exit(EXIT_SETUP_FAILED)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "reset":
            continue
        # Docker unmounts a shareable container's /dev/shm when the container stops; a
        # replacement server starts on an empty one. Containers still running keep the old one.
        try:
            umount(spec["shm"], MNT_DETACH)
            _mount_shm(spec["shm"], spec["shm_size"])
            print("ok", flush=True)
        except SetupError as exc:
            print(f"error {exc}", flush=True)


def main(argv: list[str]) -> None:
    role, spec = argv[1], json.loads(argv[2])
    if role == "pod":
        run_pod(spec)
    elif role == "container":
        run_container(spec)
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv)
