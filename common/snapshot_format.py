"""The on-disk format of a snapshot: names, the safetensors header, manifests and the index.

A complete snapshot of step N of a job is the directory ``<dir>/<job>/step-<N:012d>/``::

    rank-00000.safetensors      the rank's segment tensors, in segment order
    rank-00000.manifest.json    a RankManifest: per tensor fqn/key/dtype/shapes/crc32, ...
    ...                         (one pair per rank)
    snapshot.json               a SnapshotIndex, written last: ranks, files, their crc32s

On a multi-host job each host's directory holds its server's ranks. The safetensors header
depends only on the segment layout, so it is written before the data, streamed without gaps.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from .checksum import format_crc, parse_crc
from .dtypes import SAFETENSORS_DTYPES
from .names import snapshot_id_for, step_dir_name
from .snapshot_metadata import tensor_entry

__all__ = [
    "FORMAT_VERSION", "INDEX_NAME", "LAYOUT_NAME", "LATEST_NAME", "MANIFEST_FORMAT", "MANIFEST_VERSION", "INDEX_FORMAT",
    "TensorRecord", "RankManifest", "FileRecord", "SnapshotIndex", "step_dir_name", "partial_dir_name",
    "rank_data_name", "rank_manifest_name", "safetensors_header", "DATA_ALIGN", "checksum_block_bytes", "safetensors_metadata", "dumps_json"]

FORMAT_VERSION = 1
MANIFEST_VERSION = 2
"""Manifests written now: compact, the trainer's metadata rebuilt from their own fields
(:attr:`RankManifest.metadata_json`); version 1 (that text kept verbatim) is still read."""
READ_MANIFEST_VERSIONS = (1, MANIFEST_VERSION)
MANIFEST_FORMAT = "swap-state-rank-manifest"
INDEX_FORMAT = "swap-state-snapshot"
INDEX_NAME = "snapshot.json"
LAYOUT_NAME = "layout.json"
"""The step's layout index (the server's ``LayoutIndex``): where every rank's shards lie."""
MAX_LAYOUT_BYTES = 256 << 20
"""A bigger layout index is refused (far above any real job's: docs/benchmarks.md)."""
LATEST_NAME = "latest"


def partial_dir_name(step: int) -> str:
    return ".partial-" + step_dir_name(step)


def rank_data_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def rank_manifest_name(rank: int) -> str:
    return f"rank-{rank:05d}.manifest.json"


def dumps_json(value: Any) -> bytes:
    """Deterministic, standard JSON (no NaN/Infinity), newline-terminated."""
    return (json.dumps(value, indent=1, sort_keys=False, allow_nan=False) + "\n").encode()


def safetensors_metadata(job_id: str, step: int, rank: int, world_size: int) -> dict[str, str]:
    """The ``__metadata__`` of a rank file (safetensors allows string values only)."""
    return {"format": "pt", "swap_state.job_id": job_id, "swap_state.step": str(step),
            "swap_state.rank": str(rank), "swap_state.world_size": str(world_size)}


DATA_ALIGN = 4096
"""Where a rank file's data starts: a multiple of this (the header padded with spaces), for
O_DIRECT. Older files are padded to 8 only; readers take both (:meth:`RankManifest.header_bytes`)."""


