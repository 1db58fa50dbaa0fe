"""A peer server's snapshots and replicas, read over the replica wire (``--replica-peers``): what a host that lost its
own asks for before the store. Listed per job; every byte read is checked by the seam's reads against the index the peer
sent (crc32 per tensor and file)."""

from __future__ import annotations

import logging
import pathlib
import threading

from swap_state.common.addresses import ListenAddress
from swap_state.common.snapshot_errors import SnapshotError, SnapshotNotFoundError
from swap_state.common.snapshot_format import SnapshotIndex
from swap_state.common.snapshot_tier import SnapshotInfo, SnapshotTier
from swap_state.server.logs import log_event
from swap_state.server.snapshot.tiers.replica_wire import CONNECT_TIMEOUT_S, Connection, PeerCredentials, connect_to_peer

__all__ = ["PeerSnapshots"]

log = logging.getLogger(__name__)


class PeerSnapshots(SnapshotTier):
    """One peer's complete snapshots of a job (its own and the replicas it holds), read remotely."""

    where = "peer"

    def __init__(self, peer: ListenAddress, credentials: PeerCredentials):
        self.peer, self._credentials = peer, credentials
        self.root = peer.url
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    def list(self, job_id: str | None = None) -> list[SnapshotInfo]:
        """The job's complete snapshots on the peer; [] when it is unreachable (logged) or no job is named."""
        if job_id is None:
            return []
        try:
            answer = self._request({"op": "list", "job_id": job_id})
            indexes = [SnapshotIndex.from_json(raw) for raw in answer.get("snapshots", [])]
        except (SnapshotError, ValueError) as exc:
            log_event(log, "replica_peer_unreadable", logging.WARNING, peer=self.root, job_id=job_id, error=str(exc))
            return []
        return [SnapshotInfo.of(index, pathlib.Path(f"/{self.peer.host}:{self.peer.port}/{index.job_id}/step-{index.step}"))
                for index in indexes if index.job_id == job_id]

    def resolve(self, snapshot_id: str, job_id: str | None = None) -> SnapshotInfo:
        raise SnapshotNotFoundError(f"a peer's snapshots are resolved together with this host's ({snapshot_id})")

    def _size(self, info: SnapshotInfo, name: str) -> int:
        record = info.index.layout if info.index.layout is not None and name == info.index.layout.name else info.file(name)
        return record.bytes  # what the peer listed; the bytes read are checked against it

    def _read_range(self, info: SnapshotInfo, name: str, offset: int, nbytes: int) -> bytes:
        out = bytearray()
        while len(out) < nbytes:
            got = self._request({"op": "read", "job_id": info.job_id, "step": info.step, "name": name,
                                 "offset": offset + len(out), "nbytes": nbytes - len(out)}, data=True)
            if not got:
                break  # the file's end
            out += got
        return bytes(out)

    def _request(self, message: dict, data: bool = False):
        """The peer's answer (and with ``data``, the bytes it sends after it); a broken connection
        is dropped, the next request connects again."""
        with self._lock:
            try:
                if self._conn is None:
                    self._conn = connect_to_peer(self.peer, self._credentials, CONNECT_TIMEOUT_S)
                answer = self._conn.request(message)
                if not data:
                    return answer
                got = bytearray()
                while len(got) < int(answer.get("bytes", 0)):
                    got += self._conn.receive_data()
                return got
            except SnapshotError:
                if self._conn is not None:
                    self._conn.close()
                self._conn = None
                raise
