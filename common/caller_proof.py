"""Who calls over a unix socket: a file the caller creates proves its uid to the server (grpc's Python server does not
expose the peer's ``SO_PEERCRED``). In ``<socket>.callers`` (mode 1733: anyone may create, only the server may list or
remove another's) a client creates an empty file of a secret random name (``O_EXCL``, 0600) and sends the name with
every call; the server ``lstat``\\ s it: a regular file with one link, its owner is the caller.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets

__all__ = ["CALLER_METADATA_KEY", "CallerProof", "is_proof_name", "proof_dir"]

CALLER_METADATA_KEY = "swap-state-caller"

_NAME = re.compile(r"[0-9a-f]{32}")


def proof_dir(socket_path: str | os.PathLike[str]) -> str:
    return os.fspath(socket_path) + ".callers"


def is_proof_name(text: str) -> bool:
    return bool(_NAME.fullmatch(text))


class CallerProof:
    """This process's proof file for one server's socket (create, then :meth:`remove`)."""

    def __init__(self, socket_path: str | os.PathLike[str]):
        self.directory = proof_dir(socket_path)
        self.name = secrets.token_hex(16)

    def create(self) -> bool:
        """Create the file; False when the directory is not there (a server that does not
        identify callers by uid) or refuses it."""
        try:
            fd = os.open(os.path.join(self.directory, self.name),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:
            return False
        os.close(fd)
        return True

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.directory, self.name))

    @property
    def metadata(self) -> tuple[str, str]:
        return (CALLER_METADATA_KEY, self.name)