def safetensors_header(tensors: Sequence[tuple[str, str, Sequence[int], int]], metadata: Mapping[str, str],
                       align: int = DATA_ALIGN) -> tuple[bytes, list[tuple[int, int]]]:
    """The bytes before the data (length + JSON padded so the data starts ``align``-aligned) and
    each tensor's ``data_offsets``, for ``(name, dtype, shape, nbytes)`` in file order.
    Deterministic: restore recomputes it from the manifest and compares byte for byte."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offsets: list[tuple[int, int]] = []
    position = 0
    for name, dtype, shape, nbytes in tensors:
        if name in header:
            raise ValueError(f"duplicate tensor name {name!r}")
        code = SAFETENSORS_DTYPES.get(dtype)
        if code is None:
            raise ValueError(f"dtype {dtype!r} of {name!r} has no safetensors code")
        offsets.append((position, position + nbytes))
        header[name] = {"dtype": code, "shape": [int(d) for d in shape], "data_offsets": list(offsets[-1])}
        position += nbytes
    if align % 8:
        raise ValueError(f"align must be a multiple of 8, got {align}")
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % align)
    return struct.pack("<Q", len(text)) + text, offsets


def _layout_record(raw: Any) -> FileRecord | None:
    if raw is None:
        return None
    raw = _object(raw, "layout entry")
    if (raw.get("name"), raw.get("rank")) != (LAYOUT_NAME, -1):
        raise ValueError(f"layout must be {LAYOUT_NAME} of rank -1")
    nbytes = _int(raw.get("bytes"), "bytes of layout")
    if nbytes > MAX_LAYOUT_BYTES:  # read whole by a restore: bounded before it is
        raise ValueError(f"{LAYOUT_NAME} of {nbytes} bytes is over {MAX_LAYOUT_BYTES}")
    return FileRecord(LAYOUT_NAME, -1, nbytes, parse_crc(raw.get("crc32")))


def _int(value: Any, what: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def _dims(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list of integers, got {value!r}")
    return tuple(_int(d, what) for d in value)


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, got {value!r}")
    return value


def _opt(parse: Any, value: Any, what: str) -> Any:
    return None if value is None else parse(value, what)


def _float(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object")
    return value


@dataclasses.dataclass(frozen=True)
class TensorRecord:
    """One tensor of a rank file, as its manifest records it."""

    name: str
    """The segment tensor name (also the tensor's name in the safetensors file)."""
    dtype: str
    """Segment dtype name (``float32``, ``bfloat16``, ...), see ``SAFETENSORS_DTYPES``."""
    shape: tuple[int, ...]
    """Local shape (the shard this rank holds)."""
    nbytes: int
    data_offsets: tuple[int, int]
    """[begin, end) within the safetensors data section."""
    crc32: int
    """zlib CRC-32 of the tensor's bytes."""
    # The trainer's facts, as in :class:`~.snapshot_metadata.TensorMetadata` (None: not given).
    fqn: str | None = None
    key: str | None = None
    global_shape: tuple[int, ...] | None = None
    global_offset: tuple[int, ...] | None = None
    block_bytes: int = 0
    """The size of the blocks :attr:`block_crcs` checks (:func:`checksum_block_bytes`); 0: the
    tensor is checked whole only (written before blocks, or a layout index's record)."""
    block_crcs: bytes = b""
    """Each block's crc32, little-endian uint32s: a byte range is read and checked without the rest."""

    def to_json(self) -> dict[str, Any]:
        blocks = {"block_bytes": self.block_bytes, "block_crcs": base64.b64encode(self.block_crcs).decode()} \
            if self.block_bytes else {}
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), **tensor_entry(self),
                "nbytes": self.nbytes, "data_offsets": list(self.data_offsets), "crc32": format_crc(self.crc32),
                **blocks}

    @property
    def block_size(self) -> int:
        """The bytes each checked block holds: the whole tensor when it has no blocks."""
        return self.block_bytes or max(self.nbytes, 1)

    def block_crc(self, index: int) -> int:
        """Block ``index``'s crc32 (of :attr:`block_size` bytes, the last block's fewer)."""
        return struct.unpack_from("<I", self.block_crcs, 4 * index)[0] if self.block_bytes else self.crc32

    @classmethod
    def from_json(cls, raw: Any) -> TensorRecord:
        raw = _object(raw, "tensor entry")
        name = _str(raw.get("name"), "tensor name")
        offsets = _dims(raw.get("data_offsets"), f"data_offsets of {name}")
        if len(offsets) != 2 or offsets[0] > offsets[1]:
            raise ValueError(f"data_offsets of {name} must be [begin, end]")
        dtype = _str(raw.get("dtype"), f"dtype of {name}")
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"dtype {dtype!r} of {name} is not supported")
        return cls(name=name, dtype=dtype, shape=_dims(raw.get("shape"), f"shape of {name}"),
                   nbytes=_int(raw.get("nbytes"), f"nbytes of {name}"), data_offsets=(offsets[0], offsets[1]),
                   crc32=parse_crc(raw.get("crc32")), fqn=_opt(_str, raw.get("fqn"), f"fqn of {name}"),
                   key=_opt(_str, raw.get("key"), f"key of {name}"),
                   global_shape=_opt(_dims, raw.get("global_shape"), f"global_shape of {name}"),
                   global_offset=_opt(_dims, raw.get("global_offset"), f"global_offset of {name}"),
                   **_block_crcs(raw, name))


