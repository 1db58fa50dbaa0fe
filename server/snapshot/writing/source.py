"""What the servicer hands the coordinator to snapshot one rank: :class:`SnapshotSource`, and
:func:`check_source`, the coordinator's first step on it (nothing is published before it passed).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from swap_state.common.names import validate_job_id
from swap_state.common.segment import SegmentHeader, SegmentLayout, Word
from swap_state.common.snapshot_errors import SnapshotInvalid
from swap_state.common.snapshot_metadata_parts import MetadataParts

__all__ = ["SnapshotSource", "check_source"]


@dataclasses.dataclass(frozen=True)
class SnapshotSource:
    """One rank's segment to snapshot, as the servicer hands it to the coordinator."""

    buffer: Any  # writable, over the whole mapped segment (an mmap or a memoryview of it)
    layout: SegmentLayout  # tensors in update order
    header: SegmentHeader  # over the same buffer; owned (and released) by the caller
    job_id: str
    rank: int
    world_size: int  # ranks of the job (global, across hosts)
    step: int  # the committed step the segment holds (the caller checks it is the last committed)
    metadata_parts: MetadataParts | None = None
    """The trainer's description of the tensors, validated as a base and a delta, expanded by
    the writer (``snapshot_metadata_parts``); None: none."""
    local_world_size: int = 0
    """Ranks of the job on this server, 1..world_size (0: ``world_size``): a complete snapshot here."""
    keep_latest: int = 0  # durable snapshots the job asks to keep; the server keeps at least its ``--keep-latest``
    keep_all: bool = False  # the job keeps every checkpoint: retention removes none of its snapshots
    replace_existing: bool = False
    """A durable snapshot of this step from an earlier attempt is replaced instead of refused."""
    session_id: str = ""  # the session that asks: a start is a retry only from the same session and ``generation``
    generation: int = 0
    tenant: str = ""  # the session's, recorded in the snapshot
    bounded_retention: bool = False
    """The job's own retention may not exceed the server's ``--keep-latest`` (a non-admin tenant)."""
    memory_only: bool = False
    """Kept in this host's memory and a peer's (``--replica-peers``), not on disk."""

    @classmethod
    def of(cls, session: Any, buffer: Any, ask: Any, **more: Any) -> SnapshotSource:
        """The source of a server session (``memory.session.Session``) for a Snapshot call's
        ``ask`` (``domain.SnapshotAsk``); ``more``: the other fields."""
        return cls(buffer, session.layout, session.header, session.job_id, session.rank, session.world_size,
                   ask.step, local_world_size=session.local_world_size,
                   keep_latest=ask.keep_latest, keep_all=ask.keep_all, replace_existing=ask.replace_existing,
                   memory_only=ask.memory_only,
                   session_id=session.session_id, generation=session.generation, tenant=session.tenant, **more)

    @property
    def run(self) -> tuple[str, int]:
        """Which run of the job/rank asks: (session id, generation)."""
        return self.session_id, self.generation

    @property
    def expected_ranks(self) -> int:
        """The number of ranks this server's snapshot of the step waits for."""
        return self.local_world_size or self.world_size


def check_source(source: SnapshotSource) -> None:
    """SnapshotInvalid unless the ids and numbers are sane and the segment's header and buffer describe its layout."""
    validate_job_id(source.job_id, SnapshotInvalid)
    if not 1 <= source.world_size or not 0 <= source.rank < source.world_size:
        raise SnapshotInvalid(f"rank {source.rank} / world_size {source.world_size} is invalid")
    if not 0 <= source.local_world_size <= source.world_size:
        raise SnapshotInvalid(f"local_world_size {source.local_world_size} must be in [1, world_size "
                              f"{source.world_size}] (0: = world_size)")
    if source.step < 0:
        raise SnapshotInvalid(f"step {source.step} is negative")
    layout, header = source.layout, source.header
    try:
        header.check()
    except ValueError as exc:
        raise SnapshotInvalid(f"segment header: {exc}") from None
    words = (header[Word.N_CHUNKS], header[Word.CHUNK_BYTES], header[Word.COW_SLOTS],
             header[Word.COW_SLOTS_OFFSET], header.n_chunks, header.cow_slots)
    if words != (layout.n_chunks, layout.chunk_bytes, layout.cow_slots, layout.cow_slots_offset,
                 layout.n_chunks, layout.cow_slots):
        raise SnapshotInvalid("the segment header does not describe the given layout")
    with memoryview(source.buffer) as view:
        if view.nbytes < layout.size:
            raise SnapshotInvalid(f"the segment buffer is smaller than its layout ({layout.size} bytes)")
    if not layout.names_unique:
        raise SnapshotInvalid("segment tensor names are not unique")
