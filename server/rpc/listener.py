"""Owning a Unix socket path: one live server per path, stale files replaced, 0660. A lock file
beside the socket (``<socket>.lock``, flock'd for the server's lifetime, released even by SIGKILL)
makes the check race-free; with it held, a socket file there is stale unless something answers on it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import pathlib
import socket
import stat

from swap_state.common.errors import StartupError
from swap_state.server.dir_trust import check_own_directory
from swap_state.server.logs import log_event

__all__ = ["SocketGuard", "SOCKET_MODE"]

log = logging.getLogger(__name__)

SOCKET_MODE = 0o660


class SocketGuard:
    """The lock and the socket file of one Unix socket path."""

    def __init__(self, path: pathlib.Path, shared_gid: int | None = None) -> None:
        self.path, self._shared_gid = path, shared_gid
        self.lock_path = path.with_name(path.name + ".lock")
        self._lock_fd: int | None = None
        self._inode: tuple[int, int] | None = None

    def acquire(self) -> None:
        """Take the path or raise :class:`StartupError` saying who has it."""
        try:
            # 0755: the directory only needs to be traversable; the socket's own mode guards it.
            self.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        except OSError as exc:
            raise StartupError(
                f"cannot create {self.path.parent} for the socket: {exc.strerror}; pass "
                "--listen unix:///some/writable/dir/swap-state.sock") from None
        # Another user able to write here could take the socket's name or replace the lock.
        check_own_directory(self.path.parent, "the socket's directory (--listen)", shared_gid=self._shared_gid)
        self._lock_fd = self._lock()
        try:
            self._clear_stale()
        except BaseException:
            self.release()
            raise

    def _lock(self) -> int:
        """An exclusive flock on the file at :attr:`lock_path` now (one unlinked meanwhile does not count)."""
        for _ in range(10):
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            except OSError as exc:
                raise StartupError(f"cannot open lock file {self.lock_path}: {exc.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if isinstance(exc, BlockingIOError):  # EWOULDBLOCK: another process holds it
                    raise StartupError(
                        f"another swap-state-server is already running on unix://{self.path} "
                        f"(it holds {self.lock_path}); stop it first or pass another --listen") from None
                raise
            if _same_file(fd, self.lock_path):
                return fd
            os.close(fd)  # unlinked by the server that held it: lock the file there now
        raise StartupError(f"the lock file {self.lock_path} keeps changing; is another server starting?")

    def _clear_stale(self) -> None:
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(info.st_mode):
            raise StartupError(f"{self.path} exists and is not a socket; refusing to replace it (remove it or "
                               "pass another --listen)")
        live = True  # also on timeouts and the like: something is there; do not clobber it
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(str(self.path))
            except (ConnectionRefusedError, FileNotFoundError):
                live = False
            except OSError:
                pass
        if live:
            raise StartupError(f"something is listening on unix://{self.path} although no swap-state-server "
                               "holds its lock; refusing to replace a live socket (pass another --listen)")
        os.unlink(self.path)
        log_event(log, "stale_socket_replaced", logging.WARNING, path=self.path)

    def bound(self) -> None:
        """After bind: set 0660 (+ group) and remember the inode, so we only ever unlink ours."""
        os.chmod(self.path, SOCKET_MODE)
        if self._shared_gid is not None:
            os.chown(self.path, -1, self._shared_gid)
        info = os.lstat(self.path)
        self._inode = (info.st_dev, info.st_ino)

    def release(self) -> None:
        if self._inode is not None:
            with contextlib.suppress(FileNotFoundError):
                info = os.lstat(self.path)
                if (info.st_dev, info.st_ino) == self._inode:
                    os.unlink(self.path)
            self._inode = None
        if self._lock_fd is not None:
            # Unlinked while still locked: a starter that opened this file before the unlink
            # sees it is no longer at the path once it gets the lock, and takes the new one.
            if _same_file(self._lock_fd, self.lock_path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.lock_path)
            os.close(self._lock_fd)
            self._lock_fd = None


def _same_file(fd: int, path: pathlib.Path) -> bool:
    """Whether ``path`` still names the file open at ``fd``."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (info.st_dev, info.st_ino) == (mine.st_dev, mine.st_ino)