MAX_TENSOR_BLOCKS = 64
"""A range read rounds out to blocks: at most 2 of 64 blocks more than it needs."""


def checksum_block_bytes(nbytes: int) -> int:
    """The block size a writer checksums a tensor of ``nbytes`` in: the least power-of-two
    multiple of 4 KiB (O_DIRECT's alignment) giving at most ``MAX_TENSOR_BLOCKS`` blocks. Small
    blocks make a range read exact (a reshard at 16,384 ranks reads shards of 8-64 KiB rows);
    the cap bounds a manifest (about 5.3 bytes of JSON a block) and the writer's work per block."""
    block = DATA_ALIGN
    while block * MAX_TENSOR_BLOCKS < nbytes:
        block *= 2
    return block


def _block_crcs(raw: dict[str, Any], name: str) -> dict[str, Any]:
    """A tensor entry's blocks, checked to tile its bytes; none in entries written before them."""
    if raw.get("block_bytes") is None:
        return {}
    block, nbytes = _int(raw["block_bytes"], f"block_bytes of {name}", 1), _int(raw.get("nbytes"), f"nbytes of {name}")
    if block % DATA_ALIGN:  # as written; a byte-sized block would make a reader crawl
        raise ValueError(f"block_bytes of {name} must be a multiple of {DATA_ALIGN}, got {block}")
    try:
        crcs = base64.b64decode(_str(raw.get("block_crcs"), f"block_crcs of {name}"), validate=True)
    except ValueError:
        raise ValueError(f"block_crcs of {name} is not base64") from None
    if len(crcs) != 4 * -(-nbytes // block):
        raise ValueError(f"block_crcs of {name} must hold one crc32 per {block}-byte block of its {nbytes} bytes")
    return {"block_bytes": block, "block_crcs": crcs}


_MANIFEST_HEAD: tuple[tuple[Any, ...], ...] = (
    ("job_id", _str), ("step", _int), ("rank", _int), ("world_size", _int, 1), ("data_file", _str),
    ("data_file_bytes", _int), ("data_start", _int, 8), ("chunk_bytes", _int))
"""(field, parser, minimum) of a manifest's plain fields before its tensors, each under its own key."""
_MANIFEST_TAIL: tuple[tuple[Any, ...], ...] = (
    ("param_groups", _object), ("steps", _object), ("cow_copies", _int), ("backpressure_waits", _int),
    ("backpressure_wait_seconds", _float), ("persist_seconds", _float))
"""The same, after its tensors."""


@dataclasses.dataclass(frozen=True)
class RankManifest:
    """``rank-XXXXX.manifest.json``: everything about one rank's file except the bytes."""

    job_id: str
    step: int
    """The committed step whose moments the file holds."""
    rank: int
    world_size: int
    """Number of ranks of the snapshot (and of the job when it was taken)."""
    data_file: str
    data_file_bytes: int
    data_start: int
    """Offset of the data section in the safetensors file (8 + header length)."""
    chunk_bytes: int
    """Snapshot granularity the segment used (informational)."""
    tensors: tuple[TensorRecord, ...]
    """The tensors in segment (= file) order."""
    param_groups: dict[str, Any]
    """Per fqn, the param-group hyperparameters from the trainer's metadata."""
    steps: dict[str, Any]
    """Per fqn, the optimizer step count from the trainer's metadata."""
    metadata_extra: dict[str, Any]
    """The trainer's metadata's other top-level entries (``model_aliases``, unknown keys)."""
    cow_copies: int
    """Chunks the trainer copied before writing while this rank persisted."""
    backpressure_waits: int
    """Times the trainer waited for a free copy slot while this rank persisted."""
    backpressure_wait_seconds: float
    """Seconds the trainer spent in those waits."""
    persist_seconds: float
    """Wall time from consistent to this rank's data being durable."""
    verbatim_metadata_json: str | None = None
    """A version 1 manifest's metadata text, as the trainer sent it (None: rebuilt)."""

    @property
    def snapshot_id(self) -> str:
        return snapshot_id_for(self.job_id, self.step)

    @functools.cached_property
    def metadata_json(self) -> str:
        """The trainer's metadata of this rank (Restore returns it), rebuilt from the manifest's
        fields on first use (a reshard reads a thousand manifests and needs few of these)."""
        if self.verbatim_metadata_json is not None:
            return self.verbatim_metadata_json
        tensors = {t.name: entry for t in self.tensors if (entry := tensor_entry(t))}
        return json.dumps({"tensors": tensors, **self.metadata_fields()}, allow_nan=False)

    def metadata_fields(self) -> dict[str, Any]:
        """The trainer's metadata but its tensors, from the fields parsed with the manifest (a
        version 1 manifest's text parsed here): a reshard merges them, never their text."""
        if self.verbatim_metadata_json is not None:
            raw = json.loads(self.verbatim_metadata_json) if self.verbatim_metadata_json.strip() else {}
            return {key: value for key, value in raw.items() if key != "tensors"}
        return {"steps": self.steps, "param_groups": self.param_groups, **self.metadata_extra}

    def to_json(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "snapshot_id": self.snapshot_id,
            **{name: getattr(self, name) for name, *_ in _MANIFEST_HEAD},
            "checksum": "crc32", "tensors": [t.to_json() for t in self.tensors],
            **{name: getattr(self, name) for name, *_ in _MANIFEST_TAIL},
            "metadata_extra": self.metadata_extra}

    def to_bytes(self) -> bytes:
        """The manifest file: compact JSON (it is read by machines, a thousand at a time)."""
        return (json.dumps(self.to_json(), separators=(",", ":"), allow_nan=False) + "\n").encode()

    @classmethod
    def from_json(cls, raw: Any) -> RankManifest:
        raw = _object(raw, "manifest")
        version = raw.get("version")
        if raw.get("format") != MANIFEST_FORMAT or version not in READ_MANIFEST_VERSIONS:
            raise ValueError(f"not a {MANIFEST_FORMAT} of version {' or '.join(map(str, READ_MANIFEST_VERSIONS))}")
        tensors = raw.get("tensors")
        if not isinstance(tensors, list):
            raise ValueError("tensors must be a list")
        fields = {name: parse(raw.get(name), name, *minimum)
                  for name, parse, *minimum in _MANIFEST_HEAD + _MANIFEST_TAIL}
        return cls(**fields, tensors=tuple(TensorRecord.from_json(t) for t in tensors),
                   metadata_extra=_object(raw.get("metadata_extra"), "metadata_extra") if version != 1 else {},
                   verbatim_metadata_json=_str(raw.get("metadata_json"), "metadata_json") if version == 1 else None)

    def header_bytes(self) -> bytes:
        """The safetensors header this manifest implies (restore compares it to the file)."""
        # An 8-aligned header that happens to end on DATA_ALIGN is the same bytes either way.
        header, _ = safetensors_header([(t.name, t.dtype, t.shape, t.nbytes) for t in self.tensors],
                                       safetensors_metadata(self.job_id, self.step, self.rank, self.world_size),
                                       align=DATA_ALIGN if self.data_start % DATA_ALIGN == 0 else 8)
        return header


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """One file of a snapshot as ``snapshot.json`` lists it."""

    name: str
    """File name relative to the snapshot directory."""
    rank: int
    bytes: int
    crc32: int
    """zlib CRC-32 of the whole file."""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "rank": self.rank, "bytes": self.bytes, "crc32": format_crc(self.crc32)}

    @classmethod
    def from_json(cls, raw: Any) -> FileRecord:
        raw = _object(raw, "file entry")
        name = _str(raw.get("name"), "file name")
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"file name {name!r} is not a plain name")
        return cls(name=name, rank=_int(raw.get("rank"), f"rank of {name}"),
                   bytes=_int(raw.get("bytes"), f"bytes of {name}"), crc32=parse_crc(raw.get("crc32")))


