"""The directories the server keeps its state in must be its own: another user who owns or can
write one could plant or replace files the server trusts, so the server refuses to start on it."""

from __future__ import annotations

import os
import pathlib
import stat

from swap_state.common.errors import StartupError

__all__ = ["check_own_directory"]


def check_own_directory(path: pathlib.Path, what: str, *, shared_gid: int | None = None,
                        sticky_ok: bool = False) -> None:
    """StartupError unless ``path`` is owned by this user or root and writable by no one else but
    ``shared_gid``; with ``sticky_ok`` a sticky directory (/dev/shm) is accepted, whoever can write it."""
    info = os.stat(path)
    me = os.geteuid()
    if info.st_uid not in (0, me):
        raise StartupError(
            f"{what} {path} is owned by uid {info.st_uid}, not by this server's user (uid {me}) or root: "
            f"that user could replace what the server keeps there. Use a directory this user owns "
            f"(mkdir it, or chown {me} {path})")
    if sticky_ok and info.st_mode & stat.S_ISVTX:
        return
    others = bool(info.st_mode & stat.S_IWOTH)
    group = bool(info.st_mode & stat.S_IWGRP) and info.st_gid not in (os.getegid(), shared_gid)
    if others or group:
        raise StartupError(
            f"{what} {path} can be written by other users (mode {stat.filemode(info.st_mode)}, group "
            f"{info.st_gid}): they could plant or replace files the server trusts. Run chmod go-w {path}, "
            "or use a directory only this user can write")
