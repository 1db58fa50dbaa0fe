"""Who calls: the tenant of a call, from its bearer token (``--tenants FILE``: ``TENANT TOKEN [admin]``
per line) or on a unix socket its uid (``uid:<N>``, proven by a file it owns; root and the server's
uid are admins), else one tenant with every right. A job, its sessions and snapshots belong to the
tenant whose call created them; another tenant's call on them fails PERMISSION_DENIED.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hmac
import os
import pathlib
import stat
import threading
from collections.abc import Iterable

from swap_state.common.caller_proof import CALLER_METADATA_KEY, is_proof_name, proof_dir
from swap_state.common.errors import PermissionDeniedError, StartupError

__all__ = ["ANYONE", "Tenant", "Tenants", "UidProofs", "read_secret_file", "read_tenants_file", "tenant_uid"]

_PROOF_DIR_MODE = 0o1733  # anyone who reaches the socket creates files; only the server lists or removes others'
_CACHED_PROOFS = 1 << 14


@dataclasses.dataclass(frozen=True)
class Tenant:
    """A caller's identity."""

    name: str  # what owns jobs and snapshots ("": the single tenant of a server without tenants)
    admin: bool = False  # reaches every tenant's jobs, sessions and snapshots

    def may_reach(self, owner: str) -> bool:
        """Whether this tenant may see or touch what ``owner`` owns ("": nobody's, reachable by all)."""
        return self.admin or owner in ("", self.name)

    def may_claim(self, owner: str | None) -> bool:
        """Whether this tenant may use a job id ``owner`` holds (None: nobody holds it)."""
        return owner in (None, "", self.name)

    def check(self, owner: str, what: str) -> None:
        """PermissionDenied naming ``what`` unless this tenant may reach ``owner``'s."""
        if not self.may_reach(owner):
            raise PermissionDeniedError(f"{what} belongs to another tenant: the caller's tenant {self.name!r} may not "
                                   "use it (a job id is its tenant's: choose another job id)")


ANYONE = Tenant("", admin=True)  # the one tenant of a server without ``--tenants``


def tenant_uid(name: str) -> int | None:
    """The uid of a uid tenant (``uid:<N>``); None for any other name."""
    prefix, _, digits = name.partition(":")
    return int(digits) if prefix == "uid" and digits.isdigit() else None


class UidProofs:
    """The ``<socket>.callers`` directory of a unix socket server: a caller's uid from the owner
    of the proof file it names (:mod:`swap_state.common.caller_proof`)."""

    def __init__(self, socket_path: str | os.PathLike[str]):
        self.directory = pathlib.Path(proof_dir(socket_path))
        self._uids: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._lock = threading.Lock()

    def prepare(self) -> None:
        """Create the directory (kept across restarts: live trainers' files are in it), or check
        the one there is this server user's own."""
        try:
            self.directory.mkdir(exist_ok=True)
            info = self.directory.lstat()
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
                raise StartupError(f"{self.directory} is not a directory of this server's user: remove it")
            os.chmod(self.directory, _PROOF_DIR_MODE)
        except OSError as exc:
            raise StartupError(f"cannot prepare {self.directory} (callers' uid proofs): {exc}") from None

    def release(self) -> None:
        """At a stop: remove the directory when no caller's proof is left in it."""
        with contextlib.suppress(OSError):
            self.directory.rmdir()

    def uid_of(self, name: str) -> int | None:
        """The uid that owns proof file ``name``; None when it is no valid proof."""
        if not is_proof_name(name):
            return None
        with self._lock:
            if name in self._uids:
                self._uids.move_to_end(name)
                return self._uids[name]
        try:
            info = os.lstat(self.directory / name)
        except OSError:
            return None
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            return None  # a link: its name could be another's file
        with self._lock:
            self._uids[name] = info.st_uid
            while len(self._uids) > _CACHED_PROOFS:
                self._uids.popitem(last=False)
        return info.st_uid


class Tenants:
    """Who a call is: bearer tokens and the tenants they name, else (``proofs``) the caller's
    uid on a unix socket, else one tenant, :data:`ANYONE`."""

    def __init__(self, by_token: dict[str, Tenant] | None = None, proofs: UidProofs | None = None):
        self._by_token = {f"Bearer {token}".encode(): tenant for token, tenant in (by_token or {}).items()}
        self.proofs = None if self._by_token else proofs

    @property
    def enabled(self) -> bool:
        """Whether a call must say who it is (else every call is :data:`ANYONE`)."""
        return bool(self._by_token) or self.proofs is not None

    def tenant_of(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Tenant | None:
        """The call's tenant by its token or uid; None for a missing or unknown token or proof
        (:data:`ANYONE` when callers are not told apart)."""
        if not self.enabled:
            return ANYONE
        wanted = CALLER_METADATA_KEY if self.proofs is not None else "authorization"
        value = next((value for key, value in metadata or () if key == wanted), None)
        if value is None:
            return None
        if self.proofs is not None:
            uid = self.proofs.uid_of(value if isinstance(value, str) else bytes(value).decode("ascii", "replace"))
            return None if uid is None else Tenant(f"uid:{uid}", admin=uid in (0, os.geteuid()))
        given = value.encode() if isinstance(value, str) else bytes(value)
        # Compared with every token, in constant time each: no early exit to time.
        found = [tenant for expected, tenant in self._by_token.items() if hmac.compare_digest(given, expected)]
        return found[0] if found else None


def read_secret_file(path: pathlib.Path, flag: str) -> tuple[os.stat_result, str]:
    """(stat, text) of the file of ``flag``; StartupError naming both when it cannot be read as text."""
    try:
        return path.stat(), path.read_text()
    except OSError as exc:
        raise StartupError(f"{flag} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise StartupError(f"{flag} {path}: not a text file") from None


def read_tenants_file(path: pathlib.Path) -> Tenants:
    """The tenants of ``--tenants FILE``. StartupError naming the line or the fix."""
    info, text = read_secret_file(path, "--tenants")
    shared_group = info.st_mode & stat.S_IRWXG and info.st_gid != os.getegid()  # a k8s Secret: the pod's fsGroup
    if info.st_mode & stat.S_IRWXO or shared_group:
        raise StartupError(f"--tenants {path} holds tokens and others may read it: chmod 600 {path}")
    if info.st_uid not in (os.geteuid(), 0):
        raise StartupError(f"--tenants {path} is owned by uid {info.st_uid}, not this server's user: "
                           f"chown {os.geteuid()} {path}")
    by_token: dict[str, Tenant] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"--tenants {path} line {number}"
        if len(words) not in (2, 3) or (len(words) == 3 and words[2] != "admin"):
            raise StartupError(f"{where}: expected 'TENANT TOKEN' or 'TENANT TOKEN admin'")
        name, token = words[0], words[1]
        if not name.isprintable() or not token.isprintable() or len(token) < 16:
            raise StartupError(f"{where}: a tenant's token must be at least 16 printable characters")
        if token in by_token or any(tenant.name == name for tenant in by_token.values()):
            raise StartupError(f"{where}: tenant {name!r} or its token is listed twice")
        by_token[token] = Tenant(name, admin=len(words) == 3)
    if not by_token:
        raise StartupError(f"--tenants {path} lists no tenant")
    return Tenants(by_token)