@dataclasses.dataclass(frozen=True)
class SnapshotIndex:
    """``snapshot.json``: written last; its presence marks a snapshot complete."""

    job_id: str
    step: int
    world_size: int
    """The job's (global) number of ranks."""
    ranks: tuple[int, ...]
    """The ranks whose files this directory holds, ascending (on a multi-host job, this host's)."""
    files: tuple[FileRecord, ...]
    """Every data file and manifest, with size and checksum."""
    created_unix: float
    """Wall-clock time of the commit (informational)."""
    attempt: int = 1
    """How many times this host committed the step (trained again after a load: 2, 3, ...); the
    store's markers of one step must agree on it."""
    layout: FileRecord | None = None
    """``layout.json`` (rank -1) beside a whole job's files, for a restore at another layout; None
    on one host of several (the store's index has it) and in older snapshots."""
    tenant: str = ""
    """The tenant that owns the job (``--tenants``; "" without tenants)."""

    @property
    def snapshot_id(self) -> str:
        return snapshot_id_for(self.job_id, self.step)

    @property
    def local_world_size(self) -> int:
        return len(self.ranks)

    @property
    def complete_job(self) -> bool:
        return len(self.ranks) == self.world_size

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    @classmethod
    def parse(cls, raw: bytes, job_id: str, step: int) -> SnapshotIndex | None:
        """The index in ``raw`` when it is valid and names ``job_id`` and ``step``, else None."""
        try:
            index = cls.from_json(json.loads(raw))
        except ValueError:
            return None
        return index if (index.job_id, index.step) == (job_id, step) else None

    def file(self, name: str) -> FileRecord | None:
        return next((record for record in self.files if record.name == name), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": INDEX_FORMAT, "version": FORMAT_VERSION, "snapshot_id": self.snapshot_id,
            "job_id": self.job_id, "step": self.step, "world_size": self.world_size,
            "local_world_size": self.local_world_size, "ranks": list(self.ranks),
            "created_unix": self.created_unix, "attempt": self.attempt, "files": [f.to_json() for f in self.files],
            **({"layout": self.layout.to_json()} if self.layout is not None else {}),
            **({"tenant": self.tenant} if self.tenant else {})}

    @classmethod
    def from_json(cls, raw: Any) -> SnapshotIndex:
        raw = _object(raw, "snapshot index")
        if raw.get("format") != INDEX_FORMAT or raw.get("version") != FORMAT_VERSION:
            raise ValueError(f"not a {INDEX_FORMAT} of version {FORMAT_VERSION}")
        world_size = _int(raw.get("world_size"), "world_size", 1)
        ranks = _dims(raw.get("ranks"), "ranks")
        if not ranks or list(ranks) != sorted(set(ranks)) or ranks[-1] >= world_size:
            raise ValueError(f"ranks {list(ranks)[:16]} are not distinct ascending ranks of 0..{world_size - 1}")
        local = raw.get("local_world_size", len(ranks))
        if _int(local, "local_world_size", 1) != len(ranks):
            raise ValueError(f"local_world_size {local} is not the number of ranks {len(ranks)}")
        files = raw.get("files")
        if not isinstance(files, list):
            raise ValueError("files must be a list")
        records = tuple(FileRecord.from_json(f) for f in files)
        present = set(ranks)
        if stray := next((record for record in records if record.rank not in present), None):
            raise ValueError(f"file {stray.name} belongs to rank {stray.rank}, not in ranks")
        return cls(_str(raw.get("job_id"), "job_id"), _int(raw.get("step"), "step"), world_size, ranks, records,
                   _float(raw.get("created_unix"), "created_unix"),
                   attempt=_int(raw.get("attempt", 1), "attempt", 1),  # absent before the store tier
                   layout=_layout_record(raw.get("layout")),
                   tenant=_str(raw.get("tenant", ""), "tenant"))  # absent before tenants
