"""Scratch folders that a killed process does not leave behind for good.

A trainer or the demo killed with SIGKILL runs no cleanup, so its temporary folders stay.
:func:`make_scratch_dir` writes the owner's pid into each folder it makes and, first, removes
the folders of the same prefix whose owner is gone (dead pid, or an empty folder, no owner file).
"""

from __future__ import annotations

import os
import shutil
import tempfile

__all__ = ["OWNER_FILE", "make_scratch_dir", "sweep_stale"]

OWNER_FILE = ".owner-pid"


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
    removed = []
    try:
        names = [n for n in os.listdir(base) if n.startswith(prefix)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(base, name)
        try:
            if os.lstat(path).st_uid != os.getuid() or os.path.islink(path) or not os.path.isdir(path):
                continue
            if _owner_alive(path):
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
    except FileNotFoundError:
        return bool(os.listdir(path))  # no owner file: only an empty folder is known stale
    except (OSError, ValueError):
        return True
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True
