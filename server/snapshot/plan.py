"""What one rank's snapshot writes, apart from where it goes: :class:`RankFilePlan` names the
rank's data file and manifest, builds the safetensors header and each tensor's byte range, and
once the crc32s are known, the data file's record, the manifest and the :class:`RankResult`.

Call order (the writer)::

    plan = RankFilePlan(source, metadata)
    ...the header, then the tensors at plan.data_start...          # the writer streams
    data = plan.data_record(crcs)
    manifest = plan.manifest(crcs, data, counters, persist_seconds)
    raw = manifest.to_bytes(); storage.write_durable(partial, plan.manifest_name, raw)
    result = plan.result(manifest, data, raw)
"""

from __future__ import annotations

import dataclasses

from swap_state.common.checksum import crc32, crc32_combine
from swap_state.common.snapshot_format import (
    FileRecord, RankManifest, TensorRecord, rank_data_name, rank_manifest_name, safetensors_header,
    safetensors_metadata,
)
from swap_state.common.snapshot_metadata import SnapshotMetadata, TensorMetadata
from swap_state.server.snapshot.source import SnapshotSource

__all__ = ["RankFilePlan", "RankResult"]


@dataclasses.dataclass(frozen=True)
class RankResult:
    """A rank whose data file and manifest are written and fsynced."""

    manifest: RankManifest
    files: tuple[FileRecord, FileRecord]
    """(data file, manifest file) with sizes and crc32s, for snapshot.json."""


class RankFilePlan:
    """The files of one rank's snapshot and what goes where in them."""

    def __init__(self, source: SnapshotSource, metadata: SnapshotMetadata):
        self.source = source
        self.metadata = metadata
        self.data_name = rank_data_name(source.rank)
        self.manifest_name = rank_manifest_name(source.rank)
        tensors = source.layout.tensors
        self.header, self.offsets = safetensors_header(
            [(t.name, t.dtype, t.shape, t.nbytes) for t in tensors],
            safetensors_metadata(source.job_id, source.step, source.rank, source.world_size),
        )
        """The safetensors header (the data file's first bytes) and each tensor's (begin, end)
        after it."""
        self.tensor_bytes = sum(t.nbytes for t in tensors)

    @property
    def data_start(self) -> int:
        """Where the first tensor's bytes go in the data file."""
        return len(self.header)

    def data_record(self, crcs: list[int]) -> FileRecord:
        """The data file's entry: its size and crc32 (combined from the tensors' crc32s)."""
        file_crc = crc32(self.header)
        for tensor, value in zip(self.source.layout.tensors, crcs):
            file_crc = crc32_combine(file_crc, value, tensor.nbytes)
        return FileRecord(self.data_name, self.source.rank, len(self.header) + self.tensor_bytes, file_crc)

    def manifest(self, crcs: list[int], data: FileRecord, counters: tuple[int, int, int],
                 persist_seconds: float) -> RankManifest:
        """The rank's manifest; ``counters``: the trainer's (cow copies, back-pressure waits,
        wait ns) during the snapshot."""
        source, metadata = self.source, self.metadata
        cow_copies, bp_waits, bp_wait_ns = counters
        return RankManifest(
            job_id=source.job_id, step=source.step, rank=source.rank, world_size=source.world_size,
            data_file=self.data_name, data_file_bytes=data.bytes, data_start=len(self.header),
            chunk_bytes=source.layout.chunk_bytes, tensors=self.tensor_records(crcs),
            param_groups=metadata.param_groups, steps=metadata.steps, metadata_extra=metadata.extra,
            cow_copies=cow_copies, backpressure_waits=bp_waits, backpressure_wait_seconds=bp_wait_ns / 1e9,
            persist_seconds=persist_seconds,
        )

    def tensor_records(self, crcs: list[int]) -> tuple[TensorRecord, ...]:
        records = []
        for tensor, (begin, end), value in zip(self.source.layout.tensors, self.offsets, crcs):
            meta = self.metadata.tensors.get(tensor.name, TensorMetadata())
            records.append(TensorRecord(
                name=tensor.name, dtype=tensor.dtype, shape=tensor.shape, nbytes=tensor.nbytes,
                data_offsets=(begin, end), crc32=value, fqn=meta.fqn, key=meta.key,
                global_shape=meta.global_shape, global_offset=meta.global_offset,
            ))
        return tuple(records)

    def result(self, manifest: RankManifest, data: FileRecord, raw: bytes) -> RankResult:
        """The finished rank: its manifest (``raw`` as written) and both files' records."""
        manifest_record = FileRecord(self.manifest_name, self.source.rank, len(raw), crc32(raw))
        return RankResult(manifest, (data, manifest_record))
