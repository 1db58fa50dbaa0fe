"""Who calls: the tenant of a call, from its bearer token, and what a tenant may reach.

``--tenants FILE`` maps tokens to tenant names, one tenant per line::

    # tenant   token                              [admin]
    alice      3f0c...e1 (any printable, no spaces)
    bob        9a77...42
    ops        51d0...8c                          admin

A job, its sessions and its snapshots belong to the tenant whose call created them (recorded
in the session, the segment a successor server adopts, every ``snapshot.json`` and store
marker). Another tenant's call on them fails PERMISSION_DENIED; Stats and ListSnapshots show
only the caller's. An admin tenant reaches every tenant's. Without ``--tenants`` there is one
tenant, ``""``, with every right (``--token-file``, or no token: one trust domain).

The file holds secrets: the server refuses to start when it is readable by others than its
owner or owned by another user, naming the fix.
"""

from __future__ import annotations

import dataclasses
import hmac
import os
import pathlib
import stat
from collections.abc import Iterable

from swap_state.common.errors import PermissionDenied, StartupError

__all__ = ["ANYONE", "Tenant", "Tenants", "read_tenants_file"]


@dataclasses.dataclass(frozen=True)
class Tenant:
    """A caller's identity."""

    name: str
    """What owns jobs and snapshots (``""``: the single tenant of a server without tenants)."""
    admin: bool = False
    """Reaches every tenant's jobs, sessions and snapshots."""

    def may_reach(self, owner: str) -> bool:
        """Whether this tenant may see or touch what ``owner`` owns."""
        return self.admin or owner == self.name

    def check(self, owner: str, what: str) -> None:
        """PermissionDenied naming ``what`` unless this tenant may reach ``owner``'s."""
        if not self.may_reach(owner):
            raise PermissionDenied(
                f"{what} belongs to another tenant: this token's tenant {self.name!r} may not "
                "use it (a job id is its tenant's: choose another job id)"
            )


ANYONE = Tenant("", admin=True)
"""The one tenant of a server without ``--tenants``."""


class Tenants:
    """Bearer tokens and the tenants they name (an empty map: one tenant, :data:`ANYONE`)."""

    def __init__(self, by_token: dict[str, Tenant] | None = None):
        self._by_token = {f"Bearer {token}".encode(): tenant for token, tenant in (by_token or {}).items()}

    @property
    def enabled(self) -> bool:
        return bool(self._by_token)

    def tenant_of(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Tenant | None:
        """The tenant whose token the call's ``authorization`` metadata carries; None for a
        missing or unknown one (:data:`ANYONE` when tenants are off)."""
        if not self._by_token:
            return ANYONE
        for key, value in metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else bytes(value)
                # Compared with every token, in constant time each: no early exit to time.
                found = None
                for expected, tenant in self._by_token.items():
                    if hmac.compare_digest(given, expected):
                        found = tenant
                return found
        return None


def read_tenants_file(path: pathlib.Path) -> Tenants:
    """The tenants of ``--tenants FILE``. StartupError naming the line or the fix."""
    try:
        info = path.stat()
        text = path.read_text()
    except OSError as exc:
        raise StartupError(f"--tenants {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise StartupError(f"--tenants {path}: not a text file") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise StartupError(f"--tenants {path} holds tokens and others may read it: chmod 600 {path}")
    if info.st_uid not in (os.geteuid(), 0):
        raise StartupError(f"--tenants {path} is owned by uid {info.st_uid}, not this server's user: "
                           f"chown {os.geteuid()} {path}")
    by_token: dict[str, Tenant] = {}
    names: set[str] = set()
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
        if name in names or token in by_token:
            raise StartupError(f"{where}: tenant {name!r} or its token is listed twice")
        names.add(name)
        by_token[token] = Tenant(name, admin=len(words) == 3)
    if not by_token:
        raise StartupError(f"--tenants {path} lists no tenant")
    return Tenants(by_token)
