"""Start-up checks of the shared-memory directory: a memory filesystem with room for the whole
budget, or a :class:`StartupError` naming the Docker/compose knob. The server never falls back
to disk-backed files: every optimizer step would wait on the disk.
"""

from __future__ import annotations

import logging
import os
import pathlib

from swap_state.common.errors import StartupError
from swap_state.common.sizes import format_size
from swap_state.server.logs import log_event

__all__ = ["MEMORY_FILESYSTEMS", "check_shm_dir", "filesystem_type", "require_shm_dir"]

log = logging.getLogger(__name__)

MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def filesystem_type(path: pathlib.Path) -> str | None:
    """The fs type of the mount holding ``path`` (from /proc/self/mountinfo), None if unknown."""
    try:
        lines = pathlib.Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best, best_type = "", None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mount_point = fields[4].encode().decode("unicode_escape")  # \040 for spaces etc.
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, best_type = mount_point, right.split()[0]
    return best_type


def _docker_size(nbytes: int) -> str:
    """A size in the form docker's --shm-size takes, rounded up (``64g``, ``512m``)."""
    unit, suffix = (1 << 30, "g") if nbytes >= 1 << 30 else (1 << 20, "m")
    return f"{-(-nbytes // unit)}{suffix}"


def require_shm_dir(shm_dir: pathlib.Path) -> None:
    """StartupError unless ``shm_dir`` is a directory (before anything looks inside it)."""
    if not shm_dir.is_dir():
        raise StartupError(f"--shm-dir {shm_dir} does not exist or is not a directory: create it (a tmpfs, e.g. "
                           "mount -t tmpfs -o size=64G tmpfs DIR) or leave --shm-dir at /dev/shm")


def check_shm_dir(shm_dir: pathlib.Path, shm_size: int) -> int:
    """A directory on a memory filesystem with room for ``shm_size``: the bytes available, else
    :class:`StartupError` (a too small /dev/shm is the usual cause: Docker's default is 64 MB)."""
    require_shm_dir(shm_dir)
    fstype = filesystem_type(shm_dir)
    if fstype is not None and fstype not in MEMORY_FILESYSTEMS:
        raise StartupError(f"--shm-dir {shm_dir} is on a {fstype} filesystem, not tmpfs: segments there would be "
                           "backed by disk. Use /dev/shm (or another tmpfs mount).")
    if fstype is None:
        log_event(log, "shm_fs_unknown", logging.WARNING, shm_dir=shm_dir,
                  detail="cannot read /proc/self/mountinfo; assuming a memory filesystem")
    vfs = os.statvfs(shm_dir)
    available = vfs.f_bavail * vfs.f_frsize
    if available < shm_size:
        raise StartupError(
            f"{shm_dir} has {available} bytes ({format_size(available)}) available, less than --shm-size {shm_size} "
            f"bytes ({format_size(shm_size)}). Give the container a larger shared-memory mount, e.g. `docker run "
            f"--shm-size {_docker_size(shm_size)} ...` or `shm_size:` in the compose service (Kubernetes: a Memory "
            "emptyDir at /dev/shm with a sizeLimit), or lower --shm-size. The server never falls back to disk.")
    if not os.access(shm_dir, os.W_OK | os.X_OK):
        raise StartupError(f"--shm-dir {shm_dir} is not writable by this user")
    return available
